"""Paged KV cache: tensor storage (``KVCache``) and pure-Python bookkeeping (``BlockManager``)."""

from .block_manager import BlockManager
from .kv_cache import KVCache, bytes_per_block

__all__ = ["BlockManager", "KVCache", "bytes_per_block"]
