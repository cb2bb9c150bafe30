"""Hybrid decoders: layers that are attention or a recurrent mixer (``mixers.py``), for LFM2
(short convolutions), Qwen3.5 text (gated DeltaNet, gated attention), Qwen3-Next (Qwen3.5's layers
with mixture-of-experts MLPs), Bamba (Mamba2), Granite 4 hybrid (Mamba2, MoE and a shared MLP,
Granite's multipliers), Nemotron-H (separate Mamba2, attention and MLP blocks) and Falcon-H1
(attention and Mamba2 side by side in every layer, muP multipliers). No parallel code.

``HybridForCausalLM`` is a ``LlamaForCausalLM`` (the same attributes, ``forward`` and ``logits``;
each layer is called ``layer(x, cos, sin, ctx)``) whose layers come from the family's table
(``FAMILIES``): the checkpoint's module names of each part, so parameters keep transformers'
names. Only the model-level parts the engine reaches by name (``model.embed_tokens``,
``model.norm``) are renamed from their checkpoint names (``config.CHECKPOINT_RENAMES``).

Attention layers attend through ``ctx.attend`` as in ``llama.py``; recurrent ones hand their
sequential part to ``ctx.recur(layer_idx, scan, u, state_shapes)`` (see ``mixers.py`` for the
contract). ``state_layers`` lists the state shapes of the layers a (pipeline-cut) model holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import HYBRID, ModelConfig
from .llama import MLP, Attention, DenseContext, LlamaForCausalLM, RMSNorm
from .mixers import FalconMamba2Mixer, FusedGatedDeltaNet, GatedDeltaNet, Mamba2Mixer, ShortConv


class Lfm2Attention(Attention):
    """LFM2's attention: Llama's with per-head q/k norms, under its checkpoint's names."""

    OUT, QK_NORMS = "out_proj", ("q_layernorm", "k_layernorm")


