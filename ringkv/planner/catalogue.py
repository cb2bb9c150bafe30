"""Model presets and loading: ``PRESETS`` (the fields of each model's HF ``config.json`` that the
planner reads), ``ALIASES`` and ``load_model``, which turns a preset name, an HF directory or
``config.json``, a config dict or a transformers config/model into a ``ModelConfig``. The random
models of ringkv's own benchmarks are presets too: ``benchmarks/models.py`` builds them from
here."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from ..model.config import ModelConfig


def _llama(layers, hidden, heads, kv_heads, inter, vocab, tied, **kw):
    return dict(
        model_type=kw.pop("model_type", "llama"),
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **kw,
    )


# name -> the fields of the model's HF config.json that the planner reads (sources: docs/plan.md)
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, False),  # meta-llama/Meta-Llama-3-8B
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, False),  # meta-llama/Meta-Llama-3-70B
    "llama-3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, False),  # meta-llama/Llama-3.1-405B
    "qwen2.5-7b": _llama(
        28, 3584, 28, 4, 18944, 152064, False, model_type="qwen2"
    ),  # Qwen/Qwen2.5-7B
    "mistral-7b": _llama(
        32, 4096, 32, 8, 14336, 32000, False, model_type="mistral"
    ),  # Mistral-7B-v0.1
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, True),  # HuggingFaceTB/SmolLM2-135M
    # random models of ringkv's own benchmarks (random weights, benchmarks/models.py), for
    # calibration
    # and validation: throughput and memory only, never text quality
    # ~120M parameters like SmolLM2, but 12 heads / 4 KV heads split over tp = 2 or 4
    "llama-120m": _llama(12, 768, 12, 4, 2048, 32000, False, max_position_embeddings=8192),
    # attention-dominated long prompts: 4 layers, 4 heads of 64, 2 KV heads, 64K positions
    "tiny-long": _llama(4, 256, 4, 2, 512, 1024, False, max_position_embeddings=65536),
    # smoke tests of the benchmarks
    "tiny-test": _llama(2, 64, 4, 2, 128, 1024, False, max_position_embeddings=4096),
    # a tiny model with SmolLM2's vocabulary (49152): benchmarks/engine_memory.py
    "tiny-wide-vocab": _llama(4, 64, 4, 2, 128, 49152, False, max_position_embeddings=8192),
}
ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "llama-3.1-8b": "llama-3-8b",
    "llama-3.1-70b": "llama-3-70b",
    "llama-3-405b": "llama-3.1-405b",
}


def read_json(path, what: str = "calibration file"):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} {path!r}: {e}") from None


def config_path(model) -> Optional[str]:
    """The ``config.json`` an HF directory or a file path names, or None when there is none."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else str(model)
    return path if os.path.isfile(path) else None


def load_model(model) -> ModelConfig:
    """A ``ModelConfig`` from a preset name, an HF directory or ``config.json`` path, a config
    dict, a transformers config/model, or a ``ModelConfig``."""
    if isinstance(model, ModelConfig):
        return model
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):
        model = model.config
    if hasattr(model, "to_dict"):
        model = model.to_dict()
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a preset name, a path or a config dict, got {type(model).__name__}"
        )
    name = ALIASES.get(str(model).lower(), str(model).lower())
    if name in PRESETS:
        return ModelConfig.from_hf(PRESETS[name])
    path = config_path(model)
    if path is None:
        raise ValueError(
            f"unknown model {str(model)!r}: not a preset ({', '.join(PRESETS)}) nor a directory "
            f"or config.json file"
        )
    return ModelConfig.from_hf(read_json(path, "model config"))


def model_of(name: str) -> ModelConfig:
    """The model a benchmark JSON names: a preset, or ``engine.py``'s "random NAME ({config})"."""
    name = str(name)
    if "{" in name:  # engine.py writes "random llama-120m ({config})"
        return ModelConfig.from_hf(
            dict(json.loads(name[name.index("{") : name.rindex("}") + 1]), model_type="llama")
        )
    return load_model(name)
