"""Sequence-parallel (ring) attention for HuggingFace causal LMs in one call.

    model = ringkv.patch_model(model, group=sp_group, layout="zigzag")   # every rank of the group
    # ids: the FULL sequence on every rank (inputs="full")
    out = model(input_ids=ids)
    logits = out.logits                         # (B, S_pad / N, V): this rank's shard, in `layout`
    full = ringkv.gather_logits(logits, "zigzag", sp_group, seq_len=ids.shape[1])  # (B, S, V)
    loss = ringkv.causal_lm_loss(logits, labels, layout="zigzag", group=sp_group)  # global mean
    # no logits built (keep_logits)
    loss = model.train()(input_ids=ids, labels=ids, use_cache=False).loss
    tokens = model.generate(ids, max_new_tokens=32, do_sample=False)   # sharded KV cache

How it works: ``patch_model`` registers the attention function ``"ringkv"`` with transformers'
public ``AttentionInterface`` and switches the model to it with ``set_attn_implementation``.
A forward pre-hook on the model shards the inputs and supplies *global* ``position_ids`` (so
rotary embeddings and causal masks see global positions in every layout); the attention
function runs ``ringkv.ring_attention`` (or ``ulysses_attention`` / ``usp_attention`` with
``method=``; prefill, differentiable) or ``ringkv.sp.decode.decode_attention`` (new tokens over
the sharded cache), with the layer's sliding window when it has one. A forward hook
assembles ``logits_to_keep`` logits and the loss when ``labels`` are passed.

Training (``model.train()``, ``labels`` or ``shift_labels``): the loss comes from the base model's
last hidden states through the head in chunks (``kernels/linear_ce.py``) and ``out.logits`` is
``None``: the ``(B, S/N, V)`` logits are never built (``keep_logits=True`` keeps them). HF's
``num_items_in_batch`` divides it. ``tile_mlp`` and ``offload_checkpoints`` (``ringkv/memory.py``)
take the MLP's and the checkpoints' share of a step down too.

Inputs (``inputs=`` of ``patch_model``):

- ``"full"`` (default): every rank passes the whole ``input_ids`` (or ``inputs_embeds``),
  ``(B, S)``. ringkv shards them in ``layout``. When ``S`` is not a multiple of the layout's
  granule (``N`` ranks: ``N`` for contiguous/striped, ``2N`` for zigzag) the sequence is padded
  **at the end** to ``S_pad`` (pad token ``config.pad_token_id`` or 0). Causal attention never
  lets a real token see a later one, so real tokens are exact; the padded rows appear in the
  local logits (``gather_logits(..., seq_len=S)`` drops them, ``causal_lm_loss`` ignores them)
  and are never stored in the KV cache.
- ``"shard"``: every rank passes its own shard ``(B, S/N)`` in ``layout`` (e.g. from
  ``ringkv.shard``), optionally with ``position_ids`` that must be the shard's global
  positions (``ringkv.positions(S, layout, rank, N)``); ringkv computes them when omitted.
  No padding is added: ``S`` must be a multiple of the granule.

Packed documents (training and scoring, ``method="ring"``): ``position_ids`` that restart at 0
for each document (``DataCollatorWithFlattening``), and/or ``cu_seq_lens_q``/``cu_seq_lens_k``
with ``max_length_q``/``max_length_k``, and/or ``seq_idx`` (checked against each other). Each
document attends only within itself: the batch rows are flattened into one packed row
(``cu = packed_cu_seqlens(...)``, over ``B * S`` tokens), sharded with ``shard(...,
cu_seqlens=cu)`` (every document split by the layout and padded on its own) and run through the
varlen ring; ``out.logits`` is this rank's ``(1, L_local, V)``; ``gather_logits`` and
``causal_lm_loss`` take the same ``position_ids`` / ``seq_idx`` / ``cu_seqlens``. With
``inputs="shard"`` pass the shard of the packed row and the whole row's ``cu_seq_lens_q``.
Padding: zeros at the end of a row (or of a packed document) in ``attention_mask`` are honoured
by ignoring them (causal attention never lets a real token see a later pad); the targets of
padded tokens must be -100. Other zeros (holes, left padding) are a ``ValueError`` (left padding
with a KV cache is batched generation: below). Packed or right-padded forwards keep no KV cache.

Once a ``ShardedKVCache`` holds tokens, later calls (decode steps) take new tokens that are the
same on every rank (``(B, T)``, any ``T >= 1``) in both modes; they are appended to one owner
rank's cache (round-robin over steps) and every rank gets the same logits.

Left-padded batches (batched ``generate``, ``inputs="full"``, ``method="ring"``): with a KV cache,
an ``attention_mask`` whose rows are zeros then ones and ``position_ids = mask.cumsum(-1) - 1`` at
the real tokens (what generate passes) run the prefill as the varlen ring over the rows' real tokens
packed one document per row; pads are never computed or cached. The cache then packs every row's
real tokens into one cache row (``cache.rows``: whose each is; ``cache.lengths``: real tokens per
row); a decode step must pass the grown mask (the prompt's, then ones) and each row's next
positions, and attends in one kernel call on virtual positions ``row * 2R + position`` (no key of
another row is visible) with the usual single all-gather merge per layer.

Generation: ``model.generate`` (``inputs="full"``) works as usual on every rank in lockstep;
an empty ``DynamicCache`` (generate's default) is replaced by a :class:`ShardedKVCache` that
keeps only this rank's tokens. Sampling must use the same seed on every rank.

Not supported (clear errors): padding in ``attention_mask`` other than at the end of rows or
documents (training, scoring) or at the start of rows (with a KV cache: batched generate), a pad
pattern that changes between decode steps, attention dropout, non-causal attention, models that
do not call attention through ``AttentionInterface``. Soft-capping (Gemma 2's ``softcap``),
attention sinks (gpt-oss's ``s_aux``) and a V head size of its own (MLA: DeepSeek-V3, Kimi-K2)
run in every SP method and in decode, exactly.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..sp.collectives import agree, all_gather, all_sum, rank_world
from ..sp.decode import decode_attention
from .. import memory
from ..kernels.linear_ce import linear_cross_entropy
from ..kernels.mask import NO_WINDOW
from ..sp.layout import (
    check_cu_seqlens,
    check_layout,
    check_seq_len,
    granule,
    positions,
    shard,
    varlen_index,
    varlen_local_len,
)
from ..sp.ring import ring_attention
from ..sp.ulysses import head_plan, ulysses_attention
from ..sp.usp import sp_groups, usp_attention

__all__ = [
    "patch_model",
    "unpatch_model",
    "gather_logits",
    "causal_lm_loss",
    "packed_cu_seqlens",
    "ShardedKVCache",
    "ATTN_NAME",
]

ATTN_NAME = "ringkv"
IGNORE_INDEX = -100
PADDING_HELP = (
    "ringkv: attention_mask contains padding (zeros) in a decode step, but the prompt in the KV "
    "cache had none: a batch's pad pattern cannot change between steps. Left-pad the prompts "
    "(zeros as a prefix of each row, as generate does) and pass the attention_mask that generate "
    "grows"
)
LEFT_PAD_HELP = (
    "each row of attention_mask must be zeros followed by ones (left padding, as batched generate "
    "pads), with at least one real token"
)
# keyword arguments that describe packed documents (what DataCollatorWithFlattening adds besides
# position_ids)
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache


class ShardedKVCache(_dynamic_cache()):
    """A ``DynamicCache`` that keeps only this rank's tokens of a sequence-sharded KV cache.

    ``positions`` ``(S_local,)`` are the global positions of the cached tokens (the same for
    every layer); ``get_seq_length()`` returns the *global* number of tokens seen, which is
    what ``generate`` expects. The model's pre-hook tells the cache, before each forward,
    which of the forward's rows this rank keeps.

    It keeps whatever a layer passes to ``update``, token by token along dim 2: keys ``(B, Hkv,
    T, D)`` and values ``(B, Hkv, T, Dv)``, or MLA's compressed latents (DeepSeek-V3 caches a
    one-head ``(B, 1, T, kv_lora_rank)`` latent as keys and its rotary key ``(B, 1, T, rope)`` as
    values, and expands them into every head's K and V after reading them back).
    """

    def __init__(self):
        super().__init__()
        self.positions = torch.zeros(0, dtype=torch.long)
        self.seen = 0  # global tokens in the sequence so far (same on every rank)
        self.decode_steps = 0  # forwards after the prefill: the owner of step i is rank i % N
        self._keep: Optional[torch.Tensor] = None  # rows of the current forward to cache
        self._prefill = False
        # a left-padded batch (``lengths`` set): pads are never cached; the real tokens of all rows
        # are packed into
        # one cache row (keys (1, Hkv, S_local, D)), ``rows`` (S_local,) says whose each is
        self.rows: Optional[torch.Tensor] = None  # host: the batch row of each cached token
        self.lengths: Optional[torch.Tensor] = (
            None  # host (B,): real tokens of each row so far (global)
        )
        self.pad_mask: Optional[torch.Tensor] = (
            None  # host bool (B, S_prompt): the prompt's attention_mask
        )
        self._pack = False  # this forward's (B, Hkv, T, D) are packed into (1, Hkv, B*T, D)

    def _begin(
        self, positions_kept: torch.Tensor, keep: Optional[torch.Tensor], prefill: bool, seen: int
    ) -> None:
        self.positions = torch.cat([self.positions.to(positions_kept.device), positions_kept])
        self._keep, self._prefill, self.seen = keep, prefill, seen

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key/value_states (B, Hkv, T, D): cache only this rank's rows
        k, v = key_states, value_states
        if (
            self._pack
        ):  # a left-padded batch's decode step: row-major (b, t) order, as _begin_rows numbers them
            k, v = (x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[3]) for x in (k, v))
        if self._keep is not None:
            k, v = k[:, :, self._keep], v[:, :, self._keep]
        keys, values = super().update(k, v, layer_idx, *args, **kwargs)  # (B, Hkv, S_local, D)
        if self._prefill:  # the ring needs the forward's whole shard (padding rows included)
            return key_states, value_states
        return keys, values

    def _begin_rows(
        self,
        rows_kept: torch.Tensor,
        lengths: torch.Tensor,
        pad_mask: Optional[torch.Tensor],
        pack: bool,
    ) -> None:
        self.rows = rows_kept if self.rows is None else torch.cat([self.rows, rows_kept])
        self.lengths, self._pack = lengths, pack
        if pad_mask is not None:
            self.pad_mask = pad_mask

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "ShardedKVCache cannot be cropped (assisted decoding is not supported)"
        )


@dataclass
class _Step:
    """What the pre-hook decided for one forward (read by the attention function and post-hook)."""

    decode: bool
    q_positions: torch.Tensor  # (T,) global positions of this rank's query rows (host, like the
    # cache's: decode masks are classified without a device sync)
    total: int  # global sequence length (real tokens) including this forward
    cache: Optional[ShardedKVCache] = None
    keep: int = 0  # logits_to_keep (prefill): last `keep` global tokens
    keep_at: Optional[torch.Tensor] = None  # where this rank's kept rows go in those `keep`
    labels: Optional[torch.Tensor] = None  # whole rows' labels (B, S) (or the packed row's)
    shifted: bool = False  # labels are shift_labels: the target of each token, not shifted again
    num_items: Optional[float] = (
        None  # HF's num_items_in_batch: the loss's divisor (else the global count)
    )
    chunked: bool = False  # the loss from the hidden states in chunks: no logits are built
    hidden: Optional[torch.Tensor] = (
        None  # (B, S_local, H): the base model's output, for the chunked loss
    )
    packing: Optional["_Packing"] = None  # packed documents: the varlen ring over packing.cu
    pad: Optional["_PadStep"] = None  # a left-padded batch with a KV cache (generate)

    @property
    def cu(self) -> Optional[Tuple[int, ...]]:
        return None if self.packing is None else self.packing.cu


@dataclass
class _PadStep:
    """A forward of a left-padded batch with a KV cache. Prefill: the rows' real tokens packed as
    one document each (the varlen ring; pads are dropped, never computed or cached); the last
    ``keep`` logits of each row are assembled as ``(B, keep, V)`` from the flat slots ``keep_at``.
    Decode: the
    ``B * T`` new queries and this rank's packed cache in one kernel call on *virtual* positions
    ``row * span + position`` (a key of another row is never within ``left`` before a query, nor
    after it), then one merge across the group, as for any decode step."""

    rows_kept: torch.Tensor  # (n,) host: the batch row of each token this rank caches
    lengths: torch.Tensor  # (B,) host: real tokens of each row after this forward
    prompt_mask: Optional[torch.Tensor] = None  # prefill: the prompt's mask (B, S) host bool
    keep_rows: int = 0  # prefill: B (logits_to_keep slots are per row)
    q_virtual: Optional[torch.Tensor] = None  # decode: (B*T,) host
    k_virtual: Optional[torch.Tensor] = (
        None  # decode: (S_local,) host, set after the cache's update is planned
    )
    reach: int = 0  # decode: > every position; windows are clamped to it


@dataclass(frozen=True)
class _Packing:
    """Packed documents of one forward: ``cu = (0, l0, l0+l1, ..., rows * row_len)`` over the
    batch rows flattened into one packed row (documents never cross rows). The loss shifts the
    labels inside each row of ``row_len`` tokens (``rows`` is 1 with ``inputs="shard"``)."""

    cu: Tuple[int, ...]
    rows: int
    row_len: int


METHODS = ("ring", "ulysses", "usp")


@dataclass
class _State:
    group: object
    layout: str
    rank: int
    world: int
    method: str
    ulysses: int  # usp: the Ulysses degree (ranks form sp_groups' mesh); else 1
    groups: tuple  # usp: (ulysses_group, ring_group)
    inputs: str
    timeout: Optional[timedelta]
    prev_impl: str
    modules: List[torch.nn.Module]
    handles: list = field(default_factory=list)
    restore: list = field(default_factory=list)  # undo tile_mlp (unpatch_model)
    store: Optional[object] = None  # offload_checkpoints: the CheckpointStore
    offload: Optional[object] = None  # the offload context of the forward under way
    keep_logits: Optional[bool] = (
        None  # None: no logits in training forwards with labels; True: always; False: never
    )
    loss_chunk: Optional[int] = (
        None  # tokens per chunk of the chunked loss (None: linear_ce.default_chunk)
    )
    step: Optional[_Step] = None  # set by the pre-hook for one forward, cleared by the post-hook
    recompute: Optional[_Step] = (
        None  # the last training prefill, for activation checkpointing's replay
    )


# ---------------------------------------------------------------------------------------------
# the attention function transformers calls


def ringkv_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """``AttentionInterface`` function: query ``(B, H, S, D)``, key ``(B, Hkv, S_kv, D)``, value
    ``(B, Hkv, S_kv, Dv)`` -> ``(attn_output (B, S, H, Dv), None)``. ``softcap`` and sinks
    (``s_aux``
    ``(H,)``) are applied as the model's eager attention does."""
    state = getattr(module, "_ringkv_state", None)
    step = (
        None
        if state is None
        else state.step or (state.recompute if torch.is_grad_enabled() else None)
    )
    if step is None:
        raise RuntimeError(
            "ringkv attention ran outside the forward of a model patched by ringkv.patch_model: "
            "call the patched model itself (not a submodule), or ringkv.unpatch_model it"
        )
    if dropout:
        raise ValueError(
            f"ringkv: attention dropout ({dropout}) is not supported; set "
            "config.attention_dropout=0 "
            f"or call model.eval()"
        )
    # transformers' sliding window of W tokens: a query sees itself and the W - 1 keys before it
    window = NO_WINDOW if sliding_window is None else (sliding_window - 1, 0)
    softcap = softcap or None  # transformers passes 0/None for "no cap"
    sinks = kwargs.get("s_aux")  # gpt-oss: one sink logit per query head
    if not getattr(module, "is_causal", True):
        raise ValueError("ringkv: only causal (decoder) self-attention is supported")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) ringkv layout
    if (
        step.decode and step.pad is not None
    ):  # left-padded rows: one call on virtual positions (see _PadStep)
        b, t, h, d = q.shape
        left = step.pad.reach if window[0] < 0 else min(window[0], step.pad.reach)
        out = decode_attention(
            q.reshape(1, b * t, h, d),
            k,
            v,
            q_positions=step.pad.q_virtual,
            k_positions=step.pad.k_virtual,
            group=state.group,
            softmax_scale=scaling,
            timeout=state.timeout,
            window=(left, 0),
            softcap=softcap,
            sinks=sinks,
        )
        return out.view(b, t, h, out.shape[-1]), None  # (B, T, H, D)
    if step.decode:
        out = decode_attention(
            q,
            k,
            v,
            q_positions=step.q_positions,
            k_positions=step.cache.positions,
            group=state.group,
            softmax_scale=scaling,
            timeout=state.timeout,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
        return out, None  # (B, T, H, D)
    # the pre-hook already checked that every rank makes the same call
    kw = dict(
        causal=True,
        layout=state.layout,
        softmax_scale=scaling,
        timeout=state.timeout,
        check=False,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    if state.method == "ulysses":
        out = ulysses_attention(q, k, v, group=state.group, **kw)
    elif state.method == "usp":
        out = usp_attention(
            q, k, v, ulysses_group=state.groups[0], ring_group=state.groups[1], **kw
        )
    else:
        # packed documents (step.cu): the varlen ring, each document split by the layout on its own
        out = ring_attention(q, k, v, group=state.group, cu_seqlens=step.cu, **kw)
    return out, None  # (B, S_local, H, D)


# ---------------------------------------------------------------------------------------------
# input handling


def _as_kwargs(model, args, kwargs) -> dict:
    kw = dict(kwargs)
    names = list(inspect.signature(model.forward).parameters)
    for name, a in zip(names, args):
        kw[name] = a
    if "past_key_values" in kw and "cache" in names:
        kw["cache"] = kw.pop("past_key_values")
    return kw


def _checksum(ids: Optional[torch.Tensor]) -> int:
    if ids is None:
        return 0
    flat = ids.detach().reshape(-1).long().cpu()
    return int((flat * torch.arange(1, flat.numel() + 1)).sum()) & ((1 << 62) - 1)


def _check_positions(given, want: torch.Tensor, what: str) -> None:
    if given is None:
        return
    if (
        given.dim() != 2
        or given.shape[-1] != want.numel()
        or not torch.equal(given.to(want.device), want.expand(given.shape[0], -1))
    ):
        raise ValueError(
            f"ringkv: position_ids must be {what} (shape (B, {want.numel()})); other position ids "
            f"(offsets) are not supported. Omit position_ids to let ringkv supply them"
        )


# ---------------------------------------------------------------------------------------------
# packed documents and padding masks


def _as_rows(x, b: int, t: int, name: str) -> torch.Tensor:
    """``x`` as a ``(B, S)`` integer tensor on the host (``(S,)`` and ``(1, S)`` broadcast over
    rows)."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"ringkv: {name} must be an integer tensor, got {x.dtype}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2 or x.shape[1] != t or x.shape[0] not in (1, b):
        raise ValueError(
            f"ringkv: {name} must have the shape of the inputs ({b}, {t}) (or (1, {t})), "
            f"got {tuple(x.shape)}"
        )
    return x.detach().long().cpu().expand(b, t)


def _starts_from_positions(pos: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` bool, True where a document starts: position ids restart at 0 for each packed
    document and increase by 1 inside it."""
    prev = torch.cat([pos.new_full((pos.shape[0], 1), -1), pos[:, :-1]], 1)
    ok = (pos == 0) | (pos == prev + 1)
    if not bool(ok.all()):
        r, i = (~ok).nonzero()[0].tolist()
        got = (
            f"{int(pos[r, i])} at index 0"
            if i == 0
            else f"{int(prev[r, i])} then {int(pos[r, i])} at index {i}"
        )
        raise ValueError(
            "ringkv: position_ids must restart at 0 for each packed document and increase by 1 "
            f"inside it (as DataCollatorWithFlattening makes them); row {r} has {got}. Omit "
            "position_ids for one unpacked sequence per row (other offsets are not supported)"
        )
    return pos == 0


def _starts_from_seq_idx(idx: torch.Tensor) -> torch.Tensor:
    step = idx[:, 1:] - idx[:, :-1]
    if bool((step < 0).any()):
        r, i = (step < 0).nonzero()[0].tolist()
        raise ValueError(
            "ringkv: seq_idx must number the packed documents of a row in order (never decreasing: "
            f"a document's tokens are contiguous); row {r} goes from {int(idx[r, i])} to "
            f"{int(idx[r, i + 1])} at index {i + 1}"
        )
    return torch.cat([torch.ones(idx.shape[0], 1, dtype=torch.bool), step != 0], 1)


def _cu_tuple(cu, name: str) -> Tuple[int, ...]:
    try:
        return check_cu_seqlens(cu)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ringkv: {name}: {e}") from None


def _starts_from_cu(cu, b: int, t: int, name: str) -> torch.Tensor:
    cu = _cu_tuple(cu, name)
    if cu[-1] != b * t:
        raise ValueError(
            f"ringkv: {name} must end at the number of tokens of the flattened batch, {b} x {t} = "
            f"{b * t}, got {list(cu)[-4:]}: the documents must cover the rows exactly"
        )
    starts = torch.zeros(b * t, dtype=torch.bool)
    starts[list(cu[:-1])] = True
    starts = starts.view(b, t)
    if not bool(starts[:, 0].all()):
        r = int((~starts[:, 0]).nonzero()[0])
        raise ValueError(
            f"ringkv: {name} puts a document across batch rows {r - 1} and {r}; every row must "
            f"start a document (the multiples of the row length {t} must be in {name})"
        )
    return starts


def _packing(
    b: int,
    t: int,
    *,
    position_ids=None,
    seq_idx=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    max_length_q=None,
    max_length_k=None,
    cu_seqlens=None,
    always: bool = False,
) -> Optional[_Packing]:
    """The packed documents that the given arguments describe for inputs ``(b, t)``, checked
    against each other, or ``None`` when there are none: no argument, or only ``position_ids``
    that are ``0..t-1`` on every row (an ordinary batch; ``always`` returns those documents too)."""
    forms = []
    if position_ids is not None:
        forms.append(
            ("position_ids", _starts_from_positions(_as_rows(position_ids, b, t, "position_ids")))
        )
    if seq_idx is not None:
        forms.append(("seq_idx", _starts_from_seq_idx(_as_rows(seq_idx, b, t, "seq_idx"))))
    for name, cu in (
        ("cu_seqlens", cu_seqlens),
        ("cu_seq_lens_q", cu_seq_lens_q),
        ("cu_seq_lens_k", cu_seq_lens_k),
    ):
        if cu is not None:
            forms.append((name, _starts_from_cu(cu, b, t, name)))
    lengths = [
        (n, m)
        for n, m in (("max_length_q", max_length_q), ("max_length_k", max_length_k))
        if m is not None
    ]
    if not forms:
        if lengths:
            raise ValueError(
                "ringkv: max_length_q/max_length_k describe packed documents; pass cu_seq_lens_q/"
                "cu_seq_lens_k (or position_ids that restart at 0 for each document) with them"
            )
        return None
    first, starts = forms[0]
    for name, other in forms[1:]:
        if not torch.equal(other, starts):
            r, i = (other != starts).nonzero()[0].tolist()
            raise ValueError(
                f"ringkv: {first} and {name} describe different packed documents: at row {r}, "
                f"token {i} {first} {'starts' if starts[r, i] else 'continues'} a document and "
                f"{name} does not; pass arguments that agree, or only one of them"
            )
    cu = starts.reshape(-1).nonzero().squeeze(1).tolist() + [b * t]
    longest = max(hi - lo for lo, hi in zip(cu, cu[1:]))
    for name, m in lengths:
        if isinstance(m, bool) or not isinstance(m, (int, torch.Tensor)) or int(m) != longest:
            raise ValueError(
                f"ringkv: {name}={m!r} but the longest packed document has {longest} tokens"
            )
    if not always and [n for n, _ in forms] == ["position_ids"] and len(cu) == b + 1:
        return None  # position_ids 0..t-1 on every row: nothing is packed
    return _Packing(tuple(cu), b, t)


def packed_cu_seqlens(
    position_ids=None,
    *,
    seq_idx=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    max_length_q=None,
    max_length_k=None,
) -> List[int]:
    """``[0, l0, l0+l1, ..., B*S]``: the packed documents of a batch, from any of the arguments a
    packing collator makes (``DataCollatorWithFlattening``: ``position_ids`` that restart at 0
    per document, ``cu_seq_lens_q/k`` and ``max_length_q/k``, ``seq_idx``), checked against each
    other (``ValueError`` when they disagree). ``(B, S)`` rows are flattened: row ``r``'s
    documents follow row ``r - 1``'s. This is the ``cu_seqlens`` that ``ringkv.shard(ids.reshape(1,
    -1), 1, layout, cu_seqlens=...)`` takes to shard a packed batch for ``inputs="shard"``."""
    kw = dict(
        position_ids=position_ids,
        seq_idx=seq_idx,
        cu_seq_lens_q=cu_seq_lens_q,
        cu_seq_lens_k=cu_seq_lens_k,
        max_length_q=max_length_q,
        max_length_k=max_length_k,
    )
    pk = _packing(
        *_batch_shape(
            None,
            position_ids,
            seq_idx,
            cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k,
        ),
        always=True,
        **kw,
    )
    if pk is None:
        raise ValueError(
            "packed_cu_seqlens: pass position_ids, seq_idx or cu_seq_lens_q/cu_seq_lens_k"
        )
    return list(pk.cu)


def _batch_shape(shape, position_ids, seq_idx, cu) -> Tuple[int, int]:
    """``(B, S)`` of a batch described by these arguments (``cu`` alone: one packed row)."""
    if shape is not None:
        return tuple(shape)
    for x in (position_ids, seq_idx):
        if x is not None:
            x = torch.as_tensor(x)
            return (x.shape[0], x.shape[1]) if x.dim() == 2 else (1, x.shape[-1])
    return (1, _cu_tuple(cu, "cu_seqlens")[-1]) if cu is not None else (1, 0)


def _helper_packing(
    shape, cu_seqlens, position_ids, seq_idx, logits_rows: int
) -> Optional[_Packing]:
    """The packing that ``gather_logits`` / ``causal_lm_loss`` were told about, as the model decides
    it.
    ``position_ids`` of one document per row alone do not say it: the model packs such rows into
    one (logits ``(1, L_local, V)``) when it was also given ``cu_seq_lens_q/k`` or ``seq_idx``
    (``DataCollatorWithFlattening`` gives all of them), and runs them as an ordinary batch when
    it was not; the logits' row count tells which."""
    if cu_seqlens is None and position_ids is None and seq_idx is None:
        return None
    b, t = _batch_shape(shape, position_ids, seq_idx, cu_seqlens)
    return _packing(
        b,
        t,
        position_ids=position_ids,
        seq_idx=seq_idx,
        cu_seqlens=cu_seqlens,
        always=b > 1 and logits_rows == 1,
    )


def _shard_packing(pk_kw: dict, pos, b: int, t: int, layout: str, rank: int, world: int):
    """``inputs="shard"``: ``(packing, positions)`` of this rank's shard of a packed row, from the
    whole row's ``cu_seq_lens_q/k`` (the same on every rank), or ``(None, None)``."""
    cus = [(n, _cu_tuple(pk_kw[n], n)) for n in ("cu_seq_lens_q", "cu_seq_lens_k") if n in pk_kw]
    if not cus:
        if pk_kw:
            raise ValueError(
                "ringkv: with inputs='shard', packed documents are given by cu_seq_lens_q (the "
                "whole packed row's [0, l0, l0+l1, ..., S], the same on every rank); got only "
                f"{', '.join(sorted(pk_kw))}"
            )
        return None, None
    if len(cus) == 2 and cus[0][1] != cus[1][1]:
        raise ValueError(
            "ringkv: cu_seq_lens_q and cu_seq_lens_k describe different packed documents; causal "
            "self-attention needs the same documents for queries and keys"
        )
    cu = cus[0][1]
    longest = max(hi - lo for lo, hi in zip(cu, cu[1:]))
    for name in ("max_length_q", "max_length_k"):
        m = pk_kw.get(name)
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, (int, torch.Tensor)) or int(m) != longest
        ):
            raise ValueError(
                f"ringkv: {name}={m!r} but the longest packed document has {longest} tokens"
            )
    if b != 1:
        raise ValueError(
            "ringkv: inputs='shard' with packed documents takes one packed row (1, S_local), got "
            f"batch {b}; flatten the batch into one row (documents of all rows, cu_seq_lens_q over "
            "them)"
        )
    want = varlen_local_len(cu, layout, world)
    if t != want:
        raise ValueError(
            f"ringkv: cu_seq_lens_q gives every rank's shard of the packed row {want} tokens (each "
            f"document padded on its own) in layout {layout!r} over {world} rank(s), got {t}; "
            "shard with ringkv.shard(ids, 1, layout, group, cu_seqlens=cu_seq_lens_q)"
        )
    q_pos = positions(cu[-1], layout, rank, world, cu_seqlens=cu)  # (t,) host
    if pos is not None:
        pos = torch.as_tensor(pos)
        if (
            pos.dim() not in (1, 2)
            or pos.shape[-1] != t
            or not torch.equal(pos.detach().cpu().reshape(-1, t)[0], q_pos)
        ):
            raise ValueError(
                "ringkv: position_ids of a packed shard must be this rank's positions within their "
                f"documents, ringkv.positions(S, layout, rank, N, cu_seqlens=cu) (shape (1, {t})), "
                "or omitted (ringkv supplies them)"
            )
    if "seq_idx" in pk_kw:
        idx = _as_rows(pk_kw["seq_idx"], 1, t, "seq_idx")[0]
        index = varlen_index(cu, layout, rank, world)
        real = index >= 0
        doc = torch.searchsorted(torch.tensor(cu), index[real], right=True) - 1
        seq = idx[real]
        same = doc[1:] == doc[:-1]
        if not bool(torch.where(same, seq[1:] == seq[:-1], seq[1:] > seq[:-1]).all()):
            raise ValueError(
                "ringkv: seq_idx of a packed shard must be ringkv.shard(seq_idx, 1, layout, "
                "cu_seqlens=cu) of the row's seq_idx: one number per document, increasing with it"
            )
    return _Packing(cu, 1, cu[-1]), q_pos


