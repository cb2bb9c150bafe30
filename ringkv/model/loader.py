"""Build a ``LlamaForCausalLM`` from an HF directory (safetensors only), an in-memory
transformers model, or a GGUF file (dequantized by transformers' GGUF loader).

Never unpickles: ``*.bin``/``*.pt`` checkpoints are refused.

Phi-3 checkpoints fuse q/k/v (``qkv_proj``: the rows of q, then k, then v) and gate/up
(``gate_up_proj``: gate's rows, then up's); the model keeps them apart (so tensor parallelism
splits each by heads / hidden units like any other model) and each part reads its rows of the
fused tensor (``fused_part``), a rank's slice included: nothing is copied or concatenated.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .config import ModelConfig
from .llama import LlamaForCausalLM

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # checkpoint names that are not weights


class _NoInit(TorchFunctionMode):
    """``torch.nn.init``'s functions return their tensor as it is (a module's
    ``reset_parameters``): nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Modules built inside have their parameters on the meta device, never initialised: their
    values are never read (``materialize`` replaces every one). Initialising a meta tensor runs
    torch's Python reference kernels, the first of which imports ``torch._dynamo``: 1.2 CPU-s
    of the ~2.5 that building SmolLM2's engine took in a fresh process (each spawned rank,
    server and benchmark run built it twice: ``check_checkpoint`` and the stage)."""
    with torch.device("meta"), _NoInit():
        yield


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {directory!r}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


class StateDictSource:
    """Weights held in memory (a state dict): ``get`` returns views, never copies."""

    def __init__(self, state: Dict[str, torch.Tensor]):
        self.state = state

    def names(self):
        return set(self.state)

    def shape(self, name: str) -> tuple:
        return tuple(self.state[name].shape)

    def get(
        self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0
    ) -> torch.Tensor:
        t = self.state[name]
        return t if dim is None else t.narrow(dim, start, stop - start)


class SafetensorsSource:
    """Weights in safetensors files, read lazily: ``get`` reads only the requested slice
    (``safe_open(...).get_slice``), so a tensor-parallel rank never holds a full tensor or file."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is corrupt (need a 'weight_map'): {e}") from None
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                pickled = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
                hint = (
                    f" (found {pickled}: ringkv never unpickles; convert them to safetensors)"
                    if pickled
                    else ""
                )
                raise FileNotFoundError(f"no *.safetensors checkpoint in {directory!r}{hint}")
        self.handles, self.file_of = {}, {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint file {path!r} is missing")
            try:  # the header is validated against the file size here: truncation is caught now
                handle = safe_open(path, framework="pt", device="cpu")
            except Exception as e:  # SafetensorError / OSError on truncated or garbled files
                raise ValueError(
                    f"checkpoint file {path!r} is corrupt or not a safetensors file: {e}"
                ) from None
            self.handles[path] = handle
            self.file_of.update({k: path for k in handle.keys()})

    def names(self):
        return set(self.file_of)

    def shape(self, name: str) -> tuple:
        return tuple(self.handles[self.file_of[name]].get_slice(name).get_shape())

    def get(
        self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0
    ) -> torch.Tensor:
        sl = self.handles[self.file_of[name]].get_slice(name)
        if dim is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[(slice(None),) * dim + (slice(start, stop),)]


def read_safetensors(directory: str) -> Dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``."""
    src = SafetensorsSource(directory)
    return {name: src.get(name) for name in sorted(src.names())}


def checkpoint_name(cfg: ModelConfig, param: str) -> str:
    """The checkpoint tensor a parameter comes from (a tied LM head reads the embedding; a part of
    a fused projection reads the fused tensor)."""
    fused = fused_part(cfg, param)
    if fused is not None:
        return fused[0]
    return (
        "model.embed_tokens.weight"
        if cfg.tie_word_embeddings and param == "lm_head.weight"
        else param
    )


_FUSED = {
    "self_attn.q_proj.weight": "self_attn.qkv_proj.weight",
    "self_attn.k_proj.weight": "self_attn.qkv_proj.weight",
    "self_attn.v_proj.weight": "self_attn.qkv_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_up_proj.weight",
    "mlp.up_proj.weight": "mlp.gate_up_proj.weight",
}


def fused_part(cfg: ModelConfig, param: str) -> Optional[Tuple[str, int, int]]:
    """``(fused tensor, first row, rows)`` of a parameter held inside a fused checkpoint tensor
    (Phi-3's ``qkv_proj`` and ``gate_up_proj``), None for any other parameter."""
    if not cfg.fused_proj or not param.startswith("model.layers."):
        return None
    layer, _, key = param[len("model.layers.") :].partition(".")
    if key not in _FUSED:
        return None
    q, kv, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    first, rows = {
        "self_attn.q_proj.weight": (0, q),
        "self_attn.k_proj.weight": (q, kv),
        "self_attn.v_proj.weight": (q + kv, kv),
        "mlp.gate_proj.weight": (0, inter),
        "mlp.up_proj.weight": (inter, inter),
    }[key]
    return f"model.layers.{layer}.{_FUSED[key]}", first, rows


def source_key(cfg: ModelConfig, param: str, sl: Optional["Slice"] = None) -> tuple:
    """``(checkpoint tensor, dim, start, stop)`` that ``param`` (or its slice ``sl`` of the full
    parameter, ``(dim, start, stop)``) reads; ``dim`` None: the whole tensor."""
    dim, start, stop = sl or (None, 0, 0)
    fused = fused_part(cfg, param)
    if fused is None:
        return checkpoint_name(cfg, param), dim, start, stop
    name, first, rows = fused
    if dim is None:
        start, stop = 0, rows
    elif dim != 0:
        raise ValueError(
            f"{param} is part of the fused {name}: only rows of it can be read, not dim {dim}"
        )
    return name, 0, first + start, first + stop


def model_tensors(cfg: ModelConfig, weights) -> set:
    """The names in ``weights`` that the model reads: not the ignored buffers, and not a tied
    LM head (it reads the embedding), so a directory and an in-memory model give the same set."""
    have = {k for k in weights.names() if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")
    return have


def check_checkpoint(cfg: ModelConfig, weights) -> None:
    """Every tensor the full model needs is in ``weights`` with the full model's shape, and
    nothing else is (so a sliced load can trust names and shapes)."""
    with on_meta():
        shapes = {}
        for k, v in LlamaForCausalLM(cfg).state_dict().items():
            name, _, _, stop = source_key(cfg, k)
            shape = tuple(v.shape)
            if fused_part(cfg, k) is not None:  # the fused tensor: the rows of all its parts
                shape = (max(stop, shapes.get(name, (0,))[0]), *shape[1:])
            shapes[name] = shape
    have = model_tensors(cfg, weights)
    missing, unexpected = sorted(set(shapes) - have), sorted(have - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {cfg.model_type} config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}"
        )
    for k, want in shapes.items():
        got = weights.shape(k)
        if got != tuple(want):
            raise ValueError(
                f"checkpoint tensor {k!r} has shape {got}, config expects {tuple(want)}"
            )


Slice = Tuple[int, int, int]  # (dim, start, stop) of the checkpoint tensor


def materialize(
    model: LlamaForCausalLM,
    weights,
    dtype=torch.float32,
    device="cpu",
    slices: Optional[Dict[str, Slice]] = None,
) -> LlamaForCausalLM:
    """Give a model built on the meta device (possibly reshaped by ``ringkv.parallel``) its
    weights: each parameter reads ``checkpoint_name(param)`` or, when ``slices`` names it, only
    that slice of it. Parameters that read the same tensor and slice share one tensor (a tied
    LM head stays tied). ``check_checkpoint`` must have passed."""
    cfg, slices = model.config, slices or {}
    loaded: Dict[tuple, torch.nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            key = source_key(cfg, full, slices.get(full))
            if key not in loaded:
                t = weights.get(*key).to(device=device, dtype=dtype)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint slice {key} has shape {tuple(t.shape)}, {full} expects "
                        f"{tuple(p.shape)}"
                    )
                loaded[key] = torch.nn.Parameter(t, requires_grad=False)
            module._parameters[pname] = loaded[key]
    model.model.rotary = type(model.model.rotary)(cfg).to(device)  # buffer out of the meta device
    return model.eval()


def build(
    cfg: ModelConfig,
    state: Dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device="cpu",
) -> LlamaForCausalLM:
    """Model with ``state`` (HF parameter names) loaded strictly, in ``dtype`` on ``device``."""
    return build_from(cfg, StateDictSource(state), dtype, device)


def build_from(cfg: ModelConfig, weights, dtype=torch.float32, device="cpu") -> LlamaForCausalLM:
    check_checkpoint(cfg, weights)
    with on_meta():
        model = LlamaForCausalLM(cfg)
    return materialize(model, weights, dtype, device)


def load_dir(
    directory: str, dtype=torch.float32, device="cpu"
) -> Tuple[LlamaForCausalLM, ModelConfig]:
    cfg = ModelConfig.from_hf(read_config(directory))
    return build_from(cfg, SafetensorsSource(directory), dtype, device), cfg


def load_hf_model(
    hf_model, dtype=torch.float32, device="cpu"
) -> Tuple[LlamaForCausalLM, ModelConfig]:
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


def open_model(source):
    """``(config, weights, tokenizer_or_None)`` without building the model. ``weights`` reads
    whole tensors or slices on demand (``StateDictSource`` / ``SafetensorsSource``), so a
    parallel rank can build just its shard (``materialize``)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".gguf"):
            hf, tok = load_gguf_hf(path)
            return (
                ModelConfig.from_hf(hf.config.to_dict()),
                StateDictSource(dict(hf.state_dict())),
                tok,
            )
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
        cfg = ModelConfig.from_hf(read_config(path))
        return cfg, SafetensorsSource(path), _maybe_tokenizer(path)
    if isinstance(source, LlamaForCausalLM):
        return source.config, StateDictSource(source.state_dict()), None
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        return (
            ModelConfig.from_hf(source.config.to_dict()),
            StateDictSource(dict(source.state_dict())),
            None,
        )
    raise TypeError(
        f"model must be a path (HF directory or .gguf) or a transformers model, "
        f"got {type(source).__name__}"
    )


def load_model(source, dtype: Optional[torch.dtype] = None, device="cpu"):
    """``(model, config, tokenizer_or_None)`` from a directory, a ``.gguf`` file or a transformers
    model."""
    dtype = dtype or torch.float32
    if isinstance(source, LlamaForCausalLM):  # already ours (tests, parallel runners)
        p = next(source.parameters())
        if p.device != torch.device(device) or p.dtype != dtype:  # never move the caller's model
            import copy

            source = copy.deepcopy(source).to(device=device, dtype=dtype)
        return source.eval(), source.config, None
    cfg, weights, tok = open_model(source)
    return build_from(cfg, weights, dtype, device), cfg, tok


def _maybe_tokenizer(path: str):
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(path)
