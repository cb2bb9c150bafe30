"""Input planning: what one forward of a patched model runs, decided from its arguments before any
communication (``prepare``), and, with ``inputs="shard"``, the shards' mask and labels checked
whole after the ranks agreed (``check_shards``).

Each input is handled once: packing is found (``packing.py``), left padding read
(``_plan_left_padded``, ``left_padded_decode``), the inputs sharded, and the labels (or
``shift_labels``, merged in ``read_call``) shifted and sharded into this rank's targets
(``local_targets``) once, which the loss takes as they are.
"""

from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..sp.pieces import seq_pieces
from ..sp.layout import (
    check_seq_len,
    granule,
    positions,
    shard,
    varlen_index,
)
from .logprobs import PER_TOKEN, read_per_token
from .packing import (
    as_rows,
    check_left_padding,
    check_rows,
    find_packing,
    gather_packed,
    gather_seq,
    local_targets,
    num_items,
    shard_packing,
)
from .state import Packing, PadStep, Step, checkpointing, model_head

PADDING_HELP = (
    "ringkv: attention_mask contains padding (zeros) in a decode step, but the prompt in the KV "
    "cache had none: a batch's pad pattern cannot change between steps. Left-pad the prompts "
    "(zeros as a prefix of each row, as generate does) and pass the attention_mask that generate "
    "grows"
)
# keyword arguments that describe packed documents (what DataCollatorWithFlattening adds besides
# position_ids)
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# what every rank must agree on before a forward; the last entry is 1 on a rank whose own inputs
# broke a rule
AGREE_NAMES = [
    "phase",
    "batch",
    "sequence length",
    "cache length",
    "logits_to_keep",
    "labels (and per_token)",
    "input tokens",
    "packed documents",
    "attention mask",
    "num_items_in_batch",
    "input checks (a rank whose inputs broke a rule raises that rule's error)",
]


# ---------------------------------------------------------------------------------------------
# arguments


def as_kwargs(model, args, kwargs) -> dict:
    kw = dict(kwargs)
    names = list(inspect.signature(model.forward).parameters)
    for name, a in zip(names, args):
        kw[name] = a
    if "past_key_values" in kw and "cache" in names:
        kw["cache"] = kw.pop("past_key_values")
    return kw


def checksum(ids: Optional[torch.Tensor]) -> int:
    if ids is None:
        return 0
    flat = ids.detach().reshape(-1).long().cpu()
    return int((flat * torch.arange(1, flat.numel() + 1)).sum()) & ((1 << 62) - 1)


def check_positions(given, want: torch.Tensor, what: str) -> None:
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


def _state_targets(state, labels, shifted: bool, packing, s_pad: int, device) -> torch.Tensor:
    """``local_targets`` in the patched model's layout and group."""
    return local_targets(
        labels,
        shifted=shifted,
        packing=packing,
        layout=state.layout,
        rank=state.rank,
        world=state.world,
        ulysses=state.ulysses,
        s_pad=s_pad,
        device=device,
    )


# ---------------------------------------------------------------------------------------------
# one forward's plan


@dataclass(frozen=True)
class Call:
    """A forward's arguments that ringkv handles (taken out of its keyword arguments), each
    checked on its own. ``targets`` are ``labels``, or ``shift_labels`` (``shifted``) when given:
    the one place the two are merged."""

    x: torch.Tensor  # (B, S[, E]) input_ids or inputs_embeds
    ids: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    pos: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    shifted: bool
    unshifted: Optional[torch.Tensor]  # labels given with shift_labels, checked against them
    num_items: Optional[float]
    keep: int  # logits_to_keep
    per_token: tuple  # the fields per_token= asks for (logprobs.read_per_token)
    temperature: float  # per_token_temperature= (the logits divided by it before the softmax)
    pk_kw: dict  # the packing arguments given (PACKING_KEYS)
    cache: Optional[object]  # the ShardedKVCache, or None
    explicit_cache: bool  # a cache or use_cache=True was passed

    @property
    def label_bits(self) -> int:
        """1: labels given, + 2: shift_labels given, + 8 per per_token field (as bits)."""
        fields = sum(8 << PER_TOKEN.index(n) for n in self.per_token)
        if self.shifted:
            return 2 + (self.unshifted is not None) + fields
        return int(self.targets is not None) + fields

    @property
    def name(self) -> str:
        return "input_ids" if self.ids is not None else "inputs_embeds"

    @property
    def decode(self) -> bool:
        return self.cache is not None and self.cache.seen > 0


