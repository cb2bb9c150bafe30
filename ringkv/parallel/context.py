"""One rank's view of a step and the model's attention call site over its paged KV cache.

**Where a token's K/V lives.** With ``sp`` SP ranks, token ``t`` of a sequence is stored on
SP rank ``t % sp`` (the ``striped`` layout of ``ringkv.sp``, vLLM's decode-context-parallel
interleave of 1). A logical block of the block table holds ``block_size * sp`` consecutive
tokens; each SP rank keeps its ``block_size`` of them in its own physical block with the
same id. So rank ``r``'s tokens of a sequence, ``r, r + sp, r + 2 sp, ...``, form an
ordinary paged sequence (local token ``i`` at ``block_table[i // block_size]``, offset
``i % block_size``), one block table serves every rank, and each rank stores ``1/sp`` of
every sequence. With ``sp = 1`` this is the usual paged layout.

**What a rank computes.** A sequence's step of ``n`` tokens runs in one of two modes:

- *ring* (``sp > 1`` and ``n >= ring_min_tokens``): the tokens are split over the SP ranks
  by the same striping (padded with ``-n % sp`` tokens past the end, which no real query
  sees under the causal mask and which are never stored), so each rank computes exactly the
  tokens it stores. Attention is ``ring_attention_shards``: each rank's keys are all the
  tokens of the sequence it stores: a prompt from position 0 rings its own new K/V; a later
  chunk rings what its rank stores, cached prefix included.
- *replicated* (decode, short chunks, and everything when ``sp = 1``): every SP rank
  computes all ``n`` tokens; the owner of each token writes its K/V. A sequence starting at
  position 0 attends to its own new K/V with ``kernels.attention`` (every rank has all of
  it); the others attend the queries over the keys each rank stores and the partial
  ``(out, lse)`` are merged across the SP group (``sp.decode.merge_across``: one all-gather
  per layer for all such sequences).

Whatever the mesh, a prompt's first chunk attends to its own K/V as computed and everything
else reads the cache: with a quantized cache every mesh computes the same thing.

**Kernels.** With ``paged_backend="torch"`` (CPU) the cache is read through ``PagedPlan``s
built once per step; with ``"triton"`` (CUDA) one-token rows go to the decode kernel and all
multi-token rows of the step to one varlen ``paged_prefill`` call per layer.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate
from datetime import timedelta
from typing import List, Optional

import torch

from ..cache.kv_cache import KVCache
from ..kernels import attention
from ..kernels.paged import paged_attention, paged_prefill
from ..kernels.paged_torch import PagedPlan, paged_attention_lse, paged_attention_planned
from ..kernels.quant import as_bytes, dequantize
from ..sp.comm import RingComm
from ..sp.decode import merge_across
from ..sp.ring import Shards, ring_attention_shards
from .plan import StepPlan


def _padded_table(tables: List[List[int]], device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)  # (N, width)


class LocalStep:
    """Rank ``sp_rank``'s share of ``plan``: ``input_ids``/``positions`` ``(T,)`` of the tokens it
    computes, ``write_rows``/``write_slots`` of those it stores, the attention work, and
    ``last_rows``: for each completing sequence, the local row of its last token (or -1 when
    another SP rank holds it); ``target_rows`` likewise for the positions whose prompt
    log-probs are wanted (``SeqStep.targets``), and ``targets`` the tokens they predict."""

    def __init__(self, plan: StepPlan, sp_rank: int, sp: int, block_size: int, ring_min_tokens: int,
                 device, paged_backend: str = "torch"):
        r, bs, lb = sp_rank, block_size, block_size * sp  # lb: tokens per logical block
        ids, pos, rows, slots, self.last_rows, self.target_rows, self.targets = [], [], [], [], [], [], []
        self.fresh, self.rings = [], []  # (offset, n); (offset, m, Shards, key slots, keys per rank)
        groups = defaultdict(list)  # n -> [(offset, SeqStep)] attended over the cache
        for s in plan.seqs:
            off, end = len(ids), s.start + s.n
            ring = sp > 1 and s.n >= ring_min_tokens
            if ring:
                m = -(-s.n // sp)
                mine = range(s.start + (r - s.start) % sp, s.start + m * sp, sp)
            else:
                mine = range(s.start, end)
            ids.extend(s.tokens[p - s.start] if p < end else 0 for p in mine)
            pos.extend(mine)
            for j, p in enumerate(mine):
                if p < end and p % sp == r:
                    rows.append(off + j)
                    slots.append(s.block_table[p // lb] * bs + p % lb // sp)
            def local_row(p: int) -> int:  # the row of position p here, -1 if another SP rank has it
                if ring:
                    return off + (p - mine.start) // sp if p % sp == r else -1
                return off + p - s.start if r == 0 else -1

            if s.completes:
                self.last_rows.append(local_row(end - 1))
            for j, t in enumerate(s.targets or ()):
                self.target_rows.append(local_row(s.start + j))
                self.targets.append(t)
            if ring:
                keys = len(range(0, end, sp))  # keys per rank (rank 0 holds the most)
                shards = Shards(tuple((range(s.start + (j - s.start) % sp, s.start + m * sp, sp),) for j in range(sp)),
                                tuple((range(j, j + keys * sp, sp),) for j in range(sp)))
                if s.start == 0:  # a prompt from position 0: the keys are this step's own (rows off..off+m)
                    self.rings.append((off, m, shards, None, keys))
                else:  # the keys this rank stores, cached prefix included
                    local = torch.arange(len(range(r, end, sp)), device=device)
                    table = torch.tensor(s.block_table, dtype=torch.long, device=device)
                    self.rings.append((off, m, shards, table[local // bs] * bs + local % bs, keys))
            elif s.start == 0:  # every rank computes the whole prompt: it attends to it directly
                self.fresh.append((off, s.n))
            else:
                groups[s.n].append((off, s))
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (T,)
        self.positions = torch.tensor(pos, dtype=torch.long, device=device)  # (T,)
        self.all_written = len(rows) == len(ids)
        self.write_rows = torch.tensor(rows, dtype=torch.long, device=device)  # (W,)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)  # (W,)
        self.sp_rank, self.groups, self.varlen = r, [], None
        if paged_backend == "triton":  # kernels take positions and lengths as device tensors
            groups = self._kernel_batches(groups, sp, r, device)
        for n, members in groups.items():  # (n, rows (N*n,), block table (N, width), seq_lens (N,), PagedPlan or None)
            table = _padded_table([s.block_table for _, s in members], device)
            seq_lens = torch.tensor([len(range(r, s.start + n, sp)) if paged_backend == "triton" else s.start + n
                                     for _, s in members], dtype=torch.int32, device=device)
            rows_g = torch.tensor([o + j for o, _ in members for j in range(n)], device=device)  # (N*n,)
            if paged_backend == "triton":  # one token each: flash-decoding over the keys this rank stores
                plan_g = None
            elif sp > 1:  # keys this rank stores that each query sees: positions r, r+sp, ... <= its own
                p = torch.tensor([s.start for _, s in members], device=device)[:, None] + torch.arange(n, device=device)
                plan_g = PagedPlan(table, None, n, bs, limits=torch.div(p - r, sp, rounding_mode="floor") + 1)
            else:  # the batched torch backend: gather indices and mask once per step, not per layer
                plan_g = PagedPlan(table, seq_lens, n, bs) if paged_backend == "torch" else None
            self.groups.append((n, rows_g, table, seq_lens, plan_g))

    def _kernel_batches(self, groups, sp: int, r: int, device):
        """Sequences with several new tokens (later chunks, prefix-continued prompts) become one
        varlen batch for ``paged_prefill`` (``self.varlen``: rows (R,), block table (M, width),
        cu_seqlens_q (M + 1,), keys stored here (M,), first query positions (M,), max tokens);
        the one-token groups (decode) are returned for the decode kernel."""
        members = [m for n, ms in groups.items() if n > 1 for m in ms]
        if members:
            n_of = [s.n for _, s in members]
            self.varlen = (torch.tensor([o + j for o, s in members for j in range(s.n)], device=device),
                           _padded_table([s.block_table for _, s in members], device),
                           torch.tensor([0] + list(accumulate(n_of)), dtype=torch.int32, device=device),
                           torch.tensor([len(range(r, s.start + s.n, sp)) for _, s in members], dtype=torch.int32,
                                        device=device),
                           torch.tensor([s.start for _, s in members], dtype=torch.int32, device=device), max(n_of))
        return {n: ms for n, ms in groups.items() if n == 1}


class StepContext:
    """The model's ``ctx``: ``attend(layer, q, k, v)`` writes the step's K/V into this rank's
    cache and returns the exact attention output of its query rows."""

    def __init__(self, kv: KVCache, step: LocalStep, first_layer: int, sp: int, comm: Optional[RingComm] = None,
                 paged_backend: str = "torch", attn_backend: str = "auto", timeout: Optional[timedelta] = None):
        self.kv, self.step, self.first_layer, self.sp, self.comm = kv, step, first_layer, sp, comm
        self.paged_backend, self.attn_backend, self.timeout = paged_backend, attn_backend, timeout

    def attend(self, layer: int, q, k, v):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D)
        st, li, kv = self.step, layer - self.first_layer, self.kv
        if st.all_written:
            kv.write(li, k, v, st.write_slots)
        elif st.write_rows.numel():
            kv.write(li, k.index_select(0, st.write_rows), v.index_select(0, st.write_rows), st.write_slots)
        out = torch.empty_like(q)
        for off, n in st.fresh:  # a prompt from position 0 attends its own (unquantized) K/V
            o, _ = attention(q[None, off:off + n], k[None, off:off + n], v[None, off:off + n], causal=True,
                             backend=self.attn_backend)
            out[off:off + n] = o[0]
        cache = (kv.k(li), kv.v(li), kv.k_scale(li), kv.v_scale(li))
        qc = self._rotate(q, kv.rot)  # cached keys live in the quantized format's rotated space
        if self.sp == 1:
            for n, rows, table, seq_lens, plan in st.groups:
                qg = qc.index_select(0, rows).view(-1, n, *q.shape[1:])  # (N, n, H, D)
                if plan is not None:
                    o = paged_attention_planned(qg, cache[0], cache[1], plan, k_scale=cache[2], v_scale=cache[3])
                else:
                    o, _ = paged_attention(qg, cache[0], cache[1], table, seq_lens, backend=self.paged_backend,
                                           k_scale=cache[2], v_scale=cache[3])
                out[rows] = self._rotate(o.reshape(-1, *q.shape[1:]), kv.rot, back=True)
            if st.varlen is not None:
                o, _ = self._varlen(qc, cache)
                out[st.varlen[0]] = self._rotate(o, kv.rot, back=True)
        elif st.groups or st.varlen is not None:
            self._replicated(qc, cache, out)
        for off, m, shards, key_slots, keys in st.rings:
            if key_slots is None:  # its own new K/V (unquantized, like a fresh prompt on one rank)
                o, _ = ring_attention_shards(q[None, off:off + m], k[None, off:off + m], v[None, off:off + m],
                                             shards, causal=True, comm=self.comm, backend=self.attn_backend)
                out[off:off + m] = o[0]
            else:
                out[off:off + m] = self._rotate(self._ring(qc[off:off + m], cache, shards, key_slots, keys), kv.rot,
                                                back=True)
        return out

    @staticmethod
    def _rotate(x, rot, back: bool = False):
        """``x (..., D)`` into (or ``back`` out of) the rotated space; identity without rotation."""
        if rot is None:
            return x
        return (x.float() @ (rot.T if back else rot)).to(x.dtype)

    def _varlen(self, q, cache):
        """The step's multi-token rows over this rank's keys in one ``paged_prefill`` call:
        ``(out (R, H, D), lse (H, R))``."""
        rows, table, cu, lens, start, max_q = self.step.varlen
        return paged_prefill(q.index_select(0, rows), cache[0], cache[1], table, cu, lens, max_seqlen_q=max_q,
                             q_start=start, k_scale=cache[2], v_scale=cache[3], sp=self.sp,
                             sp_rank=self.step.sp_rank, backend=self.paged_backend)

    def _replicated(self, q, cache, out) -> None:
        """Every replicated row over this rank's keys, merged across the SP group in one round."""
        rows, parts = [], []  # [(out (R_i, H, D), lse (R_i, H))]
        for n, r, table, seq_lens, plan in self.step.groups:
            qg = q.index_select(0, r).view(-1, n, *q.shape[1:])  # (N, n, H, D)
            if plan is None:  # the decode kernel: one token at the end sees every key stored here
                o, l = paged_attention(qg, cache[0], cache[1], table, seq_lens, causal=False,
                                       backend=self.paged_backend, k_scale=cache[2], v_scale=cache[3])
            else:
                o, l = paged_attention_lse(qg, cache[0], cache[1], plan, k_scale=cache[2], v_scale=cache[3])
            rows.append(r)
            parts.append((o.reshape(-1, *q.shape[1:]), l.transpose(1, 2).reshape(-1, q.shape[1])))
        if self.step.varlen is not None:
            o, l = self._varlen(q, cache)
            rows.append(self.step.varlen[0])
            parts.append((o, l.T))
        rows = torch.cat(rows)
        o = torch.cat([p[0] for p in parts])[None]  # (1, R, H, D)
        lse = torch.cat([p[1] for p in parts]).T[None]  # (1, H, R)
        merged, _ = merge_across(o, lse.contiguous(), self.comm.group, self.timeout, "SP attention merge")
        out[rows] = self._rotate(merged[0].to(out.dtype), self.kv.rot, back=True)

    def _ring(self, q, cache, shards: Shards, key_slots, keys: int):
        """A long chunk: ring attention over every key of the sequence this rank stores."""
        k_cache = cache[0]
        k = torch.zeros(2, keys, *k_cache.shape[2:], dtype=q.dtype, device=q.device)  # K, V; pad after
        for i in range(2):
            flat = as_bytes(cache[i]).reshape(-1, *k_cache.shape[2:]).index_select(0, key_slots).view(k_cache.dtype)
            if cache[2 + i] is not None:
                flat = dequantize(flat, cache[2 + i].reshape(-1, k_cache.shape[2]).index_select(0, key_slots), q.dtype)
            k[i, :key_slots.numel()] = flat  # (keys, Hkv, D)
        out, _ = ring_attention_shards(q[None], k[0][None], k[1][None], shards, causal=True, comm=self.comm,
                                       backend=self.attn_backend)
        return out[0]
