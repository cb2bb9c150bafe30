"""ringkv's own CPU flash attention: backend ``"cpu_flash"``, the CPU default for float32 where a C
compiler builds it and it beats torch's op (its self-check, below).

``csrc/flash_attention.c`` (plain C and OpenMP, no torch headers; built on first use by
``native.load``, sharing torch's threads) runs the forward and the backward block by block on
register tiles. Against torch's fused CPU op (backend ``"sdpa"``) it takes any ``OFFSET`` or
``BAND`` mask in one call (no square-tile split and merge), reads K/V heads in place for GQA
(no repeat), adds its gradients straight into the caller's accumulators, and takes a gradient
through lse natively; it skips the masked part of a causal block a panel of keys at a time (32
keys with AVX-512, 16 with AVX2, 8 generic; torch's op computes the masked half of each diagonal
256 x 512 block). docs/kernels.md has the measurements. Its register tiles are chosen per target
ISA when it is built (AVX-512, AVX2 or generic: ``native.py``). It becomes ``"auto"``'s choice once
its self-check (``status()``: a 512 x 512 causal block forward and backward, against ``"sdpa"``,
cached beside the build) found it faster on this machine, and takes full-mask blocks too where a
second self-check on a full block did (``status("full")``, ``declines``); ``RINGKV_NATIVE_FLASH=1``
turns it on without the self-checks, ``=0`` off (``"sdpa"`` then runs these calls).
``library(isa)``, and the ``isa=`` keyword of ``forward``/``backward``/``backward_into``, run the
build for another target in this process (tests).

Takes float32 on the CPU with ``head_dim`` a multiple of 16 up to 256 and any mask but
``DENSE``; everything else is left to the next backend. Results do not depend on the number of
threads; they differ from torch's op in the last bits (another summation order).

``FEATURES``: V may have its own head size ``Dv`` (MLA's: q/k ``(.., D)``, v/out/dout/dv ``(..,
Dv)``; the kernel takes multiples of 16, another ``Dv`` is zero-padded to one, exactly), and
``softcap`` (logit soft-capping: the score is ``softcap * tanh(scale * q.k / softcap)`` before the
mask, lse over the capped scores, the backward through the tanh's derivative) runs in the kernel: a
flag checked outside its inner loops, so the calls without it run as before (the self-check's 512 x
512 causal block: 4.28 ms before, 4.27 ms after, 4.83 ms capped; AVX-512, one thread).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Optional

import torch

from . import native
from .checks import check_softcap
from .mask import BAND, DENSE, EMPTY, FULL, OFFSET, Mask

UNBOUNDED = 1 << 40  # a mask side with no limit (the kernel's +-2^40)
SWITCH = "RINGKV_NATIVE_FLASH"
FEATURES = frozenset({"softcap", "dv"})  # done natively (dispatch's registry contract)


@lru_cache(maxsize=None)
def _lib(isa: str) -> Optional[ctypes.CDLL]:
    lib = native.load("flash_attention", isa=isa)
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.ringkv_flash_fwd_f32.restype = ctypes.c_int
    f = ctypes.c_float
    lib.ringkv_flash_fwd_f32.argtypes = [p] * 5 + [i] * 7 + [p] * 4 + [i, i, f, f, ctypes.c_int]
    lib.ringkv_flash_bwd_f32.restype = ctypes.c_int
    lib.ringkv_flash_bwd_f32.argtypes = (
        [p] * 10 + [i] * 7 + [p] * 8 + [i, i, f, f, ctypes.c_int, ctypes.c_int]
    )
    return lib


def library(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernel for ``isa`` (default: ``native.default_isa()``, and None when
    ``RINGKV_NATIVE_FLASH=0``); None when no compiler builds it (with a warning) or the CPU cannot
    run that target. Whether ``"auto"`` uses it is ``status()``'s verdict."""
    return _default() if isa is None else _lib(isa)


@lru_cache(maxsize=None)
def _default() -> Optional[ctypes.CDLL]:
    return None if os.environ.get(SWITCH) == "0" else _lib(native.default_isa())


