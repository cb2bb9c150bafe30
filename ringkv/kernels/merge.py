"""Online-softmax merge of partial attention results ``(out, lse)`` (single-device math).

Two partials of the same query rows over disjoint key sets combine exactly:
``lse = logaddexp(lse_a, lse_b)`` and ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``.
Everything is float32; rows with ``lse = -inf`` (no key seen) stay ``out = 0, lse = -inf``
without NaN, and large LSE gaps cannot overflow because every weight is ``exp(x <= 0)``.

``merge_`` on CUDA is one fused pass (``triton_merge._merge_kernel``: read both partials,
write the accumulator once) when triton is installed; elsewhere it is the eager torch form
(``merge_eager_``), several element-wise passes. Neither synchronises with the host.
``RINGKV_FUSED_MERGE=0`` keeps CUDA on the eager form (the kernel has not run on a GPU yet).

Shapes: ``out`` ``(B, S, H, D)``, ``lse`` ``(B, H, S)`` float32.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = [
    "empty_partial",
    "merge_",
    "merge_eager_",
    "merge",
    "apply_sinks",
    "sinks_grad",
    "sinks_dlse",
]

_fused = None  # triton_merge.merge_ once imported; False when triton is not installed


def empty_partial(b: int, s: int, h: int, d: int, device=None):
    """The identity of ``merge_``: ``out = 0`` float32 ``(B, S, H, D)``, ``lse = -inf``
    ``(B, H, S)``."""
    return (
        torch.zeros(b, s, h, d, dtype=torch.float32, device=device),
        torch.full((b, h, s), float("-inf"), device=device),
    )


def _weight(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    # exp(lse - total) as (B, S, H, 1); 0 where total is -inf (then lse is -inf too)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    return torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)


def merge_eager_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """``merge_`` in plain torch ops (CPU, and the oracle of the fused kernel)."""
    total = torch.logaddexp(lse, block_lse.float())
    out.mul_(_weight(lse, total)).add_(block_out.float() * _weight(block_lse.float(), total))
    lse.copy_(total)


def _fused_merge():
    global _fused
    if _fused is None and os.environ.get("RINGKV_FUSED_MERGE", "1") == "0":
        _fused = False
    if _fused is None:
        try:
            from .triton_merge import merge_ as fused
        except ImportError:
            fused = False
        _fused = fused
    return _fused


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Accumulate one partial into ``(out, lse)`` in place (the ring loop's form).

    ``out`` is a float32 accumulator ``(B, S, H, D)`` and ``lse`` float32 ``(B, H, S)``; both may
    be views (e.g. the rows of a zigzag half). ``block_out`` may be any float dtype.
    """
    if out.is_cuda and _fused_merge():
        _fused(out, lse, block_out, block_lse)
    else:
        merge_eager_(out, lse, block_out, block_lse)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    """Combine many partials at once (the decode form): returns ``(out fp32, lse fp32)``.

    ``outs[i]`` ``(B, S, H, D)`` and ``lses[i]`` ``(B, H, S)`` are partials over disjoint keys.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(
            f"merge needs the same, non-zero number of outs and lses, got {len(outs)} and "
            f"{len(lses)}"
        )
    lse_all = torch.stack([ls.float() for ls in lses])  # (N, B, H, S)
    total = torch.logsumexp(lse_all, dim=0)
    out = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for o, ls in zip(outs, lse_all):
        out.add_(o.float() * _weight(ls, total))
    return out, total


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Attention sinks on a *final* result: one more logit ``sinks[h]`` per head in the softmax's
    denominator, with no value (gpt-oss). ``out`` ``(B, S, H, Dv)``, ``lse`` ``(B, H, S)`` over the
    real keys, ``sinks`` ``(H,)`` -> ``out_f`` in ``out``'s dtype and
    ``lse_f = logaddexp(lse, sink)`` float32. Applied once, after every merge (partials over
    disjoint keys merge without it). A backward given ``(dout_f, out_f, lse_f)`` is exact for q, k,
    v (the sink is a key with value 0)."""
    lse_f = torch.logaddexp(lse.float(), sinks.float().view(1, -1, 1))  # (B, H, S)
    w = torch.exp(lse.float() - lse_f)  # the real keys' share; 0 where no key was seen
    return (out.float() * w.transpose(1, 2).unsqueeze(-1)).to(out.dtype), lse_f


def sinks_dlse(dlse: torch.Tensor, lse: torch.Tensor, lse_f: torch.Tensor) -> torch.Tensor:
    """A gradient of the real keys' ``lse`` as the ``dlse`` of a backward given the sinked
    ``lse_f``: ``d lse / d s_j = p_j = p'_j * exp(lse_f - lse)`` (bounded where a huge sink leaves
    the real keys no weight, which then have none in the backward either)."""
    return dlse * torch.exp((lse_f - lse).clamp(max=80.0))


def sinks_grad(
    dout: torch.Tensor, out: torch.Tensor, lse_f: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """d loss / d sinks ``(H,)`` float32 from the rows held here:
    ``-sum p_sink * rowsum(dout * out)`` over batch and rows, with ``out``/``lse_f`` the sinked
    results of ``apply_sinks``."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, S)
    return -(torch.exp(sinks.float().view(1, -1, 1) - lse_f) * delta).sum((0, 2))
