"""What the Triton kernels of ``triton_attn``, ``triton_paged`` and ``triton_merge`` share: the lazy
jit (``LAZY``, ``build``, the process's kernel registry ``KERNELS``), the device helpers ``dot``,
``cast``, ``online_step`` and ``finish``, and the launch helpers ``interpret``, ``big_rows``,
``head_block`` and ``dot_prec``.

Importing this module does not import triton (only checks it is installed): the kernels are
decorated on first use (``build``), because triton fixes "compile for a GPU" vs "interpret on CPU"
when *it* is imported, and ``TRITON_INTERPRET`` may be set later. Until then ``triton`` in a kernel
module is ``LAZY``, whose ``@triton.jit`` marks a kernel; ``build`` binds the real ``triton`` and
``tl`` there. Kernels call each other across modules by name: ``build`` puts every kernel into the
globals of every kernel's module.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if (
    importlib.util.find_spec("triton") is None
):  # the registry imports us inside ``except ImportError``
    raise ImportError("triton is not installed (pip install 'ringkv[triton]')")


def interpret() -> bool:
    """Whether triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonKernels:
    """The Triton kernels of this process, from every module: functions marked by ``jit``, built
    (decorated in place) once by ``build``, and their autotuned wrappers made on first CUDA launch
    (``tuned``). Names are unique across modules."""

    def __init__(self):
        self._pending = []  # (python function, triton.jit options) of kernels not built yet
        self._built = {}  # name -> built kernel
        self._tuned = {}  # built kernel -> its autotuned wrapper
        self._imported = False

    def jit(self, fn=None, **options):
        """Mark a kernel for ``triton.jit``; ``build`` decorates it in place on first use."""
        if fn is None:
            return lambda f: self.jit(f, **options)
        self._pending.append((fn, options))
        return fn

    def build(self) -> None:
        """Import triton and turn every marked function into a kernel (once per process)."""
        global triton, tl
        if self._imported and not self._pending:
            return
        import triton as _triton
        import triton.language as _tl

        if interpret() and isinstance(getattr(_tl, "zeros", None), _triton.runtime.JITFunction):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported in this process; "
                "set it before anything imports triton (e.g. at the top of tests/conftest.py)"
            )
        triton, tl, self._imported = _triton, _tl, True

        def wrap(kernel):  # the shortcut needs the interpreter's rewrite() (triton 3.x has it)
            return _Interpreted(kernel) if interpret() and hasattr(kernel, "rewrite") else kernel

        pending = self._pending
        self._built.update({fn.__name__: wrap(_triton.jit(**opts)(fn)) for fn, opts in pending})
        for fn, _ in pending:  # kernels call each other across modules by name (e.g. ``dot``)
            fn.__globals__.update(self._built, triton=_triton, tl=_tl)
        pending.clear()

    def tuned(self, kernel, make):
        """``kernel``'s autotuned wrapper, made by ``make(kernel)`` on first use."""
        if kernel not in self._tuned:
            self._tuned[kernel] = make(kernel)
        return self._tuned[kernel]

    def snapshot(self) -> dict:
        """Names of the kernels marked but not built, built, and autotuned so far."""
        return dict(
            pending=[fn.__name__ for fn, _ in self._pending],
            built=sorted(self._built),
            tuned=sorted(getattr(k, "__name__", repr(k)) for k in self._tuned),
        )

    def reset(self) -> None:
        """Forget the autotuned wrappers (the next CUDA launch tunes again); built kernels stay."""
        self._tuned.clear()


class _Interpreted:
    """A kernel under the interpreter: launched as ``kernel[grid](...)`` like triton's own, and
    called from another kernel as the interpreter's rewritten Python function directly. Triton's
    device-function call re-patches ``triton.language`` first (``inspect.getmembers`` of it, on
    every call), which the launch around it has already done: a quarter to a third of the time of
    a small launch, where kernels call ``dot``, ``cast`` and ``online_step`` per key tile."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        return self.kernel[grid]

    def __call__(self, *args, **kwargs):
        return self.kernel.rewrite()(*args, **kwargs)


class LazyTriton:
    """``triton`` in a kernel module until ``build`` binds the real module there: its ``jit``
    marks a kernel (``@triton.jit``, ``@triton.jit(do_not_specialize=...)``) for ``build``."""

    def __init__(self, kernels: TritonKernels):
        self.jit = kernels.jit


KERNELS = TritonKernels()
LAZY = LazyTriton(KERNELS)
build = KERNELS.build
triton, tl = LAZY, None  # build() binds the real modules; kernel bodies read ``tl`` as a global


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """``a @ b`` accumulated in fp32. PREC: "ieee" (fp32 inputs), "tf32", or "upcast": the
    CPU interpreter multiplies bf16 bit patterns as integers, so there both sides go to
    fp32 first (exact for bf16 values; the GPU's bf16 dot also accumulates in fp32)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def cast(x, DT: tl.constexpr, PREC: tl.constexpr):
    """fp32 ``x`` as ``DT``, rounded to nearest even as the GPU does. Triton's CPU interpreter
    truncates fp32 to bf16 (one ulp low, always the same way: an output just under a bf16
    value lands a whole ulp under it), so there ("upcast") the bits are rounded first."""
    if PREC == "upcast":
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def online_step(acc, m_i, l_i, s, v, PREC: tl.constexpr):
    """One key tile of the online softmax (base 2): ``s (BR, BN)`` masked scores (-inf: hidden)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype, PREC), v, PREC)
    return acc, m_new, l_i


@triton.jit
def finish(acc, m_i, l_i):
    """``(out fp32 (BR, BD), base-2 lse (BR,))``; rows that saw no key: 0 and -inf."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    return out, tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))


# ----------------------------------------------------------------------------- launch helpers


def big_rows(elem_bytes: int, block_d: int) -> bool:
    """fp32 with D > 64 or fp16/bf16 with D > 128: large tiles overflow shared memory."""
    return elem_bytes * block_d > 256


def head_block(d: int) -> int:
    """A head size's tile width: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(d))


def dot_prec(dtype) -> str:
    """How ``dot`` multiplies: fp32 inputs without tf32 rounding; bf16 upcast in the
    interpreter."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if dtype == torch.bfloat16 and interpret() else "tf32"
