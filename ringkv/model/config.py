"""``ModelConfig``: the few numbers a decoder of the supported families needs, read from an HF
``config.json`` (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text, Phi-3, and the hybrid
families LFM2, Qwen3.5 text, Qwen3-Next, Bamba, Granite 4 hybrid, Nemotron-H and Falcon-H1, whose
recurrent mixers ``RecurrentConfig`` describes, whose mixture-of-experts MLPs (Qwen3-Next, Granite)
``MoEConfig`` does and whose muP multipliers (Falcon-H1) ``MupConfig`` does).

A hybrid model's layers each have a kind (``ModelConfig.layer_kind``): ``"attention"`` (holds KV),
``"conv"`` (LFM2's gated short convolution), ``"mamba2"`` (Bamba, Granite 4 hybrid, Nemotron-H),
``"gdn"`` (the gated DeltaNet of Qwen3.5 and Qwen3-Next), ``"mlp"`` (a Nemotron-H block that is
an MLP alone) or ``"attention+mamba2"`` (Falcon-H1: attention and a Mamba2 mixer side by side on
the same input; the layer holds K/V and a state). A config option a family has that ringkv does
not implement is refused here, with a ``ValueError`` naming it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

HYBRID = (
    "lfm2",
    "qwen3_5_text",
    "qwen3_next",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
)
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3") + HYBRID
KINDS = ("attention", "conv", "mamba2", "gdn", "mlp", "attention+mamba2")
KV_KINDS = ("attention", "attention+mamba2")  # the kinds that hold K/V
RECURRENT_KINDS = ("conv", "mamba2", "gdn")  # a layer's recurrent mixer (its kind's last part)
# our parameter-name prefix -> the checkpoint's, where a family names the engine-facing parts
# (``model.embed_tokens``, ``model.norm``) otherwise
CHECKPOINT_RENAMES = {
    "lfm2": {"model.norm.": "model.embedding_norm."},
    "bamba": {"model.norm.": "model.final_layernorm."},
    "nemotron_h": {"model.norm.": "model.norm_f.", "model.embed_tokens.": "model.embeddings."},
    "falcon_h1": {"model.norm.": "model.final_layernorm."},
}
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
GEMMA = ("gemma2", "gemma3_text")


@dataclass
class RecurrentConfig:
    """The sizes of a hybrid model's recurrent mixers (one kind per family)."""

    conv_kernel: int  # K: the short convolution's taps (its state holds the K - 1 inputs before)
    conv_bias: bool = False
    activation: Optional[str] = None  # after the convolution: None (LFM2) or "silu"
    norm_eps: float = 1e-6  # the mixer's gated RMSNorm
    proj_bias: bool = False  # Mamba2: bias on in_proj and out_proj
    heads: int = 0  # Mamba2: SSD heads; GDN: value heads
    head_dim: int = 0  # Mamba2: P; GDN: the value head dim
    k_heads: int = 0  # GDN: query/key heads
    k_head_dim: int = 0  # GDN: the query/key head dim
    groups: int = 1  # Mamba2: B/C groups (n_groups), also the gated norm's groups
    state: int = 0  # Mamba2: N (d_state)
    chunk_size: int = 64  # the chunked scan's chunk (exact under any choice, up to rounding)
    dt_limit: Optional[Tuple[float, float]] = None  # Mamba2: dt clamped to it after softplus
    out_bias: Optional[bool] = None  # Mamba2: bias on out_proj (None: proj_bias)
    gated_norm: bool = True  # Mamba2: the gated RMSNorm (False: y * silu(gate), Falcon-H1)
    norm_before_gate: bool = False  # Mamba2's gated norm: normed, weighted, then gated


@dataclass
class MupConfig:
    """Falcon-H1's muP multipliers (besides its embedding and LM head ones, which are
    ``ModelConfig.embed_scale`` and ``1 / logits_scaling``): each is 1 in a model without them.
    The key multiplier is folded into the attention scale (``ModelConfig.attn_scale``)."""

    attention_in: float = 1.0  # the attention's input (the normed hidden states)
    attention_out: float = 1.0  # the attention's output
    ssm_in: float = 1.0  # the Mamba2 mixer's input
    ssm_out: float = 1.0  # its output
    # its in_proj's output, per part: (z (the gate), x, B, C, dt)
    ssm: Tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp: Tuple[float, float] = (1.0, 1.0)  # the MLP's gate_proj output and down_proj output


