"""Smoke test: the long-context benchmark under real torchrun (2 gloo ranks) at a tiny size."""

import json
import os
import subprocess
import sys

import pytest

from tests.bench_machine import assert_names_machine
from tests.bench_runs import Runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# The torchrun runs of this module, by the test that checks it ({d}: the module's output folder).
# Each is a launcher and 2 ranks whose start-ups, rendezvous and rank-0-only parts (baseline,
# check, plot) leave a core idle: started all at once (on the first test's call), the module takes
# the time of its longest run, not the sum.
RUNS = {
    "long_ctx": [
        *TORCHRUN,
        os.path.join(ROOT, "benchmarks", "long_ctx.py"),
        "--seq",
        "512",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--layout",
        "all",
        "--backward",
        "--check",
        "--quiet",
        "--json",
        "{d}/r.json",
        "--plot",
        "{d}/r.png",
    ],
    "peer": [
        *TORCHRUN,
        os.path.join(ROOT, "benchmarks", "long_ctx.py"),
        "--seq",
        "512",
        "--heads",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--iters",
        "2",
        "--layout",
        "zigzag,striped",
        "--backward",
        "--check",
        "--quiet",
        "--no-baseline",
        "--no-overlap",
        "--peer",
        "torch",
        "--json",
        "{d}/p.json",
    ],
    "profile": [
        *TORCHRUN,
        os.path.join(ROOT, "benchmarks", "ring_profile.py"),
        "--seq",
        "512",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--iters",
        "1",
        "--backward",
        "--json",
        "{d}/prof.json",
    ],
    "methods": [
        *TORCHRUN,
        os.path.join(ROOT, "benchmarks", "long_ctx.py"),
        "--method",
        "all",
        "--seq",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2,1",
        "--head-dim",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--backward",
        "--check",
        "--quiet",
        "--json",
        "{d}/m.json",
    ],
}


@pytest.fixture(scope="module")
def torchruns(tmp_path_factory):
    """``torchruns(name)``: the stdout of ``RUNS[name]`` and the folder its files are in. Every
    run starts on the first call; a test waits for its own."""
    d = tmp_path_factory.mktemp("long-ctx")
    state = {}

    def get(name):
        if not state:
            state["runs"] = runs = Runs({**os.environ, "OMP_NUM_THREADS": "1"})
            for n, args in RUNS.items():
                runs.start(n, [[a.format(d=d) for a in args]])
        (stdout,) = state["runs"].stdouts(name)
        return stdout, d

    yield get
    if state:
        state["runs"].close()


@pytest.mark.slow
def test_long_ctx_under_torchrun(torchruns):
    stdout, d = torchruns("long_ctx")
    assert "check: passed" in stdout
    res = json.loads((d / "r.json").read_text())
    assert res["environment"]["world_size"] == 2 and res["environment"]["comm"] == "gloo"
    m = assert_names_machine(res, stdout, threads=res["environment"]["threads_per_rank"])
    assert res["environment"]["device"] == m["cpu"]
    assert [(r["layout"], r["causal"]) for r in res["rows"]] == [
        (lay, True) for lay in ("contiguous", "zigzag", "striped")
    ]
    for row in res["rows"]:
        assert row["time_s"] > 0 and row["time_nocomm_s"] > 0 and row["baseline_s"] > 0
        assert row["efficiency"] > 0 and row["overlap_ratio"] > 0  # tiny sizes: latency dominates
        assert row["tflops_per_rank"] > 0 and row["peak_mem_bytes"] > 0
        assert row["check_max_err"] < 1e-4
        # K and V of 256 tokens, 1 kv head, dim 16, fp32; backward adds K/V and fp32 dK/dV
        assert row["bytes_per_step"] == 2 * 256 * 16 * 4 + 2 * 256 * 16 * 8
    # striped, 2 ranks of 256 tokens: rank 1 sees its own and rank 0's tokens up to itself
    assert row["pairs_per_rank"] == 2 * (256 * 257 // 2)
    assert (d / "r.png").stat().st_size > 1000


@pytest.mark.slow
def test_torch_ring_as_peer(torchruns):
    """--peer torch: PyTorch's own ring on the same shards, interleaved with ringkv's, its output
    checked against the reference and its gradients against ringkv's; where torch has no
    counterpart (striped causal) the row says why instead."""
    stdout, d = torchruns("peer")
    assert "check: passed" in stdout and "vs peer" in stdout
    zigzag, striped = json.loads((d / "p.json").read_text())["rows"]
    assert (
        zigzag["peer_time_s"] > 0 and zigzag["vs_peer"] == zigzag["time_s"] / zigzag["peer_time_s"]
    )
    assert zigzag["peer_check_max_err"] < 1e-4 and zigzag["peer_grad_max_diff"] < 1e-4
    assert "peer_time_s" not in striped and "striped" in striped["peer_unavailable"]


@pytest.mark.slow
def test_ring_profile_under_torchrun(torchruns):
    """benchmarks/ring_profile.py: per-step parts of a ring backward on 2 ranks; the parts it
    times add up to no more than the call."""
    stdout, d = torchruns("profile")
    res = json.loads((d / "prof.json").read_text())
    assert_names_machine(res, stdout, threads=1)  # 2 ranks on OMP_NUM_THREADS=1
    for rank in res["ranks"]:
        assert [r["step"] for r in rank["rows"]][-2:] == [0, 1]  # 2 ranks: 2 ring steps
        assert all(r["kernel"] > 0 for r in rank["rows"] if r["step"] >= 0) and rank["other_s"] >= 0


def test_virtual_ranks_single_process(tmp_path):
    out = tmp_path / "v.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "long_ctx.py"),
        "--virtual",
        "4",
        "--seq",
        "256",
        "--head-dim",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--layout",
        "zigzag",
        "--causal",
        "--quiet",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    # zigzag, 4 ranks of 64 tokens: a causal 64x64 block, then 3 steps of two full 32x32 chunk
    # pairs;
    # every rank does the same work and the ranks together cover all 256*257/2 visible pairs
    assert row["pairs_per_rank"] == 64 * 65 // 2 + 3 * 2 * 32 * 32 == 256 * 257 // 2 // 4
    assert row["efficiency"] > 0


@pytest.mark.slow
def test_methods_side_by_side_under_torchrun(torchruns):
    """--method all: every method on the same inputs, checked against the reference, per KV head
    count."""
    stdout, d = torchruns("methods")
    assert "check: passed" in stdout
    rows = json.loads((d / "m.json").read_text())["rows"]
    assert [(r["method"], r["kv_heads"]) for r in rows] == [
        (m, kv) for kv in (2, 1) for m in ("ring", "ulysses", "usp", "allgather")
    ]
    for r in rows:
        assert (
            r["check_max_err"] < 1e-4
            and r["time_s"] > 0
            and r["time_nocomm_s"] > 0
            and r["efficiency"] > 0
        )
        kv_bytes = 2 * 256 * r["kv_heads"] * 16 * 4  # K and V of one rank's 256 tokens, fp32
        if r["method"] in (
            "ring",
            "allgather",
            "usp",
        ):  # one other rank gets this rank's K/V once (usp: 1 x 2)
            assert r["bytes_sent"] == kv_bytes
        else:  # 2 ranks: half of this rank's q (4 heads), K/V heads and out go to the other rank
            kv_sent = (
                kv_bytes // 2 if r["kv_heads"] == 2 else kv_bytes
            )  # 1 KV head: replicated to both
            assert r["bytes_sent"] == 256 * 2 * 16 * 4 * 2 + kv_sent
