"""Validate ``ringkv.plan``'s performance model: predicted vs measured (this repo's CPU runs, after
calibration on *other* runs) and vs published figures (with the hardware table's default rates).

    python benchmarks/plan_validate.py [--json results/plan_validate.json]

Inputs: the JSON of the CPU benchmark runs in benchmarks/data/plan/ (all re-measured on one commit
by
``bash benchmarks/plan_data.sh``), and published numbers cited in
docs/plan.md. Each row says what was calibrated on what; a row passes within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import write_json  # noqa: E402  (benchmarks/, the script's folder)
from ringkv import planner  # noqa: E402
from ringkv.planner.calibration import (  # noqa: E402
    _fit_attention,
    _parse_config,
    _single_process_runs,
)
from ringkv.planner.catalogue import model_of as _model_of  # noqa: E402
from ringkv.planner.hardware import with_threads as _threads  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plan")
TOLERANCE = 0.15


def data(name: str) -> str:
    return os.path.join(DATA, name)


def load(name: str) -> dict:
    with open(data(name)) as f:
        return json.load(f)


def cpu_rates() -> planner.Rates:
    return planner.rates(planner.load_hardware(), "cpu", "float32")


def row(case, predicted, measured, unit, calibrated_on, source):
    err = predicted / measured - 1
    return dict(
        case=case,
        predicted=predicted,
        measured=measured,
        unit=unit,
        error=err,
        within=abs(err) <= TOLERANCE,
        calibrated_on=calibrated_on,
        source=source,
    )


def attention_rate() -> float:
    """One rank's attention FLOP/s: the 16K zigzag causal row of long_ctx_16k.json (its striped
    row is a prediction)."""
    d = load("long_ctx_16k.json")
    return _fit_attention(dict(d, rows=[x for x in d["rows"] if x["layout"] == "zigzag"]))


def ring_cpu_rows():
    """long_ctx.py on 2 CPU ranks: the attention rate fitted on the 16K zigzag row alone, the 16K
    striped row and the 128K run predicted from it."""
    d16 = load("long_ctx_16k.json")
    r = cpu_rates()
    r.attention = attention_rate()
    (striped,) = [x for x in d16["rows"] if x["layout"] == "striped" and x["causal"]]
    (long,) = [
        x for x in load("long_ctx_128k.json")["rows"] if x["layout"] == "zigzag" and x["causal"]
    ]
    out = []
    for x, d, label in (
        (striped, d16, "S=16K, 8 heads, striped causal"),
        (long, load("long_ctx_128k.json"), "S=128K, 1 head, zigzag causal"),
    ):
        a = d["args"]
        t = planner.ring_attention_seconds(
            a["seq"], a["heads"], a["kv_heads"], a["head_dim"], 2, 4, r, "loopback"
        )[0]
        out.append(
            row(
                f"CPU ring, {label} (long_ctx.py)",
                t,
                x["time_s"],
                "s",
                "long_ctx 16K zigzag",
                "benchmarks/data/plan (plan_data.sh)",
            )
        )
    return out


def bench_prompts(model: str, n: int, lo: int = 16, hi: int = 256) -> list:
    """The prompts benchmarks/engine.py sent (same seeds and code): random ids for a random model;
    for SmolLM2 slices of its text, whose token ids are saved in smollm2_corpus.json (overlapping
    slices share prefix-cache blocks, as in the engine)."""
    rng = random.Random(n)
    if model.startswith("random"):
        return [[rng.randrange(3, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    corpus = load("smollm2_corpus.json")["corpus"]
    out = []
    for _ in range(n):
        length, start = rng.randint(lo, hi), rng.randrange(0, 200)
        out.append(corpus[start : start + length])
    return out


ENGINE_FILES = (
    "engine_pp2modelllama120m.json",
    "engine_tp2modelllama120m.json",
    "engine_pp2modelsmollm2.json",
)
SINGLE_FILES = (
    "prefill_8k.json",
    "prefill_32k.json",
    "threshold_smollm2_short.json",
    "threshold_smollm2.json",
    "threshold_tiny.json",
    "prefill_2k_1thread.json",
    "prefill_2k_2threads.json",
)


def single_process_runs() -> list:
    """Every one-process engine run saved here, with its torch threads: the baselines of the
    engine.py runs (the same requests as their parallel rows), the sp = 1 rows of long_prefill.py
    (8K SmolLM2, 32K tiny-long; 2K SmolLM2 on one and on two threads, one after the other) and
    of its --sweep (one prompt of 4-4096 tokens, 2 threads)."""
    runs = []
    for name in ENGINE_FILES:
        d = load(name)
        cfg = _model_of(d["model"])
        for x in d["rows"]:
            runs.append(
                planner.EngineRun(
                    cfg=cfg,
                    prompts=bench_prompts(d["model"], x["requests"]),
                    max_tokens=d["max_tokens"],
                    num_blocks=x["base_capacity_tokens"] // 16,
                    measured_s=x["output_tokens"] / x["base_tok_s"],
                    threads=x.get("base_threads", d["cores"]),
                    max_num_seqs=x["requests"],
                    label=f"{name}: {x['requests']} requests",
                )
            )
    for name in SINGLE_FILES:
        runs += _single_process_runs(load(name))
    return runs


def cpu_fit(runs):
    """One thread's rates (a rank of a 2-rank run): attention from the 16K ring run; matmul,
    memory bandwidth, host seconds (per step, per sequence per step, per layer per step) and the
    thread scaling fitted on the one-process ``runs`` (planner.fit_engine); the loopback link's
    latency and bandwidth under load from collective_latency.json, through the planner's
    calibration path."""
    start = planner.apply_calibration(
        cpu_rates(), [data(GEMM)]
    )  # decode matmuls at the measured rates
    start.attention = attention_rate()
    rank = planner.fit_engine(runs, start, planner.fit_keys(runs))
    return planner.apply_calibration(rank, [data(COLLECTIVE)])


COLLECTIVE = "collective_latency.json"
GEMM = "decode_gemm.json"
CAL = "one-process runs, long_ctx 16K, decode_gemm, collective_latency"


def prefill_rows(rank):
    """long_prefill.py, sp = 2 (2 ranks x 1 thread), one prompt in one step (ring mode)."""
    out = []
    for name, label in (
        ("prefill_32k.json", "tiny-long, 32768 tokens"),
        ("prefill_8k.json", "SmolLM2-135M, 8192 tokens"),
    ):
        d = load(name)
        (m,) = [x for x in d["rows"] if x["sp"] == 2]
        seq = m["seq"]
        run = planner.EngineRun(
            cfg=planner.load_model(d["model"]),
            prompts=[seq],
            max_tokens=1,
            num_blocks=seq // 32 + 8,
            measured_s=m["ttft_s"],
            sp=2,
            max_num_seqs=1,
            max_num_batched_tokens=seq,
        )
        out.append(
            row(
                f"engine SP=2 prefill (TTFT), {label} (long_prefill.py)",
                run.seconds(rank),
                m["ttft_s"],
                "s",
                CAL,
                "docs/performance.md, SP prefill table",
            )
        )
    return out


def engine_rows(rank):
    """engine.py parallel rows (each rank 1 thread): the whole run's workload through the engine's
    scheduler, priced with the rank rates; tok/s = output tokens / modelled wall time."""
    out = []
    for name in ENGINE_FILES:
        d = load(name)
        cfg = _model_of(d["model"])
        for x in d["rows"]:
            c = _parse_config(x["config"])
            run = planner.EngineRun(
                cfg=cfg,
                prompts=bench_prompts(d["model"], x["requests"]),
                max_tokens=d["max_tokens"],
                num_blocks=x["parallel_capacity_tokens"] // 16 // c["sp"],
                measured_s=0.0,
                max_num_seqs=x["requests"],
                **c,
            )
            out.append(
                row(
                    f"engine {x['config']}, {d['model'].split(' (')[0]}, {x['requests']} requests: "
                    "tok/s",
                    x["output_tokens"] / run.seconds(rank),
                    x["parallel_tok_s"],
                    "tok/s",
                    CAL,
                    "docs/performance.md, TP/PP table",
                )
            )
    return out


def ring_flash_attn_rows():
    """ring-flash-attention README (zhuzilin/ring-flash-attention, benchmark_kvpacked_func.py):
    8 GPUs, 8192 tokens per GPU (65536 in all), 32 heads, 8 KV heads, dim 128, bf16, causal,
    forward. The attention rate is the table's own single-GPU flash_attn column; links and HBM
    from the hardware table. Efficiency = ring iter/s / (flash_attn iter/s / 8)."""
    hw = planner.load_hardware()
    out = []
    for gpu, fa, measured in (("h800", 591.5, 0.852), ("a100", 373.4, 0.817)):
        r = planner.rates(hw, gpu, "bfloat16")
        r.attention = (
            4 * 128 * 32 * 8192 * 8192 / 2 * fa
        )  # flash_attn's achieved FLOP/s on one 8K causal block
        t = planner.ring_attention_seconds(65536, 32, 8, 128, 8, 2, r, "nvlink")[0]
        out.append(
            row(
                f"ring-flash-attn zigzag fwd efficiency, 8x{gpu.upper()}",
                (8 / fa) / t,
                measured,
                "",
                f"flash_attn {fa} iter/s (same table)",
                "github.com/zhuzilin/ring-flash-attention README",
            )
        )
    return out


def meta_rows():
    """Meta, 'Context Parallelism for Scalable Million-Token Inference' (arXiv 2411.01783,
    abstract): Llama 3 405B on 128 H100 (16 nodes of 8: TP 8 in a node, CP 16 across), "1M context
    prefill ... in 77s (93% parallelization efficiency, 63% FLOPS utilization) and 128K context
    prefill in 3.8s". One reading: FP8 linear layers (bf16 weights do not fit 8 x 80 GB; Meta's
    published 405B inference recipe is FP8 row-wise), 1M = 2^20 and 128K = 2^17 tokens, the 128K run
    on the same 128 GPUs (the abstract names no other count). FLOPs counted: linear 2 x 401.6e9
    linear parameters x S, attention 4 x head_dim x heads x S^2 / 2 x layers (causal); utilization =
    FLOPs / (128 x seconds x 989.4e12, the H100's dense bf16 peak)."""
    cfg = planner.load_model("llama-3.1-405b")
    lin = planner.layer_params(cfg, 1)["linear"] * cfg.num_layers

    def prefill(seq):
        (o,) = [
            o
            for o in planner.plan(
                cfg, seq, gpus=128, nodes=16, gpu="h100", dtype="fp8", ulysses=False
            )
            if (o.tp, o.pp, o.sp) == (8, 1, 16)
        ]
        flops = 2 * lin * seq + 4 * cfg.head_dim * cfg.num_heads * seq * seq / 2 * cfg.num_layers
        return o.prefill_s, flops / (128 * o.prefill_s * 989.4e12)

    src, cal = "arXiv 2411.01783 abstract", "none (hardware table defaults)"
    t1m, mfu = prefill(1 << 20)
    t128k, _ = prefill(1 << 17)
    return [
        row(
            "Llama-3.1-405B 2^20-token prefill, 128 H100, TP8 x SP16, FP8 linear",
            t1m,
            77.0,
            "s",
            cal,
            src,
        ),
        row(
            "Llama-3.1-405B 2^20 prefill: FLOPS utilization (FLOPs counted as above / bf16 peak)",
            mfu,
            0.63,
            "",
            cal,
            src,
        ),
        row(
            "Llama-3.1-405B 2^17-token prefill, 128 H100, TP8 x SP16, FP8 linear",
            t128k,
            3.8,
            "s",
            cal,
            src,
        ),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    fit = single_process_runs()
    rank = cpu_fit(fit)
    proc = _threads(rank, 2)
    rows = (
        ring_cpu_rows()
        + prefill_rows(rank)
        + engine_rows(rank)
        + ring_flash_attn_rows()
        + meta_rows()
    )
    res = [x.seconds(rank) / x.measured_s - 1 for x in fit]
    print(
        f"CPU, one thread (a rank), fitted on {len(fit)} one-process runs: matmul "
        f"{rank.matmul / 1e9:.1f} GFLOP/s, memory {rank.memory / 1e9:.2f} GB/s, attention "
        f"{rank.attention / 1e9:.1f} GFLOP/s (long_ctx 16K), 2 threads: "
        f"x{2**rank.thread_scaling:.2f} (thread_scaling {rank.thread_scaling:.2f}); host "
        + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in rank.host.items())
        + f"; loopback {rank.latency['loopback'] * 1e6:.0f} us + "
        f"{rank.links['loopback'] / 1e9:.2f} GB/s per message"
        + f"; fit residuals {min(res):+.0%} .. {max(res):+.0%}, engine baselines "
        + ", ".join(f"{e:+.0%}" for e, x in zip(res, fit) if x.max_tokens > 1)
        + "\n"
    )
    print("| case | predicted | measured / published | error | within 15% | calibrated on |")
    print("|---|---:|---:|---:|---|---|")
    for x in rows:
        fmt = (lambda v: f"{v:.3f}") if x["unit"] == "" else (lambda v: f"{v:.3g} {x['unit']}")
        print(
            f"| {x['case']} | {fmt(x['predicted'])} | {fmt(x['measured'])} | {x['error']:+.1%} | "
            f"{'yes' if x['within'] else '**no**'} | {x['calibrated_on']} |"
        )
    print(f"\n{sum(x['within'] for x in rows)} of {len(rows)} within {TOLERANCE:.0%}")
    if args.json:
        write_json(
            args.json,
            dict(
                rows=rows,
                cpu_process_rates=asdict(proc),
                cpu_rank_rates=asdict(rank),
                machine=None,
            ),
        )  # nothing is timed here: the saved runs' machines are in their JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
