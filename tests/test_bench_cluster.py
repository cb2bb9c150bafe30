"""Smoke test: benchmarks/cluster.py starts a front with two instances of a tiny random model,
drives it and writes the JSON and the plot it promises; the front and its instances are gone
afterwards. The kv setup runs with the host tier and peer pull (today's defaults), kv-old
without them (--kv-host-memory 0 --no-kv-pull): the instances' /metrics show the difference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_machine import assert_names_machine

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_cluster_benchmark_prefix(tmp_path, bench_cache):
    out, plot = tmp_path / "cluster.json", tmp_path / "cluster.png"
    env = dict(os.environ, RINGKV_CACHE=bench_cache, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/cluster.py",
            "--scenario",
            "prefix",
            "--setups",
            "kv",
            "kv-old",
            "--cache-fraction",
            "0.5",
            "--model",
            "tiny-test",
            "--prefixes",
            "2",
            "--per-prefix",
            "3",
            "--prefix-tokens",
            "48",
            "--suffix-tokens",
            "4",
            "--prefix-max-tokens",
            "4",
            "--prefix-rate",
            "8",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| kv | 2 | 6 / 6 |" in proc.stdout and "load averages" in proc.stdout
    assert "| kv-old | 2 | 6 / 6 |" in proc.stdout
    assert plot.stat().st_size > 0
    res = json.loads(out.read_text())
    assert_names_machine(res, proc.stdout, threads=1)  # every instance: OMP_NUM_THREADS=1
    d = res["scenarios"]["prefix"]
    row, old = d["rows"]
    assert (row["name"], old["name"]) == ("kv", "kv-old") and d["sizes"]["cache_fraction"] == 0.5
    assert d["sizes"]["cache_prefixes"] == 1  # half of the 2 prefixes
    assert "kv throughput >= 1.3x kv-old" in d["goals"]
    for r in (row, old):  # each instance's own /metrics were read
        assert sorted(r["tier_blocks"]) == ["r0", "r1"], r["tier_blocks"]
        assert set(r["pull_decisions"]) == {"pull", "recompute", "failed"}
        assert r["pulled_tokens"] >= 0 and r["lost"] == 0
    assert all("host" in t for t in row["tier_blocks"].values())  # the host tier: on by default
    assert not any("host" in t for t in old["tier_blocks"].values())  # --kv-host-memory 0
    assert old["pull_hints"] == {} and sum(old["pull_decisions"].values()) == 0  # --no-kv-pull
    for r in (row, old):  # the router's index: cached blocks per instance and tier
        assert sorted(r["index_tier_blocks"]) == ["r0", "r1"], r["index_tier_blocks"]
        assert sum(t.get("device", 0) for t in r["index_tier_blocks"].values()) > 0
    assert row["lost"] == 0 and row["replicas"] == 2 and len(row["instances"]) == 2
    assert (
        row["prompt_tokens"] > 0
        and row["cached_tokens"] is not None
        and row["router_problems"] == []
    )
    recs = d["records"]["kv"]
    assert all(r["ok"] and r["instance"] in ("r0", "r1") and r["ttft"] > 0 for r in recs)
    for inst in row["instances"]:  # stopped with the front
        assert (
            not os.path.exists(f"/proc/{inst['pid']}")
            or open(f"/proc/{inst['pid']}/stat").read().split()[2] == "Z"
        )
