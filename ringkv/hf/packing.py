"""Packed documents and padded rows: found in a forward's arguments (``find_packing``,
``shard_packing``; ``packed_cu_seqlens`` for users), checked on whole rows (``check_rows``,
``check_left_padding``), gathered from the shards (``gather_seq``,
``gather_packed``), and labels shifted and sharded into a rank's targets (``local_targets``)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..sp.collectives import all_gather, rank_world
from ..sp.layout import check_cu_seqlens, positions, shard, varlen_index, varlen_local_len
from .state import IGNORE_INDEX, Packing

LEFT_PAD_HELP = (
    "each row of attention_mask must be zeros followed by ones (left padding, as batched generate "
    "pads), with at least one real token"
)


def num_items(n) -> Optional[float]:
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


# ---------------------------------------------------------------------------------------------
# packed documents


def as_rows(x, b: int, t: int, name: str) -> torch.Tensor:
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


def cu_tuple(cu, name: str) -> Tuple[int, ...]:
    try:
        return check_cu_seqlens(cu)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ringkv: {name}: {e}") from None


def _starts_from_cu(cu, b: int, t: int, name: str) -> torch.Tensor:
    cu = cu_tuple(cu, name)
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


def _check_max_lengths(lengths, longest: int) -> None:
    """``max_length_q/k`` ``[(name, value)]``, each the longest packed document's length."""
    for name, m in lengths:
        if isinstance(m, bool) or not isinstance(m, (int, torch.Tensor)) or int(m) != longest:
            raise ValueError(
                f"ringkv: {name}={m!r} but the longest packed document has {longest} tokens"
            )


def _document_starts(b: int, t: int, position_ids, seq_idx, cus) -> list:
    """``[(name, (b, t) bool starts)]`` of each argument given that describes documents."""
    forms = []
    if position_ids is not None:
        forms.append(
            ("position_ids", _starts_from_positions(as_rows(position_ids, b, t, "position_ids")))
        )
    if seq_idx is not None:
        forms.append(("seq_idx", _starts_from_seq_idx(as_rows(seq_idx, b, t, "seq_idx"))))
    for name, cu in cus:
        if cu is not None:
            forms.append((name, _starts_from_cu(cu, b, t, name)))
    return forms


def find_packing(
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
) -> Optional[Packing]:
    """The packed documents that the given arguments describe for inputs ``(b, t)``, checked
    against each other, or ``None`` when there are none: no argument, or only ``position_ids``
    that are ``0..t-1`` on every row (an ordinary batch; ``always`` returns those documents too)."""
    cus = (
        ("cu_seqlens", cu_seqlens),
        ("cu_seq_lens_q", cu_seq_lens_q),
        ("cu_seq_lens_k", cu_seq_lens_k),
    )
    forms = _document_starts(b, t, position_ids, seq_idx, cus)
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
    _check_max_lengths(lengths, max(hi - lo for lo, hi in zip(cu, cu[1:])))
    if not always and [n for n, _ in forms] == ["position_ids"] and len(cu) == b + 1:
        return None  # position_ids 0..t-1 on every row: nothing is packed
    return Packing(tuple(cu), b, t)


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
    cu = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
    pk = find_packing(*batch_shape(None, position_ids, seq_idx, cu), always=True, **kw)
    if pk is None:
        raise ValueError(
            "packed_cu_seqlens: pass position_ids, seq_idx or cu_seq_lens_q/cu_seq_lens_k"
        )
    return list(pk.cu)


def batch_shape(shape, position_ids, seq_idx, cu) -> Tuple[int, int]:
    """``(B, S)`` of a batch described by these arguments (``cu`` alone: one packed row)."""
    if shape is not None:
        return tuple(shape)
    for x in (position_ids, seq_idx):
        if x is not None:
            x = torch.as_tensor(x)
            return (x.shape[0], x.shape[1]) if x.dim() == 2 else (1, x.shape[-1])
    return (1, cu_tuple(cu, "cu_seqlens")[-1]) if cu is not None else (1, 0)


def helper_packing(shape, cu_seqlens, position_ids, seq_idx, logits_rows: int) -> Optional[Packing]:
    """The packing that ``gather_logits`` / ``causal_lm_loss`` were told about, as the model decides
    it. ``position_ids`` of one document per row alone do not say it: the model packs such rows
    into one (logits ``(1, L_local, V)``) when it was also given ``cu_seq_lens_q/k`` or
    ``seq_idx`` (``DataCollatorWithFlattening`` gives all of them), and runs them as an ordinary
    batch when it was not; the logits' row count tells which."""
    if cu_seqlens is None and position_ids is None and seq_idx is None:
        return None
    b, t = batch_shape(shape, position_ids, seq_idx, cu_seqlens)
    return find_packing(
        b,
        t,
        position_ids=position_ids,
        seq_idx=seq_idx,
        cu_seqlens=cu_seqlens,
        always=b > 1 and logits_rows == 1,
    )


