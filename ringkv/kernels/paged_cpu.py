"""Paged attention on the CPU that reads the cache in place: backend ``"cpu"``, the CPU default
when a C compiler is present.

``csrc/paged_attention.c`` (plain C and OpenMP, no torch headers) is compiled on first use and
loaded by ``native.load`` (it shares torch's threads). ``RINGKV_NATIVE_PAGED=0`` turns it off.

Against the ``"torch"`` backend (gather each group's blocks into a padded copy, then SDPA), it
reads each sequence's own keys once, with no copy and no padding. It takes float32 queries over
an unquantized float32 cache with the usual contiguous layouts; anything else (another dtype, a
quantized cache, a device other than the CPU, or no compiler) goes to the ``"torch"`` backend.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import List, Optional, Sequence

import torch

from . import native, paged_torch
from .paged_base import (LayerCache, PagedSeq, RowsOut, SeqGroup, by_query_count, check_capacity, query_limits,
                         striped_limits, validate_paged)


@lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel (``native.load``), built on first use; None when turned off or no
    compiler builds it (with a warning saying why)."""
    lib = native.load("paged_attention", "RINGKV_NATIVE_PAGED")
    if lib is None:
        return None
    fn = lib.ringkv_paged_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    """The compiled kernel loads here."""
    return library() is not None


def supports(q: torch.Tensor, cache: LayerCache) -> bool:
    """The kernel takes these: float32 on the CPU, an unquantized contiguous cache."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and cache.k_scale is None
            and cache.k.dtype == cache.v.dtype == torch.float32 and cache.k.is_contiguous()
            and cache.v.is_contiguous() and available())


def attend(q: torch.Tensor, cache: LayerCache, table: torch.Tensor, limits: torch.Tensor,
           scale: Optional[float] = None, lse: bool = True):
    """``q (N, Q, H, D)`` float32 over the cache: query ``i`` of sequence ``n`` sees the first
    ``limits[n, i]`` keys (int64; the kernel clamps them to ``[0, W * block_size]``) of the blocks
    ``table[n]`` ``(N, W)`` int32. Returns ``out (N, Q, H, D)``
    and ``lse (N, H, Q)`` float32 (None unless ``lse``); a row that sees no key gives 0 / -inf."""
    q = q.contiguous()
    n, nq, h, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    table, limits = table.to(torch.int32).contiguous(), limits.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lse_out = torch.empty(n, h, nq, dtype=torch.float32) if lse else None
    if n == 0:
        return out, lse_out
    err = library().ringkv_paged_attention_f32(
        q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), table.data_ptr(), limits.data_ptr(), out.data_ptr(),
        None if lse_out is None else lse_out.data_ptr(), n, nq, h, hkv, d, nb, bs, table.shape[1],
        d ** -0.5 if scale is None else float(scale), torch.get_num_threads())
    if err == 2:
        raise ValueError(f"block_table holds block ids outside [0, {nb}) where the queries read")
    if err:
        raise MemoryError("the CPU paged-attention kernel could not allocate its scratch memory")
    return out, lse_out


def paged_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, *, scale: Optional[float] = None,
                        causal: bool = True, k_scale=None, v_scale=None):
    """``paged_base``'s contract; falls back to the ``"torch"`` backend where the kernel does not apply."""
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    cache = LayerCache(k_cache, v_cache, k_scale, v_scale)
    if not supports(q, cache):
        return paged_torch.paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale=scale,
                                                 causal=causal, k_scale=k_scale, v_scale=v_scale)
    check_capacity(seq_lens, block_table.shape[1] * k_cache.shape[1])
    return attend(q, cache, block_table, query_limits(seq_lens, q.shape[1], causal), scale)


MAX_QUERIES = 8  # sequences with more new tokens (prefill chunks) go to SDPA, whose GEMMs win there


class CpuStep:
    """The ``"cpu"`` backend's metadata for one step: per group of sequences with the same query
    count up to ``MAX_QUERIES``, their block tables and how many keys each query sees (no padding,
    no gather); the ``"torch"`` backend's plan for longer chunks, and for every sequence when the
    cache is one the kernel does not take (built when first needed)."""

    def __init__(self, seqs: Sequence[PagedSeq], *, block_size: int, sp: int = 1, sp_rank: int = 0, device=None):
        self.seqs, self.block_size, self.sp, self.sp_rank, self.device = seqs, block_size, sp, sp_rank, device
        self.groups, long = [], []
        for n, members in by_query_count(seqs).items():
            if n > MAX_QUERIES:
                long += members
                continue
            self.groups.append((SeqGroup.build(n, members, sp, sp_rank, device),
                                striped_limits(members, n, sp, sp_rank)))  # (N, n)
        self._long = self._torch(long) if long else None
        self._fallback = None

    def _torch(self, seqs):
        return paged_torch.TorchStep(seqs, block_size=self.block_size, sp=self.sp, sp_rank=self.sp_rank,
                                     device=self.device)

    def attend(self, q, cache: LayerCache, *, lse: bool = True) -> List[RowsOut]:
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, D), lse (H, N*n) or None
        if not supports(q, cache):
            if self._fallback is None:
                self._fallback = self._torch(self.seqs)
            return self._fallback.attend(q, cache, lse=lse)
        parts = [g.result(*attend(g.queries(q), cache, g.block_table, limits, lse=lse)) for g, limits in self.groups]
        return parts + (self._long.attend(q, cache, lse=lse) if self._long is not None else [])


plan_step = CpuStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