def _starts(pk: Optional[_Packing], b: int, t: int) -> torch.Tensor:
    """``(b, t)`` bool: where a segment starts (a row, or each packed document of the flattened
    rows)."""
    starts = torch.zeros(b * t, dtype=torch.bool)
    starts[list(pk.cu[:-1]) if pk is not None else list(range(0, b * t, t))] = True
    return starts.view(b, t)


def _check_padding(
    mask: torch.Tensor,
    starts: torch.Tensor,
    labels: Optional[torch.Tensor],
    shift_labels: Optional[torch.Tensor] = None,
) -> None:
    """Zeros of ``attention_mask`` ``(R, L)`` must end their row or packed document (right padding:
    causal attention never lets a real token see a later pad, so ignoring them is exact), and a
    padded token must predict nothing (``labels[:, i + 1] == -100``, or
    ``shift_labels[:, i] == -100``, where ``mask[:, i] == 0``)."""
    m = mask.detach().bool().cpu()
    bad = ~m[:, :-1] & m[:, 1:] & ~starts[:, 1:]  # a zero followed by a one in the same segment
    if bool(bad.any()):
        r, i = bad.nonzero()[0].tolist()
        cuts = starts[r].nonzero().squeeze(1).tolist() + [m.shape[1]]
        lo = max(c for c in cuts if c <= i)
        hi = min(c for c in cuts if c > i)
        seg = m[r, lo:hi]
        where = (
            f"row {r}"
            if (lo, hi) == (0, m.shape[1]) and len(cuts) == 2
            else f"row {r}, the packed document at tokens {lo}..{hi - 1}"
        )
        if int((~seg).nonzero().max()) < int(seg.nonzero().min()):
            raise ValueError(
                f"ringkv: attention_mask has left padding (zeros before the tokens) in {where}; "
                "patch_model honours right padding only (zeros at the end of each row or packed "
                "document). Pad on the right (labels -100 at the pads), or pass rows of equal "
                "length"
            )
        raise ValueError(
            f"ringkv: attention_mask has zeros between real tokens (a hole) in {where}; "
            "patch_model honours only zeros at the end of each row or packed document (right "
            "padding). Pack the pieces as separate documents (position_ids that restart at 0), or "
            "drop the hole"
        )
    if labels is None and shift_labels is not None:  # shift_labels[:, i] is labels[:, i + 1]
        labels = F.pad(shift_labels.detach().cpu()[:, :-1], (1, 0), value=IGNORE_INDEX)
    if labels is not None:
        lab = labels.detach().cpu()
        wrong = ~m[:, :-1] & (lab[:, 1:] != IGNORE_INDEX)
        if bool(wrong.any()):
            r, i = wrong.nonzero()[0].tolist()
            raise ValueError(
                f"ringkv: a padded token predicts nothing: labels must be -100 after every padded "
                f"position (row {r}: attention_mask[{r}, {i}] is 0 but labels[{r}, {i + 1}] is "
                f"{int(lab[r, i + 1])}); set the labels of the padded tokens to -100"
            )


