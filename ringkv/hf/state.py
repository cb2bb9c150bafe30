"""The records of a patched model: its patch (``State``), one forward's decisions (``Step``, with
``Packing`` and ``PadStep``) and the output head the chunked loss applies (``Head``).

Per forward, the pre-hook builds one immutable ``Step`` (``plan.py`` decides it), the attention
function reads it and the post-hook consumes it; only the patch's ``State`` changes between hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Tuple

import torch

ATTN_NAME = "ringkv"
IGNORE_INDEX = -100
METHODS = ("ring", "ulysses", "usp", "auto")


@dataclass(frozen=True)
class Packing:
    """Packed documents of one forward: ``cu = (0, l0, l0+l1, ..., rows * row_len)`` over the
    batch rows flattened into one packed row (documents never cross rows). The loss shifts the
    labels inside each row of ``row_len`` tokens (``rows`` is 1 with ``inputs="shard"``)."""

    cu: Tuple[int, ...]
    rows: int
    row_len: int


@dataclass(frozen=True)
class PadStep:
    """A forward of a left-padded batch with a KV cache. Prefill: the rows' real tokens packed as
    one document each (the varlen ring; pads are dropped, never computed or cached); the last
    ``keep`` logits of each row are assembled as ``(B, keep, V)`` from the flat slots ``keep_at``.
    Decode: the ``B * T`` new queries and this rank's packed cache in one kernel call on *virtual*
    positions ``row * span + position`` (a key of another row is never within ``left`` before a
    query, nor after it), then one merge across the group, as for any decode step."""

    rows_kept: torch.Tensor  # (n,) host: the batch row of each token this rank caches
    lengths: torch.Tensor  # (B,) host: real tokens of each row after this forward
    prompt_mask: Optional[torch.Tensor] = None  # prefill: the prompt's mask (B, S) host bool
    keep_rows: int = 0  # prefill: B (logits_to_keep slots are per row)
    q_virtual: Optional[torch.Tensor] = None  # decode: (B*T,) host
    k_virtual: Optional[torch.Tensor] = None  # decode: (S_local,) host, once the cache is begun
    reach: int = 0  # decode: > every position; windows are clamped to it


@dataclass(frozen=True)
class Step:
    """What the pre-hook decided for one forward (read by the attention function and post-hook)."""

    decode: bool
    q_positions: torch.Tensor  # (T,) global positions of this rank's query rows (host, like the
    # cache's: decode masks are classified without a device sync)
    total: int  # global sequence length (real tokens) including this forward
    cache: Optional[object] = None  # the ShardedKVCache this forward fills
    keep: int = 0  # logits_to_keep (prefill): last `keep` global tokens
    keep_at: Optional[torch.Tensor] = None  # where this rank's kept rows go in those `keep`
    targets: Optional[torch.Tensor] = None  # (B, S_local): this rank's targets (labels shifted,
    # then sharded like the inputs; -100 where nothing is predicted), for the loss
    num_items: Optional[float] = None  # HF's num_items_in_batch: the loss's divisor
    chunked: bool = False  # the loss from the hidden states in chunks: no logits are built
    per_token: tuple = ()  # per_token='s fields (hf/logprobs.py), from the hidden states
    temperature: float = 1.0  # per_token_temperature=: per_token's logits divided by it
    packing: Optional[Packing] = None  # packed documents: the varlen ring over packing.cu
    pad: Optional[PadStep] = None  # a left-padded batch with a KV cache (generate)
    pieces: Optional[object] = None  # hybrid models' prefill: ringkv.sp.pieces.Pieces, which rows
    # of each rank belong to which document (the recurrent layers' state passing)
    tokens: Optional[object] = None  # bidirectional models: hf.encoder.Tokens, for pooling
    pooling: Optional[str] = None  # pooling= of the forward: out.pooled (hf/encoder.py)
    spans: Optional[tuple] = None  # prefill: bidirectional spans per row (Gemma 3's images)

    @property
    def cu(self) -> Optional[Tuple[int, ...]]:
        return None if self.packing is None else self.packing.cu


@dataclass
class State:
    """A patched model's patch: how it runs (fixed by ``patch_model``), what undoes it, and the
    forward under way (``step``, set by the pre-hook and cleared by the post-hook)."""

    group: object
    layout: str
    rank: int
    world: int
    method: str
    ulysses: int  # usp: the Ulysses degree (ranks form sp_groups' mesh); else 1
    groups: tuple  # usp: (ulysses_group, ring_group)
    inputs: str
    timeout: Optional[timedelta]
    keep_logits: Optional[bool]  # None: no logits in training forwards with labels; True/False
    loss_chunk: Optional[int]  # tokens per chunk of the chunked loss (None: the default)
    store: Optional[object]  # offload_checkpoints: the CheckpointStore
    undo: Optional["Undo"] = None  # what unpatch_model undoes
    step: Optional[Step] = None
    hidden: Optional[torch.Tensor] = None  # (B, S_local, H): the base model's output (chunked)
    offload: Optional[object] = None  # the offload context of the forward under way
    recompute: Optional[Step] = None  # the last training prefill, for checkpointing's replay
    hybrid: Optional[str] = None  # the model's class name when it has recurrent layers
    attention: str = "ring"  # what the attention layers run: ring, ulysses or usp (hf.method)
    why: str = ""  # why (describe)
    vlm: Optional[object] = None  # a vision-language model's hf.vlm.Vlm (its text decoder)
    encoder: Optional[object] = None  # hf.encoder.Encoder of a bidirectional model; None: causal
    span_type: Optional[int] = None  # Gemma 3: the token type whose runs attend both ways

    @property
    def runs_varlen(self) -> bool:
        """Whether packed documents and left-padded batches can run: they need the varlen ring,
        which ``method="ring"`` runs, and ``"auto"`` too where it shards like the ring (it chose
        the ring or Ulysses: those forwards then run the ring)."""
        return self.attention == "ring" or (self.method == "auto" and self.ulysses == 1)

    @property
    def method_name(self) -> str:
        """``method='...'`` for messages (with what ``"auto"`` chose)."""
        chose = f" (it chose {self.attention})" if self.method == "auto" else ""
        return f"method={self.method!r}{chose}"


def active_step(state: State) -> Optional[Step]:
    """The step of the forward under way on a patched model, or during backward the training
    prefill that activation checkpointing replays; None outside both."""
    return state.step or (state.recompute if torch.is_grad_enabled() else None)


@dataclass(frozen=True)
class Undo:
    """What ``unpatch_model`` undoes: the attention implementation before the patch, the layers
    that hold the patch, the hooks, and the undo functions of ``tile_mlp``."""

    prev_impl: str
    layers: Tuple[torch.nn.Module, ...]
    handles: tuple
    restore: tuple


@dataclass(frozen=True)
class Head:
    """A causal LM's output head as the chunked loss applies it: ``weight`` ``(V, H)``, ``bias``,
    and the model's own transform of its logits (``softcap``: ``cap * tanh(z / cap)``; ``scale``:
    ``z * scale``)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: Optional[float]
    scale: Optional[float]


def model_head(model) -> Optional[Head]:
    """The head of a causal LM for the chunked loss, or None when ringkv cannot apply it itself (no
    linear output embeddings, or no base model whose output it can take): such a model's loss is
    computed from its logits."""
    lin = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(lin, torch.nn.Linear) or getattr(model, "base_model", model) is model:
        return None
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    scale = getattr(model, "logit_scale", None)  # Cohere: logits * logit_scale
    scale = None if scale is None else float(scale)
    if getattr(config, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale = (scale or 1.0) / config.logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None) or None  # Gemma 2/3
    return Head(lin.weight, lin.bias, softcap, scale)


def checkpointing(model) -> bool:
    """Whether HF activation (gradient) checkpointing is on (transformers 5 name, then 4's)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)
