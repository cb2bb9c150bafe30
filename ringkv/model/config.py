"""``ModelConfig``: the few numbers a decoder of the supported families needs, read from an HF
``config.json`` (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text, Phi-3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
GEMMA = ("gemma2", "gemma3_text")


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
    rope_scaling: Optional[Dict[str, Any]] = (
        None  # {"rope_type": "llama3" | "linear" | "default", ...}
    )
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama attention_bias=True: bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = (
        False  # Qwen3, Gemma 3: RMSNorm over each head's q and k (weights of head_dim) before RoPE
    )
    model_type: str = "llama"
    eos_token_id: Any = None  # int or list of ints
    bos_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None
    # transformers' window S: a query of a sliding layer sees itself and the S - 1 keys before it
    sliding_window: Optional[int] = None
    layer_types: Optional[List[str]] = (
        None  # per layer "full_attention" | "sliding_attention"; None: all full
    )
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight), all in float32
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and before and after the MLP
    embed_scale: Optional[float] = (
        None  # Gemma: the embeddings times sqrt(hidden_size) (in their dtype)
    )
    attn_scale: Optional[float] = (
        None  # Gemma: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    )
    attn_softcap: Optional[float] = None  # Gemma 2: scores capped as c * tanh(s / c)
    final_softcap: Optional[float] = None  # Gemma 2/3: logits capped as c * tanh(l / c)
    local_rope_theta: Optional[float] = (
        None  # Gemma 3: the RoPE base of sliding layers (None: rope_theta)
    )
    local_rope_scaling: Optional[Dict[str, Any]] = None  # Gemma 3: their RoPE scaling
    partial_rotary_factor: float = 1.0  # Phi-3 family: RoPE on the first head_dim * factor channels
    fused_proj: bool = (
        False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj (split when loaded)
    )
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, cfg: Dict[str, Any]) -> "ModelConfig":
        """Build from an HF ``config.json`` dict (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3
        text, Phi-3), as written by any transformers version (``rope_parameters`` or the older
        top-level ``rope_theta`` / ``rope_scaling``)."""
        if not isinstance(cfg, dict):
            raise TypeError(
                f"ModelConfig.from_hf takes the config.json dict, got {type(cfg).__name__}"
            )
        mt = _model_type(cfg)
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            layers = cfg["num_hidden_layers"]
            kw = dict(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=layers,
                num_heads=heads,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        gemma = mt in GEMMA
        act = _activation(cfg, gemma)
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention=True (an encoder) is not supported: the engine is "
                "causal"
            )
        rope = _rope_fields(cfg, mt)
        window, types = _windows(mt, cfg, layers)
        attention_bias = bool(cfg.get("attention_bias", False))
        head_dim = cfg.get("head_dim") or (
            256 if gemma and "head_dim" not in cfg else hidden // heads
        )
        softcap = final = scalar = None
        if gemma:
            # missing keys take transformers' defaults; its Gemma 3 attention takes no cap: nor do
            # we
            softcap = cfg.get("attn_logit_softcapping", 50.0) if mt == "gemma2" else None
            final = cfg.get("final_logit_softcapping", 30.0 if mt == "gemma2" else None)
            scalar = cfg.get("query_pre_attn_scalar", 256)
        return cls(
            **kw,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=mt == "qwen2" or (attention_bias and mt != "phi3"),
            o_bias=mt in ("llama", "qwen3", "gemma2", "gemma3_text") and attention_bias,
            qk_norm=mt in ("qwen3", "gemma3_text"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            model_type=mt,
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=window,
            layer_types=types,
            hidden_act=ACTIVATIONS[act],
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            embed_scale=float(hidden) ** 0.5 if gemma else None,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=float(softcap) if softcap else None,
            final_softcap=float(final) if final else None,
            fused_proj=mt == "phi3",
            extra=cfg,
            **rope,
        )

    @property
    def eos_token_ids(self) -> set:
        e = self.eos_token_id
        return set() if e is None else set(e) if isinstance(e, (list, tuple)) else {e}

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` (global index) is a sliding layer (``layer_types``; it attends within
        ``sliding_window`` when that is set, and Gemma 3 gives it the local RoPE)."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int:
        """``layer``'s left extent on global positions: a query at ``p`` sees keys ``p - W .. p``
        (``W = sliding_window - 1``), or -1 (unbounded) on a full-attention layer."""
        return (
            self.sliding_window - 1
            if self.sliding_window is not None and self.is_sliding(layer)
            else -1
        )


def _scaling(s: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A RoPE scaling dict with its ``rope_type`` (``type`` in old configs), None for the
    default."""
    if s is None:
        return None
    s = dict(s)
    s["rope_type"] = s.get("rope_type", s.get("type", "default"))
    return None if s["rope_type"] == "default" else s


