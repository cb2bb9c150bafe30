"""Single-device attention kernels with LSE behind one signature (no communication here).

    out, lse = attention(q, k, v, scale=None, causal=False, q_positions=None,
                         k_positions=None, window=(-1, -1), backend="auto")

- ``q`` ``(B, Sq, H, D)``, ``k``/``v`` ``(B, Sk, Hkv, D)`` with ``H % Hkv == 0`` (GQA/MQA);
- ``out`` ``(B, Sq, H, D)`` in ``q.dtype``; ``lse`` float32 natural-log ``(B, H, Sq)``;
- causal means ``q_pos >= k_pos`` on global positions (see ``mask.py``); ``window=(left,
  right)`` keeps ``q_pos - left <= k_pos <= q_pos + right`` (``-1``: unbounded; flash-attn's
  convention); rows that see no key give ``out = 0`` and ``lse = -inf``.

Backends: ``reference`` (the oracle), ``sdpa`` (torch's fused ops), ``flash_attn`` (when
installed), ``triton`` (when importable on the device). ``"auto"`` takes the first backend
that supports the inputs, in the device's preference order; on accelerators a backend is
first checked once against the reference on a small problem and skipped if it disagrees.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Tuple

import torch

from . import flash_attn, reference, sdpa
from .merge import merge_
from .mask import BAND, EMPTY, NO_WINDOW, OFFSET, Mask, Positions, check_positions, check_window, make_mask

BACKENDS: Dict[str, object] = {"reference": reference, "sdpa": sdpa, "flash_attn": flash_attn}
PREFERENCE = {"cuda": ["flash_attn", "triton", "sdpa", "reference"], "cpu": ["sdpa", "reference"]}
_verified: Dict[tuple, bool] = {}

__all__ = ["attention", "attention_backward", "block_forward", "block_backward", "block_forward_into",
           "block_backward_into", "make_mask",
           "Mask", "BACKENDS", "register_backend", "pick", "validate"]


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


def _probe(name: str, q: torch.Tensor) -> bool:
    """Check a backend once per (device, dtype) against the reference (accelerators only)."""
    key = (name, q.device.type, q.dtype)
    if key not in _verified:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = [torch.randn(2, 77, s, 64, generator=g).to(q.device, q.dtype) for s in (4, 2, 2)]
        ok = True
        try:
            for mask in (Mask(OFFSET, offset=-5), Mask(BAND, offset=3, lo=-20)):  # each kind it claims
                if not BACKENDS[name].supports(q, mask):
                    continue
                out, lse = BACKENDS[name].forward(*x, 0.125, mask)
                ref_out, ref_lse = reference.forward(*x, 0.125, mask)
                ok = ok and torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2) and \
                    torch.allclose(lse, ref_lse, atol=2e-2, rtol=0)  # equal infinities count as close
        except Exception as e:  # a broken install must not break "auto"
            warnings.warn(f"ringkv: backend {name!r} failed its self-check on {q.device.type}: {e}")
            ok = False
        _verified[key] = ok
    return _verified[key]


def pick(backend: str, q: torch.Tensor, mask: Mask, dlse: bool = False):
    """Resolve a backend name (or ``"auto"``) to a module that supports these inputs."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or 'auto'")
        module = BACKENDS[backend]
        if not module.supports(q, mask, dlse):
            raise ValueError(f"backend {backend!r} does not support {q.device.type} {q.dtype} "
                             f"head_dim={q.shape[-1]} with mask {mask.kind!r}; use backend='auto'")
        return module
    for name in PREFERENCE.get(q.device.type, ["reference"]):
        module = BACKENDS.get(name)
        if module is None or not module.supports(q, mask, dlse):
            continue
        if q.device.type != "cpu" and name != "reference" and not _probe(name, q):
            continue
        return module
    return reference


def block_forward(q, k, v, *, scale: float, mask: Mask, backend: str = "auto"):
    """Unvalidated forward for one block with a ready ``Mask`` (the ring's inner call)."""
    if mask.kind == EMPTY:
        return reference.forward(q, k, v, scale, mask)
    return pick(backend, q, mask).forward(q, k, v, scale, mask)


def block_backward(dout, q, k, v, out, lse, *, scale: float, mask: Mask, dlse=None, backend: str = "auto"):
    """Unvalidated backward for one block given the rows' final ``out``/``lse``: fp32 dq, dk, dv."""
    module = reference if mask.kind == EMPTY else pick(backend, q, mask)
    if dlse is not None and not module.supports(q, mask, True):
        module = reference  # a gradient through lse: only backends that take it run it
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
    module = pick(backend, q, mask)
    if dlse is not None and not module.supports(q, mask, True):
        module = reference  # a gradient through lse: only backends that take it run it
    if hasattr(module, "backward_into"):
        module.backward_into(dq, dk, dv, dout, q, k, v, out, lse, scale, mask, dlse)
        return
    for acc, g in zip((dq, dk, dv), module.backward(dout, q, k, v, out, lse, scale, mask, dlse)):
        acc.add_(g)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, mask, backend):
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not zeros
        out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mask, ctx.backend = scale, mask, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=ctx.scale, mask=ctx.mask,
                                    dlse=dlse, backend=ctx.backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, scale, mask, backend)
    return block_forward(q, k, v, scale=scale, mask=mask, backend=backend)


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
except ImportError:
    pass
