"""The attention layers of a patched model: the ``AttentionInterface`` function ``"ringkv"``
(``ringkv_attention``: the SP prefill, or a decode step over the sharded cache) and the sharded KV
cache they fill (``ShardedKVCache``, begun for each forward by ``begin_cache``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..kernels.mask import NO_WINDOW
from ..sp.decode import decode_attention
from ..sp.ring import ring_attention
from ..sp.ulysses import ulysses_attention
from ..sp.usp import usp_attention
from .state import Step


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

    def __init__(self, config=None):
        super().__init__(config=config)  # a hybrid model's config: its layers' recurrent states
        self.positions = torch.zeros(0, dtype=torch.long)
        self.seen = 0  # global tokens in the sequence so far (same on every rank)
        self.decode_steps = 0  # forwards after the prefill: the owner of step i is rank i % N
        self._keep: Optional[torch.Tensor] = None  # rows of the current forward to cache
        self._prefill = False
        # a left-padded batch (``lengths`` set): pads are never cached; the real tokens of all rows
        # are packed into one cache row (keys (1, Hkv, S_local, D)), ``rows`` (S_local,) says
        # whose each is
        self.rows: Optional[torch.Tensor] = None  # host: the batch row of each cached token
        self.lengths: Optional[torch.Tensor] = None  # host (B,): real tokens of each row (global)
        self.pad_mask: Optional[torch.Tensor] = None  # host bool (B, S_prompt): the prompt's mask
        self._pack = False  # this forward's (B, Hkv, T, D) are packed into (1, Hkv, B*T, D)

    def _begin(
        self, positions_kept: torch.Tensor, keep: Optional[torch.Tensor], prefill: bool, seen: int
    ) -> None:
        self.positions = torch.cat([self.positions.to(positions_kept.device), positions_kept])
        self._keep, self._prefill, self.seen = keep, prefill, seen

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key/value_states (B, Hkv, T, D): cache only this rank's rows
        k, v = key_states, value_states
        if self._pack:  # a left-padded batch's decode step: row-major (b, t), as rows number them
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


def resolve_cache(model, kw: dict, hybrid: bool = False):
    """``(cache, explicit)``: the ``ShardedKVCache`` a forward fills (an empty cache of another
    kind, or none with ``use_cache``, becomes a new one; None: no cache), and whether a cache or
    ``use_cache=True`` was passed. ``hybrid``: the new cache has the model's recurrent layers'
    states too (built from its config)."""
    cache = kw.get("cache")
    use_cache = kw.get("use_cache")
    explicit = cache is not None or use_cache is True
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if cache is not None and not isinstance(cache, ShardedKVCache):
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"ringkv: got a {type(cache).__name__} that already holds tokens; a patched model "
                "keeps its KV cache sharded: pass no cache, an empty one, or the ShardedKVCache it "
                "returned"
            )
        cache = ShardedKVCache(model.config if hybrid else None)
    elif cache is None and use_cache:
        cache = ShardedKVCache(model.config if hybrid else None)
    return cache, explicit


def begin_cache(step: Step, rows: Optional[torch.Tensor], device) -> Step:
    """Tell ``step.cache`` which of the forward's rows (``rows``, host; None: all) this rank keeps;
    returns ``step`` (a left-padded decode step's with the cached keys' virtual positions)."""
    cache, pad = step.cache, step.pad
    if cache is None:
        return step
    flat = step.q_positions.reshape(-1)  # (B*T,) for a left-padded batch's decode step, row-major
    kept = flat if rows is None else flat[rows]  # host index into host positions
    keep = None if rows is None else rows.to(device)
    cache._begin(kept, keep, prefill=not step.decode, seen=step.total)
    if pad is not None:
        cache._begin_rows(pad.rows_kept, pad.lengths, pad.prompt_mask, pack=step.decode)
        if step.decode:
            pad = replace(pad, k_virtual=cache.rows * (2 * pad.reach) + cache.positions)
    if step.decode:
        cache.decode_steps += 1
    return replace(step, pad=pad)


# ---------------------------------------------------------------------------------------------
# the attention function transformers calls


def _current(module):
    """``(state, step)`` of the forward under way on ``module``'s patched model."""
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
    return state, step


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
    (``s_aux`` ``(H,)``) are applied as the model's eager attention does."""
    state, step = _current(module)
    if dropout:
        raise ValueError(
            f"ringkv: attention dropout ({dropout}) is not supported; set the config's attention "
            "dropout to 0 (attention_dropout; BERT, RoBERTa: attention_probs_dropout_prob) or call "
            "model.eval()"
        )
    # transformers' sliding window of W tokens: a query sees itself and the W - 1 keys before it;
    # bidirectional (ModernBERT's local layers): the W - 1 keys on either side
    causal = bool(getattr(module, "is_causal", True))
    w = None if sliding_window is None else sliding_window - 1
    window = NO_WINDOW if w is None else ((w, 0) if causal else (w, w))
    q, k, v = (t.transpose(1, 2) for t in _autocast(query, key, value))  # (B, S, H, D) ringkv
    kw = dict(
        causal=causal,
        softmax_scale=scaling,
        timeout=state.timeout,
        window=window,
        softcap=softcap or None,  # transformers passes 0/None for "no cap"
        sinks=kwargs.get("s_aux"),  # gpt-oss: one sink logit per query head
    )
    if step.decode:
        kw.pop("causal")
        return _decode(state, step, q, k, v, kw), None  # (B, T, H, D)
    return _prefill(state, step, q, k, v, kw), None  # (B, S_local, H, D)