def _model_type(cfg: Dict[str, Any]) -> str:
    mt = cfg.get("model_type", "llama")
    if mt not in ARCHS:
        hint = (
            " (load the text model: model_type 'gemma3_text', Gemma3ForCausalLM)"
            if mt == "gemma3"
            else ""
        )
        raise ValueError(f"unsupported model_type {mt!r}; ringkv.model supports {ARCHS}{hint}")
    return mt


def _activation(cfg: Dict[str, Any], gemma: bool) -> str:
    act = cfg.get("hidden_activation") if gemma else None
    act = act or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"hidden activation {act!r} is not supported; ringkv.model runs {sorted(ACTIVATIONS)}"
        )
    return act


def _rope_fields(cfg: Dict[str, Any], mt: str) -> Dict[str, Any]:
    """The RoPE fields of ``ModelConfig`` (theta, scaling, Gemma 3's local ones, the partial
    factor) from ``cfg``."""
    # transformers >= 5 keeps theta and scaling in "rope_parameters" (Gemma 3: one dict per layer
    # type); older configs at top level (Gemma 3: rope_theta, rope_local_base_freq, rope_scaling)
    params = dict(cfg.get("rope_parameters") or {})
    nested = isinstance(params.get("full_attention"), dict) or isinstance(
        params.get("sliding_attention"), dict
    )
    rope = dict(params.get("full_attention") or {}) if nested else params
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    scaling = _scaling(
        cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    )
    theta = float(
        rope.get("rope_theta", cfg.get("rope_theta", 1e6 if mt == "gemma3_text" else 10000.0))
    )
    local_theta = local_scaling = None
    if mt == "gemma3_text":
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        local_scaling = _scaling(local if local.get("rope_type", "default") != "default" else None)
    if mt == "phi3" and (scaling or {}).get("rope_type") in ("longrope", "su", "yarn"):
        raise ValueError(
            "Phi-3's longrope RoPE scaling (the 128k and Phi-3.5 / Phi-4-mini checkpoints) is "
            "not supported; use a checkpoint with rope_scaling null (e.g. "
            "Phi-3-mini-4k-instruct)"
        )
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        partial_rotary_factor=partial,
    )


def _windows(mt: str, cfg: Dict[str, Any], layers: int):
    """``(sliding_window, layer_types)`` as transformers 5.25 builds them: Mistral and Phi-3 slide
    on every layer when ``sliding_window`` is set; Qwen2/3 from layer ``max_window_layers`` on with
    ``use_sliding_window``; Gemma 2 on every other layer, Gemma 3 on five of six
    (``sliding_window_pattern``), unless ``layer_types`` says otherwise."""
    window = cfg.get("sliding_window", 4096 if mt in GEMMA else None)  # transformers' defaults
    if mt in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if mt == "llama" or not (
        window or mt == "gemma3_text"
    ):  # Gemma 3's layer types also pick the RoPE
        return None, None
    window = window or None
    types = cfg.get("layer_types")
    if types is None:
        if mt in ("mistral", "phi3"):
            types = ["sliding_attention"] * layers
        elif mt in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            every = (
                2
                if mt == "gemma2"
                else int(
                    cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)) or 6
                )
            )
            types = [
                "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
            ]
    types = list(types)
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list {layers} of {LAYER_TYPES}, got {types}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")
    return window, types
