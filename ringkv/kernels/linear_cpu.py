"""``nn.Linear`` for the few rows of a CPU decode step: weights packed once, a C kernel
(``csrc/linear.c``) that streams them while it computes.

A decode step of ``T`` rows (one per running sequence) reads every weight once for ``2 T``
FLOPs per weight: for ``T`` up to a few dozen its time is the weights' bytes, and neither MKL
nor oneDNN's packed GEMM keeps memory busy there (float32, 2 threads, SmolLM2's shapes:
oneDNN moves 15-20 GB/s at 16 rows where a plain read moves 35). The kernel packs each weight
into column panels read as one contiguous run and prefetches the next panel while it computes
the current one (docs/kernels.md, the measurements). ``parallel/compiled.py`` puts it into the
compiled CPU decode graph where ``available()``: the kernel builds and its self-check (``status()``:
16 rows through SmolLM2-sized 576 -> 1536 weights, against oneDNN's packed GEMM, cached beside the
build) found it faster on this machine. ``RINGKV_NATIVE_LINEAR=1`` turns it on without the
self-check, ``=0`` off.

The panel width ``NR`` and the register tile are the build's (32 columns with AVX-512, 16 with
AVX2, 8 on a generic target: ``csrc/linear.c``), so a packed weight belongs to the build that packed
it. ``library(isa)``, and the ``isa=`` keyword of ``pack``/``packed_floats``/``packed_linear``, run
the build for another target in this process (tests).

The packed copy is a second copy of the weight (as oneDNN's packing was). Sums run in ``k``
order on one thread per output: the result does not depend on the thread count; it differs from
MKL's in the last bits, as MKL's and oneDNN's differ from each other.
"""

from __future__ import annotations

import copy
import ctypes
import os
from functools import lru_cache
from typing import Optional

import torch
import torch.nn as nn

from . import native

SWITCH = "RINGKV_NATIVE_LINEAR"


@lru_cache(maxsize=None)
def _lib(isa: str) -> Optional[ctypes.CDLL]:
    lib = native.load("linear", isa=isa)
    if lib is None:
        return None
    lib.ringkv_linear_nr.restype = ctypes.c_int64
    lib.ringkv_linear_nr.argtypes = []
    lib.ringkv_linear_packed_floats.restype = ctypes.c_int64
    lib.ringkv_linear_packed_floats.argtypes = [ctypes.c_int64] * 2
    lib.ringkv_linear_pack_f32.restype = None
    lib.ringkv_linear_pack_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.ringkv_linear_f32.restype = None
    lib.ringkv_linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.nr = lib.ringkv_linear_nr()  # the build's panel width, read once
    assert lib.ringkv_linear_packed_floats(1, 1) == lib.nr, (
        "csrc/linear.c's panel width and its packed size disagree"
    )
    return lib


