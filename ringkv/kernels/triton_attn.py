"""Own Triton attention with LSE: forward, and backward from the rows' final out/lse.

Same contract as ``reference.py``: q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v
``(B, Sk, Hkv, Dv)`` (``Dv`` may differ from ``D``, as in MLA), out ``(B, Sq, H, Dv)`` in q's dtype,
lse float32 natural log ``(B, H, Sq)``; rows that see no key give out = 0 and lse = -inf; backward
returns fp32 dq, dk, dv and takes an optional ``dlse``.

- GQA: program for query head ``h`` reads kv head ``h // (H // Hkv)``; K/V never repeated.
  The dk/dv program owns one kv head's key tile and loops over the group's query heads,
  so it accumulates in registers without atomics.
- Masks: FULL, OFFSET (key ``j`` visible to query ``i`` iff ``j <= i + offset``) and BAND
  (also ``j >= i + lo``: a window) run natively; key tiles no row of a query tile can see (and
  query tiles no key of a key tile is seen by) are outside the loop bounds, never loaded. Key
  tiles every row sees run without mask arithmetic. DENSE masks are not supported (the registry
  falls back).
- ``softcap`` (Gemma 2): scores ``cap * tanh(scale * q.k / cap)`` before the mask; the backward
  multiplies ``ds`` by the tanh's derivative ``1 - (s / cap)**2``. A constexpr switch (``SOFTCAP``):
  the uncapped kernels are the same as without the feature. ``FEATURES`` names what runs natively.
- ``Dv != D``: q/k tiles are ``BLOCK_D`` wide, v/out/dout/dv tiles ``BLOCK_DV`` wide (equal when
  ``D == Dv``, so that path is unchanged).
- Ragged tails (Sq, Sk not multiples of the tile) and head dims 16..256 (padded to a
  power of two) are masked loads/stores.
- Inside the kernels softmax runs in base 2 (``exp2``, scores pre-multiplied by
  ``scale * log2(e)``); the stored lse is converted to natural log.
- On CUDA the tile sizes are autotuned (configs pruned for small problems); under the
  CPU interpreter (``TRITON_INTERPRET=1``) one small fixed config keeps tests fast.
- Importing this module does not import triton (only checks it is installed): the kernels
  are decorated on first use (``triton_common.build``).
"""

from __future__ import annotations

import os

import torch

from .checks import check_softcap
from .mask import BAND, EMPTY, FULL, OFFSET, Mask
from .triton_common import (  # raises ImportError when triton is not installed
    LAZY,
    KERNELS,
    big_rows,
    build,
    cast,
    dot,
    dot_prec,
    finish,
    head_block,
    interpret,
    online_step,
)

triton, tl = LAZY, None  # build() binds the real modules (triton_common: kernels built on use)

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FEATURES = frozenset({"softcap", "dv"})  # native: logit soft-capping, V's own head size
MAX_HEAD = 256


