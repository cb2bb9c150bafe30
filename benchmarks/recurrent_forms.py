"""The recurrent layers' two sequence-parallel forms, one layer at a time: state passing
(``ringkv.sp.gated_delta_rule``, ``mamba2_scan``) against the head-parallel all-to-all form
(``ringkv.sp.heads_gated_delta_rule``, ``heads_mamba2_scan``) and against one process running the
torch reference on the whole sequence (issue #56).

    torchrun --standalone --nproc-per-node 2 benchmarks/recurrent_forms.py \\
        --seq 4096 8192 16384 --json results/recurrent_forms_2.json

Layers (batch 1, float32 on CPU, zigzag): GDN with Qwen3-Next's head sizes (d_k = d_v = 128;
8 value heads, 4 key heads, chunk 64, q/k l2-normalised) and Mamba2 (head_dim 64, state 128,
8 heads, 1 group of B/C, chunk 128). For each sequence length S and mode (``fwd``: forward
under no_grad; ``fwdbwd``: forward and backward of ``sum(out * dout)``):

- ``ref``: rank 0 alone, ``--ref-threads`` threads (default 1, as each rank), the reference on
  the whole sequence (the others wait);
- ``state``, ``heads``: every rank with 1 thread, its shard; the time from a barrier to the
  last rank's end, median of ``--iters`` after one warm-up, the two forms interleaved (on
  shared cores the load then falls on both alike); the reference: ``--ref-iters`` runs;
- bytes one rank sends per layer and forward for each form (``layer_bytes``, from the shapes;
  the backward sends as much again), the rate of a plain all-to-all of the heads form's bytes
  on this group (``link``), and the form ``choose_form`` picks.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402
from ringkv.kernels.delta_ref import gated_delta_ref  # noqa: E402
from ringkv.kernels.scan_ref import ssd_scan_ref  # noqa: E402
from ringkv.sp import (  # noqa: E402
    choose_form,
    gated_delta_rule,
    heads_gated_delta_rule,
    heads_mamba2_scan,
    layer_bytes,
    mamba2_scan,
)
from ringkv.sp.collectives import all_to_all  # noqa: E402
from ringkv.sp.layout import shard  # noqa: E402
from ringkv.sp.pieces import seq_pieces  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--kinds", nargs="+", default=["gdn", "mamba2"], choices=["gdn", "mamba2"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--v-heads", type=int, default=8, help="GDN value heads")
    p.add_argument("--k-heads", type=int, default=4, help="GDN key heads")
    p.add_argument("--mamba-heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=1, help="Mamba2 groups of B/C")
    p.add_argument("--iters", type=int, default=3, help="timed runs of each form")
    p.add_argument("--ref-iters", type=int, default=1, help="timed runs of the reference")
    p.add_argument(
        "--ref-threads",
        type=int,
        default=1,
        help="threads of the one-process reference (1: as each rank; more is fairer on idle "
        "cores, and far slower on cores other processes share)",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def layer(kind: str, a, seq: int):
    """(dims for layer_bytes, the whole sequence's tensors, fn(form, *tensors, pieces, group)
    -> out, the reference on whole tensors -> out)."""
    g = torch.Generator().manual_seed(seq)
    if kind == "gdn":
        hk, hv = a.k_heads, a.v_heads
        dims = dict(k_heads=hk, v_heads=hv, d_k=128, d_v=128, itemsize=4)
        q, k = (torch.randn(1, seq, hk, 128, generator=g) for _ in range(2))
        v = torch.randn(1, seq, hv, 128, generator=g)
        gg, beta = -torch.rand(1, seq, hv, generator=g), torch.rand(1, seq, hv, generator=g)
        fns = {"state": gated_delta_rule, "heads": heads_gated_delta_rule}

        def fn(form, *xs, **kw):
            return fns[form](*xs, use_qk_l2norm=True, chunk_size=64, **kw)

        def ref(*xs):
            return gated_delta_ref(*xs, use_qk_l2norm=True, chunk_size=64)[0]

        return dims, [q, k, v, gg, beta], fn, ref
    h, gr = a.mamba_heads, a.groups
    dims = dict(heads=h, head_dim=64, state=128, groups=gr, itemsize=4)
    x = torch.randn(1, seq, h, 64, generator=g)
    dt = torch.rand(1, seq, h, generator=g) * 0.1
    B, C = (torch.randn(1, seq, gr, 128, generator=g) for _ in range(2))
    A = -torch.rand(h, generator=g)
    fns = {"state": mamba2_scan, "heads": heads_mamba2_scan}

    def fn(form, x, dt, B, C, **kw):
        return fns[form](x, dt, A, B, C, chunk_size=128, **kw)

    def ref(x, dt, B, C):
        Bh, Ch = (m.repeat_interleave(h // gr, 2) for m in (B, C))
        return ssd_scan_ref(x, dt, A, Bh, Ch, 128)[0]

    return dims, [x, dt, B, C], fn, ref


def step(run, xs, mode: str) -> float:
    t = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            run(*xs)
    else:
        leaves = [x.detach().requires_grad_() for x in xs]
        out = run(*leaves)
        out.backward(torch.ones_like(out))
    return time.perf_counter() - t


def timed(runs: dict, xs, mode, iters, world, warmup=True) -> dict:
    """Median seconds of each of ``runs`` from a barrier to the last rank's end, the runs
    interleaved (iteration ``i`` runs them in turn, the order reversed every other
    iteration), so load from other processes falls on each alike; one warm-up each first."""
    times = {name: [] for name in runs}
    for i in range(iters + int(warmup)):
        for name in list(runs)[:: 1 if i % 2 else -1]:
            if world > 1:
                dist.barrier()
            t = time.perf_counter()
            step(runs[name], xs, mode)
            if world > 1:
                dist.barrier()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts[int(warmup) :]) for name, ts in times.items()}


def link_rate(nbytes: int, world: int) -> float:
    """Bytes per second of a plain all-to-all sending ``nbytes`` from each rank."""
    if world == 1:
        return float("inf")
    n = max(world, nbytes * world // (4 * (world - 1)) // world * world)
    x = torch.zeros(world, n // world)
    all_to_all(x)
    dist.barrier()
    t = time.perf_counter()
    all_to_all(x)
    dist.barrier()
    return nbytes / (time.perf_counter() - t)


def one(kind, a, seq, mode, rank, world) -> dict:
    dims, whole, fn, ref = layer(kind, a, seq)
    t_ref = None
    torch.set_num_threads(a.ref_threads if rank == 0 else 1)
    if rank == 0:  # one timed run, no warm-up: the slowest part of the benchmark
        t_ref = timed({"ref": ref}, whole, mode, a.ref_iters, 1, warmup=False)["ref"]
    if world > 1:
        dist.barrier()
    torch.set_num_threads(1)
    pieces = seq_pieces(seq, "zigzag", world)
    local = [shard(x, 1, "zigzag", rank=rank, world=world) for x in whole]
    row = dict(kind=kind, mode=mode, seq=seq, world=world, ref_s=t_ref)
    runs = {f: functools.partial(fn, f, pieces=pieces) for f in ("state", "heads")}
    row.update({f + "_s": t for f, t in timed(runs, local, mode, a.iters, world).items()})
    with torch.no_grad():
        outs = {f: run(*local) for f, run in runs.items()}
    row["max_diff"] = (outs["state"].float() - outs["heads"].float()).abs().max().item()
    b = layer_bytes(kind, dims, pieces, world)
    row.update(state_bytes=b["state"], heads_bytes=b["heads"])
    row["link"] = link_rate(max(b["heads"], 1), world)
    row["auto"] = choose_form(kind, dims, pieces, world)
    return row


def main(argv=None) -> int:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    rows, where = [], machine_line(machine(threads=[a.ref_threads, 1]))
    if rank == 0:
        print(where, "| load", load_average(), flush=True)
    for kind in a.kinds:
        for mode in a.modes:
            for seq in a.seq:
                row = one(kind, a, seq, mode, rank, world)
                if rank == 0:
                    rows.append(row)
                    print(_line(row), flush=True)
    if rank == 0:
        print(where, "| load", load_average())
        if a.json:
            write_json(a.json, dict(args=vars(a), rows=rows, load=load_average()))
    if world > 1:
        dist.barrier()  # no rank tears gloo down while another still writes
        dist.destroy_process_group()
    return 0


def _line(r: dict) -> str:
    mib = 1 << 20
    return (
        f"{r['kind']:6} {r['mode']:6} S={r['seq']:6} N={r['world']}  ref {r['ref_s']:.2f}s  "
        f"state {r['state_s']:.2f}s  heads {r['heads_s']:.2f}s  heads/state "
        f"{r['heads_s'] / r['state_s']:.2f}  bytes/layer state {r['state_bytes'] / mib:.2f} MiB "
        f"heads {r['heads_bytes'] / mib:.1f} MiB  link {r['link'] / 1e9:.2f} GB/s  "
        f"auto {r['auto']}  diff {r['max_diff']:.1e}"
    )


if __name__ == "__main__":
    sys.exit(main())
