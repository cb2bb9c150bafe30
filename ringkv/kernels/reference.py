"""Pure-torch attention with LSE: the oracle every other backend is tested against.

Plain on purpose: two passes over key chunks in float32 (first the log-sum-exp, then the
weighted sum), so memory is O(Sq * chunk) and there is no online rescaling to get wrong.
GQA is a view: query heads are grouped ``(Hkv, H // Hkv)``; K/V are never repeated. V may have its
own head size ``Dv`` (MLA). ``softcap``: scores ``cap * tanh(scale * q.k / cap)`` before the mask
(Gemma 2's soft-capping), differentiated through the tanh.
"""

from __future__ import annotations

import torch

from .mask import EMPTY, Mask

CHUNK = 1024
FEATURES = frozenset({"softcap", "dv"})


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    return True


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    b, sq, h, d = q.shape
    # float32, or float64 when given (the tests' oracle)
    return q.to(torch.promote_types(q.dtype, torch.float32)).reshape(
        b, sq, hkv, h // hkv, d
    )  # (B, Sq, Hkv, G, D)


def _scores(qg, k, scale, mask: Mask, k0: int, k1: int, softcap=None, capped_grad: bool = False):
    # qg (B, Sq, Hkv, G, D) x k[:, k0:k1] (B, C, Hkv, D) -> s (B, Hkv, G, Sq, C)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k[:, k0:k1].to(qg.dtype)) * scale
    dcap = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
        dcap = 1 - t * t if capped_grad else None  # d capped / d raw score
    sub = mask.block(0, qg.shape[1], k0, k1)
    if sub.kind != "full":
        s = s.masked_fill(~sub.visible(qg.shape[1], k1 - k0, s.device), float("-inf"))
    return (s, dcap) if capped_grad else s


def _safe(lse):
    # rows that see no key have lse = -inf; exp(s - 0) with s = -inf gives 0, not NaN
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def forward(q, k, v, scale: float, mask: Mask, chunk: int = CHUNK, softcap=None):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H, Dv) in q.dtype, lse
    (B, H, Sq) float32 (float64 for float64 inputs)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc_t = torch.promote_types(q.dtype, torch.float32)
    lse = torch.full((b, hkv, h // hkv, sq), float("-inf"), device=q.device, dtype=acc_t)
    acc = torch.zeros(b, hkv, h // hkv, sq, v.shape[-1], device=q.device, dtype=acc_t)
    if mask.kind != EMPTY:
        qg = _grouped(q, hkv)
        for k0 in range(0, sk, chunk):
            s = _scores(qg, k, scale, mask, k0, min(sk, k0 + chunk), softcap)
            lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
        for k0 in range(0, sk, chunk):
            k1 = min(sk, k0 + chunk)
            p = torch.exp(_scores(qg, k, scale, mask, k0, k1, softcap) - _safe(lse)[..., None])
            acc += torch.einsum("bhgqk,bkhd->bhgqd", p, v[:, k0:k1].to(acc_t))
    out = acc.permute(0, 3, 1, 2, 4).reshape(b, sq, h, v.shape[-1])  # (B, Sq, H, Dv)
    return out.to(q.dtype), lse.reshape(b, h, sq)


def backward(
    dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None, chunk: int = CHUNK, softcap=None
):
    """Gradients of ``out`` (and of ``lse`` when ``dlse`` is given) w.r.t. q, k, v.

    ``out``/``lse`` are the *final* values of the row (after any merge), so this also gives
    one ring block's share of the gradient. Returns dq, dk, dv in float32 (float64 for float64).
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    acc_t = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(b, sq, hkv, g, d, device=q.device, dtype=acc_t)
    dk = torch.zeros(k.shape, device=q.device, dtype=acc_t)
    dv = torch.zeros(v.shape, device=q.device, dtype=acc_t)
    if mask.kind == EMPTY:
        return dq.reshape(q.shape), dk, dv
    qg = _grouped(q, hkv)
    do = _grouped(dout, hkv)  # (B, Sq, Hkv, G, D)
    lse_g = _safe(lse.to(acc_t).reshape(b, hkv, g, sq))
    # delta_i = rowsum(dout_i * out_i) - dlse_i  (B, Hkv, G, Sq)
    delta = (do * _grouped(out, hkv)).sum(-1).permute(0, 2, 3, 1)
    if dlse is not None:
        delta = delta - dlse.to(acc_t).reshape(b, hkv, g, sq)
    for k0 in range(0, sk, chunk):
        k1 = min(sk, k0 + chunk)
        s, dcap = _scores(qg, k, scale, mask, k0, k1, softcap, capped_grad=True)
        p = torch.exp(s - lse_g[..., None])  # (B,Hkv,G,Sq,C)
        dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v[:, k0:k1].to(acc_t))
        ds = p * (dp - delta[..., None]) * scale
        if dcap is not None:
            ds = ds * dcap  # through the tanh of the cap (0 where masked: p is)
        dq += torch.einsum("bhgqk,bkhd->bqhgd", ds, k[:, k0:k1].to(acc_t))
        dk[:, k0:k1] += torch.einsum("bhgqk,bqhgd->bkhd", ds, qg)
        dv[:, k0:k1] += torch.einsum("bhgqk,bqhgd->bkhd", p, do)  # (B, C, Hkv, Dv)
    return dq.reshape(q.shape), dk, dv