def supports(q: torch.Tensor, mask: Mask, dlse=False) -> bool:
    on_device = q.device.type == "cuda" or (q.device.type == "cpu" and interpret())
    # EMPTY: answered without a launch (the registry also routes it to the reference first)
    return (
        on_device
        and q.dtype in _DTYPES
        and 0 < q.shape[-1] <= MAX_HEAD
        and mask.kind in (FULL, OFFSET, BAND, EMPTY)
    )


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(x):
    """fp32 ``tanh(x)`` from ``exp2`` (the interpreter has no libdevice, and the GPU then computes
    the same): ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)``; below ``|x| = 1/4``, where ``1 - e``
    cancels, the odd series to ``x**9`` (truncation < 1e-8 of ``|x|``)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2a)
    a2 = a * a
    series = a * (
        1.0
        + a2
        * (
            -0.3333333333333333
            + a2 * (0.13333333333333333 + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203))
        )
    )
    r = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _tile_start(IS_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr):
    """First row of this program's query tile; with an OFFSET mask the last (heaviest)
    tiles are launched first, so the short ones fill in at the end."""
    pid = tl.program_id(0)
    if IS_OFFSET:
        pid = tl.num_programs(0) - 1 - pid
    return pid * BLOCK_M


@triton.jit
def _rows_off(r0, stride, BLOCK: tl.constexpr):
    """Element offsets ``(BLOCK, 1)`` of rows ``r0 .. r0 + BLOCK - 1``: ``r0 * stride`` in int64
    (``S * H * D`` passes 2**31 at 512K tokens with H=32, D=128), the rest within the tile."""
    return tl.cast(r0, tl.int64) * stride + (tl.arange(0, BLOCK) * stride)[:, None]


@triton.jit
def _load_v(
    v_at_k,
    v_base,
    k_off,
    k_mask,
    n0,
    offs_n,
    offs_dv,
    stride_vn,
    Sk,
    Dv,
    KV_SAME: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """V's key tile ``(BN, BDV)`` from ``v_base`` (this head's V). ``KV_SAME`` (``Dv == D``, v's
    strides k's): ``v_at_k + k_off`` with the K tile's own offsets and mask, as before V had its own
    head size (no second set of addresses per tile)."""
    if KV_SAME:
        return tl.load(v_at_k + k_off, mask=k_mask, other=0.0)
    return tl.load(
        v_base + _rows_off(n0, stride_vn, BLOCK_N) + offs_dv[None, :],
        mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv),
        other=0.0,
    )


@triton.jit
def _fwd_tile(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    offs_dv,
    n_lo,
    n_hi,
    Sk,
    offset,
    lo,
    qk_scale,
    cap2,
    D,
    Dv,
    MASKED: tl.constexpr,
    IS_OFFSET: tl.constexpr,
    IS_BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_SAME: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    """Online softmax (base 2) of one query tile over key tiles ``[n_lo, n_hi)``; acc
    ``(BM, BDV)``."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
        k_off = _rows_off(n0, stride_kn, BLOCK_N) + offs_d[None, :]
        k = tl.load(k_base + k_off, mask=k_mask, other=0.0)  # (BN, BD)
        v = _load_v(
            v_base, v_base, k_off, k_mask, n0, offs_n, offs_dv, stride_vn, Sk, Dv, KV_SAME, BLOCK_N
        )  # (BN, BDV)
        s = dot(q, tl.trans(k), PREC) * qk_scale  # (BM, BN) base-2 scores
        if SOFTCAP:  # qk_scale = scale / cap, cap2 = cap * log2(e)
            s = _tanh(s) * cap2
        if MASKED:
            visible = offs_n[None, :] < Sk
            if IS_OFFSET:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
            if IS_BAND:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + lo)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_step(acc, m_i, l_i, s, v, PREC)
    return acc, m_i, l_i


# lengths/offsets vary per call: not specialized (fewer compiles); strides still are
_NO_SPEC = ["H", "G", "Sq", "Sk", "D", "Dv", "offset", "lo", "SQ_B", "SK_B"]


