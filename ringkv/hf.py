"""Sequence-parallel (ring) attention for HuggingFace causal LMs in one call.

    model = ringkv.patch_model(model, group=sp_group, layout="zigzag")   # every rank of the group
    out = model(input_ids=ids)                  # ids: the FULL sequence on every rank (inputs="full")
    logits = out.logits                         # (B, S_pad / N, V): this rank's shard, in `layout`
    full = ringkv.gather_logits(logits, "zigzag", sp_group, seq_len=ids.shape[1])  # (B, S, V)
    loss = ringkv.causal_lm_loss(logits, labels, layout="zigzag", group=sp_group)  # global mean
    tokens = model.generate(ids, max_new_tokens=32, do_sample=False)   # sharded KV cache

How it works: ``patch_model`` registers the attention function ``"ringkv"`` with transformers'
public ``AttentionInterface`` and switches the model to it with ``set_attn_implementation``.
A forward pre-hook on the model shards the inputs and supplies *global* ``position_ids`` (so
rotary embeddings and causal masks see global positions in every layout); the attention
function runs ``ringkv.ring_attention`` (or ``ulysses_attention`` / ``usp_attention`` with
``method=``; prefill, differentiable) or ``ringkv.sp.decode.decode_attention`` (new tokens over
the sharded cache), with the layer's sliding window when it has one. A forward hook
assembles ``logits_to_keep`` logits and the loss when ``labels`` are passed.

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

Once a ``ShardedKVCache`` holds tokens, later calls (decode steps) take new tokens that are the
same on every rank (``(B, T)``, any ``T >= 1``) in both modes; they are appended to one owner
rank's cache (round-robin over steps) and every rank gets the same logits.

Generation: ``model.generate`` (``inputs="full"``) works as usual on every rank in lockstep;
an empty ``DynamicCache`` (generate's default) is replaced by a :class:`ShardedKVCache` that
keeps only this rank's tokens. Sampling must use the same seed on every rank.

Not supported (clear errors): padding in ``attention_mask`` (see the message for the fix),
attention dropout, soft-capping, attention sinks,
non-causal attention, models that do not call attention through ``AttentionInterface``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional

import torch
import torch.nn.functional as F

from .sp.collectives import agree, all_gather, all_sum, rank_world
from .sp.decode import decode_attention
from .kernels.mask import NO_WINDOW
from .sp.layout import check_layout, check_seq_len, granule, positions, shard
from .sp.ring import ring_attention
from .sp.ulysses import head_plan, ulysses_attention
from .sp.usp import sp_groups, usp_attention

__all__ = ["patch_model", "unpatch_model", "gather_logits", "causal_lm_loss", "ShardedKVCache", "ATTN_NAME"]

ATTN_NAME = "ringkv"
IGNORE_INDEX = -100
PADDING_HELP = ("ringkv: attention_mask contains padding (zeros); sequence-parallel attention cannot honour "
                "padding masks. Pass batch rows of equal length without padding (batch size 1, or group "
                "prompts by length). For training with right padding, drop the attention_mask and set the "
                "labels of the padded tokens to -100: causal attention never lets a real token see a later "
                "pad, so the loss is the same.")


def _dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache


class ShardedKVCache(_dynamic_cache()):
    """A ``DynamicCache`` that keeps only this rank's tokens of a sequence-sharded KV cache.

    ``positions`` ``(S_local,)`` are the global positions of the cached tokens (the same for
    every layer); ``get_seq_length()`` returns the *global* number of tokens seen, which is
    what ``generate`` expects. The model's pre-hook tells the cache, before each forward,
    which of the forward's rows this rank keeps.
    """

    def __init__(self):
        super().__init__()
        self.positions = torch.zeros(0, dtype=torch.long)
        self.seen = 0           # global tokens in the sequence so far (same on every rank)
        self.decode_steps = 0   # forwards after the prefill: the owner of step i is rank i % N
        self._keep: Optional[torch.Tensor] = None  # rows of the current forward to cache
        self._prefill = False

    def _begin(self, positions_kept: torch.Tensor, keep: Optional[torch.Tensor], prefill: bool, seen: int) -> None:
        self.positions = torch.cat([self.positions.to(positions_kept.device), positions_kept])
        self._keep, self._prefill, self.seen = keep, prefill, seen

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key/value_states (B, Hkv, T, D): cache only this rank's rows
        k, v = key_states, value_states
        if self._keep is not None:
            k, v = k[:, :, self._keep], v[:, :, self._keep]
        keys, values = super().update(k, v, layer_idx, *args, **kwargs)  # (B, Hkv, S_local, D)
        if self._prefill:  # the ring needs the forward's whole shard (padding rows included)
            return key_states, value_states
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ShardedKVCache cannot be cropped (assisted decoding is not supported)")


@dataclass
class _Step:
    """What the pre-hook decided for one forward (read by the attention function and post-hook)."""
    decode: bool
    q_positions: torch.Tensor            # (T,) global positions of this rank's query rows (host, like the
                                         # cache's: decode masks are classified without a device sync)
    total: int                           # global sequence length (real tokens) including this forward
    cache: Optional[ShardedKVCache] = None
    keep: int = 0                        # logits_to_keep (prefill): last `keep` global tokens
    keep_at: Optional[torch.Tensor] = None  # where this rank's kept rows go in those `keep`
    labels: Optional[torch.Tensor] = None


METHODS = ("ring", "ulysses", "usp")


@dataclass
class _State:
    group: object
    layout: str
    rank: int
    world: int
    method: str
    ulysses: int                         # usp: the Ulysses degree (ranks form sp_groups' mesh); else 1
    groups: tuple                        # usp: (ulysses_group, ring_group)
    inputs: str
    timeout: Optional[timedelta]
    prev_impl: str
    modules: List[torch.nn.Module]
    handles: list = field(default_factory=list)
    step: Optional[_Step] = None        # set by the pre-hook for one forward, cleared by the post-hook
    recompute: Optional[_Step] = None   # the last training prefill, for activation checkpointing's replay


# ---------------------------------------------------------------------------------------------
# the attention function transformers calls

def ringkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, softcap=None, **kwargs):
    """``AttentionInterface`` function: query ``(B, H, S, D)``, key/value ``(B, Hkv, S_kv, D)``
    -> ``(attn_output (B, S, H, D), None)``."""
    state = getattr(module, "_ringkv_state", None)
    step = None if state is None else state.step or (state.recompute if torch.is_grad_enabled() else None)
    if step is None:
        raise RuntimeError("ringkv attention ran outside the forward of a model patched by ringkv.patch_model: "
                           "call the patched model itself (not a submodule), or ringkv.unpatch_model it")
    if dropout:
        raise ValueError(f"ringkv: attention dropout ({dropout}) is not supported; set config.attention_dropout=0 "
                         f"or call model.eval()")
    # transformers' sliding window of W tokens: a query sees itself and the W - 1 keys before it
    window = NO_WINDOW if sliding_window is None else (sliding_window - 1, 0)
    if softcap or kwargs.get("s_aux") is not None:
        raise ValueError("ringkv: attention soft-capping and attention sinks are not supported")
    if not getattr(module, "is_causal", True):
        raise ValueError("ringkv: only causal (decoder) self-attention is supported")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) ringkv layout
    if step.decode:
        out = decode_attention(q, k, v, q_positions=step.q_positions, k_positions=step.cache.positions,
                               group=state.group, softmax_scale=scaling, timeout=state.timeout, window=window)
        return out, None  # (B, T, H, D)
    # the pre-hook already checked that every rank makes the same call
    kw = dict(causal=True, layout=state.layout, softmax_scale=scaling, timeout=state.timeout, check=False,
              window=window)
    if state.method == "ulysses":
        out = ulysses_attention(q, k, v, group=state.group, **kw)
    elif state.method == "usp":
        out = usp_attention(q, k, v, ulysses_group=state.groups[0], ring_group=state.groups[1], **kw)
    else:
        out = ring_attention(q, k, v, group=state.group, **kw)
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
    if given.dim() != 2 or given.shape[-1] != want.numel() or not torch.equal(
            given.to(want.device), want.expand(given.shape[0], -1)):
        raise ValueError(f"ringkv: position_ids must be {what} (shape (B, {want.numel()})); custom position ids "
                         f"(packing, offsets) are not supported. Omit position_ids to let ringkv supply them")


def _pre_hook(state: _State, model, args, kwargs):
    kw = _as_kwargs(model, args, kwargs)
    state.step = None
    ids, emb = kw.get("input_ids"), kw.get("inputs_embeds")
    x = ids if ids is not None else emb
    if x is None:
        raise ValueError("ringkv: pass input_ids or inputs_embeds")
    b, t = x.shape[:2]
    rank, world, layout, u = state.rank, state.world, state.layout, state.ulysses

    # --- local checks (before any collective) ---
    mask = kw.pop("attention_mask", None)
    if mask is not None and (mask.dim() != 2 or not bool(mask.bool().all())):
        raise ValueError(PADDING_HELP if mask.dim() == 2 else
                         f"ringkv: only 2-D attention masks without padding are supported, got {mask.dim()}-D")
    cache = kw.get("cache")
    use_cache = kw.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if cache is not None and not isinstance(cache, ShardedKVCache):
        if cache.get_seq_length() > 0:
            raise ValueError(f"ringkv: got a {type(cache).__name__} that already holds tokens; a patched model keeps "
                             f"its KV cache sharded: pass no cache, an empty one, or the ShardedKVCache it returned")
        cache = ShardedKVCache()
    elif cache is None and use_cache:
        cache = ShardedKVCache()
    if cache is not None:
        kw["cache"] = cache
    labels = kw.pop("labels", None)
    keep = kw.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or not isinstance(keep, int) or keep < 0:
        raise ValueError("ringkv: logits_to_keep must be a non-negative int (the last tokens of the global sequence)")
    if (keep or labels is not None) and kw.get("return_dict") is False:
        raise ValueError("ringkv: use return_dict=True with labels or logits_to_keep")
    decode = cache is not None and cache.seen > 0
    replicated = decode or state.inputs == "full"

    if decode:
        if labels is not None:
            raise ValueError("ringkv: labels are supported for the prefill (no cache, or an empty one) only")
        seq, s_pad = cache.seen + t, t
        q_pos = torch.arange(cache.seen, seq)                                          # (T,) on the host
        _check_positions(kw.get("position_ids"), q_pos, f"the global positions {cache.seen}..{seq - 1}")
        owner = cache.decode_steps % world  # the new tokens are cached on one rank, round-robin
        rows = None if rank == owner else torch.zeros(0, dtype=torch.long)  # host, like q_pos
        x_local, keep_at = x, None
    else:
        if state.inputs == "full":
            seq, g = t, granule(layout, world, u)
            s_pad = -(-seq // g) * g
            _check_positions(kw.get("position_ids"), torch.arange(seq, device=x.device), f"0..{seq - 1}")
        else:
            seq = s_pad = t * world
            check_seq_len(s_pad, layout, world, u)
        q_pos = positions(s_pad, layout, rank, world, ulysses=u)                       # (S_pad / N,) host
        if state.inputs == "shard":
            _check_positions(kw.get("position_ids"), q_pos, f"this rank's global positions in layout {layout!r}")
            x_local = x
        else:
            if s_pad > seq:  # pad at the end: invisible to every real token under causal attention
                pad = getattr(model.config, "pad_token_id", None) or 0
                tail = (x.new_full((b, s_pad - seq), pad) if ids is not None else x.new_zeros(b, s_pad - seq, x.shape[2]))
                x = torch.cat([x, tail], 1)                                            # (B, S_pad[, E])
            x_local = shard(x, 1, layout, rank=rank, world=world, ulysses=u)            # (B, S_pad / N[, E])
        rows = (q_pos < seq).nonzero().squeeze(1) if s_pad > seq else None
        keep_at = None
        if keep:
            sel = (q_pos >= seq - keep) & (q_pos < seq)
            keep_at = q_pos[sel] - (seq - keep)
            kw["logits_to_keep"] = sel.nonzero().squeeze(1)  # local rows among the last `keep` global tokens

    # --- every rank must make the same call: one tiny all-gather ---
    names = ["phase", "batch", "sequence length", "cache length", "logits_to_keep", "labels", "input tokens"]
    agree([int(decode), b, s_pad, cache.seen if cache is not None else -1, keep,
           labels is not None, _checksum(ids) if replicated else 0], names, state.group, state.timeout,
          "ringkv.patch_model", device=x.device)

    # --- commit ---
    kw["input_ids" if ids is not None else "inputs_embeds"] = x_local
    kw["position_ids"] = q_pos.to(x.device).unsqueeze(0).expand(b, -1)                  # global positions
    if cache is not None:
        kept = q_pos if rows is None else q_pos[rows]  # host index into host positions
        cache._begin(kept, None if rows is None else rows.to(x.device), prefill=not decode, seen=seq)
        if decode:
            cache.decode_steps += 1
    state.step = _Step(decode=decode, q_positions=q_pos, total=seq, cache=cache,
                       keep=0 if decode else keep, keep_at=keep_at, labels=labels)
    return (), kw


def _post_hook(state: _State, model, args, kwargs, output):
    step, state.step = state.step, None
    if step is None or output is None:  # the forward raised
        return None
    # activation checkpointing replays the layers' forwards during backward, after this hook
    replay = not step.decode and torch.is_grad_enabled() and getattr(model, "is_activation_checkpointing", False)
    state.recompute = _Step(decode=False, q_positions=step.q_positions, total=step.total) if replay else None
    if step.keep:  # assemble the last `keep` global logits on every rank: zeros elsewhere, summed
        local = output.logits                                                           # (B, r, V)
        full = local.new_zeros(local.shape[0], step.keep, local.shape[2])
        full[:, step.keep_at] = local
        output.logits = all_sum(full, state.group, state.timeout, "ringkv logits_to_keep")  # (B, keep, V)
    if step.labels is not None:
        output.loss = causal_lm_loss(output.logits, step.labels, layout=state.layout, group=state.group,
                                     sharded=state.inputs == "shard", timeout=state.timeout, ulysses=state.ulysses)
    return output


# ---------------------------------------------------------------------------------------------
# public API

def patch_model(model, sp: Optional[int] = None, group=None, layout: str = "zigzag", *, method: str = "ring",
                ulysses: Optional[int] = None, inputs: str = "full", timeout: Optional[float] = None):
    """Make ``model`` (a transformers causal LM) run exact sequence-parallel attention over the SP ``group``.

    Call it on every rank of ``group`` (default: the world; no process group = one rank) with
    identical weights. ``sp`` (optional) must equal the group size. ``layout`` is how the
    sequence is split (``"zigzag"`` balances causal work; ``"contiguous"``, ``"striped"``).
    ``method``: ``"ring"`` (``ring_attention``), ``"ulysses"`` (``ulysses_attention``: the
    attention heads must split over the group) or ``"usp"`` (``usp_attention`` on
    ``sp_groups(ulysses=U, ring=N/U)`` of the default world: pass ``ulysses=U``). Layers with
    a sliding window (Mistral, Qwen2) attend within it, at any length.
    ``inputs`` is ``"full"`` (every rank passes the whole sequence) or ``"shard"`` (every rank
    passes its own shard); see the module docstring. ``timeout`` (seconds) bounds every wait
    on a peer. Returns the same model, patched in place; ``unpatch_model`` restores it.
    """
    from transformers import AttentionInterface, PreTrainedModel

    check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if inputs not in ("full", "shard"):
        raise ValueError(f"inputs must be 'full' or 'shard', got {inputs!r}")
    if getattr(model, "_ringkv_state", None) is not None:
        raise ValueError("this model is already patched by ringkv; call ringkv.unpatch_model(model) first")
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or not getattr(model, "_supports_attention_backend", False) \
            or not model._can_set_attn_implementation():
        raise TypeError(f"ringkv.patch_model needs a transformers model whose attention goes through "
                        f"AttentionInterface (model._supports_attention_backend and set_attn_implementation), "
                        f"e.g. Llama, Qwen2, Mistral; {name} does not")
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"ringkv.patch_model supports decoder-only causal LMs, not the encoder-decoder {name}")
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not modules:
        raise TypeError(f"ringkv.patch_model found no attention layers (modules with layer_idx and is_causal) in {name}")
    if not all(m.is_causal for m in modules):
        raise TypeError(f"ringkv.patch_model supports causal self-attention only; {name} has non-causal layers")
    rank, world = rank_world(group)
    if sp is not None and sp != world:
        raise ValueError(f"sp={sp} but the SP group has {world} rank(s); pass the process group of {sp} ranks as "
                         f"group= (or omit sp)" + ("" if world > 1 else "; call torch.distributed.init_process_group "
                                                   "first for sp > 1"))
    u, groups = _method_groups(model.config, method, ulysses, group, world)
    AttentionInterface.register(ATTN_NAME, ringkv_attention)
    state = _State(group=group, layout=layout, rank=rank, world=world, method=method, ulysses=u, groups=groups,
                   inputs=inputs,
                   timeout=None if timeout is None else timedelta(seconds=timeout),
                   prev_impl=model.config._attn_implementation, modules=modules)
    model.set_attn_implementation(ATTN_NAME)
    for m in modules:
        m._ringkv_state = state
    state.handles = [
        model.register_forward_pre_hook(lambda mod, a, k: _pre_hook(state, mod, a, k), with_kwargs=True),
        model.register_forward_hook(lambda mod, a, k, o: _post_hook(state, mod, a, k, o), with_kwargs=True,
                                    always_call=True),
    ]
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
        raise ValueError(f"method='usp' needs ulysses=U, a positive divisor of the SP world size {world} "
                         f"(ring = {world} / U), got {ulysses!r}")
    if group is not None and rank_world(group)[1] != rank_world()[1]:
        raise ValueError("method='usp' runs on sp_groups(ulysses=U, ring=N/U) of the whole default world; "
                         "leave group=None")
    head_plan(heads, kv_heads, ulysses, "patch_model(method='usp')")
    return ulysses, sp_groups(ulysses=ulysses, ring=world // ulysses)


def unpatch_model(model):
    """Undo ``patch_model``: remove the hooks and restore the previous attention implementation."""
    state = getattr(model, "_ringkv_state", None)
    if state is None:
        raise ValueError("this model is not patched by ringkv")
    for h in state.handles:
        h.remove()
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
    where = torch.cat([positions(s, layout, r, world, device=x.device, ulysses=ulysses) for r in range(world)])
    full = x.new_empty((x.shape[0], s, *x.shape[2:]))
    full[:, where] = torch.cat(parts, 1)
    return full


def gather_logits(logits: torch.Tensor, layout: str = "zigzag", group=None, seq_len: Optional[int] = None,
                  timeout: Optional[timedelta] = None, ulysses: int = 1):
    """All-gather the logits shards ``(B, S_pad / N, V)`` into global order ``(B, S, V)``
    (``seq_len`` drops the end padding added in ``inputs="full"`` mode; ``ulysses``: the
    Ulysses degree of a model patched with ``method="usp"``). Not differentiable."""
    check_layout(layout)
    full = _gather_seq(logits.detach(), layout, group, timeout, ulysses)
    return full if seq_len is None else full[:, :seq_len]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, layout: str = "zigzag", group=None,
                   sharded: bool = False, ignore_index: int = IGNORE_INDEX, timeout: Optional[timedelta] = None,
                   ulysses: int = 1):
    """Mean next-token cross-entropy of the whole sequence, from this rank's logits shard.

    ``logits`` ``(B, S_pad / N, V)`` is this rank's shard in ``layout`` (``ulysses``: the
    Ulysses degree of a model patched with ``method="usp"``). ``labels`` are the
    whole sequence's labels ``(B, S)`` (``S <= S_pad``; padding is ignored), or this rank's
    shard ``(B, S_pad / N)`` with ``sharded=True`` (gathered once). Labels are shifted once,
    globally (token ``i`` predicts label ``i + 1``; the last token predicts nothing), then
    sharded. Returns the same value on every rank, equal to the unpatched model's loss; its
    gradient is this rank's share, so gradients summed over the SP group (all-reduce, as
    data parallelism does) equal the unpatched model's.
    """
    rank, world = rank_world(group)
    b, s_local, vocab = logits.shape
    s_pad = s_local * world
    check_seq_len(s_pad, layout, world, ulysses)
    if sharded:
        if labels.shape[1] != s_local:
            raise ValueError(f"sharded labels must have this rank's length {s_local}, got {labels.shape[1]}")
        labels = _gather_seq(labels.to(logits.device), layout, group, timeout, ulysses)  # (B, S_pad)
    elif not s_pad - granule(layout, world, ulysses) < labels.shape[1] <= s_pad:
        raise ValueError(f"labels of length {labels.shape[1]} do not match logits shards of {s_local} tokens on "
                         f"{world} rank(s) (a sequence of {s_pad} tokens, padding included); pass the whole "
                         f"sequence's labels, or this rank's shard with sharded=True")
    shifted = F.pad(labels[:, 1:].to(logits.device), (0, s_pad - labels.shape[1] + 1), value=ignore_index)  # (B, S_pad)
    local = shard(shifted, 1, layout, rank=rank, world=world, ulysses=ulysses)          # (B, S_pad / N)
    loss_sum = F.cross_entropy(logits.float().reshape(-1, vocab), local.reshape(-1), ignore_index=ignore_index,
                               reduction="sum")
    count = (local != ignore_index).sum()
    totals = all_sum(torch.stack([loss_sum.detach().double(), count.double()]), group, timeout, "causal_lm_loss")
    # value: the global mean on every rank; gradient: only through this rank's own tokens
    return (loss_sum + (totals[0] - loss_sum.detach()).float()) / totals[1].float()
