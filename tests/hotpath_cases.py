"""Cases for tests/test_ring_hotpath.py, run on every rank of a gloo world (see tests/dist.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringkv
from ringkv.sp import RingStats, collectives


def agreement_counts(ctx, method):
    """Argument checks (``agree``) and real all-gathers made by each of five calls of ``method``:
    a configuration, the same twice more, a changed one, the first again."""
    counts, real_agree, real_gather = [], collectives.agree, dist.all_gather
    calls = {"agree": 0, "all_gather": 0}

    def counting(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    collectives.agree, dist.all_gather = (
        counting("agree", real_agree),
        counting("all_gather", real_gather),
    )
    try:
        g = torch.Generator().manual_seed(ctx.rank)
        q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))
        if method == "usp":
            ug, rg = ringkv.sp_groups(ulysses=2, ring=2)
            fn, where = ringkv.usp_attention, dict(ulysses_group=ug, ring_group=rg)
        else:
            fn = {
                "ring": ringkv.ring_attention,
                "ulysses": ringkv.ulysses_attention,
                "allgather": ringkv.allgather_attention,
            }[method]
            where = dict(group=ctx.group)
        for causal in (False, False, False, True, False):
            before = dict(calls)
            fn(q, k, v, causal=causal, layout="zigzag", **where)
            counts.append(tuple(calls[n] - before[n] for n in ("agree", "all_gather")))
    finally:
        collectives.agree, dist.all_gather = real_agree, real_gather
    return counts


def grad_comm(ctx, q, k, v, dout, causal, layout, grad_comm_dtype):
    """Ring forward + backward with dK/dV on the wire in ``grad_comm_dtype``: the gradients and the
    backward's bytes sent."""
    ql, kl, vl = (
        ringkv.shard(t, 1, layout, rank=ctx.rank, world=ctx.world).clone().requires_grad_()
        for t in (q, k, v)
    )
    stats = RingStats()
    out = ringkv.ring_attention(
        ql,
        kl,
        vl,
        causal=causal,
        group=ctx.group,
        layout=layout,
        grad_comm_dtype=grad_comm_dtype,
        stats=stats,
    )
    (out.float() * ringkv.shard(dout, 1, layout, rank=ctx.rank, world=ctx.world)).sum().backward()
    return ql.grad, kl.grad, vl.grad, stats.backward.bytes_sent
