"""``ModelConfig``: the few numbers a Llama-family decoder needs, read from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None  # {"rope_type": "llama3" | "linear" | "default", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (weights of head_dim) before RoPE
    model_type: str = "llama"
    eos_token_id: Any = None  # int or list of ints
    bos_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None
    sliding_window: Optional[int] = None  # not implemented: the engine caps max_model_len to it
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, cfg: Dict[str, Any]) -> "ModelConfig":
        """Build from an HF ``config.json`` dict (Llama, Qwen2, Qwen3, Mistral)."""
        if not isinstance(cfg, dict):
            raise TypeError(f"ModelConfig.from_hf takes the config.json dict, got {type(cfg).__name__}")
        mt = cfg.get("model_type", "llama")
        if mt not in ARCHS:
            raise ValueError(f"unsupported model_type {mt!r}; ringkv.model supports {ARCHS}")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            kw = dict(vocab_size=cfg["vocab_size"], hidden_size=hidden,
                      intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                      num_heads=heads)
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, got {cfg.get('hidden_act')!r}")
        # transformers >= 5 keeps theta and scaling in "rope_parameters"; older configs at top level
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            **kw,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attention_bias,
            o_bias=mt in ("llama", "qwen3") and attention_bias,
            qk_norm=mt == "qwen3",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            model_type=mt,
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=(cfg.get("sliding_window") if mt == "mistral" or cfg.get("use_sliding_window")
                            else None),
            extra=cfg,
        )

    @property
    def eos_token_ids(self) -> set:
        e = self.eos_token_id
        return set() if e is None else set(e) if isinstance(e, (list, tuple)) else {e}
