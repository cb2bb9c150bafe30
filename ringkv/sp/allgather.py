"""All-gather-KV attention (the Llama 3 context-parallel recipe): gather K/V instead of rotating it.

Each rank holds ``q, k, v`` for its shard (in ``layout``). The local K/V is cut into ``chunks``
pieces along the sequence; K/V chunk ``c`` of every rank is all-gathered (K and V in one
message) while the previous one is computed: the gather of chunk ``c+1`` is posted before the
local queries attend chunk ``c`` (this rank's own piece first, needing no wait, then every
other rank's). Masks come from global positions (``ring.plan``: empty blocks are skipped) and
partials merge by LSE in float32. Backward: the chunks are gathered again (memory stays one
chunk per rank, not the whole K/V), dq accumulates locally, and the float32 dK/dV of each
gathered chunk is reduce-scattered back to its owners while the next chunk is computed.
Bytes per rank and forward: ``(N-1)`` x local K/V bytes (the ring's count, in one collective
per chunk instead of ``N-1`` hops).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .. import kernels
from .collectives import CommStats, agree_once, rank_world, start_all_gather, start_reduce_scatter
from .layout import chunks as layout_chunks
from .layout import cut
from ..kernels.merge import empty_partial
from ..kernels.mask import NO_WINDOW, check_window
from .ring import call_values, check_inputs, plan

__all__ = ["allgather_attention"]


class _Plan:
    """Who holds what: this rank's query ranges and every rank's K/V chunk ranges."""

    def __init__(
        self, s_local: int, layout: str, rank: int, world: int, n_chunks: int, window=NO_WINDOW
    ):
        self.window = window
        self.rank, self.world = rank, world
        ranges = [layout_chunks(s_local * world, layout, r, world) for r in range(world)]
        self.q = list(ranges[rank])
        self.bounds = [
            c * s_local // n_chunks for c in range(n_chunks + 1)
        ]  # local rows of chunk c
        self.k = [
            [cut(ranges[src], lo, hi) for src in range(world)]
            for lo, hi in zip(self.bounds, self.bounds[1:])
        ]

    def rows(self, c: int) -> slice:
        return slice(self.bounds[c], self.bounds[c + 1])


def _gather(kv, p: _Plan, c: int, group, timeout):
    return start_all_gather(kv[:, :, p.rows(c)], group, timeout, "allgather_attention")


def _message(k, v) -> torch.Tensor:
    """K and V as one message ``(2, B, S_l, Hkv, max(D, Dv))``: the narrower one zero-padded
    (MLA)."""
    d = max(k.shape[-1], v.shape[-1])
    return torch.stack([torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in (k, v)])


def _blocks(kv, p: _Plan, c: int, pending):
    """``(src, K/V chunk c of rank src (2, B, L, Hkv, max(D, Dv)))``: this rank's own chunk first,
    computed while the gather is in flight, then the other ranks' once it arrived."""
    yield p.rank, kv[:, :, p.rows(c)]
    gathered = pending.wait()  # (N, 2, B, L, Hkv, D)
    for src in range(p.world):
        if src != p.rank:
            yield src, gathered[src]


def _forward(q, k, v, scale, causal, p: _Plan, group, timeout, backend, softcap=None, into=None):
    """``into``: a ``CommStats`` to fill with the bytes this rank sent, or None."""
    b, s, h, d = q.shape
    dv = v.shape[-1]
    out, lse = empty_partial(b, s, h, dv, q.device)
    kv = _message(k, v)  # K and V travel as one message
    pending, sent = _gather(kv, p, 0, group, timeout), 0
    for c in range(len(p.k)):
        current, sent = pending, sent + pending.sent
        if c + 1 < len(p.k):  # post the next gather before computing this chunk
            pending = _gather(kv, p, c + 1, group, timeout)
        for src, blk in _blocks(kv, p, c, current):
            for qs, ks, mask in plan(p.q, p.k[c][src], causal, p.window):
                kernels.block_forward_into(
                    out[:, qs],
                    lse[:, :, qs],
                    q[:, qs],
                    blk[0][:, ks, :, :d],
                    blk[1][:, ks, :, :dv],
                    scale=scale,
                    mask=mask,
                    backend=backend,
                    softcap=softcap,
                )
    if into is not None:
        into.method, into.bytes_sent = "allgather", sent
    return out.to(q.dtype), lse


