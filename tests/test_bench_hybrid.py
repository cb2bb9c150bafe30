"""benchmarks/hybrid.py at toy sizes in this process (world 1): its rows, with and without the
unpatched baseline (``--skip-base``), and the JSON it writes."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.parametrize("skip", [False, True])
def test_hybrid_benchmark_rows(tmp_path, skip):
    from benchmarks import hybrid

    out = tmp_path / "h.json"
    argv = ["--seq", "24", "--hidden", "64", "--vocab", "128", "--heads", "2", "--iters", "1"]
    threads = torch.get_num_threads()
    try:
        assert hybrid.main(argv + ["--json", str(out)] + (["--skip-base"] if skip else [])) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["seq"], r["world"]) for r in rows] == [("fwd", 24, 1), ("fwdbwd", 24, 1)]
    for r in rows:
        assert r["patched_s"] > 0 and r["sp1_s"] > 0 and r["ratio_sp1"] > 0
        assert (r["base_s"] is None and r["ratio"] is None) == skip
        assert r["state"] == r["heads"] == r["halo"] == 0  # one rank sends nothing
