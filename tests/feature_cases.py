"""Attention with V's own head size, soft-capping and sinks on every SP method, run on every rank
of a gloo world (see tests/dist.py and tests/test_attention_features.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringkv
from ringkv.sp.decode import decode_attention
from tests.variant_cases import _where

METHODS = {
    "ring": ringkv.ring_attention,
    "ulysses": ringkv.ulysses_attention,
    "usp": ringkv.usp_attention,
    "allgather": ringkv.allgather_attention,
}


def forward_backward(ctx, method, q, k, v, sinks, dout, dlse, c, cu=None):
    """One method's forward + backward on this rank's shard with ``c``'s softcap, window, layout;
    returns the unsharded out, lse, dq, dk, dv and the sinks' gradient summed over the ranks."""
    where = _where(ctx, c["dims"])
    extra = {} if cu is None else dict(cu_seqlens=cu)

    def shard(x, dim=1):
        return ringkv.shard(x, dim, c["layout"], **where, **extra)

    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    sk = None if sinks is None else sinks.clone().requires_grad_()
    kw = dict(chunks=c["chunks"]) if method == "allgather" else {}
    out, lse = METHODS[method](
        ql,
        kl,
        vl,
        causal=c["causal"],
        layout=c["layout"],
        softmax_scale=c["scale"],
        return_lse=True,
        window=c["window"],
        softcap=c["softcap"],
        sinks=sk,
        **where,
        **extra,
        **kw,
    )
    loss = (out.float() * shard(dout)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * shard(dlse, 2)).sum()
    loss.backward()
    dsinks = None
    if sk is not None:  # a replicated weight: its gradient is the sum of the ranks' shares
        dsinks = sk.grad.float()
        dist.all_reduce(dsinks, group=where.get("group"))
    full = [
        ringkv.unshard(x.detach(), dim, c["layout"], **where, **extra)
        for x, dim in zip((out, lse, ql.grad, kl.grad, vl.grad), (1, 2, 1, 1, 1))
    ]
    return (*full, dsinks)


def disagree(ctx, per_rank):
    """ring_attention with this rank's keyword arguments; returns the error's text (or "ok")."""
    kw = dict(per_rank[ctx.rank])
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    try:
        ringkv.ring_attention(q, k, v, group=ctx.group, **kw)
    except ValueError as e:
        return str(e)
    return "ok"


def decode(ctx, q, k, v, sinks, q_pos):
    """decode_attention over this rank's striped slice of the cache, with a cap and sinks."""
    mine = torch.arange(ctx.rank, k.shape[1], ctx.world)
    return decode_attention(
        q,
        k[:, mine],
        v[:, mine],
        q_positions=q_pos,
        k_positions=mine,
        group=ctx.group,
        softcap=5.0,
        sinks=sinks,
    )
