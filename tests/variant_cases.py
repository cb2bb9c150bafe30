"""Ulysses / USP / all-gather-KV cases run on every rank of a gloo world (see tests/dist.py).

USP needs a 2D mesh over the whole 4-rank world: ``ringkv.sp_groups`` builds it (a
collective) once per process and shape and caches it, so every case below reuses it.
"""

from __future__ import annotations

from datetime import timedelta

import torch

import ringkv
from ringkv.sp.collectives import forget_agreed
from ringkv.sp import CommStats, RingStats

METHODS = {"ulysses": ringkv.ulysses_attention, "allgather": ringkv.allgather_attention}


def _groups(dims):
    """``(ulysses_group, ring_group)`` of a ``(U, R)`` mesh (cached by ``sp_groups``)."""
    u, r = dims
    return ringkv.sp_groups(ulysses=u, ring=r)


def _where(ctx, dims):
    """Keyword arguments that place this rank's shard: 1D over ``ctx.group`` or a 2D mesh."""
    if dims is None:
        return dict(group=ctx.group)
    ug, rg = _groups(dims)
    return dict(ulysses_group=ug, ring_group=rg)


def _shard(x, layout, where, dim=1):
    if "group" in where:
        return ringkv.shard(x, dim, layout, where["group"])
    return ringkv.shard(x, dim, layout, **where)


def forward_backward(ctx, method, q, k, v, dout, dlse, causal, layout, scale, dims=None, kw=None):
    """One method's forward + backward on this rank's shard (``dims=(U, R)``: usp on the 2D mesh).
    Returns out, lse, dq, dk, dv, the global positions of this rank's tokens and the whole
    output gathered in global order (``unshard``)."""
    where = _where(ctx, dims)
    fn = ringkv.usp_attention if dims is not None else METHODS[method]
    ql, kl, vl = (_shard(t, layout, where).clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(
        ql,
        kl,
        vl,
        causal=causal,
        layout=layout,
        softmax_scale=scale,
        return_lse=True,
        **where,
        **(kw or {}),
    )
    loss = (out.float() * _shard(dout, layout, where)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * _shard(dlse, layout, where, dim=2)).sum()
    loss.backward()
    if "group" in where:
        pos = ringkv.positions(q.shape[1], layout, ctx.rank, ctx.world)
        full = ringkv.unshard(out.detach(), 1, layout, ctx.group)
    else:
        pos = ringkv.positions(q.shape[1], layout, **where)
        full = ringkv.unshard(out.detach(), 1, layout, **where)
    return out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad, pos, full


def shard_roundtrip(ctx, dims, x, layout, dim):
    """2D shard (local) and unshard (all-gather) of ``x``; returns the shard, the gathered
    tensor and the positions."""
    ug, rg = _groups(dims)
    part = ringkv.shard(x, dim, layout, ulysses_group=ug, ring_group=rg)
    back = ringkv.unshard(part, dim, layout, ulysses_group=ug, ring_group=rg)
    return part, back, ringkv.positions(x.shape[dim], layout, ulysses_group=ug, ring_group=rg)


def bytes_sent(ctx, q, k, v):
    """Forward bytes this rank sent, per method (contiguous layout, non-causal)."""
    stats = dict(ring=RingStats(), ulysses=CommStats(), allgather=CommStats(), usp=CommStats())
    args = dict(layout="contiguous", group=ctx.group)
    shards = [ringkv.shard(t, 1, "contiguous", ctx.group) for t in (q, k, v)]
    ringkv.ring_attention(*shards, **args, stats=stats["ring"])
    ringkv.ulysses_attention(*shards, **args, stats=stats["ulysses"])
    ringkv.allgather_attention(*shards, **args, stats=stats["allgather"])
    ug, rg = _groups((2, 2))
    ringkv.usp_attention(
        *(ringkv.shard(t, 1, "contiguous", ulysses_group=ug, ring_group=rg) for t in (q, k, v)),
        layout="contiguous",
        ulysses_group=ug,
        ring_group=rg,
        stats=stats["usp"],
    )
    return {method: s.bytes_sent for method, s in stats.items()}


def call(ctx, method, per_rank_kwargs, timeout_s=10.0):
    """Call a method with this rank's kwargs (q/k/v given as shapes); ``dims`` in the kwargs
    selects usp on that 2D mesh, ``groups`` only builds the mesh."""
    # a first call on every rank, whatever configurations earlier cases agreed on (else a rank
    # whose arguments were agreed before skips the check its peers make: a timeout, not the
    # ValueError these cases look for)
    forget_agreed(ctx.group)
    kw = dict(per_rank_kwargs[ctx.rank] if isinstance(per_rank_kwargs, list) else per_rank_kwargs)
    if kw.pop("skip", False):
        return "skipped"
    if method == "groups":
        ringkv.sp_groups(**kw)
        return "built"
    dtype = kw.pop("dtype", torch.float32)
    q, k, v = (torch.randn(*kw.pop(n)).to(dtype) for n in "qkv")
    if method == "usp":
        ug, rg = _groups(kw.pop("dims"))
        out = ringkv.usp_attention(
            q, k, v, ulysses_group=ug, ring_group=rg, timeout=timedelta(seconds=timeout_s), **kw
        )
    else:
        out = METHODS[method](q, k, v, group=ctx.group, timeout=timedelta(seconds=timeout_s), **kw)
    return tuple(out.shape)
