"""Batched pure-torch paged attention: one gather + two einsums for all sequences.

Same contract as ``paged.paged_attention_reference`` (which loops over sequences); this one
pads every sequence to the longest in the batch and masks, so a decode step of many
sequences is a handful of tensor ops. Registered in ``paged`` as backend ``"torch"``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import paged


def paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, *, scale: Optional[float] = None,
                          causal: bool = True):
    paged.validate_paged(q, k_cache, v_cache, block_table, seq_lens)
    n, nq, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d ** -0.5 if scale is None else scale
    lens = seq_lens.to(q.device, torch.long)
    nb = max(1, -(-int(lens.max()) // bs)) if n else 1
    table = block_table[:, :nb].to(q.device, torch.long).clamp_min(0)  # unused entries may be -1
    k = k_cache.index_select(0, table.reshape(-1)).reshape(n, nb * bs, hkv, d)  # (N, L, Hkv, D)
    v = v_cache.index_select(0, table.reshape(-1)).reshape(n, nb * bs, hkv, v_cache.shape[-1])
    g = h // hkv
    compute = torch.float32 if q.dtype != torch.float64 else q.dtype
    qg = q.reshape(n, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * nq, d)  # (N, Hkv, G*Q, D)
    s = torch.matmul(qg.to(compute), k.permute(0, 2, 3, 1).to(compute)) * scale  # (N, Hkv, G*Q, L)
    key = torch.arange(nb * bs, device=q.device)
    visible = key[None, None, :] < lens[:, None, None]  # (N, 1, L)
    if causal:
        qpos = lens[:, None] - nq + torch.arange(nq, device=q.device)[None, :]  # (N, Q)
        visible = visible & (key[None, None, :] <= qpos[:, :, None])  # (N, Q, L)
    visible = visible.expand(n, nq, nb * bs).repeat(1, g, 1)[:, None]  # (N, 1, G*Q, L) rows g-major
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (N, Hkv, G*Q, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key: p = 0, not NaN
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v.permute(0, 2, 1, 3).to(compute)) / denom.clamp_min(1e-30)  # (N, Hkv, G*Q, D)
    lse = (m + denom.log()).reshape(n, h, nq)  # heads are (Hkv, G)-major like q's
    out = out.reshape(n, hkv, g, nq, -1).permute(0, 3, 1, 2, 4).reshape(n, nq, h, -1)
    return out.to(q.dtype), lse.float()

paged._BACKENDS.setdefault("torch", paged_attention_torch)


class PagedPlan:
    """What every layer of one engine step reads from the cache, computed once per step.

    ``slots (N, L)``: flat cache slots (``block * block_size + offset``) of each sequence's
    first ``L`` tokens (padded to the longest); ``bias (N, 1, Q, L)``: 0 where query ``i`` of
    sequence ``n`` (at position ``seq_lens[n] - Q + i``) sees key ``j``, ``-inf`` elsewhere.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_queries: int, block_size: int,
                 *, causal: bool = True, dtype=torch.float32):
        n = block_table.shape[0]
        lens = seq_lens.to(torch.long)
        nb = max(1, -(-int(lens.max()) // block_size))
        table = block_table[:, :nb].to(torch.long).clamp_min(0)
        offsets = torch.arange(block_size, device=table.device)
        self.slots = (table[:, :, None] * block_size + offsets).reshape(n, nb * block_size)  # (N, L)
        key = torch.arange(nb * block_size, device=table.device)
        visible = (key[None, None, :] < lens[:, None, None]).expand(n, num_queries, nb * block_size)
        if causal:
            qpos = lens[:, None] - num_queries + torch.arange(num_queries, device=table.device)[None, :]
            visible = visible & (key[None, None, :] <= qpos[:, :, None])  # (N, Q, L)
        self.all_see_a_key = bool(visible.any(-1).all())
        self.bias = torch.zeros(visible.shape, dtype=dtype, device=table.device).masked_fill(
            ~visible, float("-inf"))[:, None]  # (N, 1, Q, L)


def paged_attention_planned(q, k_cache, v_cache, plan: PagedPlan, *, scale: Optional[float] = None):
    """``out (N, Q, H, D)`` of ``q (N, Q, H, D)`` over the cache as ``plan`` describes (no lse:
    the engine's fast path; use ``paged_attention`` when partials must be merged)."""
    n, nq, h, d = q.shape
    hkv = k_cache.shape[2]
    flat = plan.slots.reshape(-1)  # index_select: ~6x faster than advanced indexing on CPU
    k = k_cache.view(-1, hkv, d).index_select(0, flat).view(n, -1, hkv, d)  # (N, L, Hkv, D)
    v = v_cache.view(-1, hkv, v_cache.shape[-1]).index_select(0, flat).view(n, -1, hkv, v_cache.shape[-1])
    if not plan.all_see_a_key:  # a fully masked row would be NaN in SDPA; the general path handles it
        raise ValueError("a query row sees no key; use paged_attention")
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.bias.to(q.dtype),
        scale=scale, enable_gqa=True)  # (N, H, Q, D)
    return out.transpose(1, 2)
