"""Rotary position embeddings from GLOBAL token positions (HF "rotate_half" convention)."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies ``(head_dim // 2,)`` float32, with llama3/linear scaling."""
    d = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return freq
    kind = s["rope_type"]
    if kind == "linear":
        return freq / float(s["factor"])
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        out = torch.where(wavelen > old / lo, freq / factor, freq)  # long wavelengths: scaled
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; use a config with rope_scaling type "
                     f"default, linear or llama3")


class Rotary(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions (T,) int -> cos, sin (T, 1, head_dim), computed in fp32
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, heads, D); cos/sin (T, 1, D)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