def _timed_call(isa: str, kind: str = "causal"):
    """The self-check's call: a 512 x 512 ``kind`` ("causal" or "full") block, forward then backward
    (4 query heads over 2 K/V heads, head dim 64, heads-first memory as the ring passes it), ours
    against torch's fused op. The backward counts: the AVX2 build's full-block forward is at parity
    with torch's op while its backward is slower."""
    from . import sdpa

    g = torch.Generator().manual_seed(0)
    q, dout = (
        torch.randn(1, 4, 512, 64, generator=g).transpose(1, 2) for _ in range(2)
    )  # (B, S, H, D) views
    k, v = (torch.randn(1, 2, 512, 64, generator=g).transpose(1, 2) for _ in range(2))
    mask = Mask(OFFSET, offset=0) if kind == "causal" else Mask(FULL)

    def run(fwd, bwd):
        out, lse = fwd(q, k, v, 0.125, mask)
        bwd(dout, q, k, v, out, lse, 0.125, mask)

    return (
        lambda: run(lambda *a: forward(*a, isa=isa), lambda *a: backward(*a, isa=isa)),
        lambda: run(sdpa.forward, sdpa.backward),
        f"a 512 x 512 {kind} block forward and backward, 4 / 2 heads x 64",
    )


@lru_cache(maxsize=None)
def status(kind: str = "causal") -> dict:
    """The self-check's verdict (``native.self_check``) for blocks of ``kind``: ``"causal"`` (any
    mask with a diagonal: whether ``"auto"`` runs this kernel here at all) or ``"full"`` (whether it
    also takes the full blocks: the AVX2 build wins the diagonal blocks by skipping their masked
    panels and can lose the full ones); why, and both timings."""
    return native.self_check(
        "flash_attention",
        SWITCH,
        lambda isa: _timed_call(isa, kind),
        "torch's fused op (sdpa)",
        "" if kind == "causal" else kind,
    )


def declines(mask: Mask) -> str:
    """Why ``"auto"`` passes this kernel over for blocks of ``mask`` although it is on ("" when it
    takes them): full blocks where its self-check on them found torch's op faster."""
    if mask.kind != FULL:
        return ""
    return status("full")["why"]


def __getattr__(name: str):
    # ``unavailable`` (read by dispatch): why "auto" does not run the backend here, "" when it does
    if name == "unavailable":
        return status()["why"]
    raise AttributeError(name)


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    d = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and d % 16 == 0
        and 0 < d <= 256
        and mask.kind != DENSE
        and library() is not None
    )


