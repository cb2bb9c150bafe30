"""Opt-in compiled steps (``EngineConfig(compile_decode=True)``): a step's dense parts compiled
(CPU: AOTInductor packages; CUDA: ``torch.compile``), attention eager.

A step in which every scheduled sequence computes one token (a decode step: no prefill chunk)
and whose row count ``T`` is in range (below) runs this rank's stage (``stage_forward``:
embedding, layers, final norm, as the stage holds them) as ONE compiled graph. The model's
one attention call site, ``ctx.attend``, is traced as the opaque custom op
``ringkv::decode_attend``, which runs the step's real ``StepContext.attend`` eagerly: the
paged KV-cache write, the paged attention and, under ``sp > 1``, the merge across the SP
group. Its shapes change with every step's context lengths and it calls collectives, so it is
never traced; the compiler only knows its output has ``q``'s shape. On CUDA every other step
(prefill, chunked prefill, a step mixing prefill and decode, a ``T`` out of range) runs
``stage_forward`` eagerly, as without the option; on CPU those steps get a graph of their own
(below). Ring-mode steps (``sp > 1`` prefill split over the SP group) always run eagerly. The
model file is unchanged.

**CPU: AOTInductor packages.** Every CPU graph is a ``.pt2`` package (``packages``):
``torch.export`` of the stage (``_Stage``) or the LM head (``_Head``) with a dynamic row count
(``torch.export.Dim``), compiled by ``torch._inductor.aoti_compile_and_package`` once per
machine into the artifact cache (``autocompile.ArtifactCache.packages``) and only loaded at
later starts (``warm_up``; no tracing, no AOTAutograd: that is what made a warm
``torch.compile`` start cost 23-40 s, docs/performance.md). A package holds no weights
(``package_constants_in_so=False``): ``load_package`` hands its runner the live model's own
tensors (no copy), so a package built with one checkpoint runs another of the same architecture
with that one's weights. So no graph is frozen: freezing folds constants computed from the
model's tensors into new ones (seen: RoPE's ``inv_freq``), which would carry the build's values
along; ``load_package`` refuses a package that needs a constant the model does not hold.

**CPU, decode steps** (tested): one graph for ``CPU_MIN_ROWS``..``max_num_seqs`` rows, the
elementwise ops fused; the LM head of those steps is a second graph. The linears run what the
model holds: float32 linears on ``kernels/linear_cpu.py``'s packed C kernel where it is on (the
worker packs the model once, for its eager steps too), else MKL's GEMMs on the weights (unfrozen:
no oneDNN packing; ``"auto"`` measures whether that still wins); ``linear_kind`` says which. The
graph calls the packed kernel in C (``linear_cpu.aoti_shim``: AOTInductor's C-shim call of the
op), not back through Python as it calls attention (a 16-row SmolLM2 step: 58-63 -> 55-58 ms).
Steps of fewer than ``CPU_MIN_ROWS = 4`` rows stay eager (measured 0.84-0.97x compiled). No
buckets on CPU: the one dynamic graph is built once.

**CPU, every other step** (prefill, chunks, steps mixing them with decode rows;
``CPU_MIN_ROWS`` rows or more): a third graph, its GEMMs the eager path's, its elementwise work
(norms, RoPE, SiLU, residuals) fused (with ``torch.compile``, a 2048-row stage of SmolLM2-135M
took 1.21 s against 1.83 s eager, 2 threads).

**CUDA**: static buckets (``decode_buckets``: 1, 2, 4, ..., ``max_num_seqs``; ``T`` padded up
to the next) with ``mode="reduce-overhead"``: CUDA graphs over the dense pieces, the attention
op (tagged ``cudagraph_unsafe``) kept out of them by inductor's graph partitioning, so it runs
eagerly between the replays. UNTESTED on a GPU: written to the documented contract
(``torch.compiler.cudagraph_mark_step_begin()`` before each step, the output cloned before it
leaves the step, every bucket warmed up and recorded at start), never run.

**Padding rows** (CUDA buckets) are zeros seen only by the dense parts: the attention op hands
``ctx.attend`` the first ``T`` rows of q/k/v (a padding row never writes the KV cache) and pads
its output back with zeros; every dense op is row-wise, so a padding row never changes a real
row.

**Hybrid models.** A recurrent layer's sequential part (``ctx.recur``) is the second opaque op,
``ringkv::decode_recur``: it runs the step's real ``StepContext.recur`` (its scans and the state
slots) eagerly. Its output width is known before tracing from one eager pass at start-up
(``_Recorder``), which also keeps each layer's ``scan`` for the op to call.

Tensor parallelism is not supported (its all-reduces sit inside the dense parts, in
``RowParallelLinear`` and the vocab-parallel embedding): ``LLM`` refuses ``compile_decode``
with ``tp > 1``. ``pp`` and ``sp`` work: each rank compiles its own stage. CUDA: compiled code
lives as long as the process (torch's compile cache keeps it), also after ``LLM.close()``; CPU:
the runners live as long as this object.
"""

