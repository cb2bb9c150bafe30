"""The flash-attn package (CUDA, fp16/bf16), when it is importable. Never required.

flash-attn takes ``(B, S, H, D)`` and GQA natively. Offset-diagonal masks are split into
full tiles and one square causal tile (``mask.offset_tiles``), as in ``sdpa``.
Not exercised in CI (flash-attn needs CUDA to install); ``"auto"`` only picks it after a
one-time check against the reference on the device (see ``kernels.pick``).
"""

from __future__ import annotations

import torch

from ..sp.merge import empty_partial, merge_
from .mask import DENSE, EMPTY, FULL, Mask, offset_tiles

try:  # pragma: no cover - needs CUDA
    from flash_attn import flash_attn_interface as _fa
except Exception:  # ImportError, or a broken CUDA install
    _fa = None


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    return (_fa is not None and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and mask.kind != DENSE and not dlse)


def _tiles(mask: Mask, sq: int, sk: int):
    if mask.kind == FULL:
        return [(slice(0, sq), slice(0, sk), False)]
    return [(slice(t.q0, t.q1), slice(t.k0, t.k1), t.causal) for t in offset_tiles(mask.offset, sq, sk)]


def forward(q, k, v, scale: float, mask: Mask):  # pragma: no cover - needs CUDA
    sq = q.shape[1]
    acc, lse = empty_partial(*q.shape[:3], v.shape[-1], q.device)
    if mask.kind == EMPTY:
        return acc.to(q.dtype), lse
    for r, c, causal in _tiles(mask, sq, k.shape[1]):
        o, l, _ = _fa.flash_attn_func(q[:, r], k[:, c], v[:, c], 0.0, softmax_scale=scale,
                                      causal=causal, return_attn_probs=True)
        merge_(acc[:, r], lse[:, :, r], o, l.float())
    return acc.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None):  # pragma: no cover
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).contiguous()
    for r, c, causal in _tiles(mask, q.shape[1], k.shape[1]):
        qs, ks, vs = q[:, r].contiguous(), k[:, c].contiguous(), v[:, c].contiguous()
        g = [torch.empty_like(t) for t in (qs, ks, vs)]
        _fa._flash_attn_backward(dout[:, r].contiguous(), qs, ks, vs, out[:, r].contiguous(),
                                 lse[:, :, r].contiguous(), *g, 0.0, scale, causal, -1, -1, 0.0,
                                 None, False, None)
        dq[:, r] += g[0]
        dk[:, c] += g[1]
        dv[:, c] += g[2]
    return dq, dk, dv
