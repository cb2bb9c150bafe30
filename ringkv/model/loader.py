"""Build a ``LlamaForCausalLM`` (or a ``HybridForCausalLM``, its subclass, for the hybrid
families: ``new_model``) from an HF directory (safetensors only), an in-memory transformers model,
or a GGUF file (dequantized by transformers' GGUF loader).

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
import re
from typing import Dict, Optional, Tuple, Union

import torch
from torch.overrides import TorchFunctionMode

from .config import CHECKPOINT_RENAMES, ModelConfig
from .hybrid import new_model
from .llama import LlamaForCausalLM

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # checkpoint names that are not weights
# checkpoint tensors a family's model does not read (multi-token prediction, a vision tower)
IGNORED_PREFIXES = {
    "qwen3_5_text": ("mtp.", "model.visual."),
    "qwen3_next": ("mtp.",),
    "nemotron_h": ("mtp.",),
}
# saved checkpoints' names -> transformers' in-memory ones (the model's), as regex substitutions
SAVED_NAMES = {
    "nemotron_h": [(r"^backbone\.", "model.")],
    "qwen3_5_text": [(r"^model\.language_model\.", "model.")],  # an image-text checkpoint
    "granitemoehybrid": [
        (r"\.block_sparse_moe\.input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),
        (r"\.block_sparse_moe\.router\.layer\.weight$", ".block_sparse_moe.router.weight"),
    ],
}


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


class RenamedSource:
    """``weights`` under other names: ``renames`` (``[(saved pattern, ours)]``, regex
    substitutions) applied to each; ``get`` and ``shape`` read the saved tensor (views, as
    ``weights``)."""

    def __init__(self, weights, renames):
        self.weights, self.saved = weights, {}
        for name in weights.names():
            ours = name
            for pattern, repl in renames:
                ours = re.sub(pattern, repl, ours)
            self.saved[ours] = name

    def names(self):
        return set(self.saved)

    def shape(self, name: str) -> tuple:
        return self.weights.shape(self.saved[name])

    def get(self, name: str, *args) -> torch.Tensor:
        return self.weights.get(self.saved[name], *args)


class ExpertsSource:
    """``weights`` whose MoE experts are fused as transformers holds them in memory
    (``experts.gate_up_proj (E, 2I, H)``, ``experts.down_proj (E, H, I)``) seen one expert at a
    time as checkpoints save them (``experts.<e>.gate_proj.weight``, ...): views, no copies (an
    in-memory model's state dict; a safetensors file holding them fused would be read whole)."""

    def __init__(self, weights):
        self.weights, self.parts = weights, {}  # name -> (fused name, expert, first row, rows)
        for name in weights.names():
            base, _, kind = name.rpartition(".experts.")
            if kind not in ("gate_up_proj", "down_proj"):
                self.parts[name] = None
                continue
            experts, rows, _ = weights.shape(name)
            half = rows // 2
            split = (
                {"gate_proj": (0, half), "up_proj": (half, half)}
                if kind == "gate_up_proj"
                else {"down_proj": (0, rows)}
            )  # part -> (first row, rows) of an expert's fused tensor
            for e in range(experts):
                for part, (first, n) in split.items():
                    self.parts[f"{base}.experts.{e}.{part}.weight"] = (name, e, first, n)

    def names(self):
        return set(self.parts)

    def shape(self, name: str) -> tuple:
        part = self.parts[name]
        return self.weights.shape(name) if part is None else self._get(name).shape

    def get(self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0):
        if self.parts[name] is None:
            return self.weights.get(name, dim, start, stop)
        t = self._get(name)
        return t if dim is None else t.narrow(dim, start, stop - start)

    def _get(self, name: str) -> torch.Tensor:
        fused, e, first, rows = self.parts[name]
        return self.weights.get(fused)[e].narrow(0, first, rows)


def in_memory_names(cfg: ModelConfig, weights):
    """``weights`` named as the model's parameters: where a family's saved checkpoints name them
    otherwise (``SAVED_NAMES``: Nemotron-H saves ``backbone.*`` for ``model.*``, Granite its
    experts) and where transformers' in-memory model fuses what checkpoints keep apart (Qwen3-Next's
    experts: ``ExpertsSource``)."""
    renames = SAVED_NAMES.get(cfg.model_type)
    if renames and not isinstance(weights, RenamedSource):
        weights = RenamedSource(weights, renames)
    fused = cfg.model_type == "qwen3_next" and not isinstance(weights, ExpertsSource)
    if fused and any(n.endswith(".experts.gate_up_proj") for n in weights.names()):
        weights = ExpertsSource(weights)
    return weights


def read_safetensors(directory: str) -> Dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``."""
    src = SafetensorsSource(directory)
    return {name: src.get(name) for name in sorted(src.names())}


def checkpoint_name(cfg: ModelConfig, param: str) -> str:
    """The checkpoint tensor a parameter comes from (a tied LM head reads the embedding; a part of
    a fused projection reads the fused tensor; a family's own names: ``CHECKPOINT_RENAMES``)."""
    fused = fused_part(cfg, param)
    if fused is not None:
        return fused[0]
    if cfg.tie_word_embeddings and param == "lm_head.weight":
        param = "model.embed_tokens.weight"
    for ours, theirs in CHECKPOINT_RENAMES.get(cfg.model_type, {}).items():
        if param.startswith(ours):
            return theirs + param[len(ours) :]
    return param


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
    skip = IGNORED_PREFIXES.get(cfg.model_type, ())
    have = {k for k in weights.names() if not k.endswith(IGNORED_SUFFIXES)}
    have = {k for k in have if not k.startswith(skip)} if skip else have
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")
    return have


def check_checkpoint(cfg: ModelConfig, weights) -> None:
    """Every tensor the full model needs is in ``weights`` with the full model's shape, and
    nothing else is (so a sliced load can trust names and shapes)."""
    weights = in_memory_names(cfg, weights)
    with on_meta():
        shapes = {}
        for k, v in new_model(cfg).state_dict().items():
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
            f"{'...' if len(unexpected) > 5 else ''}{_kinds_of(cfg, missing + unexpected)}"
        )
    for k, want in shapes.items():
        got = weights.shape(k)
        if got != tuple(want):
            raise ValueError(
                f"checkpoint tensor {k!r} has shape {got}, config expects {tuple(want)}"
                f"{_kinds_of(cfg, [k])}"
            )


def _kinds_of(cfg: ModelConfig, names) -> str:
    """For a hybrid config: what it says the layers of ``names`` are (``" (config: layer 3 is
    conv)"``), to tell a layer pattern that disagrees with the weights."""
    if cfg.layer_kinds is None:
        return ""
    parts = [n.split(".") for n in names if n.startswith("model.layers.")]
    idx = sorted({int(p[2]) for p in parts if p[2].isdigit()})[:5]
    kinds = ", ".join(f"layer {i} is {cfg.layer_kind(i)}" for i in idx if i < cfg.num_layers)
    return f" (config: {kinds})" if kinds else ""


# (dim, start, stop) of the checkpoint tensor, or (dim, ((start, stop), ...)): several ranges
# of that dim, concatenated in order (a tensor-parallel rank's part of a fused projection)
Slice = Union[Tuple[int, int, int], Tuple[int, Tuple[Tuple[int, int], ...]]]


def materialize(
    model: LlamaForCausalLM,
    weights,
    dtype=torch.float32,
    device="cpu",
    slices: Optional[Dict[str, Slice]] = None,
) -> LlamaForCausalLM:
    """Give a model built on the meta device (possibly reshaped by ``ringkv.parallel``) its
    weights: each parameter reads ``checkpoint_name(param)`` or, when ``slices`` names it, only
    that slice of it (``Slice``: one range of a dim, or several concatenated). Parameters that
    read the same tensor and slice share one tensor (a tied LM head stays tied).
    ``check_checkpoint`` must have passed."""
    cfg, slices = model.config, slices or {}
    weights = in_memory_names(cfg, weights)
    loaded: Dict[tuple, torch.nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            sl = slices.get(full)
            if sl is not None and len(sl) == 2:  # several ranges: a key per range
                key = tuple(source_key(cfg, full, (sl[0], a, b)) for a, b in sl[1])
            else:
                key = source_key(cfg, full, sl)
            if key not in loaded:
                t = _read(weights, key).to(device=device, dtype=dtype)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint slice {key} has shape {tuple(t.shape)}, {full} expects "
                        f"{tuple(p.shape)}"
                    )
                loaded[key] = torch.nn.Parameter(t, requires_grad=False)
            module._parameters[pname] = loaded[key]
    model.model.rotary = type(model.model.rotary)(cfg).to(device)  # buffer out of the meta device
    return model.eval()


def _read(weights, key: tuple) -> torch.Tensor:
    """The tensor ``source_key`` names, or the ranges of a tuple of them concatenated."""
    if isinstance(key[0], tuple):
        return torch.cat([weights.get(*k) for k in key], key[0][1])
    return weights.get(*key)


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
        model = new_model(cfg)
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
