"""Causal attention with bidirectional spans (Gemma 3's images) run on every rank of a gloo world:
ring, Ulysses and USP (``dims``: the 2D mesh of ``tests.variant_cases``)."""

from __future__ import annotations

import ringkv
from tests.variant_cases import _shard, _where


def forward_backward(ctx, method, q, k, v, dout, dlse, layout, window, spans, dims=None):
    """One method's forward + backward on this rank's shard with ``spans``: out, lse, dq, dk, dv
    and the global positions of this rank's rows."""
    where = _where(ctx, dims)
    fn = dict(ring=ringkv.ring_attention, ulysses=ringkv.ulysses_attention)
    fn = ringkv.usp_attention if dims is not None else fn[method]
    ql, kl, vl = (_shard(t, layout, where).clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(
        ql, kl, vl, causal=True, layout=layout, return_lse=True, window=window, spans=spans, **where
    )
    loss = (out.float() * _shard(dout, layout, where)).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * _shard(dlse, layout, where, dim=2)).sum()
    loss.backward()
    if "group" in where:
        pos = ringkv.positions(q.shape[1], layout, ctx.rank, ctx.world)
    else:
        pos = ringkv.positions(q.shape[1], layout, **where)
    return out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad, pos
