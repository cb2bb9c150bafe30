"""Single-device attention kernels with LSE behind one signature (no communication here).

    out, lse = attention(q, k, v, scale=None, causal=False, q_positions=None,
                         k_positions=None, window=(-1, -1), backend="auto")

- ``q`` ``(B, Sq, H, D)``, ``k``/``v`` ``(B, Sk, Hkv, D)`` with ``H % Hkv == 0`` (GQA/MQA);
- ``out`` ``(B, Sq, H, D)`` in ``q.dtype``; ``lse`` float32 natural-log ``(B, H, Sq)``;
- causal means ``q_pos >= k_pos`` on global positions (see ``mask.py``); ``window=(left,
  right)`` keeps ``q_pos - left <= k_pos <= q_pos + right`` (``-1``: unbounded; flash-attn's
  convention); rows that see no key give ``out = 0`` and ``lse = -inf``.

Backends: ``reference`` (the oracle), ``sdpa`` (torch's fused ops), ``cudnn`` (torch's cuDNN
op, CUDA), ``flash_attn`` (flash-attn 2.6-2.8) and ``flash_attn3`` (FlashAttention-3) when
installed, ``triton`` (our kernels, when triton imports). ``"auto"`` takes, for each call, the
first backend in the device's ``PREFERENCE`` order that supports the inputs and passed its
one-time check against the reference (``_probe``: forward, backward and the gradient through
lse, each on its own); ``describe()`` says which backend runs which call and why the others
do not. A gradient through lse runs only on a backend that takes ``dlse`` natively (``triton``,
``reference``): with no such backend usable, the reference runs it, by design.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Tuple

import torch

from . import cudnn, flash_attn, reference, sdpa
from .mask import (BAND, DENSE, EMPTY, FULL, NO_WINDOW, OFFSET, Mask, Positions, check_positions, check_window,
                   make_mask)
from .merge import merge_

BACKENDS: Dict[str, object] = {"reference": reference, "sdpa": sdpa, "cudnn": cudnn,
                               "flash_attn": flash_attn.FA2, "flash_attn3": flash_attn.FA3}
# expected fastest first (published H100/A100 results, not measured by us): FlashAttention-3 (Hopper),
# flash-attn 2, cuDNN, torch's flash SDPA, then our Triton kernels (never run on a GPU yet; they register
# after sdpa, at the end of this file); each call takes the first that supports it and passed its probe
PREFERENCE = {"cuda": ["flash_attn3", "flash_attn", "cudnn", "sdpa", "reference"], "cpu": ["sdpa", "reference"]}
NEEDS = ("forward", "backward", "lse_grad")
MISSING: Dict[str, str] = {}  # backends that could not even be imported: name -> why
_verified: Dict[tuple, Dict[str, str]] = {}  # (name, device type, dtype) -> need -> "" (passed) or why not
_warned: set = set()

__all__ = ["attention", "attention_backward", "block_forward", "block_backward", "block_forward_into",
           "block_backward_into", "run_differentiable", "make_mask", "Mask", "BACKENDS", "PREFERENCE",
           "register_backend", "pick", "validate", "describe"]


def register_backend(name: str, module, preference: Optional[Dict[str, int]] = None) -> None:
    """Add a backend module with ``supports/forward/backward`` (same contract as ``reference``)."""
    BACKENDS[name] = module
    for device, index in (preference or {}).items():
        order = PREFERENCE.setdefault(device, ["reference"])
        if name not in order:
            order.insert(index, name)


def validate(q, k, v, scale=None) -> float:
    """Check shapes/dtypes of one attention call; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor (float32/float16/bfloat16), got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, seq, kv_heads, head_dim), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError(f"head_dim must be at least 1, got shape {tuple(q.shape)}")
    if k.shape[2] == 0 or q.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a positive multiple of kv heads ({k.shape[2]}) "
                         f"for GQA/MQA")
    return resolve_scale(scale, q.shape[3])


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale to use: ``scale`` checked, or ``1/sqrt(head_dim)`` when ``None``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float (default 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def _check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}; "
                        f"pass positions (q_positions/k_positions) for other masks")


def _check_grad_inputs(q, v, dout, out, lse, dlse) -> None:
    """Shapes/dtypes of what ``attention_backward`` takes besides q, k, v."""
    want = tuple(q.shape[:3]) + tuple(v.shape[3:])
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} (like q), got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])  # (B, H, Sq)
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is None and name == "dlse":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch.Tensor (batch, heads, seq), got {type(t).__name__}")
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{name} must have shape (batch, heads, seq_q) = {lse_shape}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (as attention returns it), got {t.dtype}")


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _name(module) -> str:
    return next((n for n, m in BACKENDS.items() if m is module), repr(module))


