"""Gemma 3's image tokens: causal attention in which each image attends to all of itself.

transformers (``Gemma3Model.forward``) builds this mask whenever a forward gets ``token_type_ids``
(training, eval, and ``generate``'s prefill; its decode steps pass none): a run of
``token_type_ids == 1`` is one image block (adjacent images are one run), seen whole by each of its
tokens; full-attention layers mask ``OR(causal, block)``, sliding ones ``AND(window, OR(causal,
block))``. The pre-hook reads the runs from the whole ``token_type_ids`` every rank passes
(``spans_of_mask``) into the forward's ``Step.spans``; the attention runs its SP method with
``spans=`` (``ringkv.sp.spans``): exact in every method and layout, forward and backward.

Other vision-language models whose masks let image or prefix tokens see later ones (PaliGemma's
prefix, Gemma 4, Molmo 2, ...) are not in ``vlm.SPLIT``: refused at patch time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..sp.spans import check_spans, spans_of_mask
from .state import Step

# model_type -> the token type whose runs attend both ways
SPAN_MODELS = {"gemma3": 1}


def check_model(model) -> Optional[int]:
    """At patch time: the token type whose runs are ``model``'s bidirectional spans (Gemma 3: 1), or
    None for a model without; a Gemma 3 option ringkv cannot honour is a ``ValueError`` naming it.
    (Other VLMs with such masks are not in ``vlm.SPLIT``: refused there.)"""
    name, kind = type(model).__name__, getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SPAN_MODELS:
        return None
    if getattr(model.config.get_text_config(), "use_bidirectional_attention", False):
        raise ValueError(
            f"ringkv: {name} with use_bidirectional_attention=True (every token sees every "
            "other) is not supported: ringkv splits its causal attention with image blocks"
        )
    return SPAN_MODELS[kind]


def with_spans(token_type: Optional[int], kw: dict, step: Step, name: str) -> Step:
    """``step`` with the bidirectional spans of this forward's whole ``token_type_ids`` ``(B, S)``
    (runs of ``token_type``); ``ValueError`` when they do not match the tokens, or mark image tokens
    in a decode step (transformers' mask then indexes the new tokens only)."""
    types = kw.get("token_type_ids")
    if token_type is None or types is None:
        return step
    x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    if x is None or tuple(types.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"ringkv: {name}'s token_type_ids {tuple(types.shape)} must be (B, S) like the tokens "
            f"{None if x is None else tuple(x.shape[:2])}: every rank passes the whole sequence's"
        )
    image = types == token_type  # (B, S)
    if step.decode:
        if bool(image.any()):
            raise ValueError(
                f"ringkv: token_type_ids mark image tokens in a decode step of {name} (the KV "
                "cache holds tokens): pass images in the prefill (generate does)"
            )
        return step
    return replace(step, spans=check_spans(spans_of_mask(image), x.shape[0], x.shape[1]))
