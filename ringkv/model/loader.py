"""Build a ``LlamaForCausalLM`` from an HF directory (safetensors only), an in-memory
transformers model, or a GGUF file (dequantized by transformers' GGUF loader).

Never unpickles: ``*.bin``/``*.pt`` checkpoints are refused.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {directory!r}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _load_safetensors_file(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} is missing")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises SafetensorError / OSError on truncated or garbled files
        raise ValueError(f"checkpoint file {path!r} is corrupt or not a safetensors file: {e}") from None


def read_safetensors(directory: str) -> Dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or the shards named by ``model.safetensors.index.json``."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is corrupt (need a 'weight_map'): {e}") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            pickled = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
            hint = f" (found {pickled}: ringkv never unpickles; convert them to safetensors)" if pickled else ""
            raise FileNotFoundError(f"no *.safetensors checkpoint in {directory!r}{hint}")
    state = {}
    for name in files:
        state.update(_load_safetensors_file(os.path.join(directory, name)))
    return state


def build(cfg: ModelConfig, state: Dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
          device="cpu") -> LlamaForCausalLM:
    """Model with ``state`` (HF parameter names) loaded strictly, in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = {k for k in shapes if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {cfg.model_type} config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}")
    for k, v in state.items():
        want = shapes[k]
        if v.shape != want:
            raise ValueError(f"checkpoint tensor {k!r} has shape {tuple(v.shape)}, config expects {tuple(want)}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = type(model.model.rotary)(cfg).to(device)  # buffer out of the meta device
    return model.eval()


def load_dir(directory: str, dtype=torch.float32, device="cpu") -> Tuple[LlamaForCausalLM, ModelConfig]:
    cfg = ModelConfig.from_hf(read_config(directory))
    return build(cfg, read_safetensors(directory), dtype, device), cfg


def load_hf_model(hf_model, dtype=torch.float32, device="cpu") -> Tuple[LlamaForCausalLM, ModelConfig]:
    """From an in-memory transformers ``*ForCausalLM`` (its config and state_dict)."""
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    return build(cfg, dict(hf_model.state_dict()), dtype, device), cfg


def load_gguf_hf(gguf_path: str):
    """A transformers model and tokenizer from a GGUF file (weights dequantized to float)."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file {gguf_path!r} is missing")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(gguf_path))
    try:
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    except Exception as e:
        raise ValueError(f"could not load GGUF file {gguf_path!r} through transformers: {e}") from e
    return hf, tok


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Write an HF-format copy (config.json, model.safetensors, tokenizer files) of a GGUF model."""
    from safetensors.torch import save_file

    hf, tok = load_gguf_hf(gguf_path)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)  # the copy holds plain float weights
    cfg["architectures"] = [type(hf).__name__]
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    tmp = out_dir.rstrip("/") + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, default=str)
    tok.save_pretrained(tmp)
    if os.path.isdir(out_dir):  # a stale or partial copy
        import shutil
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)  # a half-written copy is never picked up as complete
    return out_dir


def load_model(source, dtype: Optional[torch.dtype] = None, device="cpu"):
    """``(model, config, tokenizer_or_None)`` from a directory, a ``.gguf`` file or a transformers model."""
    dtype = dtype or torch.float32
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".gguf"):
            hf, tok = load_gguf_hf(path)
            model, cfg = load_hf_model(hf, dtype, device)
            return model, cfg, tok
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
        model, cfg = load_dir(path, dtype, device)
        return model, cfg, _maybe_tokenizer(path)
    if isinstance(source, LlamaForCausalLM):  # already ours (tests, parallel runners)
        p = next(source.parameters())
        if p.device != torch.device(device) or p.dtype != dtype:  # never move the caller's model
            import copy
            source = copy.deepcopy(source).to(device=device, dtype=dtype)
        return source.eval(), source.config, None
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        model, cfg = load_hf_model(source, dtype, device)
        return model, cfg, None
    raise TypeError(f"model must be a path (HF directory or .gguf) or a transformers model, "
                    f"got {type(source).__name__}")


def _maybe_tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(path)
