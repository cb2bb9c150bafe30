"""Which SP attention a patched model runs (``choose``, at patch time, before any collective but
building USP's groups) and what ``describe`` reports about it.

- ``"ring"``, ``"ulysses"``: as asked (Ulysses: any heads ``>= N``, split unevenly where ``N``
  does not divide them).
- ``"usp"``: Ulysses ``U`` x ring ``N/U`` on ``sp_groups``; ``ulysses=U`` as given, or chosen by
  ``ringkv.planner.choose_sp`` among the divisors ``U <= heads`` of ``N``.
- ``"auto"``: ``choose_sp`` among the ring, Ulysses and USP (USP only when the group is the whole
  default world, where ``sp_groups`` builds its mesh), from the heads, the world, the length
  ``seq_len`` and the hardware table's rates for the model's device; U = 1 runs the ring, U = N
  Ulysses. A hybrid model keeps the ring for its attention layers (its recurrent layers choose
  their form per layer, ``hf.recurrent.form``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sp.collectives import rank_world
from ..sp.ulysses import head_split
from ..sp.usp import sp_groups

__all__ = ["Choice", "choose", "describe"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Choice:
    """``attention`` (ring, ulysses or usp) with Ulysses degree ``ulysses`` (usp; else 1) on
    ``groups`` (usp: ``(ulysses_group, ring_group)``), and ``why``."""

    attention: str
    ulysses: int
    groups: tuple
    why: str


def _heads(config):
    """``(heads, kv_heads, head_dim, v_head_dim, default length)`` of a model's text config; a
    ``ValueError`` for a config whose layers differ in them (transformers' per-layer configs)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        h = c.num_attention_heads
        hkv = getattr(c, "num_key_value_heads", None) or h
        d = getattr(c, "head_dim", None) or c.hidden_size // h
        dv = getattr(c, "v_head_dim", None) or d
    except RuntimeError as e:  # AmbiguousGlobalPerLayerAttributeError: heads vary per layer
        raise ValueError(
            f"{type(config).__name__} sets its attention heads per layer ({e}); "
            f"ringkv splits heads only for one head count and size: use method='ring'"
        ) from None
    hkv = hkv if h % hkv == 0 else h  # what the attention sees (MLA expands its latent per head)
    return h, hkv, d, dv, getattr(c, "max_position_embeddings", None) or 8192


def _planned(model, world: int, seq_len, degrees, label: str):
    """``choose_sp`` for ``model`` at ``seq_len`` over the Ulysses ``degrees``."""
    from ..planner.sp_method import choose_sp, local_rates

    h, hkv, d, dv, default_len = _heads(model.config)
    p = next(model.parameters())
    rates, link, source = local_rates(p.device, DTYPE_NAMES.get(p.dtype, "bfloat16"))
    seq = seq_len or default_len
    act = p.element_size()
    found = choose_sp(
        h, hkv, d, world, seq, rates, link, act=act, dv=dv, degrees=degrees, source=source
    )
    length = f"seq_len={seq}" if seq_len else f"max_position_embeddings={seq}"
    return found, f"{label} chose {found.why} ({length})"


def _check_ulysses(ulysses, world: int) -> None:
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
        raise ValueError(
            f"method='usp' needs ulysses=U, a positive divisor of the SP world size {world} "
            f"(ring = {world} / U), or None to choose U; got {ulysses!r}"
        )


def choose(model, method: str, ulysses, group, world: int, seq_len, hybrid: bool) -> Choice:
    """The ``Choice`` of ``patch_model(method=, ulysses=, seq_len=)``, after checking that the
    model's heads split (before any collective; building the USP groups is the first one)."""
    if method != "usp" and ulysses is not None:
        raise ValueError(f"ulysses={ulysses} is for method='usp' (method={method!r})")
    if seq_len is not None and (
        isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1
    ):
        raise ValueError(f"seq_len must be a positive int or None, got {seq_len!r}")
    whole = group is None or rank_world(group)[1] == rank_world()[1]
    if method == "ring" or (method == "auto" and (world == 1 or hybrid)):
        why = "method='ring'" if method == "ring" else "method='auto' on one rank: the ring"
        if method == "auto" and hybrid:
            why = "method='auto' on a hybrid model: attention on the ring (recurrent layers: form)"
        return Choice("ring", 1, (), why)
    h, hkv = _heads(model.config)[:2]  # the ring needs no head count
    if method == "ulysses":
        split = head_split(h, hkv, world, "patch_model(method='ulysses')")
        counts = [len(split.q_heads(r)) for r in range(world)]
        return Choice("ulysses", 1, (), f"method='ulysses': query heads per rank {counts}")
    if method == "usp" and not whole:
        raise ValueError(
            "method='usp' runs on sp_groups(ulysses=U, ring=N/U) of the whole default world; "
            "leave group=None"
        )
    if method == "usp" and ulysses is not None:
        _check_ulysses(ulysses, world)
        head_split(h, hkv, ulysses, "patch_model(method='usp')")
        why = f"method='usp' with ulysses={ulysses}: Ulysses {ulysses} x ring {world // ulysses}"
        return Choice("usp", ulysses, sp_groups(ulysses=ulysses, ring=world // ulysses), why)
    degrees = [u for u in range(1, min(world, h) + 1) if world % u == 0]
    if not whole:  # USP's mesh spans the default world: the ring or Ulysses on this group
        degrees = [u for u in degrees if u in (1, world)]
    found, why = _planned(model, world, seq_len, degrees, f"method={method!r}")
    attention = "usp" if method == "usp" else found.method
    if attention != "usp":
        return Choice(attention, 1, (), why)
    u = found.ulysses
    return Choice("usp", u, sp_groups(ulysses=u, ring=world // u), why)


def describe(state, config) -> dict:
    """What a patch runs: ``method`` (asked), ``attention`` (run), the Ulysses x ring degrees, the
    query heads each Ulysses rank computes, ``why``, and ``shard_ulysses``: the ``ulysses=`` that
    ``ringkv.shard``, ``gather_logits`` and ``causal_lm_loss`` take for its sharding (USP's
    degree; 1 for the ring and Ulysses, which shard in ``layout`` over the group)."""
    u = state.world if state.attention == "ulysses" else state.ulysses
    heads = None
    if state.attention != "ring":
        split = head_split(*_heads(config)[:2], u)
        heads = [len(split.q_heads(r)) for r in range(u)]
    return dict(
        method=state.method,
        attention=state.attention,
        world=state.world,
        ulysses=u,
        ring=state.world // u,
        layout=state.layout,
        heads_per_rank=heads,
        shard_ulysses=state.ulysses,
        why=state.why,
    )
