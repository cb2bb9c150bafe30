"""A decoder layer's elementwise parts: RMSNorm, RoPE (q and k at once) and the gated MLP's SiLU
times up, each one C call (``csrc/pointwise.c``) on an eager CPU step where eager torch runs
3-14 ops.

An eager decode step of SmolLM2 (30 layers, 16 rows) ran ~1,200 torch op calls; their dispatch and
the Python around them were about a third of the step (docs/performance.md). These functions are
what the model calls (``model/llama.py``); each runs the kernel when ``runs(x)``: a float32 CPU
tensor with no autograd and no tracing (a compiled or exported graph traces the torch ops and fuses
them itself), and the kernel is on (``available()``: it builds and its self-check, a decode step's
calls against the same torch ops, found it faster; ``RINGKV_NATIVE_POINTWISE=1`` on without the
check, ``=0`` off). Otherwise, or for a layout the kernel does not take, the torch ops below run:
they are the definition.

Bits: RoPE is torch's to the bit (the same roundings); RMSNorm's mean of squares is summed in
another order than torch's reduction (last bits) and SiLU's exp is a polynomial (relative error
~1e-7): the eager step's results move in the last bits, as the compiled graph's do.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import native

SWITCH = "RINGKV_NATIVE_POINTWISE"


@lru_cache(maxsize=None)
def _lib(isa: str) -> Optional[ctypes.CDLL]:
    lib = native.load("pointwise", isa=isa)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ringkv_rms_norm_f32.argtypes = [p] * 3 + [i64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.ringkv_rope_f32.argtypes = [p] * 6 + [i64] * 5
    lib.ringkv_silu_mul_f32.argtypes = [p] * 3 + [i64]
    for fn in (lib.ringkv_rms_norm_f32, lib.ringkv_rope_f32, lib.ringkv_silu_mul_f32):
        fn.restype = None
    return lib


@lru_cache(maxsize=None)
def _default() -> Optional[ctypes.CDLL]:
    return None if os.environ.get(SWITCH) == "0" else _lib(native.default_isa())


def library(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernels for ``isa`` (default: the process's; None when ``RINGKV_NATIVE_POINTWISE
    =0``), or None when they do not build here."""
    return _default() if isa is None else _lib(isa)


def _timed_call(isa: str):
    """The self-check's call: one layer's elementwise work in a 16-row decode step of SmolLM2
    (two 576-wide norms, RoPE on 9 + 3 heads of 64, SiLU x up over 1536), kernels against torch."""
    lib = _lib(isa)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.rand(576, generator=g)
    q, k = torch.randn(16, 9, 64, generator=g), torch.randn(16, 3, 64, generator=g)
    cos, sin = torch.rand(16, 1, 64, generator=g), torch.rand(16, 1, 64, generator=g)
    gate, up = torch.randn(16, 1536, generator=g), torch.randn(16, 1536, generator=g)

    def run(rms, rot, silu):
        for _ in range(2):
            rms(x, w, 1e-5, False)
        rot(q, k, cos, sin)
        silu(gate, up)

    return (
        lambda: run(
            lambda *a: _rms_norm(lib, *a),
            lambda *a: _rope(lib, *a),
            lambda *a: _silu_mul(lib, *a),
        ),
        lambda: run(
            _torch_rms_norm,
            _torch_rope,
            _torch_silu_mul,
        ),
        "one layer's norms, RoPE and SiLU x up at 16 rows (SmolLM2's shapes)",
    )


@lru_cache(maxsize=None)
def status() -> dict:
    """The self-check's verdict (``native.self_check``): whether the eager model runs these kernels
    here, why, and both timings."""
    return native.self_check("pointwise", SWITCH, _timed_call, "torch's elementwise ops")


def available() -> bool:
    """The kernels are on here: they build, and ``RINGKV_NATIVE_POINTWISE=1`` or the self-check
    says so."""
    return status()["on"]


def runs(x: torch.Tensor) -> bool:
    """Whether the model's elementwise ops on ``x`` run the kernels: a float32 CPU tensor, no
    autograd, no tracing, and ``available()``."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and available()
    )


# ---- RMSNorm ----------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False):
    """``x (..., D)``, ``weight (D,)`` -> ``(..., D)``: ``weight * x / sqrt(mean(x^2) + eps)``,
    the statistics in float32 like HF's, cast back to ``x``'s dtype before the weight; Gemma
    (``plus_one``): scaled by ``1 + weight`` in float32, then cast."""
    if x.numel() and weight.shape == x.shape[-1:] and weight.dtype == torch.float32 and runs(x):
        return _rms_norm(_default(), x.contiguous(), weight, eps, plus_one)
    return _torch_rms_norm(x, weight, eps, plus_one)


def _torch_rms_norm(x, weight, eps, plus_one):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def _rms_norm(lib, x, weight, eps, plus_one):
    d = x.shape[-1]
    out = torch.empty_like(x)
    lib.ringkv_rms_norm_f32(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps, plus_one
    )
    return out


# ---- RoPE -------------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE ("rotate_half"): ``x (T, heads, D)``, ``cos``/``sin`` ``(T, 1, rd)`` with
    ``rd <= D``: the first ``rd`` channels of each head rotate, the rest pass."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([rotate_half(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = rd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope(q, k, cos, sin) -> Tuple[torch.Tensor, torch.Tensor]:
    """``rotate_half`` of ``q (T, H, D)`` and ``k (T, Hkv, D)`` with the same ``cos``/``sin``
    ``(T, 1, rd)``: ``(q, k)`` rotated, new tensors."""
    t, rd = q.shape[0], cos.shape[-1]
    if (
        q.dim() == k.dim() == 3
        and k.shape[0] == t
        and k.shape[2] == q.shape[2] >= rd
        and rd % 2 == 0
        and cos.shape == sin.shape == (t, 1, rd)
        and k.dtype == cos.dtype == sin.dtype == torch.float32
        and q.is_contiguous()
        and k.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and runs(q)
    ):
        return _rope(_default(), q, k, cos, sin)
    return _torch_rope(q, k, cos, sin)


def _torch_rope(q, k, cos, sin):
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin)


def _rope(lib, q, k, cos, sin):
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    t, hq, d = q.shape
    lib.ringkv_rope_f32(
        q.data_ptr(),
        k.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        qo.data_ptr(),
        ko.data_ptr(),
        t,
        hq,
        k.shape[1],
        d,
        cos.shape[-1],
    )
    return qo, ko


# ---- SiLU x up --------------------------------------------------------------------------------


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, both ``(..., I)`` of one shape -> ``(..., I)``."""
    if (
        gate.shape == up.shape
        and up.dtype == torch.float32
        and gate.is_contiguous()
        and up.is_contiguous()
        and runs(gate)
    ):
        return _silu_mul(_default(), gate, up)
    return _torch_silu_mul(gate, up)


def _torch_silu_mul(gate, up):
    return F.silu(gate) * up


def _silu_mul(lib, gate, up):
    out = torch.empty_like(gate)
    lib.ringkv_silu_mul_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out