def _floats(lib, n: int, k: int) -> int:
    return -(-n // lib.nr) * k * lib.nr


def library(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernel for ``isa`` (default: ``native.default_isa()``, and None when
    ``RINGKV_NATIVE_LINEAR=0``); None when no compiler builds it (with a warning) or the CPU cannot
    run that target. Whether compiled decode uses it is ``available()``."""
    return _default() if isa is None else _lib(isa)


@lru_cache(maxsize=None)
def _default() -> Optional[ctypes.CDLL]:
    return None if os.environ.get(SWITCH) == "0" else _lib(native.default_isa())


def _need(isa: Optional[str]) -> ctypes.CDLL:
    return native.require(library(isa), "linear_cpu", SWITCH, isa)


def nr(isa: Optional[str] = None) -> int:
    """Output columns per packed panel in the build for ``isa``."""
    return _need(isa).nr


def packed_floats(n: int, k: int, isa: Optional[str] = None) -> int:
    """The packed size of an ``(n, k)`` weight: ``ceil(n / NR)`` panels of ``k * NR`` floats."""
    return _floats(_need(isa), n, k)


def _timed_call(isa: str):
    """The self-check's call: 16 rows (a decode step) through four SmolLM2-sized 576 -> 1536
    weights in turn (14 MiB: more than a core's L2), ours against oneDNN's packed GEMM (what the
    frozen decode graph runs without the kernel; MKL's ``F.linear`` where torch has no oneDNN)."""
    lib = _lib(isa)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g) for _ in range(4)]
    x = torch.randn(16, 576, generator=g)
    ours = [_pack(lib, w) for w in ws]
    if torch.backends.mkldnn.is_available():
        theirs = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]

        def torch_path():
            for w in theirs:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:

        def torch_path():
            for w in ws:
                torch.nn.functional.linear(x, w)

    def kernel():
        for p in ours:
            _linear(lib, x, p, 1536)

    return kernel, torch_path, "16 rows x four 576 -> 1536 weights"


@lru_cache(maxsize=None)
def status() -> dict:
    """The self-check's verdict (``native.self_check``): whether compiled decode runs this kernel
    here, why, and both timings."""
    return native.self_check("linear", SWITCH, _timed_call, "oneDNN's packed GEMM")


def available() -> bool:
    """The kernel is on here: it builds, and ``RINGKV_NATIVE_LINEAR=1`` or its self-check says
    so."""
    return status()["on"]


def pack(weight: torch.Tensor, isa: Optional[str] = None) -> torch.Tensor:
    """An ``nn.Linear`` weight ``(N, K)`` float32 on the CPU -> its packed copy (1-D float32) for
    the build for ``isa`` (default: this process's)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"pack takes a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
            f"on {weight.device}"
        )
    return _pack(_need(isa), weight)


def _pack(lib, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = torch.empty(_floats(lib, n, k), dtype=torch.float32)
    lib.ringkv_linear_pack_f32(w.data_ptr(), packed.data_ptr(), n, k)
    return packed


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, isa: Optional[str] = None
) -> torch.Tensor:
    """``x (..., K)`` times the weight ``pack(W, isa)`` packed: ``(..., n)`` (the op
    ``torch.ops.ringkv.packed_linear`` without ``isa``)."""
    return _linear(_need(isa), x, packed, n)


def _linear(lib, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    k = x.shape[-1]
    if (
        packed.numel() != _floats(lib, n, k)
        or x.dtype != torch.float32
        or packed.dtype != torch.float32
    ):
        raise ValueError(
            f"packed_linear: {packed.numel()} packed {packed.dtype} do not hold a ({n}, {k}) "
            f"float32 weight for x of {x.dtype}"
        )
    x2 = x.reshape(-1, k).contiguous()  # (M, K)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)  # (M, n)
    lib.ringkv_linear_f32(x2.data_ptr(), packed.data_ptr(), y.data_ptr(), x2.shape[0], n, k)
    return y.view(*x.shape[:-1], n)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _linear(_need(None), x, packed, n)


# ringkv::packed_linear(x (..., K), packed, n) -> (..., n), registered with the dispatcher directly
# rather than through torch.library.custom_op: called from Python, custom_op's wrapper added ~15 us
# a call over this one's ~4 (measured); CPU only, no autograd (inference graphs)
_OPS = torch.library.Library("ringkv", "FRAGMENT")
_OPS.define("packed_linear(Tensor x, Tensor packed, int n) -> Tensor")
_OPS.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("ringkv::packed_linear")
def _(x, packed, n):
    return x.new_empty(*x.shape[:-1], n)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (float32, CPU) whose product runs on the packed kernel: the weight is
    packed once, here; the bias (if any) is the original's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.register_buffer("packed", pack(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x):
        y = torch.ops.ringkv.packed_linear(x, self.packed, self.out_features)
        return y if self.bias is None else y + self.bias


def _packable(m: nn.Module) -> bool:
    return (
        isinstance(m, nn.Linear)
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    )


def packs(module: nn.Module) -> bool:
    """Whether ``with_packed_linears`` would pack anything in ``module``: the kernel is on here
    (``available()``) and its linears are float32 on the CPU."""
    return available() and any(_packable(m) for m in module.modules())


def with_packed_linears(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose float32 CPU ``nn.Linear`` s are ``PackedLinear`` s; its
    parameters and buffers are ``module``'s own tensors, not copies (a plain tensor attribute,
    which is neither, is copied)."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    out = copy.deepcopy(module, memo)
    for m in list(out.modules()):
        for child_name, child in list(m.named_children()):
            if _packable(child):
                setattr(m, child_name, PackedLinear(child))
    return out
