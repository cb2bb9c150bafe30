"""cuDNN attention through torch (``aten._scaled_dot_product_cudnn_attention``), which returns the
LSE.

CUDA only (``supports`` is False elsewhere), fp16/bf16, head_dim <= 128 and a multiple of 8,
masks FULL and OFFSET (the same tiles as ``sdpa``: full tiles plus one square causal tile, on
which every causal convention agrees) and EMPTY. GQA: K/V heads are repeated locally, dk/dv
summed back. The op's lse comes as ``(B, H, Sq, 1)`` float32; the backward op takes it in that
shape, with this file's zero dropout seed/offset and no bias. ``"auto"`` only uses it after the
one-time check against the reference on the device (``dispatch._probe``).
"""

from __future__ import annotations

import torch

from .mask import EMPTY, FULL, OFFSET, Mask
from .sdpa import heads_first, grad_args, grads_bshd, tiled_backward, tiled_forward

OP = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
OP_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)
unavailable = (
    ""
    if OP is not None and OP_BACKWARD is not None
    else f"torch {torch.__version__} has no cuDNN attention op"
)


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    return (
        not unavailable
        and q.device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 128
        and q.shape[-1] % 8 == 0
        and mask.kind in (FULL, OFFSET, EMPTY)
        and not dlse
    )


def _fused(q, k, v, scale, causal):
    """One call: q (B,Sq,H,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,H,D), lse (B,H,Sq) fp32."""
    b, sq, h, _ = q.shape
    qt, kt, vt = (
        t.contiguous() for t in (q.transpose(1, 2), heads_first(k, h), heads_first(v, h))
    )  # (B, H, S, D)
    out, lse = OP(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)[:2]  # lse (B, H, Sq, 1)
    return out.transpose(1, 2), lse.reshape(b, h, sq).float()


def _fused_backward(dout, q, k, v, out, lse, scale, causal):
    """Backward of one call with the rows' *final* out/lse; dk/dv summed over GQA groups."""
    args, lse = grad_args(dout, q, k, v, out, lse)
    args = [a.contiguous() for a in args]  # dout and out in one layout (the op wants equal strides)
    zero = torch.zeros(
        (), dtype=torch.int64, device=q.device
    )  # philox seed/offset: unused without dropout
    dq, dk, dv = OP_BACKWARD(
        *args,
        lse.unsqueeze(-1).contiguous(),
        zero,
        zero,
        None,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return grads_bshd(dq, dk, dv, k.shape)


def forward(q, k, v, scale: float, mask: Mask):
    """Same contract as ``reference.forward``."""
    return tiled_forward(q, k, v, scale, mask, _fused)


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None):
    """Same contract as ``reference.backward`` without ``dlse`` (the registry routes that)."""
    assert dlse is None and mask.kind != EMPTY
    return tiled_backward(dout, q, k, v, out, lse, scale, mask, _fused_backward)
