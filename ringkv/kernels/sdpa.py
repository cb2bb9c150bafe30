"""torch's fused SDPA ops that also return LSE.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its backward), any float dtype.
CUDA: ``aten._scaled_dot_product_flash_attention`` (+ backward) for fp16/bf16, head_dim <= 256
and a multiple of 8.

The fused ops only know "no mask" and "causal"; ``mask.offset_tiles`` rewrites any offset
diagonal (a ring step's mask) as full tiles plus one *square* causal tile, on which every
causal convention agrees, and the tiles' partials are merged by LSE (``forward_into``: straight
into the caller's accumulator, so a ring block is merged once; one tile over all rows is returned
without a merge). Dense masks and
sliding-window bands run as an additive mask on CPU (not on CUDA). GQA: K/V heads are
repeated locally (never before communication).
"""

from __future__ import annotations

import torch

from .mask import BAND, DENSE, EMPTY, FULL, OFFSET, Mask, Tile, offset_tiles
from .merge import empty_partial, merge_


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    if dlse:
        return False
    if q.device.type == "cpu":
        return True
    if q.device.type == "cuda":
        return (
            q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0
            and mask.kind not in (DENSE, BAND)
        )
    return False


def heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, S, Hkv, D) -> (B, H, S, D)``, repeating KV heads for GQA (into heads-first memory,
    which the CPU op reads faster)."""
    b, s, hkv, d = x.shape
    x = x.transpose(1, 2)
    if heads != hkv:
        x = x[:, :, None].expand(b, hkv, heads // hkv, s, d).reshape(b, heads, s, d)
    return x


def _fused(q, k, v, scale, causal, attn_mask=None):
    """One fused call: q (B,Sq,H,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,H,D), lse (B,H,Sq) fp32."""
    h = q.shape[2]
    qt, kt, vt = q.transpose(1, 2), heads_first(k, h), heads_first(v, h)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, causal, attn_mask=attn_mask, scale=scale
        )
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qt.contiguous(), kt.contiguous(), vt.contiguous(), 0.0, causal, False, scale=scale
        )[:2]
    return out.transpose(1, 2), lse.float()


def grad_args(dout, q, k, v, out, lse):
    """A fused backward's inputs: dout, q, k, v, out as (B, H, S, D) (K/V heads repeated), and lse
    with rows that saw no key at 0 (so P = 0 there, not NaN)."""
    h = q.shape[2]
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return [t.transpose(1, 2) for t in (dout, q)] + [
        heads_first(k, h),
        heads_first(v, h),
        out.transpose(1, 2),
    ], lse


def grads_bshd(dq, dk, dv, k_shape):
    """(B, H, S, D) grads -> dq (B, Sq, H, D) and dk/dv (B, Sk, Hkv, D) summed over each GQA group:
    views of the op's (B, H, S, D) memory, no copy without GQA (callers add them in place)."""
    hkv = k_shape[2]
    h = dq.shape[1]
    if h != hkv:  # (B, Hkv, H/Hkv, Sk, D) summed over the group: one pass
        dk, dv = (g.unflatten(1, (hkv, h // hkv)).sum(2) for g in (dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _fused_backward(dout, q, k, v, out, lse, scale, causal, attn_mask=None):
    """Backward of one fused call with the row's *final* out/lse; dk/dv summed over GQA groups."""
    sk = k.shape[1]
    args, lse = grad_args(dout, q, k, v, out, lse)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args,
            lse.double() if q.dtype == torch.float64 else lse,
            0.0,
            causal,
            attn_mask=attn_mask,
            scale=scale,
        )  # the op's own lse is float64 for float64 inputs (found by the probe)
    else:
        args = [a.contiguous() for a in args]
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *args,
            lse.contiguous(),
            empty,
            empty,
            q.shape[1],
            sk,
            0.0,
            causal,
            empty,
            empty,
            scale=scale,
        )
    return grads_bshd(dq, dk, dv, k.shape)


def _additive(mask: Mask, dtype) -> torch.Tensor:
    return torch.zeros(mask.dense.shape, dtype=dtype, device=mask.dense.device).masked_fill(
        ~mask.dense, float("-inf")
    )


def _as_dense(mask: Mask, sq: int, sk: int, device) -> Mask:
    # a window band runs as an explicit boolean mask (CPU only, see supports)
    return Mask(DENSE, dense=mask.visible(sq, sk, device)) if mask.kind == BAND else mask


def forward(q, k, v, scale: float, mask: Mask):
    """Same contract as ``reference.forward``."""
    mask = _as_dense(mask, q.shape[1], k.shape[1], q.device)
    if mask.kind == DENSE:
        out, lse = _fused(q, k, v, scale, False, attn_mask=_additive(mask, q.dtype))
        seen = mask.dense.any(1)  # the CPU op returns lse = 0 for rows with no visible key
        return out * seen[:, None, None], lse.masked_fill(~seen, float("-inf"))
    return tiled_forward(q, k, v, scale, mask, _fused)


def forward_into(q, k, v, scale: float, mask: Mask, out, lse) -> None:
    """Merge the block's partial into the float32 accumulator ``out`` ``(B, Sq, H, D)``, ``lse``
    ``(B, H, Sq)``: each ``OFFSET`` tile's fused result is merged once, straight into it."""
    if mask.kind == OFFSET:
        tiled_forward_into(q, k, v, scale, mask, out, lse, _fused)
    elif mask.kind != EMPTY:
        merge_(out, lse, *forward(q, k, v, scale, mask))


def tiled_forward(q, k, v, scale: float, mask: Mask, fused):
    """FULL/OFFSET/EMPTY masks as ``fused(q, k, v, scale, causal) -> (out, lse)`` calls on tiles;
    an ``OFFSET`` block that is one tile over all rows is one call, returned without a merge."""
    if mask.kind == FULL:
        return fused(q, k, v, scale, False)
    acc, lse = empty_partial(
        *q.shape[:3], v.shape[-1], q.device
    )  # EMPTY, or the tiles' accumulator
    if mask.kind == EMPTY:
        return acc.to(q.dtype), lse
    tiles = offset_tiles(mask.offset, q.shape[1], k.shape[1])
    if len(tiles) == 1 and (tiles[0].q0, tiles[0].q1) == (0, q.shape[1]):  # single tile: no merge
        t = tiles[0]
        return fused(q, k[:, t.k0 : t.k1], v[:, t.k0 : t.k1], scale, t.causal)
    tiled_forward_into(q, k, v, scale, mask, acc, lse, fused)
    return acc.to(q.dtype), lse


def tiled_forward_into(q, k, v, scale: float, mask: Mask, out, lse, fused) -> None:
    """The ``OFFSET`` tiles' partials merged one by one into ``out``/``lse`` (float32)."""
    for t in offset_tiles(mask.offset, q.shape[1], k.shape[1]):
        o, ls = fused(q[:, t.q0 : t.q1], k[:, t.k0 : t.k1], v[:, t.k0 : t.k1], scale, t.causal)
        merge_(out[:, t.q0 : t.q1], lse[:, :, t.q0 : t.q1], o, ls)


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None):
    """Same contract as ``reference.backward`` (without ``dlse``: the registry routes that)."""
    assert dlse is None and mask.kind != EMPTY
    mask = _as_dense(mask, q.shape[1], k.shape[1], q.device)
    if mask.kind == DENSE:
        return _fused_backward(
            dout, q, k, v, out, lse, scale, False, attn_mask=_additive(mask, q.dtype)
        )
    return tiled_backward(dout, q, k, v, out, lse, scale, mask, _fused_backward)


