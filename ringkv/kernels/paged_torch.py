"""Batched pure-torch paged attention: one gather + two einsums for all sequences.

Same contract as ``paged_base.paged_attention_reference`` (which loops over sequences); this
one pads every sequence to the longest in the batch and masks, so a decode step of many
sequences is a handful of tensor ops. Registered in ``paged`` as backend ``"torch"`` (the
default on CPU); ``plan_step`` builds a step's ``PagedPlan``s once for every layer.

The features (``paged_base``): a ``window`` is one more bound of the plan's mask (built once per
step and window, ``PagedPlan.windowed``); a ``softcap`` takes the explicit path (scores, cap,
softmax: SDPA has no cap); a V head size ``Dv != D`` zero-pads the smaller of the two for the
fused CPU kernel, which needs one head size (exact: the padded products are 0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .checks import resolve_scale
from .paged_base import (
    LayerCache,
    PagedSeq,
    RowsOut,
    SeqGroup,
    by_query_count,
    check_features,
    query_limits,
    striped_limits,
    validate_paged,
)


class PagedPlan:
    """What attention over the cache reads for one step, computed once (the engine reuses it
    for every layer).

    ``blocks (N * nb,)``: the cache blocks holding each sequence's first ``L = nb * block_size``
    tokens (padded to the longest); ``visible (N, Q, L)``: query ``i`` of sequence
    ``n`` sees key ``j``; ``bias (N, 1, Q, L)``: the same as an additive mask (0 / ``-inf``).
    By default query ``i`` sits at position ``seq_lens[n] - Q + i`` and sees the keys up to it
    (all ``seq_lens[n]`` keys when not ``causal``); ``limits (N, Q)`` instead gives the number
    of leading keys each query sees (a rank holding every ``sp``-th token of a sequence), and
    ``positions (N, Q)`` the queries' global positions (needed for a window: local key ``j`` sits
    at ``sp_rank + j * sp``). ``windowed(W)`` is the same plan with keys ``< p - W`` hidden too.
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: Optional[torch.Tensor],
        num_queries: int,
        block_size: int,
        *,
        causal: bool = True,
        dtype=torch.float32,
        limits: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        sp: int = 1,
        sp_rank: int = 0,
    ):
        n = block_table.shape[0]
        dev = block_table.device
        if limits is None:
            limits = query_limits(seq_lens.to(dev), num_queries, causal)  # (N, Q)
            if positions is None:  # the queries are the last Q of seq_lens keys
                positions = query_limits(seq_lens.to(dev), num_queries, True) - 1
        limits = limits.to(dev, torch.long).clamp_min(0)  # (N, Q)
        nb = max(1, -(-int(limits.max()) // block_size)) if limits.numel() else 1
        self.n, self.dtype, self.sp, self.sp_rank = n, dtype, sp, sp_rank
        self.limits = limits
        self.positions = None if positions is None else positions.to(dev, torch.long)  # (N, Q)
        table = block_table[:, :nb].to(torch.long).clamp_min(0)  # unused entries may be -1
        if table.shape[1] < nb:  # no key here at all (another SP rank holds them): block 0, masked
            table = torch.nn.functional.pad(table, (0, nb - table.shape[1]))
        self.blocks = table.reshape(-1)
        self.key = torch.arange(nb * block_size, device=dev)  # (L,) local key index
        self._mask(self.key[None, None, :] < limits[:, :, None], limits > 0)  # (N, Q, L), (N, Q)
        self._windowed = {}

    def _mask(self, visible: torch.Tensor, sees: torch.Tensor) -> None:
        """Set ``visible (N, Q, L)``, ``sees (N, Q)`` (the query sees a key) and what follows:
        ``bias``, ..."""
        self.visible, self.sees = visible, sees
        self.all_see_a_key = bool(self.sees.all())
        self.bias = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(
            ~visible, float("-inf")
        )[:, None]  # (N, 1, Q, L)
        self._folded_bias = {}

    def windowed(self, window: int) -> "PagedPlan":
        """This plan with a window: a query at global position ``p`` also hides keys before
        ``p - window``; built once per window (``-1``: this plan itself)."""
        if window < 0:
            return self
        if window not in self._windowed:
            if self.positions is None:
                raise ValueError(
                    "a window needs the queries' positions: build the plan with positions="
                )
            first = (
                self.positions - window - self.sp_rank
            )  # (N, Q): keys at global positions >= p - W
            first = torch.div(first + self.sp - 1, self.sp, rounding_mode="floor").clamp_min(
                0
            )  # local index
            plan = copy.copy(self)
            plan._windowed = {}
            visible = self.visible & (self.key[None, None, :] >= first[:, :, None])
            plan._mask(visible, visible.any(-1))
            self._windowed[window] = plan
        return self._windowed[window]

    def folded_bias(self, g: int, dtype) -> torch.Tensor:
        """``bias`` for query rows folded g-major (``G * Q`` rows a K/V head, see ``_folded``):
        ``(N, 1, G*Q or 1, L)`` in ``dtype``, built once per step, not once per layer."""
        key = (g, dtype)
        if key not in self._folded_bias:
            bias = self.bias.to(dtype)
            self._folded_bias[key] = (
                bias.repeat(1, 1, g, 1) if bias.shape[2] > 1 and g > 1 else bias
            )
        return self._folded_bias[key]

    def gather(self, cache: LayerCache, dtype=None):
        """Each sequence's K ``(N, L, Hkv, D)`` and V ``(N, L, Hkv, Dv)``, dequantized to ``dtype``
        (default float32) when the cache is quantized. Whole blocks are copied (index_select of
        ``block_size`` rows at once: ~5x faster on CPU than one index per token, which is ~6x faster
        than advanced indexing)."""
        k, v = cache.read_blocks(self.blocks, dtype)  # (N * nb, block_size, Hkv, D)
        return k.view(self.n, -1, *k.shape[2:]), v.view(self.n, -1, *v.shape[2:])


def paged_attention_torch(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    softcap: Optional[float] = None,
    window: int = -1,
):
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, softcap, window)
    plan = PagedPlan(
        block_table.to(q.device), seq_lens, q.shape[1], k_cache.shape[1], causal=causal
    )
    return paged_attention_lse(
        q,
        LayerCache(k_cache, v_cache, k_scale, v_scale),
        plan.windowed(window),
        scale=scale,
        softcap=softcap,
    )


def _folded(q, plan: PagedPlan, hkv: int):
    """``q (N, Q, H, D)`` with the G query heads of a K/V head as G * Q query rows of one head:
    ``(N, Hkv, G*Q, D)``, and the plan's additive mask for those rows ``(N, 1, G*Q or 1, L)``.
    An attention kernel then reads each K/V head once for all G of them (SDPA's enable_gqa reads
    it once per query head: 64 decode rows, SmolLM2's 9 / 3 heads, 1.85 -> 1.14 ms a layer on
    the 2-core VM)."""
    n, nq, h, d = q.shape
    g = h // hkv
    qg = (
        q.reshape(n, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * nq, d)
    )  # (N, Hkv, G*Q, D)
    return qg, plan.folded_bias(g, q.dtype)


def _unfolded(out, n: int, nq: int, hkv: int):
    """``(N, Hkv, G*Q, Dv)`` rows back to ``(N, Q, H, Dv)``."""
    d = out.shape[-1]
    return out.reshape(n, hkv, -1, nq, d).permute(0, 3, 1, 2, 4).reshape(n, nq, -1, d)


def _one_head_size(qg, k, v):
    """``qg (.., D)``, ``k (.., D)``, ``v (.., Dv)`` with the smaller of ``D``/``Dv`` zero-padded to
    the larger (the fused CPU kernel takes one head size; the padded products are exactly 0), and
    ``Dv``."""
    d, dv = k.shape[-1], v.shape[-1]
    if d < dv:
        qg, k = (torch.nn.functional.pad(t, (0, dv - d)) for t in (qg, k))
    elif dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    return qg, k, v, dv


def paged_attention_lse(
    q,
    cache: LayerCache,
    plan: PagedPlan,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
):
    """``(out (N, Q, H, Dv), lse float32 (N, H, Q))`` of ``q`` over the cache as ``plan`` describes
    (``plan.windowed(W)`` for a window); a query that sees no key gives ``out = 0``, ``lse = -inf``.
    On CPU: the fused flash op, which returns the lse (the matmul path below copies the gathered
    K/V twice more for its strides); with a ``softcap`` the matmul path, scores capped before the
    mask."""
    n, nq, h, d = q.shape
    hkv = cache.k.shape[2]
    scale = d**-0.5 if scale is None else scale
    compute = torch.float32 if q.dtype != torch.float64 else q.dtype
    k, v = plan.gather(cache, compute)  # (N, L, Hkv, D), (N, L, Hkv, Dv)
    k, v = k.to(compute), v.to(compute)
    qg, bias = _folded(q.to(compute), plan, hkv)  # (N, Hkv, G*Q, D), (N, 1, G*Q or 1, L)
    if q.device.type == "cpu" and softcap is None:
        qg, k, v, dv = _one_head_size(qg, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=bias, scale=scale
        )  # lse (N, Hkv, G*Q)
        out = out[..., :dv]
        if not plan.all_see_a_key:  # rows with no key: out 0, lse -inf (the kernel's are undefined)
            seen = plan.sees[:, None, None, :].expand(n, hkv, h // hkv, nq).reshape(lse.shape)
            out = torch.where(seen[..., None], out, torch.zeros((), dtype=out.dtype))
            lse = torch.where(seen, lse, torch.full((), float("-inf"), dtype=lse.dtype))
    else:
        s = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # (N, Hkv, G*Q, L)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s + bias
        m = s.amax(dim=-1, keepdim=True)  # (N, Hkv, G*Q, 1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key: p = 0, not NaN
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, v.permute(0, 2, 1, 3)) / denom.clamp_min(1e-30)  # (N, Hkv, G*Q, Dv)
        lse = m + denom.log()
    return _unfolded(out, n, nq, hkv).to(q.dtype), lse.reshape(
        n, h, nq
    ).float()  # heads (Hkv, G)-major like q's


def paged_attention_planned(
    q, cache: LayerCache, plan: PagedPlan, *, scale: Optional[float] = None
):
    """``out (N, Q, H, Dv)`` of ``q (N, Q, H, D)`` over the cache as ``plan`` describes (no lse:
    the engine's fast path; use ``paged_attention_lse`` when partials must be merged, or for a
    softcap)."""
    if (
        not plan.all_see_a_key
    ):  # a fully masked row would be NaN in SDPA; the general path handles it
        raise ValueError("a query row sees no key; use paged_attention_lse")
    n, nq, h, d = q.shape
    k, v = plan.gather(cache, q.dtype)  # (N, L, Hkv, D), (N, L, Hkv, Dv)
    qg, bias = _folded(q, plan, k.shape[2])
    if (
        k.shape[-1] != v.shape[-1]
    ):  # SDPA's fused kernels take one head size: pad (exact), keep the default scale
        scale = resolve_scale(scale, d)
        qg, k, v, dv = _one_head_size(qg, k, v)
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )  # (N, Hkv, G*Q, Dv)
    if out.shape[-1] != cache.v.shape[-1]:
        out = out[..., : cache.v.shape[-1]]
    return _unfolded(out, n, nq, k.shape[2])