def _close(a: torch.Tensor, e: torch.Tensor, tol: float) -> bool:
    """Same infinities, finite entries within ``tol * (1 + max |e|)``."""
    a, e = a.float(), e.float()
    inf = torch.isinf(e)
    if not torch.equal(torch.isinf(a), inf) or not torch.equal(a[inf], e[inf]) or torch.isnan(a).any():
        return False
    fin = ~inf
    return not fin.any() or (a[fin] - e[fin]).abs().max().item() <= tol * (1 + e[fin].abs().max().item())


def _check(name: str, need: str, q: torch.Tensor) -> str:
    """One need of one backend against the reference on a small GQA problem: "" or why it failed."""
    module = BACKENDS[name]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = [torch.randn(2, 77, s, 64, generator=g).to(q.device, q.dtype) for s in (4, 2, 2, 4)]
    dlse = torch.randn(2, 4, 77, generator=g).to(q.device) if need == "lse_grad" else None
    tol = max(16 * torch.finfo(q.dtype).eps, 1e-3)  # wrong arguments give errors of order 1
    masks = [m for m in (Mask(OFFSET, offset=-5), Mask(BAND, offset=3, lo=-20))  # rows with no key included
             if module.supports(q, m, dlse is not None)]
    if not masks:
        return "unsupported"
    try:
        for mask in masks:
            ref_out, ref_lse = reference.forward(q, k, v, 0.125, mask)
            if need == "forward":
                out, lse = module.forward(q, k, v, 0.125, mask)
                if not (_close(out, ref_out, tol) and _close(lse, ref_lse, 3e-3)):
                    return f"failed probe: forward differs from the reference (mask {mask.kind})"
                continue
            got = module.backward(dout, q, k, v, ref_out, ref_lse, 0.125, mask, dlse)
            want = reference.backward(dout, q, k, v, ref_out, ref_lse, 0.125, mask, dlse)
            if not all(_close(a, e, tol) for a, e in zip(got, want)):
                return f"failed probe: {need} differs from the reference (mask {mask.kind})"
    except Exception as e:  # a broken install or an API change must not break "auto"
        return f"failed probe: {type(e).__name__}: {e}"
    return ""


def _probe(name: str, q: torch.Tensor, need: str = "forward") -> str:
    """Check a backend once per (device, dtype, need) against the reference: "" or why not."""
    key = (name, q.device.type, q.dtype)
    results = _verified.setdefault(key, {})
    if need not in results:
        results[need] = _check(name, need, q)
        if results[need].startswith("failed"):
            _warn_once((key, need), f"ringkv: backend {name!r} {results[need]} on {q.device.type} {q.dtype}; "
                                    f"'auto' runs the {need} elsewhere (ringkv.kernels.describe() says where)")
    return results[need]


def _need(dlse: bool, backward: bool) -> str:
    return "lse_grad" if dlse else "backward" if backward else "forward"


def _skip_reason(name: str, q: torch.Tensor, mask: Mask, need: str) -> str:
    """Why ``auto`` passes over backend ``name`` for this call ("" when it may take it)."""
    module = BACKENDS.get(name)
    if module is None:
        return MISSING.get(name, "not registered")
    if getattr(module, "unavailable", ""):
        return module.unavailable
    if not module.supports(q, mask, need == "lse_grad"):
        return "unsupported" + (" (takes no gradient through lse)" if need == "lse_grad"
                                and module.supports(q, mask) else "")
    return "" if name == "reference" else _probe(name, q, need)


def pick(backend: str, q: torch.Tensor, mask: Mask, dlse: bool = False, backward: bool = False):
    """Resolve a backend name (or ``"auto"``) to a module for this call.

    ``backward``: the call is a backward; ``dlse``: a backward with a gradient through lse.
    ``"auto"`` takes the first backend in ``PREFERENCE`` that supports the call and passed its
    probe for it. An explicit backend that runs the backward but takes no ``dlse`` hands that
    call to ``"auto"`` (with a warning, once).
    """
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or 'auto'")
        module = BACKENDS[backend]
        if module.supports(q, mask, dlse):
            return module
        if dlse and module.supports(q, mask):
            chosen = pick("auto", q, mask, dlse=True, backward=True)
            _warn_once(("dlse", backend, _name(chosen)),
                       f"ringkv: backend {backend!r} takes no gradient through lse; backward calls with one run "
                       f"on {_name(chosen)!r}")
            return chosen
        raise ValueError(f"backend {backend!r} does not support {q.device.type} {q.dtype} "
                         f"head_dim={q.shape[-1]} with mask {mask.kind!r}; use backend='auto'")
    need = _need(dlse, backward)
    for name in PREFERENCE.get(q.device.type, ["reference"]):
        if not _skip_reason(name, q, mask, need):
            return BACKENDS[name]
    return reference


