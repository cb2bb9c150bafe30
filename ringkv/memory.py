"""Training memory beyond attention: the MLP over sequence tiles, and checkpoints offloaded.

``patch_model(model, tile_mlp=True, offload_checkpoints=True)`` applies both to a HuggingFace
model; they are model-agnostic and need no process group.

- :func:`tile_mlp`: each decoder layer's MLP runs over tiles of ``tile`` tokens, and its
  backward recomputes one tile at a time, so the MLP's intermediates (``(B, S, I)``, several of
  them, ``I`` ~ 3-4x the hidden size) are never alive for all ``S`` tokens at once: only the
  layer's input is kept. Exact: an MLP is token-wise.
- :func:`offload_checkpoints`: with activation checkpointing on, the layer inputs it saves
  (``(B, S, H)`` per layer, the part of a checkpointed step that grows with depth) go to a
  :class:`CheckpointStore` when saved and come back for backward. :class:`HostStore` copies
  them to pinned host memory on a side CUDA stream and brings the next one back while the
  current layer's backward runs; :class:`FileStore` (tests, CPU) writes them to files.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import types
import weakref
from typing import Callable, List, Optional

import torch

__all__ = ["tile_mlp", "offload_checkpoints", "CheckpointStore", "HostStore", "FileStore", "mlps"]

# child modules by which an MLP is recognised as a token-wise feed-forward block (Llama, Qwen,
# Mistral, Gemma,
# Phi, GPT-style); routed experts (MoE) are not tiled
MLP_FORMS = (
    ("gate_proj", "up_proj", "down_proj"),
    ("up_proj", "down_proj"),
    ("fc1", "fc2"),
    ("c_fc", "c_proj"),
    ("gate_up_proj", "down_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("w1", "w2", "w3"),  # LFM2
)
# a decoder layer: one of these token mixers beside an MLP child of MLP_NAMES (hybrid models:
# gated DeltaNet, Mamba and short-convolution layers instead of attention), or a layer whose
# ``mixer`` is itself the feed-forward block (Nemotron-H's MLP and MoE layers)
MIXER_NAMES = ("self_attn", "linear_attn", "mamba", "conv")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")


def _children(m: torch.nn.Module) -> set:
    return {n for n, _ in m.named_children()}


def _moe(names: set) -> bool:
    return any(n in names for n in ("experts", "router", "gate"))


def _layer_mlp(m: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The feed-forward block of decoder layer ``m``, or None when ``m`` is not one."""
    if any(hasattr(m, n) for n in MIXER_NAMES):
        for n in MLP_NAMES:
            if isinstance(getattr(m, n, None), torch.nn.Module):
                return getattr(m, n)
    mixer = getattr(m, "mixer", None)
    if isinstance(mixer, torch.nn.Module):
        names = _children(mixer)
        if _moe(names) or any(set(f) <= names for f in MLP_FORMS):
            return mixer
    return None


def mlps(model) -> List[torch.nn.Module]:
    """The MLPs of ``model``'s decoder layers (``_layer_mlp``: a token mixer of ``MIXER_NAMES``
    beside a child of ``MLP_NAMES``, or a feed-forward ``mixer``). ``ValueError`` naming
    ``tile_mlp`` when there are none, or one is not a recognised form (mixtures of experts)."""
    found = [mlp for m in model.modules() for mlp in (_layer_mlp(m),) if mlp is not None]
    if not found:
        raise ValueError(
            f"tile_mlp: found no decoder layers (modules with self_attn and mlp) in "
            f"{type(model).__name__}; tile_mlp recognises Llama-style layers"
        )
    for mlp in found:
        names = _children(mlp)
        if _moe(names) or not any(set(f) <= names for f in MLP_FORMS):
            raise ValueError(
                f"tile_mlp: {type(model).__name__}'s MLP {type(mlp).__name__} (children "
                f"{sorted(names)}) is not a recognised token-wise MLP (one of "
                f"{[list(f) for f in MLP_FORMS]}; mixtures of experts are not tiled); pass "
                "tile_mlp=False"
            )
    return found


class _TiledMLP(torch.autograd.Function):
    """``y = fn(x)`` over tiles of ``x`` ``(B, S, H)`` along ``S``; backward recomputes each
    tile."""

    @staticmethod
    def forward(ctx, fn, tile, x, *params):
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        ctx.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in ("cpu", "cuda")
            if d == "cpu" or torch.cuda.is_available()
        ]
        ctx.save_for_backward(x)
        # tile by tile: the whole sequence's intermediates never exist
        return torch.cat(
            [fn(x[:, lo : lo + tile]) for lo in range(0, x.shape[1], tile)], 1
        )  # (B, S, H)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        want = [i for i in range(len(ctx.params)) if ctx.needs_input_grad[3 + i]]
        grads = [None] * len(ctx.params)
        dx = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        for lo in range(0, x.shape[1], ctx.tile):
            xt = x[:, lo : lo + ctx.tile].detach().requires_grad_(dx is not None)
            with torch.enable_grad(), _autocast(ctx.autocast):
                yt = ctx.fn(xt)  # one tile, recomputed
            got = torch.autograd.grad(
                yt,
                ([xt] if dx is not None else []) + [ctx.params[i] for i in want],
                grad_out[:, lo : lo + ctx.tile],
                allow_unused=True,
            )
            if dx is not None:
                dx[:, lo : lo + ctx.tile], got = got[0], got[1:]
            for i, g in zip(want, got):
                grads[i] = g if grads[i] is None else grads[i] if g is None else grads[i] + g
        return (None, None, dx, *grads)


