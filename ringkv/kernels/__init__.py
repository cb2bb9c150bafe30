"""Single-device attention kernels with LSE behind one signature (no communication here).

    out, lse = attention(q, k, v, scale=None, causal=False, q_positions=None, k_positions=None,
                         window=(-1, -1), backend="auto", softcap=None, sinks=None)

- ``q`` ``(B, Sq, H, D)``, ``k`` ``(B, Sk, Hkv, D)``, ``v`` ``(B, Sk, Hkv, Dv)`` with
  ``H % Hkv == 0`` (GQA/MQA); ``Dv`` may differ from ``D`` (MLA);
- ``out`` ``(B, Sq, H, Dv)`` in ``q.dtype``; ``lse`` float32 natural-log ``(B, H, Sq)`` over the
  real keys;
- ``softcap``: scores ``softcap * tanh(scale * q.k / softcap)`` (in the kernel, forward and
  backward);
  ``sinks`` ``(H,)``: one extra logit per head in the softmax's denominator, applied once to the
  final result (``merge.apply_sinks``; partials merge without it);
- causal means ``q_pos >= k_pos`` on global positions (see ``mask.py``); ``window=(left,
  right)`` keeps ``q_pos - left <= k_pos <= q_pos + right`` (``-1``: unbounded; flash-attn's
  convention); rows that see no key give ``out = 0`` and ``lse = -inf``.

Backends: ``reference`` (the oracle), ``sdpa`` (torch's fused ops), ``cudnn`` (torch's cuDNN
op, CUDA), ``flash_attn`` (flash-attn 2.6-2.8) and ``flash_attn3`` (FlashAttention-3) when
installed, ``triton`` (our kernels, when triton imports). Which one runs a call is decided in
``dispatch.py`` (the registry, the one-time probes, ``pick`` and ``describe``, re-exported here);
this package holds the entry points. Paged attention over a KV cache: ``paged.py``.

Modules of the package import each other, never the package itself
(``tests/test_kernel_imports.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import cudnn, flash_attn, reference, sdpa  # noqa: F401  (``kernels.sdpa`` etc. for callers)
from .checks import (
    check_causal,
    check_grad_inputs,
    check_sinks,
    check_softcap,
    validate,
)
from .dispatch import (
    BACKENDS,
    PREFERENCE,
    REGISTRY,
    describe,
    features,
    pick,
    register_backend,
)
from .mask import EMPTY, NO_WINDOW, Mask, Positions, check_positions, check_window, make_mask
from .merge import apply_sinks, merge_, sinks_dlse, sinks_grad

__all__ = [
    "attention",
    "attention_backward",
    "block_forward",
    "block_backward",
    "block_forward_into",
    "block_backward_into",
    "run_differentiable",
    "make_mask",
    "Mask",
    "BACKENDS",
    "PREFERENCE",
    "REGISTRY",
    "register_backend",
    "pick",
    "validate",
    "describe",
]


def _cap(softcap) -> dict:
    return {} if softcap is None else {"softcap": softcap}


def _pick(backend, q, v, mask, softcap, dlse=False, backward=False):
    return pick(
        backend,
        q,
        mask,
        dlse=dlse,
        backward=backward,
        softcap=softcap is not None,
        dv=q.shape[-1] != v.shape[-1],
    )


def _padded(module, q, v) -> bool:
    """Whether ``module`` runs this call zero-padded: V's head size differs from q's and it takes
    only one."""
    return q.shape[-1] != v.shape[-1] and "dv" not in features(module)


def _pad(x: torch.Tensor, d: int) -> torch.Tensor:
    # (..., d0) -> (..., d): zeros after, so scores and weighted sums are unchanged
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _forward(module, q, k, v, scale, mask, softcap):
    if not _padded(module, q, v):
        return module.forward(q, k, v, scale, mask, **_cap(softcap))
    d = max(q.shape[-1], v.shape[-1])
    out, lse = module.forward(_pad(q, d), _pad(k, d), _pad(v, d), scale, mask, **_cap(softcap))
    return out[..., : v.shape[-1]], lse  # (B, Sq, H, Dv)


def _backward(module, dout, q, k, v, out, lse, scale, mask, dlse, softcap):
    if not _padded(module, q, v):
        return module.backward(dout, q, k, v, out, lse, scale, mask, dlse, **_cap(softcap))
    d = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = module.backward(
        _pad(dout, d),
        _pad(q, d),
        _pad(k, d),
        _pad(v, d),
        _pad(out, d),
        lse,
        scale,
        mask,
        dlse,
        **_cap(softcap),
    )
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


def block_forward(q, k, v, *, scale: float, mask: Mask, backend: str = "auto", softcap=None):
    """Unvalidated forward for one block with a ready ``Mask`` (the ring's inner call)."""
    if mask.kind == EMPTY:
        return reference.forward(q, k, v, scale, mask)
    return _forward(_pick(backend, q, v, mask, softcap), q, k, v, scale, mask, softcap)


def block_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scale: float,
    mask: Mask,
    dlse=None,
    backend: str = "auto",
    softcap=None,
):
    """Unvalidated backward for one block given the rows' final ``out``/``lse``: fp32 dq, dk, dv."""
    module = (
        reference
        if mask.kind == EMPTY
        else _pick(backend, q, v, mask, softcap, dlse is not None, True)
    )
    return _backward(module, dout, q, k, v, out, lse, scale, mask, dlse, softcap)


