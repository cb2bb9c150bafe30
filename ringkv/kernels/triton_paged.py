"""Flash-decoding over a paged KV cache in Triton (same contract as ``paged_attention_reference``).

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
"""

from __future__ import annotations

from typing import Optional

import torch

from . import paged
from .paged import validate_paged
from .triton_attn import _build, _jit, _prec  # raises ImportError when triton is not installed

triton = tl = None  # bound by _build() (see triton_attn: kernels are decorated on first use)

LOG2E = 1.4426950408889634
MIN_CHUNK = 256   # tokens per split at least (less: the reduce costs more than it saves)
MAX_SPLITS = 256


@_jit(do_not_specialize=["capacity", "chunk", "num_splits"])
def _paged_split_kernel(Q, K, V, KScale, VScale, BlockTable, SeqLens, OutP, LseP,
                        stride_qn, stride_qq, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                        stride_bt, H, G, NQ, D, block_size, capacity, chunk, num_splits, qk_scale,
                        CAUSAL: tl.constexpr, QUANT: tl.constexpr, PREC: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
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
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + n * stride_qn + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # (BR, BD)
    last_key = seq_len - NQ + qi  # causal: the last key position each row sees
    if not CAUSAL:
        last_key = tl.zeros_like(qi) + seq_len - 1

    t_lo = split * chunk
    # splits past the end run no iteration; never read past the table row (seq_len > capacity)
    t_hi = tl.minimum(tl.minimum(t_lo + chunk, seq_len), capacity)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < t_hi
        block = tl.load(BlockTable + n * stride_bt + offs_t // block_size, mask=t_ok, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_kb + (offs_t % block_size)[:, None] * stride_ks \
            + hk * stride_kh + offs_d[None, :]
        kv_mask = t_ok[:, None] & (offs_d[None, :] < D)
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)  # (BN, BD), gathered through the table
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        if QUANT:  # one byte per value, one scale per (token, kv head): dequantize as it is read
            s_off = block * stride_sb + (offs_t % block_size) * stride_ss + hk
            k_s = tl.load(KScale + s_off, mask=t_ok, other=0.0).to(tl.float32)
            v_s = tl.load(VScale + s_off, mask=t_ok, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_s[:, None]).to(Q.dtype.element_ty)
            v = (v.to(tl.float32) * v_s[:, None]).to(Q.dtype.element_ty)
        s = _dot(q, tl.trans(k), PREC) * qk_scale  # (BR, BN) base-2 scores
        visible = t_ok[None, :] & (offs_t[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    # partials: OutP (N, H, NQ, splits, D), LseP (N, H, NQ, splits), both fp32 contiguous
    part = ((n * H + h) * NQ + qi) * num_splits + split
    tl.store(OutP + part[:, None] * D + offs_d[None, :], out, mask=q_mask)
    tl.store(LseP + part, lse2, mask=row_ok)


@_jit(do_not_specialize=["num_splits"])
def _paged_reduce_kernel(OutP, LseP, Out, Lse, stride_on, stride_oq, stride_oh,
                         H, NQ, D, num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    nh = tl.program_id(0).to(tl.int64)  # n * H + h
    qi = tl.program_id(1)
    n = nh // H
    h = nh % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (nh * NQ + qi) * num_splits
    lse2 = tl.load(LseP + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))  # (BS,)
    o = tl.load(OutP + (base + offs_s)[:, None] * D + offs_d[None, :],
                mask=(offs_s[:, None] < num_splits) & (offs_d[None, :] < D), other=0.0)  # (BS, BD)
    m = tl.max(lse2, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse2 - m_safe)  # splits that saw nothing weigh 0
    total = tl.sum(w, 0)
    seen = total > 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(seen, total, 1.0)
    lse = tl.where(seen, (m_safe + tl.math.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(Out + n * stride_on + qi * stride_oq + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < D)
    tl.store(Lse + nh * NQ + qi, lse)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits, to exercise the reduce


def num_splits_for(capacity: int, programs: int, device) -> int:
    """Splits per (sequence, kv head): about two programs per SM, chunks >= MIN_CHUNK tokens."""
    want = -(-2 * _num_sms(device) // max(programs, 1))  # ceil division
    return max(1, min(want, -(-capacity // MIN_CHUNK), MAX_SPLITS))


def paged_attention_triton(q, k_cache, v_cache, block_table, seq_lens, *, scale: Optional[float] = None,
                           causal: bool = True, num_splits: Optional[int] = None, k_scale=None, v_scale=None):
    """Same contract as ``paged.paged_attention_reference``; ``num_splits`` overrides the choice."""
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    _build()
    n, nq, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    scale = d ** -0.5 if scale is None else scale
    q = q.contiguous()
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():  # the kernel reads both with k's strides
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # (never a copy for the engine's caches)
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    out = torch.zeros(n, nq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((n, h, nq), float("-inf"), dtype=torch.float32, device=q.device)
    capacity = block_table.shape[1] * bs
    if n * nq * h == 0 or capacity == 0:
        return out, lse
    splits = num_splits or num_splits_for(capacity, n * hkv, q.device)
    chunk = triton.cdiv(capacity, splits)
    g = h // hkv
    block_r = max(16, triton.next_power_of_2(g * nq))
    block_d = max(16, triton.next_power_of_2(d))
    block_n = 64 if block_d <= 64 else 32
    out_p = torch.empty(n, h, nq, splits, d, dtype=torch.float32, device=q.device)
    lse_p = torch.empty(n, h, nq, splits, dtype=torch.float32, device=q.device)
    quant = k_scale is not None
    if quant:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    k_s, v_s = (k_scale, v_scale) if quant else (q, q)  # unused pointers without QUANT
    _paged_split_kernel[(n, hkv, splits)](
        q, k_cache, v_cache, k_s, v_s, block_table, seq_lens, out_p, lse_p,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_s.stride(0) if quant else 0, k_s.stride(1) if quant else 0,
        block_table.stride(0), h, g, nq, d, bs, capacity, chunk, splits, scale * LOG2E,
        CAUSAL=causal, QUANT=quant, PREC=_prec(q.dtype), BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d)
    _paged_reduce_kernel[(n * h, nq)](
        out_p, lse_p, out, lse, out.stride(0), out.stride(1), out.stride(2), h, nq, d, splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d)
    return out, lse


paged._BACKENDS["triton"] = paged_attention_triton
