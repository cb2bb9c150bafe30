"""Per-token log-probs of given targets from a patched model, without logits: what a forward with
``per_token=`` adds to its output (``read_per_token``, ``token_stats``), and ``sequence_sums``, the
per-sequence sums of such values over the SP group.

    out = model(input_ids=ids, labels=labels, per_token=("entropy", "is_top1"))
    out.log_probs                          # (B, S_pad / N): this rank's tokens, like its inputs
    logp = ringkv.hf.sequence_sums(out.log_probs, group=sp_group)   # (B,), every rank

The targets are the loss's (``labels`` shifted once globally, then sharded; ``shift_labels`` as
they are), so a rank's last token is scored against the first token of the next shard.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch

from ..kernels.linear_ce import linear_log_probs
from ..sp.collectives import rank_world, shared_sum
from ..sp.layout import check_layout, varlen_index
from .packing import helper_packing
from .state import IGNORE_INDEX, Head

PER_TOKEN = ("log_probs", "entropy", "is_top1", "mean_logits")  # what per_token= may ask for


def read_per_token(value) -> tuple:
    """The forward's ``per_token=`` as the fields it asks for (``log_probs`` always, first): None
    or False asks for none, True for ``log_probs``, else a name or names of ``PER_TOKEN``."""
    if value is None or value is False:
        return ()
    names = ("log_probs",) if value is True else (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = (value,)
    bad = [n for n in names if n not in PER_TOKEN]
    if bad or not names:
        raise ValueError(
            f"ringkv: per_token must be True or names among {PER_TOKEN}, got {value!r}"
        )
    return tuple(n for n in PER_TOKEN if n == "log_probs" or n in names)


def plain_head(head: Head, what: str) -> Head:
    """``head``, whose weight must be a plain tensor for the chunked kernels (``ValueError``)."""
    if type(head.weight).__name__ == "DTensor":
        raise ValueError(
            f"ringkv: {what} needs the output head's weight as a plain tensor, got "
            f"{type(head.weight).__name__} (e.g. FSDP2 sharding the head in its own unit: keep "
            "it in the root unit), or patch with keep_logits=True"
        )
    return head


def token_stats(
    head: Head,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    fields: tuple,
    chunk: Optional[int],
    temperature: float = 1.0,
) -> dict:
    """``fields`` (``read_per_token``) of this rank's tokens from its hidden states ``hidden``
    ``(B, S_local, H)`` through ``head`` in chunks (its logits divided by ``temperature``, after
    the head's own transform), against its ``targets`` ``(B, S_local)``:
    each ``(B, S_local)``, 0 (False) where the target is -100, and ``label_mask`` (target given).
    ``log_probs`` and ``entropy`` are float32 and differentiable, ``is_top1`` bool, ``mean_logits``
    float32 without gradient."""
    plain_head(head, "per_token")
    y = targets.to(hidden.device)
    out = linear_log_probs(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        y.reshape(-1),
        head.bias,
        ignore_index=IGNORE_INDEX,
        chunk=chunk,
        softcap=head.softcap,
        scale=head.scale,
        temperature=temperature,
        entropy="entropy" in fields,
        top1="is_top1" in fields,
        mean_logits="mean_logits" in fields,
    )
    stats = {name: getattr(out, name).view(y.shape) for name in fields}
    stats["label_mask"] = y != IGNORE_INDEX
    return stats


def sequence_sums(
    values: torch.Tensor,
    group=None,
    *,
    layout: str = "zigzag",
    timeout: Optional[timedelta] = None,
    cu_seqlens=None,
    position_ids=None,
    seq_idx=None,
) -> torch.Tensor:
    """Per-sequence sums of this rank's per-token ``values`` ``(B, S_pad / N)`` (e.g. a patched
    forward's ``log_probs``) over the SP ``group``: ``(B,)``, the same on every rank.

    Packed documents (``values`` ``(1, L_local)`` of the varlen layout): pass what the model was
    given about them (``position_ids`` or ``seq_idx`` ``(B, S)``, or ``cu_seqlens``, as for
    ``gather_logits``, and its ``layout``); returns one sum per document ``(D,)``, in packed order.

    Differentiable: the gradient is this rank's share (as ``causal_lm_loss``'s), so gradients summed
    over the SP group (DDP's all-reduce) are those of the whole sequences' sums."""
    check_layout(layout)
    if values.dim() != 2:
        raise ValueError(f"sequence_sums: values must be (B, S_local), got {tuple(values.shape)}")
    pk = helper_packing(None, cu_seqlens, position_ids, seq_idx, values.shape[0])
    if pk is None:
        local = values.sum(1)  # (B,)
    else:
        rank, world = rank_world(group)
        index = varlen_index(pk.cu, layout, rank, world, device=values.device)  # (L_local,)
        if tuple(values.shape) != (1, index.numel()):
            raise ValueError(
                f"sequence_sums: the packed documents give shards of shape (1, {index.numel()}) "
                f"on {world} rank(s) in layout {layout!r}, got {tuple(values.shape)}"
            )
        real = index >= 0
        ends = torch.tensor(pk.cu[1:], device=values.device)
        doc = torch.searchsorted(ends, index[real], right=True)  # the document of each real row
        local = values.new_zeros(len(pk.cu) - 1).index_add(0, doc, values[0, real])  # (D,)
    return shared_sum(local, group, timeout, "ringkv sequence_sums")
