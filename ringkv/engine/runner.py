"""Runs one scheduled step through the model over the paged KV cache, and samples.

``PagedContext`` is the model's attention call site for a step (``attend(layer, q, k, v)``):
it writes the step's K/V into their slots, then

- a sequence starting at position 0 (a fresh prompt, or its first chunk) attends to its own
  new K/V with ``kernels.attention`` (causal, global positions);
- every other sequence (decode, later chunks, prompts continuing a cached prefix) attends
  over the cache with ``kernels.paged.paged_attention``, one call per group of sequences
  with the same number of new tokens (all decodes together). With the batched ``"torch"``
  backend (CPU default) the gather indices and masks are planned once per step
  (``PagedPlan``) and reused by every layer.

A parallel runner swaps this object, not the model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import List, Sequence

import torch

from ..cache.kv_cache import KVCache, slots
from ..kernels import attention
from ..kernels.paged import paged_attention
from ..kernels.paged_torch import PagedPlan, paged_attention_planned  # also registers backend "torch"
from .scheduler import Scheduled


class PagedContext:
    def __init__(self, kv: KVCache, batch: Sequence[Scheduled], device, paged_backend: str = "auto",
                 attn_backend: str = "auto"):
        self.kv, self.paged_backend, self.attn_backend = kv, paged_backend, attn_backend
        bs = kv.block_size
        slot_mapping = []
        self.fresh = []  # (token offset, n) of sequences computing from position 0
        groups = defaultdict(list)  # n -> [(token offset, Scheduled)]
        off = 0
        for s in batch:
            table = s.seq.block_table
            slot_mapping.extend(slots(table, s.start, s.start + s.n, bs))
            if s.start == 0:
                self.fresh.append((off, s.n))
            else:
                groups[s.n].append((off, s))
            off += s.n
        self.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=device)  # (T,)
        self.groups = []
        for n, members in groups.items():
            width = max(len(s.seq.block_table) for _, s in members)
            table = torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table))
                                  for _, s in members], dtype=torch.int32, device=device)  # (N, width)
            seq_lens = torch.tensor([s.start + n for _, s in members], dtype=torch.int32, device=device)
            rows = torch.tensor([o + j for o, _ in members for j in range(n)], device=device)  # (N*n,)
            # the batched torch backend: gather indices and mask once per step, not per layer
            plan = PagedPlan(table, seq_lens, n, bs) if paged_backend == "torch" else None
            self.groups.append((n, rows, table, seq_lens, plan))

    def attend(self, layer: int, q, k, v):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D)
        self.kv.write(layer, k, v, self.slot_mapping)
        out = torch.empty_like(q)
        for off, n in self.fresh:
            o, _ = attention(q[None, off:off + n], k[None, off:off + n], v[None, off:off + n], causal=True,
                             backend=self.attn_backend)
            out[off:off + n] = o[0]
        for n, rows, table, seq_lens, plan in self.groups:
            qg = q.index_select(0, rows).view(-1, n, *q.shape[1:])  # (N, n, H, D)
            if plan is not None:
                o = paged_attention_planned(qg, self.kv.k(layer), self.kv.v(layer), plan)
            else:
                o, _ = paged_attention(qg, self.kv.k(layer), self.kv.v(layer), table, seq_lens,
                                       backend=self.paged_backend)
            out[rows] = o.reshape(-1, *q.shape[1:])
        return out


class Runner:
    def __init__(self, model, kv: KVCache, device, paged_backend: str = "auto"):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        if paged_backend == "auto" and self.device.type == "cpu":
            paged_backend = "torch"  # the per-sequence reference loop is far slower on CPU
        self.paged_backend = paged_backend

    @torch.inference_mode()
    def run(self, batch: List[Scheduled]) -> torch.Tensor:
        """Compute the step's tokens; return fp32 logits ``(M, vocab)`` for the sequences whose
        step ``completes`` (in batch order)."""
        ids, pos, last = [], [], []
        off = 0
        for s in batch:
            ids.extend(s.seq.token_ids[s.start:s.start + s.n])
            pos.extend(range(s.start, s.start + s.n))
            off += s.n
            if s.completes:
                last.append(off - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # (T,)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)  # (T,)
        ctx = PagedContext(self.kv, batch, self.device, self.paged_backend)
        hidden = self.model(input_ids, positions, ctx)  # (T, hidden)
        if not last:
            return hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(last, device=self.device)])  # (M, vocab)


def sample(logits: torch.Tensor, seqs) -> List[int]:
    """Next token per row of ``logits (M, vocab)`` fp32 under each sequence's params."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature == 0 or p.top_k == 1:
            out.append(greedy[i])
            continue
        l = logits[i].float().cpu() / p.temperature
        if p.top_k > 0 and p.top_k < l.numel():
            kth = torch.topk(l, p.top_k).values[-1]
            l = l.masked_fill(l < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_l, order = torch.sort(l, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
            l = l.scatter(0, order, sorted_l.masked_fill(drop, float("-inf")))
        probs = torch.softmax(l, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out