from __future__ import annotations

import bisect
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..kernels import linear_cpu
from .autocompile import inductor_dir
from .pp import stage_forward

log = logging.getLogger(__name__)
CPU_MIN_ROWS = 4  # CPU: fewer rows run eagerly (measured slower compiled; docstring)
_active = (
    threading.local()
)  # the step the attention op answers for: .ctx (a StepContext), .rows (real T)


# cudagraph_unsafe (torch >= 2.8) keeps the op out of CUDA graphs; older torch has no such tag
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ringkv::decode_attend", mutates_args=(), tags=_TAGS)
def decode_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    window: int = -1,
) -> torch.Tensor:
    """The current step's ``ctx.attend(layer, q, k, v, ...)`` over its real rows (``scale``,
    ``softcap``, ``window``: the layer's, as the model passes them); padding rows of the output are
    zeros. Opaque to the compiler (it writes the KV cache, reads it, may communicate)."""
    ctx, t = _active.ctx, _active.rows
    out = ctx.attend(
        layer, q[:t], k[:t], v[:t], scale=scale, softcap=softcap, window=window
    )  # new (T, H, D)
    pad = q.shape[0] - t
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


@decode_attend.register_fake
def _(q, k, v, layer, scale=None, softcap=None, window=-1):
    return torch.empty_like(q)


@torch.library.custom_op("ringkv::decode_recur", mutates_args=(), tags=_TAGS)
def decode_recur(u: torch.Tensor, layer: int, features: int) -> torch.Tensor:
    """A hybrid model's recurrent layer: the current step's ``ctx.recur(layer, scan, u, shapes)``
    over its real rows (the layer's ``scan`` and state shapes as ``_Recorder`` found them) ->
    ``(T, features)``; padding rows of the output are zeros. Opaque to the compiler (it reads and
    writes the state slots)."""
    ctx, t = _active.ctx, _active.rows
    fn, shapes = _active.mixers[layer]
    out = ctx.recur(layer, fn, u[:t], shapes)
    pad = u.shape[0] - t
    return F.pad(out, (0, 0, 0, pad)) if pad else out


@decode_recur.register_fake
def _(u, layer, features):
    return u.new_empty(u.shape[0], features)


class _OpContext:
    """The ``ctx`` the compiled stage is traced with: attention is the custom op."""

    @staticmethod
    def attend(
        layer: int,
        q,
        k,
        v,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ):
        return torch.ops.ringkv.decode_attend(q, k, v, layer, scale, softcap, window)

    @staticmethod
    def recur(layer: int, fn, u, shapes):
        return torch.ops.ringkv.decode_recur(u, layer, fn.__self__._ringkv_features)


class _Zeros:
    """Warm-up: attention and recurrent layers that return zeros and touch no cache."""

    @staticmethod
    def attend(layer: int, q, k, v, **kw):
        return torch.zeros_like(q)

    @staticmethod
    def recur(layer: int, fn, u, shapes):
        return u.new_zeros(u.shape[0], fn.__self__._ringkv_features)


class _Recorder:
    """An eager pass before compiling: each recurrent layer's ``scan`` and state shapes (what the
    ``decode_recur`` op runs) and its output width (``_ringkv_features`` on the mixer: what the
    op's fake answers while tracing); attention answers zeros."""

    def __init__(self, mixers: dict):
        self.mixers = mixers

    @staticmethod
    def attend(layer: int, q, k, v, **kw):
        return torch.zeros_like(q)

    def recur(self, layer: int, fn, u, shapes):
        states = [u.new_zeros(u.shape[0], *s, dtype=torch.float32) for s in shapes]
        y, _ = fn(u[:, None], states)  # (T, 1, F')
        fn.__self__._ringkv_features = y.shape[-1]
        self.mixers.setdefault(layer, (fn, shapes))
        return y[:, 0]


