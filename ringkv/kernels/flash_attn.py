"""The flash-attn package (CUDA, fp16/bf16), when it is importable. Never required.

flash-attn takes ``(B, S, H, D)`` and GQA natively. Offset-diagonal masks are split into
full tiles and one square causal tile (``mask.offset_tiles``), as in ``sdpa``. A window band
runs as one call with flash-attn's native ``window_size`` on the rows that see a key and the
keys they see (see ``_tiles``), so no row of a call is fully masked.
Not exercised in CI (flash-attn needs CUDA to install); ``"auto"`` only picks it after a
one-time check against the reference on the device (see ``kernels.pick``).
"""

from __future__ import annotations

import torch

from .merge import empty_partial, merge_
from .mask import BAND, DENSE, EMPTY, FULL, Mask, offset_tiles

try:  # pragma: no cover - needs CUDA
    from flash_attn import flash_attn_interface as _fa
except Exception:  # ImportError, or a broken CUDA install
    _fa = None


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    return (_fa is not None and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and mask.kind != DENSE and not dlse)


def _tiles(mask: Mask, sq: int, sk: int):
    """Calls ``(rows, keys, causal, window_size)`` covering the mask once, in flash-attn's terms."""
    if mask.kind == FULL:
        return [(slice(0, sq), slice(0, sk), False, (-1, -1))]
    if mask.kind == BAND:  # i + lo <= j <= i + hi
        lo, hi = mask.lo, mask.offset
        r0, r1 = max(0, -hi), min(sq - 1, sk - 1 - lo)  # the rows that see at least one key
        c0, c1 = max(0, r0 + lo), min(sk - 1, r1 + hi)  # the keys those rows see
        # flash-attn aligns bottom-right: j' visible iff i' + shift - left <= j' <= i' + shift + right
        shift = (c1 - c0) - (r1 - r0)
        left, right = shift - (lo + r0 - c0), (hi + r0 - c0) - shift  # both >= 0 after the trim
        return [(slice(r0, r1 + 1), slice(c0, c1 + 1), False, (left, right))]
    return [(slice(t.q0, t.q1), slice(t.k0, t.k1), t.causal, (-1, -1))
            for t in offset_tiles(mask.offset, sq, sk)]


def forward(q, k, v, scale: float, mask: Mask):  # pragma: no cover - needs CUDA
    sq = q.shape[1]
    acc, lse = empty_partial(*q.shape[:3], v.shape[-1], q.device)
    if mask.kind == EMPTY:
        return acc.to(q.dtype), lse
    for r, c, causal, window in _tiles(mask, sq, k.shape[1]):
        o, l, _ = _fa.flash_attn_func(q[:, r], k[:, c], v[:, c], 0.0, softmax_scale=scale,
                                      causal=causal, window_size=window, return_attn_probs=True)
        merge_(acc[:, r], lse[:, :, r], o, l.float())
    return acc.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None):  # pragma: no cover
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).contiguous()
    for r, c, causal, window in _tiles(mask, q.shape[1], k.shape[1]):
        qs, ks, vs = q[:, r].contiguous(), k[:, c].contiguous(), v[:, c].contiguous()
        g = [torch.empty_like(t) for t in (qs, ks, vs)]
        _fa._flash_attn_backward(dout[:, r].contiguous(), qs, ks, vs, out[:, r].contiguous(),
                                 lse[:, :, r].contiguous(), *g, 0.0, scale, causal, *window, 0.0,
                                 None, False, None)
        dq[:, r] += g[0]
        dk[:, c] += g[1]
        dv[:, c] += g[2]
    return dq, dk, dv
