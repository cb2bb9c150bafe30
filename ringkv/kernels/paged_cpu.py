"""Paged attention on the CPU that reads the cache in place: backend ``"cpu"``, the CPU default
where a C compiler builds it and it beats the ``"torch"`` backend (its self-check, below).

``csrc/paged_attention.c`` (plain C and OpenMP, no torch headers) is compiled on first use for the
process's target ISA and loaded by ``native.load`` (it shares torch's threads). ``available()`` (what
``paged.auto_backend`` asks) is its self-check's verdict (``status()``: a decode step of 16
sequences of 200-312 keys, SmolLM2's 9 / 3 heads x 64, against the ``"torch"`` plan, cached beside
the build); ``RINGKV_NATIVE_PAGED=1`` turns it on without the self-check, ``=0`` off. Asked for by
name (``backend="cpu"``) it runs wherever it builds. ``library(isa)``, and the ``isa=`` keyword of
``attend``, run the build for another target in this process (tests).

Against the ``"torch"`` backend (gather each group's blocks into a padded copy, then SDPA), it
reads each sequence's own keys once, with no copy and no padding. It takes float32 queries over
an unquantized float32 cache with the usual contiguous layouts; anything else (another dtype, a
quantized cache, a device other than the CPU, or no compiler) goes to the ``"torch"`` backend.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import List, Optional, Sequence

import torch

from . import native, paged_torch
from .paged_base import (LayerCache, PagedSeq, RowsOut, SeqGroup, by_query_count, check_capacity, query_limits,
                         striped_limits, validate_paged)

SWITCH = "RINGKV_NATIVE_PAGED"


@lru_cache(maxsize=None)
def _lib(isa: str) -> Optional[ctypes.CDLL]:
    lib = native.load("paged_attention", isa=isa)
    if lib is None:
        return None
    fn = lib.ringkv_paged_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    return lib


def library(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernel for ``isa`` (default: ``native.default_isa()``, and None when
    ``RINGKV_NATIVE_PAGED=0``), built on first use; None when no compiler builds it (with a warning
    saying why) or the CPU cannot run that target. Whether ``"auto"`` uses it is ``available()``."""
    return _default() if isa is None else _lib(isa)


@lru_cache(maxsize=None)
def _default() -> Optional[ctypes.CDLL]:
    return None if os.environ.get(SWITCH) == "0" else _lib(native.default_isa())


def _timed_call(isa: str):
    """The self-check's call: one layer of a decode step of 16 sequences of 200-312 keys (SmolLM2's
    9 query heads over 3 K/V heads, head dim 64, blocks of 16 in shuffled order), this kernel's step
    against the ``"torch"`` backend's."""
    lib = _lib(isa)
    g = torch.Generator().manual_seed(0)
    lens = [200 + 7 * i for i in range(16)]
    bs, per = 16, -(-max(lens) // 16)
    kc, vc = (torch.randn(16 * per, bs, 3, 64, generator=g) for _ in range(2))
    order = torch.randperm(16 * per, generator=g).view(16, per).tolist()
    seqs = [PagedSeq(row=i, start=n - 1, n=1, block_table=order[i]) for i, n in enumerate(lens)]
    q, cache = torch.randn(16, 9, 64, generator=g), LayerCache(kc, vc)
    mine, theirs = CpuStep(seqs, block_size=bs), paged_torch.TorchStep(seqs, block_size=bs)
    return (lambda: mine.attend(q, cache, lse=False, lib=lib), lambda: theirs.attend(q, cache, lse=False),
            "a decode step of 16 sequences of 200-312 keys, 9 / 3 heads x 64")


@lru_cache(maxsize=None)
def status() -> dict:
    """The self-check's verdict (``native.self_check``): whether ``"auto"`` runs this kernel here,
    why, and both timings."""
    return native.self_check("paged_attention", SWITCH, _timed_call, "the 'torch' backend")


def available() -> bool:
    """The kernel is on here (``"auto"`` picks it): it builds, and ``RINGKV_NATIVE_PAGED=1`` or its
    self-check says so."""
    return status()["on"]


def _takes(q: torch.Tensor, cache: LayerCache) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and cache.k_scale is None
            and cache.k.dtype == cache.v.dtype == torch.float32 and cache.k.is_contiguous()
            and cache.v.is_contiguous())


def supports(q: torch.Tensor, cache: LayerCache) -> bool:
    """The kernel takes these: float32 on the CPU, an unquantized contiguous cache (and it builds)."""
    return _takes(q, cache) and library() is not None


def attend(q: torch.Tensor, cache: LayerCache, table: torch.Tensor, limits: torch.Tensor,
           scale: Optional[float] = None, lse: bool = True, *, isa: Optional[str] = None, lib=None):
    """``q (N, Q, H, D)`` float32 over the cache: query ``i`` of sequence ``n`` sees the first
    ``limits[n, i]`` keys (int64; the kernel clamps them to ``[0, W * block_size]``) of the blocks
    ``table[n]`` ``(N, W)`` int32. Returns ``out (N, Q, H, D)``
    and ``lse (N, H, Q)`` float32 (None unless ``lse``); a row that sees no key gives 0 / -inf.
    ``isa``: the build to run (default: this process's); ``lib``: a loaded build instead."""
    if lib is None:
        lib = native.require(library(isa), "paged_cpu", SWITCH, isa)
    q = q.contiguous()
    n, nq, h, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    table, limits = table.to(torch.int32).contiguous(), limits.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lse_out = torch.empty(n, h, nq, dtype=torch.float32) if lse else None
    if n == 0:
        return out, lse_out
    err = lib.ringkv_paged_attention_f32(
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

    def attend(self, q, cache: LayerCache, *, lse: bool = True, lib=None) -> List[RowsOut]:
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, D), lse (H, N*n) or None; lib: a
        # loaded build instead of this process's (the self-check's)
        if not (_takes(q, cache) and (lib is not None or library() is not None)):
            if self._fallback is None:
                self._fallback = self._torch(self.seqs)
            return self._fallback.attend(q, cache, lse=lse)
        parts = [g.result(*attend(g.queries(q), cache, g.block_table, limits, lse=lse, lib=lib))
                 for g, limits in self.groups]
        return parts + (self._long.attend(q, cache, lse=lse) if self._long is not None else [])


plan_step = CpuStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
