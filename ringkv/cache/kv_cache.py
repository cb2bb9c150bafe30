"""Paged KV storage: per layer ``k``/``v`` of shape ``(num_blocks, block_size, Hkv, D)``.

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block * block_size + offset`` (``slot_mapping``).
"""

from __future__ import annotations

from typing import Optional

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of one block over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
                 num_blocks: Optional[int] = None, memory_bytes: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("give the KV cache size as num_blocks or memory_bytes")
            num_blocks = int(memory_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache of {memory_bytes} bytes holds no block of {per_block} bytes "
                             f"(block_size={block_size}); give more memory or a smaller block_size")
        self.num_blocks, self.block_size = num_blocks, block_size
        # (layers, 2, num_blocks, block_size, Hkv, D); k = [l, 0], v = [l, 1]
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k/v (T, Hkv, D) into their slots (T,) of ``layer``."""
        kv = self.data[layer].view(2, -1, *k.shape[1:])  # (2, num_blocks * block_size, Hkv, D)
        kv[0].index_copy_(0, slot_mapping, k.to(kv.dtype))
        kv[1].index_copy_(0, slot_mapping, v.to(kv.dtype))


def slots(block_table, start: int, end: int, block_size: int) -> list:
    """Flat slots of tokens ``[start, end)`` of a sequence with this block table."""
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]
