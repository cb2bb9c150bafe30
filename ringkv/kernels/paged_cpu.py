"""Paged attention on the CPU that reads the cache in place: backend ``"cpu"``, the CPU default
where a C compiler builds it and it beats the ``"torch"`` backend (its self-check, below).

``csrc/paged_attention.c`` (plain C and OpenMP, no torch headers) is compiled on first use for the
process's target ISA and loaded by ``native.load`` (it shares torch's threads). ``available()``
(what
``paged.auto_backend`` asks) is its self-check's verdict (``status()``: a decode step of 16
sequences of 200-312 keys, SmolLM2's 9 / 3 heads x 64, against the ``"torch"`` plan, cached beside
the build); ``RINGKV_NATIVE_PAGED=1`` turns it on without the self-check, ``=0`` off. Asked for by
name (``backend="cpu"``) it runs wherever it builds. ``library(isa)``, and the ``isa=`` keyword of
``attend``, run the build for another target in this process (tests).

Against the ``"torch"`` backend (gather each group's blocks into a padded copy, then SDPA), it
reads each sequence's own keys once, with no copy and no padding. It takes float32 queries over
an unquantized float32 cache with the usual contiguous layouts; anything else (another dtype, a
quantized cache, a device other than the CPU, or no compiler) goes to the ``"torch"`` backend.

``FEATURES`` (``paged_base``'s contract): a V cache of its own head size ``Dv``, ``softcap`` (the
scores capped in the kernel before its softmax) and a sliding ``window`` (a first visible key per
query, on global positions, SP striping included: blocks wholly before every query's window are
not read), with ``scale``, on ``paged_attention_cpu`` and ``CpuStep.attend``.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import List, Optional, Sequence

import torch

from . import native, paged_torch
from .checks import check_softcap
from .paged_base import (
    LayerCache,
    PagedSeq,
    RowsOut,
    SeqGroup,
    by_query_count,
    check_capacity,
    query_limits,
    striped_limits,
    validate_paged,
)

SWITCH = "RINGKV_NATIVE_PAGED"
FEATURES = frozenset({"softcap", "window", "dv"})  # done in the kernel (scale too, on every call)


@lru_cache(maxsize=None)
def _lib(isa: str) -> Optional[ctypes.CDLL]:
    lib = native.load("paged_attention", isa=isa)
    if lib is None:
        return None
    fn = lib.ringkv_paged_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 8
        + [ctypes.c_int64] * 9
        + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
    )
    fn = lib.ringkv_paged_write_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
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
    return (
        lambda: mine.attend(q, cache, lse=False, lib=lib),
        lambda: theirs.attend(q, cache, lse=False),
        "a decode step of 16 sequences of 200-312 keys, 9 / 3 heads x 64",
    )


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
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and cache.k_scale is None
        and cache.k.dtype == cache.v.dtype == torch.float32
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and cache.v.shape[:3] == cache.k.shape[:3]
    )


def supports(q: torch.Tensor, cache: LayerCache) -> bool:
    """The kernel takes these: float32 on the CPU, an unquantized contiguous cache (and it
    builds)."""
    return _takes(q, cache) and library() is not None


def _cap(softcap) -> float:
    """The kernel's softcap argument: 0.0 for none (``checks.check_softcap`` rejects the rest)."""
    return check_softcap(softcap) or 0.0


def _window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < -1:
        raise ValueError(
            f"window must be an int >= 0 (the left extent W) or -1 (unbounded), got {window!r}"
        )
    return window


def attend(
    q: torch.Tensor,
    cache: LayerCache,
    table: torch.Tensor,
    limits: torch.Tensor,
    scale: Optional[float] = None,
    lse: bool = True,
    *,
    starts: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    isa: Optional[str] = None,
    lib=None,
):
    """``q (N, Q, H, D)`` float32 over the cache (``k`` ``(NB, BS, Hkv, D)``, ``v`` ``(NB, BS, Hkv,
    Dv)``): query ``i`` of sequence ``n`` sees the keys ``starts[n, i] <= j < limits[n, i]`` (int64
    ``(N, Q)``; ``starts`` None: from 0; the kernel clamps both to ``[0, W * block_size]``) of the
    blocks ``table[n]`` ``(N, W)`` int32 (blocks before every query's start are not read), scores
    ``scale * q.k`` (default ``1/sqrt(D)``) capped as ``softcap * tanh(s / softcap)`` when given.
    Returns ``out (N, Q, H, Dv)`` and ``lse (N, H, Q)`` float32 (None unless ``lse``); a row that
    sees no key gives 0 / -inf. ``isa``: the build to run (default: this process's); ``lib``: a
    loaded build instead."""
    if lib is None:
        lib = native.require(library(isa), "paged_cpu", SWITCH, isa)
    table, limits = table.to(torch.int32).contiguous(), limits.to(torch.int64).contiguous()
    starts = None if starts is None else starts.to(torch.int64).contiguous()
    return _run(lib, q.contiguous(), cache, table, limits, starts, scale, softcap, lse)