def _check_shift_labels(labels: torch.Tensor, shift_labels: torch.Tensor) -> None:
    """``shift_labels`` ``(B, S)`` given with ``labels`` must be them shifted:
    ``shift_labels[:, i] == labels[:, i + 1]``, -100 at the end of each row."""
    want = F.pad(labels.detach()[:, 1:], (0, 1), value=IGNORE_INDEX)
    got = shift_labels.detach().to(want.device)
    if not torch.equal(got.long(), want.long()):
        r, i = (got != want).nonzero()[0].tolist()
        raise ValueError(
            f"ringkv: shift_labels and labels disagree: shift_labels[{r}, {i}] is {int(got[r, i])} "
            f"but labels shifted by one give {int(want[r, i])} (shift_labels[:, i] must be "
            "labels[:, i + 1], -100 at the end of each row); pass one of them"
        )


def _num_items(n) -> Optional[float]:
    """HF's ``num_items_in_batch`` (an int or a scalar tensor), checked: a float > 0, or None."""
    if n is None:
        return None
    if isinstance(n, torch.Tensor):
        if n.numel() != 1:
            raise ValueError(
                "ringkv: num_items_in_batch must be one number, got a tensor of shape "
                f"{tuple(n.shape)}"
            )
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
        raise ValueError(
            "ringkv: num_items_in_batch must be a number > 0 (the counted labels the loss is "
            f"divided by), got {n!r}"
        )
    return float(n)


