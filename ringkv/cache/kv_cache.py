"""Paged KV storage: per layer ``k``/``v`` of shape ``(num_blocks, block_size, Hkv, D)``.

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block * block_size + offset`` (``slot_mapping``).
With a quantized ``kv_cache_dtype`` (``kernels/quant.py``) the values are one byte each and
``k_scale``/``v_scale`` ``(num_blocks, block_size, Hkv)`` fp16 sit beside them; readers
dequantize (``kernels.paged``) in the rotated space the format uses (``rot``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import paged_cpu
from ..kernels.paged_base import LayerCache
from ..kernels.quant import SCALE_DTYPE, QuantFormat, as_bytes, bytes_per_head, quantize, rotation


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quant: Optional[QuantFormat] = None,
) -> int:
    """K and V of one block over all layers (scales included)."""
    return 2 * num_layers * block_size * num_kv_heads * bytes_per_head(quant, head_dim, dtype)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        memory_bytes: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        quant: Optional[QuantFormat] = None,
    ):
        per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, quant)
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("give the KV cache size as num_blocks or memory_bytes")
            num_blocks = int(memory_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache of {memory_bytes} bytes holds no block of {per_block} bytes "
                f"(block_size={block_size}); give more memory or a smaller block_size"
            )
        self.num_blocks, self.block_size, self.quant = num_blocks, block_size, quant
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads)
        # (layers, 2, num_blocks, block_size, Hkv, D); k = [l, 0], v = [l, 1]
        self.data = torch.zeros(
            *shape, head_dim, dtype=quant.dtype if quant else dtype, device=device
        )
        self.scale = torch.zeros(shape, dtype=SCALE_DTYPE, device=device) if quant else None
        self.rot = rotation(head_dim, device) if quant is not None and quant.rotate else None
        # views made once (every layer of every step asks for them): each layer as the kernels
        # read it, and its K and V as rows (num_blocks * block_size, Hkv, D), where writes go
        sc = self.scale if quant else [(None, None)] * num_layers
        self._layers = [
            LayerCache(self.data[i, 0], self.data[i, 1], sc[i][0], sc[i][1])
            for i in range(num_layers)
        ]
        self._rows = [
            tuple(as_bytes(self.data[i]).view(2, -1, num_kv_heads, head_dim))
            for i in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (
            self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        )

    def layer(self, layer: int) -> LayerCache:
        """``layer``'s K/V (and scales) as the kernels take them."""
        return self._layers[layer]

    def k(self, layer: int) -> torch.Tensor:
        return self._layers[layer].k

    def v(self, layer: int) -> torch.Tensor:
        return self._layers[layer].v

    def k_scale(self, layer: int) -> Optional[torch.Tensor]:
        return self._layers[layer].k_scale

    def v_scale(self, layer: int) -> Optional[torch.Tensor]:
        return self._layers[layer].v_scale

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """k/v (T, Hkv, D) into their slots (T,) of ``layer`` (quantized on the way in)."""
        kv = self._rows[layer]  # K, V: (num_blocks * block_size, Hkv, D) each
        if self.quant is None:
            if paged_cpu.write(kv[0], kv[1], k, v, slot_mapping):  # float32 on the CPU: one C call
                return
            kv[0].index_copy_(0, slot_mapping, k.to(self.data.dtype))
            kv[1].index_copy_(0, slot_mapping, v.to(self.data.dtype))
            return
        sc = self.scale[layer].view(2, -1, k.shape[1])  # (2, slots, Hkv)
        for i, x in enumerate((k, v)):
            q, s = quantize(x, self.quant, self.rot)
            kv[i].index_copy_(0, slot_mapping, as_bytes(q))
            sc[i].index_copy_(0, slot_mapping, s)