def _run(lib, q, cache: LayerCache, table, limits, starts, scale, softcap, lse: bool):
    """``attend`` on arguments already in the kernel's types and layouts (``CpuStep``'s tables are
    built so: int32 block tables, int64 limits and starts)."""
    n, nq, h, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    dv = cache.v.shape[-1]
    out = torch.empty(n, nq, h, dv, dtype=q.dtype)
    lse_out = torch.empty(n, h, nq, dtype=torch.float32) if lse else None
    if n == 0:
        return out, lse_out
    err = lib.ringkv_paged_attention_f32(
        q.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        table.data_ptr(),
        limits.data_ptr(),
        None if starts is None else starts.data_ptr(),
        out.data_ptr(),
        None if lse_out is None else lse_out.data_ptr(),
        n,
        nq,
        h,
        hkv,
        d,
        dv,
        nb,
        bs,
        table.shape[1],
        d**-0.5 if scale is None else float(scale),
        _cap(softcap),
        torch.get_num_threads(),
    )
    if err == 2:
        raise ValueError(f"block_table holds block ids outside [0, {nb}) where the queries read")
    if err:
        raise MemoryError("the CPU paged-attention kernel could not allocate its scratch memory")
    return out, lse_out


def write(k_cache, v_cache, k, v, slots) -> bool:
    """``k``/``v`` ``(T, Hkv, D)`` / ``(T, Hkv, Dv)`` into slots ``slots (T,)`` of ``k_cache``/
    ``v_cache`` ``(slots, Hkv, D)``/``(slots, Hkv, Dv)``, in one C call (two ``index_copy_`` s and
    their views in torch: ~50 us a layer of a 16-row decode step, ~5 here). True when done; False
    (nothing written) where the kernel does not take them: not all float32 contiguous CPU tensors
    of those shapes with int64 slots, or the kernel is off. A slot outside the cache raises
    ``IndexError`` before anything is written."""
    lib = library()
    f32 = torch.float32
    if not (
        lib is not None
        and k.dtype is f32
        and v.dtype is f32
        and k_cache.dtype is f32
        and v_cache.dtype is f32
        and slots.dtype is torch.int64
        and k.is_cpu
        and k_cache.is_cpu
        and k.shape[1:] == k_cache.shape[1:]
        and v.shape[1:] == v_cache.shape[1:]
        and k.shape[0] == v.shape[0] == slots.numel()
        and k_cache.shape[0] == v_cache.shape[0]
        and k.is_contiguous()
        and v.is_contiguous()
        and slots.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        return False
    t, nslots = k.shape[0], k_cache.shape[0]
    err = lib.ringkv_paged_write_f32(
        k.data_ptr(),
        v.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        t,
        k_cache.stride(0),  # Hkv * D floats a row (contiguous)
        v_cache.stride(0),
        nslots,
    )
    if err:
        raise IndexError(f"a K/V slot lies outside the cache's [0, {nslots})")
    return True


def window_starts(
    positions: torch.Tensor, window: int, sp: int = 1, sp_rank: int = 0
) -> Optional[torch.Tensor]:
    """The first local key a query at global position ``positions`` (int, any shape) sees under a
    left ``window`` ``W`` (position ``>= p - W``), local key ``i`` at position ``sp_rank + i * sp``:
    ``ceil((p - W - sp_rank) / sp)`` (may be <= 0: from the first); None when ``window`` is -1."""
    if window < 0:
        return None
    return -torch.div(sp_rank + window - positions.to(torch.long), sp, rounding_mode="floor")


def _features(softcap=None, window: int = -1):
    """The keywords of the torch backend's call for the features in use (only those, as it takes
    them)."""
    return {
        **({} if softcap is None else {"softcap": softcap}),
        **({} if window == -1 else {"window": window}),
    }


def paged_attention_cpu(
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
    """``paged_base``'s contract (``v_cache`` of its own head size ``Dv``, ``softcap``, ``window``
    included); falls back to the ``"torch"`` backend where the kernel does not apply."""
    _cap(softcap)
    _window(window)
    validate_paged(
        q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, **_features(softcap, window)
    )
    cache = LayerCache(k_cache, v_cache, k_scale, v_scale)
    if not supports(q, cache):
        return paged_torch.paged_attention_torch(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            scale=scale,
            causal=causal,
            k_scale=k_scale,
            v_scale=v_scale,
            **_features(softcap, window),
        )
    check_capacity(seq_lens, block_table.shape[1] * k_cache.shape[1])
    nq = q.shape[1]
    pos = seq_lens.to(torch.long)[:, None] - nq + torch.arange(nq)  # (N, Q): the queries' positions
    return attend(
        q,
        cache,
        block_table,
        query_limits(seq_lens, nq, causal),
        scale,
        starts=window_starts(pos, window),
        softcap=softcap,
    )


MAX_QUERIES = 8  # sequences with more new tokens (prefill chunks) go to SDPA, whose GEMMs win there


class CpuStep:
    """The ``"cpu"`` backend's metadata for one step: per group of sequences with the same query
    count up to ``MAX_QUERIES``, their block tables and how many keys each query sees (no padding,
    no gather); the ``"torch"`` backend's plan for longer chunks, and for every sequence when the
    cache is one the kernel does not take (built when first needed)."""

    def __init__(
        self,
        seqs: Sequence[PagedSeq],
        *,
        block_size: int,
        sp: int = 1,
        sp_rank: int = 0,
        device=None,
    ):
        self.seqs, self.block_size, self.sp, self.sp_rank, self.device = (
            seqs,
            block_size,
            sp,
            sp_rank,
            device,
        )
        self.groups, long = [], []
        for n, members in by_query_count(seqs).items():
            if n > MAX_QUERIES:
                long += members
                continue
            positions = torch.tensor([s.start for s in members])[:, None] + torch.arange(
                n
            )  # (N, n) global
            self.groups.append(  # int32 block tables, int64 limits: the kernel's types (_run)
                (
                    SeqGroup.build(n, members, sp, sp_rank, device),
                    striped_limits(members, n, sp, sp_rank),
                    positions,
                )
            )  # (N, n) each
        self._long = self._torch(long) if long else None
        self._fallback = None
        # window -> per group its queries' first local keys (N, n), made once per step
        self._starts = {}

    def _torch(self, seqs):
        return paged_torch.TorchStep(
            seqs, block_size=self.block_size, sp=self.sp, sp_rank=self.sp_rank, device=self.device
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
        lib=None,
    ) -> List[RowsOut]:
        # q (T, H, D) -> per group: rows (N*n,), out (N*n, H, Dv), lse (H, N*n) or None; scale
        # (default 1/sqrt(D)), softcap, window: paged_base's; lib: a loaded build instead of this
        # process's (the self-check's)
        _cap(softcap)
        window = _window(window)
        lib = lib or library()
        if not (lib is not None and _takes(q, cache)):
            if self._fallback is None:
                self._fallback = self._torch(self.seqs)
            return self._fallback.attend(q, cache, lse=lse, **self._kw(scale, softcap, window))
        if window not in self._starts:
            self._starts[window] = [
                window_starts(pos, window, self.sp, self.sp_rank) for _, _, pos in self.groups
            ]  # int64
        parts = [
            g.result(
                *_run(
                    lib,
                    g.queries(q).contiguous(),
                    cache,
                    g.block_table,
                    limits,
                    starts,
                    scale,
                    softcap,
                    lse,
                )
            )
            for (g, limits, _), starts in zip(self.groups, self._starts[window])
        ]
        if self._long is None:
            return parts
        return parts + self._long.attend(q, cache, lse=lse, **self._kw(scale, softcap, window))

    @staticmethod
    def _kw(scale, softcap, window) -> dict:
        """The ``"torch"`` backend's keywords for the features in use."""
        return dict(**({} if scale is None else {"scale": scale}), **_features(softcap, window))


plan_step = (
    CpuStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
)
