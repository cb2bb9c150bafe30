"""Ring attention across two hosts on shaped links: how much of the communication the ring hides
as the link rate falls (issue #45, part 6; the seeds' consumer card, where "without NVLink
communication outweighs compute").

    # as root (network namespaces): S=64K and a knee at S=8K, forward and forward + backward
    python benchmarks/hosts_ring.py --seq 65536 --rates 10gbit,1gbit,100mbit
    python benchmarks/hosts_ring.py --seq 8192 --rates 1gbit,100mbit,30mbit \\
        --grad-comm-dtype fp32,auto --json out.json

Makes 2 hosts (``tests/hosts.py``: network namespaces on a bridge, each link shaped by tbf) and
runs ``benchmarks/long_ctx.py`` on them with ``torchrun --nnodes 2 --nproc-per-node 2`` (4
ranks: the ring crosses the link twice per hop, host 0 -> host 1 and back). Each shaped rate
is measured between two runs on the unshaped link (the baseline: veths at memory speed), with
the links re-shaped in place, so a change of load falls on both. Per run and pass (forward,
forward + backward) it reports the ring's time, the time of the same ring with every hop a local
copy (``no-comm``: the compute alone), the overlap fraction ``no-comm / time`` (1: the
communication is hidden) and that fraction over the baseline's (the issue's goal: >= 0.9 at
10 Gbit/s, S = 64K). ``--grad-comm-dtype fp32,auto`` times the backward with each dK/dV wire
dtype in interleaved rounds and shows what ``"auto"`` chose (the dtype and the measured
transfer / compute ratio, checked to be the same on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402
from tests.hosts import Hosts, missing, wait_all  # noqa: E402

LONG_CTX = os.path.join(HERE, "long_ctx.py")
ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument(
        "--rates", default="10gbit,1gbit,100mbit", help="shaped rates (tc units), in order"
    )
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--passes", default="fwd,bwd", help="fwd (forward), bwd (forward + backward), or both"
    )
    p.add_argument(
        "--grad-comm-dtype",
        default="fp32",
        help="long_ctx.py's --grad-comm-dtype for the bwd pass (e.g. fp32,auto: interleaved)",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="the shaped rates only (no unshaped runs)"
    )
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="default: 1 with auto, else 0")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun launch")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="folder for the runs' logs (default: a temp dir)")
    return p.parse_args(argv)


def launch(hosts, args, pas: str, out: str, name: str, port: int) -> dict:
    """long_ctx.py on both hosts (``--master-addr`` form); rank 0's JSON result."""
    result = os.path.join(out, f"{name}.json")
    flags = ["--seq", str(args.seq), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]
    flags += ["--head-dim", str(args.head_dim), "--iters", str(args.iters), "--quiet"]
    flags += ["--layout", "zigzag", "--causal", "--no-baseline", "--json", result]
    gcd = args.grad_comm_dtype if pas == "bwd" else "fp32"
    warmup = args.warmup if args.warmup is not None else int("auto" in gcd)
    flags += ["--warmup", str(warmup), "--grad-comm-dtype", gcd]
    flags += ["--backward"] if pas == "bwd" else []
    procs = []
    for i in range(2):
        cmd = ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--node-rank", str(i), "--master-addr", hosts.addr(0)]
        cmd += ["--master-port", str(port), LONG_CTX, *flags]
        with open(os.path.join(out, f"{name}.host{i}.log"), "w") as log:
            procs.append(hosts.run(i, cmd, env=ENV, stdout=log, stderr=log))
    codes = wait_all(procs, args.timeout)
    if codes != [0, 0] or not os.path.exists(result):
        tail = open(os.path.join(out, f"{name}.host0.log")).read()[-3000:]
        raise RuntimeError(f"{name}: exit codes {codes}\n{tail}")
    with open(result) as f:
        return json.load(f)


def summarize(res: dict) -> dict:
    (row,) = res["rows"]
    got = dict(time_s=row["time_s"], nocomm_s=row["time_nocomm_s"])
    got["overlap"] = row["time_nocomm_s"] / row["time_s"]
    got["bytes_sent"] = row["bytes_sent"]
    got["load"] = res["environment"]["load_start"] + " -> " + res["environment"]["load_end"]
    got["by_grad_comm"] = row.get("by_grad_comm", {})
    return got