def _check_dims(q, k, v) -> int:
    """V's head size ``Dv``, or a ValueError: q/k share ``D`` (``supports``' rule), V any ``Dv > 0``
    (the kernel's is a multiple of 16; ``_wide`` pads another)."""
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d or d % 16 or not 0 < d <= 256 or dv <= 0:
        raise ValueError(
            "cpu_flash takes q/k of one head size D (a multiple of 16 up to 256) and v of head "
            f"size Dv > 0; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return dv


def _wide(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` zero-padded in its last dimension to ``width`` (the kernel's V head size, a multiple of
    16; exact: the padded columns of out and dv come out 0 and are dropped)."""
    return (
        t if t.shape[-1] == width else torch.nn.functional.pad(t.float(), (0, width - t.shape[-1]))
    )


def _cap(softcap) -> float:
    """The kernel's softcap argument: 0.0 for none (``checks.check_softcap`` rejects the rest)."""
    return check_softcap(softcap) or 0.0


def _need(isa: Optional[str]) -> ctypes.CDLL:
    return native.require(library(isa), "cpu_flash", SWITCH, isa)


def _bounds(mask: Mask):
    """The mask as the kernel's diagonals ``lo <= j - i <= hi``."""
    if mask.kind == FULL:
        return -UNBOUNDED, UNBOUNDED
    if mask.kind == OFFSET:
        return -UNBOUNDED, mask.offset
    if mask.kind == BAND:
        return mask.lo, mask.offset
    raise ValueError(f"cpu_flash takes full, offset and band masks, not {mask.kind!r}")


def _strides(t: torch.Tensor):
    # (B, S, H, D) with a contiguous last dim -> its (batch, seq, head) strides in floats
    return (ctypes.c_int64 * 3)(*t.stride()[:3])


def _rows(t: torch.Tensor) -> torch.Tensor:
    # float32 with a contiguous last dimension (any other strides are read in place)
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(
    q, k, v, scale: float, mask: Mask, softcap: Optional[float] = None, *, isa: Optional[str] = None
):
    """Same contract as ``reference.forward`` (float32): q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``,
    v ``(B, Sk, Hkv, Dv)`` -> out ``(B, Sq, H, Dv)``, lse ``(B, H, Sq)``; ``softcap``: the scores'
    cap (None: none); ``isa``: the build to run (default: this process's)."""
    return _forward(_need(isa), q, k, v, scale, mask, softcap)


def _forward(lib, q, k, v, scale: float, mask: Mask, softcap=None):
    b, sq, h, d = q.shape
    dv, cap = _check_dims(q, k, v), _cap(softcap)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32)  # (B, H, Sq)
    if mask.kind == EMPTY or sq == 0 or k.shape[1] == 0:
        return torch.zeros(b, sq, h, dv, dtype=torch.float32), lse
    wide = -(-dv // 16) * 16
    out = torch.empty(b, sq, h, wide, dtype=torch.float32)  # (B, Sq, H, Dv) (every row written)
    q, k, v = _rows(q), _rows(k), _rows(_wide(v, wide))
    lo, hi = _bounds(mask)
    failed = lib.ringkv_flash_fwd_f32(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        b,
        sq,
        k.shape[1],
        h,
        k.shape[2],
        d,
        wide,
        _strides(q),
        _strides(k),
        _strides(v),
        _strides(out),
        lo,
        hi,
        scale,
        cap,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("cpu_flash: the forward could not allocate its scratch memory")
    return (out if wide == dv else out[..., :dv].contiguous()), lse


def backward_into(
    dq,
    dk,
    dv,
    dout,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    mask: Mask,
    dlse=None,
    softcap: Optional[float] = None,
    *,
    isa: Optional[str] = None,
) -> None:
    """``backward`` added in place into float32 ``dq`` ``(B, Sq, H, D)``, ``dk``
    ``(B, Sk, Hkv, D)``,
    ``dv`` ``(B, Sk, Hkv, Dv)`` (views with a contiguous last dimension; others are added through a
    copy)."""
    if mask.kind == EMPTY or q.shape[1] == 0 or k.shape[1] == 0:
        return
    targets = (dq, dk, dv)
    if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in targets) or v.shape[-1] % 16:
        for acc, g in zip(
            targets, backward(dout, q, k, v, out, lse, scale, mask, dlse, softcap, isa=isa)
        ):
            acc.add_(g)
        return
    _backward(
        dq, dk, dv, dout, q, k, v, out, lse, scale, mask, dlse, softcap, accumulate=True, isa=isa
    )


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    mask: Mask,
    dlse=None,
    softcap: Optional[float] = None,
    *,
    isa: Optional[str] = None,
):
    """Same contract as ``reference.backward``, ``dlse`` and ``softcap`` included: float32 dq
    ``(B, Sq, H, D)``, dk ``(B, Sk, Hkv, D)``, dv ``(B, Sk, Hkv, Dv)`` (dout/out
    ``(B, Sq, H, Dv)``)."""
    vd = v.shape[-1]
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk, dv = (
        torch.zeros(k.shape, dtype=torch.float32),
        torch.zeros(*v.shape[:-1], -(-vd // 16) * 16),
    )
    if mask.kind != EMPTY and q.shape[1] and k.shape[1]:
        _backward(
            dq,
            dk,
            dv,
            dout,
            q,
            k,
            v,
            out,
            lse,
            scale,
            mask,
            dlse,
            softcap,
            accumulate=False,
            isa=isa,
        )
    return dq, dk, (dv if dv.shape[-1] == vd else dv[..., :vd].contiguous())


def _backward(
    dq, dk, dv, dout, q, k, v, out, lse, scale, mask, dlse, softcap, accumulate: bool, isa=None
) -> None:
    lib = _need(isa)
    b, sq, h, d = q.shape
    _check_dims(q, k, v)
    vd, cap = dv.shape[-1], _cap(softcap)  # dv: as wide as the kernel's V (a multiple of 16)
    q, k = _rows(q), _rows(k)
    dout, v, out = (_rows(_wide(t, vd)) for t in (dout, v, out))
    lse = lse.float().contiguous()  # (B, H, Sq)
    dlse = None if dlse is None else dlse.float().contiguous()
    lo, hi = _bounds(mask)
    failed = lib.ringkv_flash_bwd_f32(
        dout.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        None if dlse is None else dlse.data_ptr(),
        dq.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
        b,
        sq,
        k.shape[1],
        h,
        k.shape[2],
        d,
        vd,
        *(_strides(t) for t in (dout, q, k, v, out, dq, dk, dv)),
        lo,
        hi,
        scale,
        cap,
        int(accumulate),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("cpu_flash: the backward could not allocate its scratch memory")
