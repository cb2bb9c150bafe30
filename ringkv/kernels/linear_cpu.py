"""``nn.Linear`` on the CPU with its weight packed once: a C kernel (``csrc/linear.c``) that
streams the weight while it computes.

A decode step of ``T`` rows (one per running sequence) reads every weight once for ``2 T``
FLOPs per weight: for ``T`` up to a few dozen its time is the weights' bytes, and neither MKL
nor oneDNN's packed GEMM keeps memory busy there (float32, 2 threads, SmolLM2's shapes:
oneDNN moves 15-20 GB/s at 16 rows where a plain read moves 35). The kernel packs each weight
into column panels read as one contiguous run and prefetches the next panel while it computes
the current one; a prefill's many rows split into row groups over the threads, each a register
tile over a panel (docs/kernels.md, the measurements: ahead of MKL's ``F.linear`` from 1 to 2048
rows on SmolLM2's and Llama-8B's shapes, AVX-512 and AVX2). The engine's CPU model runs its float32
linears on it (``pack_linears``, ``parallel/worker.py``: eager steps and the compiled graphs alike)
where ``available()``: the kernel builds and its self-check (``status()``: 16 and 256 rows through
SmolLM2-sized 576 -> 1536 weights, against ``F.linear``, cached beside the build) found it faster
on this machine. ``RINGKV_NATIVE_LINEAR=1`` turns it on without the self-check, ``=0`` off.

The panel width ``NR`` and the register tile are the build's (32 columns with AVX-512, 16 with
AVX2, 8 on a generic target: ``csrc/linear.c``), so a packed weight belongs to the build that packed
it. ``library(isa)``, and the ``isa=`` keyword of ``pack``/``packed_floats``/``packed_linear``, run
the build for another target in this process (tests).

The packed copy replaces the weight (``pack_linears`` drops the linear's reference); an embedding
tied to an LM head reads its rows from the head's packed copy (``PackedEmbedding``). Sums run in
``k`` order on one thread per output: the result depends neither on the thread count nor on the
other rows; it differs from MKL's in the last bits.
"""

from __future__ import annotations

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
    lib.ringkv_linear_rows_f32.restype = ctypes.c_int
    lib.ringkv_linear_rows_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
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


# the C-ABI declaration AOTInductor calls ringkv::packed_linear by (csrc/linear.c)
SHIM = (
    "AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, "
    "int64_t n, AtenTensorHandle* out)"
)
_TORCH_C = [  # torch's C functions the shim calls, in ringkv_linear_aoti_init's order
    "aoti_torch_get_data_ptr",
    "aoti_torch_get_dim",
    "aoti_torch_get_sizes",
    "aoti_torch_get_strides",
    "aoti_torch_get_dtype",
    "aoti_torch_get_numel",
    "aoti_torch_empty_strided",
]


_shim_build: list = []  # the build whose aoti_torch_cpu_packed_linear this process's graphs call


def aoti_shim() -> Optional[dict]:
    """AOTInductor's ``custom_ops_to_c_shims`` entry for ``ringkv::packed_linear``, or None where
    the kernel is off (or torch's C functions are not found): a graph compiled with it calls this
    process's build of the kernel directly (``aoti_torch_cpu_packed_linear``), not through Python.
    Made ready on the first call: the build is made global (a package's reference to that symbol
    resolves to it when the package is loaded) and handed torch's C functions. The first build
    made global keeps the symbol, so None also where the process's build has changed since."""
    lib = _default()
    if lib is None:
        return None
    if not _shim_build:
        try:
            api = ctypes.CDLL(
                os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
            )
            fns = [ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in _TORCH_C]
            codes = api.aoti_torch_dtype_float32, api.aoti_torch_device_type_cpu
            glob = ctypes.CDLL(lib._name, mode=os.RTLD_GLOBAL | os.RTLD_NOW)  # the same library
        except (OSError, AttributeError):
            return None
        for f in codes:
            f.restype, f.argtypes = ctypes.c_int32, []
        glob.ringkv_linear_aoti_init.restype = None
        glob.ringkv_linear_aoti_init.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int32] * 2
        glob.ringkv_linear_aoti_init(*fns, *(f() for f in codes))
        _shim_build.append(lib._name)
    if _shim_build[0] != lib._name:
        return None
    return {torch.ops.ringkv.packed_linear.default: [SHIM]}


def _need(isa: Optional[str]) -> ctypes.CDLL:
    return native.require(library(isa), "linear_cpu", SWITCH, isa)


def nr(isa: Optional[str] = None) -> int:
    """Output columns per packed panel in the build for ``isa``."""
    return _need(isa).nr


def packed_floats(n: int, k: int, isa: Optional[str] = None) -> int:
    """The packed size of an ``(n, k)`` weight: ``ceil(n / NR)`` panels of ``k * NR`` floats."""
    return _floats(_need(isa), n, k)