def block_forward_into(
    out, lse, q, k, v, *, scale: float, mask: Mask, backend: str = "auto", softcap=None
) -> None:
    """Merge one block's partial into a float32 accumulator in place: ``out`` ``(B, Sq, H, Dv)``,
    ``lse`` ``(B, H, Sq)`` (views allowed). A backend with ``forward_into`` merges each of its own
    tiles straight into the accumulator (no intermediate partial merged a second time); others
    run ``forward`` and the result is merged once."""
    if mask.kind == EMPTY:
        return
    module = _pick(backend, q, v, mask, softcap)
    if hasattr(module, "forward_into") and not _padded(module, q, v):
        module.forward_into(q, k, v, scale, mask, out, lse, **_cap(softcap))
    else:
        merge_(out, lse, *_forward(module, q, k, v, scale, mask, softcap))


def block_backward_into(
    dq,
    dk,
    dv,
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scale: float,
    mask: Mask,
    dlse=None,
    backend: str = "auto",
    softcap=None,
) -> None:
    """``block_backward`` added in place into float32 ``dq``, ``dk``, ``dv`` (views allowed): a
    backend with ``backward_into`` adds each tile's gradients directly (no zeroed per-block
    buffers to add again)."""
    if mask.kind == EMPTY:
        return
    module = _pick(backend, q, v, mask, softcap, dlse is not None, True)
    if hasattr(module, "backward_into") and not _padded(module, q, v):
        module.backward_into(
            dq, dk, dv, dout, q, k, v, out, lse, scale, mask, dlse, **_cap(softcap)
        )
        return
    for acc, g in zip(
        (dq, dk, dv), _backward(module, dout, q, k, v, out, lse, scale, mask, dlse, softcap)
    ):
        acc.add_(g)


