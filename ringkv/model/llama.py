"""Llama-family decoder (Llama incl. Llama-3 RoPE scaling, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3
text, Phi-3). No parallel code.

Tokens of all sequences in a step are flattened: ``input_ids (T,)`` and ``positions (T,)``
(global positions, not assumed ``0..S-1``). Attention is one call site,
``ctx.attend(layer_idx, q, k, v, **kw) -> out`` with ``q (T, H, D)``, ``k/v (T, Hkv, D)``, so the
engine (paged KV cache) or a parallel runner can swap what attention means. ``kw`` holds what a
layer's attention needs beyond the defaults, and only that (Llama, Qwen2/3 and Mistral without a
window pass none): ``scale`` (Gemma's ``query_pre_attn_scalar ** -0.5``; default ``D ** -0.5``),
``softcap`` (Gemma 2: scores ``c * tanh(s / c)``) and ``window`` (a sliding layer: a query at
position ``p`` sees keys ``p - window .. p``; transformers' ``sliding_window`` minus one). Without a
``ctx`` the tokens are one causal sequence (``DenseContext``).

What the families add to Llama's layer, each a field of ``ModelConfig``: Gemma's RMSNorm scales by
``1 + weight``, its layers norm the attention output and the MLP's input and output too
(``sandwich_norms``), its MLP is GELU-tanh gated, its embeddings are scaled by ``sqrt(hidden)``
(applied at layer 0's input: a tensor-parallel engine replaces the embedding module) and its
logits may be soft-capped (``final_softcap``); Gemma 3 and Qwen3 norm each head's q and k; Gemma 3's
sliding layers use their own RoPE base; Phi-3 rotates part of each head (``partial_rotary_factor``)
and fuses q/k/v and gate/up in its checkpoint (``loader`` splits them; the model holds them apart).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import attention
from ..kernels.mask import NO_WINDOW
from ..kernels.pointwise import rms_norm, rope, silu_mul
from .config import ModelConfig
from .rope import Rotary, rope_index


class DenseContext:
    """Attention of one sequence over itself (no cache): causal on the given positions."""

    def __init__(self, positions: torch.Tensor, backend: str = "auto"):
        self.positions, self.backend = positions, backend

    def attend(
        self,
        layer: int,
        q,
        k,
        v,
        *,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D)
        return self.over(q, k, v, self.positions, scale=scale, softcap=softcap, window=window)

    def over(self, q, k, v, k_positions, *, scale=None, softcap=None, window: int = -1):
        """``q (T, H, D)`` at ``self.positions`` over ``k``/``v`` ``(S, Hkv, D)`` at
        ``k_positions (S,)``, causal on the positions -> ``(T, H, D)``."""
        out, _ = attention(
            q[None],
            k[None],
            v[None],
            scale=scale,
            causal=True,
            q_positions=self.positions,
            k_positions=k_positions,
            window=(window, 0) if window >= 0 else NO_WINDOW,
            backend=self.backend,
            softcap=softcap,
        )
        return out[0]

    def recur(self, layer: int, fn, u: torch.Tensor, shapes):
        """A recurrent layer's sequential part over the sequence from the zero state: ``u (T, F)``
        -> ``fn(u[None], zero states)``'s output ``(T, F')`` (``ringkv.model.hybrid``)."""
        states = [torch.zeros((1, *s), dtype=torch.float32, device=u.device) for s in shapes]
        y, _ = fn(u[None], states)
        return y[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x):
        # fp32 statistics like HF, result cast back to the input dtype before the weight; Gemma
        # (plus_one): scaled by (1 + weight) in fp32, then cast
        return rms_norm(x, self.weight, self.eps, self.plus_one)


class Attention(nn.Module):
    # the checkpoint's names of the output projection and the q/k norms (LFM2 names them otherwise)
    OUT, QK_NORMS = "o_proj", ("q_norm", "k_norm")

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate  # Qwen3.5: each head's q rows, then its gate's
        q_rows = self.h * self.d * (2 if self.gated else 1)
        self.q_proj = nn.Linear(cfg.hidden_size, q_rows, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        setattr(self, self.OUT, nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3, Gemma 3: one (D,) norm shared by the heads, so TP leaves it whole
            for name in self.QK_NORMS:
                setattr(self, name, RMSNorm(self.d, cfg.rms_norm_eps, cfg.norm_plus_one))
        self.rope = rope_index(cfg, layer_idx) if cfg.use_rope else None
        kw = dict(scale=cfg.attn_scale, softcap=cfg.attn_softcap, window=cfg.window(layer_idx))
        self.attn_kw = {
            k: v for k, v in kw.items() if v not in (None, -1)
        }  # only what is not the default

    def forward(self, x, cos, sin, ctx):
        # x (T, hidden); cos/sin (R, T, 1, rotary_dim): the model's RoPEs, this layer's is
        # [self.rope]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, -1)  # (T, H, D), or (T, H, 2D) with the gate
        if self.gated:
            q, gate = q.chunk(2, dim=-1)  # (T, H, D) each
        k = self.k_proj(x).view(t, self.hkv, self.d)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = (getattr(self, n)(y) for n, y in zip(self.QK_NORMS, (q, k)))
        if self.rope is not None:
            cos, sin = cos[self.rope], sin[self.rope]
            q, k = rope(q, k, cos, sin)
        out = ctx.attend(
            self.layer_idx, q, k, v, **self.attn_kw
        )  # (T, H, D): the one attention call site
        out = out.reshape(t, self.h * self.d)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(t, self.h * self.d))
        return getattr(self, self.OUT)(out)  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        b, i = cfg.mlp_bias, intermediate_size or cfg.intermediate_size  # (an expert's own)
        self.gate_proj = nn.Linear(cfg.hidden_size, i, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, i, bias=b)
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=b)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(g, approximate="tanh") * u if self.gelu else silu_mul(g, u))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        h, eps, one = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one
        self.input_layernorm = RMSNorm(h, eps, one)
        self.post_attention_layernorm = RMSNorm(
            h, eps, one
        )  # Gemma: on attention's output; else the MLP's input
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, one)
            self.post_feedforward_layernorm = RMSNorm(h, eps, one)
        # Gemma's embedding scale, at the input of layer 0 (the stage that holds the embedding
        # runs it next): a tensor-parallel engine swaps the embedding module for its own
        self.embed_scale = cfg.embed_scale if layer_idx == 0 else None

    def forward(self, x, cos, sin, ctx):
        if self.embed_scale is not None:  # as HF: a float32 scalar cast to the embeddings' dtype
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32, device=x.device).to(x.dtype)
        if self.sandwich:
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, ctx)
            )
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, new_layer=DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(new_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.rotary = Rotary(cfg)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF's ``*ForCausalLM`` so checkpoints load without renaming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, self.new_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def new_layer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``, called as ``layer(x, cos, sin, ctx)`` (a subclass builds others)."""
        return DecoderLayer(cfg, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None, ctx=None):
        """input_ids (T,), positions (T,) -> hidden states (T, hidden) after the final norm."""
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        if ctx is None:
            ctx = DenseContext(positions)
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)  # (R, T, 1, rotary_dim)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) in float32 (a vocabulary shard's columns under
        TP: the soft-cap is elementwise, so it commutes with the gather)."""
        x = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            x = x / self.config.logits_scaling
        c = self.config.final_softcap
        if c is not None:  # Gemma: c * tanh(logits / c), in the head's dtype like HF
            x = torch.tanh(x / c) * c
        return x.float()