@dataclass
class MoEConfig:
    """A sparse MLP: ``top_k`` of ``experts`` gated MLPs picked by a router, plus a shared expert
    (Qwen3-Next: gated by ``sigmoid(shared_expert_gate x)``; Granite: its ``shared_mlp``, sized by
    ``ModelConfig.intermediate_size``)."""

    experts: int
    top_k: int
    intermediate_size: int  # each expert's
    shared_intermediate_size: int = 0  # Qwen3-Next's shared expert
    norm_topk_prob: bool = False  # Qwen3-Next: the top-k router weights renormalised
    # the layers whose MLP is this block (the others: the dense MLP)
    layers: List[int] = field(default_factory=list)


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
    # the MLP's activation: "silu", "gelu_pytorch_tanh" (Gemma) or "relu2" (Nemotron-H, ungated)
    hidden_act: str = "silu"
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
    # hybrid models: each layer's kind (KINDS; None: all attention) and their mixers' sizes
    layer_kinds: Optional[List[str]] = None
    recurrent: Optional[RecurrentConfig] = None
    moe: Optional[MoEConfig] = None
    mup: Optional[MupConfig] = None  # Falcon-H1
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a gate, out * sigmoid(gate)
    use_rope: bool = True  # Nemotron-H's attention has no position embedding
    residual_multiplier: float = 1.0  # Granite: each residual branch's output scaled by it
    logits_scaling: float = 1.0  # Granite: logits divided by it
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
        if cfg.get("model_type") == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
            # Qwen3.5's image-text checkpoints: the text model (its weights under
            # model.language_model; the vision tower's are not read)
            cfg = {**cfg["text_config"], "model_type": "qwen3_5_text"}
        mt = _model_type(cfg)
        if mt == "nemotron_h" and "num_hidden_layers" not in cfg:  # (a property of its config)
            cfg = dict(cfg, num_hidden_layers=len(cfg.get("layers_block_type") or ()))
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
        fields = dict(
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
        if mt in HYBRID:
            fields.update(_HYBRID_FIELDS[mt](cfg, layers))
        return cls(**fields)

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

    def layer_kind(self, layer: int) -> str:
        """``layer``'s kind (global index): ``"attention"`` or a recurrent kind of ``KINDS``."""
        return "attention" if self.layer_kinds is None else self.layer_kinds[layer]

    def recurrent_kind(self, layer: int) -> Optional[str]:
        """The kind of ``layer``'s recurrent mixer (``"conv"``, ``"mamba2"``, ``"gdn"``; a
        Falcon-H1 layer's is ``"mamba2"``), or None when it keeps no state."""
        kind = self.layer_kind(layer).rpartition("+")[2]
        return kind if kind in RECURRENT_KINDS else None

    def kv_layers(self) -> List[int]:
        """Global indices of the layers that hold K/V (attention, alone or beside a mixer)."""
        return [i for i in range(self.num_layers) if self.layer_kind(i) in KV_KINDS]


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
    key = "hidden_activation" if gemma and cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"hidden activation {key}={act!r} is not supported; ringkv.model runs "
            f"{sorted(ACTIVATIONS)}"
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
        rope.get(
            "rope_theta",
            cfg.get("rope_theta", 1e6 if mt in ("gemma3_text", "lfm2") else 10000.0),
        )
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
    default = {"qwen3_5_text": 0.25, "qwen3_next": 0.25, "bamba": 0.5}.get(
        mt, 1.0
    )  # transformers' defaults
    partial = float(
        rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)) or default
    )
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


# ---------------------------------------------------------------------------------------------
# hybrid families: their layer kinds and mixers (the fields that differ from the common parse)


def _kinds(types, names: Dict[str, str], key: str, layers: int) -> List[str]:
    """Layer kinds from a family's per-layer type names (``names``: its name -> our kind)."""
    types = list(types or ())
    bad = sorted({t for t in types if t not in names})
    if len(types) != layers or bad:
        hint = f" (not supported: {bad})" if bad else ""
        raise ValueError(
            f"{key} must list {layers} layer types of {sorted(names)}, got {types}{hint}"
        )
    return [names[t] for t in types]


def _refuse(cfg: Dict[str, Any], mt: str, unsupported: Dict[str, Any]) -> None:
    """``ValueError`` naming the first option of ``unsupported`` (key -> the only value ringkv
    runs, transformers' default when absent) that ``cfg`` sets otherwise."""
    for key, ok in unsupported.items():
        if key in cfg and cfg[key] != ok:
            raise ValueError(
                f"{mt}: config option {key}={cfg[key]!r} is not supported by ringkv.model "
                f"(only {ok!r})"
            )


