"""Attention of a few new query tokens per sequence over a paged KV cache: the backend registry
and the calls that take a ``backend=`` name. The contract (shapes, causality, SP striping, the
records) and the plain-torch reference are in ``paged_base.py``; the backends in
``paged_cpu.py`` (``"cpu"``: a compiled C kernel reading the cache in place, the CPU default when
it builds), ``paged_torch.py`` (``"torch"``: gather + SDPA, the CPU fallback) and
``triton_paged.py`` (``"triton"``, CUDA).

    out, lse = paged_attention(q, k_cache, v_cache, block_table, seq_lens, backend="auto",
                               softcap=None, window=-1, sinks=None)
    out, lse = paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                             max_seqlen_q=...)
    attn = plan_step(seqs, block_size=..., sp=1, sp_rank=0, device=None, backend="auto")
    # every layer of the step
    parts = attn.attend(q, cache, lse=True, scale=None, softcap=None, window=-1)

``plan_step`` is how the engine reads its cache: each backend builds its own per-step metadata
once (``"cpu"``: block tables and visible-key counts per group; ``"torch"``: gather indices and
masks per group of sequences; ``"triton"``: device tensors
for the decode kernel and one varlen prefill batch; ``"reference"``: one varlen reference call) and
answers every layer's ``attend`` with ``RowsOut(rows, out, lse)`` parts.

The features (``paged_base``): ``softcap``, ``window`` and a V head size ``Dv != D`` reach the
backends; ``"auto"`` never picks one that cannot do what a call asks (``features``), and a
backend asked for by name raises a ValueError naming the argument instead. ``sinks`` (``(H,)``)
are applied here, once, to the final output (``merge.apply_sinks``); the ``lse`` returned stays
the one over the real keys (what merges with other ranks' partials).

This module imports the backends; they import ``paged_base``, never this module.
"""

from __future__ import annotations

from itertools import accumulate
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import torch

from . import paged_cpu, paged_torch
from .checks import check_sinks
from .merge import apply_sinks
from .paged_base import (
    LayerCache,
    PagedSeq,
    RowsOut,
    StepAttention,
    check_features,
    check_striping,
    padded_table,
    paged_attention_reference,
    paged_prefill_reference,
    read_blocks,
    validate_paged,
    validate_prefill,
)

__all__ = [
    "PAGED",
    "PagedBackends",
    "paged_attention",
    "paged_attention_reference",
    "paged_prefill",
    "paged_prefill_reference",
    "plan_step",
    "auto_backend",
    "validate_paged",
    "validate_prefill",
    "read_blocks",
    "LayerCache",
    "PagedSeq",
    "RowsOut",
    "StepAttention",
]


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    backend: str = "auto",
    k_scale=None,
    v_scale=None,
    softcap: Optional[float] = None,
    window: int = -1,
    sinks: Optional[torch.Tensor] = None,
):
    """See ``paged_base``. ``backend``: ``"reference"``, ``"cpu"``, ``"torch"``, ``"triton"`` or
    ``"auto"``.
    ``sinks`` ``(H,)``: one more logit per head in the softmax's denominator, applied to ``out``;
    the
    ``lse`` returned is over the real keys."""
    want = _wanted(softcap, window, v_cache, k_cache, sinks, q)
    name = backend if backend != "auto" else auto_backend(q.device, want=want)
    impl = _BACKENDS.get(name)
    if impl is None:
        raise ValueError(
            f"unknown paged backend {backend!r}; choose from {sorted(_BACKENDS)} or 'auto'"
        )
    _check_dv(name, want, "decode")
    out, lse = impl(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale=scale,
        causal=causal,
        k_scale=k_scale,
        v_scale=v_scale,
        **_keywords(name, features(name, "decode"), softcap, window),
    )
    return _sunk(out, lse, sinks), lse


