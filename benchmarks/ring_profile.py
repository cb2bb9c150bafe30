"""Where a ring attention call spends its time, hop by hop (CPU, gloo; or one process).

    torchrun --nproc-per-node 2 benchmarks/ring_profile.py --seq 16384 --heads 8 --backward

Runs ``ring_attention`` (``--iters`` times after one warm-up) with timers around its parts and
prints, per ring step and in total, the seconds per call of this rank split into:

- ``kernel``: the attention kernel (forward, or backward) on each block or tile: ringkv's own
  ``cpu_flash`` for float32 on CPU, else torch's fused op (``sdpa``);
- ``merge``: the LSE merges of partials into the float32 accumulator;
- ``copies``: K and V stacked into one message (heads-first on CPU), empty accumulators;
- ``post``/``wait``: posting the hop's isend/irecv and waiting for it (a wait longer than zero
  is communication the computation did not hide);
- ``other``: the rest (Python, slicing, buffer allocation, in-place gradient accumulation,
  casts of the result).

The timers wrap module functions (``ringkv.kernels.cpu_flash`` and ``sdpa``, ``ringkv.sp.ring``,
``RingComm``) from
the outside: nothing in the library changes. The steps are rank 0's, the totals every rank's;
``--json`` has every rank's steps.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
import ringkv  # noqa: E402
from ringkv import kernels  # noqa: E402
from ringkv.kernels import cpu_flash, merge as merge_mod, sdpa  # noqa: E402
from ringkv.sp import comm as comm_mod, ring  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402

CATEGORIES = ("kernel", "merge", "copies", "post", "wait", "other")


class Clock:
    """Seconds per (step, category); the step advances at each ``Shards.plan`` call (one per ring
    step)."""

    def __init__(self):
        self.table = defaultdict(float)
        self.step, self.depth, self.enabled = -1, 0, False

    def wrap(self, owner, name: str, category: str):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            if self.depth or not self.enabled:  # inside another timed part: counted there
                return fn(*a, **kw)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                # a K/V hop (tag 0) is posted before its step's plan: count it with that step
                ahead = category == "post" and a[0].tag == 0
                self.table[self.step + ahead, category] += time.perf_counter() - t
                self.depth -= 1

        setattr(owner, name, timed)

    def install(self):
        for owner, name in (
            (sdpa, "_fused"),
            (sdpa, "_fused_backward"),
            (cpu_flash, "forward"),
            (cpu_flash, "_backward"),
        ):
            self.wrap(owner, name, "kernel")
        for owner in (sdpa, merge_mod, kernels):  # each module's own reference to the merge
            self.wrap(owner, "merge_", "merge")
        for name in ("_pack", "empty_partial"):
            self.wrap(ring, name, "copies")
        self.wrap(comm_mod.RingComm, "send_recv", "post")
        self.wrap(comm_mod.RingComm, "wait", "wait")
        plan = ring.Shards.plan

        def counted(shards, *a, **kw):
            self.step += self.enabled
            return plan(shards, *a, **kw)

        ring.Shards.plan = counted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--backward", action="store_true", help="profile the backward (after an untimed forward)"
    )
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        from ringkv.parallel.net import pick_interface

        pick_interface()  # a world across hosts: the interface that reaches the master
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.set_num_threads(
        max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    )
    g = torch.Generator().manual_seed(1 + rank)
    s = args.seq // world
    q, k, v = (
        torch.randn(1, s, h, args.head_dim, generator=g).requires_grad_(args.backward)
        for h in (args.heads, args.kv_heads or args.heads, args.kv_heads or args.heads)
    )
    call = functools.partial(ringkv.ring_attention, causal=args.causal, layout=args.layout)
    clock = Clock()
    clock.install()
    totals = []
    for i in range(args.iters + 1):  # the first call warms up, untimed
        clock.enabled = False
        if args.backward:
            out = call(q, k, v)
        if dist.is_initialized():
            dist.barrier()
        clock.enabled, clock.step = i > 0, -1
        t = time.perf_counter()
        if args.backward:
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                call(q, k, v)
        if i:
            totals.append(time.perf_counter() - t)
    total = sum(totals) / len(totals)
    table = {key: val / len(totals) for key, val in clock.table.items()}
    steps = sorted({st for st, _ in table})
    rows = [dict(step=st, **{c: table.get((st, c), 0.0) for c in CATEGORIES[:-1]}) for st in steps]
    known = sum(sum(r[c] for c in CATEGORIES[:-1]) for r in rows)
    result = dict(rank=rank, total_s=total, rows=rows, other_s=total - known)
    every = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(every, result)
    else:
        every = [result]
    if rank == 0:
        mach = machine()  # this rank's threads: every rank sets the same count
        print(machine_line(mach) + " per rank")
        what = "forward + backward's backward" if args.backward else "forward"
        print(
            f"ring {what}: seq={args.seq} heads={args.heads} "
            f"kv_heads={args.kv_heads or args.heads} head_dim={args.head_dim} {args.layout} "
            f"{'causal' if args.causal else 'full'}, {world} rank(s); seconds per call, by step on "
            f"rank 0, in all on every rank (load {load_average()})"
        )
        print(f"{'step':>5s} " + " ".join(f"{c:>8s}" for c in CATEGORIES))
        for r in rows:
            print(
                f"{'setup' if r['step'] < 0 else r['step']:>5} "
                + " ".join(f"{r[c]:8.4f}" for c in CATEGORIES[:-1])
            )
        for res in every:
            sums = {c: sum(r[c] for r in res["rows"]) for c in CATEGORIES[:-1]}
            print(
                f"{'all':>5s} "
                + " ".join(f"{sums[c]:8.4f}" for c in CATEGORIES[:-1])
                + f" {res['other_s']:8.4f}   total {res['total_s']:.4f}  (rank {res['rank']})"
            )
        if args.json:
            write_json(args.json, dict(args=vars(args), ranks=every, machine=mach))
    if dist.is_initialized():
        dist.barrier()  # every rank has printed and written what it had
    return 0


if __name__ == "__main__":
    code = main()
    # No gloo teardown at exit: in about 1 run in 10 (2 ranks, with or without a barrier or
    # destroy_process_group first, seen in CI) a rank aborted in it ("terminate called without an
    # active exception") after all its output was written. The cause is not found yet; the
    # results are complete by now, so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