@dataclass
class _Head:
    """A causal LM's output head as the chunked loss applies it: ``weight`` ``(V, H)``, ``bias``,
    and the model's own transform of its logits (``softcap``: ``cap * tanh(z / cap)``; ``scale``:
    ``z * scale``)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: Optional[float]
    scale: Optional[float]

    def loss_sum(
        self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk: Optional[int]
    ):
        """Summed cross-entropy (float32) of ``hidden`` ``(N, H)`` against ``targets`` ``(N,)``."""
        if type(self.weight).__name__ == "DTensor":
            raise ValueError(
                "ringkv: the chunked loss needs the output head's weight as a plain tensor, got "
                f"{type(self.weight).__name__} (e.g. FSDP2 sharding the head in its own unit: keep "
                "it in the root unit), or patch with keep_logits=True"
            )
        if hidden.is_cuda and self.scale is None and chunk is None:
            fused = _liger_loss_sum(hidden, self, targets, ignore_index)
            if fused is not None:
                return fused
        return linear_cross_entropy(
            hidden,
            self.weight,
            targets,
            self.bias,
            ignore_index=ignore_index,
            chunk=chunk,
            softcap=self.softcap,
            scale=self.scale,
        )


def _liger_loss_sum(hidden, head: _Head, targets, ignore_index):
    """Liger's fused linear cross-entropy (CUDA, when ``liger-kernel`` is installed), summed; else
    None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    kw = dict(ignore_index=ignore_index, reduction="sum", softcap=head.softcap)
    if "accum_dtype" in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        kw["accum_dtype"] = torch.float32  # the head's gradient accumulated in float32, as ours
    return liger_fused_linear_cross_entropy(hidden, head.weight, targets, head.bias, **kw).float()


def _head(model) -> Optional[_Head]:
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
    return _Head(lin.weight, lin.bias, softcap, scale)


def _gather_packed(
    x: torch.Tensor, cu: Tuple[int, ...], layout: str, group, timeout
) -> torch.Tensor:
    """Every rank's shard ``(1, L_local, ...)`` of a packed row, as the packed row ``(1, S, ...)``
    (pad rows dropped)."""
    _, world = rank_world(group)
    parts = all_gather(x.contiguous(), group, timeout, "ringkv gather")
    index = torch.cat([varlen_index(cu, layout, r, world) for r in range(world)])
    real = (index >= 0).nonzero().squeeze(1)
    full = x.new_empty((1, cu[-1], *x.shape[2:]))
    full[:, index[real].to(x.device)] = torch.cat(parts, 1)[:, real.to(x.device)]
    return full


# ---------------------------------------------------------------------------------------------
# the forward's hooks

# what every rank must agree on before a forward; the last entry is 1 on a rank whose own inputs
# broke a rule
AGREE_NAMES = [
    "phase",
    "batch",
    "sequence length",
    "cache length",
    "logits_to_keep",
    "labels",
    "input tokens",
    "packed documents",
    "attention mask",
    "num_items_in_batch",
    "input checks (a rank whose inputs broke a rule raises that rule's error)",
]


@dataclass
class _Plan:
    """What the pre-hook's local checks decided (committed after every rank agreed)."""

    values: list
    device: torch.device
    name: str  # "input_ids" or "inputs_embeds"
    x_local: torch.Tensor
    q_pos: torch.Tensor  # (rows,) host: global positions (packed: within documents)
    seq: int
    decode: bool
    cache: Optional[ShardedKVCache]
    explicit_cache: bool
    rows: Optional[torch.Tensor]  # rows of this forward to cache (None: all)
    keep: int
    keep_at: Optional[torch.Tensor]
    labels: Optional[torch.Tensor]
    shift_labels: Optional[torch.Tensor]
    num_items: Optional[float]
    chunked: bool
    packing: Optional[_Packing]
    mask: Optional[torch.Tensor]  # inputs="shard": the local mask, checked after gathering it
    padded: bool = False
    pad: Optional[_PadStep] = None  # a left-padded batch with a KV cache