@dataclass(frozen=True)
class Shards:
    """``inputs="shard"``: this rank's shards of the mask and labels, checked whole (and the labels
    sharded into targets) once the ranks agreed."""

    mask: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    shifted: bool
    unshifted: Optional[torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """What the pre-hook's local checks decided (committed after every rank agreed)."""

    values: list  # what every rank must agree on (AGREE_NAMES but the last)
    name: str  # "input_ids" or "inputs_embeds"
    x_local: torch.Tensor  # this rank's inputs
    rows: Optional[torch.Tensor]  # rows of this forward to cache (None: all)
    step: Step
    shards: Optional[Shards] = None
    explicit_cache: bool = False


def _read_keep(state, model, kw) -> int:
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
    return keep


def _read_labels(kw, b: int, t: int, shard_mode: bool):
    """``(labels, shift_labels)`` taken out of ``kw``, their shapes checked."""
    labels, shift_labels = kw.pop("labels", None), kw.pop("shift_labels", None)
    for name, lab in (("labels", labels), ("shift_labels", shift_labels)):
        if lab is not None and tuple(lab.shape) != (b, t):
            raise ValueError(
                f"ringkv: {name} must have the shape of the inputs ({b}, {t})"
                f"{' (this rank shard, like the inputs)' if shard_mode else ''}, got "
                f"{tuple(lab.shape)}"
            )
    return labels, shift_labels


def _read_per_token(state, model, value, targets) -> tuple:
    """``per_token=``'s fields, refused where they cannot come from the hidden states."""
    fields = read_per_token(value)
    if not fields:
        return ()
    why = None
    if targets is None:
        why = "needs labels or shift_labels (the targets it scores)"
    elif state.keep_logits is True:
        why = "computes without logits, but the model was patched with keep_logits=True"
    elif model_head(model) is None:
        why = f"needs a linear output head and a base model, which {type(model).__name__} lacks"
    if why:
        raise ValueError(f"ringkv: per_token={value!r} {why}")
    return fields


def _read_temperature(value, per_token: tuple) -> float:
    """``per_token_temperature=``: a positive float, with ``per_token`` only (default 1)."""
    if value is None:
        return 1.0
    if not per_token:
        raise ValueError("ringkv: per_token_temperature needs per_token= (the fields it scales)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"ringkv: per_token_temperature must be a positive float, got {value!r}")
    return float(value)


def read_call(state, model, kw: dict, cache, explicit_cache: bool) -> Call:
    """The arguments ringkv handles, out of ``kw``, with the checks each needs alone."""
    ids, emb = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else emb
    if x is None:
        raise ValueError("ringkv: pass input_ids or inputs_embeds")
    b, t = x.shape[:2]
    shard_mode = state.inputs == "shard"
    pk_kw = {n: v for n, v in ((n, kw.pop(n, None)) for n in PACKING_KEYS) if v is not None}
    mask = kw.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            "ringkv: only 2-D attention masks (B, S) are supported (no 4-D masks), got "
            f"{mask.dim()}-D"
        )
    labels, shift_labels = _read_labels(kw, b, t, shard_mode)
    n = num_items(kw.pop("num_items_in_batch", None))
    keep = _read_keep(state, model, kw)
    targets = labels if shift_labels is None else shift_labels
    per_token = _read_per_token(state, model, kw.pop("per_token", None), targets)
    temperature = _read_temperature(kw.pop("per_token_temperature", None), per_token)
    if (keep or targets is not None) and kw.get("return_dict") is False:
        raise ValueError("ringkv: use return_dict=True with labels or logits_to_keep")
    return Call(
        x=x,
        ids=ids,
        mask=mask,
        pos=kw.get("position_ids"),
        targets=targets,
        shifted=shift_labels is not None,
        unshifted=labels if shift_labels is not None else None,
        num_items=n,
        keep=keep,
        per_token=per_token,
        temperature=temperature,
        pk_kw=pk_kw,
        cache=cache,
        explicit_cache=explicit_cache,
    )


def prepare(state, model, kw: dict, cache, explicit_cache: bool) -> Plan:
    """Every check of a forward's inputs that needs no communication; ``kw`` loses what ringkv
    handles. ``cache``: the ``ShardedKVCache`` the forward would fill (or None)."""
    call = read_call(state, model, kw, cache, explicit_cache)
    if (
        state.store is not None
        and not call.decode
        and model.training
        and torch.is_grad_enabled()
        and not checkpointing(model)
    ):
        raise ValueError(
            "ringkv: offload_checkpoints offloads what activation checkpointing saves; enable it "
            "(model.gradient_checkpointing_enable()) or patch with offload_checkpoints=False"
        )
    if call.decode:
        return _plan_decode(state, model, call, kw)
    return _plan_prefill(state, model, call, kw)


def _finish(state, model, call: Call, kw: dict, step: Step, x_local, rows, s_pad: int) -> Plan:
    """The plan of ``step``: whether the loss is chunked, and what the ranks must agree on."""
    # the loss from the hidden states, never the logits (training forwards with labels, unless
    # keep_logits)
    chunked = bool(call.per_token) or (
        call.targets is not None
        and not step.decode
        and state.keep_logits is not True
        and (state.keep_logits is False or model.training)
        and model_head(model) is not None
    )
    if call.targets is not None and not chunked and call.keep and not step.decode:
        raise ValueError(
            f"ringkv: labels with logits_to_keep={call.keep} need logits for every token, but only "
            f"the kept ones are built; drop logits_to_keep, or take the loss from the hidden "
            f"states (training, with keep_logits=None or False)"
        )
    if chunked and not step.keep:  # the model's head computes (B, 0, V)
        kw["logits_to_keep"] = torch.zeros(0, dtype=torch.long)
    replicated = step.decode or state.inputs != "shard"
    pk, mask, cache = step.packing, call.mask, step.cache
    values = [
        int(step.decode),
        call.x.shape[0],
        s_pad,
        cache.seen if cache is not None else -1,
        step.keep or call.keep,  # a decode step keeps none, a left-padded prefill every row's
        call.label_bits + 4 * chunked,
        checksum(call.ids) if replicated else 0,
        -1 if pk is None else zlib.crc32(repr((pk.cu, pk.rows)).encode()),
        -1 if mask is None else (checksum(mask) if replicated and not step.decode else 1),
        -1 if step.num_items is None else zlib.crc32(repr(step.num_items).encode()),
    ]
    shards = None
    if (
        state.inputs == "shard"
        and not step.decode
        and (mask is not None or call.targets is not None)
    ):
        shards = Shards(mask, call.targets, call.shifted, call.unshifted)
    step = replace(step, chunked=chunked, per_token=call.per_token, temperature=call.temperature)
    if state.hybrid is not None and not step.decode:  # the recurrent layers' pieces, once
        step = replace(step, pieces=seq_pieces(step.total, state.layout, state.world, step.cu))
    return Plan(values, call.name, x_local, rows, step, shards, call.explicit_cache)


def _plan_decode(state, model, call: Call, kw: dict) -> Plan:
    """A decode step: new tokens, the same on every rank, cached on one owner rank."""
    if call.targets is not None:
        raise ValueError(
            "ringkv: labels (and shift_labels) are supported for the prefill (no cache, or an "
            "empty one) only"
        )
    if call.pk_kw:
        raise ValueError(
            f"ringkv: {', '.join(sorted(call.pk_kw))} (packed documents) are for the prefill only, "
            "not for a decode step (the KV cache holds tokens)"
        )
    cache, (b, t) = call.cache, call.x.shape[:2]
    owner = cache.decode_steps % state.world  # the new tokens are cached on one rank, round-robin
    pad = None
    if cache.lengths is not None:  # a left-padded batch: per-row positions (B, T), its mask checked
        q_pos, pad = left_padded_decode(cache, call.mask, call.pos, b, t, state.rank == owner)
    else:
        if call.mask is not None and not bool(call.mask.bool().all()):
            raise ValueError(PADDING_HELP)
        q_pos = torch.arange(cache.seen, cache.seen + t)  # (T,) on the host
        what = f"the global positions {cache.seen}..{cache.seen + t - 1}"
        check_positions(call.pos, q_pos, what)
    rows = None if state.rank == owner else torch.zeros(0, dtype=torch.long)  # host, like q_pos
    step = Step(
        decode=True,
        q_positions=q_pos,
        total=cache.seen + t,
        cache=cache,
        num_items=call.num_items,
        pad=pad,
    )
    return _finish(state, model, call, kw, step, call.x, rows, t)


def _plan_prefill(state, model, call: Call, kw: dict) -> Plan:
    """A prefill (training, scoring, or generate's first forward)."""
    (b, t), mask = call.x.shape[:2], call.mask
    shard_mode = state.inputs == "shard"
    if mask is not None and tuple(mask.shape) != (b, t):
        raise ValueError(
            f"ringkv: attention_mask must have the shape of the inputs ({b}, {t})"
            f"{' (this rank shard, like the inputs)' if shard_mode else ''}, got "
            f"{tuple(mask.shape)}"
        )
    padded = mask is not None and not bool(mask.bool().all())
    if not shard_mode and call.explicit_cache and padded and not call.pk_kw:
        return _plan_left_padded(state, model, call, kw)  # generate's padded batch
    pk, q_pos = _prefill_packing(state, call)
    cache = call.cache
    if pk is not None or (padded and not shard_mode):  # a KV cache of such rows is no use
        if call.explicit_cache:
            raise ValueError(
                f"ringkv: {'packed documents' if pk is not None else 'padding masks'} are for "
                f"training and scoring without a KV cache: pass use_cache=False and no cache. "
                f"With a cache, a batch of prompts is left-padded: attention_mask and the "
                f"position_ids generate makes, no other packing arguments"
            )
        cache = None
    if pk is None:
        return _plan_rows(state, model, call, kw, cache)
    if not state.runs_varlen:
        raise ValueError(
            f"ringkv: packed documents need method='ring' (the varlen ring attention); "
            f"{state.method_name} cannot keep documents apart. Patch with method='ring'"
        )
    if call.keep:
        raise ValueError(
            "ringkv: logits_to_keep is not supported with packed documents; gather the "
            "logits with gather_logits(..., cu_seqlens=...) instead"
        )
    return _plan_packed(state, model, call, kw, pk, q_pos)


def _prefill_packing(state, call: Call):
    """``(packing, positions)`` of a prefill (positions: with ``inputs="shard"`` only); with
    ``inputs="full"``, the whole rows checked (``check_rows``)."""
    b, t = call.x.shape[:2]
    if state.inputs == "shard":
        return shard_packing(call.pk_kw, call.pos, b, t, state.layout, state.rank, state.world)
    try:
        pk, error = find_packing(b, t, position_ids=call.pos, **call.pk_kw), None
    except ValueError as e:  # e.g. generate's position ids of a left-padded prompt: the rows'
        pk, error = None, e  # checks (the mask's) come first
    check_rows(call.mask, pk, call.targets, call.shifted, call.unshifted)
    if error is not None:
        raise error
    return pk, None


def _plan_packed(state, model, call: Call, kw: dict, pk: Packing, q_pos) -> Plan:
    """Packed documents: the varlen ring over ``pk.cu``, every document split by the layout."""
    rank, world, layout, x = state.rank, state.world, state.layout, call.x
    seq = pk.cu[-1]
    targets = None
    if state.inputs == "shard":
        x_local = x
    else:
        q_pos = positions(seq, layout, rank, world, cu_seqlens=pk.cu)  # (L_local,) host
        x_local = shard(
            x.reshape(1, seq, *x.shape[2:]), 1, layout, rank=rank, world=world, cu_seqlens=pk.cu
        )
        if call.targets is not None:
            targets = _state_targets(state, call.targets, call.shifted, pk, seq, x.device)
    step = Step(
        decode=False,
        q_positions=q_pos,
        total=seq,
        targets=targets,
        num_items=call.num_items,
        packing=pk,
    )
    return _finish(state, model, call, kw, step, x_local, None, q_pos.numel() * world)


def _pad_end(model, call: Call, s_pad: int) -> torch.Tensor:
    """The inputs padded at the end to ``s_pad`` tokens: invisible to every real token under causal
    attention."""
    x, (b, t) = call.x, call.x.shape[:2]
    if s_pad == t:
        return x
    pad = getattr(model.config, "pad_token_id", None) or 0
    tail = (
        x.new_full((b, s_pad - t), pad)
        if call.ids is not None
        else x.new_zeros(b, s_pad - t, x.shape[2])
    )
    return torch.cat([x, tail], 1)  # (B, S_pad[, E])


def _plan_rows(state, model, call: Call, kw: dict, cache) -> Plan:
    """Rows of one sequence each, in ``layout`` (``inputs="full"``: padded at the end to the
    layout's granule)."""
    rank, world, layout, u = state.rank, state.world, state.layout, state.ulysses
    t = call.x.shape[1]
    if state.inputs == "shard":
        seq = s_pad = t * world
        check_seq_len(s_pad, layout, world, u)
    else:
        seq, g = t, granule(layout, world, u)
        s_pad = -(-seq // g) * g
    q_pos = positions(s_pad, layout, rank, world, ulysses=u)  # (S_pad / N,) host
    targets = None
    if state.inputs == "shard":
        check_positions(
            call.pos,
            q_pos,
            f"this rank's global positions in layout {layout!r} (for packed "
            f"documents pass cu_seq_lens_q too)",
        )
        x_local = call.x
    else:
        x = _pad_end(model, call, s_pad)
        x_local = shard(x, 1, layout, rank=rank, world=world, ulysses=u)  # (B, S_pad / N[, E])
        if call.targets is not None:
            targets = _state_targets(state, call.targets, call.shifted, None, s_pad, x.device)
    rows = (q_pos < seq).nonzero().squeeze(1) if s_pad > seq else None
    keep_at = None
    if call.keep:
        sel = (q_pos >= seq - call.keep) & (q_pos < seq)
        keep_at = q_pos[sel] - (seq - call.keep)
        kw["logits_to_keep"] = sel.nonzero().squeeze(1)  # local rows among the last `keep` tokens
    step = Step(
        decode=False,
        q_positions=q_pos,
        total=seq,
        cache=cache,
        keep=call.keep,
        keep_at=keep_at,
        targets=targets,
        num_items=call.num_items,
    )
    return _finish(state, model, call, kw, step, x_local, rows, s_pad)


# ---------------------------------------------------------------------------------------------
# left-padded batches with a KV cache (batched generate)


def _check_left_padded_prefill(state, call: Call, m: torch.Tensor) -> None:
    b, t = call.x.shape[:2]
    check_left_padding(m)
    if call.targets is not None:
        raise ValueError(
            "ringkv: labels with a left-padded batch and a KV cache are not supported; pass "
            "use_cache=False (training and scoring)"
        )
    if not state.runs_varlen:
        raise ValueError(
            "ringkv: a left-padded batch with a KV cache (batched generate) needs method='ring' "
            f"(the varlen ring keeps the rows apart); {state.method_name}. Patch with "
            "method='ring'"
        )
    want = m.long().cumsum(1) - 1
    if call.pos is None or not torch.equal(as_rows(call.pos, b, t, "position_ids")[m], want[m]):
        raise ValueError(
            "ringkv: a left-padded batch with a KV cache needs position_ids = "
            "attention_mask.cumsum(-1) "
            "- 1 at the real tokens (as generate makes them; the pads' values are ignored)"
        )


def _plan_left_padded(state, model, call: Call, kw: dict) -> Plan:
    """The prefill of a left-padded batch with a KV cache (``generate``'s): each row's real tokens
    are one packed document of the varlen ring (pads dropped); this rank caches its real tokens."""
    x, (b, t) = call.x, call.x.shape[:2]
    m = call.mask.detach().bool().cpu()
    _check_left_padded_prefill(state, call, m)
    rank, world, layout = state.rank, state.world, state.layout
    lengths = m.sum(1)  # (B,) real tokens
    cu = tuple([0] + lengths.cumsum(0).tolist())
    real = x[m.to(x.device)].unsqueeze(0)  # (1, N[, E]): the rows' real tokens, in order
    x_local = shard(real, 1, layout, rank=rank, world=world, cu_seqlens=cu)
    q_pos = positions(cu[-1], layout, rank, world, cu_seqlens=cu)  # (L_local,) within rows
    index = varlen_index(cu, layout, rank, world)  # -1: the layout's pads
    rows = (index >= 0).nonzero().squeeze(1)
    row_of = torch.searchsorted(torch.tensor(cu), index[rows], right=True) - 1  # batch row of each
    keep = call.keep or t
    slot = keep - lengths[row_of] + q_pos[rows]  # (row r, position o) among row r's last `keep`
    sel = slot >= 0
    kw["logits_to_keep"] = rows[sel]
    step = Step(
        decode=False,
        q_positions=q_pos,
        total=t,
        cache=call.cache,
        keep=keep,
        keep_at=row_of[sel] * keep + slot[sel],
        packing=Packing(cu, 1, cu[-1]),
        pad=PadStep(rows_kept=row_of, lengths=lengths, prompt_mask=m, keep_rows=b),
    )
    return _finish(state, model, call, kw, step, x_local, rows, q_pos.numel() * world)


def left_padded_decode(cache, mask, pos, b: int, t: int, owner: bool):
    """A decode step of a left-padded batch: ``(q_pos (B, T) host, PadStep)`` after checking that
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
    kept = torch.arange(b).repeat_interleave(t) if owner else torch.zeros(0, dtype=torch.long)
    return q_pos, PadStep(
        rows_kept=kept, lengths=cache.lengths + t, q_virtual=q_virtual, reach=reach
    )


# ---------------------------------------------------------------------------------------------
# inputs="shard": the shards checked whole, after the ranks agreed


def check_shards(state, plan: Plan) -> Step:
    """The shards' mask and labels, whole ``(B, S)`` (packed: ``(1, S)``), checked alike on every
    rank; the plan's step with this rank's targets (and no cache for a padded batch)."""
    sh, step = plan.shards, plan.step
    device = plan.x_local.device

    def whole(t):
        if t is None:
            return None
        t = t.to(device).long()
        if step.packing is not None:
            return gather_packed(t, step.packing.cu, state.layout, state.group, state.timeout)
        return gather_seq(t, state.layout, state.group, state.timeout, state.ulysses)

    unshifted = whole(sh.unshifted)  # labels first, then shift_labels, then the mask
    labels, mask = whole(sh.targets), whole(sh.mask)
    check_rows(mask, step.packing, labels, sh.shifted, unshifted)
    cache = step.cache
    if mask is not None and not bool(mask.bool().all()):
        if plan.explicit_cache:
            raise ValueError(
                "ringkv: padding masks are for training and scoring without a KV cache: pass "
                "use_cache=False and no cache"
            )
        cache = None
    targets = None
    if labels is not None:
        s_pad = labels.shape[1]  # packed: unused
        targets = _state_targets(state, labels, sh.shifted, step.packing, s_pad, device)
    return replace(step, cache=cache, targets=targets)