_OP_CONTEXT = _OpContext()


def _stage(model, x, positions):
    return stage_forward(model, x, positions, _OP_CONTEXT)


class _Stage(torch.nn.Module):
    """``stage_forward`` over ``model`` as a module (what a CPU stage graph is exported from): its
    constants are ``model``'s tensors, named ``model.<name>``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, positions):
        return stage_forward(self.model, x, positions, _OP_CONTEXT)


class _Head(torch.nn.Module):
    """``model.logits`` as a module (the CPU LM head graph's export)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden):
        return self.model.logits(hidden)


def build_package(module, inputs: tuple, dims: dict, path: Path) -> None:
    """Export ``module`` on ``inputs`` (``dims``: its dynamic dimensions, ``torch.export`` style)
    and compile it with AOTInductor into the package ``path`` (``.pt2``), constants NOT in it
    (the live model's tensors are loaded into the runner, ``load_package``). Not frozen: freezing
    folds constants computed from the weights into new ones (measured: RoPE's ``inv_freq``), which
    would carry the build's values to another checkpoint."""
    ep = torch.export.export(module, inputs, dynamic_shapes=dims)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new.pt2")
    configs = {"freezing": False, "aot_inductor.package_constants_in_so": False}
    shim = linear_cpu.aoti_shim()
    if shim is not None:  # the packed linears called in C, not through Python (csrc/linear.c)
        configs["aot_inductor.custom_ops_to_c_shims"] = shim
    with tempfile.TemporaryDirectory(prefix="ringkv-aoti-") as scratch, inductor_dir(scratch):
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp), inductor_configs=configs
        )
    os.replace(tmp, path)  # a package is there whole or not at all


def load_package(path: Path, module):
    """The AOTInductor runner of the package ``path`` with ``module``'s own tensors as its
    constants (no copy: the runner holds pointers, ``module`` keeps them alive), so it computes
    with the live weights, whatever checkpoint the package was built with. A package that needs a
    constant ``module`` does not hold (one folded from the weights at build time) is refused."""
    # the loader torch._inductor.aoti_load_package ends in, without its device check: that check
    # (only a warning) compiles and dlopens inductor's ISA probes, 2-30 s at a start (measured);
    # the artifact cache's key already holds the ISA and the CPU's flags
    from torch.export.pt2_archive._package import AOTICompiledModel  # imports torch._dynamo

    linear_cpu.aoti_shim()  # a package calling the packed linear in C finds it (build_package)
    runner = AOTICompiledModel(
        torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    )
    live = dict(module.named_parameters(remove_duplicate=False))
    live.update(module.named_buffers(remove_duplicate=False))
    want = runner.get_constant_fqns()
    foreign = [n for n in want if n not in live]
    if foreign:
        raise RuntimeError(
            f"{path}: constants {foreign[:3]} are not the model's tensors (computed from the "
            "weights it was built with); it cannot run another checkpoint"
        )
    runner.load_constants({n: live[n] for n in want}, check_full_update=True, user_managed=True)
    return runner


def linear_kind(model, device) -> str:
    """What runs ``model``'s linears: ``"packed"`` (CPU, ``kernels/linear_cpu.py``'s kernel),
    ``"mkl"`` (CPU, ``F.linear``) or ``"cuda"``."""
    if torch.device(device).type == "cuda":
        return "cuda"
    return "packed" if linear_cpu.is_packed(model) else "mkl"


