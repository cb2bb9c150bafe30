"""Encoders and bidirectional attention in a patched model: ModernBERT, BERT, RoBERTa, XLM-R
(base models, ``*ForMaskedLM``, ``*ForTokenClassification``, ``*ForSequenceClassification``) and
decoders whose attention layers have ``is_causal=False`` (embedding models; base models only).

- ``classify`` (patch time): whether the model is bidirectional, what its head pools, and every
  refusal (``ValueError`` naming the class or option), before any collective.
- Padding: a bidirectional query sees every key it is not masked from, so a right-padded row's
  pads become a packed document of their own (``split_pads``): real tokens never see a pad, and
  the pads' outputs are never used.
- ``Tokens``: whose each local token is (batch row, position, real), for pooling.
- Pooling over the whole sequence (``pool``, by ``sp.collectives.shared_pool``): the
  ``pooling=`` forward argument (``out.pooled``) and the classification heads' pooled token
  (``install``: a pre-hook on the module that pools gives it the global CLS token or mean). The
  modules after pooling run on every rank on the same pooled values: ``install`` scales their
  parameters' gradients by ``1 / N``, so gradients summed over the SP group are the unpatched ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..sp.collectives import rank_world, shared_pool
from ..sp.layout import granule, shard, varlen_index
from .state import Packing

POOLINGS = ("mean", "cls", "last")
# the inputs of one value per token that are sharded like the tokens
TOKEN_INPUTS = ("token_type_ids",)
_ENCODERS = ("ModernBert", "Bert", "Roberta", "XLMRoberta")
_HEADS = ("Model", "ForMaskedLM", "ForTokenClassification", "ForSequenceClassification")


@dataclass(frozen=True)
class Encoder:
    """A bidirectional model's patch: ``pooler`` (the module whose input ringkv replaces by the
    pooled token, None if none), ``pooler_input`` (``"sequence"``: it takes ``(B, S, H)`` and uses
    row 0; ``"pooled"``: it takes ``(B, H)``), ``how`` (its pooling), ``roberta_pad`` (RoBERTa's
    positions start after the pad id: the padding index, else None) and ``replicated`` (the
    parameters used after pooling)."""

    name: str
    pooler: Optional[torch.nn.Module] = None
    pooler_input: str = "sequence"
    how: str = "cls"
    roberta_pad: Optional[int] = None
    replicated: Tuple[torch.nn.Parameter, ...] = ()
    per_token_labels: bool = True  # labels (B, S) per token (MLM, token classes); else the model's


@dataclass(frozen=True)
class Tokens:
    """This rank's tokens of a forward, flat ``(n,)`` host tensors in local order: batch ``row``,
    ``pos`` (position in the row) and ``real`` (not a pad, neither the mask's nor the layout's);
    ``lengths`` ``(B,)`` real tokens per row."""

    row: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    lengths: torch.Tensor


# ---------------------------------------------------------------------------------------------
# patch time


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(f"ringkv.patch_model: {name} {why}")


def classify(model, layers) -> Optional[Encoder]:
    """None for a causal model; the ``Encoder`` of a bidirectional one (attention layers with
    ``is_causal=False``); ``ValueError`` for what ringkv cannot split exactly."""
    name = type(model).__name__
    config = model.config
    causal = [bool(m.is_causal) for m in layers]
    cross = [type(m).__name__ for m in model.modules() if "CrossAttention" in type(m).__name__]
    if cross and getattr(config, "add_cross_attention", False):
        raise _refuse(name, f"has cross-attention ({cross[0]}); ringkv splits self-attention only")
    if all(causal) and getattr(config, "is_causal", True):
        return None
    if any(causal):
        raise _refuse(
            name,
            "mixes causal and bidirectional attention (config.is_causal=False with causal "
            "layers, or layers of both kinds); set is_causal=False on every attention layer and "
            "in the config, or on none",
        )
    family = next((f for f in _ENCODERS if name.startswith(f) and name[len(f) :] in _HEADS), None)
    if family is None:
        return _decoder(model, name)
    if family == "ModernBert":
        return _modernbert(model, name)
    return _bert_like(model, name, family)


def _decoder(model, name: str) -> Encoder:
    """A decoder run bidirectionally (an embedding model): its base model only."""
    from transformers import PreTrainedModel

    base = getattr(model, "base_model", model)
    decoder = getattr(model.config, "is_causal", True) is False  # transformers' bidirectional mask
    if base is not model or not isinstance(model, PreTrainedModel) or not decoder:
        raise _refuse(
            name,
            "is a bidirectional model ringkv does not know (is_causal=False); it runs encoders "
            "(ModernBert, Bert, Roberta, XLMRoberta: *Model, *ForMaskedLM, "
            "*ForTokenClassification, *ForSequenceClassification) and the base models of "
            "decoders run bidirectionally (config.is_causal=False and every attention layer's, "
            "e.g. LlamaModel: pool with pooling=); generate needs causal attention",
        )
    text = model.config.get_text_config()
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        raise _refuse(
            name, "has sliding-window layers, which ringkv runs bidirectionally only for ModernBERT"
        )
    return Encoder(name)


def _modernbert(model, name: str) -> Encoder:
    config = model.config
    if name.endswith("ForSequenceClassification"):
        if config.classifier_pooling not in ("cls", "mean"):
            raise _refuse(name, f"classifier_pooling={config.classifier_pooling!r}: cls or mean")
        after = [model.head, model.classifier]
        return Encoder(
            name,
            pooler=model.head,
            pooler_input="pooled",
            how=config.classifier_pooling,
            replicated=tuple(p for m in after for p in m.parameters()),
            per_token_labels=False,
        )
    return Encoder(name)


def _bert_like(model, name: str, family: str) -> Encoder:
    """BERT, RoBERTa and XLM-R: a pooler (BERT; RoBERTa's base model) or a classification head
    (RoBERTa, XLM-R) that takes the sequence and uses its first token."""
    base = model.base_model
    emb = base.embeddings
    roberta_pad = emb.padding_idx if hasattr(emb, "create_position_ids_from_input_ids") else None
    seq_class = name.endswith("ForSequenceClassification")
    pooler = getattr(base, "pooler", None)
    if seq_class and family != "Bert":
        pooler = model.classifier  # RobertaClassificationHead: features[:, 0, :]
    if pooler is None:
        return Encoder(name, roberta_pad=roberta_pad)
    after = [pooler] + ([model.classifier] if seq_class and family == "Bert" else [])
    return Encoder(
        name,
        pooler=pooler,
        roberta_pad=roberta_pad,
        replicated=tuple(p for m in after for p in m.parameters()),
        per_token_labels=not seq_class,
    )


def install(model, state, encoder: Encoder) -> list:
    """The pooler's pre-hook and the ``1 / N`` gradient hooks of the parameters after pooling:
    their handles (``unpatch_model`` removes them)."""
    handles = []
    if encoder.pooler is not None:
        handles.append(
            encoder.pooler.register_forward_pre_hook(
                lambda mod, args: _pooled_input(state, encoder, args)
            )
        )
    if state.world > 1:
        scale = 1.0 / state.world
        handles += [p.register_hook(lambda g: g * scale) for p in encoder.replicated]
    return handles


def _pooled_input(state, encoder: Encoder, args):
    """The pooler's input replaced by the pooled token of the whole sequence: ``(B, 1, H)`` for a
    module that takes the sequence and uses its first row, ``(B, H)`` for one that takes it
    pooled."""
    step = state.step
    if step is None or step.tokens is None:
        return None
    x = args[0] if encoder.pooler_input == "sequence" else state.hidden  # (B, S_local, H)
    pooled = pool(x, step.tokens, encoder.how, state.group, state.timeout)  # (B, H)
    return (pooled[:, None] if encoder.pooler_input == "sequence" else pooled,) + tuple(args[1:])


# ---------------------------------------------------------------------------------------------
# a forward


def check_pooling(value) -> Optional[str]:
    if value is None or value in POOLINGS:
        return value
    raise ValueError(f"ringkv: pooling must be one of {POOLINGS} or None, got {value!r}")


def split_pads(pk: Optional[Packing], mask: torch.Tensor) -> Packing:
    """The packed documents of a right-padded batch ``mask`` ``(B, S)``: each row (or each packed
    document ``pk`` of it) split where its padding starts, so the pads form a document of their
    own that no real token sees."""
    b, t = mask.shape
    m = mask.detach().bool().cpu().reshape(-1)
    starts = torch.zeros(b * t, dtype=torch.bool)
    starts[list(pk.cu[:-1]) if pk is not None else list(range(0, b * t, t))] = True
    starts[1:] |= m[:-1] & ~m[1:]  # a pad after a real token starts the pads' document
    cu = starts.nonzero().squeeze(1).tolist() + [b * t]
    return Packing(tuple(cu), b, t)


def packing(pk: Optional[Packing], mask, b: int, t: int, layout: str, world: int, ulysses=1):
    """The packed documents a bidirectional forward of ``(b, t)`` tokens runs: ``pk`` (the
    given documents, or None) split at the pads of ``mask`` when the batch is padded, or its rows
    as documents when ``t`` does not fill the layout's granule (the layout's end padding would be
    seen too); else ``pk``."""
    padded = mask is not None and not bool(mask.bool().all())
    if not padded and t % granule(layout, world, ulysses) == 0:
        return pk
    return split_pads(pk, mask if mask is not None else torch.ones(b, t, dtype=torch.long))


def encoder_cu_seqlens(attention_mask=None, *, shape=None, layout="zigzag", group=None):
    """The ``cu_seqlens`` of the packed row a patched bidirectional model runs for a batch with
    ``attention_mask`` ``(B, S)`` (or none, ``shape=(B, S)``) on ``group`` in ``layout``, or None
    when it runs the rows as they are: what ``gather_logits(..., cu_seqlens=)`` takes to gather
    its token outputs (``(1, B * S, V)``, each row's pads included)."""
    b, t = tuple(attention_mask.shape) if attention_mask is not None else tuple(shape)
    pk = packing(None, attention_mask, b, t, layout, rank_world(group)[1])
    return None if pk is None else list(pk.cu)


def tokens(
    mask: Optional[torch.Tensor], b: int, t: int, pk: Optional[Packing], q_pos, layout, rank, world
) -> Tokens:
    """``Tokens`` of this rank: rows ``(B, S_pad / N)`` at global positions ``q_pos``, or the
    packed row of ``pk`` (``B * S`` tokens, every document split by the layout)."""
    m = torch.ones(b, t, dtype=torch.bool) if mask is None else mask.detach().bool().cpu()
    if pk is None:
        row = torch.arange(b).repeat_interleave(q_pos.numel())
        pos = q_pos.repeat(b)
        inside = pos < t
    else:
        index = varlen_index(pk.cu, layout, rank, world)  # -1: the layout's pads
        inside = index >= 0
        row, pos = index.clamp(min=0) // t, index.clamp(min=0) % t
    real = inside & m[row, pos.clamp(max=t - 1)]
    return Tokens(row, pos, real, m.sum(1))


def pool(x: torch.Tensor, tok: Tokens, how: str, group, timeout) -> torch.Tensor:
    """``how`` (``"mean"`` of the real tokens, ``"cls"``: position 0, ``"last"``: the last real
    token) pooling of the hidden states ``x`` ``(B, S_local, H)`` (packed: ``(1, L_local, H)``) of
    this rank's ``tok`` -> ``(B, H)`` on every rank; gradient: this rank's share."""
    if how == "mean":
        w = tok.real.double() / tok.lengths.clamp(min=1)[tok.row].double()
    elif how == "cls":
        w = (tok.real & (tok.pos == 0)).double()
    else:
        w = (tok.real & (tok.pos == tok.lengths[tok.row] - 1)).double()
    flat = x.reshape(-1, x.shape[-1])  # (n, H)
    return shared_pool(flat, tok.row, w, tok.lengths.numel(), group, timeout)


def shard_tokens(
    values: torch.Tensor, step, layout: str, rank: int, world: int, ulysses: int = 1
) -> torch.Tensor:
    """A per-token input ``(B, S)`` sharded like the tokens of ``step``: ``(B, S_pad / N)``
    (pads 0; ``ulysses``: USP's degree), or the packed row's ``(1, L_local)``."""
    if step.packing is not None:
        flat = values.reshape(1, -1)
        return shard(flat, 1, layout, rank=rank, world=world, cu_seqlens=step.packing.cu)
    s_pad = step.q_positions.numel() * world
    padded = torch.nn.functional.pad(values, (0, s_pad - values.shape[1]))
    return shard(padded, 1, layout, rank=rank, world=world, ulysses=ulysses)


def roberta_positions(ids, x, padding_idx: int) -> torch.Tensor:
    """RoBERTa's and XLM-R's position ids of the whole rows ``(B, S)``: counted over the tokens
    that are not the pad id, from ``padding_idx + 1`` (pads: ``padding_idx``), as their
    embeddings compute them."""
    if ids is not None:
        real = ids.ne(padding_idx).long()
        return torch.cumsum(real, 1) * real + padding_idx
    b, t = x.shape[:2]
    return torch.arange(padding_idx + 1, t + padding_idx + 1, device=x.device).expand(b, t)
