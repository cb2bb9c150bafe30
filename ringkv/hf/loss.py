"""The outputs of a patched model: the next-token loss (``lm_loss``, from this rank's targets,
through the head in chunks when no logits are built), the user-facing ``causal_lm_loss`` and
``gather_logits``, and what the post-hook does with a forward's output (``kept_logits``,
``step_loss``, with ``per_token=``'s fields from ``logprobs.py``)."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from datetime import timedelta
from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.linear_ce import linear_cross_entropy
from ..sp.collectives import all_sum, rank_world, shared_sum
from ..sp.layout import check_layout, check_seq_len, granule, varlen_local_len
from .logprobs import plain_head, token_stats
from .packing import cu_tuple, gather_packed, gather_seq, helper_packing, local_targets, num_items
from .state import IGNORE_INDEX, Head, Packing, Step, model_head


def _liger_loss_sum(hidden, head: Head, targets, ignore_index):
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


def head_loss_sum(
    head: Head, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk: Optional[int]
):
    """Summed cross-entropy (float32) of ``hidden`` ``(N, H)`` through ``head`` against ``targets``
    ``(N,)``, in chunks: the ``(N, V)`` logits are never built."""
    plain_head(head, "the chunked loss")
    if hidden.is_cuda and head.scale is None and chunk is None:
        fused = _liger_loss_sum(hidden, head, targets, ignore_index)
        if fused is not None:
            return fused
    return linear_cross_entropy(
        hidden,
        head.weight,
        targets,
        head.bias,
        ignore_index=ignore_index,
        chunk=chunk,
        softcap=head.softcap,
        scale=head.scale,
    )


def lm_loss(
    x: torch.Tensor,
    targets: torch.Tensor,
    group,
    timeout,
    *,
    head: Optional[Head] = None,
    num_items: Optional[float] = None,
    chunk: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
):
    """The loss from this rank's logits ``x`` ``(B, S_local, V)`` (``head`` given: its hidden
    states ``(B, S_local, H)``, through the head in chunks) against its ``targets``
    ``(B, S_local)`` (``local_targets``): the global sum over the global count (or
    ``num_items``, HF's ``num_items_in_batch``) on every rank; the gradient is this rank's share."""
    local = targets.to(x.device)
    if head is None:
        loss_sum = F.cross_entropy(
            x.float().reshape(-1, x.shape[-1]),
            local.reshape(-1),
            ignore_index=ignore_index,
            reduction="sum",
        )
    else:
        loss_sum = head_loss_sum(
            head, x.reshape(-1, x.shape[-1]), local.reshape(-1), ignore_index, chunk
        )
    return group_mean(loss_sum, local, group, timeout, num_items, ignore_index)


def group_mean(loss_sum, targets, group, timeout, num_items=None, ignore_index=IGNORE_INDEX):
    """This rank's summed loss over its ``targets`` ``(B, S_local)`` -> the group's sum over the
    group's count of targets (or ``num_items``), the same on every rank (float32); its gradient
    is this rank's tokens' only."""
    count = (targets != ignore_index).sum()
    both = torch.stack([loss_sum.double(), count.double()])
    totals = shared_sum(both, group, timeout, "causal_lm_loss")  # one all-reduce
    return totals[0].float() / (totals[1].float() if num_items is None else num_items)


# ---------------------------------------------------------------------------------------------
# a forward's output (the post-hook)


def drop_logits(output) -> None:
    """``output.logits = None``, and gone from the output's dict and tuple forms too."""
    output.logits = None
    if "logits" in output.keys():
        OrderedDict.__delitem__(output, "logits")


def kept_logits(local: torch.Tensor, step: Step, group, timeout) -> torch.Tensor:
    """The last ``step.keep`` global logits ``(B, keep, V)`` on every rank from this rank's kept
    rows ``(B, r, V)``: zeros elsewhere, summed over the group."""
    rows = step.pad.keep_rows if step.pad is not None else 0  # left-padded: (1, r, V)
    full = local.new_zeros(rows or local.shape[0], step.keep, local.shape[2])
    if rows:
        full.view(-1, local.shape[2])[step.keep_at.to(local.device)] = local[0]
    else:
        full[:, step.keep_at] = local
    return all_sum(full, group, timeout, "ringkv logits_to_keep")  # (B, keep, V)


def step_loss(state, step: Step, model, output, hidden: Optional[torch.Tensor]):
    """The loss of a forward with labels: from its logits, or (``step.chunked``) from the base
    model's output ``hidden`` ``(B, S_local, H)`` through the head in chunks (the logits are
    dropped from ``output`` unless kept). With ``step.per_token`` the fields go into ``output``
    (``token_stats``) and the loss is their log-probs' (one pass through the head)."""
    x, head = output.logits, None
    if step.chunked:
        x, head = hidden, model_head(model)
        if x is None:
            raise RuntimeError(
                f"ringkv: the chunked loss did not see the output of {type(model).__name__}'s "
                f"base model; patch with keep_logits=True"
            )
        if not step.keep:
            drop_logits(output)
    if step.per_token:
        stats = token_stats(
            head, x, step.targets, step.per_token, state.loss_chunk, step.temperature
        )
        for name, value in stats.items():
            output[name] = value  # a key and an attribute of the ModelOutput
        loss_sum = -stats["log_probs"].sum()
        return group_mean(loss_sum, step.targets, state.group, state.timeout, step.num_items)
    return lm_loss(
        x,
        step.targets,
        state.group,
        state.timeout,
        head=head,
        num_items=step.num_items,
        chunk=state.loss_chunk,
    )


# ---------------------------------------------------------------------------------------------
# public helpers


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
    pk = helper_packing(None, cu_seqlens, position_ids, seq_idx, logits.shape[0])
    if pk is not None:
        if ulysses != 1:
            raise ValueError(
                "gather_logits: packed documents run on method='ring' only (ulysses must be 1)"
            )
        full = gather_packed(logits.detach(), pk.cu, layout, group, timeout)  # (1, B*S, V)
        return full.view(pk.rows, pk.row_len, *full.shape[2:])
    if seq_len is None and position_ids is not None:
        seq_len = torch.as_tensor(position_ids).shape[-1]
    full = gather_seq(logits.detach(), layout, group, timeout, ulysses)
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
    if weight is not None and hidden is None:  # causal_lm_loss(hidden, labels, weight=...)
        logits, hidden = None, logits
    if (logits is None) == (hidden is None) or (hidden is None) != (weight is None):
        raise ValueError(
            "causal_lm_loss: pass logits, or hidden states with the head's weight (hidden=, "
            "weight=)"
        )
    if (labels is None) == (shift_labels is None):
        raise ValueError("causal_lm_loss: pass labels or shift_labels (one of them)")
    head = None if weight is None else Head(weight, bias, softcap, scale)
    x = logits if head is None else hidden
    shifted = shift_labels is not None
    labels = labels if not shifted else shift_labels
    pk = _loss_packing(x, labels, sharded, cu_seqlens, position_ids, seq_idx)
    n = num_items(num_items_in_batch)
    where = dict(layout=layout, group=group, timeout=timeout, ulysses=ulysses)
    targets = _loss_targets(x, labels, shifted, pk, sharded, ignore_index, **where)
    return lm_loss(
        x, targets, group, timeout, head=head, num_items=n, chunk=chunk, ignore_index=ignore_index
    )


def _loss_packing(x, labels, sharded: bool, cu_seqlens, position_ids, seq_idx):
    """The packed documents ``causal_lm_loss`` was told about, or None."""
    if cu_seqlens is None and position_ids is None and seq_idx is None:
        return None
    if sharded:
        if cu_seqlens is None:
            raise ValueError(
                "causal_lm_loss: sharded packed labels need cu_seqlens (the whole packed row's "
                "[0, l0, ..., S]); position_ids and seq_idx describe whole rows"
            )
        cu = cu_tuple(cu_seqlens, "cu_seqlens")
        return Packing(cu, 1, cu[-1])
    if labels.dim() != 2:
        raise ValueError(f"causal_lm_loss: labels must be (B, S), got {tuple(labels.shape)}")
    return helper_packing(tuple(labels.shape), cu_seqlens, position_ids, seq_idx, x.shape[0])


def _loss_targets(
    x, labels, shifted, pk, sharded, ignore_index, *, layout, group, timeout, ulysses
):
    """This rank's targets for ``causal_lm_loss``, its ``labels`` checked against the shards
    ``x``."""
    rank, world = rank_world(group)
    b, s_local = x.shape[:2]
    if pk is not None:
        labels = _packed_labels(x, labels, pk, sharded, layout, group, timeout, ulysses)
        s_pad = pk.cu[-1]  # unused
    else:
        s_pad = s_local * world
        check_seq_len(s_pad, layout, world, ulysses)
        if sharded:
            if labels.shape[1] != s_local:
                raise ValueError(
                    f"sharded labels must have this rank's length {s_local}, got {labels.shape[1]}"
                )
            labels = gather_seq(labels.to(x.device), layout, group, timeout, ulysses)  # (B, S_pad)
        elif not s_pad - granule(layout, world, ulysses) < labels.shape[1] <= s_pad:
            raise ValueError(
                f"labels of length {labels.shape[1]} do not match logits shards of {s_local} "
                f"tokens on {world} rank(s) (a sequence of {s_pad} tokens, padding included); pass "
                "the whole sequence's labels, or this rank's shard with sharded=True"
            )
    return local_targets(
        labels,
        shifted=shifted,
        packing=pk,
        layout=layout,
        rank=rank,
        world=world,
        ulysses=ulysses,
        s_pad=s_pad,
        device=x.device,
        ignore_index=ignore_index,
    )


def _packed_labels(x, labels, pk: Packing, sharded, layout, group, timeout, ulysses):
    """The packed row's whole labels, checked against this rank's shard ``x`` ``(1, L_local, .)``
    (``sharded``: gathered from every rank's shard)."""
    _, world = rank_world(group)
    if ulysses != 1:
        raise ValueError(
            "causal_lm_loss: packed documents run on method='ring' only (ulysses must be 1)"
        )
    want = varlen_local_len(pk.cu, layout, world)
    if tuple(x.shape[:2]) != (1, want):
        raise ValueError(
            f"causal_lm_loss: the packed documents give logits shards of shape (1, {want}, V) "
            f"on {world} rank(s) in layout {layout!r}, got {tuple(x.shape)}"
        )
    if sharded:
        if tuple(labels.shape) != (1, want):
            raise ValueError(
                f"sharded packed labels must be this rank's shard (1, {want}), got "
                f"{tuple(labels.shape)}"
            )
        return gather_packed(labels.to(x.device), pk.cu, layout, group, timeout)  # (1, S)
    if labels.numel() != pk.cu[-1] or labels.dim() != 2:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match the packed documents of "
            f"{pk.cu[-1]} tokens; pass the batch's labels (B, S), or sharded=True"
        )
    return labels