class Lfm2MLP(nn.Module):
    """LFM2's SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.w1, self.w3 = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Relu2MLP(nn.Module):
    """Nemotron-H's MLP: ``down(relu(up x) ** 2)``, ungated."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.up_proj, self.down_proj = nn.Linear(h, i, bias=b), nn.Linear(i, h, bias=b)

    def forward(self, x):
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class FalconMLP(MLP):
    """Falcon-H1's gated MLP with its muP multipliers: ``down(up x * act(gate x * g)) * d``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.gate_multiplier, self.down_multiplier = cfg.mup.mlp

    def forward(self, x):
        g = self.gate_proj(x) * self.gate_multiplier
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(self.up_proj(x) * g) * self.down_multiplier


def routed(x, chosen, weights, expert: Callable) -> torch.Tensor:
    """Each row's chosen experts, weighed: ``x (T, hidden)``, ``chosen``/``weights`` ``(T,
    top_k)``, ``expert(e, rows (n, hidden)) -> (n, hidden)`` -> ``(T, hidden)``, every expert
    run once on the rows that chose it."""
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert(e, x[rows]) * weights[rows, slot, None])
    return out


class SparseMoE(nn.Module):
    """Qwen3-Next's MoE MLP: the router's softmax top-k (renormalised if ``norm_topk_prob``)
    weighs its experts' gated MLPs; a shared expert, gated by ``sigmoid(shared_expert_gate x)``,
    is added. Experts are held one module each (``experts.<e>.gate_proj``: the checkpoints'
    names)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg, moe.intermediate_size) for _ in range(moe.experts))
        self.shared_expert = MLP(cfg, moe.shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        # x (T, hidden) -> (T, hidden)
        logits = self.gate(x)  # (T, experts)
        weights, chosen = F.softmax(logits, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)  # (T, top_k)
        out = routed(x, chosen, weights, lambda e, rows: self.experts[e](rows))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class FusedExperts(nn.Module):
    """Experts' gated MLPs fused as transformers holds them: ``gate_up_proj (E, 2I, H)`` (gate's
    rows, then up's) and ``down_proj (E, H, I)``."""

    def __init__(self, experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, e: int, x):
        # x (n, hidden) -> (n, hidden): expert e
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class GraniteMoE(nn.Module):
    """Granite 4 hybrid's MoE: the router's top-k logits, softmaxed, weigh the experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.top_k = moe.top_k
        self.router = nn.Linear(h, moe.experts, bias=False)
        self.experts = FusedExperts(moe.experts, h, moe.intermediate_size)

    def forward(self, x):
        # x (T, hidden) -> (T, hidden)
        top, chosen = self.router(x).float().topk(self.top_k, dim=-1)  # (T, top_k)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        return routed(x, chosen, weights, self.experts)


class GraniteSharedMLP(nn.Module):
    """Granite 4 hybrid's shared MLP: ``output_linear(silu(g) * u)``, ``(g, u)`` from
    ``input_linear``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size  # (shared_intermediate_size)
        self.input_linear = nn.Linear(h, 2 * i, bias=False)
        self.output_linear = nn.Linear(i, h, bias=False)

    def forward(self, x):
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


def _granite_mlps(cfg: ModelConfig, i: int) -> Dict[str, nn.Module]:
    moe = {"block_sparse_moe": GraniteMoE(cfg)} if cfg.moe is not None else {}
    return {**moe, "shared_mlp": GraniteSharedMLP(cfg)}  # summed in this order


@dataclass(frozen=True)
class Family:
    """A family's layer: the checkpoint names of its parts and their classes. ``norms``: the
    mixer's input norm, then the MLPs'. ``mlps(cfg, layer)``: the layer's MLPs by name (their
    outputs are summed; none: Nemotron-H's blocks are one mixer each, an MLP block's mixer being
    ``mlp_mixer``). A layer of kind ``"attention+mamba2"`` (Falcon-H1) holds both mixers, under
    their names ``attention`` and ``recurrent``."""

    attention: str
    recurrent: str
    norms: Tuple[str, ...]
    attention_cls: type
    recurrent_cls: type
    mlps: Callable[[ModelConfig, int], Dict[str, nn.Module]]
    mlp_mixer: Optional[type] = None


def _qwen3_next_mlps(cfg: ModelConfig, i: int) -> Dict[str, nn.Module]:
    sparse = cfg.moe is not None and i in cfg.moe.layers
    return {"mlp": SparseMoE(cfg) if sparse else MLP(cfg)}


QWEN_NORMS = ("input_layernorm", "post_attention_layernorm")
FAMILIES: Dict[str, Family] = {
    "lfm2": Family(
        "self_attn", "conv", ("operator_norm", "ffn_norm"), Lfm2Attention, ShortConv,
        lambda cfg, i: {"feed_forward": Lfm2MLP(cfg)},
    ),
    "qwen3_5_text": Family(
        "self_attn", "linear_attn", QWEN_NORMS, Attention, GatedDeltaNet,
        lambda cfg, i: {"mlp": MLP(cfg)},
    ),
    "qwen3_next": Family(
        "self_attn", "linear_attn", QWEN_NORMS, Attention, FusedGatedDeltaNet, _qwen3_next_mlps
    ),
    "bamba": Family(
        "self_attn", "mamba", ("input_layernorm", "pre_ff_layernorm"), Attention, Mamba2Mixer,
        lambda cfg, i: {"feed_forward": MLP(cfg)},
    ),
    "granitemoehybrid": Family(
        "self_attn", "mamba", QWEN_NORMS, Attention, Mamba2Mixer, _granite_mlps
    ),
    "nemotron_h": Family(
        "mixer", "mixer", ("norm",), Attention, Mamba2Mixer, lambda cfg, i: {}, Relu2MLP
    ),
    "falcon_h1": Family(
        "self_attn", "mamba", ("input_layernorm", "pre_ff_layernorm"), Attention,
        FalconMamba2Mixer, lambda cfg, i: {"feed_forward": FalconMLP(cfg)},
    ),
}  # fmt: skip
BOTH = "attention+mamba2"  # Falcon-H1's layers: attention and Mamba2 on the same input


class HybridLayer(nn.Module):
    """A pre-norm residual layer: ``x + r * mixer(norm(x))``, then ``x + r * sum(mlps(norm(x)))``
    when the family has MLPs (``r``: Granite's ``residual_multiplier``, else 1). The mixer is
    attention, a recurrent mixer or (Nemotron-H) an MLP. A Falcon-H1 layer (``BOTH``) runs
    attention and its Mamba2 on the same normed input and sums their outputs, each with its
    muP multipliers: ``mamba(h) * ssm_out + attn(h * attention_in) * attention_out``;
    ``mixer_module`` is then the Mamba2 (the part holding a state), ``attention_module`` the
    attention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        fam = FAMILIES[cfg.model_type]
        self.kind = cfg.layer_kind(layer_idx)
        self.attention_name = None
        if self.kind == "attention":
            self.mixer_name, mixer = fam.attention, fam.attention_cls(cfg, layer_idx)
        elif self.kind == "mlp":
            self.mixer_name, mixer = fam.recurrent, fam.mlp_mixer(cfg)
        else:
            self.mixer_name, mixer = fam.recurrent, fam.recurrent_cls(cfg, layer_idx)
        setattr(self, self.mixer_name, mixer)
        if self.kind == BOTH:
            self.attention_name = fam.attention
            setattr(self, fam.attention, fam.attention_cls(cfg, layer_idx))
            mup = cfg.mup
            self.attention_in, self.attention_out = mup.attention_in, mup.attention_out
            self.ssm_out = mup.ssm_out
        mlps = fam.mlps(cfg, layer_idx)
        for name, module in mlps.items():
            setattr(self, name, module)
        self.mlp_names, self.norm_names = tuple(mlps), fam.norms
        for name in fam.norms:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one))
        self.residual_multiplier = cfg.residual_multiplier
        # Granite's embedding multiplier, at the input of layer 0 (as DecoderLayer's)
        self.embed_scale = cfg.embed_scale if layer_idx == 0 else None

    @property
    def mixer_module(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def attention_module(self) -> Optional[nn.Module]:
        """A Falcon-H1 layer's attention (beside ``mixer_module``); None for the other kinds."""
        return None if self.attention_name is None else getattr(self, self.attention_name)

    def forward(self, x, cos, sin, ctx):
        # x (T, hidden) -> (T, hidden)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        h = getattr(self, self.norm_names[0])(x)
        if self.kind == "attention":
            h = self.mixer_module(h, cos, sin, ctx)
        elif self.kind == "mlp":
            h = self.mixer_module(h)
        elif self.kind == BOTH:
            h = self._parallel(h, cos, sin, ctx)
        else:
            h = self.mixer_module(h, ctx)
        x = x + _times(h, self.residual_multiplier)
        if not self.mlp_names:
            return x
        h = getattr(self, self.norm_names[1])(x)
        outs = [getattr(self, name)(h) for name in self.mlp_names]
        return x + _times(sum(outs[1:], outs[0]), self.residual_multiplier)

    def _parallel(self, h, cos, sin, ctx):
        # Falcon-H1: the Mamba2 and the attention on the same normed h, summed (as transformers)
        m = _times(self.mixer_module(h, ctx), self.ssm_out)
        a = self.attention_module(_times(h, self.attention_in), cos, sin, ctx)
        return m + _times(a, self.attention_out)


def _times(x, m: float):
    return x if m == 1.0 else x * m


class HybridForCausalLM(LlamaForCausalLM):
    """A hybrid decoder with ``LlamaForCausalLM``'s interface (see the module docstring)."""

    @staticmethod
    def new_layer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return HybridLayer(cfg, layer_idx)


def new_model(cfg: ModelConfig) -> LlamaForCausalLM:
    """The decoder for ``cfg``: a ``HybridForCausalLM`` for the hybrid families, else a
    ``LlamaForCausalLM`` (built on the current default device)."""
    return HybridForCausalLM(cfg) if cfg.model_type in HYBRID else LlamaForCausalLM(cfg)


def _layers(model) -> List[nn.Module]:
    layers = model.model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def state_layers(model) -> Dict[int, List[tuple]]:
    """Global layer index -> its recurrent mixer's ``state_shapes`` (per sequence, float32), for
    the layers ``model`` holds (all of them, or a pipeline stage's)."""
    out = {}
    for layer in _layers(model):
        mixer = getattr(layer, "mixer_module", None)
        if mixer is not None and hasattr(mixer, "state_shapes"):
            out[mixer.layer_idx] = list(mixer.state_shapes)
    return out


class SequenceContext(DenseContext):
    """One sequence run in successive pieces with nothing paged: each layer's K/V so far and
    recurrent states are kept here. Call ``next(positions)`` before each piece's forward; a piece
    attends to the K/V of every earlier piece and its own (causal on global positions)."""

    def __init__(self, backend: str = "auto"):
        super().__init__(torch.zeros(0, dtype=torch.long), backend)
        self.kv: Dict[int, tuple] = {}  # layer -> (k (S, Hkv, D), v, positions (S,))
        self.states: Dict[int, List[torch.Tensor]] = {}  # layer -> states (1, *shape)

    def next(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def attend(self, layer, q, k, v, *, scale=None, softcap=None, window=-1):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D) over this layer's K/V so far
        if layer in self.kv:
            pk, pv, pp = self.kv[layer]
            k, v, kpos = torch.cat([pk, k]), torch.cat([pv, v]), torch.cat([pp, self.positions])
        else:
            kpos = self.positions
        self.kv[layer] = (k, v, kpos)
        return self.over(q, k, v, kpos, scale=scale, softcap=softcap, window=window)

    def recur(self, layer, fn, u, shapes):
        # u (T, F) -> y (T, F'), from the state the previous piece left
        states = self.states.get(layer)
        if states is None:
            states = [torch.zeros((1, *s), dtype=torch.float32, device=u.device) for s in shapes]
        y, self.states[layer] = fn(u[None], states)
        return y[0]
