"""Smoke tests: the parallel-engine benchmarks run (tiny random model) and write the JSON they
promise."""

import json
import os
from pathlib import Path

import pytest

from tests.bench_machine import assert_names_machine
from tests.bench_runs import Runs
from tests.models import HAVE_SMOLLM2, needs_smollm2

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def preset(cache, name):
    """Write benchmark model ``name`` into ``cache`` (before runs side by side need it: each would
    write it when missing, and one could remove the other's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "benchmarks" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGKV_CACHE", cache)
        models.model_path(name)


# Every benchmark run of this module, by the test that checks it ({d}: the module's output folder).
# The runs are mostly start-ups and single-threaded steps with waits between processes: started all
# at once (on the first test's call), the module takes the time of its longest chain, not the sum.
RUNS = {
    "engine": [
        [
            "benchmarks/engine.py",
            "--pp",
            "2",
            "--model",
            "tiny-test",
            "--requests",
            "3",
            "--max-tokens",
            "4",
            "--min-prompt",
            "4",
            "--max-prompt",
            "30",
            "--kv-cache-memory",
            "0.01",
            "--json",
            "{d}/engine.json",
        ]
    ],
    "peer": [
        [
            "benchmarks/engine.py",
            "--requests",
            "3",
            "--max-tokens",
            "4",
            "--min-prompt",
            "4",
            "--max-prompt",
            "30",
            "--peer",
            "vllm",
            "--peer-python",
            "/nonexistent/python",
            "--json",
            "{d}/engine-peer.json",
        ]
    ],
    "prefill": [
        [
            "benchmarks/long_prefill.py",
            "--model",
            "tiny-test",
            "--seq",
            "300",
            "--sp",
            "1",
            "2",
            "--min-ring",
            "64",
            "--repeats",
            "1",
            "--json",
            "{d}/prefill.json",
        ],
        [
            "benchmarks/long_prefill.py",
            "--model",
            "tiny-test",
            "--sweep",
            "16",
            "--repeats",
            "1",
            "--json",
            "{d}/sweep.json",
        ],
    ],
    "collective": [
        [
            "benchmarks/collective_latency.py",
            "--model",
            "tiny-long",
            "--rows",
            "4",
            "--steps",
            "1",
            "--json",
            "{d}/collective.json",
        ]
    ],
    "gemm": [
        [
            "benchmarks/decode_gemm.py",
            "--model",
            "tiny-long",
            "--rows",
            "1",
            "4",
            "--threads",
            "1",
            "--iters",
            "1",
            "--rounds",
            "1",
            "--json",
            "{d}/gemm.json",
        ]
    ],
    "serve": [
        [
            "benchmarks/serve.py",
            "--model",
            "tiny-test",
            "--rates",
            "8",
            "inf",
            "--requests",
            "4",
            "--max-prompt",
            "40",
            "--min-tokens",
            "2",
            "--max-tokens",
            "6",
            "--json",
            "{d}/serve.json",
            "--plot",
            "{d}/serve.png",
        ]
    ],
    "kv": [
        [
            "benchmarks/kv_quant.py",
            "--model",
            "tiny-test",
            "--tokens",
            "96",
            "--chunk",
            "16",
            "--greedy-prompts",
            "2",
            "--greedy-tokens",
            "4",
            "--decode-requests",
            "2",
            "--decode-tokens",
            "4",
            "--kv-gib",
            "0.01",
            "--json",
            "{d}/kv.json",
        ]
    ],
    "migration": [
        [
            "benchmarks/migration.py",
            "--model",
            "tiny-test",
            "--contexts",
            "64",
            "256",
            "--repeats",
            "1",
            "--decoded",
            "2",
            "--pairs",
            "1:1",
            "tp2:pp2",
            "--json",
            "{d}/mig.json",
        ],
        [
            "benchmarks/migration.py",
            "--model",
            "tiny-test",
            "--contexts",
            "64",
            "--repeats",
            "1",
            "--decoded",
            "2",
            "--pairs",
            "1:1",
            "--transport",
            "link",
        ],
    ],  # B in another process
    "decode_step": [
        [
            "benchmarks/decode_step.py",
            "--rows",
            "2",
            "--steps",
            "2",
            "--engines",
            "eager",
            "--agg",
            "mean",
            "--sampled",
            "--json",
            "{d}/decode.json",
        ]
    ],
}
NEEDS_SMOLLM2 = {"peer", "decode_step"}


@pytest.fixture(scope="module")
def bench(bench_cache, tmp_path_factory):
    """``bench(name)``: the stdouts of ``RUNS[name]`` and the folder its files are in. Every run
    starts on the first call (the models they share written first); a test waits for its own."""
    d = tmp_path_factory.mktemp("bench-engine")
    state = {}

    def get(name):
        if not state:
            for model in ("tiny-test", "tiny-long"):
                preset(bench_cache, model)
            env = dict(os.environ, RINGKV_CACHE=bench_cache, OMP_NUM_THREADS="1")
            state["runs"] = runs = Runs(env, cwd=ROOT)
            for n, arg_lists in RUNS.items():
                if n not in NEEDS_SMOLLM2 or HAVE_SMOLLM2:
                    runs.start(n, [[a.format(d=d) for a in args] for args in arg_lists])
        return state["runs"].stdouts(name), d

    yield get
    if state:
        state["runs"].close()


def test_engine_benchmark_parallel_mode(bench):
    (table,), d = bench("engine")
    assert "tp=1 pp=2 sp=1" in table
    res = json.loads((d / "engine.json").read_text())
    (row,) = res["rows"]
    m = assert_names_machine(res, table, threads=row["base_threads"])
    assert res["cores"] == m["cores"]
    assert row["greedy_agreement"] == 1.0 and row["parallel_tok_s"] > 0 and row["base_tok_s"] > 0
    assert row["parallel_capacity_tokens"] > row["base_capacity_tokens"]  # half the layers per rank
    assert (
        len(row["parallel_ranks"]) == 2
        and len(row["idle_fraction"]) == 2
        and row["peak_in_flight"] == 2
    )


@needs_smollm2
def test_engine_benchmark_peer_not_run(bench):
    """``--peer vllm`` without a vLLM venv: the table says why the peer did not run, the rest
    stands."""
    (table,), d = bench("peer")
    assert "vllm: not run: no python at /nonexistent/python" in table
    lines = table.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("SmolLM2-135M-Instruct"))
    assert lines[title - 1].startswith(
        "machine: "
    )  # the table's header: the machine, the title, the columns
    header, row_line = lines[title + 1 : title + 3]
    assert (
        "ringkv_tok_s" in header
        and "vllm_tok_s" in header
        and row_line.split("|")[0].strip() == "3"
    )
    res = json.loads((d / "engine-peer.json").read_text())
    assert_names_machine(res, table, threads=res["threads"])
    (row,) = res["rows"]
    assert row["vllm_error"] == "no python at /nonexistent/python" and "vllm_tok_s" not in row
    assert row["ringkv_tok_s"] > 0 and row["hf_batched_tok_s"] > 0


def test_long_prefill_benchmark(bench):
    (table, sweep), d = bench("prefill")
    assert "| 2 |" in table
    res = json.loads((d / "prefill.json").read_text())
    rows = res["rows"]
    assert [r["sp"] for r in rows] == [1, 2]
    assert assert_names_machine(res, table)["threads"] == sorted(
        {r["threads"] for r in rows}, reverse=True
    )
    assert (
        rows[1]["same_token_as_sp1"]
        and rows[1]["efficiency"] > 0
        and len(rows[1]["peak_rss_mib"]) == 2
    )
    res = json.loads((d / "sweep.json").read_text())
    assert_names_machine(res, sweep)
    (r,) = res["rows"]
    assert r["seq"] == 16 and r["faster"] in ("ring", "replicated") and r["ring_s"] > 0


def test_collective_latency_benchmark(bench):
    """Two gloo ranks time the all-reduces of a few decode steps; the JSON is a rates file the
    planner's calibration path reads (the loopback link's latency)."""
    from ringkv import planner

    (table,), folder = bench("collective")
    out = folder / "collective.json"
    assert "all-reduce busy" in table
    d = json.loads(out.read_text())
    assert_names_machine(
        d, table, threads=max(1, d["machine"]["cores"] // 2)
    )  # 2 ranks share the cores
    assert [r["rows"] for r in d["rows"]] == [4] and d["rows"][0][
        "allreduces_per_step"
    ] == 2 * 4 + 1
    r = planner.apply_calibration(
        planner.rates(planner.load_hardware(), "cpu", "float32"), [str(out)]
    )
    assert r.latency["loopback"] == d["rates"]["latency"]["loopback"] >= 0


def test_decode_gemm_benchmark(bench):
    """The decode-matmul table: one row per threads x rows, and its JSON is a rates file whose
    ``gemm`` table the planner's calibration path reads."""
    from ringkv import planner
    from ringkv.planner.hardware import with_threads as _threads

    (table,), folder = bench("gemm")
    out = folder / "gemm.json"
    assert "weights GB/s" in table
    d = json.loads(out.read_text())
    assert_names_machine(d, table, threads=[1])  # the sweep's thread counts
    assert [(r["threads"], r["rows"]) for r in d["rows"]] == [(1, 1), (1, 4)]
    r = planner.apply_calibration(
        planner.rates(planner.load_hardware(), "cpu", "float32"), [str(out)]
    )
    assert (
        r.weight_rate(4) == d["rows"][1]["bytes_per_s"] > 0
        and _threads(r, 2).weight_rate(4) is None
    )


