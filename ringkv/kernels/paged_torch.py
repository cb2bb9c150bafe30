"""Batched pure-torch paged attention: one gather + two einsums for all sequences.

Same contract as ``paged_base.paged_attention_reference`` (which loops over sequences); this
one pads every sequence to the longest in the batch and masks, so a decode step of many
sequences is a handful of tensor ops. Registered in ``paged`` as backend ``"torch"`` (the
default on CPU); ``plan_step`` builds a step's ``PagedPlan``s once for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .paged_base import (LayerCache, PagedSeq, RowsOut, SeqGroup, by_query_count, query_limits, striped_limits,
                         validate_paged)


class PagedPlan:
    """What attention over the cache reads for one step, computed once (the engine reuses it
    for every layer).

    ``blocks (N * nb,)``: the cache blocks holding each sequence's first ``L = nb * block_size``
    tokens (padded to the longest); ``visible (N, Q, L)``: query ``i`` of sequence
    ``n`` sees key ``j``; ``bias (N, 1, Q, L)``: the same as an additive mask (0 / ``-inf``).
    By default query ``i`` sits at position ``seq_lens[n] - Q + i`` and sees the keys up to it
    (all ``seq_lens[n]`` keys when not ``causal``); ``limits (N, Q)`` instead gives the number
    of leading keys each query sees (a rank holding every ``sp``-th token of a sequence).
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: Optional[torch.Tensor], num_queries: int,
                 block_size: int, *, causal: bool = True, dtype=torch.float32, limits: Optional[torch.Tensor] = None):
        n = block_table.shape[0]
        dev = block_table.device
        if limits is None:
            limits = query_limits(seq_lens.to(dev), num_queries, causal)  # (N, Q)
        limits = limits.to(dev, torch.long).clamp_min(0)  # (N, Q)
        nb = max(1, -(-int(limits.max()) // block_size)) if limits.numel() else 1
        self.n = n
        self.blocks = block_table[:, :nb].to(torch.long).clamp_min(0).reshape(-1)  # unused entries may be -1
        key = torch.arange(nb * block_size, device=dev)
        self.visible = key[None, None, :] < limits[:, :, None]  # (N, Q, L)
        self.sees = limits > 0  # (N, Q): the query sees a key
        self.all_see_a_key = bool(self.sees.all())
        self.bias = torch.zeros(self.visible.shape, dtype=dtype, device=dev).masked_fill(
            ~self.visible, float("-inf"))[:, None]  # (N, 1, Q, L)
        self._folded_bias = {}

    def folded_bias(self, g: int, dtype) -> torch.Tensor:
        """``bias`` for query rows folded g-major (``G * Q`` rows a K/V head, see ``_folded``):
        ``(N, 1, G*Q or 1, L)`` in ``dtype``, built once per step, not once per layer."""
        key = (g, dtype)
        if key not in self._folded_bias:
            bias = self.bias.to(dtype)
            self._folded_bias[key] = bias.repeat(1, 1, g, 1) if bias.shape[2] > 1 and g > 1 else bias
        return self._folded_bias[key]

    def gather(self, cache: LayerCache, dtype=None):
        """Each sequence's K/V ``(N, L, Hkv, D)``, dequantized to ``dtype`` (default float32) when
        the cache is quantized. Whole blocks are copied (index_select of ``block_size`` rows at
        once: ~5x faster on CPU than one index per token, which is ~6x faster than advanced
        indexing)."""
        k, v = cache.read_blocks(self.blocks, dtype)  # (N * nb, block_size, Hkv, D)
        return k.view(self.n, -1, *k.shape[2:]), v.view(self.n, -1, *v.shape[2:])


def paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, *, scale: Optional[float] = None,
                          causal: bool = True, k_scale=None, v_scale=None):
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    plan = PagedPlan(block_table.to(q.device), seq_lens, q.shape[1], k_cache.shape[1], causal=causal)
    return paged_attention_lse(q, LayerCache(k_cache, v_cache, k_scale, v_scale), plan, scale=scale)


def _folded(q, plan: PagedPlan, hkv: int):
    """``q (N, Q, H, D)`` with the G query heads of a K/V head as G * Q query rows of one head:
    ``(N, Hkv, G*Q, D)``, and the plan's additive mask for those rows ``(N, 1, G*Q or 1, L)``.
    An attention kernel then reads each K/V head once for all G of them (SDPA's enable_gqa reads
    it once per query head: 64 decode rows, SmolLM2's 9 / 3 heads, 1.85 -> 1.14 ms a layer on
    the 2-core VM)."""
    n, nq, h, d = q.shape
    g = h // hkv
    qg = q.reshape(n, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * nq, d)  # (N, Hkv, G*Q, D)
    return qg, plan.folded_bias(g, q.dtype)


def _unfolded(out, n: int, nq: int, hkv: int):
    """``(N, Hkv, G*Q, D)`` rows back to ``(N, Q, H, D)``."""
    d = out.shape[-1]
    return out.reshape(n, hkv, -1, nq, d).permute(0, 3, 1, 2, 4).reshape(n, nq, -1, d)


def paged_attention_lse(q, cache: LayerCache, plan: PagedPlan, *, scale: Optional[float] = None):
    """``(out (N, Q, H, D), lse float32 (N, H, Q))`` of ``q`` over the cache as ``plan`` describes;
    a query that sees no key gives ``out = 0``, ``lse = -inf``. On CPU: the fused flash op, which
    returns the lse (the matmul path below copies the gathered K/V twice more for its strides)."""
    n, nq, h, d = q.shape
    hkv = cache.k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    compute = torch.float32 if q.dtype != torch.float64 else q.dtype
    k, v = plan.gather(cache, compute)  # (N, L, Hkv, D)
    k, v = k.to(compute), v.to(compute)
    qg, bias = _folded(q.to(compute), plan, hkv)  # (N, Hkv, G*Q, D), (N, 1, G*Q or 1, L)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=bias, scale=scale)  # lse (N, Hkv, G*Q)
        if not plan.all_see_a_key:  # rows with no key: out 0, lse -inf (the kernel's are undefined)
            seen = plan.sees[:, None, None, :].expand(n, hkv, h // hkv, nq).reshape(lse.shape)
            out = torch.where(seen[..., None], out, torch.zeros((), dtype=out.dtype))
            lse = torch.where(seen, lse, torch.full((), float("-inf"), dtype=lse.dtype))
    else:
        s = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale + bias  # (N, Hkv, G*Q, L)
        m = s.amax(dim=-1, keepdim=True)  # (N, Hkv, G*Q, 1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key: p = 0, not NaN
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, v.permute(0, 2, 1, 3)) / denom.clamp_min(1e-30)  # (N, Hkv, G*Q, D)
        lse = m + denom.log()
    return _unfolded(out, n, nq, hkv).to(q.dtype), lse.reshape(n, h, nq).float()  # heads (Hkv, G)-major like q's


def paged_attention_planned(q, cache: LayerCache, plan: PagedPlan, *, scale: Optional[float] = None):
    """``out (N, Q, H, D)`` of ``q (N, Q, H, D)`` over the cache as ``plan`` describes (no lse:
    the engine's fast path; use ``paged_attention_lse`` when partials must be merged)."""
    if not plan.all_see_a_key:  # a fully masked row would be NaN in SDPA; the general path handles it
        raise ValueError("a query row sees no key; use paged_attention_lse")
    n, nq, h, d = q.shape
    k, v = plan.gather(cache, q.dtype)  # (N, L, Hkv, D)
    qg, bias = _folded(q, plan, k.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)  # (N, Hkv, G*Q, D)
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
    return [ordered[i * len(ordered) // k:(i + 1) * len(ordered) // k] for i in range(k)]


class TorchStep:
    """The ``"torch"`` backend's metadata for one step: one ``PagedPlan`` (gather indices and
    mask) per group of sequences with the same query count and similar lengths, built once,
    used by every layer."""

    def __init__(self, seqs: Sequence[PagedSeq], *, block_size: int, sp: int = 1, sp_rank: int = 0, device=None):
        self.groups: List[PlannedGroup] = []
        parts = [(n, members) for n, same_n in by_query_count(seqs).items()
                 for members in by_length(same_n, sp, sp_rank)]
        for n, members in parts:
            g = SeqGroup.build(n, members, sp, sp_rank, device)
            limits = striped_limits(members, n, sp, sp_rank, device)  # (N, n)
            self.groups.append(PlannedGroup(g, PagedPlan(g.block_table, None, n, block_size, limits=limits)))

    def attend(self, q, cache: LayerCache, *, lse: bool = True) -> List[RowsOut]:
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, D), lse (H, N*n) or None
        if lse:
            return [p.group.result(*paged_attention_lse(p.group.queries(q), cache, p.plan)) for p in self.groups]
        return [p.group.result(paged_attention_planned(p.group.queries(q), cache, p.plan)) for p in self.groups]


plan_step = TorchStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
