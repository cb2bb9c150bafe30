"""Sampling on the driver: one token per row of fp32 logits under each sequence's params."""

from __future__ import annotations

from typing import List

import torch


def greedy(params) -> bool:
    return params.temperature == 0 or params.top_k == 1


def sample(logits: torch.Tensor, seqs) -> List[int]:
    """Next token per row of ``logits (M, vocab)`` fp32 under each sequence's params."""
    best = logits.argmax(dim=-1).tolist()
    out = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if greedy(p):
            out.append(best[i])
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