def test_serve_benchmark(bench):
    (table,), d = bench("serve")
    assert "| inf |" in table and (d / "serve.png").stat().st_size > 0
    res = json.loads((d / "serve.json").read_text())
    assert_names_machine(res, table)
    rows = res["rows"]
    assert [r["rate"] for r in rows] == [8, float("inf")]
    for r in rows:
        assert (
            r["requests"] == 4 and r["output_tokens"] >= 4 and r["tok_s"] > 0 and r["ttft_p50"] > 0
        )


def test_kv_quant_benchmark(bench):
    (table,), d = bench("kv")
    assert "| int8 |" in table
    res = json.loads((d / "kv.json").read_text())
    assert_names_machine(res, table)
    rows = {r["dtype"]: r for r in res["rows"]}
    assert rows["auto"]["ppl_delta_pct"] == 0 and rows["auto"]["greedy_agreement"] == 1
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        r = rows[name]
        assert (
            r["vs_fp32"] < 0.4
            and r["capacity_tokens"] > rows["auto"]["capacity_tokens"]
            and r["ppl"] > 0
        )


def test_migration_benchmark(bench):
    (table, link), d = bench("migration")
    assert "| tp2:pp2 | 256 |" in table and "| 1:1 | 64 |" in table
    res = json.loads((d / "mig.json").read_text())
    assert_names_machine(res, table)
    rows = res["rows"]
    assert [(r["pair"], r["context"]) for r in rows] == [
        ("1:1", 64),
        ("1:1", 256),
        ("tp2:pp2", 64),
        ("tp2:pp2", 256),
    ]
    for r in rows:
        assert r["full_bytes"] > r["final_bytes"] > 0 and r["incremental_downtime_s"] > 0
    assert "over a loopback Link" in link and "| 1:1 | 64 |" in link and "machine: " in link


@needs_smollm2
def test_decode_step_benchmark(bench):
    """A decode step split into dense, attention, LM head and host (eager engine: no compiling)."""
    (table,), d = bench("decode_step")
    assert "| eager | 2 |" in table
    res = json.loads((d / "decode.json").read_text())
    assert_names_machine(res, table, threads=res["threads"])
    (row,) = res["rows"]
    parts = row["dense_ms"] + row["attention_ms"] + row["lm_head_ms"] + row["host_ms"]
    assert abs(parts - row["step_ms"]) < 1e-6 and row["sample_ms"] > 0 and 0 < row["host_share"] < 1