@triton.jit(do_not_specialize=_NO_SPEC)
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_om,
    stride_oh,
    H,
    G,
    Sq,
    Sk,
    D,
    Dv,
    offset,
    lo,
    qk_scale,
    cap2,
    SQ_B,
    SK_B,
    IS_OFFSET: tl.constexpr,
    IS_BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_SAME: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid (cdiv(Sq, BLOCK_M), B * H): one query tile of one head
    m0 = _tile_start(IS_OFFSET, BLOCK_M)
    b = (tl.program_id(1) // H).to(tl.int64)  # int64: batch/head offsets may pass 2**31
    h = (tl.program_id(1) % H).to(tl.int64)
    hk = h // G  # GQA: the kv head of this query head
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + _rows_off(m0, stride_qm, BLOCK_M) + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # (BM, BD)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    if KV_SAME:
        v_base = (
            V + b * stride_kb + hk * stride_kh
        )  # k's offsets (the same strides: shared by the compiler)

    # key range: [0, n_full) seen by every row of the tile, [n_full, n_hi) needs the mask
    n_hi = Sk
    n_full = (Sk // BLOCK_N) * BLOCK_N
    if IS_OFFSET:  # (BAND too: its upper diagonal)
        last_row = tl.minimum(m0 + BLOCK_M, Sq) - 1
        n_hi = tl.maximum(tl.minimum(Sk, last_row + offset + 1), 0)
        n_full = tl.minimum(n_full, tl.maximum((m0 + offset + 1) // BLOCK_N * BLOCK_N, 0))
    n_full = tl.minimum(n_full, n_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_lo = 0
    if IS_BAND:
        # keys below the first row's window are skipped; [n_lo, n_mid) (below the last row's) is
        # masked,
        # then [n_mid, n_full) is seen by every row and [n_full, n_hi) masked again
        n_lo = tl.minimum(tl.maximum(m0 + lo, 0) // BLOCK_N * BLOCK_N, n_hi)
        n_mid = tl.minimum(
            tl.maximum(tl.cdiv(tl.maximum(last_row + lo, 0), BLOCK_N) * BLOCK_N, n_lo), n_hi
        )
        n_full = tl.minimum(tl.maximum(n_full, n_mid), n_hi)
        acc, m_i, l_i = _fwd_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            offs_m,
            offs_d,
            offs_dv,
            n_lo,
            n_mid,
            Sk,
            offset,
            lo,
            qk_scale,
            cap2,
            D,
            Dv,
            True,
            IS_OFFSET,
            IS_BAND,
            SOFTCAP,
            KV_SAME,
            BLOCK_N,
            PREC,
        )
        n_lo = n_mid
    acc, m_i, l_i = _fwd_tile(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        offs_dv,
        n_lo,
        n_full,
        Sk,
        offset,
        lo,
        qk_scale,
        cap2,
        D,
        Dv,
        False,
        IS_OFFSET,
        IS_BAND,
        SOFTCAP,
        KV_SAME,
        BLOCK_N,
        PREC,
    )
    acc, m_i, l_i = _fwd_tile(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        offs_dv,
        n_full,
        n_hi,
        Sk,
        offset,
        lo,
        qk_scale,
        cap2,
        D,
        Dv,
        True,
        IS_OFFSET,
        IS_BAND,
        SOFTCAP,
        KV_SAME,
        BLOCK_N,
        PREC,
    )

    out, lse2 = finish(acc, m_i, l_i)  # rows that saw no key: out 0, lse -inf
    lse = lse2 * 0.6931471805599453  # natural log
    if not KV_SAME:
        q_mask = (offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv)  # now out's
    tl.store(
        Out + b * stride_ob + h * stride_oh + _rows_off(m0, stride_om, BLOCK_M) + offs_dv[None, :],
        cast(out, Out.dtype.element_ty, PREC),
        mask=q_mask,
    )
    tl.store(Lse + (b * H + h) * Sq + offs_m, lse, mask=offs_m < Sq)


@triton.jit(do_not_specialize=["H", "Sq", "D"])
def _bwd_preprocess(
    Out,
    DO,
    Lse,
    DLse,
    Delta,
    Lse2,
    stride_ob,
    stride_om,
    stride_oh,
    stride_db,
    stride_dm,
    stride_dh,
    H,
    Sq,
    D,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid (cdiv(Sq, BLOCK_M), B * H): delta = rowsum(dout * out) - dlse; lse in base 2 (D here: V's
    # Dv)
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    b = (tl.program_id(1) // H).to(tl.int64)  # int64: batch/head offsets may pass 2**31
    h = (tl.program_id(1) % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + _rows_off(m0, stride_om, BLOCK_M) + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + b * stride_db + h * stride_dh + _rows_off(m0, stride_dm, BLOCK_M) + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    row = (b * H + h) * Sq + offs_m
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=offs_m < Sq, other=0.0).to(tl.float32)
    lse = tl.load(Lse + row, mask=offs_m < Sq, other=0.0)
    # rows that saw no key: lse2 = +inf makes every p = exp2(s - lse2) = 0 (zero grads, no NaN)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Delta + row, delta, mask=offs_m < Sq)
    tl.store(Lse2 + row, lse2, mask=offs_m < Sq)


@triton.jit(do_not_specialize=_NO_SPEC + ["Hkv"])
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse2,
    Delta,
    DK,
    DV,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_db,
    stride_dm,
    stride_dh,
    stride_gb,
    stride_gn,
    stride_gh,
    stride_gvb,
    stride_gvn,
    stride_gvh,
    H,
    Hkv,
    G,
    Sq,
    Sk,
    D,
    Dv,
    offset,
    lo,
    qk_scale,
    cap2,
    scale,
    SQ_B,
    SK_B,
    IS_OFFSET: tl.constexpr,
    IS_BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_SAME: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid (cdiv(Sk, BLOCK_N), B * Hkv): one key tile of one kv head, all G query heads
    n0 = tl.program_id(0) * BLOCK_N
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hk = (tl.program_id(1) % Hkv).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
    kv_off = b * stride_kb + hk * stride_kh + _rows_off(n0, stride_kn, BLOCK_N) + offs_d[None, :]
    k = tl.load(K + kv_off, mask=k_mask, other=0.0)  # (BN, BD)
    v = _load_v(
        V,
        V + b * stride_vb + hk * stride_vh,
        kv_off,
        k_mask,
        n0,
        offs_n,
        offs_dv,
        stride_vn,
        Sk,
        Dv,
        KV_SAME,
        BLOCK_N,
    )  # (BN, BDV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # query rows that see a key of this tile: i >= n0 - offset (earlier tiles skipped) and, in a
    # band, i + lo <= the tile's last key (later tiles skipped)
    m_lo = 0
    m_hi = Sq
    if IS_OFFSET:
        m_lo = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
    if IS_BAND:
        m_hi = tl.maximum(tl.minimum(Sq, n0 + BLOCK_N - lo), 0)
    for g in range(0, G):
        h = hk * G + g
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
            q = tl.load(
                Q
                + b * stride_qb
                + h * stride_qh
                + _rows_off(m0, stride_qm, BLOCK_M)
                + offs_d[None, :],
                mask=q_mask,
                other=0.0,
            )  # (BM, BD)
            if not KV_SAME:
                q_mask = (offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv)  # now dout's
            do = tl.load(
                DO
                + b * stride_db
                + h * stride_dh
                + _rows_off(m0, stride_dm, BLOCK_M)
                + offs_dv[None, :],
                mask=q_mask,
                other=0.0,
            )  # (BM, BDV)
            row = (b * H + h) * Sq + offs_m
            lse2 = tl.load(Lse2 + row, mask=offs_m < Sq, other=float("inf"))  # (BM,)
            delta = tl.load(Delta + row, mask=offs_m < Sq, other=0.0)
            s_t = dot(k, tl.trans(q), PREC) * qk_scale  # (BN, BM)
            if SOFTCAP:
                t_t = _tanh(s_t)
                s_t = t_t * cap2
            visible = (offs_n[:, None] < Sk) & (offs_m[None, :] < Sq)
            if IS_OFFSET:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + offset)
            if IS_BAND:
                visible = visible & (offs_n[:, None] >= offs_m[None, :] + lo)
            p_t = tl.where(visible, tl.math.exp2(s_t - lse2[None, :]), 0.0)
            dv += dot(cast(p_t, do.dtype, PREC), do, PREC)
            dp_t = dot(v, tl.trans(do), PREC)  # (BN, BM)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:  # through cap * tanh(x / cap): d/dx = 1 - tanh**2
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk += dot(cast(ds_t, q.dtype, PREC), q, PREC)
    g_off = b * stride_gb + hk * stride_gh + _rows_off(n0, stride_gn, BLOCK_N) + offs_d[None, :]
    tl.store(DK + g_off, cast(dk * scale, DK.dtype.element_ty, PREC), mask=k_mask)
    if not KV_SAME:  # dv's own offsets and mask
        g_off = (
            b * stride_gvb + hk * stride_gvh + _rows_off(n0, stride_gvn, BLOCK_N) + offs_dv[None, :]
        )
        k_mask = (offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv)
    tl.store(DV + g_off, cast(dv, DV.dtype.element_ty, PREC), mask=k_mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse2,
    Delta,
    DQ,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_db,
    stride_dm,
    stride_dh,
    stride_gb,
    stride_gm,
    stride_gh,
    H,
    G,
    Sq,
    Sk,
    D,
    Dv,
    offset,
    lo,
    qk_scale,
    cap2,
    scale,
    SQ_B,
    SK_B,
    IS_OFFSET: tl.constexpr,
    IS_BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_SAME: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid (cdiv(Sq, BLOCK_M), B * H): one query tile of one head over its visible key tiles
    m0 = _tile_start(IS_OFFSET, BLOCK_M)
    b = (tl.program_id(1) // H).to(tl.int64)  # int64: batch/head offsets may pass 2**31
    h = (tl.program_id(1) % H).to(tl.int64)
    hk = h // G
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + _rows_off(m0, stride_qm, BLOCK_M) + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # (BM, BD)
    do_mask = q_mask
    if not KV_SAME:
        do_mask = (offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv)
    do = tl.load(
        DO + b * stride_db + h * stride_dh + _rows_off(m0, stride_dm, BLOCK_M) + offs_dv[None, :],
        mask=do_mask,
        other=0.0,
    )  # (BM, BDV)
    row = (b * H + h) * Sq + offs_m
    lse2 = tl.load(Lse2 + row, mask=offs_m < Sq, other=float("inf"))
    delta = tl.load(Delta + row, mask=offs_m < Sq, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    if KV_SAME:
        v_base = (
            V + b * stride_kb + hk * stride_kh
        )  # k's offsets (the same strides: shared by the compiler)

    n_lo = 0
    n_hi = Sk
    if IS_OFFSET:  # key tiles past the tile's last row's diagonal are skipped
        n_hi = tl.maximum(tl.minimum(Sk, tl.minimum(m0 + BLOCK_M, Sq) - 1 + offset + 1), 0)
    if IS_BAND:  # ... and those below the first row's window
        n_lo = tl.maximum(m0 + lo, 0) // BLOCK_N * BLOCK_N
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
        k_off = _rows_off(n0, stride_kn, BLOCK_N) + offs_d[None, :]
        k = tl.load(k_base + k_off, mask=k_mask, other=0.0)  # (BN, BD)
        v = _load_v(
            v_base, v_base, k_off, k_mask, n0, offs_n, offs_dv, stride_vn, Sk, Dv, KV_SAME, BLOCK_N
        )  # (BN, BDV)
        s = dot(q, tl.trans(k), PREC) * qk_scale  # (BM, BN)
        if SOFTCAP:
            t = _tanh(s)
            s = t * cap2
        visible = offs_n[None, :] < Sk
        if IS_OFFSET:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
        if IS_BAND:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + lo)
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = dot(do, tl.trans(v), PREC)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += dot(cast(ds, k.dtype, PREC), k, PREC)
    tl.store(
        DQ + b * stride_gb + h * stride_gh + _rows_off(m0, stride_gm, BLOCK_M) + offs_d[None, :],
        cast(dq * scale, DQ.dtype.element_ty, PREC),
        mask=q_mask,
    )


# ----------------------------------------------------------------------------- launch

_CPU_CONFIG = dict(BLOCK_M=32, BLOCK_N=16)  # interpreter: small, fixed, M != N on purpose
_FIXED_CONFIG = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)  # RINGKV_TRITON_AUTOTUNE=0
_FIXED_BIG = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)  # ... for wide rows


def _configs():
    return [
        triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (64, 64, 4, 3),
            (64, 32, 4, 2),
            (16, 16, 2, 1),
        ]
    ]


def _widest(meta) -> int:
    """The wider of q/k's and v's padded head dims (``BLOCK_DV`` absent: kernels with one)."""
    return max(meta["BLOCK_D"], meta.get("BLOCK_DV", 0))


def _prune(configs, named_args, **kwargs):
    """Drop tiles much larger than the problem (small ring blocks, short sequences) and, for
    wide rows, tiles whose buffers do not fit in shared memory."""
    sq, sk = named_args["Sq"], named_args["Sk"]
    bm_cap = max(16, triton.next_power_of_2(sq))
    bn_cap = max(16, triton.next_power_of_2(sk))
    if big_rows(named_args["Q"].element_size(), _widest(kwargs)):
        bm_cap, bn_cap = min(bm_cap, 64), min(bn_cap, 32)
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= bm_cap and c.kwargs["BLOCK_N"] <= bn_cap]
    return kept or configs[-1:]


def _tuned(kernel):
    # key on bucketed lengths (SQ_B/SK_B are the next powers of two), the head dims and the variant
    return triton.autotune(
        _configs(),
        key=["SQ_B", "SK_B", "BLOCK_D", "BLOCK_DV", "IS_OFFSET", "IS_BAND", "SOFTCAP", "KV_SAME"],
        prune_configs_by={"early_config_prune": _prune},
    )(kernel)


def _launch(kernel, grid_fn, *args, **meta):
    """Run ``kernel``: autotuned on CUDA, one fixed small config under the interpreter.

    ``RINGKV_TRITON_AUTOTUNE=0`` takes one fixed config on CUDA too (test runs on a fresh GPU,
    where tuning every drawn shape would mostly measure compile time).
    """
    if interpret():
        kernel[grid_fn(_CPU_CONFIG)](*args, **meta, **_CPU_CONFIG)
        return
    if os.environ.get("RINGKV_TRITON_AUTOTUNE", "1") == "0":
        cfg = _FIXED_BIG if big_rows(args[0].element_size(), _widest(meta)) else _FIXED_CONFIG
        kernel[grid_fn(cfg)](*args, **meta, **cfg)
        return
    KERNELS.tuned(kernel, _tuned)[grid_fn](*args, **meta)


def _mask_args(mask: Mask) -> dict:
    """The kernels' mask: ``offset`` (OFFSET and BAND: ``j <= i + offset``), ``lo`` (BAND:
    ``j >= i + lo``)."""
    diag = mask.kind in (OFFSET, BAND)
    return dict(
        offset=mask.offset if diag else 0,
        lo=mask.lo if mask.kind == BAND else 0,
        IS_OFFSET=diag,
        IS_BAND=mask.kind == BAND,
    )


def _score_args(scale: float, softcap) -> dict:
    """Base-2 scores are ``q.k * qk_scale``, or with ``SOFTCAP`` ``cap2 * tanh(q.k * qk_scale)``:
    ``cap * tanh(scale * q.k / cap) * log2(e)``."""
    if softcap is None:
        return dict(qk_scale=scale * LOG2E, cap2=0.0, SOFTCAP=False)
    return dict(qk_scale=scale / softcap, cap2=softcap * LOG2E, SOFTCAP=True)


def _kv_same(k, v) -> bool:
    """k and v (or dk and dv) of one head size and one layout: the kernels address both at once."""
    return k.shape[-1] == v.shape[-1] and k.stride()[:3] == v.stride()[:3]


def _check_dims(q, k, v) -> None:
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d or not 0 < dv <= MAX_HEAD:
        raise ValueError(
            f"triton attention needs k's head size equal to q's ({k.shape[-1]} vs {d}) and "
            f"v's head size Dv in 1..{MAX_HEAD}, got Dv={dv}"
        )


def forward(q, k, v, scale: float, mask: Mask, softcap=None):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H, Dv) in q.dtype,
    lse (B, H, Sq) fp32. ``softcap``: scores ``cap * tanh(scale * q.k / cap)`` (None: plain)."""
    build()
    b, sq, h, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    _forward(q, k, v, out, lse, scale, mask, softcap=softcap)
    return out, lse


def _forward(q, k, v, out, lse, scale: float, mask: Mask, softcap=None) -> None:
    """Write ``out`` (B, Sq, H, Dv) / ``lse`` (B, H, Sq) (zeros / -inf beforehand); any strides with
    a unit last one."""
    build()
    _check_dims(q, k, v)
    softcap = check_softcap(softcap)
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if b * h * sq * sk == 0 or mask.kind == EMPTY:
        return
    _launch(
        _fwd_kernel,
        lambda c: (triton.cdiv(sq, c["BLOCK_M"]), b * h),
        q,
        k,
        v,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        h,
        h // hkv,
        sq,
        sk,
        d,
        dv,
        **_mask_args(mask),
        **_score_args(scale, softcap),
        KV_SAME=_kv_same(k, v),
        PREC=dot_prec(q.dtype),
        BLOCK_D=head_block(d),
        BLOCK_DV=head_block(dv),
        **_buckets(sq, sk),
    )


def _buckets(sq, sk):
    # SQ_B/SK_B: unused by the kernels, the autotune key (lengths bucketed to powers of two)
    return dict(SQ_B=triton.next_power_of_2(sq), SK_B=triton.next_power_of_2(sk))


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, dlse=None, softcap=None):
    """Same contract as ``reference.backward``: fp32 dq (B, Sq, H, D), dk (B, Sk, Hkv, D), dv (B,
    Sk, Hkv, Dv) from the rows' final out/lse (dout/out (B, Sq, H, Dv), lse and dlse (B, H, Sq));
    ``softcap`` as in forward."""
    build()
    q, k, v, dout, out = (t.contiguous() for t in (q, k, v, dout, out))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    _backward(
        dout.to(q.dtype),
        q,
        k,
        v,
        out,
        lse.float().contiguous(),
        dq,
        dk,
        dv,
        scale,
        mask,
        dlse,
        softcap=softcap,
    )
    return dq, dk, dv


def _backward(
    dout, q, k, v, out, lse, dq, dk, dv, scale: float, mask: Mask, dlse=None, softcap=None
) -> None:
    """Write fp32 ``dq, dk, dv`` (zeros beforehand); strides as in ``_forward``."""
    build()
    _check_dims(q, k, v)
    softcap = check_softcap(softcap)
    b, sq, h, d = q.shape
    sk, hkv, dvh = k.shape[1], k.shape[2], v.shape[-1]
    if b * h * sq * sk == 0 or mask.kind == EMPTY:
        return
    bd, bdv = head_block(d), head_block(dvh)
    delta, lse2 = _preprocess(out, dout, lse, dlse, bdv)
    common = dict(
        **_mask_args(mask),
        **_score_args(scale, softcap),
        scale=scale,
        PREC=dot_prec(q.dtype),
        KV_SAME=_kv_same(k, v) and _kv_same(dk, dv),
        BLOCK_D=bd,
        BLOCK_DV=bdv,
        **_buckets(sq, sk),
    )
    strides = tuple(s for t in (q, k, v, dout) for s in t.stride()[:3])
    _launch(
        _bwd_dkdv_kernel,
        lambda c: (triton.cdiv(sk, c["BLOCK_N"]), b * hkv),
        q,
        k,
        v,
        dout,
        lse2,
        delta,
        dk,
        dv,
        *strides,
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dv.stride(0),
        dv.stride(1),
        dv.stride(2),
        h,
        hkv,
        h // hkv,
        sq,
        sk,
        d,
        dvh,
        **common,
    )
    _launch(
        _bwd_dq_kernel,
        lambda c: (triton.cdiv(sq, c["BLOCK_M"]), b * h),
        q,
        k,
        v,
        dout,
        lse2,
        delta,
        dq,
        *strides,
        dq.stride(0),
        dq.stride(1),
        dq.stride(2),
        h,
        h // hkv,
        sq,
        sk,
        d,
        dvh,
        **common,
    )


def _preprocess(out, dout, lse, dlse, block_dv: int):
    """``(delta, lse2)``, both ``(B, H, Sq)`` fp32: ``rowsum(dout * out) - dlse`` and the base-2
    lse (+inf for rows that see no key)."""
    b, sq, h, dvh = out.shape
    delta = torch.empty(b, h, sq, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)  # base-2 lse, +inf for rows that see no key
    dlse_t = dlse.float().contiguous() if dlse is not None else delta
    bm = 32
    _bwd_preprocess[(triton.cdiv(sq, bm), b * h)](
        out,
        dout,
        lse,
        dlse_t,
        delta,
        lse2,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        dout.stride(0),
        dout.stride(1),
        dout.stride(2),
        h,
        sq,
        dvh,
        HAS_DLSE=dlse is not None,
        BLOCK_M=bm,
        BLOCK_D=block_dv,
    )
    return delta, lse2
