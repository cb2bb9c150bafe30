"""Smoke test: benchmarks/tiers.py on a tiny random model and short prefixes measures every path
(recompute, pull, host, disk), writes the JSON it promises, and the promoted and pulled requests
reuse every whole block of the prompt and give the cold run's token."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench_machine import assert_names_machine

ROOT = Path(__file__).resolve().parents[1]


def test_tiers_benchmark(tmp_path, bench_cache):
    out, disk = tmp_path / "tiers.json", tmp_path / "disk"
    disk.mkdir()
    env = dict(os.environ, RINGKV_CACHE=bench_cache)
    args = ["--model", "tiny-test", "--prefix-tokens", "48", "96", "--suffix-tokens", "8"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/tiers.py", *args, "--reps", "2", "--threads", "1"]
        + ["--disk-dir", str(disk), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert_names_machine(res, proc.stdout, threads=1)
    assert [s["prefix_tokens"] for s in res["sizes"]] == [48, 96]
    for size in res["sizes"]:
        expected = (size["prompt_tokens"] - 1) // 16 * 16  # whole blocks but the last token
        assert size["prompt_tokens"] == size["prefix_tokens"] + 8 and size["expected_cached"] == (
            expected
        )
        rows = size["rows"]
        assert set(rows) == {"recompute", "pull", "host", "disk"}
        assert rows["recompute"]["cached_tokens"] == [0, 0] and rows["recompute"]["ratio"] == 1
        for path in ("pull", "host", "disk"):
            r = rows[path]
            assert r["cached_tokens"] == [expected, expected], (path, r)
            assert r["same_token"] is True, (path, r["samples"])
            assert 0 < r["min"] <= r["p50"] <= r["max"] and r["ratio"] > 0
            assert r["bytes_moved"] > 0
        pulls = rows["pull"]["samples"]
        bpt = size["cost_model"]["bytes_per_token"]
        # tiny-test: 2 layers x 2 KV heads x 16 dims x K and V x float32 = 512 bytes per token
        assert bpt == 512 and all(s["imported"] >= expected for s in pulls)
        assert all(s["prefix_bytes"] == s["prefix_tokens"] * bpt for s in pulls)
        assert size["cost_model"]["link_bytes_s"] > 0
        assert size["cost_model"]["prefill_tokens_s"] > 0
        assert all(s["disk_bytes"] > 0 for s in rows["disk"]["samples"])  # it read real files
        assert len(size["load_after"]) == 3
    assert len(res["goals"]) == 1 and "load averages" in proc.stdout