class _Differentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, bwd, fwd_args, bwd_args, q, k, v, sinks):
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not zeros
        out, lse = fwd(q, k, v, *fwd_args)
        out_f, lse_f = (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
        # the backward sees the rows' final out/lse: with sinks, the sinked ones (exact for q, k, v)
        ctx.save_for_backward(q, k, v, out_f, lse_f, None if sinks is None else lse, sinks)
        ctx.bwd, ctx.bwd_args = bwd, bwd_args
        return out_f, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse_f, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if sinks is not None and dlse is not None:  # the returned lse is over the real keys
            dlse = sinks_dlse(dlse, lse, lse_f)
        dq, dk, dv = ctx.bwd(dout.contiguous(), dlse, q, k, v, out, lse_f, *ctx.bwd_args)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[7]:
            dsinks = sinks_grad(dout, out, lse_f, sinks).to(sinks.dtype)
        return None, None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


def run_differentiable(
    fwd,
    bwd,
    q,
    k,
    v,
    fwd_args: tuple,
    bwd_args: Optional[tuple] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """``fwd(q, k, v, *fwd_args) -> (out, lse)``, through autograd when q, k, v or sinks need a
    gradient: ``bwd(dout, dlse, q, k, v, out, lse, *bwd_args) -> (dq, dk, dv)`` (``dlse`` is
    ``None`` when lse is unused; ``bwd_args`` default to ``fwd_args``). Every attention here (the
    kernels, the ring, all-gather) is differentiated this way: through ``out`` and ``lse``.
    ``sinks`` ``(H,)`` are applied to the final ``out`` (``apply_sinks``; the returned lse stays
    over the real keys); their gradient covers this rank's rows (summed over the SP group like any
    replicated weight)."""
    grads = any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    if torch.is_grad_enabled() and grads:
        return _Differentiable.apply(
            fwd,
            bwd,
            tuple(fwd_args),
            tuple(fwd_args if bwd_args is None else bwd_args),
            q,
            k,
            v,
            sinks,
        )
    out, lse = fwd(q, k, v, *fwd_args)
    return (out, lse) if sinks is None else (apply_sinks(out, lse, sinks)[0], lse)


def _block_fwd(q, k, v, scale, mask, backend, softcap=None):
    return block_forward(q, k, v, scale=scale, mask=mask, backend=backend, softcap=softcap)


def _block_bwd(dout, dlse, q, k, v, out, lse, scale, mask, backend, softcap=None):
    return block_backward(
        dout, q, k, v, out, lse, scale=scale, mask=mask, dlse=dlse, backend=backend, softcap=softcap
    )


def _mask(q, k, causal, q_positions, k_positions, window) -> Mask:
    check_causal(causal)
    window = check_window(window)
    check_positions("q_positions", q_positions, q.shape[1])
    check_positions("k_positions", k_positions, k.shape[1])
    return make_mask(causal, q_positions, k_positions, q.shape[1], k.shape[1], q.device, window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    q_positions: Positions = None,
    k_positions: Positions = None,
    window: Tuple[int, int] = NO_WINDOW,
    backend: str = "auto",
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, Sq, H, D)`` over ``k (B, Sk, Hkv, D)``, ``v (B, Sk, Hkv, Dv)``: ``(out
    (B, Sq, H, Dv), lse (B, H, Sq))``.

    Positions are global token positions (``None``, a ``range`` or a 1-D int tensor) used only
    when ``causal`` or with a ``window`` ``(left, right)`` (key visible iff ``q_pos - left <=
    k_pos <= q_pos + right``, ``-1`` unbounded); see ``ringkv.kernels.mask``. ``softcap`` (> 0):
    Gemma 2's soft-capping of the scores; ``sinks`` ``(H,)``: gpt-oss's per-head sink logits (the
    returned ``lse`` is over the real keys). Differentiable w.r.t. q, k, v and sinks (through
    ``out`` and ``lse``).
    """
    scale = validate(q, k, v, scale)
    softcap, sinks = check_softcap(softcap), check_sinks(sinks, q)
    mask = _mask(q, k, causal, q_positions, k_positions, window)
    _pick(backend, q, v, mask, softcap)  # fail early on an unusable explicit backend
    return run_differentiable(
        _block_fwd, _block_bwd, q, k, v, (scale, mask, backend, softcap), sinks=sinks
    )


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    q_positions: Positions = None,
    k_positions: Positions = None,
    dlse=None,
    window: Tuple[int, int] = NO_WINDOW,
    backend: str = "auto",
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """dq, dk, dv (in the inputs' dtypes) of ``attention`` given ``dout`` (and ``dlse``), with
    ``out``/``lse`` as ``attention`` returned them; with ``sinks`` also ``dsinks`` (in sinks'
    dtype)."""
    scale = validate(q, k, v, scale)
    softcap, sinks = check_softcap(softcap), check_sinks(sinks, q)
    check_grad_inputs(q, v, dout, out, lse, dlse)
    mask = _mask(q, k, causal, q_positions, k_positions, window)
    lse_f = lse if sinks is None else torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    if sinks is not None and dlse is not None:
        dlse = sinks_dlse(dlse, lse, lse_f)
    dq, dk, dv = block_backward(
        dout,
        q,
        k,
        v,
        out,
        lse_f,
        scale=scale,
        mask=mask,
        dlse=dlse,
        backend=backend,
        softcap=softcap,
    )
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    return (
        grads if sinks is None else grads + (sinks_grad(dout, out, lse_f, sinks).to(sinks.dtype),)
    )
