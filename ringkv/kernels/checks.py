"""Argument checks of the attention entry points (``ringkv.kernels.attention`` and friends, the
paged kernels): ``validate`` one call's q, k, v, ``resolve_scale`` the softmax scale. Imports no
other module of the package, so every kernel module may use it."""

from __future__ import annotations

import math

import torch


def validate(q, k, v, scale=None) -> float:
    """Check shapes/dtypes of one attention call; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{name} must be a floating tensor (float32/float16/bfloat16), got {t.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "k and v must have the same shape but for the head_dim (batch, seq, kv_heads; v may "
            f"have its own head_dim), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if v.shape[3] == 0:
        raise ValueError(f"v's head_dim must be at least 1, got shape {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError(f"head_dim must be at least 1, got shape {tuple(q.shape)}")
    if k.shape[2] == 0 or q.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a positive multiple of kv heads ({k.shape[2]}) "
            f"for GQA/MQA"
        )
    return resolve_scale(scale, q.shape[3])


def check_softcap(softcap) -> "float | None":
    """``softcap``: None, or a finite float > 0 (scores become ``softcap * tanh(s / softcap)``)."""
    if softcap is None:
        return None
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise ValueError(
            f"softcap must be None or a finite float > 0 (logit soft-capping), got {softcap!r}"
        )
    return float(softcap)


def check_sinks(sinks, q):
    """``sinks``: None, or a floating tensor ``(H,)`` (one logit per query head:
    ``H = q.shape[-2]``, for ``(B, S, H, D)`` and the paged ``(N, Q, H, D)`` / ``(T, H, D)`` alike)
    on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise ValueError(
            f"sinks must be None or a floating tensor of shape (heads,) = ({q.shape[-2]},), got "
            f"{type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else sinks.dtype}"
        )
    if tuple(sinks.shape) != (q.shape[-2],):
        raise ValueError(
            f"sinks must have shape (heads,) = ({q.shape[-2]},) (one per query head), got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale to use: ``scale`` checked, or ``1/sqrt(head_dim)`` when ``None``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float (default 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(
            f"causal must be True or False, got {type(causal).__name__}; "
            f"pass positions (q_positions/k_positions) for other masks"
        )


def check_grad_inputs(q, v, dout, out, lse, dlse) -> None:
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
            raise TypeError(
                f"{name} must be a float32 torch.Tensor (batch, heads, seq), got {type(t).__name__}"
            )
        if tuple(t.shape) != lse_shape:
            raise ValueError(
                f"{name} must have shape (batch, heads, seq_q) = {lse_shape}, got {tuple(t.shape)}"
            )
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (as attention returns it), got {t.dtype}")