def paged_prefill(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    *,
    max_seqlen_q: int,
    q_start=None,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    sp: int = 1,
    sp_rank: int = 0,
    backend: str = "auto",
    softcap: Optional[float] = None,
    window: int = -1,
    sinks: Optional[torch.Tensor] = None,
):
    """See ``paged_base``. ``backend``: ``"reference"``, ``"triton"`` or ``"auto"`` (Triton on
    CUDA).
    ``sinks`` ``(H,)`` as in ``paged_attention`` (``out (T, H, Dv)``, ``lse (H, T)``)."""
    want = _wanted(softcap, window, v_cache, k_cache, sinks, q)
    name = backend if backend != "auto" else auto_backend(q.device, prefill=True, want=want)
    impl = _PREFILL_BACKENDS.get(name)
    if impl is None:
        raise ValueError(
            f"unknown paged prefill backend {backend!r}; "
            f"choose from {sorted(_PREFILL_BACKENDS)} or 'auto'"
        )
    _check_dv(name, want, "prefill")
    out, lse = impl(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        max_seqlen_q=max_seqlen_q,
        q_start=q_start,
        scale=scale,
        causal=causal,
        k_scale=k_scale,
        v_scale=v_scale,
        sp=sp,
        sp_rank=sp_rank,
        **_keywords(name, features(name, "prefill"), softcap, window),
    )
    return (_sunk(out[None], lse[None], sinks)[0] if sinks is not None else out), lse


def plan_step(
    seqs: Sequence[PagedSeq],
    *,
    block_size: int,
    sp: int = 1,
    sp_rank: int = 0,
    device=None,
    backend: str = "auto",
) -> StepAttention:
    """The backend's metadata for one step over the cache (see ``paged_base``): ``seqs``, each
    sequence's query rows, positions and block table; ``sp``/``sp_rank``, the striping of the keys.
    Its ``attend`` takes ``scale``, ``softcap`` and ``window`` on every backend: where the chosen
    one (``"cpu"``) does not, a call that uses them goes to the ``"torch"`` backend's plan when the
    backend was ``"auto"``, and raises a ValueError naming the argument when it was asked for."""
    name = backend if backend != "auto" else auto_backend(torch.device(device or "cpu"))
    impl = _STEP_BACKENDS.get(name)
    if impl is None:
        raise ValueError(
            f"unknown paged backend {backend!r}; choose from {sorted(_STEP_BACKENDS)} or 'auto'"
        )
    check_striping(sp, sp_rank)
    step = impl(seqs, block_size=block_size, sp=sp, sp_rank=sp_rank, device=device)
    have = features(name, "step")
    if have >= ALL_FEATURES:
        return step
    fallback = None
    if backend == "auto":

        def fallback():
            return paged_torch.plan_step(
                seqs, block_size=block_size, sp=sp, sp_rank=sp_rank, device=device
            )

    return _GuardedStep(step, name, have, fallback)


class ReferenceStep:
    """The ``"reference"`` backend's metadata for one step: all of its sequences as one varlen
    ``paged_prefill_reference`` call per layer (positions, lengths and striping as host tensors)."""

    def __init__(
        self,
        seqs: Sequence[PagedSeq],
        *,
        block_size: int,
        sp: int = 1,
        sp_rank: int = 0,
        device=None,
    ):
        self.sp, self.sp_rank, self.any = sp, sp_rank, bool(seqs)
        ints = dict(dtype=torch.int32, device=device)
        self.rows = torch.tensor(
            [s.row + j for s in seqs for j in range(s.n)], device=device, dtype=torch.long
        )
        self.block_table = padded_table([s.block_table for s in seqs], device) if seqs else None
        self.cu = torch.tensor([0] + list(accumulate(s.n for s in seqs)), **ints)
        self.lens = torch.tensor([s.keys(sp, sp_rank) for s in seqs], **ints)
        self.start = torch.tensor([s.start for s in seqs], **ints)
        self.max_n = max((s.n for s in seqs), default=0)

    def attend(
        self,
        q,
        cache: LayerCache,
        *,
        lse: bool = True,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ):
        # q (T, H, D) -> rows (R,), out (R, H, Dv), lse (H, R) or None
        if not self.any:
            return []
        o, ls = paged_prefill_reference(
            q.index_select(0, self.rows),
            cache.k,
            cache.v,
            self.block_table,
            self.cu,
            self.lens,
            max_seqlen_q=self.max_n,
            q_start=self.start,
            scale=scale,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            sp=self.sp,
            sp_rank=self.sp_rank,
            softcap=softcap,
            window=window,
        )
        return [RowsOut(self.rows, o, ls if lse else None)]


