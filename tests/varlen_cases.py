"""Sliding-window and packed-sequence (varlen) cases run on every rank of a gloo world."""

from __future__ import annotations

import torch

import ringkv
from ringkv.sp import RingStats
from ringkv.sp.layout import varlen_index, varlen_local_len


def window_forward_backward(ctx, q, k, v, dout, dlse, causal, layout, scale, window):
    """Windowed ring forward + backward on this rank's shard: out, lse, dq, dk, dv, (fwd hops, bwd
    hops)."""

    def shard(x, dim=1):
        return ringkv.shard(x, dim, layout, rank=ctx.rank, world=ctx.world)

    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
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
        window=window,
        stats=stats,
    )
    loss = (out.float() * shard(dout)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * shard(dlse, 2)).sum()
    loss.backward()
    return (
        out.detach(),
        lse.detach(),
        ql.grad,
        kl.grad,
        vl.grad,
        (stats.hops, stats.backward.hops),
    )


def varlen_forward_backward(ctx, q, k, v, dout, dlse, causal, layout, scale, window, cu):
    """Packed ring forward + backward; checks pad rows locally and returns the *unsharded*
    (1, S, ...) out, lse, dq, dk, dv (so shard/unshard round-trip with the results)."""

    def shard(x, dim=1):
        return ringkv.shard(x, dim, layout, ctx.group, cu_seqlens=cu)

    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    assert ql.shape[1] == varlen_local_len(cu, layout, ctx.world)
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
        window=window,
        cu_seqlens=cu,
        stats=stats,
    )
    loss = (out.float() * shard(dout)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * shard(dlse, 2)).sum()
    loss.backward()
    pad = varlen_index(cu, layout, ctx.rank, ctx.world) < 0
    grads = (ql.grad, kl.grad, vl.grad)
    pad_ok = (
        not out[:, pad].any()
        and bool(torch.isneginf(lse[:, :, pad]).all())  # out 0, lse -inf
        and not any(g[:, pad].any() for g in grads)
    )  # and no gradient
    full = [
        ringkv.unshard(x.detach(), dim, layout, ctx.group, cu_seqlens=cu)
        for x, dim in zip((out, lse, *grads), (1, 2, 1, 1, 1))
    ]
    return (*full, (stats.hops, stats.calls, stats.pairs), pad_ok)


def roundtrip(ctx, x, cu, layout):
    """shard -> unshard with cu_seqlens, and this rank's positions within documents."""
    local = ringkv.shard(x, 1, layout, ctx.group, cu_seqlens=cu)
    pos = ringkv.positions(x.shape[1], layout, ctx.rank, ctx.world, cu_seqlens=cu)
    return local, pos, ringkv.unshard(local, 1, layout, ctx.group, cu_seqlens=cu)