def _backward(
    dout, dlse, q, k, v, out, lse, scale, causal, p: _Plan, group, timeout, backend, softcap=None
):
    d, dv = k.shape[-1], v.shape[-1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _message(k, v)
    pending, reduces = _gather(kv, p, 0, group, timeout), []
    for c in range(len(p.k)):
        current = pending
        if c + 1 < len(p.k):
            pending = _gather(kv, p, c + 1, group, timeout)
        own = kv[:, :, p.rows(c)]
        dkv = torch.zeros(
            (p.world, *own.shape), dtype=torch.float32, device=q.device
        )  # every rank's chunk c
        for src, blk in _blocks(kv, p, c, current):
            for qs, ks, mask in plan(p.q, p.k[c][src], causal, p.window):
                kernels.block_backward_into(
                    dq[:, qs],
                    dkv[src, 0][:, ks, :, :d],
                    dkv[src, 1][:, ks, :, :dv],
                    dout[:, qs],
                    q[:, qs],
                    blk[0][:, ks, :, :d],
                    blk[1][:, ks, :, :dv],
                    out[:, qs],
                    lse[:, :, qs],
                    scale=scale,
                    mask=mask,
                    dlse=None if dlse is None else dlse[:, :, qs],
                    backend=backend,
                    softcap=softcap,
                )
        reduces.append(
            start_reduce_scatter(dkv, group, timeout, "allgather_attention")
        )  # back to the owners
    mine = torch.cat(
        [r.wait() for r in reduces], dim=2
    )  # (2, B, S_l, Hkv, max(D, Dv)): this rank's dK/dV, summed
    return dq.to(q.dtype), mine[0, ..., :d].to(k.dtype), mine[1, ..., :dv].to(v.dtype)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    timeout: Optional[timedelta] = None,
    check: bool = True,
    chunks: int = 2,
    window=NO_WINDOW,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[CommStats] = None,
):
    """Exact attention of this rank's query shard over the whole sequence, by all-gathering K/V.

    Args:
        q: ``(B, S_local, H, D)``, this rank's shard in ``layout``.
        k, v: ``(B, S_local, Hkv, D)``, ``(B, S_local, Hkv, Dv)`` with ``H % Hkv == 0``; only the
            ``Hkv`` heads travel (with ``Dv != D`` the narrower one padded in the message).
        causal, group, layout, softmax_scale, return_lse, backend, timeout, check, softcap, sinks:
            as
            in ``ring_attention``.
        chunks: K/V pieces gathered one after another, each overlapped with the previous
            piece's compute (at most ``S_local``).
        window: ``(left, right)`` as in ``ring_attention``: blocks outside it are not computed
            (the all-gather still moves every K/V piece).
        stats: a ``CommStats`` this call fills with the bytes this rank sent in the forward.

    Returns:
        ``out`` ``(B, S_local, H, Dv)`` in ``q.dtype`` (and float32 ``lse`` ``(B, H, S_local)``).
        Differentiable w.r.t. q, k, v (and sinks).
    """
    rank, n = rank_world(group)
    scale, softcap = check_inputs(
        q, k, v, causal, layout, softmax_scale, backend, n, softcap=softcap, sinks=sinks
    )
    window = check_window(window)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    n_chunks = min(chunks, q.shape[1])
    if check and n > 1:
        names, values = call_values(
            q, k, causal, layout, scale, backend, window, v=v, softcap=softcap, sinks=sinks
        )
        agree_once(
            values + [n_chunks], names + ["chunks"], group, timeout, "allgather_attention", q.device
        )
    p = _Plan(q.shape[1], layout, rank, n, n_chunks, window)
    args = (scale, causal, p, group, timeout, backend, softcap)
    out, lse = kernels.run_differentiable(
        _forward, _backward, q, k, v, args + (stats,), args, sinks=sinks
    )
    return (out, lse) if return_lse else out