class _GuardedStep:
    """A backend's step whose ``attend`` lacks some of the keywords (``features``): calls that do
    not use them go to it, the others to ``fallback()`` (the ``"torch"`` plan, built on first use)
    or, without one (the backend was asked for by name), raise a ValueError naming the argument."""

    def __init__(self, step, name: str, have: frozenset, fallback):
        self.step, self.name, self.have, self._make_fallback, self._fallback = (
            step,
            name,
            have,
            fallback,
            None,
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
    ):
        softcap, window = check_features(softcap, window)
        want = _used(
            scale=scale, softcap=softcap, window=window, dv=cache.v.shape[-1] != cache.k.shape[-1]
        )
        missing = want - self.have
        if not missing:
            return self.step.attend(
                q, cache, lse=lse, **_keywords(self.name, self.have, softcap, window, scale)
            )
        if self._make_fallback is None:
            _refuse(self.name, missing)
        if self._fallback is None:
            self._fallback = self._make_fallback()
        return self._fallback.attend(q, cache, lse=lse, scale=scale, softcap=softcap, window=window)


# ----------------------------------------------------------------------------- features

ALL_FEATURES = frozenset({"scale", "softcap", "window", "dv"})
_ARGUMENT = {"scale": "scale", "softcap": "softcap", "window": "window", "dv": "v_cache"}


def _used(*, scale=None, softcap=None, window: int = -1, dv: bool = False) -> frozenset:
    return frozenset(
        name
        for name, on in (
            ("scale", scale is not None),
            ("softcap", softcap is not None),
            ("window", window != -1),
            ("dv", dv),
        )
        if on
    )


def _wanted(softcap, window, v_cache, k_cache, sinks, q) -> frozenset:
    """Check the feature arguments of a call (ValueError naming the argument) -> the features it
    uses."""
    softcap, window = check_features(softcap, window)
    check_sinks(sinks, q)
    dv = (
        isinstance(v_cache, torch.Tensor)
        and isinstance(k_cache, torch.Tensor)
        and v_cache.dim() == 4
        and k_cache.dim() == 4
        and v_cache.shape[-1] != k_cache.shape[-1]
    )
    return _used(softcap=softcap, window=window, dv=dv)


def _sunk(out, lse, sinks):
    """``out`` with the sinks in its softmax's denominator (``merge.apply_sinks``)."""
    return out if sinks is None else apply_sinks(out, lse, sinks)[0]


def features(name: str, kind: str = "decode") -> frozenset:
    """What backend ``name`` does for calls of ``kind`` (``"decode"``: ``paged_attention``;
    ``"prefill"``; ``"step"``: ``plan_step(...).attend``), of ``ALL_FEATURES``: ``"scale"`` (every
    backend), and what its module declares in ``FEATURES`` among ``"softcap"``, ``"window"`` and
    ``"dv"`` (a V head size other than K's); none for a kind it has no function for."""
    if name in ("reference", "torch", "triton"):
        return ALL_FEATURES
    if name not in PAGED.table(kind):
        return frozenset()
    return frozenset({"scale"} | (set(getattr(PAGED.module(name), "FEATURES", ())) & ALL_FEATURES))


def _refuse(name: str, missing) -> None:
    arg = _ARGUMENT[sorted(missing)[0]]
    raise ValueError(
        f"the {name!r} paged backend cannot take {arg}= ({', '.join(sorted(missing))}); use "
        f"backend='auto', 'torch' or 'reference'"
    )


def _check_dv(name: str, want: frozenset, kind: str) -> None:
    if "dv" in want and "dv" not in features(name, kind):
        _refuse(name, {"dv"})