def _lfm2(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    types = cfg.get("layer_types")
    if types is None:  # older configs: the attention layers' indices
        full = cfg.get("full_attn_idxs")
        full = range(layers) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    inter = cfg.get("block_ff_dim", cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):  # as Lfm2MLP sizes its hidden units
        inter = int(2 * inter / 3)
        mult, of = cfg.get("block_ffn_dim_multiplier", 1.0), cfg.get("block_multiple_of", 256)
        if mult is not None:
            inter = of * ((int(mult * inter) + of - 1) // of)
    eps = cfg.get("norm_eps", 1e-5)
    bias = bool(cfg.get("conv_bias", False))
    return dict(
        layer_kinds=_kinds(
            types, {"conv": "conv", "full_attention": "attention"}, "layer_types", layers
        ),
        intermediate_size=inter,
        rms_norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        qk_norm=True,
        qkv_bias=False,
        o_bias=False,
        recurrent=RecurrentConfig(conv_kernel=int(cfg.get("conv_L_cache", 3)), conv_bias=bias),
    )


def _qwen3_next(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    """Qwen3.5's layers (its DeltaNet's projections fused) with MoE MLPs."""
    out = _qwen3_5(cfg, layers, "qwen3_next")
    experts, step = int(cfg.get("num_experts", 512)), int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    if sparse:
        out["moe"] = MoEConfig(
            experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 10)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            layers=sparse,
        )
    return out


def _qwen3_5(cfg: Dict[str, Any], layers: int, mt: str = "qwen3_5_text") -> Dict[str, Any]:
    _refuse(cfg, mt, {"hidden_act": "silu"})  # also the convolution's activation
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    names = {"linear_attention": "gdn", "full_attention": "attention"}
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_kinds=_kinds(types, names, "layer_types", layers),
        norm_plus_one=True,
        qk_norm=True,
        attn_output_gate=True,
        qkv_bias=bias,
        o_bias=bias,
        recurrent=RecurrentConfig(
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            activation="silu",
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            heads=int(cfg.get("linear_num_value_heads", 32)),
            head_dim=int(cfg.get("linear_value_head_dim", 128)),
            k_heads=int(cfg.get("linear_num_key_heads", 16)),
            k_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        ),
    )


def _mamba2(mt: str, act: tuple, groups: tuple, limit, **sizes) -> RecurrentConfig:
    """A Mamba2 mixer's sizes (``RecurrentConfig`` fields in ``sizes``); ``act``/``groups``: the
    family's ``(key, value)`` of the mixer's activation and of its B/C groups."""
    if act[1] not in ("silu", "swish"):
        raise ValueError(
            f"{mt}: config option {act[0]}={act[1]!r} is not supported by ringkv.model "
            f"(only 'silu')"
        )
    if sizes["heads"] % groups[1]:
        raise ValueError(f"{mt}: {groups[0]}={groups[1]} must divide the {sizes['heads']} heads")
    limit = (0.0, float("inf")) if limit is None else (_json_float(limit[0]), _json_float(limit[1]))
    return RecurrentConfig(activation="silu", groups=int(groups[1]), dt_limit=limit, **sizes)


def _json_float(v) -> float:
    """A float of a config.json; transformers writes infinities as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _bamba_mamba(cfg: Dict[str, Any], mt: str) -> RecurrentConfig:
    """The Mamba2 mixer of Bamba and Granite 4 hybrid (the same ``mamba_*`` keys)."""
    heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head == "auto":
        d_head = cfg.get("mamba_expand", 2) * cfg["hidden_size"] // heads
    return _mamba2(
        mt,
        ("hidden_act", cfg.get("hidden_act", "silu")),
        ("mamba_n_groups", cfg.get("mamba_n_groups", 1)),
        cfg.get("time_step_limit"),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        heads=heads,
        head_dim=int(d_head),
        state=int(cfg.get("mamba_d_state", 256)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
    )


def _bamba(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    attn = set(cfg.get("attn_layer_indices") or ())
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        layer_kinds=["attention" if i in attn else "mamba2" for i in range(layers)],
        qkv_bias=bias,
        o_bias=bias,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        recurrent=_bamba_mamba(cfg, "bamba"),
    )


def _granite(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    """Granite 4 hybrid: Bamba's mixer, MoE plus a shared MLP, and Granite's multipliers."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    names = {"mamba": "mamba2", "linear_attention": "mamba2"}
    names.update(attention="attention", full_attention="attention")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope"):
        raise ValueError(
            f"granitemoehybrid: config option position_embedding_type={rope!r} is not supported "
            f"by ringkv.model (only 'rope' or None)"
        )
    experts, bias = int(cfg.get("num_local_experts", 0)), bool(cfg.get("attention_bias", False))
    moe = None
    if experts > 0:
        top_k = int(cfg.get("num_experts_per_tok", 2))
        moe = MoEConfig(experts, top_k, int(cfg["intermediate_size"]), layers=list(range(layers)))
    embed = float(cfg.get("embedding_multiplier", 1.0))
    return dict(
        layer_kinds=_kinds(types, names, "layer_types", layers),
        intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),  # the shared MLP's
        moe=moe,
        qkv_bias=bias,
        o_bias=bias,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        use_rope=rope == "rope",
        attn_scale=float(cfg.get("attention_multiplier", 1.0)),
        embed_scale=None if embed == 1.0 else embed,
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        recurrent=_bamba_mamba(cfg, "granitemoehybrid"),
    )


