"""Tensor parallelism applied to a ``LlamaForCausalLM`` from outside (the model file stays a
single-device model): attention split by heads, the MLP by its hidden units, the embedding
and LM head by vocabulary rows.

- q/k/v and gate/up are column-parallel: a plain ``nn.Linear`` holding this rank's output
  rows; no communication.
- o_proj and down_proj are row-parallel (``RowParallelLinear``): this rank's input columns,
  one all-reduce, then the bias.
- KV heads: ``Hkv / tp`` per rank; when ``tp > Hkv`` (and ``tp % Hkv == 0``) each rank holds
  the one KV head its query heads read (replicated on ``tp / Hkv`` ranks).
- ``VocabParallelEmbedding`` looks up this rank's vocabulary rows and all-reduces; the LM
  head is an ``nn.Linear`` over the same rows (tied weights stay tied) and the driver-side
  gather (``gather_vocab``) assembles full logits where sampling happens.

``apply_tp`` works on a model built on the meta device and returns, per parameter, the
slice of the checkpoint tensor it holds, for ``model.loader.materialize``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..model.config import ModelConfig
from ..sp.collectives import all_gather, all_reduce_


def split(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``range(n)`` cut into ``parts`` nearly equal pieces (sizes differ by <= 1)."""
    return range(i * n // parts, (i + 1) * n // parts)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """``ValueError`` naming the fix when the model cannot be split over ``tp`` ranks."""
    h, hkv = cfg.num_heads, cfg.num_kv_heads
    ok = [d for d in range(1, h + 1) if h % d == 0 and (hkv % d == 0 if d <= hkv else d % hkv == 0)]
    if h % tp:
        raise ValueError(f"tp={tp} does not divide the model's {h} attention heads; use tp in {ok}")
    if hkv % tp if tp <= hkv else tp % hkv:
        raise ValueError(
            f"tp={tp} cannot split the model's {hkv} KV heads (need kv_heads % tp == 0, or "
            f"tp % kv_heads == 0 to replicate them); use tp in {ok}"
        )
    if cfg.vocab_size < tp or cfg.intermediate_size < tp:
        raise ValueError(
            f"tp={tp} exceeds the vocabulary ({cfg.vocab_size}) or MLP width "
            f"({cfg.intermediate_size}); use tp in {ok}"
        )


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    return max(1, cfg.num_kv_heads // tp)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: ``x`` holds this rank's input features."""

    def __init__(
        self, in_local: int, out_features: int, bias: bool, group, timeout: Optional[timedelta]
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group, self.timeout = group, timeout

    def forward(self, x):
        y = all_reduce_(
            F.linear(x, self.weight), self.group, self.timeout, "tensor-parallel all-reduce"
        )
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab`` of the embedding; tokens outside them contribute zeros to the all-reduce."""

    def __init__(self, vocab: range, dim: int, group, timeout: Optional[timedelta]):
        super().__init__()
        self.vocab, self.group, self.timeout = vocab, group, timeout
        self.weight = nn.Parameter(torch.empty(len(vocab), dim))

    def forward(self, ids):
        # ids (T,) -> (T, dim)
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        x = F.embedding((ids - self.vocab.start).clamp(0, len(self.vocab) - 1), self.weight)
        x = x * mine[:, None].to(x.dtype)
        return all_reduce_(x, self.group, self.timeout, "vocab-parallel embedding")


def apply_tp(
    model, cfg: ModelConfig, rank: int, tp: int, group, timeout: Optional[timedelta] = None
) -> Dict:
    """Reshape ``model`` (on the meta device) into TP rank ``rank``'s shard; return the
    checkpoint slice ``{param name: (dim, start, stop)}`` each sharded parameter holds."""
    check_tp(cfg, tp)
    if tp == 1:
        return {}
    d, hidden = cfg.head_dim, cfg.hidden_size
    heads = split(cfg.num_heads, tp, rank)
    if tp <= cfg.num_kv_heads:
        kv = split(cfg.num_kv_heads, tp, rank)
    else:
        kv = range(
            rank * cfg.num_kv_heads // tp, rank * cfg.num_kv_heads // tp + 1
        )  # the head its queries read
    mlp = split(cfg.intermediate_size, tp, rank)
    vocab = split(cfg.vocab_size, tp, rank)
    rows_q, rows_kv = range(heads.start * d, heads.stop * d), range(kv.start * d, kv.stop * d)
    slices: Dict[str, tuple] = {}

    def column(prefix: str, rows: range, bias: bool) -> nn.Linear:
        slices[f"{prefix}.weight"] = (0, rows.start, rows.stop)
        if bias:
            slices[f"{prefix}.bias"] = (0, rows.start, rows.stop)
        return nn.Linear(hidden, len(rows), bias=bias)

    def row(prefix: str, cols: range, out: int, bias: bool) -> RowParallelLinear:
        slices[f"{prefix}.weight"] = (1, cols.start, cols.stop)
        return RowParallelLinear(len(cols), out, bias, group, timeout)

    for name, layer in _layers(model):
        p = f"model.layers.{name}"
        a = layer.self_attn
        a.q_proj = column(f"{p}.self_attn.q_proj", rows_q, cfg.qkv_bias)
        a.k_proj = column(f"{p}.self_attn.k_proj", rows_kv, cfg.qkv_bias)
        a.v_proj = column(f"{p}.self_attn.v_proj", rows_kv, cfg.qkv_bias)
        a.o_proj = row(f"{p}.self_attn.o_proj", rows_q, hidden, cfg.o_bias)
        a.h, a.hkv = len(heads), len(kv)
        m = layer.mlp
        m.gate_proj = column(f"{p}.mlp.gate_proj", mlp, cfg.mlp_bias)
        m.up_proj = column(f"{p}.mlp.up_proj", mlp, cfg.mlp_bias)
        m.down_proj = row(f"{p}.mlp.down_proj", mlp, hidden, cfg.mlp_bias)
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, group, timeout)
        slices["model.embed_tokens.weight"] = (0, vocab.start, vocab.stop)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, len(vocab), bias=False)
        slices["lm_head.weight"] = (0, vocab.start, vocab.stop)
    return slices


def _layers(model):
    layers = model.model.layers
    return (
        layers.items()
        if isinstance(layers, nn.ModuleDict)
        else ((str(i), layer) for i, layer in enumerate(layers))
    )


def gather_vocab(
    logits: torch.Tensor, cfg: ModelConfig, tp: int, group, timeout=None
) -> torch.Tensor:
    """Full logits ``(M, vocab)`` from each TP rank's ``(M, vocab_rank)`` columns (every rank gets
    them)."""
    if tp == 1:
        return logits
    width = -(-cfg.vocab_size // tp)
    padded = F.pad(logits, (0, width - logits.shape[1]))  # equal sizes for the all-gather
    parts = all_gather(padded, group, timeout, "logits gather")
    return torch.cat(
        [p[:, : len(split(cfg.vocab_size, tp, r))] for r, p in enumerate(parts)], dim=1
    )