class _autocast:
    """Re-enter the autocast state that a forward ran under (for a recompute in backward)."""

    def __init__(self, states):
        self.ctxs = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in states]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def tile_mlp(model, tile: Optional[int] = None) -> Callable[[], None]:
    """Run every decoder MLP of ``model`` over sequence tiles of ``tile`` tokens (default: the
    hidden size, at least 256), recomputing each tile in backward. Returns the undo function.

    Output and gradients equal the untiled MLP's (a token-wise map). Composes with activation
    checkpointing (the replay runs the tiled MLP again) and with ``torch.compile`` (the tiled
    call is one graph break). ``ValueError`` when an MLP is not recognised (``mlps``).
    """
    found = mlps(model)
    if tile is None:
        hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
        tile = max(256, hidden)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile_mlp must be True or a positive int (tokens per tile), got {tile!r}")
    for mlp in found:
        mlp.forward = types.MethodType(_tiled_forward(type(mlp).forward, tile), mlp)

    def undo():
        for mlp in found:
            del mlp.forward

    return undo


def _tiled_forward(forward, tile: int):
    @torch.compiler.disable
    def tiled(self, x, *args, **kwargs):
        fn = types.MethodType(forward, self)
        if args or kwargs or x.dim() != 3 or x.shape[1] <= tile or not torch.is_grad_enabled():
            return fn(x, *args, **kwargs)  # nothing to save: no tiling needed
        return _TiledMLP.apply(fn, tile, x, *self.parameters())

    return tiled


# ---------------------------------------------------------------------------------------------
# checkpoint offload


class CheckpointStore:
    """Where offloaded checkpoints live between forward and backward: ``put`` takes a tensor
    and returns a handle; ``get`` gives the tensor back (once) for backward."""

    def put(self, tensor: torch.Tensor):
        raise NotImplementedError

    def get(self, handle) -> torch.Tensor:
        raise NotImplementedError


class FileStore(CheckpointStore):
    """Checkpoints in files under ``directory`` (a temporary one by default), each read back once
    and deleted; a handle dropped unread (its graph freed without a backward) deletes its file.
    For tests of the mechanism on CPU, and hosts without a GPU."""

    def __init__(self, directory: Optional[str] = None):
        self.directory = directory or tempfile.mkdtemp(prefix="ringkv-ckpt-")
        if directory is None:  # its own temporary directory goes with it
            weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._ids = itertools.count()
        self.stored = []  # (shape, dtype) of every tensor put, in order

    @property
    def pending(self) -> int:
        """Checkpoints put and not yet read back (or dropped)."""
        return len(os.listdir(self.directory))

    def put(self, tensor):
        path = os.path.join(self.directory, f"{next(self._ids)}.pt")
        torch.save(tensor.detach().cpu().clone(), path)
        self.stored.append((tuple(tensor.shape), tensor.dtype))
        return _FileHandle(path, tensor.device)

    def get(self, handle):
        t = torch.load(handle.path, weights_only=True).to(handle.device)
        handle.done()
        return t


class _FileHandle:
    def __init__(self, path, device):
        self.path, self.device = path, device
        self.done = weakref.finalize(self, _remove, path)  # on read, or when the handle dies unread


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class HostStore(CheckpointStore):
    """Pinned host memory, filled and emptied on a side CUDA stream. ``get`` of a checkpoint
    starts bringing back the one saved before it (the next one backward needs) before it
    returns. A handle owns its host copy: a graph that is dropped without a backward (an
    aborted step) frees its checkpoints with it."""

    def __init__(self, device=None):
        self.stream = torch.cuda.Stream(device)
        self._last = None  # weakref to the newest entry: the next one's predecessor

    def put(self, tensor):
        current = torch.cuda.current_stream(tensor.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            stored = self.stream.record_event()
        tensor.record_stream(self.stream)  # its memory is not reused before the copy ends
        entry = _HostEntry(host, stored, tensor.device, self._last)
        self._last = weakref.ref(entry)
        return entry

    def _fetch(self, e: "_HostEntry"):
        if e.back is None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(e.stored)
                e.back = e.host.to(e.device, non_blocking=True)
                e.ready = self.stream.record_event()

    def get(self, e: "_HostEntry"):
        self._fetch(e)
        prev = e.prev() if e.prev is not None else None
        if prev is not None and prev.host is not None:
            self._fetch(prev)  # the next one backward needs, overlapped with this layer
        t, ready = e.back, e.ready
        e.host = e.back = None
        current = torch.cuda.current_stream(t.device)
        current.wait_event(ready)
        t.record_stream(current)
        return t


class _HostEntry:
    __slots__ = ("host", "stored", "device", "prev", "back", "ready", "__weakref__")

    def __init__(self, host, stored, device, prev):
        self.host, self.stored, self.device, self.prev = host, stored, device, prev
        self.back = self.ready = None


def _offloads(t: torch.Tensor, hidden: int) -> bool:
    """A layer input: a floating ``(B, S, H)`` tensor of the model's hidden size."""
    return t.is_floating_point() and t.dim() == 3 and t.shape[-1] == hidden and t.shape[1] > 1


class offload_checkpoints:
    """A context (entered for the forward of a training step) in which every ``(B, S, H)`` tensor
    that autograd saves outside a checkpointed layer (with activation checkpointing on: each
    layer's input, kept for its replay) goes to ``store`` and comes back in backward."""

    def __init__(self, store: CheckpointStore, hidden: int):
        self.store, self.hidden = store, hidden
        self._hooks = None

    def _pack(self, t):
        if not _offloads(t, self.hidden):
            return t
        return _Offloaded(self.store.put(t))

    def _unpack(self, x):
        return self.store.get(x.handle) if isinstance(x, _Offloaded) else x

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)


class _Offloaded:
    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle
