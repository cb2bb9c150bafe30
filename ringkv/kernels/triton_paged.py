"""Flash-decoding over a paged KV cache in Triton (same contract as ``paged_attention_reference``),
and a varlen prefill kernel (the contract of ``paged_prefill_reference``; ``paged_base.py``).

Two kernels:

1. ``_paged_split_kernel``, grid ``(N, Hkv, num_splits)``: one program takes sequence ``n``,
   kv head ``hk`` with *all* ``G * Q`` query rows that read it (``G = H // Hkv`` heads of the
   group x ``Q`` new tokens), and one chunk of the sequence's tokens (split-K). Keys are
   gathered through the block table tile by tile; it writes a partial ``out`` (fp32) and a
   base-2 ``lse`` per row and split. Splits past the sequence's end write lse = -inf.
2. ``_paged_reduce_kernel``, grid ``(N * H, Q)``: merges the splits of one row by LSE and
   writes ``out`` in q's dtype and the natural-log ``lse``.

Causal: query ``i`` sits at position ``seq_len - Q + i`` and sees keys ``t <= seq_len - Q + i``.
The number of splits comes from the cache capacity (``max_blocks * block_size``), not from
``seq_lens`` (no host sync): enough programs to fill the GPU (about two per SM) with chunks
of at least ``MIN_CHUNK`` tokens, so one 128K-token sequence still spreads over every SM.

Features (``paged_base``), compiled in only when used (constexpr flags, so the plain kernels are
the same as before): ``SOFTCAP``: scores ``softcap * tanh(scale * q.k / softcap)`` (base 2 after
the cap), masked after; ``HAS_WINDOW``: keys at global positions ``< p - window`` hidden, and key
tiles wholly before the first row's window skipped; V's head size ``D_V`` has its own tile width
(``BLOCK_DV``) and strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import List, Optional, Sequence

import torch

from .checks import resolve_scale
from .paged_base import (
    LayerCache,
    PagedSeq,
    RowsOut,
    SeqGroup,
    by_query_count,
    check_features,
    check_striping,
    padded_table,
    validate_paged,
    validate_prefill,
)
from .triton_common import (  # raises ImportError when triton is not installed
    LAZY,
    big_rows,
    build,
    dot,
    dot_prec,
    finish,
    head_block,
    interpret,
    online_step,
)

triton, tl = LAZY, None  # build() binds the real modules (triton_common: kernels built on use)

LOG2E = 1.4426950408889634
MIN_CHUNK = 256  # tokens per split at least (less: the reduce costs more than it saves)
MAX_SPLITS = 256


@triton.jit
def _gather_kv(
    Q,
    K,
    V,
    KScale,
    VScale,
    table_row,
    offs_t,
    t_ok,
    hk,
    offs_d,
    D,
    offs_dv,
    D_V,
    block_size,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    QUANT: tl.constexpr,
):
    """K ``(BN, BD)`` and V ``(BN, BDV)`` of tokens ``offs_t`` of one sequence (its block table row
    at ``table_row``) and kv head ``hk``, gathered token by token through the table (any block
    size); a quantized cache (one byte per value, one scale per (token, kv head)) is
    dequantized to q's dtype as it is read. Tokens with ``t_ok`` false load as zeros."""
    block = tl.load(table_row + offs_t // block_size, mask=t_ok, other=0).to(tl.int64)
    slot = offs_t % block_size
    k_off = (
        block[:, None] * stride_kb + slot[:, None] * stride_ks + hk * stride_kh + offs_d[None, :]
    )
    v_off = (
        block[:, None] * stride_vb + slot[:, None] * stride_vs + hk * stride_vh + offs_dv[None, :]
    )
    k = tl.load(K + k_off, mask=t_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + v_off, mask=t_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if QUANT:
        s_off = block * stride_sb + slot * stride_ss + hk
        k_s = tl.load(KScale + s_off, mask=t_ok, other=0.0).to(tl.float32)
        v_s = tl.load(VScale + s_off, mask=t_ok, other=0.0).to(tl.float32)
        k = (k.to(tl.float32) * k_s[:, None]).to(Q.dtype.element_ty)
        v = (v.to(tl.float32) * v_s[:, None]).to(Q.dtype.element_ty)
    return k, v


@triton.jit
def _paged_scores(q, k, qk_scale, cap2, SOFTCAP: tl.constexpr, PREC: tl.constexpr):
    """Base-2 scores ``(BR, BN)`` of ``q (BR, BD)`` and ``k (BN, BD)``: ``q.k * qk_scale``
    (``scale * log2(e)``), or with ``SOFTCAP`` ``cap2 * tanh(q.k * qk_scale)``
    (``qk_scale = scale / softcap``,
    ``cap2 = softcap * log2(e)``); tanh from one exp2 of ``-2|x|`` (no overflow at any ``x``)."""
    s = dot(q, tl.trans(k), PREC) * qk_scale
    if SOFTCAP:
        e = tl.math.exp2(-2.8853900817779268 * tl.abs(s))  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        s = cap2 * tl.where(s < 0, -t, t)
    return s


@triton.jit
def _paged_first_key(first_pos, window, sp, sp_rank):
    """The first local key (at global position ``sp_rank + j * sp``) at or after
    ``first_pos - window``."""
    return (tl.maximum(first_pos - window - sp_rank, 0) + sp - 1) // sp


@triton.jit(do_not_specialize=["capacity", "chunk", "num_splits", "sp", "sp_rank", "window"])
def _paged_split_kernel(
    Q,
    K,
    V,
    KScale,
    VScale,
    BlockTable,
    SeqLens,
    QStart,
    OutP,
    LseP,
    stride_qn,
    stride_qq,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    stride_bt,
    H,
    G,
    NQ,
    D,
    D_V,
    block_size,
    capacity,
    chunk,
    num_splits,
    qk_scale,
    cap2,
    sp,
    sp_rank,
    window,
    CAUSAL: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_START: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + n).to(tl.int32)
    # rows r = g * NQ + i: query token i of query head hk * G + g
    offs_r = tl.arange(0, BLOCK_R)
    g = offs_r // NQ
    qi = offs_r % NQ
    h = hk * G + g
    row_ok = offs_r < G * NQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(
        Q + n * stride_qn + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # (BR, BD)
    last_key = seq_len - NQ + qi  # causal: the last key position each row sees
    if not CAUSAL:
        last_key = tl.zeros_like(qi) + seq_len - 1

    t_lo = split * chunk
    # splits past the end run no iteration; never read past the table row (seq_len > capacity)
    t_hi = tl.minimum(tl.minimum(t_lo + chunk, seq_len), capacity)
    if (
        HAS_WINDOW
    ):  # global query positions (default: the last NQ of the keys); skip tiles before the window
        if HAS_START:
            start = tl.load(QStart + n).to(tl.int32)
        else:
            start = seq_len - NQ
        pos = start + qi
        t_lo = tl.maximum(t_lo, _paged_first_key(start, window, sp, sp_rank))
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < t_hi
        k, v = _gather_kv(
            Q,
            K,
            V,
            KScale,
            VScale,
            BlockTable + n * stride_bt,
            offs_t,
            t_ok,
            hk,
            offs_d,
            D,
            offs_dv,
            D_V,
            block_size,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_sb,
            stride_ss,
            QUANT,
        )
        s = _paged_scores(q, k, qk_scale, cap2, SOFTCAP, PREC)  # (BR, BN) base-2 scores
        visible = t_ok[None, :] & (offs_t[None, :] <= last_key[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_t[None, :] * sp + sp_rank >= pos[:, None] - window)
        acc, m_i, l_i = online_step(acc, m_i, l_i, tl.where(visible, s, float("-inf")), v, PREC)

    out, lse2 = finish(acc, m_i, l_i)
    # partials: OutP (N, H, NQ, splits, D_V), LseP (N, H, NQ, splits), both fp32 contiguous
    part = ((n * H + h) * NQ + qi) * num_splits + split
    tl.store(
        OutP + part[:, None] * D_V + offs_dv[None, :],
        out,
        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
    )
    tl.store(LseP + part, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_reduce_kernel(
    OutP,
    LseP,
    Out,
    Lse,
    stride_on,
    stride_oq,
    stride_oh,
    H,
    NQ,
    D,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)  # n * H + h
    qi = tl.program_id(1)
    n = nh // H
    h = nh % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (nh * NQ + qi) * num_splits
    lse2 = tl.load(LseP + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))  # (BS,)
    o = tl.load(
        OutP + (base + offs_s)[:, None] * D + offs_d[None, :],
        mask=(offs_s[:, None] < num_splits) & (offs_d[None, :] < D),
        other=0.0,
    )  # (BS, BD)
    m = tl.max(lse2, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse2 - m_safe)  # splits that saw nothing weigh 0
    total = tl.sum(w, 0)
    seen = total > 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(seen, total, 1.0)
    lse = tl.where(
        seen,
        (m_safe + tl.math.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
        float("-inf"),
    )
    tl.store(
        Out + n * stride_on + qi * stride_oq + h * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < D,
    )
    tl.store(Lse + nh * NQ + qi, lse)


@triton.jit(
    do_not_specialize=[
        "total_q",
        "H",
        "G",
        "D",
        "D_V",
        "block_size",
        "capacity",
        "sp",
        "sp_rank",
        "window",
    ]
)
def _paged_prefill_kernel(
    Q,
    K,
    V,
    KScale,
    VScale,
    BlockTable,
    CuSeqlensQ,
    SeqLens,
    QStart,
    Out,
    Lse,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_ot,
    stride_oh,
    total_q,
    H,
    G,
    D,
    D_V,
    block_size,
    capacity,
    sp,
    sp_rank,
    qk_scale,
    cap2,
    window,
    CAUSAL: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_START: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid (cdiv(max_seqlen_q, BLOCK_M), N, H): query tokens [m0, m0 + BLOCK_M) of sequence n, head
    # h
    m0 = tl.program_id(0) * BLOCK_M
    n = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    hk = h // G
    q_lo = tl.load(CuSeqlensQ + n).to(tl.int64)
    nq = (tl.load(CuSeqlensQ + n + 1) - q_lo).to(tl.int32)
    seq_len = tl.load(SeqLens + n).to(tl.int32)
    if HAS_START:
        start = tl.load(QStart + n).to(tl.int32)
    else:
        start = seq_len - nq  # the new tokens are the last ones in the cache
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = q_lo + offs_m  # packed token index, int64
    row_ok = offs_m < nq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )  # (BM, BD)
    pos = start + offs_m  # global position of each query

    # local key j sits at global position j * sp + sp_rank; never read past the table row
    t_hi = tl.minimum(seq_len, capacity)
    if CAUSAL:  # keys past the tile's last row are outside the loop
        last = start + tl.minimum(m0 + BLOCK_M, nq) - 1
        t_hi = tl.minimum(t_hi, tl.maximum((last - sp_rank + sp) // sp, 0))
    t_hi = tl.where(m0 < nq, t_hi, 0)  # a tile past this sequence's queries: nothing to do
    t_lo = 0
    if HAS_WINDOW:  # keys before the tile's first row's window are outside the loop
        t_lo = _paged_first_key(start + m0, window, sp, sp_rank)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < t_hi
        k, v = _gather_kv(
            Q,
            K,
            V,
            KScale,
            VScale,
            BlockTable + n * stride_bt,
            offs_t,
            t_ok,
            hk,
            offs_d,
            D,
            offs_dv,
            D_V,
            block_size,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_sb,
            stride_ss,
            QUANT,
        )
        s = _paged_scores(q, k, qk_scale, cap2, SOFTCAP, PREC)  # (BM, BN) base-2 scores
        visible = t_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_t[None, :] * sp + sp_rank <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_t[None, :] * sp + sp_rank >= pos[:, None] - window)
        acc, m_i, l_i = online_step(acc, m_i, l_i, tl.where(visible, s, float("-inf")), v, PREC)

    out, lse2 = finish(acc, m_i, l_i)
    tl.store(
        Out + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
    )
    tl.store(
        Lse + h * total_q + rows, lse2 * 0.6931471805599453, mask=row_ok
    )  # (H, T), natural log


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits, to exercise the reduce


def num_splits_for(capacity: int, programs: int, device) -> int:
    """Splits per (sequence, kv head): about two programs per SM, chunks >= MIN_CHUNK tokens."""
    want = -(-2 * _num_sms(device) // max(programs, 1))  # ceil division
    return max(1, min(want, -(-capacity // MIN_CHUNK), MAX_SPLITS))


def paged_attention_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    num_splits: Optional[int] = None,
    k_scale=None,
    v_scale=None,
    softcap: Optional[float] = None,
    window: int = -1,
):
    """Same contract as ``paged_base.paged_attention_reference`` (the ``"triton"`` backend): one new
    token per sequence (or ``num_splits`` given) runs the decode kernel, several the prefill
    kernel."""
    kw = dict(
        scale=scale, causal=causal, k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window
    )
    if q.shape[1] == 1 or num_splits is not None:
        return paged_decode_triton(
            q, k_cache, v_cache, block_table, seq_lens, num_splits=num_splits, **kw
        )
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, softcap, window)
    n, nq, h, d = q.shape
    cu = torch.arange(
        0, (n + 1) * nq, nq, dtype=torch.int32, device=q.device
    )  # (N + 1,): Q tokens each
    out, lse = paged_prefill_triton(
        q.reshape(n * nq, h, d), k_cache, v_cache, block_table, cu, seq_lens, max_seqlen_q=nq, **kw
    )  # (N * Q, H, Dv), (H, N * Q)
    return out.view(n, nq, h, -1), lse.view(h, n, nq).transpose(0, 1).contiguous()


def _score_args(scale: float, softcap: Optional[float]):
    """``(qk_scale, cap2)`` of ``_scores``: base-2 scores without a cap, ``tanh``'s argument with
    one."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


def paged_decode_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    num_splits: Optional[int] = None,
    k_scale=None,
    v_scale=None,
    softcap: Optional[float] = None,
    window: int = -1,
    q_start=None,
    sp: int = 1,
    sp_rank: int = 0,
):
    """The flash-decoding kernel for any ``Q`` (its row tile is ``G * Q``: meant for a few
    tokens); ``num_splits`` overrides the choice. ``q_start (N,)``, ``sp``/``sp_rank``: the queries'
    global positions and the keys' striping, read for a ``window`` only (default: the queries are
    the last ``Q`` of ``seq_lens`` keys, not striped); ``causal`` compares local positions."""
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, softcap, window)
    softcap, window = check_features(softcap, window)
    check_striping(sp, sp_rank)
    build()
    n, nq, h, d = q.shape
    hkv, bs, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q = q.contiguous()
    if k_cache.stride(-1) != 1:  # (never a copy for the engine's caches)
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    out = torch.zeros(n, nq, h, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((n, h, nq), float("-inf"), dtype=torch.float32, device=q.device)
    capacity = block_table.shape[1] * bs
    if n * nq * h == 0 or capacity == 0:
        return out, lse
    splits = num_splits or num_splits_for(capacity, n * hkv, q.device)
    chunk = triton.cdiv(capacity, splits)
    g = h // hkv
    block_r = max(16, triton.next_power_of_2(g * nq))
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    block_n = 64 if max(block_d, block_dv) <= 64 else 32
    out_p = torch.empty(n, h, nq, splits, dv, dtype=torch.float32, device=q.device)
    lse_p = torch.empty(n, h, nq, splits, dtype=torch.float32, device=q.device)
    quant, k_s, v_s = _scales(q, k_scale, v_scale)
    qk_scale, cap2 = _score_args(scale, softcap)
    has_start = q_start is not None and window >= 0
    _paged_split_kernel[(n, hkv, splits)](
        q,
        k_cache,
        v_cache,
        k_s,
        v_s,
        block_table,
        seq_lens,
        q_start.contiguous() if has_start else seq_lens,
        out_p,
        lse_p,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *_cache_strides(k_cache, v_cache, k_s, quant, block_table),
        h,
        g,
        nq,
        d,
        dv,
        bs,
        capacity,
        chunk,
        splits,
        qk_scale,
        cap2,
        sp,
        sp_rank,
        window,
        CAUSAL=causal,
        QUANT=quant,
        SOFTCAP=softcap is not None,
        HAS_WINDOW=window >= 0,
        HAS_START=has_start,
        PREC=dot_prec(q.dtype),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    _reduce(out_p, lse_p, out, lse, splits, block_dv)
    return out, lse


def _reduce(out_p, lse_p, out, lse, splits: int, block_dv: int) -> None:
    """Merge the splits' partials ``out_p (N, H, Q, S, Dv)``, ``lse_p (N, H, Q, S)`` into ``out
    (N, Q, H, Dv)`` and ``lse (N, H, Q)``."""
    n, nq, h, dv = out.shape
    _paged_reduce_kernel[(n * h, nq)](
        out_p,
        lse_p,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        h,
        nq,
        dv,
        splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=block_dv,
    )


def _scales(q, k_scale, v_scale):
    """``(quant, k_s, v_s)``: the scales of a quantized cache, contiguous; q itself for both
    (unused pointers) without QUANT."""
    quant = k_scale is not None
    if quant:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    return (quant, k_scale, v_scale) if quant else (quant, q, q)


def _cache_strides(k_cache, v_cache, k_s, quant: bool, block_table) -> tuple:
    """The kernels' cache strides: K's and V's (block, slot, head), the scales' (block, slot; 0
    without QUANT), a block table row's."""
    return (
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        k_s.stride(0) if quant else 0,
        k_s.stride(1) if quant else 0,
        block_table.stride(0),
    )


def paged_prefill_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    *,
    max_seqlen_q: int,
    q_start=None,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    sp: int = 1,
    sp_rank: int = 0,
    softcap: Optional[float] = None,
    window: int = -1,
):
    """Same contract as ``paged_base.paged_prefill_reference``: ``q (T, H, D)`` packed ->
    ``out (T, H, Dv)``, ``lse (H, T)`` fp32. No host sync: the grid is ``(cdiv(max_seqlen_q,
    BLOCK_M), N, H)``, so ``max_seqlen_q`` must be at least every sequence's query count."""
    validate_prefill(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        q_start,
        k_scale,
        v_scale,
        sp,
        sp_rank,
        softcap,
        window,
    )
    softcap, window = check_features(softcap, window)
    build()
    t, h, d = q.shape
    n, hkv, bs, dv = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    scale, block_d, block_dv = resolve_scale(scale, d), head_block(d), head_block(dv)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_table, cu_seqlens_q, seq_lens = (
        block_table.contiguous(),
        cu_seqlens_q.contiguous(),
        seq_lens.contiguous(),
    )
    out = q.new_empty(
        t, h, dv
    )  # every row is written: each sequence's tokens lie in its first tiles
    lse = torch.empty(h, t, dtype=torch.float32, device=q.device)
    capacity = block_table.shape[1] * bs
    if t * h == 0 or n == 0 or max_seqlen_q <= 0:
        return out.zero_(), lse.fill_(float("-inf"))
    quant, k_s, v_s = _scales(q, k_scale, v_scale)
    cfg = _prefill_config(q.element_size(), max(block_d, block_dv))
    qk_scale, cap2 = _score_args(scale, softcap)
    _paged_prefill_kernel[(triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), n, h)](
        q,
        k_cache,
        v_cache,
        k_s,
        v_s,
        block_table,
        cu_seqlens_q,
        seq_lens,
        q_start.contiguous() if q_start is not None else seq_lens,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        *_cache_strides(k_cache, v_cache, k_s, quant, block_table),
        out.stride(0),
        out.stride(1),
        t,
        h,
        h // hkv,
        d,
        dv,
        bs,
        capacity,
        sp,
        sp_rank,
        qk_scale,
        cap2,
        window,
        CAUSAL=causal,
        QUANT=quant,
        HAS_START=q_start is not None,
        SOFTCAP=softcap is not None,
        HAS_WINDOW=window >= 0,
        PREC=dot_prec(q.dtype),
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        **cfg,
    )
    return out, lse


def _prefill_config(elem_bytes: int, block_d: int) -> dict:
    """Fixed tiles: 64 query rows x 64 keys (32 for D > 64; 32 x 32 for wide fp32 rows, whose
    buffers would not fit in shared memory); small ones under the interpreter."""
    if interpret():
        return dict(BLOCK_M=16, BLOCK_N=16)
    if big_rows(elem_bytes, block_d):
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=64 if block_d <= 64 else 32, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class VarlenBatch:
    """Sequences of a step with several queries each, packed for one ``paged_prefill_triton``
    call."""

    rows: torch.Tensor  # (R,) local query rows, sequence after sequence
    block_table: torch.Tensor  # (M, width) int32
    cu_seqlens_q: torch.Tensor  # (M + 1,) int32
    seq_lens: torch.Tensor  # (M,) int32: keys stored here, the new ones included
    q_start: torch.Tensor  # (M,) int32: each sequence's first query position
    max_seqlen_q: int

    @classmethod
    def build(cls, seqs: Sequence[PagedSeq], sp: int, sp_rank: int, device) -> "VarlenBatch":
        n_of = [s.n for s in seqs]
        return cls(
            torch.tensor([s.row + j for s in seqs for j in range(s.n)], device=device),
            padded_table([s.block_table for s in seqs], device),
            torch.tensor([0] + list(accumulate(n_of)), dtype=torch.int32, device=device),
            torch.tensor([s.keys(sp, sp_rank) for s in seqs], dtype=torch.int32, device=device),
            torch.tensor([s.start for s in seqs], dtype=torch.int32, device=device),
            max(n_of),
        )


class TritonStep:
    """The ``"triton"`` backend's metadata for one step (positions and lengths as device tensors,
    built once): one-token sequences (decode) go to the flash-decoding kernel, all sequences with
    several tokens (later chunks, prefix-continued prompts) to one varlen prefill call per layer."""

    def __init__(
        self,
        seqs: Sequence[PagedSeq],
        *,
        block_size: int,
        sp: int = 1,
        sp_rank: int = 0,
        device=None,
    ):
        groups = by_query_count(seqs)
        self.sp, self.sp_rank = sp, sp_rank
        self.decode = SeqGroup.build(1, groups[1], sp, sp_rank, device) if 1 in groups else None
        self.decode_start = (
            None
            if self.decode is None
            else torch.tensor(  # (N,) positions, for a window
                [s.start for s in groups[1]], dtype=torch.int32, device=device
            )
        )
        multi = [s for n, members in groups.items() if n > 1 for s in members]
        self.varlen = VarlenBatch.build(multi, sp, sp_rank, device) if multi else None

    def attend(
        self,
        q,
        cache: LayerCache,
        *,
        lse: bool = True,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ) -> List[RowsOut]:
        # q (T, H, D) -> decode rows (N,) and varlen rows (R,): out (., H, Dv), lse (H, .) or None
        parts = []
        if (
            self.decode is not None
        ):  # one token at the end sees every key stored here (its window's)
            o, ls = paged_decode_triton(
                self.decode.queries(q),
                cache.k,
                cache.v,
                self.decode.block_table,
                self.decode.seq_lens,
                causal=False,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                scale=scale,
                softcap=softcap,
                window=window,
                q_start=self.decode_start,
                sp=self.sp,
                sp_rank=self.sp_rank,
            )
            parts.append(self.decode.result(o, ls if lse else None))
        if self.varlen is not None:
            b = self.varlen
            o, ls = paged_prefill_triton(
                q.index_select(0, b.rows),
                cache.k,
                cache.v,
                b.block_table,
                b.cu_seqlens_q,
                b.seq_lens,
                max_seqlen_q=b.max_seqlen_q,
                q_start=b.q_start,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                sp=self.sp,
                sp_rank=self.sp_rank,
                scale=scale,
                softcap=softcap,
                window=window,
            )
            parts.append(RowsOut(b.rows, o, ls if lse else None))
        return parts


plan_step = (
    TritonStep  # the backend's plan_step(seqs, *, block_size, sp, sp_rank, device) (see paged_base)
)