def _shard_cu(pk_kw: dict, b: int, t: int, layout: str, world: int) -> Optional[Tuple[int, ...]]:
    """``inputs="shard"``: the whole packed row's ``cu`` from ``cu_seq_lens_q/k`` (the same on every
    rank), checked against this rank's shard ``(b, t)``, or None."""
    cus = [(n, cu_tuple(pk_kw[n], n)) for n in ("cu_seq_lens_q", "cu_seq_lens_k") if n in pk_kw]
    if not cus:
        if pk_kw:
            raise ValueError(
                "ringkv: with inputs='shard', packed documents are given by cu_seq_lens_q (the "
                "whole packed row's [0, l0, l0+l1, ..., S], the same on every rank); got only "
                f"{', '.join(sorted(pk_kw))}"
            )
        return None
    if len(cus) == 2 and cus[0][1] != cus[1][1]:
        raise ValueError(
            "ringkv: cu_seq_lens_q and cu_seq_lens_k describe different packed documents; causal "
            "self-attention needs the same documents for queries and keys"
        )
    cu = cus[0][1]
    longest = max(hi - lo for lo, hi in zip(cu, cu[1:]))
    _check_max_lengths(
        [(n, pk_kw.get(n)) for n in ("max_length_q", "max_length_k") if pk_kw.get(n) is not None],
        longest,
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
    return cu


def shard_packing(pk_kw: dict, pos, b: int, t: int, layout: str, rank: int, world: int):
    """``inputs="shard"``: ``(packing, positions)`` of this rank's shard of a packed row, from the
    whole row's ``cu_seq_lens_q/k`` (the same on every rank), or ``(None, None)``."""
    cu = _shard_cu(pk_kw, b, t, layout, world)
    if cu is None:
        return None, None
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
        idx = as_rows(pk_kw["seq_idx"], 1, t, "seq_idx")[0]
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
    return Packing(cu, 1, cu[-1]), q_pos


# ---------------------------------------------------------------------------------------------
# padding and labels, checked on whole rows


def _segment_starts(pk: Optional[Packing], b: int, t: int) -> torch.Tensor:
    """``(b, t)`` bool: where a segment starts (a row, or each packed document of the flattened
    rows)."""
    starts = torch.zeros(b * t, dtype=torch.bool)
    starts[list(pk.cu[:-1]) if pk is not None else list(range(0, b * t, t))] = True
    return starts.view(b, t)


def _check_right_padding(m: torch.Tensor, starts: torch.Tensor) -> None:
    """Zeros of the host bool mask ``m`` ``(R, L)`` must end their row or packed document."""
    bad = ~m[:, :-1] & m[:, 1:] & ~starts[:, 1:]  # a zero followed by a one in the same segment
    if not bool(bad.any()):
        return
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


def _check_padding(
    mask: torch.Tensor, starts: torch.Tensor, labels: Optional[torch.Tensor], shifted: bool
) -> None:
    """Zeros of ``attention_mask`` ``(R, L)`` must end their row or packed document (right padding:
    causal attention never lets a real token see a later pad, so ignoring them is exact), and a
    padded token must predict nothing (``labels[:, i + 1] == -100``, or, ``shifted`` (HF's
    ``shift_labels``), ``labels[:, i] == -100``, where ``mask[:, i] == 0``)."""
    m = mask.detach().bool().cpu()
    _check_right_padding(m, starts)
    if labels is None:
        return
    lab = labels.detach().cpu()
    if shifted:  # shift_labels[:, i] is labels[:, i + 1]
        lab = F.pad(lab[:, :-1], (1, 0), value=IGNORE_INDEX)
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


def check_rows(
    mask: Optional[torch.Tensor],
    packing: Optional[Packing],
    labels: Optional[torch.Tensor],
    shifted: bool,
    unshifted: Optional[torch.Tensor] = None,
) -> None:
    """Every check of whole rows ``(B, S)`` (packed: the packed row), in one place: ``labels``
    (HF's ``shift_labels`` when ``shifted``) against ``unshifted`` (``labels`` given with them),
    and a padded ``mask``: zeros only at the end of each row or ``packing``'s document, and no
    target after a pad."""
    if unshifted is not None:
        _check_shift_labels(unshifted, labels)
    if mask is not None and not bool(mask.bool().all()):
        _check_padding(mask, _segment_starts(packing, *mask.shape), labels, shifted)


def check_left_padding(m: torch.Tensor) -> None:
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


# ---------------------------------------------------------------------------------------------
# shards gathered, labels sharded


def gather_seq(x: torch.Tensor, layout: str, group, timeout, ulysses: int = 1) -> torch.Tensor:
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


def gather_packed(
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


def local_targets(
    labels: torch.Tensor,
    *,
    shifted: bool,
    packing: Optional[Packing],
    layout: str,
    rank: int,
    world: int,
    ulysses: int,
    s_pad: int,
    device,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This rank's targets ``(B, S_pad / N)`` (packed: ``(1, L_local)``) from the whole rows'
    ``labels`` ``(B, S)`` (``S <= s_pad``): shifted once, globally (token ``i`` predicts label
    ``i + 1``; the last token of a row predicts nothing; ``shifted``: they are HF's
    ``shift_labels``, the target of each token already), then sharded like the inputs, with
    ``ignore_index`` where the layout pads."""
    if packing is not None:  # the shift stays inside each row of row_len tokens
        rows = labels.to(device).reshape(-1, packing.row_len)  # (rows, S_row)
        targets = rows if shifted else F.pad(rows[:, 1:], (0, 1), value=ignore_index)
        targets = targets.reshape(-1)
        index = varlen_index(packing.cu, layout, rank, world).to(device)
        local = torch.where(index >= 0, targets[index.clamp(min=0)], ignore_index)
        return local.unsqueeze(0)  # (1, L_local)
    labels = labels.to(device)
    targets = labels if shifted else labels[:, 1:]
    targets = F.pad(targets, (0, s_pad - targets.shape[1]), value=ignore_index)  # (B, S_pad)
    return shard(targets, 1, layout, rank=rank, world=world, ulysses=ulysses)  # (B, S_pad / N)
