"""What one tensor-parallel all-reduce costs on this machine while the ranks are busy, as the
planner's link terms (``--calibrate`` input for ``ringkv plan``).

    python benchmarks/collective_latency.py --model llama-120m --tp 2 --rows 16 64 \
        --json results/collective_latency.json

``tp`` gloo ranks (``cores / tp`` torch threads each, as ``benchmarks/engine.py`` gives a
parallel engine's ranks) run decode steps of the model's TP slices: per layer the q/k/v, o,
gate/up and down matmuls of ``rows`` tokens (random weights of the rank's shapes), an
all-reduce after o and after down, one more per step (the vocab-parallel embedding):
``2 x layers + 1`` per step, as the engine does. Three modes, interleaved step by step,
``--steps`` times each: ``compute`` (the same matmuls, no all-reduce), ``both`` (the engine's
step) and ``comm`` (the all-reduces alone, idle ranks). The cost of an all-reduce under load
is the median over steps of ``(both - compute) / all-reduces`` (pairs of neighbouring steps,
so load from other processes hits both sides alike; the difference of the fastest steps is
reported too); a least-squares fit of the planner's model of it (``message_seconds``: ``2 (tp - 1)``
messages x latency + ``2 (tp - 1) / tp x bytes / bandwidth``) over the ``rows`` gives the
``latency`` and ``links`` of the ``loopback`` link, written under ``"rates"`` in the JSON
(a rates file for ``--calibrate``). ``uptime``'s load average is recorded before and after:
other processes on the cores change the result.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402
from ringkv import planner  # noqa: E402
from ringkv.parallel.tp import kv_heads_per_rank  # noqa: E402

MODES = ("compute", "both", "comm")


def _step(ws, x, allreduce: bool, compute: bool) -> None:
    """One decode step of a TP rank: per layer (wqkv, wo, wgu, wd) and two all-reduces, + 1."""
    h = x.shape[1]
    y = torch.empty_like(x)
    if allreduce:
        dist.all_reduce(y)  # the vocab-parallel embedding
    for wqkv, wo, wgu, wd in ws:
        if compute:
            qkv = F.linear(x, wqkv)  # (rows, (hq + 2 hkv) d)
            y = F.linear(qkv[:, : wo.shape[1]], wo)  # (rows, h)
        if allreduce:
            dist.all_reduce(y)
        if compute:
            gu = F.linear(x, wgu)  # (rows, 2 inter / tp)
            g, u = gu.chunk(2, dim=1)
            y = F.linear(F.silu(g) * u, wd)  # (rows, h)
        if allreduce:
            dist.all_reduce(y)
        assert y.shape[1] == h


def rank_threads(tp: int) -> int:
    """torch threads per rank: the cores shared by the ranks."""
    return max(1, (os.cpu_count() or 1) // tp)


def _rank(rank: int, args, port: int, out) -> None:
    torch.set_num_threads(rank_threads(args.tp))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.tp,
        timeout=timedelta(seconds=120),
    )
    cfg = planner.load_model(args.model)
    d, h, tp = cfg.head_dim, cfg.hidden_size, args.tp
    hq, hkv, inter = (
        cfg.num_heads // tp,
        kv_heads_per_rank(cfg, tp),
        -(-cfg.intermediate_size // tp),
    )
    g = torch.Generator().manual_seed(rank)
    ws = [
        (
            torch.randn((hq + 2 * hkv) * d, h, generator=g),
            torch.randn(h, hq * d, generator=g),
            torch.randn(2 * inter, h, generator=g),
            torch.randn(h, inter, generator=g),
        )
        for _ in range(cfg.num_layers)
    ]
    rows = []
    count = 2 * cfg.num_layers + 1
    for n in args.rows:
        x = torch.randn(n, h, generator=g) * 0.01
        times = {m: [] for m in MODES}
        for i in range(args.steps + 1):  # modes interleaved step by step (the first round warms up)
            for m in MODES:
                dist.barrier()
                t = time.perf_counter()
                _step(ws, x, allreduce=m != "compute", compute=m != "comm")
                dt = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(
                    dt, op=dist.ReduceOp.MAX
                )  # the step ends when the slowest rank is done
                if i:
                    times[m].append(dt.item())
        busy = statistics.median(b - c for b, c in zip(times["both"], times["compute"])) / count
        rows.append(
            dict(
                rows=n,
                bytes=n * h * 4,
                allreduces_per_step=count,
                step_s=times,
                compute_step_s=statistics.median(times["compute"]),
                both_step_s=statistics.median(times["both"]),
                comm_step_s=statistics.median(times["comm"]),
                allreduce_busy_s=busy,
                allreduce_idle_s=statistics.median(times["comm"]) / count,
                allreduce_busy_fastest_s=(min(times["both"]) - min(times["compute"])) / count,
            )
        )
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def fit_link(rows, tp: int, key: str = "allreduce_busy_s"):
    """(latency s per message, bytes/s) of ``message_seconds`` for an all-reduce over ``tp``
    ranks, least squares over the rows' ``key`` seconds; bandwidth None when the fit gives no
    positive slope."""
    m = 2 * (tp - 1)
    xs = [2 * (tp - 1) / tp * r["bytes"] for r in rows]
    ys = [r[key] for r in rows]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den > 0 else 0.0
    if slope <= 0:
        return max(sy / n, 0.0) / m, None
    return max((sy - slope * sx) / n, 0.0) / m, 1 / slope


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-120m", help="a planner preset or config (shapes only)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument(
        "--rows", type=int, nargs="+", default=[16, 64], help="tokens per step (decode batches)"
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode and size")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    load_before = load_average()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.tp)]
    for q in procs:
        q.start()
    rows = out.get()
    for q in procs:
        q.join()
    load_after = load_average()
    latency, bw = fit_link(rows, args.tp)
    idle_latency, _ = fit_link(rows, args.tp, "allreduce_idle_s")
    rates = dict(
        latency=dict(loopback=latency),
        source=f"collective_latency.py ({args.model}, tp={args.tp}, "
        f"load {load_before} -> {load_after})",
    )
    if bw is not None:
        rates["links"] = dict(loopback=bw)
    mach = machine(threads=rank_threads(args.tp))  # per rank
    print(machine_line(mach) + " per rank")
    print(
        f"{args.tp} gloo ranks x {mach['threads']} thread(s), {args.model} decode steps; "
        f"load average {load_before} -> {load_after}"
    )
    print(
        "| rows | all-reduce bytes | step compute | step with all-reduces | all-reduce busy | busy "
        "(fastest steps) | all-reduce idle |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['rows']} | {r['bytes']} | {r['compute_step_s'] * 1e3:.1f} ms | "
            f"{r['both_step_s'] * 1e3:.1f} ms | {r['allreduce_busy_s'] * 1e3:.2f} ms | "
            f"{r['allreduce_busy_fastest_s'] * 1e3:.2f} ms | {r['allreduce_idle_s'] * 1e3:.2f} ms |"
        )
    print(
        f"fit (planner link model, busy): latency {latency * 1e6:.0f} us per message, bandwidth "
        f"{'-' if bw is None else f'{bw / 1e9:.2f} GB/s'}; idle latency {idle_latency * 1e6:.0f} "
        "us per message"
    )
    if args.json:
        write_json(
            args.json,
            dict(
                kind="collective",
                model=args.model,
                tp=args.tp,
                cores=mach["cores"],
                machine=mach,
                load_before=load_before,
                load_after=load_after,
                rows=rows,
                rates=rates,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