def _prepare(state: _State, model, kw: dict) -> _Plan:
    """Every check of a forward's inputs that needs no communication; ``kw`` loses what ringkv
    handles."""
    ids, emb = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else emb
    if x is None:
        raise ValueError("ringkv: pass input_ids or inputs_embeds")
    b, t = x.shape[:2]
    rank, world, layout, u = state.rank, state.world, state.layout, state.ulysses
    shard_mode = state.inputs == "shard"
    pk_kw = {n: v for n, v in ((n, kw.pop(n, None)) for n in PACKING_KEYS) if v is not None}

    mask = kw.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            "ringkv: only 2-D attention masks (B, S) are supported (no 4-D masks), got "
            f"{mask.dim()}-D"
        )
    cache = kw.get("cache")
    use_cache = kw.get("use_cache")
    explicit_cache = cache is not None or use_cache is True
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if cache is not None and not isinstance(cache, ShardedKVCache):
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"ringkv: got a {type(cache).__name__} that already holds tokens; a patched model "
                "keeps its KV cache sharded: pass no cache, an empty one, or the ShardedKVCache it "
                "returned"
            )
        cache = ShardedKVCache()
    elif cache is None and use_cache:
        cache = ShardedKVCache()
    labels, shift_labels = kw.pop("labels", None), kw.pop("shift_labels", None)
    num_items = _num_items(kw.pop("num_items_in_batch", None))
    keep = kw.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or not isinstance(keep, int) or keep < 0:
        raise ValueError(
            "ringkv: logits_to_keep must be a non-negative int (the last tokens of the global "
            "sequence)"
        )
    if keep and state.keep_logits is False and not model.training:
        raise ValueError(
            f"ringkv: logits_to_keep={keep} asks for logits, but the model was patched with "
            f"keep_logits=False (no logits are built); patch with keep_logits=None (the default: "
            f"logits in eval mode) or True"
        )
    for name, lab in (("labels", labels), ("shift_labels", shift_labels)):
        if lab is not None and tuple(lab.shape) != (b, t):
            raise ValueError(
                f"ringkv: {name} must have the shape of the inputs ({b}, {t})"
                f"{' (this rank shard, like the inputs)' if shard_mode else ''}, got "
                f"{tuple(lab.shape)}"
            )
    if labels is not None and shift_labels is not None and not shard_mode:
        _check_shift_labels(labels, shift_labels)
    targets = labels if shift_labels is None else shift_labels
    if (keep or targets is not None) and kw.get("return_dict") is False:
        raise ValueError("ringkv: use return_dict=True with labels or logits_to_keep")
    decode = cache is not None and cache.seen > 0
    replicated = decode or not shard_mode
    pos = kw.get("position_ids")
    pk, padded, keep_at, left_pad = None, False, None, None

    if (
        state.store is not None
        and not decode
        and model.training
        and torch.is_grad_enabled()
        and not _checkpointing(model)
    ):
        raise ValueError(
            "ringkv: offload_checkpoints offloads what activation checkpointing saves; enable it "
            "(model.gradient_checkpointing_enable()) or patch with offload_checkpoints=False"
        )
    if decode:
        if targets is not None:
            raise ValueError(
                "ringkv: labels (and shift_labels) are supported for the prefill (no cache, or an "
                "empty one) only"
            )
        if pk_kw:
            raise ValueError(
                f"ringkv: {', '.join(sorted(pk_kw))} (packed documents) are for the prefill only, "
                "not for a decode step (the KV cache holds tokens)"
            )
        owner = cache.decode_steps % world  # the new tokens are cached on one rank, round-robin
        if (
            cache.lengths is not None
        ):  # a left-padded batch: per-row positions (B, T), its mask checked
            q_pos, left_pad = _left_padded_decode(cache, mask, pos, b, t, rank == owner)
        elif mask is not None and not bool(mask.bool().all()):
            raise ValueError(PADDING_HELP)
        seq, s_pad = cache.seen + t, t
        if cache.lengths is None:
            q_pos = torch.arange(cache.seen, seq)  # (T,) on the host
            _check_positions(pos, q_pos, f"the global positions {cache.seen}..{seq - 1}")
        rows = None if rank == owner else torch.zeros(0, dtype=torch.long)  # host, like q_pos
        x_local = x
    else:
        if mask is not None and tuple(mask.shape) != (b, t):
            raise ValueError(
                f"ringkv: attention_mask must have the shape of the inputs ({b}, {t})"
                f"{' (this rank shard, like the inputs)' if shard_mode else ''}, got "
                f"{tuple(mask.shape)}"
            )
        if (
            not shard_mode
            and explicit_cache
            and mask is not None
            and not pk_kw
            and not bool(mask.bool().all())
        ):
            return _left_padded_prefill(
                state, kw, x, ids, mask, pos, targets, keep, cache
            )  # generate's padded batch
        if shard_mode:
            pk, q_pos = _shard_packing(pk_kw, pos, b, t, layout, rank, world)
        else:
            padded = mask is not None and not bool(mask.bool().all())
            try:
                pk = _packing(b, t, position_ids=pos, **pk_kw)
            except ValueError:
                if (
                    padded
                ):  # e.g. generate's position ids of a left-padded prompt: the mask is the problem
                    _check_padding(mask, _starts(None, b, t), labels, shift_labels)
                raise
            if padded:
                _check_padding(mask, _starts(pk, b, t), labels, shift_labels)
        if (
            pk is not None or padded
        ):  # training / scoring: a KV cache of packed or padded rows is no use
            if explicit_cache:
                raise ValueError(
                    f"ringkv: {'packed documents' if pk is not None else 'padding masks'} are for "
                    f"training and scoring without a KV cache: pass use_cache=False and no cache. "
                    f"With a cache, a batch of prompts is left-padded: attention_mask and the "
                    f"position_ids generate makes, no other packing arguments"
                )
            cache = None
        if pk is not None:
            if state.method != "ring":
                raise ValueError(
                    f"ringkv: packed documents need method='ring' (the varlen ring attention); "
                    f"method={state.method!r} cannot keep documents apart. Patch with method='ring'"
                )
            if keep:
                raise ValueError(
                    "ringkv: logits_to_keep is not supported with packed documents; gather the "
                    "logits with gather_logits(..., cu_seqlens=...) instead"
                )
        if pk is not None:
            seq = pk.cu[-1]
            if shard_mode:
                x_local = x
            else:
                q_pos = positions(seq, layout, rank, world, cu_seqlens=pk.cu)  # (L_local,) host
                x_local = shard(
                    x.reshape(1, seq, *x.shape[2:]),
                    1,
                    layout,
                    rank=rank,
                    world=world,
                    cu_seqlens=pk.cu,
                )
            s_pad = q_pos.numel() * world
            rows = None
        else:
            if shard_mode:
                seq = s_pad = t * world
                check_seq_len(s_pad, layout, world, u)
            else:
                seq, g = t, granule(layout, world, u)
                s_pad = -(-seq // g) * g
            q_pos = positions(s_pad, layout, rank, world, ulysses=u)  # (S_pad / N,) host
            if shard_mode:
                _check_positions(
                    pos,
                    q_pos,
                    f"this rank's global positions in layout {layout!r} (for packed "
                    f"documents pass cu_seq_lens_q too)",
                )
                x_local = x
            else:
                if (
                    s_pad > seq
                ):  # pad at the end: invisible to every real token under causal attention
                    pad = getattr(model.config, "pad_token_id", None) or 0
                    tail = (
                        x.new_full((b, s_pad - seq), pad)
                        if ids is not None
                        else x.new_zeros(b, s_pad - seq, x.shape[2])
                    )
                    x = torch.cat([x, tail], 1)  # (B, S_pad[, E])
                x_local = shard(
                    x, 1, layout, rank=rank, world=world, ulysses=u
                )  # (B, S_pad / N[, E])
            rows = (q_pos < seq).nonzero().squeeze(1) if s_pad > seq else None
            if keep:
                sel = (q_pos >= seq - keep) & (q_pos < seq)
                keep_at = q_pos[sel] - (seq - keep)
                kw["logits_to_keep"] = sel.nonzero().squeeze(
                    1
                )  # local rows among the last `keep` global tokens

    # the loss from the hidden states, never the logits (training forwards with labels, unless
    # keep_logits)
    chunked = (
        targets is not None
        and not decode
        and state.keep_logits is not True
        and (state.keep_logits is False or model.training)
        and _head(model) is not None
    )
    if chunked and not keep:
        kw["logits_to_keep"] = torch.zeros(
            0, dtype=torch.long
        )  # the model's head computes (B, 0, V)
    values = [
        int(decode),
        b,
        s_pad,
        cache.seen if cache is not None else -1,
        keep,
        (labels is not None) + 2 * (shift_labels is not None) + 4 * chunked,
        _checksum(ids) if replicated else 0,
        -1 if pk is None else zlib.crc32(repr((pk.cu, pk.rows)).encode()),
        -1 if mask is None else (_checksum(mask) if replicated and not decode else 1),
        -1 if num_items is None else zlib.crc32(repr(num_items).encode()),
    ]
    return _Plan(
        values=values,
        device=x.device,
        name="input_ids" if ids is not None else "inputs_embeds",
        x_local=x_local,
        q_pos=q_pos,
        seq=seq,
        decode=decode,
        cache=cache,
        explicit_cache=explicit_cache,
        rows=rows,
        keep=0 if decode else keep,
        keep_at=keep_at,
        labels=labels,
        shift_labels=shift_labels,
        num_items=num_items,
        chunked=chunked,
        packing=pk,
        mask=mask if shard_mode and not decode else None,
        padded=padded,
        pad=left_pad,
    )


def _left_padded_prefill(
    state: _State, kw: dict, x, ids, mask, pos, labels, keep: int, cache: ShardedKVCache
) -> _Plan:
    """The prefill of a left-padded batch with a KV cache (``generate``'s): each row's real tokens
    are one packed document of the varlen ring (pads dropped); this rank caches its real tokens."""
    b, t = x.shape[:2]
    m = mask.detach().bool().cpu()
    _check_left_padding(m)
    if labels is not None:
        raise ValueError(
            "ringkv: labels with a left-padded batch and a KV cache are not supported; pass "
            "use_cache=False (training and scoring)"
        )
    if state.method != "ring":
        raise ValueError(
            "ringkv: a left-padded batch with a KV cache (batched generate) needs method='ring' "
            f"(the varlen ring keeps the rows apart); method={state.method!r}. Patch with "
            "method='ring'"
        )
    want = m.long().cumsum(1) - 1
    if pos is None or not torch.equal(_as_rows(pos, b, t, "position_ids")[m], want[m]):
        raise ValueError(
            "ringkv: a left-padded batch with a KV cache needs position_ids = "
            "attention_mask.cumsum(-1) "
            "- 1 at the real tokens (as generate makes them; the pads' values are ignored)"
        )
    rank, world, layout = state.rank, state.world, state.layout
    lengths = m.sum(1)  # (B,) real tokens
    cu = tuple([0] + lengths.cumsum(0).tolist())
    real = x[m.to(x.device)].unsqueeze(0)  # (1, N[, E]): the rows' real tokens, in order
    x_local = shard(real, 1, layout, rank=rank, world=world, cu_seqlens=cu)
    q_pos = positions(cu[-1], layout, rank, world, cu_seqlens=cu)  # (L_local,) within rows
    index = varlen_index(cu, layout, rank, world)  # -1: the layout's pads
    rows = (index >= 0).nonzero().squeeze(1)
    row_of = torch.searchsorted(torch.tensor(cu), index[rows], right=True) - 1  # batch row of each
    keep = keep or t
    slot = (
        keep - lengths[row_of] + q_pos[rows]
    )  # where (row r, position o) is among row r's last `keep` tokens
    sel = slot >= 0
    kw["logits_to_keep"] = rows[sel]
    pk = _Packing(cu, 1, cu[-1])
    values = [
        0,
        b,
        q_pos.numel() * world,
        cache.seen,
        keep,
        0,
        _checksum(ids),
        zlib.crc32(repr((pk.cu, pk.rows)).encode()),
        _checksum(mask),
        -1,
    ]
    return _Plan(
        values=values,
        device=x.device,
        name="input_ids" if ids is not None else "inputs_embeds",
        x_local=x_local,
        q_pos=q_pos,
        seq=t,
        decode=False,
        cache=cache,
        explicit_cache=True,
        rows=rows,
        keep=keep,
        keep_at=row_of[sel] * keep + slot[sel],
        labels=None,
        shift_labels=None,
        num_items=None,
        chunked=False,
        packing=pk,
        mask=None,
        pad=_PadStep(rows_kept=row_of, lengths=lengths, prompt_mask=m, keep_rows=b),
    )


def _check_left_padding(m: torch.Tensor) -> None:
    """``m`` ``(B, S)`` host bool: every row zeros then ones, with at least one one."""
    bad = m[:, :-1] & ~m[:, 1:]  # a one, then a zero
    if bool(bad.any()):
        r, i = bad.nonzero()[0].tolist()
        what = (
            "a hole (zeros between real tokens)" if bool(m[r, i + 1 :].any()) else "right padding"
        )
        raise ValueError(
            f"ringkv: a padded batch with a KV cache (batched generate): {LEFT_PAD_HELP}; row {r} "
            f"has {what} at index {i + 1}. Left-pad the prompts (tokenizer padding_side='left')"
        )
    if not bool(m.any(1).all()):
        r = int((~m.any(1)).nonzero()[0])
        raise ValueError(
            f"ringkv: a padded batch with a KV cache (batched generate): {LEFT_PAD_HELP}; row {r} "
            "is all padding"
        )


def _left_padded_decode(cache: ShardedKVCache, mask, pos, b: int, t: int, owner: bool):
    """A decode step of a left-padded batch: ``(q_pos (B, T) host, _PadStep)`` after checking that
    ``mask`` is the prompt's followed by ones and ``position_ids`` (if given) each row's next
    positions."""
    rows = cache.lengths.numel()
    if b != rows:
        raise ValueError(
            f"ringkv: this decode step has {b} rows but the KV cache holds a left-padded batch of "
            f"{rows}"
        )
    seen, s0 = cache.seen, cache.pad_mask.shape[1]
    if mask is None:
        raise ValueError(
            f"ringkv: a decode step of a left-padded batch needs its attention_mask ({b}, "
            f"{seen + t}): the prompt's mask followed by ones, as generate grows it"
        )
    m = mask.detach().bool().cpu()
    if (
        tuple(m.shape) != (b, seen + t)
        or not torch.equal(m[:, :s0], cache.pad_mask)
        or not bool(m[:, s0:].all())
    ):
        raise ValueError(
            f"ringkv: a decode step of a left-padded batch must pass attention_mask ({b}, "
            f"{seen + t}) = the prompt's mask followed by ones (as generate grows it): the pad "
            "pattern cannot change between steps and new tokens are never pads; got shape "
            f"{tuple(m.shape)}"
            + ("" if tuple(m.shape) != (b, seen + t) else " with another pattern")
        )
    q_pos = cache.lengths[:, None] + torch.arange(t)  # (B, T)
    if pos is not None:
        given = torch.as_tensor(pos).detach().cpu()
        if tuple(given.shape) != (b, t) or not torch.equal(given.long(), q_pos):
            raise ValueError(
                "ringkv: position_ids of a left-padded batch's decode step must be each row's next "
                "positions, attention_mask.cumsum(-1) - 1 (as generate makes them): "
                f"{q_pos.tolist()}, got {given.tolist()}"
            )
    reach = int(q_pos.max()) + 1  # > every position; 2 * reach apart, rows never see each other
    q_virtual = (torch.arange(b)[:, None] * (2 * reach) + q_pos).reshape(-1)
    return q_pos, _PadStep(
        rows_kept=torch.arange(b).repeat_interleave(t)
        if owner
        else torch.zeros(0, dtype=torch.long),
        lengths=cache.lengths + t,
        q_virtual=q_virtual,
        reach=reach,
    )


def _pre_hook(state: _State, model, args, kwargs):
    kw = _as_kwargs(model, args, kwargs)
    state.step = None
    try:
        p = _prepare(state, model, kw)
    except (ValueError, TypeError):
        if (
            state.inputs == "shard" and state.world > 1
        ):  # per-rank inputs: the peers must raise too, not wait
            x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
            try:
                agree(
                    [-1] * (len(AGREE_NAMES) - 1) + [1],
                    AGREE_NAMES,
                    state.group,
                    state.timeout,
                    "ringkv.patch_model",
                    device=None if x is None else x.device,
                )
            except Exception:  # noqa: BLE001 - this rank's own error is the one to report
                pass
        raise

    # --- every rank must make the same call: one tiny all-gather ---
    agree(
        p.values + [0],
        AGREE_NAMES,
        state.group,
        state.timeout,
        "ringkv.patch_model",
        device=p.device,
    )
    labels, shift_labels = p.labels, p.shift_labels
    if (
        state.inputs == "shard"
        and not p.decode
        and (p.mask is not None or labels is not None or shift_labels is not None)
    ):
        # the shards' mask and labels, whole (B, S) (packed: (1, S)), checked alike on every rank
        def whole(t):
            if t is None:
                return None
            t = t.to(p.device).long()
            if p.packing is not None:
                return _gather_packed(t, p.packing.cu, state.layout, state.group, state.timeout)
            return _gather_seq(t, state.layout, state.group, state.timeout, state.ulysses)

        labels, shift_labels, mask = whole(labels), whole(shift_labels), whole(p.mask)
        if labels is not None and shift_labels is not None:
            _check_shift_labels(labels, shift_labels)
        if mask is not None and not bool(mask.bool().all()):
            _check_padding(
                mask.bool(),
                _starts(p.packing, *mask.shape)
                if p.packing is not None
                else _starts(None, *mask.shape),
                labels,
                shift_labels,
            )
            if p.explicit_cache:
                raise ValueError(
                    "ringkv: padding masks are for training and scoring without a KV cache: pass "
                    "use_cache=False and no cache"
                )
            p.cache = None

    # --- commit ---
    if state.store is not None and not p.decode and model.training and torch.is_grad_enabled():
        state.offload = memory.offload_checkpoints(
            state.store, model.config.get_text_config().hidden_size
        )
        state.offload.__enter__()
    b_local = p.x_local.shape[0]
    kw[p.name] = p.x_local
    q_pos = p.q_pos.to(p.device)
    kw["position_ids"] = (
        q_pos if q_pos.dim() == 2 else q_pos.unsqueeze(0).expand(b_local, -1)
    )  # global positions
    kw["cache"] = p.cache
    if p.cache is None:
        kw["use_cache"] = False
    else:
        flat = p.q_pos.reshape(-1)  # (B*T,) for a left-padded batch's decode step, row-major
        kept = flat if p.rows is None else flat[p.rows]  # host index into host positions
        p.cache._begin(
            kept, None if p.rows is None else p.rows.to(p.device), prefill=not p.decode, seen=p.seq
        )
        if p.pad is not None:
            p.cache._begin_rows(p.pad.rows_kept, p.pad.lengths, p.pad.prompt_mask, pack=p.decode)
            if p.decode:
                p.pad.k_virtual = p.cache.rows * (2 * p.pad.reach) + p.cache.positions
        if p.decode:
            p.cache.decode_steps += 1
    state.step = _Step(
        decode=p.decode,
        q_positions=p.q_pos,
        total=p.seq,
        cache=p.cache,
        keep=p.keep,
        keep_at=p.keep_at,
        labels=labels if shift_labels is None else shift_labels,
        shifted=shift_labels is not None,
        num_items=p.num_items,
        chunked=p.chunked,
        packing=p.packing,
        pad=p.pad,
    )
    return (), kw


def _post_hook(state: _State, model, args, kwargs, output):
    step, state.step = state.step, None
    offload, state.offload = state.offload, None
    if offload is not None:  # the layers' inputs are saved; the loss's tensors stay where they are
        offload.__exit__(None, None, None)
    if step is None or output is None:  # the forward raised
        return None
    # activation checkpointing replays the layers' forwards during backward, after this hook
    replay = not step.decode and torch.is_grad_enabled() and _checkpointing(model)
    state.recompute = (
        _Step(decode=False, q_positions=step.q_positions, total=step.total, packing=step.packing)
        if replay
        else None
    )
    if step.keep:  # assemble the last `keep` global logits on every rank: zeros elsewhere, summed
        local = output.logits  # (B, r, V)
        rows = (
            step.pad.keep_rows if step.pad is not None else 0
        )  # left-padded: (1, r, V) -> (B, keep, V)
        full = local.new_zeros(rows or local.shape[0], step.keep, local.shape[2])
        if rows:
            full.view(-1, local.shape[2])[step.keep_at.to(local.device)] = local[0]
        else:
            full[:, step.keep_at] = local
        output.logits = all_sum(
            full, state.group, state.timeout, "ringkv logits_to_keep"
        )  # (B, keep, V)
    if step.labels is not None:
        x, head = output.logits, None
        if step.chunked:  # the base model's output (B, S_local, H) through the head in chunks
            x, head = step.hidden, _head(model)
            if x is None:
                raise RuntimeError(
                    f"ringkv: the chunked loss did not see the output of {type(model).__name__}'s "
                    f"base model; patch with keep_logits=True"
                )
            if not step.keep:
                _drop_logits(output)
        output.loss = _lm_loss(
            x,
            step.labels,
            state.layout,
            state.group,
            False,
            IGNORE_INDEX,
            state.timeout,
            state.ulysses,
            step.packing,
            head=head,
            shifted=step.shifted,
            num_items=step.num_items,
            chunk=state.loss_chunk,
        )
    return output


def _checkpointing(model) -> bool:
    """Whether HF activation (gradient) checkpointing is on (transformers 5 name, then 4's)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def _capture_hidden(state: _State, output) -> None:
    """Forward hook of the base model: keep its last hidden states for the chunked loss."""
    if state.step is not None and state.step.chunked:
        state.step.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state


def _drop_logits(output) -> None:
    """``output.logits = None``, and gone from the output's dict and tuple forms too."""
    output.logits = None
    if "logits" in output.keys():
        OrderedDict.__delitem__(output, "logits")


# ---------------------------------------------------------------------------------------------
# public API


def patch_model(
    model,
    sp: Optional[int] = None,
    group=None,
    layout: str = "zigzag",
    *,
    method: str = "ring",
    ulysses: Optional[int] = None,
    inputs: str = "full",
    timeout: Optional[float] = None,
    mesh_dim=None,
    keep_logits: Optional[bool] = None,
    loss_chunk: Optional[int] = None,
    tile_mlp=False,
    offload_checkpoints=False,
):
    """Make ``model`` (a transformers causal LM) run exact sequence-parallel attention over the SP
    ``group``.

    Call it on every rank of ``group`` (default: the world; no process group = one rank) with
    identical weights. ``group`` may also be a ``torch.distributed.device_mesh.DeviceMesh``: a
    1-D mesh is its group; an n-D mesh needs ``mesh_dim`` (the name or index of its
    sequence-parallel dimension, e.g. ``patch_model(model, group=mesh, mesh_dim="sp")`` on a
    ``("dp", "sp")`` mesh, the same as ``group=mesh["sp"]``). ``sp`` (optional) must equal the
    group size. ``layout`` is how the
    sequence is split (``"zigzag"`` balances causal work; ``"contiguous"``, ``"striped"``).
    ``method``: ``"ring"`` (``ring_attention``), ``"ulysses"`` (``ulysses_attention``: the
    attention heads must split over the group) or ``"usp"`` (``usp_attention`` on
    ``sp_groups(ulysses=U, ring=N/U)`` of the default world: pass ``ulysses=U``). Layers with
    a sliding window (Mistral, Qwen2) attend within it, at any length.
    ``inputs`` is ``"full"`` (every rank passes the whole sequence) or ``"shard"`` (every rank
    passes its own shard); see the module docstring. ``timeout`` (seconds) bounds every wait
    on a peer. Returns the same model, patched in place; ``unpatch_model`` restores it.

    Training memory (docs/hf.md, "Training at any length"):

    - ``keep_logits``: ``None`` (default) computes the loss of a **training-mode** forward with
      ``labels`` (or ``shift_labels``) from the final hidden states through the head in chunks
      of ``loss_chunk`` tokens, never building the ``(B, S/N, V)`` logits: ``output.logits`` is
      ``None`` then (eval-mode forwards return logits as before). ``True``: logits always (the
      loss from them). ``False``: never for a forward with labels, in eval too (``logits_to_keep``
      in eval is then a ``ValueError``). HF's ``num_items_in_batch`` divides the loss instead of the
      global count of targets.
    - ``tile_mlp``: ``True`` (or tokens per tile) runs every decoder layer's MLP over sequence
      tiles and recomputes them in backward (``ringkv.memory.tile_mlp``).
    - ``offload_checkpoints``: ``True`` moves the layer inputs that gradient checkpointing saves
      to pinned host memory (CUDA) and back for backward; or a ``ringkv.memory.CheckpointStore``.
    """
    from transformers import AttentionInterface, PreTrainedModel

    check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if inputs not in ("full", "shard"):
        raise ValueError(f"inputs must be 'full' or 'shard', got {inputs!r}")
    if getattr(model, "_ringkv_state", None) is not None:
        raise ValueError(
            "this model is already patched by ringkv; call ringkv.unpatch_model(model) first"
        )
    name = type(model).__name__
    if (
        not isinstance(model, PreTrainedModel)
        or not getattr(model, "_supports_attention_backend", False)
        or not model._can_set_attn_implementation()
    ):
        raise TypeError(
            f"ringkv.patch_model needs a transformers model whose attention goes through "
            f"AttentionInterface (model._supports_attention_backend and set_attn_implementation), "
            f"e.g. Llama, Qwen2, Mistral; {name} does not"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(
            f"ringkv.patch_model supports decoder-only causal LMs, not the encoder-decoder {name}"
        )
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not modules:
        raise TypeError(
            "ringkv.patch_model found no attention layers (modules with layer_idx and is_causal) "
            f"in {name}"
        )
    if not all(m.is_causal for m in modules):
        raise TypeError(
            f"ringkv.patch_model supports causal self-attention only; {name} has non-causal layers"
        )
    group = _sp_group(group, mesh_dim)
    rank, world = rank_world(group)
    if sp is not None and sp != world:
        raise ValueError(
            f"sp={sp} but the SP group has {world} rank(s); pass the process group of {sp} ranks "
            "as group= (or omit sp)"
            + ("" if world > 1 else "; call torch.distributed.init_process_group first for sp > 1")
        )
    u, groups = _method_groups(model.config, method, ulysses, group, world)
    if keep_logits not in (None, True, False):
        raise ValueError(
            f"keep_logits must be None (logits in eval only), True or False, got {keep_logits!r}"
        )
    if loss_chunk is not None and (
        isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1
    ):
        raise ValueError(
            f"loss_chunk must be a positive int (tokens per chunk of the loss), got {loss_chunk!r}"
        )
    store = _checkpoint_store(model, offload_checkpoints)
    restore = (
        []
        if tile_mlp is False or tile_mlp is None
        else [memory.tile_mlp(model, None if tile_mlp is True else tile_mlp)]
    )
    AttentionInterface.register(ATTN_NAME, _eager_attention)
    state = _State(
        group=group,
        layout=layout,
        rank=rank,
        world=world,
        method=method,
        ulysses=u,
        groups=groups,
        inputs=inputs,
        timeout=None if timeout is None else timedelta(seconds=timeout),
        prev_impl=model.config._attn_implementation,
        modules=modules,
        keep_logits=keep_logits,
        loss_chunk=loss_chunk,
        restore=restore,
        store=store,
    )
    model.set_attn_implementation(ATTN_NAME)
    for m in modules:
        m._ringkv_state = state
    state.handles = [
        model.register_forward_pre_hook(
            lambda mod, a, k: _run_eager(_pre_hook, state, mod, a, k), with_kwargs=True
        ),
        model.register_forward_hook(
            lambda mod, a, k, o: _run_eager(_post_hook, state, mod, a, k, o),
            with_kwargs=True,
            always_call=True,
        ),
    ]
    if getattr(model, "base_model", model) is not model:  # its output feeds the chunked loss
        state.handles.append(
            model.base_model.register_forward_hook(
                lambda mod, a, o: _run_eager(_capture_hidden, state, o)
            )
        )
    model._ringkv_state = state
    return model


def _method_groups(config, method: str, ulysses: Optional[int], group, world: int):
    """``(U, (ulysses_group, ring_group))`` for ``method``, after checking that the model's heads
    split (before any collective; building the USP groups is the first one)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if method != "usp":
        if ulysses is not None:
            raise ValueError(f"ulysses={ulysses} is for method='usp' (method={method!r})")
        if method == "ulysses":
            head_plan(heads, kv_heads, world, "patch_model(method='ulysses')")
        return 1, ()
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
        raise ValueError(
            f"method='usp' needs ulysses=U, a positive divisor of the SP world size {world} "
            f"(ring = {world} / U), got {ulysses!r}"
        )
    if group is not None and rank_world(group)[1] != rank_world()[1]:
        raise ValueError(
            "method='usp' runs on sp_groups(ulysses=U, ring=N/U) of the whole default world; "
            "leave group=None"
        )
    head_plan(heads, kv_heads, ulysses, "patch_model(method='usp')")
    return ulysses, sp_groups(ulysses=ulysses, ring=world // ulysses)


def _checkpoint_store(model, offload):
    """The ``CheckpointStore`` that ``offload_checkpoints=`` names (None: no offload)."""
    if offload is None or offload is False:
        return None
    if isinstance(offload, memory.CheckpointStore):
        return offload
    if offload is not True:
        raise ValueError(
            f"offload_checkpoints must be True, False or a ringkv.memory.CheckpointStore, got "
            f"{offload!r}"
        )
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(
            "offload_checkpoints=True moves checkpoints from CUDA memory to pinned host memory, "
            f"but the model is on {device}; on a CPU there is nothing to offload to (pass False, "
            "or a ringkv.memory.CheckpointStore such as FileStore to store them elsewhere)"
        )
    return memory.HostStore(device)


def _sp_group(group, mesh_dim):
    """The SP process group that ``patch_model(group=, mesh_dim=)`` names: ``group`` itself (a
    process group or None), or a ``DeviceMesh``'s group (1-D), or its ``mesh_dim`` dimension's."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without device meshes: only process groups
        DeviceMesh = ()
    if not isinstance(group, DeviceMesh):
        if mesh_dim is not None:
            raise ValueError(
                f"mesh_dim={mesh_dim!r} picks a dimension of a DeviceMesh, but group= is "
                f"{type(group).__name__}; pass the mesh as group= (or drop mesh_dim)"
            )
        return group
    names = tuple(group.mesh_dim_names or ())
    if mesh_dim is None:
        if group.ndim == 1:
            return group.get_group()
        raise ValueError(
            f"group= is a {group.ndim}-D DeviceMesh (dims {names or tuple(range(group.ndim))}); "
            "name its sequence-parallel dimension: patch_model(model, group=mesh, mesh_dim='sp') "
            "(or pass group=mesh['sp'])"
        )
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(
                f"mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh; its dims are {names}"
            )
    elif (
        isinstance(mesh_dim, bool)
        or not isinstance(mesh_dim, int)
        or not 0 <= mesh_dim < group.ndim
    ):
        raise ValueError(
            f"mesh_dim must be a dimension name in {names} or an index 0..{group.ndim - 1}, "
            f"got {mesh_dim!r}"
        )
    return group.get_group(mesh_dim)


# torch.compile: the hooks and the attention run eagerly (one graph break each: they communicate and
# make
# per-call Python decisions that would otherwise be traced and guarded on); the layers between them
# compile
@torch.compiler.disable
def _run_eager(fn, *args):
    return fn(*args)


@torch.compiler.disable
def _eager_attention(*args, **kwargs):
    return ringkv_attention(*args, **kwargs)


def unpatch_model(model):
    """Undo ``patch_model``: remove the hooks and restore the previous attention implementation."""
    state = getattr(model, "_ringkv_state", None)
    if state is None:
        raise ValueError("this model is not patched by ringkv")
    for h in state.handles:
        h.remove()
    for undo in state.restore:
        undo()
    for m in state.modules:
        del m._ringkv_state
    del model._ringkv_state
    model.set_attn_implementation(state.prev_impl)
    return model


def _gather_seq(x: torch.Tensor, layout: str, group, timeout, ulysses: int = 1) -> torch.Tensor:
    """Every rank's shard ``(B, S/N, ...)`` in global order ``(B, S, ...)`` (bounded all-gather)."""
    _, world = rank_world(group)
    parts = all_gather(x, group, timeout, "ringkv gather")
    s = x.shape[1] * world
    where = torch.cat(
        [positions(s, layout, r, world, device=x.device, ulysses=ulysses) for r in range(world)]
    )
    full = x.new_empty((x.shape[0], s, *x.shape[2:]))
    full[:, where] = torch.cat(parts, 1)
    return full


def gather_logits(
    logits: torch.Tensor,
    layout: str = "zigzag",
    group=None,
    seq_len: Optional[int] = None,
    timeout: Optional[timedelta] = None,
    ulysses: int = 1,
    *,
    cu_seqlens=None,
    position_ids=None,
    seq_idx=None,
):
    """All-gather the logits shards ``(B, S_pad / N, V)`` into global order ``(B, S, V)``
    (``seq_len`` drops the end padding added in ``inputs="full"`` mode; ``ulysses``: the
    Ulysses degree of a model patched with ``method="usp"``). Not differentiable.

    Packed batches: pass what the model was given about the documents: ``position_ids`` or
    ``seq_idx`` ``(B, S)`` (returns ``(B, S, V)``, each row as the batch had it), or
    ``cu_seqlens`` (``packed_cu_seqlens(...)``, or the ``cu_seq_lens_q`` of ``inputs="shard"``;
    returns the packed row ``(1, B*S, V)``). The shards' pad rows are dropped.
    """
    check_layout(layout)
    pk = _helper_packing(None, cu_seqlens, position_ids, seq_idx, logits.shape[0])
    if pk is not None:
        if ulysses != 1:
            raise ValueError(
                "gather_logits: packed documents run on method='ring' only (ulysses must be 1)"
            )
        full = _gather_packed(logits.detach(), pk.cu, layout, group, timeout)  # (1, B*S, V)
        return full.view(pk.rows, pk.row_len, *full.shape[2:])
    if seq_len is None and position_ids is not None:
        seq_len = torch.as_tensor(position_ids).shape[-1]
    full = _gather_seq(logits.detach(), layout, group, timeout, ulysses)
    return full if seq_len is None else full[:, :seq_len]


def causal_lm_loss(
    logits: Optional[torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    layout: str = "zigzag",
    group=None,
    sharded: bool = False,
    ignore_index: int = IGNORE_INDEX,
    timeout: Optional[timedelta] = None,
    ulysses: int = 1,
    cu_seqlens=None,
    position_ids=None,
    seq_idx=None,
    hidden: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
    shift_labels: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
):
    """Mean next-token cross-entropy of the whole sequence, from this rank's logits shard.

    Without logits: pass ``hidden`` ``(B, S_pad / N, H)`` (the base model's last
    hidden states, this rank's shard) and the head's ``weight`` ``(V, H)`` (and ``bias``;
    ``softcap`` and ``scale`` for heads that transform their logits; the hidden states may also come
    as the first argument when ``weight`` is given): the loss goes through the head in
    chunks of ``chunk`` tokens (``ringkv.kernels.linear_ce``) and the ``(B, S_pad / N, V)`` logits
    are never built. ``shift_labels`` (HF's: the target of each token, already shifted) may stand
    in for ``labels``; ``num_items_in_batch`` (> 0) divides the summed loss instead of the number
    of counted targets (gradient accumulation, as HF's losses do).

    ``logits`` ``(B, S_pad / N, V)`` is this rank's shard in ``layout`` (``ulysses``: the
    Ulysses degree of a model patched with ``method="usp"``). ``labels`` are the
    whole sequence's labels ``(B, S)`` (``S <= S_pad``; padding is ignored), or this rank's
    shard ``(B, S_pad / N)`` with ``sharded=True`` (gathered once). Labels are shifted once,
    globally (token ``i`` predicts label ``i + 1``; the last token predicts nothing), then
    sharded. Returns the same value on every rank, equal to the unpatched model's loss; its
    gradient is this rank's share, so gradients summed over the SP group (all-reduce, as
    data parallelism does) equal the unpatched model's.

    Packed batches (``logits`` ``(1, L_local, V)`` of the varlen layout): pass ``position_ids``
    or ``seq_idx`` ``(B, S)``, or ``cu_seqlens``, as for ``gather_logits``. The shift stays inside
    each row of ``labels`` ``(B, S)`` (a document's last token predicts the next document's first
    label, which packing collators set to -100); with ``sharded=True`` ``labels`` are this rank's
    shard ``(1, L_local)`` of the packed row (``ringkv.shard(labels, 1, layout, cu_seqlens=cu)``)
    and ``cu_seqlens`` is required.
    """
    if (
        weight is not None and hidden is None
    ):  # causal_lm_loss(hidden, labels, weight=...): the first is hidden
        logits, hidden = None, logits
    if (logits is None) == (hidden is None) or (hidden is None) != (weight is None):
        raise ValueError(
            "causal_lm_loss: pass logits, or hidden states with the head's weight (hidden=, "
            "weight=)"
        )
    if (labels is None) == (shift_labels is None):
        raise ValueError("causal_lm_loss: pass labels or shift_labels (one of them)")
    head = None if weight is None else _Head(weight, bias, softcap, scale)
    x = logits if head is None else hidden
    labels = labels if shift_labels is None else shift_labels
    pk = None
    if cu_seqlens is not None or position_ids is not None or seq_idx is not None:
        if sharded:
            if cu_seqlens is None:
                raise ValueError(
                    "causal_lm_loss: sharded packed labels need cu_seqlens (the whole packed row's "
                    "[0, l0, ..., S]); position_ids and seq_idx describe whole rows"
                )
            cu = _cu_tuple(cu_seqlens, "cu_seqlens")
            pk = _Packing(cu, 1, cu[-1])
        else:
            if labels.dim() != 2:
                raise ValueError(
                    f"causal_lm_loss: labels must be (B, S), got {tuple(labels.shape)}"
                )
            pk = _helper_packing(tuple(labels.shape), cu_seqlens, position_ids, seq_idx, x.shape[0])
    return _lm_loss(
        x,
        labels,
        layout,
        group,
        sharded,
        ignore_index,
        timeout,
        ulysses,
        pk,
        head=head,
        shifted=shift_labels is not None,
        num_items=_num_items(num_items_in_batch),
        chunk=chunk,
    )


def _lm_loss(
    logits,
    labels,
    layout,
    group,
    sharded,
    ignore_index,
    timeout,
    ulysses,
    pk: Optional[_Packing],
    *,
    head: Optional["_Head"] = None,
    shifted: bool = False,
    num_items: Optional[float] = None,
    chunk: Optional[int] = None,
):
    """The loss of ``causal_lm_loss``. ``head`` given: ``logits`` are the hidden states
    ``(B, S_local, H)``
    and the loss is computed through the head in chunks (``linear_cross_entropy``). ``shifted``:
    ``labels`` are the targets of each token already (HF's ``shift_labels``). ``num_items``: the
    divisor (HF's ``num_items_in_batch``) instead of the number of counted targets."""
    rank, world = rank_world(group)
    b, s_local = logits.shape[:2]
    if pk is not None:
        if ulysses != 1:
            raise ValueError(
                "causal_lm_loss: packed documents run on method='ring' only (ulysses must be 1)"
            )
        want = varlen_local_len(pk.cu, layout, world)
        if (b, s_local) != (1, want):
            raise ValueError(
                f"causal_lm_loss: the packed documents give logits shards of shape (1, {want}, V) "
                f"on {world} rank(s) in layout {layout!r}, got {tuple(logits.shape)}"
            )
        if sharded:
            if tuple(labels.shape) != (1, want):
                raise ValueError(
                    f"sharded packed labels must be this rank's shard (1, {want}), got "
                    f"{tuple(labels.shape)}"
                )
            labels = _gather_packed(
                labels.to(logits.device), pk.cu, layout, group, timeout
            )  # (1, S)
        elif labels.numel() != pk.cu[-1] or labels.dim() != 2:
            raise ValueError(
                f"labels of shape {tuple(labels.shape)} do not match the packed documents of "
                f"{pk.cu[-1]} tokens; pass the batch's labels (B, S), or sharded=True"
            )
        rows = labels.to(logits.device).reshape(-1, pk.row_len)  # (rows, S_row)
        targets = (rows if shifted else F.pad(rows[:, 1:], (0, 1), value=ignore_index)).reshape(
            -1
        )  # in each row
        index = varlen_index(pk.cu, layout, rank, world).to(logits.device)
        local = torch.where(index >= 0, targets[index.clamp(min=0)], ignore_index).unsqueeze(
            0
        )  # (1, L_local)
    else:
        s_pad = s_local * world
        check_seq_len(s_pad, layout, world, ulysses)
        if sharded:
            if labels.shape[1] != s_local:
                raise ValueError(
                    f"sharded labels must have this rank's length {s_local}, got {labels.shape[1]}"
                )
            labels = _gather_seq(
                labels.to(logits.device), layout, group, timeout, ulysses
            )  # (B, S_pad)
        elif not s_pad - granule(layout, world, ulysses) < labels.shape[1] <= s_pad:
            raise ValueError(
                f"labels of length {labels.shape[1]} do not match logits shards of {s_local} "
                f"tokens on {world} rank(s) (a sequence of {s_pad} tokens, padding included); pass "
                "the whole sequence's labels, or this rank's shard with sharded=True"
            )
        labels = labels.to(logits.device)
        targets = labels if shifted else labels[:, 1:]
        targets = F.pad(targets, (0, s_pad - targets.shape[1]), value=ignore_index)  # (B, S_pad)
        local = shard(targets, 1, layout, rank=rank, world=world, ulysses=ulysses)  # (B, S_pad / N)
    if head is None:
        loss_sum = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            local.reshape(-1),
            ignore_index=ignore_index,
            reduction="sum",
        )
    else:
        loss_sum = head.loss_sum(
            logits.reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index, chunk
        )
    count = (local != ignore_index).sum()
    totals = all_sum(
        torch.stack([loss_sum.detach().double(), count.double()]), group, timeout, "causal_lm_loss"
    )
    # value: the global sum on every rank, over the global count (or num_items); gradient: this
    # rank's tokens only
    total = loss_sum + (totals[0] - loss_sum.detach()).float()
    return total / (totals[1].float() if num_items is None else num_items)
