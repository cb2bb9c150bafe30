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
installed, ``triton`` (our kernels, when triton imports). Which one runs a call is decided in
``dispatch.py`` (the registry, the one-time probes, ``pick`` and ``describe``, re-exported here);
this package holds the entry points. Paged attention over a KV cache: ``paged.py``.

Modules of the package import each other, never the package itself (``tests/test_kernel_imports.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import cudnn, flash_attn, reference, sdpa  # noqa: F401  (``kernels.sdpa`` etc. for callers)
from .checks import check_causal, check_grad_inputs, resolve_scale, validate  # noqa: F401
from .dispatch import BACKENDS, MISSING, NEEDS, PREFERENCE, describe, pick, register_backend  # noqa: F401
from .mask import EMPTY, NO_WINDOW, Mask, Positions, check_positions, check_window, make_mask
from .merge import merge_

__all__ = ["attention", "attention_backward", "block_forward", "block_backward", "block_forward_into",
           "block_backward_into", "run_differentiable", "make_mask", "Mask", "BACKENDS", "PREFERENCE",
           "register_backend", "pick", "validate", "describe"]


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
    check_causal(causal)
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
    check_grad_inputs(q, v, dout, out, lse, dlse)
    mask = _mask(q, k, causal, q_positions, k_positions, window)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, dlse=dlse, backend=backend)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