def _timed_call(isa: str):
    """The self-check's call: a decode step's 16 rows, then a prefill chunk's 256, through four
    SmolLM2-sized 576 -> 1536 weights in turn (14 MiB: more than a core's L2), ours against
    ``F.linear`` (MKL: what the engine's linears run without the kernel). The prefill's FLOPs
    weigh most in the sum: a CPU where MKL wins the compute-bound rows keeps MKL."""
    lib = _lib(isa)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g) for _ in range(4)]
    xs = [torch.randn(rows, 576, generator=g) for rows in (16, 256)]
    ours = [_pack(lib, w) for w in ws]

    def torch_path():
        for x in xs:
            for w in ws:
                torch.nn.functional.linear(x, w)

    def kernel():
        for x in xs:
            for p in ours:
                _linear(lib, x, p, 1536)

    return kernel, torch_path, "16 rows, then 256, x four 576 -> 1536 weights"


@lru_cache(maxsize=None)
def status() -> dict:
    """The self-check's verdict (``native.self_check``): whether the engine's CPU linears run this
    kernel here, why, and both timings."""
    return native.self_check("linear", SWITCH, _timed_call, "F.linear (MKL)")


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


def _packed_rows(ids: torch.Tensor, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Rows ``ids`` of the ``(n, k)`` weight ``packed`` holds: ``(..., k)``."""
    lib = _need(None)
    flat = ids.reshape(-1).contiguous()  # (T,)
    if packed.numel() != _floats(lib, n, k) or flat.dtype != torch.long:
        raise ValueError(f"packed_rows: {packed.numel()} packed floats, {flat.dtype} ids")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)  # (T, k)
    t = flat.numel()
    if lib.ringkv_linear_rows_f32(packed.data_ptr(), flat.data_ptr(), out.data_ptr(), t, n, k):
        raise IndexError(f"token ids must be in [0, {n}), got {flat.tolist()[:8]}...")
    return out.view(*ids.shape, k)


# ringkv::packed_rows(ids (...), packed, n, k) -> (..., k): a tied embedding's lookup
_OPS.define("packed_rows(Tensor ids, Tensor packed, int n, int k) -> Tensor")
_OPS.impl("packed_rows", _packed_rows, "CPU")


@torch.library.register_fake("ringkv::packed_rows")
def _(ids, packed, n, k):
    return packed.new_empty(*ids.shape, k)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (float32, CPU) whose product runs on the packed kernel: the weight is
    packed once, here; the bias (if any) is the original's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.register_buffer("packed", pack(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x):
        n, k = self.out_features, self.in_features
        if (  # an eager step's (T, K) rows: the kernel straight from here, ~4 us a call less
            x.dim() == 2
            and x.shape[1] == k
            and x.dtype == torch.float32
            and x.is_contiguous()
            and not torch.compiler.is_compiling()
        ):
            y = torch.empty(x.shape[0], n)  # (T, n)
            _need(None).ringkv_linear_f32(
                x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), x.shape[0], n, k
            )
        else:  # the op: checks its arguments; what compiled graphs call
            y = torch.ops.ringkv.packed_linear(x, self.packed, n)
        return y if self.bias is None else y + self.bias


def _packable(m: nn.Module) -> bool:
    return (
        type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    )


class PackedEmbedding(nn.Module):
    """An ``nn.Embedding`` tied to a ``PackedLinear`` (an LM head sharing the embedding's weight):
    its rows are read from the head's packed copy, so the weight is held once. Row ``r`` is column
    ``r % NR`` of panel ``r // NR``: the same floats."""

    def __init__(self, head: PackedLinear, dim: int):
        super().__init__()
        self.rows, self.dim = head.out_features, dim
        self.register_buffer("packed", head.packed, persistent=False)  # the head's: no copy

    def forward(self, ids):
        return torch.ops.ringkv.packed_rows(ids, self.packed, self.rows, self.dim)  # (..., dim)


def pack_linears(module: nn.Module) -> nn.Module:
    """``module`` with its float32 CPU ``nn.Linear`` s replaced, in place, by ``PackedLinear`` s
    when the kernel is on here (``available()``; else untouched): each weight is packed once and
    the linear's reference to it dropped, so the packed copy replaces it in memory (the other
    parameters are copied, so that a checkpoint's file mapping they were read from is let go). An
    ``nn.Embedding`` tied to such a linear (the same weight tensor: a tied LM head) becomes a
    ``PackedEmbedding`` reading the packed copy. Returns ``module``."""
    if not available():
        return module
    heads = {}  # id(weight) -> its PackedLinear
    for m in list(module.modules()):
        for child_name, child in list(m.named_children()):
            if _packable(child):
                heads[id(child.weight)] = PackedLinear(child)
                setattr(m, child_name, heads[id(child.weight)])
    for m in list(module.modules()):
        for child_name, child in list(m.named_children()):
            if type(child) is nn.Embedding and id(child.weight) in heads:
                tied = heads[id(child.weight)]
                setattr(m, child_name, PackedEmbedding(tied, child.embedding_dim))
    if heads:  # what was not packed gets memory of its own: a tensor read from a checkpoint's
        for p in module.parameters():  # file mapping holds the whole mapping, packed weights too
            p.data = p.data.clone()
    return module


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights as the checkpoint has them: its parameters and its packed
    linears' weights (each once; not the packed copies' panel padding)."""
    packed = sum(
        4 * m.out_features * m.in_features for m in module.modules() if isinstance(m, PackedLinear)
    )
    return packed + sum(p.numel() * p.element_size() for p in module.parameters())


def is_packed(module: nn.Module) -> bool:
    """Whether any of ``module``'s linears runs on the packed kernel."""
    return any(isinstance(m, PackedLinear) for m in module.modules())
