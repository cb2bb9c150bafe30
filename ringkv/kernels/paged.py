"""Attention of a few new query tokens per sequence over a paged KV cache: the backend registry
and the calls that take a ``backend=`` name. The contract (shapes, causality, SP striping, the
records) and the plain-torch reference are in ``paged_base.py``; the backends in
``paged_cpu.py`` (``"cpu"``: a compiled C kernel reading the cache in place, the CPU default when
it builds), ``paged_torch.py`` (``"torch"``: gather + SDPA, the CPU fallback) and ``triton_paged.py``
(``"triton"``, CUDA).

    out, lse = paged_attention(q, k_cache, v_cache, block_table, seq_lens, backend="auto")
    out, lse = paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q=...)
    attn = plan_step(seqs, block_size=..., sp=1, sp_rank=0, device=None, backend="auto")
    parts = attn.attend(q, cache, lse=True)    # every layer of the step

``plan_step`` is how the engine reads its cache: each backend builds its own per-step metadata
once (``"cpu"``: block tables and visible-key counts per group; ``"torch"``: gather indices and
masks per group of sequences; ``"triton"``: device tensors
for the decode kernel and one varlen prefill batch; ``"reference"``: plain per-group calls) and
answers every layer's ``attend`` with ``RowsOut(rows, out, lse)`` parts.

This module imports the backends; they import ``paged_base``, never this module.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import paged_cpu, paged_torch
from .paged_base import (LayerCache, PagedSeq, RowsOut, SeqGroup, StepAttention, by_query_count,  # noqa: F401
                         check_striping, paged_attention_reference, paged_prefill_reference, read_blocks,
                         validate_paged, validate_prefill)

__all__ = ["paged_attention", "paged_attention_reference", "paged_prefill", "paged_prefill_reference", "plan_step",
           "auto_backend", "validate_paged", "validate_prefill", "read_blocks", "LayerCache", "PagedSeq", "RowsOut",
           "StepAttention"]


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale: Optional[float] = None,
                    causal: bool = True, backend: str = "auto", k_scale=None, v_scale=None):
    """See ``paged_base``. ``backend``: ``"reference"``, ``"cpu"``, ``"torch"``, ``"triton"`` or ``"auto"``."""
    impl = _BACKENDS.get(backend if backend != "auto" else auto_backend(q.device))
    if impl is None:
        raise ValueError(f"unknown paged backend {backend!r}; choose from {sorted(_BACKENDS)} or 'auto'")
    return impl(q, k_cache, v_cache, block_table, seq_lens, scale=scale, causal=causal, k_scale=k_scale,
                v_scale=v_scale)


def paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, *, max_seqlen_q: int, q_start=None,
                  scale: Optional[float] = None, causal: bool = True, k_scale=None, v_scale=None, sp: int = 1,
                  sp_rank: int = 0, backend: str = "auto"):
    """See ``paged_base``. ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton on CUDA)."""
    name = backend if backend != "auto" else auto_backend(q.device, prefill=True)
    impl = _PREFILL_BACKENDS.get(name)
    if impl is None:
        raise ValueError(f"unknown paged prefill backend {backend!r}; "
                         f"choose from {sorted(_PREFILL_BACKENDS)} or 'auto'")
    return impl(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q=max_seqlen_q, q_start=q_start,
                scale=scale, causal=causal, k_scale=k_scale, v_scale=v_scale, sp=sp, sp_rank=sp_rank)


def plan_step(seqs: Sequence[PagedSeq], *, block_size: int, sp: int = 1, sp_rank: int = 0, device=None,
              backend: str = "auto") -> StepAttention:
    """The backend's metadata for one step over the cache (see ``paged_base``): ``seqs``, each
    sequence's query rows, positions and block table; ``sp``/``sp_rank``, the striping of the keys."""
    name = backend if backend != "auto" else auto_backend(torch.device(device or "cpu"))
    impl = _STEP_BACKENDS.get(name)
    if impl is None:
        raise ValueError(f"unknown paged backend {backend!r}; choose from {sorted(_STEP_BACKENDS)} or 'auto'")
    check_striping(sp, sp_rank)
    return impl(seqs, block_size=block_size, sp=sp, sp_rank=sp_rank, device=device)


class ReferenceStep:
    """The ``"reference"`` backend's metadata for one step: per group of sequences with the same
    query count, one ``paged_attention_reference`` call per layer."""

    def __init__(self, seqs: Sequence[PagedSeq], *, block_size: int, sp: int = 1, sp_rank: int = 0, device=None):
        self.groups = [SeqGroup.build(n, members, sp, sp_rank, device) for n, members in by_query_count(seqs).items()]

    def attend(self, q, cache: LayerCache, *, lse: bool = True):
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, D), lse (H, N*n) or None
        parts = []
        for g in self.groups:
            o, l = paged_attention_reference(g.queries(q), cache.k, cache.v, g.block_table, g.seq_lens,
                                             k_scale=cache.k_scale, v_scale=cache.v_scale)
            parts.append(g.result(o, l if lse else None))
        return parts


def _reference_step(seqs: Sequence[PagedSeq], *, block_size: int, sp: int = 1, sp_rank: int = 0, device=None):
    """The reference's ``plan_step``. A striped share (``sp > 1``: query ``i`` sees the local keys
    up to its position, not the last ``Q`` ones) is outside ``paged_attention_reference``'s
    contract: the torch backend's plan computes it."""
    step = paged_torch.TorchStep if sp > 1 else ReferenceStep
    return step(seqs, block_size=block_size, sp=sp, sp_rank=sp_rank, device=device)


_BACKENDS = {"reference": paged_attention_reference, "torch": paged_torch.paged_attention_torch,
             "cpu": paged_cpu.paged_attention_cpu}
_PREFILL_BACKENDS = {"reference": paged_prefill_reference}
_STEP_BACKENDS = {"reference": _reference_step, "torch": paged_torch.plan_step, "cpu": paged_cpu.plan_step}

try:  # the Triton kernels when triton imports
    from . import triton_paged
except ImportError:
    pass
else:
    _BACKENDS["triton"] = triton_paged.paged_attention_triton
    _PREFILL_BACKENDS["triton"] = triton_paged.paged_prefill_triton
    _STEP_BACKENDS["triton"] = triton_paged.plan_step


def auto_backend(device, prefill: bool = False) -> str:
    """What ``backend="auto"`` means on ``device``: the Triton kernels on CUDA when they registered;
    on the CPU the compiled kernel when it builds, else the batched torch version (decode; prefill:
    the reference)."""
    table = _PREFILL_BACKENDS if prefill else _BACKENDS
    if torch.device(device).type == "cuda" and "triton" in table:
        return "triton"
    if torch.device(device).type == "cpu" and "cpu" in table and paged_cpu.available():
        return "cpu"
    return "torch" if "torch" in table else "reference"