def main(argv=None) -> int:
    args = parse_args(argv)
    why = missing()
    if why:
        raise SystemExit(f"hosts_ring.py makes network namespaces: {why}")
    rates = [r for r in args.rates.split(",") if r]
    passes = args.passes.split(",")
    out = args.out or tempfile.mkdtemp(prefix="hosts_ring-")
    os.makedirs(out, exist_ok=True)
    # the baseline before each rate and after the last: each rate sits between two of them
    order = [] if args.no_baseline else [None]
    for rate in rates:
        order += [rate] if args.no_baseline else [rate, None]
    # a stop from outside (kill, or Ctrl-C of a background job, where SIGINT starts ignored)
    # still takes the hosts down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runs = []  # (rate, pass, summary)
    port = args.port
    hosts = Hosts(2, rate=None)
    try:
        hosts.up()
        for i, rate in enumerate(order):
            hosts.shape(rate)
            for pas in passes:
                name = f"{i:02d}-{rate or 'unshaped'}-{pas}"
                got = summarize(launch(hosts, args, pas, out, name, port))
                port += 1
                runs.append((rate, pas, got))
                print(
                    f"  {name}: {got['time_s']:.3f}s, no-comm {got['nocomm_s']:.3f}s, overlap "
                    f"{got['overlap']:.3f} (load {got['load']})",
                    flush=True,
                )
    finally:
        hosts.down()
    rows = []
    for j, (rate, pas, got) in enumerate(runs):
        if rate is None:
            continue
        base = [g for r, p, g in runs if r is None and p == pas]
        k = [i for i, (r, p, _) in enumerate(runs) if r is None and p == pas]
        near = [base[n] for n, i in enumerate(k) if abs(i - j) <= len(passes)]  # both neighbours
        nan = float("nan")
        b_overlap = sum(g["overlap"] for g in near) / len(near) if near else nan
        b_time = sum(g["time_s"] for g in near) / len(near) if near else nan
        rows.append(dict(rate=rate, pass_=pas, **got, base_overlap=b_overlap, base_time_s=b_time))
        rows[-1]["overlap_vs_base"] = got["overlap"] / b_overlap
    mach = machine(threads=1)
    what = f"S={args.seq} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} fp32 zigzag causal"
    print(f"\n{machine_line(mach)} per rank; 2 hosts x 2 ranks; {what}; load now {load_average()}")
    print(
        "| link | pass | time | no-comm | overlap | unshaped overlap | overlap / unshaped "
        "| time / unshaped | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']} | {r['pass_']} | {r['time_s']:.3f}s | {r['nocomm_s']:.3f}s "
            f"| {r['overlap']:.3f} | {r['base_overlap']:.3f} | {r['overlap_vs_base']:.3f} "
            f"| {r['time_s'] / r['base_time_s']:.3f} | {r['load']} |"
        )
    gcd = [(r["rate"], r["by_grad_comm"]) for r in rows if len(r["by_grad_comm"]) > 1]
    gcd += [("unshaped", g["by_grad_comm"]) for r, p, g in runs if r is None]
    if any(len(b) > 1 for _, b in gcd):
        print("\n| link | dK/dV wire | fwd+bwd time | dtype used | ratio | same on every rank |")
        print("|---|---|---|---|---|---|")
        for rate, by in gcd:
            if len(by) < 2:
                continue
            for name, w in by.items():
                ratio = w.get("ratio")
                print(
                    f"| {rate} | {name} | {w['time_s']:.3f}s | {w.get('dkv_dtype')} "
                    f"| {'-' if ratio is None else f'{ratio:.3f}'} "
                    f"| {w.get('same_on_every_rank')} |"
                )
    if args.json:
        write_json(
            args.json,
            dict(
                args=vars(args),
                rows=rows,
                runs=[dict(rate=r, pass_=p, **g) for r, p, g in runs],
                machine=mach,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
