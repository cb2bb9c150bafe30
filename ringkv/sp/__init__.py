"""Sequence parallelism: the only package (with ``ringkv.parallel``) that communicates."""

from .allgather import allgather_attention
from .collectives import CommStats
from .comm import LocalComm, RingComm, RingTimeoutError
from .delta import gated_delta_rule, kda
from .layout import LAYOUTS, chunks, positions, shard, unshard, usp_chunks
from .recurrent import causal_conv1d, mamba2_scan, selective_scan
from .recurrent_heads import (
    choose_form,
    heads_divide,
    heads_gated_delta_rule,
    heads_kda,
    heads_mamba2_scan,
    heads_selective_scan,
    layer_bytes,
)
from .ring import AutoWire, RingAttention, RingStats, auto_decisions, forget_auto, ring_attention
from .ulysses import ulysses_attention
from .usp import sp_groups, usp_attention

__all__ = [
    "LocalComm",
    "RingComm",
    "RingTimeoutError",
    "LAYOUTS",
    "chunks",
    "positions",
    "shard",
    "unshard",
    "usp_chunks",
    "RingAttention",
    "RingStats",
    "AutoWire",
    "auto_decisions",
    "forget_auto",
    "ring_attention",
    "ulysses_attention",
    "usp_attention",
    "allgather_attention",
    "sp_groups",
    "CommStats",
    "gated_delta_rule",
    "kda",
    "causal_conv1d",
    "mamba2_scan",
    "selective_scan",
    "heads_gated_delta_rule",
    "heads_kda",
    "heads_mamba2_scan",
    "heads_selective_scan",
    "heads_divide",
    "layer_bytes",
    "choose_form",
]