@dataclass(frozen=True)
class PlannedGroup:
    """A group of sequences with the same query count and what it reads from the cache."""

    group: SeqGroup
    plan: PagedPlan


GROUP_MIN = 16  # sequences per gather at least, when a step's sequences are split by length


def by_length(seqs: Sequence[PagedSeq], sp: int, sp_rank: int) -> List[List[PagedSeq]]:
    """``seqs`` (same query count) sorted by their keys here, in chunks of ``GROUP_MIN`` or more:
    each chunk's K/V are padded to its own longest, not the step's (64 decode rows of 20-320
    keys: 3.9 -> 2.5 ms a layer on the 2-core VM; fewer than ``2 * GROUP_MIN`` stay one group)."""
    if len(seqs) < 2 * GROUP_MIN:
        return [list(seqs)]
    ordered = sorted(seqs, key=lambda s: s.keys(sp, sp_rank))
    k = len(ordered) // GROUP_MIN
    return [ordered[i * len(ordered) // k : (i + 1) * len(ordered) // k] for i in range(k)]


class TorchStep:
    """The ``"torch"`` backend's metadata for one step: one ``PagedPlan`` (gather indices and
    mask) per group of sequences with the same query count and similar lengths, built once,
    used by every layer."""

    def __init__(
        self,
        seqs: Sequence[PagedSeq],
        *,
        block_size: int,
        sp: int = 1,
        sp_rank: int = 0,
        device=None,
    ):
        self.groups: List[PlannedGroup] = []
        parts = [
            (n, members)
            for n, same_n in by_query_count(seqs).items()
            for members in by_length(same_n, sp, sp_rank)
        ]
        for n, members in parts:
            g = SeqGroup.build(n, members, sp, sp_rank, device)
            limits = striped_limits(members, n, sp, sp_rank, device)  # (N, n)
            positions = torch.tensor([s.start for s in members], device=device)[
                :, None
            ] + torch.arange(n, device=device)  # (N, n) global
            self.groups.append(
                PlannedGroup(
                    g,
                    PagedPlan(
                        g.block_table,
                        None,
                        n,
                        block_size,
                        limits=limits,
                        positions=positions,
                        sp=sp,
                        sp_rank=sp_rank,
                    ),
                )
            )

    def attend(
        self,
        q,
        cache: LayerCache,
        *,
        lse: bool = True,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ) -> List[RowsOut]:
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, Dv), lse (H, N*n) or None
        if softcap is not None or window != -1:
            softcap, window = check_features(softcap, window)
        parts = []
        for p in self.groups:
            plan = p.plan.windowed(window)
            if (
                lse or softcap is not None or not plan.all_see_a_key
            ):  # SDPA: no cap, NaN for a row with no key
                o, ls = paged_attention_lse(
                    p.group.queries(q), cache, plan, scale=scale, softcap=softcap
                )
                parts.append(p.group.result(o, ls if lse else None))
            else:
                parts.append(
                    p.group.result(
                        paged_attention_planned(p.group.queries(q), cache, plan, scale=scale)
                    )
                )
        return parts


plan_step = (
    TorchStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
)
