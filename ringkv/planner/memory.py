"""Memory per GPU with the engine's own formulas: layers per PP stage (``stage_sizes``), a
layer's parameters on a TP rank (``layer_params``), weight bytes and K/V bytes per token of
each stage's ranks (``stage_weight_bytes``, ``stage_kv_bytes_per_token``), the byte sizes of
the dtypes (``DTYPES``)."""

from __future__ import annotations

from typing import Dict, List

import torch

from ..model.config import ModelConfig
from ..parallel.tp import check_tp, kv_heads_per_rank
from ..parallel.worker import EngineShape

DTYPES = {
    "float32": (torch.float32, 4),
    "bfloat16": (torch.bfloat16, 2),
    "float16": (torch.float16, 2),
    "fp8": (torch.bfloat16, 1),
}  # fp8: FP8 weights and matmuls, bf16 activations and K/V


def stage_sizes(cfg: ModelConfig, pp: int) -> List[int]:
    """Layers per PP stage, exactly as the engine splits them (decode-balanced, LM head counted)."""
    return EngineShape(pp=pp).stage_sizes(cfg)


def layer_params(cfg: ModelConfig, tp: int) -> Dict[str, int]:
    """Parameters of one decoder layer on a TP rank: ``linear`` (the matmul weights a token
    multiplies) and ``total`` (with norms and biases). Split as ``apply_tp`` splits them."""
    d, h = cfg.head_dim, cfg.hidden_size
    hq, hkv, inter = (
        cfg.num_heads // tp,
        kv_heads_per_rank(cfg, tp),
        -(-cfg.intermediate_size // tp),
    )
    linear = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter
    bias = (
        (hq * d + 2 * hkv * d if cfg.qkv_bias else 0)
        + (h if cfg.o_bias else 0)
        + (2 * inter + h if cfg.mlp_bias else 0)
    )
    return dict(linear=linear, total=linear + bias + 2 * h)


def stage_weight_bytes(cfg: ModelConfig, tp: int, pp: int, dtype: str = "bfloat16") -> List[int]:
    """Weight bytes of one rank of each PP stage (the engine's ``per_rank[i]["weight_bytes"]``):
    its layers' TP slices, the vocabulary slice of the embedding on the first stage and of the
    LM head on the last (one tensor when tied on a single stage), the final norm."""
    check_tp(cfg, tp)
    sizes, h = stage_sizes(cfg, pp), cfg.hidden_size
    vocab = -(-cfg.vocab_size // tp)
    per_layer = layer_params(cfg, tp)["total"]
    out = []
    for i, n in enumerate(sizes):
        first, last = i == 0, i == len(sizes) - 1
        params = n * per_layer + (vocab * h if first else 0)
        if last:
            params += h + (0 if cfg.tie_word_embeddings and first else vocab * h)
        out.append(params * DTYPES[dtype][1])
    return out


def stage_kv_bytes_per_token(
    cfg: ModelConfig, tp: int, pp: int, kv_cache_dtype: str = "auto", dtype: str = "bfloat16"
) -> List[int]:
    """K/V bytes of one token on a rank of each stage: ``EngineShape.bytes_per_token``, the
    seed's ``2 x layers_on_stage x kv_heads_on_rank x head_dim x bytes`` (+ quantization scales)."""
    shape = EngineShape(pp=pp, tp=tp, kv_cache_dtype=kv_cache_dtype)
    return [shape.bytes_per_token(cfg, s, DTYPES[dtype][0]) for s in range(pp)]


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"