def _autocast(*tensors) -> tuple:
    """``tensors`` in the autocast dtype when autocast is on for their device (CPU/CUDA bf16
    training): the rotary embedding's float32 cos/sin promote q and k back to float32 while v
    stays in the projection's autocast dtype; transformers' SDPA and eager attention run in the
    autocast dtype. Without autocast the tensors are returned as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _decode(state, step: Step, q, k, v, kw: dict) -> torch.Tensor:
    """New tokens (the same on every rank) over this rank's cache, merged across the group."""
    if step.pad is None:
        return decode_attention(
            q,
            k,
            v,
            q_positions=step.q_positions,
            k_positions=step.cache.positions,
            group=state.group,
            **kw,
        )
    # left-padded rows: one call on virtual positions (see PadStep)
    b, t, h, d = q.shape
    window = kw.pop("window")
    left = step.pad.reach if window[0] < 0 else min(window[0], step.pad.reach)
    out = decode_attention(
        q.reshape(1, b * t, h, d),
        k,
        v,
        q_positions=step.pad.q_virtual,
        k_positions=step.pad.k_virtual,
        group=state.group,
        window=(left, 0),
        **kw,
    )
    return out.view(b, t, h, out.shape[-1])


def _prefill(state, step: Step, q, k, v, kw: dict) -> torch.Tensor:
    """This rank's shard of the sequence, in ``state.attention`` (packed documents and left-padded
    rows: the varlen ring; the pre-hook already checked that every rank makes the same call)."""
    kw.update(layout=state.layout, check=False)
    if step.spans is not None:  # Gemma 3's images (hf/image_mask.py)
        kw["spans"] = step.spans
    if step.cu is None and state.attention == "ulysses":
        return ulysses_attention(q, k, v, group=state.group, **kw)
    if state.attention == "usp":
        ulysses_group, ring_group = state.groups
        return usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, **kw)
    # packed documents (step.cu): the varlen ring, each document split by the layout on its own
    return ring_attention(q, k, v, group=state.group, cu_seqlens=step.cu, **kw)


# torch.compile: the attention runs eagerly (one graph break: it communicates and makes per-call
# Python decisions that would otherwise be traced and guarded on); the layers around it compile
@torch.compiler.disable
def eager_attention(*args, **kwargs):
    return ringkv_attention(*args, **kwargs)
