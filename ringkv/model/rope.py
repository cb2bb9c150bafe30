"""Rotary position embeddings from GLOBAL token positions (HF "rotate_half" convention).

A model has one RoPE, or two (Gemma 3: sliding layers use their own base, ``local_rope_theta``):
``Rotary.cos_sin`` returns both stacked, and each layer picks its own (``rope_index``). With a
``partial_rotary_factor`` below 1 (the Phi-3 family) only the first ``head_dim * factor``
channels of each head rotate.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    """Channels of a head that rotate (``head_dim`` unless ``partial_rotary_factor < 1``)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies ``(rotary_dim // 2,)`` float32, with llama3/linear scaling;
    ``local``: those of sliding layers (Gemma 3's ``local_rope_theta`` and its scaling)."""
    d = rotary_dim(cfg)
    theta = cfg.local_rope_theta if local and cfg.local_rope_theta is not None else cfg.rope_theta
    # a model built on the meta device computes it on the CPU (``materialize`` rebuilds the
    # rotary anyway): meta arithmetic runs torch's Python reference kernels, whose first call
    # imports torch._dynamo (loader.on_meta)
    meta = torch.get_default_device().type == "meta"
    pairs = torch.arange(0, d, 2, dtype=torch.int64, device="cpu" if meta else None)
    freq = 1.0 / (theta ** (pairs.float() / d))
    s = cfg.local_rope_scaling if local else cfg.rope_scaling
    if s is None:
        return freq
    kind = s["rope_type"]
    if kind == "linear":
        return freq / float(s["factor"])
    if kind == "llama3":
        factor, lo, hi = (
            float(s["factor"]),
            float(s["low_freq_factor"]),
            float(s["high_freq_factor"]),
        )
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        out = torch.where(wavelen > old / lo, freq / factor, freq)  # long wavelengths: scaled
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; use a config with rope_scaling type "
        f"default, linear or llama3"
    )


def rope_index(cfg: ModelConfig, layer: int) -> int:
    """Which of ``Rotary.cos_sin``'s RoPEs ``layer`` uses: 1 for a sliding layer of a model with a
    local RoPE (Gemma 3), else 0."""
    return int(cfg.local_rope_theta is not None and cfg.is_sliding(layer))


class Rotary(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        freqs = [inv_freq(cfg)]
        if cfg.local_rope_theta is not None:
            freqs.append(inv_freq(cfg, local=True))
        self.register_buffer(
            "inv_freq", torch.stack(freqs), persistent=False
        )  # (R, rotary_dim // 2)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions (T,) int -> cos, sin (R, T, 1, rotary_dim), computed in fp32; R: the model's
        # RoPEs
        freqs = (
            positions.to(self.inv_freq.device).float()[None, :, None] * self.inv_freq[:, None, :]
        )
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]