def decode_buckets(max_num_seqs: int) -> tuple:
    """Decode batch sizes that get a CUDA graph: powers of two below ``max_num_seqs``, and
    ``max_num_seqs`` itself (a decode step has at most one token per running sequence)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return tuple(out + [max_num_seqs])


class CompiledDecode:
    """This rank's stage (``model``, as ``parallel.pp.apply_pp`` left it) with compiled decode
    steps: ``bucket(T)`` says whether (and padded to how many rows) a decode step of ``T`` rows
    runs compiled, ``forward`` has ``stage_forward``'s contract plus that row count, ``logits``
    is ``model.logits`` for those steps."""

    def __init__(self, model, buckets: Sequence[int], device, *, first_stage: bool):
        self.model, self.first_stage = model, first_stage
        self.mixers: dict = {}  # a hybrid's recurrent layers: layer -> (scan, state shapes)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.largest = self.buckets[-1]
        if self.cuda:  # CUDA graphs need static shapes: one graph per bucket
            self.min_rows = 1
            self._fn = torch.compile(_stage, dynamic=False, fullgraph=True, mode="reduce-overhead")
            self._head = None  # one GEMM: nothing for a CUDA graph to save
        else:  # AOTInductor runners, one graph for any T in range: built or loaded by warm_up
            self.min_rows = CPU_MIN_ROWS
            self._fn = self._head = self._any = None
        limit = len(self.buckets) + 8  # an entry per bucket (and per engine made in this process)
        if torch._dynamo.config.recompile_limit < limit:
            torch._dynamo.config.recompile_limit = limit

    @property
    def what(self) -> str:
        """What ``warm_up`` compiles, for the start-up log: the graphs and their row counts."""
        if self.cuda:
            return f"the decode step's CUDA graphs for batch sizes {list(self.buckets)}"
        return (
            f"the decode step (one graph for {self.min_rows}-{self.largest} rows) and the other "
            f"steps' graph ({self.min_rows} rows up)"
        )

    @property
    def enabled(self) -> bool:
        """Whether any decode step can run compiled (CPU: ``max_num_seqs >= CPU_MIN_ROWS``)."""
        return self.largest >= self.min_rows

    def bucket(self, tokens: int) -> Optional[int]:
        """The row count a decode step of ``tokens`` rows runs compiled with, None: eagerly."""
        if not self.min_rows <= tokens <= self.largest:
            return None
        if not self.cuda:
            return tokens
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def other(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` rows that ``bucket`` does not take (not a decode step) runs
        through the other steps' graph (``forward_any``): CPU, ``CPU_MIN_ROWS`` rows up."""
        return not self.cuda and tokens >= self.min_rows

    def _call(self, x, positions, ctx, rows: int, fn=None):
        _active.ctx, _active.rows, _active.mixers = ctx, rows, self.mixers
        try:
            if fn is not None:  # the other steps' graph (CPU)
                return fn(x, positions)
            if self.cuda:
                return self._fn(self.model, x, positions)
            return self._fn(x, positions)  # (the runner holds the model's tensors)
        finally:
            _active.ctx = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.logits`` (``(N, hidden)`` -> fp32 ``(N, vocab)``) of a compiled decode step."""
        if self._head is None or not 2 <= hidden.shape[0] <= self.largest:
            return self.model.logits(hidden)
        return self._head(hidden)

    def _inputs(self, b: int, dtype: torch.dtype, hidden: int):
        """Dummy step inputs of ``b`` rows: token ids ``(b,)`` (first stage) or hidden states
        ``(b, hidden)``, and positions ``(b,)``."""
        x = (
            torch.zeros(b, dtype=torch.long, device=self.device)
            if self.first_stage
            else torch.zeros(b, hidden, dtype=dtype, device=self.device)
        )
        return x, torch.arange(b, device=self.device)

    @torch.inference_mode()
    def warm_up(self, dtype: torch.dtype, hidden: int, where: Optional[Path] = None) -> float:
        """Make every graph ready, attention answering zeros (no cache is touched). CUDA: compile
        and record each bucket's graph on dummy inputs. CPU: load the AOTInductor packages kept in
        ``where`` (the artifact cache's directory), building those that are not there first, and
        run each once. Returns the seconds it took."""
        t = time.perf_counter()
        log.info("ringkv: compiling or loading %s", self.what)
        self._record(dtype, hidden)
        if self.cuda:
            self._warm_cuda(dtype, hidden)
        else:
            if where is None:
                raise ValueError("CompiledDecode on the CPU keeps its packages in a directory")
            self._load(Path(where), dtype, hidden)
        log.info("ringkv: compiled in %.1f s", time.perf_counter() - t)
        return time.perf_counter() - t

    def _warm_cuda(self, dtype: torch.dtype, hidden: int) -> None:
        if not self.enabled:
            return
        for b in self.buckets:
            for _ in range(3):  # cudagraph trees: warm-up runs, then the recording
                torch.compiler.cudagraph_mark_step_begin()
                self._call(*self._inputs(b, dtype, hidden), _Zeros(), b)
        torch.cuda.synchronize(self.device)

    def packages(self, dtype: torch.dtype, hidden: int) -> dict:
        """The CPU graphs, ``{file name: (module, example inputs, dynamic shapes)}``: the decode
        step (``min_rows``..``largest`` rows), its LM head (2..``largest``
        rows; the last stage) and every other step (``min_rows`` rows up, over ``model``). A file
        name says its row range: engines of another ``max_num_seqs`` build their own."""
        dim = torch.export.Dim
        lo, hi = self.min_rows, max(self.largest, self.min_rows + 1)  # (a range, not one size)
        step, other = dim("rows", min=lo, max=hi), dim("rows", min=lo)
        out = {}
        if self.enabled:
            out[f"decode-{lo}-{hi}.pt2"] = (
                _Stage(self.model),
                self._inputs(lo, dtype, hidden),
                {"x": {0: step}, "positions": {0: step}},
            )
            if self.model.lm_head is not None:
                h = torch.zeros(lo, hidden, dtype=dtype, device=self.device)
                head = {"hidden": {0: dim("rows", min=2, max=hi)}}
                out[f"head-2-{hi}.pt2"] = (_Head(self.model), (h,), head)
        out[f"other-{lo}.pt2"] = (
            _Stage(self.model),
            self._inputs(max(lo, 2 * self.largest), dtype, hidden),
            {"x": {0: other}, "positions": {0: other}},
        )
        return out

    def _load(self, where: Path, dtype: torch.dtype, hidden: int) -> None:
        """CPU: each package of ``packages`` loaded from ``where`` (built there first if it is not
        there), with the live model's tensors as its constants, then run once on dummy inputs."""
        runners = []
        for name, (module, inputs, dims) in self.packages(dtype, hidden).items():
            path = where / name
            if not path.is_file():
                log.info("ringkv: building %s", path)
                build_package(module, inputs, dims, path)
            runners.append(load_package(path, module))
        if self.enabled:
            self._fn = runners.pop(0)
            if self.model.lm_head is not None:
                self._head = runners.pop(0)
        (self._any,) = runners
        b = self.min_rows
        if self.enabled:
            h = self._call(*self._inputs(b, dtype, hidden), _Zeros(), b)
            if self._head is not None:
                self.logits(h)
        b = max(b, 2 * self.largest)
        self._call(*self._inputs(b, dtype, hidden), _Zeros(), b, self._any)

    def dummy_steps(self, dtype: torch.dtype, hidden: int):
        """``(compiled(rows), eager(rows))``: a decode step of ``rows`` rows (the stage and, on the
        last stage, its logits) on dummy inputs, compiled and eager, attention answering zeros
        (the same eager op in both): what ``compile_decode="auto"`` times (``autocompile``)."""
        head = self.model.lm_head is not None

        @torch.inference_mode()
        def compiled(b: int):
            h = self.forward(*self._inputs(b, dtype, hidden), _Zeros(), self.bucket(b))
            return self.logits(h) if head else h

        @torch.inference_mode()
        def eager(b: int):
            h = stage_forward(self.model, *self._inputs(b, dtype, hidden), _Zeros())
            return self.model.logits(h) if head else h

        return compiled, eager

    def _record(self, dtype: torch.dtype, hidden: int) -> None:
        """A hybrid model: its recurrent layers seen once eagerly (``_Recorder``)."""
        x, _ = self._inputs(1, dtype, hidden)
        positions = torch.zeros(1, dtype=torch.long, device=self.device)
        stage_forward(self.model, x, positions, _Recorder(self.mixers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx, bucket: int) -> torch.Tensor:
        """Token ids ``(T,)`` (first stage) or hidden states ``(T, hidden)`` -> ``(T, hidden)``,
        like ``stage_forward``, run as the compiled graph for ``bucket >= T`` rows."""
        t = positions.numel()
        pad = bucket - t
        if (
            pad
        ):  # padding rows: token 0 / zero hidden states at position 0, never attended nor stored
            x = F.pad(x, (0, pad) if x.dim() == 1 else (0, 0, 0, pad))
            positions = F.pad(positions, (0, pad))
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        out = self._call(x, positions, ctx, t)
        out = out[:t] if pad else out
        return (
            out.clone() if self.cuda else out
        )  # a CUDA graph's output is overwritten by its next replay

    def forward_any(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """``stage_forward`` of a step ``other`` takes (CPU), through the other steps' graph."""
        return self._call(x, positions, ctx, positions.numel(), self._any)
