"""Smoke test: benchmarks/train_memory.py runs under torchrun (2 ranks, tiny random model) in both
modes and writes the tables and JSON it promises: every configuration's rows, the fits, the
skipped points with their reasons, and ``--summarize`` over the two JSON files. Memory numbers
are checked only for structure and the properties that hold at any size (linear in S/N, the
chunked loss builds no logits); timings are never asserted."""

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
BENCH = "benchmarks/train_memory.py"


def _env(cache):
    """The runs' environment: ``cache`` is the session's benchmark cache (conftest's
    ``bench_cache``), whose compiled C kernels are linked from the suite's: a cache of its own made
    each rank compile them again."""
    return dict(os.environ, RINGKV_CACHE=cache, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _torchrun(cache, *args):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        BENCH,
        "--model",
        "tiny-test",
        "--warmup",
        "32",
        "--calib",
        "16",
        *args,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(cache)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_memory_benchmark(tmp_path, bench_cache):
    mem, tput = tmp_path / "memory.json", tmp_path / "throughput.json"
    # --limit cuts chunked at 64 tokens per rank: a skipped point with its reason
    out = _torchrun(
        bench_cache, "--per-rank", "64", "128", "256", "--limit", "chunked=64", "--json", str(mem)
    )
    assert (
        "| logits | 2 | 512 | 256 |" in out
        and "linear fit" in out
        and "longest S/N in 8 GiB" in out
    ), out
    assert "skipped: chunked at S/N 128 (S 256): --limit chunked=64" in out, out
    d = json.loads(mem.read_text())
    assert (
        d["mode"] == "memory"
        and d["world"] == 2
        and d["load"]
        and d["load_end"]
        and d["vocab"] == 1024
    )
    assert_names_machine(d, out, threads=1)
    assert not d["not_available"], d["not_available"]  # this ringkv has every option
    rows = {(r["config"], r["tokens_per_rank"]): r for r in d["rows"]}
    want = {
        (c, x)
        for c in ("unpatched", "logits", "chunked+ckpt", "chunked+ckpt+tiled")
        for x in (64, 128, 256)
    }
    assert set(rows) == want | {("chunked", 64)}, sorted(rows)
    assert [(s["config"], s["tokens_per_rank"]) for s in d["skipped"]] == [
        ("chunked", 128),
        ("chunked", 256),
    ]
    for (cfg, x), r in rows.items():
        assert r["alloc"] > 0 and len(r["alloc_per_rank"]) == (1 if cfg == "unpatched" else 2), r
        assert r["seq"] == (x if cfg == "unpatched" else 2 * x) and r["ranks"] == (
            1 if cfg == "unpatched" else 2
        )
    assert len(d["calibration"]) == 2 * 5  # two small profiled steps per configuration
    # the logits exist only where they are asked for
    assert d["logits_built"] == {
        "unpatched": True,
        "logits": True,
        "chunked": False,
        "chunked+ckpt": False,
        "chunked+ckpt+tiled": False,
    }, d["logits_built"]
    for cfg in ("unpatched", "logits", "chunked+ckpt", "chunked+ckpt+tiled"):
        f = d["fits"][cfg]
        assert f["points"] == 3 and f["b"] > 0 and f["worst"] < 0.1 and f["per_rank"] > 0, (cfg, f)
        assert f["per_rank_adamw"] <= f["per_rank"]
        # linear in S/N: doubling the tokens per rank nearly doubles the step's peak
        assert 1.6 < rows[(cfg, 256)]["alloc"] / rows[(cfg, 128)]["alloc"] < 2.1, cfg
    assert "chunked" not in d["fits"]  # one point: no fit
    # the chunked loss with checkpointing keeps less than the logits
    assert rows[("chunked+ckpt", 256)]["alloc"] < rows[("logits", 256)]["alloc"]

    out = _torchrun(
        bench_cache,
        "--throughput",
        "--seq",
        "256",
        "--iters",
        "1",
        "--configs",
        "unpatched",
        "chunked+ckpt",
        "--json",
        str(tput),
    )
    assert (
        "| unpatched | 1 x 2 | 256 | 256 |" in out and "| chunked+ckpt | 2 x 1 | 256 | 128 |" in out
    ), out
    t = json.loads(tput.read_text())
    assert t["mode"] == "throughput" and [r["config"] for r in t["rows"]] == [
        "unpatched",
        "chunked+ckpt",
    ]
    assert_names_machine(t, out, threads=[1, 2])
    for r in t["rows"]:
        assert r["tokens_per_s"] > 0 and len(r["times"]) == 1 and r["seconds"] > 0, r

    proc = subprocess.run(
        [sys.executable, BENCH, "--summarize", str(mem), str(tput)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=_env(bench_cache),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = proc.stdout
    assert "| tiny-test | 2 | 1024 |" in s and "peak at S/N 8192: chunked+ckpt" in s, s
    assert "longest S/N in 8 GiB per rank: chunked+ckpt" in s and "time per token" in s, s
