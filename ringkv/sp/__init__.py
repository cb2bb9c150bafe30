"""Sequence parallelism: the only package (with ``ringkv.parallel``) that communicates."""

from .comm import LocalComm, RingComm, RingTimeoutError
from .layout import LAYOUTS, chunks, positions, shard, unshard
from .merge import merge, merge_
from .ring import RingAttention, RingStats, ring_attention

__all__ = ["LocalComm", "RingComm", "RingTimeoutError", "LAYOUTS", "chunks", "positions", "shard", "unshard",
           "merge", "merge_", "RingAttention", "RingStats", "ring_attention"]