def _keywords(name: str, have: frozenset, softcap, window, scale=None) -> dict:
    """The feature keywords for a backend's call: only those the call uses (a backend without a
    feature it is asked for: ValueError naming the argument)."""
    kw = {}
    if scale is not None:
        kw["scale"] = scale
    if softcap is not None:
        kw["softcap"] = softcap
    if window != -1:
        kw["window"] = window
    missing = set(kw) - have
    if missing:
        _refuse(name, missing)
    return kw


class PagedBackends:
    """The paged backends of this process: per kind (``"decode"``: ``paged_attention``,
    ``"prefill"``, ``"step"``: ``plan_step``) name -> function, and name -> module (whose
    ``FEATURES`` say what it does). ``table(kind)`` is a read-only view; ``register`` adds or
    replaces a function, ``reset`` returns to the built-in backends, ``snapshot`` lists them."""

    KINDS = ("decode", "prefill", "step")

    def __init__(self, tables: dict, modules: dict):
        self._built_in = ({k: dict(tables[k]) for k in self.KINDS}, dict(modules))
        self._tables = {kind: {} for kind in self.KINDS}
        self._views = {kind: MappingProxyType(t) for kind, t in self._tables.items()}
        self._modules: dict = {}
        self.reset()

    def table(self, kind: str) -> Mapping:
        return self._views[kind]

    def module(self, name: str):
        return self._modules.get(name)

    def register(self, kind: str, name: str, fn, module=None) -> None:
        """Run calls of ``kind`` for backend ``name`` with ``fn`` (``module``: its ``FEATURES``)."""
        self._tables[kind][name] = fn
        if module is not None:
            self._modules[name] = module

    def snapshot(self) -> dict:
        """Plain data: the backends' names per kind, and those with a module."""
        return dict(
            {kind: sorted(t) for kind, t in self._tables.items()}, modules=sorted(self._modules)
        )

    def reset(self) -> None:
        """Forget registrations: the built-in backends (and Triton's when it imported) only."""
        tables, modules = self._built_in
        for kind, t in self._tables.items():
            t.clear()
            t.update(tables[kind])
        self._modules.clear()
        self._modules.update(modules)


try:  # the Triton kernels when triton imports
    from . import triton_paged
except ImportError:
    triton_paged = None
_TRITON = triton_paged is not None

PAGED = PagedBackends(
    {
        "decode": {
            "reference": paged_attention_reference,
            "torch": paged_torch.paged_attention_torch,
            "cpu": paged_cpu.paged_attention_cpu,
            **({"triton": triton_paged.paged_attention_triton} if _TRITON else {}),
        },
        "prefill": {
            "reference": paged_prefill_reference,
            **({"triton": triton_paged.paged_prefill_triton} if _TRITON else {}),
        },
        "step": {
            "reference": ReferenceStep,
            "torch": paged_torch.plan_step,
            "cpu": paged_cpu.plan_step,
            **({"triton": triton_paged.plan_step} if _TRITON else {}),
        },
    },
    {"cpu": paged_cpu, **({"triton": triton_paged} if _TRITON else {})},
)
_BACKENDS = PAGED.table("decode")  # read-only views
_PREFILL_BACKENDS = PAGED.table("prefill")
_STEP_BACKENDS = PAGED.table("step")


def auto_backend(device, prefill: bool = False, want: frozenset = frozenset()) -> str:
    """What ``backend="auto"`` means on ``device``: the Triton kernels on CUDA when they registered;
    on the CPU the compiled kernel when it builds and does the features ``want`` (see ``features``),
    else the batched torch version (decode; prefill: the reference)."""
    table = _PREFILL_BACKENDS if prefill else _BACKENDS
    if torch.device(device).type == "cuda" and "triton" in table:
        return "triton"
    if (
        torch.device(device).type == "cpu"
        and "cpu" in table
        and paged_cpu.available()
        and want <= features("cpu", "prefill" if prefill else "decode")
    ):
        return "cpu"
    return "torch" if "torch" in table else "reference"
