"""Llama-family decoder (Llama incl. Llama-3 RoPE scaling, Qwen2, Qwen3, Mistral). No parallel code.

Tokens of all sequences in a step are flattened: ``input_ids (T,)`` and ``positions (T,)``
(global positions, not assumed ``0..S-1``). Attention is one call site,
``ctx.attend(layer_idx, q, k, v) -> out`` with ``q (T, H, D)``, ``k/v (T, Hkv, D)``, so the
engine (paged KV cache) or a parallel runner can swap what attention means. Without a
``ctx`` the tokens are one causal sequence (``DenseContext``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import attention
from .config import ModelConfig
from .rope import Rotary, apply_rotary


class DenseContext:
    """Attention of one sequence over itself (no cache): causal on the given positions."""

    def __init__(self, positions: torch.Tensor, backend: str = "auto"):
        self.positions, self.backend = positions, backend

    def attend(self, layer: int, q, k, v):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D)
        out, _ = attention(q[None], k[None], v[None], causal=True, q_positions=self.positions,
                           k_positions=self.positions, backend=self.backend)
        return out[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # fp32 statistics like HF, result cast back to the input dtype before the weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: one (D,) norm shared by the heads, so TP leaves it whole
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)  # (T, H, D)
        k = self.k_proj(x).view(t, self.hkv, self.d)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v)  # (T, H, D): the one attention call site
        return self.o_proj(out.reshape(t, self.h * self.d))  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF's ``*ForCausalLM`` so checkpoints load without renaming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None, ctx=None):
        """input_ids (T,), positions (T,) -> hidden states (T, hidden) after the final norm."""
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        if ctx is None:
            ctx = DenseContext(positions)
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)  # (T, 1, D)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) in float32."""
        return self.lm_head(hidden).float()
