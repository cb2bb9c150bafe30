"""Cases of ``grad_comm_dtype="auto"`` on every rank of a gloo world (tests/test_ring_auto.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

import ringkv
from ringkv.sp import RingStats, ring as ring_mod
from ringkv.sp.collectives import forget_agreed
from ringkv.sp.comm import RingComm

THRESHOLD = "RINGKV_GRAD_COMM_AUTO_RATIO"


def _shard(x, layout, ctx, dim=1):
    return ringkv.shard(x, dim, layout, rank=ctx.rank, world=ctx.world)


def calls(ctx, q, k, v, dout, grad_comm, n, threshold=None, layout="zigzag"):
    """``n`` ring forward + backward calls with ``grad_comm_dtype=grad_comm`` from a fresh start
    (no decision remembered), ``threshold``: this rank's ``RINGKV_GRAD_COMM_AUTO_RATIO`` (None:
    unset). Returns per call ``(out, dq, dk, dv, dK/dV dtype used, comm_ratio)`` and this rank's
    decision for the group (``AutoWire`` fields, or None)."""
    forget_agreed(ctx.group)
    ring_mod.forget_auto(ctx.group)
    before = os.environ.pop(THRESHOLD, None)
    if threshold is not None:
        os.environ[THRESHOLD] = str(threshold)
    try:
        got = []
        for _ in range(n):
            ql, kl, vl = (_shard(t, layout, ctx).clone().requires_grad_() for t in (q, k, v))
            stats = RingStats()
            out = ringkv.ring_attention(
                ql,
                kl,
                vl,
                causal=True,
                group=ctx.group,
                layout=layout,
                grad_comm_dtype=grad_comm,
                timeout=timedelta(seconds=60),
                stats=stats,
            )
            (out.float() * _shard(dout, layout, ctx)).sum().backward()
            b = stats.backward
            got.append(
                (out.detach(), ql.grad, kl.grad, vl.grad, str(b.grad_comm_dtype), b.comm_ratio)
            )
        mine = [w for (g, _), w in ring_mod.auto_decisions().items() if g is ctx.group]
        decision = tuple(vars(mine[0]).values()) if mine else None
        return got, decision, len(mine)
    finally:
        os.environ.pop(THRESHOLD, None)
        if before is not None:
            os.environ[THRESHOLD] = before


def decide(ctx, transfer_s, step_transfer_s, compute_s, threshold):
    """``_Auto.decide`` fed this rank's own (made-up, rank-dependent) measurements and
    threshold: returns the decision this rank takes, which must be every rank's."""
    before = os.environ.pop(THRESHOLD, None)
    os.environ[THRESHOLD] = str(threshold[ctx.rank])
    try:
        auto = ring_mod._Auto((ctx.group, ("decide-case", ctx.world)), RingComm(ctx.group))
        auto.transfer_s = transfer_s[ctx.rank]
        wire = auto.decide(step_transfer_s[ctx.rank], compute_s[ctx.rank], torch.device("cpu"))
        return tuple(vars(wire).values())
    finally:
        ring_mod.forget_auto(ctx.group)
        os.environ.pop(THRESHOLD, None)
        if before is not None:
            os.environ[THRESHOLD] = before


def packed_and_shapes(ctx, cap: int):
    """``"auto"`` over packed batches of one length whose boundaries change every call, then over
    ``cap + 2`` lengths with ``AUTO_PER_GROUP = cap``: returns the group's decision count after
    each phase (one decision for the packed calls; at most ``cap`` after the lengths)."""
    forget_agreed(ctx.group)
    ring_mod.forget_auto(ctx.group)
    keep = ring_mod.AUTO_PER_GROUP
    ring_mod.AUTO_PER_GROUP = cap

    def call(s_total, cu=None):
        g = torch.Generator().manual_seed(s_total)
        q, k, v = (torch.randn(1, s_total, 2, 8, generator=g) for _ in range(3))
        kw = dict(layout="zigzag", rank=ctx.rank, world=ctx.world)
        if cu is not None:
            kw["cu_seqlens"] = cu
        ql, kl, vl = (ringkv.shard(t, 1, **kw).requires_grad_() for t in (q, k, v))
        ringkv.ring_attention(
            ql,
            kl,
            vl,
            causal=True,
            group=ctx.group,
            layout="zigzag",
            cu_seqlens=cu,
            grad_comm_dtype="auto",
            timeout=timedelta(seconds=60),
        ).sum().backward()
        return sum(1 for g, _ in ring_mod.auto_decisions() if g is ctx.group)

    try:
        step = 2 * ctx.world  # zigzag splits each document into 2 x world chunks
        packed = [call(8 * step, [0, step * a, 8 * step]) for a in range(1, 5)]
        shapes = [call(step * (9 + i)) for i in range(cap + 2)]
        return packed, shapes
    finally:
        ring_mod.AUTO_PER_GROUP = keep
        ring_mod.forget_auto(ctx.group)