_SAMPLE_MASKS = {FULL: lambda s: Mask(FULL), OFFSET: lambda s: Mask(OFFSET),
                 BAND: lambda s: Mask(BAND, offset=0, lo=-s // 4),
                 DENSE: lambda s: Mask(DENSE, dense=torch.rand(s, s, generator=torch.Generator().manual_seed(0)) < .5)}


def describe(device=None, dtype=None, head_dim: int = 128) -> dict:
    """Which backend ``"auto"`` runs for each call on ``device``/``dtype``, and why not the others.

    Runs the one-time probes it needs. Returns ``{"device", "dtype", "order", "auto", "skipped",
    "notes"}``: ``auto[need][mask kind]`` is a backend name for each need in ``NEEDS`` (forward,
    backward, lse_grad) and mask kind (full, offset, band, dense; EMPTY blocks never reach a
    backend); ``skipped[name]`` is why another backend is not used: one string when the reason
    is the same for every call, else ``{"need/kind": reason}`` for the calls it does not run.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    q = torch.zeros(1, 64, 2, head_dim, device=device, dtype=dtype)
    order = PREFERENCE.get(device.type, ["reference"])
    auto, cells = {}, {}
    for need in NEEDS:
        auto[need] = {}
        for kind, make in _SAMPLE_MASKS.items():
            mask = make(q.shape[1])
            chosen = _name(pick("auto", q, mask, dlse=need == "lse_grad", backward=need != "forward"))
            auto[need][kind] = chosen
            for name in sorted(set(BACKENDS) | set(MISSING)):
                if name == chosen:
                    continue
                why = MISSING.get(name) or getattr(BACKENDS[name], "unavailable", "")
                if not why and name not in order:
                    why = f"not in the {device.type} preference order"
                elif not why and order.index(name) > order.index(chosen):
                    why = f"after {chosen!r} in the preference order"
                cells.setdefault(name, {})[f"{need}/{kind}"] = why or _skip_reason(name, q, mask, need)
    skipped = {n: (next(iter(c.values())) if len(set(c.values())) == 1 else c) for n, c in cells.items()}
    notes = []
    if "reference" in auto["lse_grad"].values():
        notes.append("lse_grad on 'reference': no backend usable here takes a gradient through lse natively "
                     "(only 'triton' does, for full/offset masks on CUDA), so the reference runs those backward "
                     "calls, by design")
    return dict(device=str(device), dtype=str(dtype), order=list(order), auto=auto, skipped=skipped, notes=notes)


def block_forward(q, k, v, *, scale: float, mask: Mask, backend: str = "auto"):
    """Unvalidated forward for one block with a ready ``Mask`` (the ring's inner call)."""
    if mask.kind == EMPTY:
        return reference.forward(q, k, v, scale, mask)
    return pick(backend, q, mask).forward(q, k, v, scale, mask)


def block_backward(dout, q, k, v, out, lse, *, scale: float, mask: Mask, dlse=None, backend: str = "auto"):
    """Unvalidated backward for one block given the rows' final ``out``/``lse``: fp32 dq, dk, dv."""
    module = reference if mask.kind == EMPTY else pick(backend, q, mask, dlse=dlse is not None, backward=True)
    return module.backward(dout, q, k, v, out, lse, scale, mask, dlse)


def block_forward_into(out, lse, q, k, v, *, scale: float, mask: Mask, backend: str = "auto") -> None:
    """Merge one block's partial into a float32 accumulator in place: ``out`` ``(B, Sq, H, D)``,
    ``lse`` ``(B, H, Sq)`` (views allowed). A backend with ``forward_into`` merges each of its own
    tiles straight into the accumulator (no intermediate partial merged a second time); others
    run ``forward`` and the result is merged once."""
    if mask.kind == EMPTY:
        return
    module = pick(backend, q, mask)
    if hasattr(module, "forward_into"):
        module.forward_into(q, k, v, scale, mask, out, lse)
    else:
        merge_(out, lse, *module.forward(q, k, v, scale, mask))


def block_backward_into(dq, dk, dv, dout, q, k, v, out, lse, *, scale: float, mask: Mask, dlse=None,
                        backend: str = "auto") -> None:
    """``block_backward`` added in place into float32 ``dq``, ``dk``, ``dv`` (views allowed): a
    backend with ``backward_into`` adds each tile's gradients directly (no zeroed per-block
    buffers to add again)."""
    if mask.kind == EMPTY:
        return
    module = pick(backend, q, mask, dlse=dlse is not None, backward=True)
    if hasattr(module, "backward_into"):
        module.backward_into(dq, dk, dv, dout, q, k, v, out, lse, scale, mask, dlse)
        return
    for acc, g in zip((dq, dk, dv), module.backward(dout, q, k, v, out, lse, scale, mask, dlse)):
        acc.add_(g)


class _Differentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, bwd, fwd_args, bwd_args, q, k, v):
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not zeros
        out, lse = fwd(q, k, v, *fwd_args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd, ctx.bwd_args = bwd, bwd_args
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.bwd(dout.contiguous(), dlse, q, k, v, out, lse, *ctx.bwd_args)
        return None, None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def run_differentiable(fwd, bwd, q, k, v, fwd_args: tuple, bwd_args: Optional[tuple] = None):
    """``fwd(q, k, v, *fwd_args) -> (out, lse)``, through autograd when q, k or v need a gradient:
    ``bwd(dout, dlse, q, k, v, out, lse, *bwd_args) -> (dq, dk, dv)`` (``dlse`` is ``None`` when
    lse is unused; ``bwd_args`` default to ``fwd_args``). Every attention here (the kernels, the
    ring, all-gather) is differentiated this way: through ``out`` and ``lse``."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Differentiable.apply(fwd, bwd, tuple(fwd_args), tuple(fwd_args if bwd_args is None else bwd_args),
                                     q, k, v)
    return fwd(q, k, v, *fwd_args)


def _block_fwd(q, k, v, scale, mask, backend):
    return block_forward(q, k, v, scale=scale, mask=mask, backend=backend)


def _block_bwd(dout, dlse, q, k, v, out, lse, scale, mask, backend):
    return block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, dlse=dlse, backend=backend)


def _mask(q, k, causal, q_positions, k_positions, window) -> Mask:
    _check_causal(causal)
    window = check_window(window)
    check_positions("q_positions", q_positions, q.shape[1])
    check_positions("k_positions", k_positions, k.shape[1])
    return make_mask(causal, q_positions, k_positions, q.shape[1], k.shape[1], q.device, window)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
              causal: bool = False, q_positions: Positions = None, k_positions: Positions = None,
              window: Tuple[int, int] = NO_WINDOW, backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, Sq, H, D)`` over ``k, v (B, Sk, Hkv, D)``: ``(out, lse)``.

    Positions are global token positions (``None``, a ``range`` or a 1-D int tensor) used only
    when ``causal`` or with a ``window`` ``(left, right)`` (key visible iff ``q_pos - left <=
    k_pos <= q_pos + right``, ``-1`` unbounded); see ``ringkv.kernels.mask``. Differentiable
    w.r.t. q, k, v (through ``out`` and ``lse``).
    """
    scale = validate(q, k, v, scale)
    mask = _mask(q, k, causal, q_positions, k_positions, window)
    pick(backend, q, mask)  # fail early on an unusable explicit backend
    return run_differentiable(_block_fwd, _block_bwd, q, k, v, (scale, mask, backend))


def attention_backward(dout, q, k, v, out, lse, *, scale: Optional[float] = None, causal: bool = False,
                       q_positions: Positions = None, k_positions: Positions = None, dlse=None,
                       window: Tuple[int, int] = NO_WINDOW, backend: str = "auto"):
    """dq, dk, dv (in the inputs' dtypes) of ``attention`` given ``dout`` (and ``dlse``)."""
    scale = validate(q, k, v, scale)
    _check_grad_inputs(q, v, dout, out, lse, dlse)
    mask = _mask(q, k, causal, q_positions, k_positions, window)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, dlse=dlse, backend=backend)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


try:  # own Triton kernels register themselves when triton imports
    from . import triton_attn  # noqa: F401
except ImportError as e:
    MISSING["triton"] = f"not installed ({e})"
