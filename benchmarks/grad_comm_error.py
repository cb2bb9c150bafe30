"""Error budget of ``grad_comm_dtype``: ring gradients with dK/dV on the wire in float32 vs
bfloat16, both against a float64 single-device reference.

    # worlds 2, 4; S 512, 2048; fp32 and bf16 inputs
    python benchmarks/grad_comm_error.py
    python benchmarks/grad_comm_error.py --worlds 8 --seqs 4096 --json out.json

Spawns a gloo world per world size on this machine (CPU). For each configuration (causal, zigzag,
H=8, Hkv=2, D=64, batch 1) it prints, per wire dtype and gradient, the max error relative to the
largest reference entry and the mean absolute error relative to the mean absolute reference entry.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import ringkv  # noqa: E402
from benchmarks.models import machine, machine_line, write_json  # noqa: E402

H, HKV, D = 8, 2, 64


def reference_grads(q, k, v, dout):
    """float64 causal attention's dq, dk, dv (plain autograd, GQA by repeating K/V)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = q.shape[1]
    kr, vr = (t.repeat_interleave(H // HKV, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / D**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    (out * dout.double()).sum().backward()
    return q.grad, k.grad, v.grad


def _worker(rank, world, port, seqs, dtypes, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    for s in seqs:
        for dtype in dtypes:
            g = torch.Generator().manual_seed(s)
            q = torch.randn(1, s, H, D, generator=g).to(dtype)
            k, v = (torch.randn(1, s, HKV, D, generator=g).to(dtype) for _ in range(2))
            dout = torch.randn(1, s, H, D, generator=g).to(dtype)
            row = dict(world=world, seq=s, dtype=str(dtype).replace("torch.", ""))
            want = reference_grads(q, k, v, dout) if rank == 0 else None
            for wire in (None, torch.bfloat16):
                ql, kl, vl = (
                    ringkv.shard(t, 1, "zigzag").clone().requires_grad_() for t in (q, k, v)
                )
                out = ringkv.ring_attention(ql, kl, vl, causal=True, grad_comm_dtype=wire)
                out.backward(ringkv.shard(dout, 1, "zigzag"))
                grads = [ringkv.unshard(t.grad, 1, "zigzag") for t in (ql, kl, vl)]
                if rank == 0:
                    name = "fp32" if wire is None else "bf16"
                    for gname, got, ref in zip(("dq", "dk", "dv"), grads, want):
                        err = (got.double() - ref).abs()
                        row[f"{name}_{gname}_max"] = (err.max() / ref.abs().max()).item()
                        row[f"{name}_{gname}_mean"] = (err.mean() / ref.abs().mean()).item()
            if rank == 0:
                results.put(row)
    dist.destroy_process_group()


def _port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--seqs", default="512,2048")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    dtypes = [getattr(torch, x) for x in a.dtypes.split(",")]
    ctx = mp.get_context("spawn")
    rows = []
    for world in (int(x) for x in a.worlds.split(",")):
        results = ctx.Queue()
        port = _port()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, seqs, dtypes, results))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        for _ in range(len(seqs) * len(dtypes)):
            rows.append(results.get(timeout=1800))
        for proc in procs:
            proc.join()
    mach = machine(threads=1)  # every rank: torch.set_num_threads(1)
    print(machine_line(mach) + " per rank")
    print(
        "| world | seq | inputs | grad | fp32 wire: max / mean rel. error | bf16 wire: max / mean "
        "rel. error |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        for gname in ("dq", "dk", "dv"):
            print(
                f"| {r['world']} | {r['seq']} | {r['dtype']} | {gname} | "
                f"{r[f'fp32_{gname}_max']:.2e} / {r[f'fp32_{gname}_mean']:.2e} | "
                f"{r[f'bf16_{gname}_max']:.2e} / {r[f'bf16_{gname}_mean']:.2e} |"
            )
    if a.json:
        write_json(a.json, dict(rows=rows, machine=mach))


if __name__ == "__main__":
    main()
