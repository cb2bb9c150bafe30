"""Ulysses (DeepSpeed-Ulysses) attention: all-to-all from sequence shards to head shards.

Each rank holds ``q, k, v`` for its shard of the sequence (in ``layout``). One all-to-all (q, K
and V packed into one message per pair of ranks) gives every rank the whole sequence for its
query heads and the KV heads they use; the gathered tokens are put in global order so one plain
causal single-device attention (a fused kernel) computes them; a second all-to-all brings ``out``
(and ``lse``) back to sequence shards. Differentiable: an all-to-all's backward is the same
exchange of the gradients. Bytes sent per rank: about ``(N-1)/N`` of local q, K, V and out.

Any head count (``HeadSplit``): ``H`` query heads over ``N <= H`` ranks go in consecutive runs of
``ceil(H/N)`` heads (the first ``H % N`` ranks) or ``floor(H/N)``, by ``all_to_all_single`` with
per-rank sizes (no zero-head padding: padding sends and computes heads no one reads). Each rank
receives the KV heads its query heads use, once: a KV head whose group of query heads straddles
two ranks is sent to both (the gradients of the copies sum back to the owner). Where a rank's run
of query heads does not start and end on its KV groups (9 heads, 3 KV heads over 2 ranks: heads
0-4 use KV heads 0, 0, 0, 1, 1), it repeats its received KV heads locally, after the exchange, to
the largest group size ``g'`` its run aligns to, so that the kernel's GQA rule (query head ``i``
uses KV head ``i // g'``) holds on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels.mask import NO_WINDOW, check_window
from .collectives import CommStats, agree_once, all_to_all_sizes, rank_world
from .layout import gather_order
from .comm import LocalComm
from .ring import Shards, call_values, check_inputs, ring_attention_shards, with_spans

__all__ = ["ulysses_attention", "HeadSplit", "head_split"]


@dataclass(frozen=True)
class HeadSplit:
    """How ``world`` ranks split ``heads`` query heads and the ``kv_heads`` KV heads they use
    (``heads % kv_heads == 0``, ``1 <= world <= heads``). Rank ``r`` gets query heads
    ``q_heads(r)`` (``ceil(H/N)`` of them for ``r < H % N``, else ``floor(H/N)``), receives KV heads
    ``kv_heads_of(r)`` and runs its kernel with ``local_kv(r)`` KV heads (None: the received ones
    as they are)."""

    heads: int
    kv_heads: int
    world: int

    def q_heads(self, rank: int) -> range:
        base, extra = divmod(self.heads, self.world)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def kv_heads_of(self, rank: int) -> range:
        g, q = self.heads // self.kv_heads, self.q_heads(rank)
        return range(q.start // g, -(-q.stop // g))

    def group(self, rank: int) -> int:
        """The GQA group size of rank ``rank``'s kernel: the largest divisor of its query head count
        whose consecutive runs of heads each use one KV head."""
        q, full = self.q_heads(rank), self.heads // self.kv_heads
        return max(
            g
            for g in range(1, len(q) + 1)
            if len(q) % g == 0 and all(h // full == (h + g - 1) // full for h in q[::g])
        )

    def local_kv(self, rank: int) -> Optional[List[int]]:
        """The received KV heads (indices into ``kv_heads_of(rank)``) the kernel runs with, one
        per ``group(rank)`` query heads; None when that is each received head once."""
        q, kv = self.q_heads(rank), self.kv_heads_of(rank)
        full = self.heads // self.kv_heads
        index = [h // full - kv.start for h in range(q.start, q.stop, self.group(rank))]
        return None if index == list(range(len(kv))) else index


def head_split(h: int, hkv: int, world: int, what: str = "ulysses_attention") -> HeadSplit:
    """The ``HeadSplit`` of ``h`` query heads and ``hkv`` KV heads over ``world`` ranks;
    ``ValueError`` naming the valid world sizes (and what to use instead) when a rank would get no
    query head (``world > h``)."""
    if world > h:
        raise ValueError(
            f"{what} over {world} ranks splits the {h} query heads (kv heads {hkv}): every rank "
            f"needs at least one, so heads ({h}) must be >= {world}; valid world sizes for "
            f"heads={h}: 1..{h}. For more ranks use USP with ulysses <= {h} "
            f"(usp_attention, or patch_model(method='usp')) or the ring"
        )
    return HeadSplit(h, hkv, world)


def _bytes(x: torch.Tensor, world: int) -> int:
    return x.numel() * x.element_size() // world * (world - 1)


def scatter_heads(q, k, v, split: HeadSplit, group, timeout, what):
    """Sequence shards -> head shards over ``group`` (N ranks), differentiable.

    q ``(B, S_l, H, D)``, k ``(B, S_l, Hkv, D)``, v ``(B, S_l, Hkv, Dv)`` -> this rank's q
    ``(B, N*S_l, H_r, D)`` and k/v ``(B, N*S_l, Hkv_r, D or Dv)`` (``split``'s heads of rank ``r``,
    K/V repeated to ``local_kv(r)``): every rank's tokens in rank order. Also returns the bytes
    sent.
    """
    b, s, _, d = q.shape
    dv = v.shape[-1]
    rank, n = rank_world(group)
    runs = []  # for rank j: its query heads, then the KV heads they use, of k and of v
    for j in range(n):
        qj, kvj = split.q_heads(j), split.kv_heads_of(j)
        qj, kvj = slice(qj.start, qj.stop), slice(kvj.start, kvj.stop)
        runs += [q[:, :, qj], k[:, :, kvj], v[:, :, kvj]]
    send = [sum(t.numel() for t in runs[3 * j : 3 * j + 3]) for j in range(n)]
    hq, hkv = len(split.q_heads(rank)), len(split.kv_heads_of(rank))
    sizes = [b * s * hq * d, b * s * hkv * d, b * s * hkv * dv]  # what each rank sends here
    flat = torch.cat([t.reshape(-1) for t in runs])  # (sum(send),)
    got = all_to_all_sizes(flat, send, [sum(sizes)] * n, group, timeout, what)  # (N * sum(sizes),)
    parts = got.view(n, -1).split(sizes, dim=1)  # from rank i: (N, B*S_l*heads*dim) each
    qh, kh, vh = (
        x.view(n, b, s, heads, dim).transpose(0, 1).reshape(b, n * s, heads, dim)
        for x, heads, dim in zip(parts, (hq, hkv, hkv), (d, d, dv))
    )  # (B, N*S_l, heads, dim): rank i's tokens in rows [i*S_l, (i+1)*S_l)
    local = split.local_kv(rank)
    if local is not None:  # a run not aligned on KV groups: repeat after the exchange
        index = torch.tensor(local, device=kh.device)
        kh, vh = kh.index_select(2, index), vh.index_select(2, index)
    sent = (sum(send) - send[rank]) * flat.element_size()
    return qh, kh, vh, sent


def _heads_back(x, heads: List[int], dim: int, group, timeout, what):
    """``x`` ``(N, *row)``: row ``j`` (this rank's heads, at ``dim`` of ``row``, of rank ``j``'s
    tokens) goes to rank ``j``. Returns what every rank sent here, joined along the heads (rank
    ``i`` sends ``heads[i]`` of them), and the bytes sent."""
    n, row = x.shape[0], list(x.shape[1:])
    flat = x.reshape(-1)
    shapes = [row[:dim] + [h] + row[dim + 1 :] for h in heads]
    recv = [math.prod(shape) for shape in shapes]
    got = all_to_all_sizes(flat, [flat.numel() // n] * n, recv, group, timeout, what)
    parts = [t.view(shape) for t, shape in zip(got.split(recv), shapes)]
    return torch.cat(parts, dim), _bytes(flat, n)


def gather_heads(out, lse, split: HeadSplit, group, timeout, what):
    """Head shards -> sequence shards: out ``(B, N*S_l, H_r, Dv)`` (rows in rank order) ->
    ``(B, S_l, H, Dv)``; lse (or ``None``) ``(B, H_r, N*S_l)`` -> ``(B, H, S_l)``. Differentiable.
    Also returns the bytes sent."""
    b, s_all, hr, dv = out.shape
    n = rank_world(group)[1]
    s = s_all // n
    heads = [len(split.q_heads(j)) for j in range(n)]
    rows = out.reshape(b, n, s, hr, dv).transpose(0, 1)  # (N, B, S_l, H_r, Dv): rank j's tokens
    out, sent = _heads_back(rows, heads, 2, group, timeout, what)  # (B, S_l, H, Dv)
    if lse is not None:
        rows = lse.reshape(b, hr, n, s).permute(2, 0, 1, 3)  # (N, B, H_r, S_l)
        lse, more = _heads_back(rows, heads, 1, group, timeout, what)  # (B, H, S_l)
        sent += more
    return out, lse, sent


def ulysses_attention(
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
    window=NO_WINDOW,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[CommStats] = None,
    spans=None,
):
    """Exact attention of this rank's query shard over the whole sharded sequence, by head shards.

    Args:
        q: ``(B, S_local, H, D)``, this rank's shard in ``layout``; any ``H >= N`` (rank ``r``
            computes the heads ``head_split(H, Hkv, N).q_heads(r)``).
        k, v: ``(B, S_local, Hkv, D)``, ``(B, S_local, Hkv, Dv)``; any ``Hkv`` dividing ``H``.
        causal: mask ``q_pos >= k_pos`` on global positions.
        group: the SP process group (default: the world; no process group = one rank).
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see ``ringkv.sp.layout``).
        softmax_scale, backend, timeout, check, window, softcap: as in ``ring_attention``.
        sinks: ``(H,)``; each rank applies its heads' sinks (their gradient lands on this rank's
            heads for every row: the sum over the group is the whole gradient).
        return_lse: also return the float32 LSE ``(B, H, S_local)``.
        stats: a ``CommStats`` this call fills with the bytes this rank sent (both all-to-alls).
        spans: bidirectional spans in causal attention, as in ``ring_attention``.

    Returns:
        ``out`` ``(B, S_local, H, Dv)`` in ``q.dtype`` (and ``lse``). Differentiable w.r.t. q, k, v
        (and sinks).
    """
    rank, n = rank_world(group)
    scale, softcap = check_inputs(
        q, k, v, causal, layout, softmax_scale, backend, n, softcap=softcap, sinks=sinks
    )
    split = head_split(q.shape[2], k.shape[2], n)
    window = check_window(window)
    seq_len = q.shape[1] * n
    spans = with_spans(spans, causal, q.shape[0], seq_len)
    if check and n > 1:
        names, values = call_values(
            q, k, causal, layout, scale, backend, window, None, v, softcap, sinks, spans
        )
        agree_once(values, names, group, timeout, "ulysses_attention", q.device)
    # (B, S, H_r, D), (B, S, Hkv_r, D or Dv): this rank's heads, rows in rank order
    qh, kh, vh, sent = scatter_heads(q, k, v, split, group, timeout, "ulysses_attention")
    # only a causal or windowed mask needs the tokens in global order
    in_order = layout == "contiguous" or n == 1 or (not causal and window == NO_WINDOW)
    if not in_order:  # global order, so that plain causal (a fused kernel) applies
        # the global position of each row, and its inverse
        index, order = gather_order(seq_len, layout, n, q.device)
        qh, kh, vh = (t.index_select(1, order) for t in (qh, kh, vh))
    mine = split.q_heads(rank)
    local_sinks = None if sinks is None else sinks[mine.start : mine.stop]  # (H_r,)
    if spans is None:
        out, lse = kernels.attention(
            qh,
            kh,
            vh,
            scale=scale,
            causal=causal,
            window=window,
            backend=backend,
            softcap=softcap,
            sinks=local_sinks,
        )
    else:  # the ring's plan on one rank: the causal call and the spans' extra calls
        whole = Shards(((range(seq_len),),), ((range(seq_len),),), spans=spans)
        out, lse = ring_attention_shards(
            qh,
            kh,
            vh,
            whole,
            causal=True,
            comm=LocalComm(0, 1),
            softmax_scale=scale,
            backend=backend,
            window=window,
            softcap=softcap,
            sinks=local_sinks,
        )
    if not in_order:  # back to rank order
        out, lse = out.index_select(1, index), lse.index_select(2, index)
    out, lse, sent_back = gather_heads(
        out, lse if return_lse else None, split, group, timeout, "ulysses_attention"
    )
    if stats is not None:
        stats.method, stats.bytes_sent = "ulysses", sent + sent_back
    return (out, lse) if return_lse else out
