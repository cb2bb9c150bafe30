"""Smoke tests: the parallel-engine benchmarks run (tiny random model) and write the JSON they promise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import needs_smollm2

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(args, cache):
    return run_side_by_side([args], cache)[0]


def run_side_by_side(arg_lists, cache):
    """The benchmark runs at once (each is mostly start-ups of single-threaded processes); their stdouts."""
    env = dict(os.environ, RINGKV_CACHE=cache, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env) for args in arg_lists]
    try:
        outs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, stderr) in zip(procs, outs):
        assert proc.returncode == 0, stderr[-3000:]
    return [stdout for stdout, _ in outs]


@pytest.fixture(scope="module")
def tiny_test(bench_cache):
    """The cache with the ``tiny-test`` random model written, before runs side by side need it
    (each would write it when missing, and one could remove the other's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "benchmarks" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGKV_CACHE", bench_cache)
        models.model_path("tiny-test")
    return bench_cache


def test_engine_benchmark_parallel_mode(tmp_path, bench_cache):
    out = tmp_path / "engine.json"
    table = run(["benchmarks/engine.py", "--pp", "2", "--model", "tiny-test", "--requests", "3", "--max-tokens", "4",
                 "--min-prompt", "4", "--max-prompt", "30", "--kv-cache-memory", "0.01", "--json", str(out)],
                bench_cache)
    assert "tp=1 pp=2 sp=1" in table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["greedy_agreement"] == 1.0 and row["parallel_tok_s"] > 0 and row["base_tok_s"] > 0
    assert row["parallel_capacity_tokens"] > row["base_capacity_tokens"]  # half the layers per rank
    assert len(row["parallel_ranks"]) == 2 and len(row["idle_fraction"]) == 2 and row["peak_in_flight"] == 2


@needs_smollm2
def test_engine_benchmark_peer_not_run(tmp_path, bench_cache):
    """``--peer vllm`` without a vLLM venv: the table says why the peer did not run, the rest stands."""
    out = tmp_path / "engine.json"
    table = run(["benchmarks/engine.py", "--requests", "3", "--max-tokens", "4", "--min-prompt", "4",
                 "--max-prompt", "30", "--peer", "vllm", "--peer-python", "/nonexistent/python", "--json", str(out)],
                bench_cache)
    assert "vllm: not run: no python at /nonexistent/python" in table
    header, row_line = table.splitlines()[1:3]
    assert "ringkv_tok_s" in header and "vllm_tok_s" in header and row_line.split("|")[0].strip() == "3"
    (row,) = json.loads(out.read_text())["rows"]
    assert row["vllm_error"] == "no python at /nonexistent/python" and "vllm_tok_s" not in row
    assert row["ringkv_tok_s"] > 0 and row["hf_batched_tok_s"] > 0


def test_long_prefill_benchmark(tmp_path, tiny_test):
    out, sweep = tmp_path / "prefill.json", tmp_path / "sweep.json"
    table, _ = run_side_by_side([
        ["benchmarks/long_prefill.py", "--model", "tiny-test", "--seq", "300", "--sp", "1", "2", "--min-ring", "64",
         "--repeats", "1", "--json", str(out)],
        ["benchmarks/long_prefill.py", "--model", "tiny-test", "--sweep", "16", "--repeats", "1", "--json", str(sweep)],
    ], tiny_test)
    assert "| 2 |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["sp"] for r in rows] == [1, 2]
    assert rows[1]["same_token_as_sp1"] and rows[1]["efficiency"] > 0 and len(rows[1]["peak_rss_mib"]) == 2
    (r,) = json.loads(sweep.read_text())["rows"]
    assert r["seq"] == 16 and r["faster"] in ("ring", "replicated") and r["ring_s"] > 0


def test_collective_latency_benchmark(tmp_path, bench_cache):
    """Two gloo ranks time the all-reduces of a few decode steps; the JSON is a rates file the
    planner's calibration path reads (the loopback link's latency)."""
    from ringkv import planner

    out = tmp_path / "collective.json"
    table = run(["benchmarks/collective_latency.py", "--model", "tiny-long", "--rows", "4", "--steps", "1",
                 "--json", str(out)], bench_cache)
    assert "all-reduce busy" in table
    d = json.loads(out.read_text())
    assert [r["rows"] for r in d["rows"]] == [4] and d["rows"][0]["allreduces_per_step"] == 2 * 4 + 1
    r = planner.apply_calibration(planner.rates(planner.load_hardware(), "cpu", "float32"), [str(out)])
    assert r.latency["loopback"] == d["rates"]["latency"]["loopback"] >= 0


def test_decode_gemm_benchmark(tmp_path, bench_cache):
    """The decode-matmul table: one row per threads x rows, and its JSON is a rates file whose
    ``gemm`` table the planner's calibration path reads."""
    from ringkv import planner

    out = tmp_path / "gemm.json"
    table = run(["benchmarks/decode_gemm.py", "--model", "tiny-long", "--rows", "1", "4", "--threads", "1",
                 "--iters", "1", "--rounds", "1", "--json", str(out)], bench_cache)
    assert "weights GB/s" in table
    d = json.loads(out.read_text())
    assert [(r["threads"], r["rows"]) for r in d["rows"]] == [(1, 1), (1, 4)]
    r = planner.apply_calibration(planner.rates(planner.load_hardware(), "cpu", "float32"), [str(out)])
    assert r.weight_rate(4) == d["rows"][1]["bytes_per_s"] > 0 and planner._threads(r, 2).weight_rate(4) is None


def test_serve_benchmark(tmp_path, bench_cache):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    table = run(["benchmarks/serve.py", "--model", "tiny-test", "--rates", "8", "inf", "--requests", "4",
                 "--max-prompt", "40", "--min-tokens", "2", "--max-tokens", "6", "--json", str(out), "--plot", str(plot)],
                bench_cache)
    assert "| inf |" in table and plot.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rate"] for r in rows] == [8, float("inf")]
    for r in rows:
        assert r["requests"] == 4 and r["output_tokens"] >= 4 and r["tok_s"] > 0 and r["ttft_p50"] > 0


def test_kv_quant_benchmark(tmp_path, bench_cache):
    out = tmp_path / "kv.json"
    table = run(["benchmarks/kv_quant.py", "--model", "tiny-test", "--tokens", "96", "--chunk", "16",
                 "--greedy-prompts", "2", "--greedy-tokens", "4", "--decode-requests", "2", "--decode-tokens", "4",
                 "--kv-gib", "0.01", "--json", str(out)], bench_cache)
    assert "| int8 |" in table
    rows = {r["dtype"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["auto"]["ppl_delta_pct"] == 0 and rows["auto"]["greedy_agreement"] == 1
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        r = rows[name]
        assert r["vs_fp32"] < 0.4 and r["capacity_tokens"] > rows["auto"]["capacity_tokens"] and r["ppl"] > 0


def test_migration_benchmark(tmp_path, tiny_test):
    out = tmp_path / "mig.json"
    table, link = run_side_by_side([
        ["benchmarks/migration.py", "--model", "tiny-test", "--contexts", "64", "256", "--repeats", "1",
         "--decoded", "2", "--pairs", "1:1", "tp2:pp2", "--json", str(out)],
        ["benchmarks/migration.py", "--model", "tiny-test", "--contexts", "64", "--repeats", "1",
         "--decoded", "2", "--pairs", "1:1", "--transport", "link"],  # B in another process
    ], tiny_test)
    assert "| tp2:pp2 | 256 |" in table and "| 1:1 | 64 |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pair"], r["context"]) for r in rows] == [("1:1", 64), ("1:1", 256), ("tp2:pp2", 64), ("tp2:pp2", 256)]
    for r in rows:
        assert r["full_bytes"] > r["final_bytes"] > 0 and r["incremental_downtime_s"] > 0
    assert "over a loopback Link" in link and "| 1:1 | 64 |" in link


@needs_smollm2
def test_decode_step_benchmark(tmp_path, bench_cache):
    """A decode step split into dense, attention, LM head and host (eager engine: no compiling)."""
    out = tmp_path / "decode.json"
    table = run(["benchmarks/decode_step.py", "--rows", "2", "--steps", "2", "--engines", "eager", "--agg", "mean",
                 "--sampled", "--json", str(out)], bench_cache)
    assert "| eager | 2 |" in table
    (row,) = json.loads(out.read_text())["rows"]
    parts = row["dense_ms"] + row["attention_ms"] + row["lm_head_ms"] + row["host_ms"]
    assert abs(parts - row["step_ms"]) < 1e-6 and row["sample_ms"] > 0 and 0 < row["host_share"] < 1