_NEMOTRON_TYPES = {  # its layer type names, old ones included -> our kinds ("moe": refused)
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
}


def _nemotron_h(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    _refuse(
        cfg,
        "nemotron_h",
        {
            "mlp_hidden_act": "relu2",
            "sliding_window": None,
            "num_nextn_predict_layers": 0,
            "residual_in_fp32": False,
        },
    )
    types = cfg.get("layers_block_type")
    if types is None and "hybrid_override_pattern" in cfg:
        pattern = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
        types = [pattern.get(c, c) for c in cfg["hybrid_override_pattern"]]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    rec = _mamba2(
        "nemotron_h",
        ("mamba_hidden_act", cfg.get("mamba_hidden_act", "silu")),
        ("n_groups", cfg.get("n_groups", 8)),
        cfg.get("time_step_limit"),
        conv_kernel=int(cfg.get("conv_kernel", 4)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=eps,
        heads=int(cfg.get("mamba_num_heads", 128)),
        head_dim=int(cfg.get("mamba_head_dim", 64)),
        state=int(cfg.get("ssm_state_size", 128)),
        chunk_size=int(cfg.get("chunk_size", 128)),
    )
    return dict(
        layer_kinds=_kinds(types, _NEMOTRON_TYPES, "layers_block_type", layers),
        rms_norm_eps=eps,
        qkv_bias=False,
        o_bias=False,
        use_rope=False,
        tie_word_embeddings=False,  # transformers never ties them (whatever the config says)
        hidden_act="relu2",
        recurrent=rec,
    )


def _falcon_h1(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    """Falcon-H1: every layer attention and Mamba2 side by side (``"attention+mamba2"``), then a
    gated MLP; its muP multipliers (``MupConfig``)."""
    _refuse(cfg, "falcon_h1", {"mamba_use_mlp": True})
    hidden, heads = cfg["hidden_size"], int(cfg.get("mamba_n_heads", 128))
    inner = cfg.get("mamba_d_ssm", 1024)
    if inner is None:
        inner = int(cfg.get("mamba_expand", 2) * hidden)
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head == "auto":
        d_head = inner // heads
    if int(d_head) * heads != inner:
        raise ValueError(
            f"falcon_h1: mamba_n_heads={heads} x mamba_d_head={d_head} must equal the mixer's "
            f"width {inner} (mamba_d_ssm, or mamba_expand x hidden_size)"
        )
    rec = _mamba2(
        "falcon_h1",
        ("hidden_act", cfg.get("hidden_act", "silu")),
        ("mamba_n_groups", cfg.get("mamba_n_groups", 1)),
        cfg.get("time_step_limit"),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        out_bias=bool(cfg.get("projectors_bias", False)),
        gated_norm=bool(cfg.get("mamba_rms_norm", False)),
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        heads=heads,
        head_dim=int(d_head),
        state=int(cfg.get("mamba_d_state", 256)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
    )

    def multipliers(key: str, n: int) -> tuple:
        m = cfg.get(key)
        m = [1.0] * n if m is None else m
        if not isinstance(m, (list, tuple)) or len(m) != n:
            raise ValueError(f"falcon_h1: config option {key} must list {n} floats, got {m!r}")
        return tuple(float(x) for x in m)

    def one(key: str) -> float:
        m = cfg.get(key)
        return 1.0 if m is None else float(m)

    bias, head_dim = bool(cfg.get("attention_bias", False)), cfg.get("head_dim")
    head_dim = head_dim or hidden // cfg["num_attention_heads"]
    embed, lm_head = one("embedding_multiplier"), one("lm_head_multiplier")
    if lm_head == 0.0:
        raise ValueError("falcon_h1: config option lm_head_multiplier=0.0 is not supported")
    return dict(
        layer_kinds=["attention+mamba2"] * layers,
        qkv_bias=bias,
        o_bias=bias,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        # q . (k * key_multiplier) * D^-0.5: the key multiplier folded into the scale
        attn_scale=one("key_multiplier") * float(head_dim) ** -0.5,
        embed_scale=None if embed == 1.0 else embed,
        logits_scaling=1.0 / lm_head,
        mup=MupConfig(
            attention_in=one("attention_in_multiplier"),
            attention_out=one("attention_out_multiplier"),
            ssm_in=one("ssm_in_multiplier"),
            ssm_out=one("ssm_out_multiplier"),
            ssm=multipliers("ssm_multipliers", 5),
            mlp=multipliers("mlp_multipliers", 2),
        ),
        recurrent=rec,
    )


_HYBRID_FIELDS = {
    "lfm2": _lfm2,
    "qwen3_5_text": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "bamba": _bamba,
    "granitemoehybrid": _granite,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
}
