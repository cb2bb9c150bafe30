"""How fast one process streams a model's weights through its decode matmuls, by rows and threads.

    python benchmarks/decode_gemm.py --model llama-120m --rows 8 16 64 --threads 1 2 \\
        --json results/decode_gemm.json

A decode step multiplies ``rows`` tokens (the step's sequences) by every linear weight of the
model: per layer q/k/v, o, gate/up and down, then the LM head (random fp32 weights of the
model's shapes, no attention, no host work). For each threads x rows it reports the median
step time, the weight bytes read per second and the FLOP/s. The planner's roofline prices a
step at ``max(bytes / memory, FLOPs / matmul)`` with one memory rate, but on this VM one
thread streams 8 rows slower than 16, and one thread is 1.7-2.5x slower than two. The JSON
holds the table under ``"rates"`` as ``gemm`` (``{threads: {rows: bytes/s}}``): a rates file for
``ringkv plan --calibrate``, with which a step's weights are read at the measured rate. Rounds
alternate the thread counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402

import torch  # noqa: E402

from ringkv.planner import load_model  # noqa: E402


def weights(cfg) -> list:
    """The model's linear weights in decode order, fused as the engine fuses them: (out, in)
    each."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    layer = [(q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return [torch.randn(*s) for _ in range(cfg.num_layers) for s in layer] + [
        torch.randn(cfg.vocab_size, h)
    ]


def step(ws, xs) -> None:
    """One decode step's matmuls: each weight times ``xs[its input width]`` (rows, in)."""
    for w in ws:
        xs[w.shape[1]] @ w.T  # (rows, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="llama-120m", help="a planner preset, HF directory or config.json"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--iters", type=int, default=7, help="timed steps per point (the median counts)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = load_model(args.model)
    ws = weights(cfg)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    params = sum(w.numel() for w in ws)
    times = {(t, r): [] for t in args.threads for r in args.rows}
    for _ in range(args.rounds):
        for t in args.threads:
            torch.set_num_threads(t)
            for r in args.rows:
                xs = {w.shape[1]: torch.randn(r, w.shape[1]) for w in ws}
                step(ws, xs)  # warm-up
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    step(ws, xs)
                    times[t, r].append(time.perf_counter() - t0)
    rows = []
    mach = machine(threads=args.threads)  # the sweep's counts: a column of the table
    print(machine_line(mach))
    print(f"{args.model}: {nbytes / 2**20:.0f} MiB of fp32 weights per step")
    print("| threads | rows | step (median) | weights GB/s | GFLOP/s |")
    print("|---:|---:|---:|---:|---:|")
    for (t, r), ts in times.items():
        s = statistics.median(ts)
        rows.append(
            dict(
                threads=t,
                rows=r,
                step_s=s,
                times=ts,
                bytes_per_s=nbytes / s,
                flops_per_s=2 * params * r / s,
            )
        )
        print(
            f"| {t} | {r} | {s * 1e3:.1f} ms | {nbytes / s / 1e9:.2f} | "
            f"{2 * params * r / s / 1e9:.1f} |"
        )
    if args.json:
        load = load_average()
        gemm = {
            str(t): {str(x["rows"]): x["bytes_per_s"] for x in rows if x["threads"] == t}
            for t in args.threads
        }
        write_json(
            args.json,
            dict(
                kind="decode_gemm",
                model=args.model,
                weight_bytes=nbytes,
                load=load,
                rows=rows,
                machine=mach,
                rates=dict(gemm=gemm, source=f"decode_gemm.py ({args.model}, load {load})"),
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
