"""ringkv: exact attention over sequences longer than one device holds."""

from .kernels import attention, attention_backward
from .sp import (LAYOUTS, RingAttention, RingTimeoutError, merge, merge_, positions, ring_attention, shard,
                 unshard)

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "ring_attention", "RingAttention", "RingTimeoutError",
           "LAYOUTS", "shard", "unshard", "positions", "merge", "merge_"]
