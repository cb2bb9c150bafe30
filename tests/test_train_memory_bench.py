"""Smoke test: benchmarks/train_memory.py runs under torchrun (2 ranks, tiny random model) and
writes the table and JSON it promises, with memory that grows linearly in S/N."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_machine import assert_names_machine

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_train_memory_benchmark(tmp_path):
    out = tmp_path / "train_memory.json"
    env = dict(os.environ, RINGKV_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "benchmarks/train_memory.py", "--model", "tiny-test", "--seq", "128", "256", "512", "--warmup", "32",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| patched | 2 | off | 512 | 256 |" in proc.stdout and "linear fit" in proc.stdout, proc.stdout
    d = json.loads(out.read_text())
    assert d["world"] == 2 and d["load"]
    assert_names_machine(d, proc.stdout, threads=1)
    rows = {(r["run"], r["checkpointing"], r["seq"]): r for r in d["rows"]}
    assert len(rows) == 12  # patched and unpatched, checkpointing off and on, 3 lengths
    for (run, ckpt, seq), r in rows.items():
        assert r["alloc"] > 0 and len(r["alloc_per_rank"]) == (2 if run == "patched" else 1)
        assert r["tokens_per_rank"] == (seq // 2 if run == "patched" else seq)
    for ckpt in (False, True):
        # linear in S/N: doubling the length doubles the activation memory (within the constant term)
        a, b = rows[("patched", ckpt, 256)]["alloc"], rows[("patched", ckpt, 512)]["alloc"]
        assert 1.8 < b / a < 2.1, (ckpt, a, b)
        # memory depends on S/N: 2 ranks at S use what one unpatched process uses at S/2 (within 5%)
        one = rows[("unpatched", ckpt, 256)]["alloc"]
        assert abs(b - one) <= 0.05 * one, (ckpt, b, one)
        assert d["fits"][f"patched/{'ckpt' if ckpt else 'no-ckpt'}"]["worst"] < 0.05
    # checkpointing keeps less
    assert rows[("patched", True, 512)]["alloc"] < rows[("patched", False, 512)]["alloc"]
