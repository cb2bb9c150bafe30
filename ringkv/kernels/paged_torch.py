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
    k = k_cache[table].reshape(n, nb * bs, hkv, d)  # (N, L, Hkv, D)
    v = v_cache[table].reshape(n, nb * bs, hkv, v_cache.shape[-1])  # (N, L, Hkv, Dv)
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
