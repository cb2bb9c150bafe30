"""Smoke test: benchmarks/hosts_ring.py across two real hosts (network namespaces) at a tiny
size: the ring's forward + backward on a 30 Mbit/s link (no unshaped runs: one launch), float32 and
``grad_comm_dtype="auto"`` dK/dV interleaved; "auto" picks bf16 on every rank of the slow link."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench_machine import assert_names_machine
from tests.hosts import missing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hosts_ring_auto_sends_bf16_on_a_slow_link(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hosts_ring.py"), "--seq", "1024"]
    cmd += ["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--rates", "30mbit"]
    cmd += ["--passes", "bwd", "--grad-comm-dtype", "fp32,auto", "--iters", "1", "--no-baseline"]
    cmd += ["--port", "29681", "--timeout", "120", "--out", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| 30mbit | bwd |" in p.stdout and "| 30mbit | auto |" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert_names_machine(res, p.stdout, threads=1)
    (row,) = res["rows"]
    assert row["rate"] == "30mbit" and row["pass_"] == "bwd"
    assert 0 < row["overlap"] and row["time_s"] > 0 and row["nocomm_s"] > 0
    assert [r["rate"] for r in res["runs"]] == ["30mbit"]
    fp32, auto = row["by_grad_comm"]["fp32"], row["by_grad_comm"]["auto"]
    assert fp32["dkv_dtype"] == "float32" and fp32["ratio"] is None
    # 32 KiB of K/V per hop take ~9 ms at 30 Mbit/s: far more than these blocks' compute
    assert auto["dkv_dtype"] == "bfloat16" and auto["ratio"] > 1
    assert fp32["same_on_every_rank"] and auto["same_on_every_rank"]