def backward_into(dq, dk, dv, dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None) -> None:
    """``backward`` added in place into float32 ``dq``, ``dk``, ``dv`` (views allowed), tile by
    tile."""
    assert dlse is None
    if mask.kind == OFFSET:
        tiled_backward_into(dq, dk, dv, dout, q, k, v, out, lse, scale, mask, _fused_backward)
    elif mask.kind != EMPTY:
        for acc, g in zip((dq, dk, dv), backward(dout, q, k, v, out, lse, scale, mask)):
            acc.add_(g)


def tiled_backward(dout, q, k, v, out, lse, scale: float, mask: Mask, fused_backward):
    """FULL/OFFSET masks as ``fused_backward(dout, q, k, v, out, lse, scale, causal)`` calls on
    tiles (one call when the ``OFFSET`` block is one tile)."""
    if mask.kind == FULL:
        return fused_backward(dout, q, k, v, out, lse, scale, False)
    tiles = offset_tiles(mask.offset, q.shape[1], k.shape[1])
    if len(tiles) == 1 and tiles[0] == Tile(
        0, q.shape[1], 0, k.shape[1], tiles[0].causal
    ):  # one tile
        return fused_backward(dout, q, k, v, out, lse, scale, tiles[0].causal)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
    tiled_backward_into(*grads, dout, q, k, v, out, lse, scale, mask, fused_backward)
    return tuple(grads)


def tiled_backward_into(
    dq, dk, dv, dout, q, k, v, out, lse, scale: float, mask: Mask, fused_backward
) -> None:
    """The ``OFFSET`` tiles' gradients added one by one into float32 ``dq``, ``dk``, ``dv``."""
    for t in offset_tiles(mask.offset, q.shape[1], k.shape[1]):
        r, c = slice(t.q0, t.q1), slice(t.k0, t.k1)
        g = fused_backward(
            dout[:, r], q[:, r], k[:, c], v[:, c], out[:, r], lse[:, :, r], scale, t.causal
        )
        dq[:, r] += g[0]
        dk[:, c] += g[1]
        dv[:, c] += g[2]
