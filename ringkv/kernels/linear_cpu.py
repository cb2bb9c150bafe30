"""``nn.Linear`` for the few rows of a CPU decode step: weights packed once, a C kernel
(``csrc/linear.c``) that streams them while it computes.

A decode step of ``T`` rows (one per running sequence) reads every weight once for ``2 T``
FLOPs per weight: for ``T`` up to a few dozen its time is the weights' bytes, and neither MKL
nor oneDNN's packed GEMM keeps memory busy there (float32, 2 threads, SmolLM2's shapes:
oneDNN moves 15-20 GB/s at 16 rows where a plain read moves 35). The kernel packs each weight
into column panels read as one contiguous run and prefetches the next panel while it computes
the current one (docs/kernels.md, the measurements). ``parallel/compiled.py`` puts it into the
compiled CPU decode graph; ``RINGKV_NATIVE_LINEAR=0`` turns it off there.

The packed copy is a second copy of the weight (as oneDNN's packing was). Sums run in ``k``
order on one thread per output: the result does not depend on the thread count; it differs from
MKL's in the last bits, as MKL's and oneDNN's differ from each other.
"""

from __future__ import annotations

import copy
import ctypes
from functools import lru_cache
from typing import Optional

import torch
import torch.nn as nn

from . import native


NR = 32  # output columns per packed panel (csrc/linear.c)


def packed_floats(n: int, k: int) -> int:
    """The packed size of an ``(n, k)`` weight: ``ceil(n / NR)`` panels of ``k * NR`` floats."""
    return -(-n // NR) * k * NR


@lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel; None when turned off or no compiler builds it (with a warning)."""
    lib = native.load("linear", "RINGKV_NATIVE_LINEAR")
    if lib is None:
        return None
    lib.ringkv_linear_packed_floats.restype = ctypes.c_int64
    lib.ringkv_linear_packed_floats.argtypes = [ctypes.c_int64] * 2
    lib.ringkv_linear_pack_f32.restype = None
    lib.ringkv_linear_pack_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.ringkv_linear_f32.restype = None
    lib.ringkv_linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    assert lib.ringkv_linear_packed_floats(1, 1) == NR, "csrc/linear.c and linear_cpu.NR disagree"
    return lib


def available() -> bool:
    """The compiled kernel loads here."""
    return library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An ``nn.Linear`` weight ``(N, K)`` float32 on the CPU -> its packed copy (1-D float32)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack takes a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    lib, (n, k) = library(), weight.shape
    w = weight.detach().contiguous()
    packed = torch.empty(packed_floats(n, k), dtype=torch.float32)
    lib.ringkv_linear_pack_f32(w.data_ptr(), packed.data_ptr(), n, k)
    return packed


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    k = x.shape[-1]
    if packed.numel() != packed_floats(n, k) or x.dtype != torch.float32 or packed.dtype != torch.float32:
        raise ValueError(f"packed_linear: {packed.numel()} packed {packed.dtype} do not hold a ({n}, {k}) float32 "
                         f"weight for x of {x.dtype}")
    x2 = x.reshape(-1, k).contiguous()  # (M, K)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)  # (M, n)
    library().ringkv_linear_f32(x2.data_ptr(), packed.data_ptr(), y.data_ptr(), x2.shape[0], n, k)
    return y.view(*x.shape[:-1], n)


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
    return isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def packs(module: nn.Module) -> bool:
    """Whether ``with_packed_linears`` would pack anything in ``module``: the kernel loads and
    its linears are float32 on the CPU."""
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
