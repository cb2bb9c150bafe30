"""Smoke test: benchmarks/hosts_serve.py on two real hosts at its smallest size (a tiny random
model, a 512-token context over a 2 Mbit/s and the unshaped link, a 2048-token one too long for
the transfer budget at 2 Mbit/s): every measured row moved the request's K/V over the link and
gave A's tokens on B (the benchmark checks), and the JSON's fields are sane."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_machine import assert_names_machine
from tests.hosts import missing

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]


def test_hosts_serve_benchmark(tmp_path, bench_cache):
    out = tmp_path / "hosts_serve.json"
    env = dict(os.environ, RINGKV_CACHE=bench_cache)
    # 2048 tokens x 512 bytes, twice, at 2 Mbit/s: 8.4 s > --max-transfer-s: skipped
    args = ["--model", "tiny-test", "--rates", "2mbit,none", "--contexts", "512", "2048"]
    args += ["--max-transfer-s", "5", "--json", str(out), "--out", str(tmp_path / "logs")]
    args += ["--port", "29681"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/hosts_serve.py", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert_names_machine(res, proc.stdout, threads=1)
    bpt = res["bytes_per_token"]
    assert bpt == 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
    rows = {(r["context"], r["rate"]): r for r in res["rows"]}
    assert list(rows) == [(512, "2mbit"), (512, "none"), (2048, "2mbit"), (2048, "none")]
    assert rows[2048, "2mbit"].get("skipped") is True
    assert not rows[2048, "none"].get("skipped")
    for key, r in rows.items():
        if r.get("skipped"):
            continue
        n = key[0]
        # the whole context's K/V moved (and the few decoded tokens), in the full move and in
        # the pre-copy; the final snapshot holds only what is new since the pre-copy
        for field in ("full_bytes", "pre_copy_bytes"):
            assert n * bpt <= r[field] <= (n + 64) * bpt + 65536, (key, field, r[field])
        assert 0 < r["final_bytes"] <= 16 * bpt + 65536 < r["full_bytes"], r
        for field in ("full_move_s", "full_downtime_s", "incremental_downtime_s", "step_s"):
            assert 0 < r[field] < 60, (key, field, r[field])
        assert r["full_downtime_s"] >= r["step_s"] * 0.5, r
        if key[1] == "2mbit":  # the link sets the pace (less tbf's 64 KiB bucket: 0.26 s)
            assert r["expected_s"] == pytest.approx(r["full_bytes"] * 8 / 2e6)
            assert r["full_move_s"] >= 0.8 * r["expected_s"] - 0.3, r
            assert 0 < r["moved_bits_per_s"] <= 1.4 * 2e6, r
        else:
            assert r["expected_s"] is None
    assert "| 2mbit | 512 |" in proc.stdout and "skipped" in proc.stdout and "Mbit/s" in proc.stdout
