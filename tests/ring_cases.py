"""Cases run on every rank of a gloo world (see tests/dist.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

import ringkv
from ringkv.sp.collectives import forget_agreed
from ringkv.sp import RingStats, ring as ring_mod


def _shard(x, layout, ctx, dim=1):
    return ringkv.shard(x, dim, layout, rank=ctx.rank, world=ctx.world)


def forward_backward(ctx, q, k, v, dout, dlse, causal, layout, scale, backend):
    """Ring forward + backward on this rank's shard; returns out, lse, dq, dk, dv, stats."""
    ql, kl, vl = (_shard(t, layout, ctx).clone().requires_grad_() for t in (q, k, v))
    stats = RingStats()
    out, lse = ringkv.ring_attention(
        ql,
        kl,
        vl,
        causal=causal,
        group=ctx.group,
        layout=layout,
        softmax_scale=scale,
        return_lse=True,
        backend=backend,
        stats=stats,
    )
    loss = (out.float() * _shard(dout, layout, ctx)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * _shard(dlse, layout, ctx, dim=2)).sum()
    loss.backward()
    return (
        out.detach(),
        lse.detach(),
        ql.grad,
        kl.grad,
        vl.grad,
        (stats.pairs, stats.calls, stats.skipped),
    )


def twice_bitwise(ctx, q, k, v, causal, layout):
    """Two identical calls (forward + backward) give bit-identical results."""
    results = [
        forward_backward(ctx, q, k, v, torch.ones(q.shape), None, causal, layout, None, "auto")[:5]
        for _ in range(2)
    ]
    return all(torch.equal(a, b) for a, b in zip(*results))


def call(ctx, per_rank_kwargs, timeout_s=5.0):
    """Call ring_attention with this rank's kwargs (q/k/v given as shapes or tensors)."""
    # a first call on every rank, whatever configurations earlier cases agreed on (else a rank
    # whose arguments were agreed before skips the check its peers make: a timeout, not the
    # ValueError these cases look for)
    forget_agreed(ctx.group)
    kw = dict(per_rank_kwargs[ctx.rank] if isinstance(per_rank_kwargs, list) else per_rank_kwargs)
    if kw.pop("skip", False):
        return "skipped"
    dtype = kw.pop("dtype", torch.float32)
    q, k, v = (
        torch.randn(*kw.pop(n)).to(dtype) if isinstance(kw.get(n), tuple) else kw.pop(n)
        for n in "qkv"
    )
    out = ringkv.ring_attention(
        q, k, v, group=ctx.group, timeout=timedelta(seconds=timeout_s), **kw
    )
    return tuple(out.shape)


def die_mid_ring(ctx, doomed_rank, timeout_s=10.0):
    """Rank ``doomed_rank`` exits during its second ring step. A survivor may still finish that
    call (it had every block it needed), but it must raise by its next call, within the timeout."""
    if ctx.rank == doomed_rank:
        calls = {"n": 0}
        real = ring_mod.kernels.block_forward

        def dying(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(1)
            return real(*a, **kw)

        ring_mod.kernels.block_forward = dying
    q = torch.randn(1, 64, 2, 16)
    for _ in range(2):
        ringkv.ring_attention(
            q, q, q, causal=False, group=ctx.group, timeout=timedelta(seconds=timeout_s)
        )
    return "finished"
