"""Smoke test: benchmarks/kernel_backends.py runs (tiny sizes) and writes the JSON it promises."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.bench_machine import assert_names_machine

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_benchmark_quick_json(tmp_path):
    out = tmp_path / "kernels.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "kernel_backends.py"),
        "--quick",
        "--device",
        "cpu",
        "--seqlens",
        "64",
        "--head-dims",
        "16",
        "--heads",
        "2",
        "--cache-lens",
        "40",
        "--seqs",
        "2",
        "--copy-mib",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"device", "dtype", "torch", "copy_gbps", "attention", "paged"} <= res.keys()
    assert res["device"] == "cpu" and res["copy_gbps"] > 0
    rows = res["attention"]
    assert {r["impl"] for r in rows} >= {"reference", "sdpa"}  # every usable registry backend
    assert {(r["causal"], r["mode"]) for r in rows} == {
        (c, m) for c in (False, True) for m in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["seqlen"] == 64 and "error" not in r, r
    paged = res["paged"]
    assert [r["impl"] for r in paged][:1] == ["reference"]
    for r in paged:
        assert (
            r["cache_len"] == 40 and r["ms"] > 0 and r["gbps"] > 0 and r["fraction_of_copy"] > 0
        ), r
    assert "TFLOP/s" in proc.stdout and "GB/s" in proc.stdout
    m = assert_names_machine(res, proc.stdout)
    assert res["threads"] == m["threads"] and res["device_name"] == m["cpu"]


def test_flops_count_only_visible_pairs():
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "benchmarks" / "kernel_backends.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from ringkv.kernels import make_mask

    for sq, sk, q_pos, k_pos in [
        (8, 8, None, None),
        (4, 10, None, None),
        (6, 6, range(0, 6), range(3, 9)),
        (5, 7, range(0, 10, 2), range(0, 7)),
        (3, 4, range(100, 103), range(0, 4)),
    ]:
        for causal in (False, True):
            mask = make_mask(causal, q_pos, k_pos, sq, sk)
            assert bench.visible_pairs(mask, sq, sk) == int(mask.visible(sq, sk).sum()), (
                sq,
                sk,
                q_pos,
                k_pos,
            )
    assert bench.visible_pairs(make_mask(True, None, None, 8, 8), 8, 8) == 8 * 9 // 2
