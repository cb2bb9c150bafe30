"""Attention of new tokens over a KV cache sharded along the sequence across an SP group.

Every rank holds the same new queries ``q`` and its own slice of the cache (with the global
positions of those keys). Each rank computes the partial ``(out, lse)`` of ``q`` over its
local keys with ``ringkv.kernels.attention`` (causal on global positions), the partials are
all-gathered (one message: out and lse packed together) and merged by LSE in rank order, so
every rank gets the same, exact result. Inference only (not differentiable).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

import torch

from .. import kernels
from .collectives import all_gather, rank_world
from ..kernels.merge import apply_sinks, empty_partial, merge

__all__ = ["decode_attention", "merge_across"]


def decode_attention(
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    group=None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    timeout: Optional[timedelta] = None,
    window: Tuple[int, int] = (-1, -1),
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact causal attention of replicated new queries over the sharded cache.

    Args:
        q: ``(B, T, H, D)``, the same on every rank; ``q_positions`` ``(T,)`` their global
            positions.
        k_local, v_local: ``(B, S_local, Hkv, D)``, ``(B, S_local, Hkv, Dv)``, this rank's cached
            keys/values (``S_local`` may be 0 and may differ between ranks); ``k_positions``
            ``(S_local,)`` global positions.
        window: ``(left, right)`` sliding window on those positions, as in ``ring_attention``.
        softcap, sinks: as in ``ring_attention`` (sinks applied once, after the merge).
    Returns:
        ``(B, T, H, Dv)`` in ``q.dtype``, identical on every rank.
    """
    softcap, sinks = kernels.check_softcap(softcap), kernels.check_sinks(sinks, q)
    if k_local.shape[1] != k_positions.numel():
        raise ValueError(
            f"decode_attention: {k_local.shape[1]} cached keys but {k_positions.numel()} positions"
        )
    b, t, h, d = q.shape
    if k_local.shape[1] == 0:  # this rank caches nothing (yet): a neutral partial
        out, lse = empty_partial(b, t, h, v_local.shape[-1], q.device)
    else:
        out, lse = kernels.attention(
            q,
            k_local,
            v_local,
            scale=softmax_scale,
            causal=True,
            q_positions=q_positions,
            k_positions=k_positions,
            window=window,
            backend=backend,
            softcap=softcap,
        )
    merged, lse = merge_across(out, lse, group, timeout, "decode_attention")
    if sinks is not None:
        merged = apply_sinks(merged, lse, sinks)[0]
    return merged.to(q.dtype)


def merge_across(
    out: torch.Tensor,
    lse: torch.Tensor,
    group=None,
    timeout: Optional[timedelta] = None,
    what: str = "merge_across",
):
    """Merge the partial results of the same queries over the disjoint keys each rank of
    ``group`` holds: ``out`` ``(B, T, H, D)``, ``lse`` float32 ``(B, H, T)`` -> the exact
    ``(out float32, lse)``, identical on every rank (one all-gather of out and lse together)."""
    _, world = rank_world(group)
    if world == 1:
        return out.float(), lse
    packed = torch.cat([out.float().reshape(-1), lse.reshape(-1)])
    parts = all_gather(packed, group, timeout, what)
    n = out.numel()
    return merge([p[:n].view(out.shape) for p in parts], [p[n:].view(lse.shape) for p in parts])
