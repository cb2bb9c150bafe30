"""The fused LSE merge (``merge.merge_`` on CUDA): one Triton pass per partial.

``_merge_kernel``, grid ``(cdiv(B * S * H, BLOCK_R),)``: each program takes ``BLOCK_R`` rows
``(b, s, h)``, reads both lse values and both ``D``-vectors once, and writes the merged row and
lse in place. Any strides (the accumulator is often a view: a zigzag half's rows, or a
transposed kernel output) and any float dtype for the block's ``out``; math in fp32. Rows that
no partial saw (both lse ``-inf``) get weights 0 and keep ``lse = -inf`` (no NaN).
Importing needs triton (``ImportError`` otherwise: ``merge.merge_`` then stays eager).
"""

from __future__ import annotations

import torch

from .triton_common import (  # raises ImportError when triton is not installed
    LAZY,
    build,
    interpret,
)

triton, tl = LAZY, None  # build() binds the real modules (triton_common: kernels built on use)


@triton.jit
def _merge_kernel(
    Out,
    Lse,
    BOut,
    BLse,
    n_rows,
    S,
    H,
    D,
    so0,
    so1,
    so2,
    so3,
    sl0,
    sl1,
    sl2,
    sb0,
    sb1,
    sb2,
    sb3,
    sc0,
    sc1,
    sc2,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    h = (rows % H).to(tl.int64)
    s = ((rows // H) % S).to(tl.int64)
    b = (rows // (H * S)).to(tl.int64)
    a = tl.load(Lse + b * sl0 + h * sl1 + s * sl2, mask=live, other=float("-inf"))
    c = tl.load(BLse + b * sc0 + h * sc1 + s * sc2, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.maximum(a, c)
    none = m == float("-inf")  # no key seen by either partial
    m0 = tl.where(none, 0.0, m)
    ea, ec = tl.exp(a - m0), tl.exp(c - m0)
    tot = ea + ec
    inv = tl.where(none, 0.0, 1.0 / tl.where(none, 1.0, tot))
    total = tl.where(none, float("-inf"), m0 + tl.log(tl.where(none, 1.0, tot)))
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    cell = live[:, None] & (d[None, :] < D)
    po = Out + (b * so0 + s * so1 + h * so2)[:, None] + d[None, :] * so3
    pb = BOut + (b * sb0 + s * sb1 + h * sb2)[:, None] + d[None, :] * sb3
    o = tl.load(po, mask=cell, other=0.0)
    bo = tl.load(pb, mask=cell, other=0.0).to(tl.float32)
    tl.store(po, o * (ea * inv)[:, None] + bo * (ec * inv)[:, None], mask=cell)
    tl.store(Lse + b * sl0 + h * sl1 + s * sl2, total, mask=live)


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Same contract as ``merge.merge_`` (CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``)."""
    build()
    b, s, h, d = out.shape
    n_rows = b * s * h
    if n_rows == 0 or d == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_r = 16 if interpret() else max(1, min(64, 4096 // block_d))
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](
        out,
        lse,
        block_out,
        block_lse,
        n_rows,
        s,
        h,
        d,
        *out.stride(),
        *lse.stride(),
        *block_out.stride(),
        *block_lse.stride(),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
