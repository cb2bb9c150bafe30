"""Bidirectional spans in causal attention (Gemma 3's image tokens), planned as ring block calls.

Under ``spans``, query ``q`` sees key ``k`` iff ``k_pos <= q_pos`` (the causal mask, with the
layer's window on the keys before it) OR ``q`` and ``k`` lie in the same span: the mask is
``k_pos <= reach(q_pos)``, where ``reach`` is the span's last position for a span's tokens and
``q_pos`` for the others. A span is a run ``[start, stop)`` of global positions of one batch row.

The ring computes it as two disjoint parts merged by log-sum-exp like any other block: its usual
causal calls (keys ``<= q_pos``) and, from ``span_calls``, the keys of the query's own span after
it (``q_pos < k_pos < stop``). Those extra keys are never further than the window's left edge,
so a sliding window (transformers: ``AND(window, OR(causal, span))``) only bounds the causal part.
Both parts go through the same kernels, forward and backward, so the gradients are exact.
"""

from __future__ import annotations

import functools
import itertools
from typing import List, Optional, Sequence, Tuple

import torch

from ..kernels.mask import EMPTY, Mask, make_mask

__all__ = ["Spans", "check_spans", "spans_of_mask", "span_calls"]

# per batch row: its spans ``((start, stop), ...)``, increasing and disjoint
Spans = Tuple[Tuple[Tuple[int, int], ...], ...]


def check_spans(spans, batch: int, seq_len: int) -> Optional[Spans]:
    """``spans`` (one sequence of ``(start, stop)`` per batch row, global positions) as a hashable
    ``Spans`` with the spans shorter than 2 dropped (a one-token span is causal already); None when
    none is left. ``ValueError``/``TypeError`` naming the row and span when it is malformed."""
    if spans is None:
        return None
    if isinstance(spans, torch.Tensor) or not isinstance(spans, Sequence):
        raise TypeError(
            f"spans must be one sequence of (start, stop) pairs per batch row, got "
            f"{type(spans).__name__}; from a (B, S) mask use ringkv.sp.spans.spans_of_mask"
        )
    if len(spans) != batch:
        raise ValueError(f"spans has {len(spans)} rows, the batch has {batch}")
    rows = []
    for b, row in enumerate(spans):
        end, out = 0, []
        for span in row:
            if (
                len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                or not end <= span[0] < span[1] <= seq_len
            ):
                raise ValueError(
                    f"spans row {b}: {tuple(span)!r} is not a (start, stop) with "
                    f"{end} <= start < stop <= {seq_len} (spans increasing and disjoint, within "
                    f"the sequence of {seq_len})"
                )
            end = span[1]
            out += [(int(span[0]), int(span[1]))] if span[1] - span[0] > 1 else []
        rows.append(tuple(out))
    return tuple(rows) if any(rows) else None


def spans_of_mask(mask: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """The runs of ``True`` in each row of a ``(B, S)`` bool mask (e.g. ``token_type_ids == 1``) as
    ``(start, stop)`` spans: transformers' Gemma 3 blocks (``get_block_sequence_ids_for_mask``:
    adjacent image tokens are one block)."""
    m = mask.to(device="cpu", dtype=torch.int8)
    edges = torch.nn.functional.pad(m, (1, 1)).diff(dim=1)  # (B, S+1): +1 at starts, -1 at stops
    rows = []
    for e in edges:
        starts = (e == 1).nonzero().flatten().tolist()
        stops = (e == -1).nonzero().flatten().tolist()
        rows.append(list(zip(starts, stops)))
    return rows


def _cut(r: range, start: int, stop: int) -> Tuple[int, range]:
    """The local offset and positions of ``r``'s elements in ``[start, stop)`` (one run of ``r``,
    which increases)."""
    s = r.step
    i0 = max(0, -((r.start - start) // s))  # ceil((start - r.start) / s)
    i1 = min(len(r), max(0, -((r.start - stop) // s)))
    return i0, r[i0 : max(i0, i1)]


def _runs(spans: Spans) -> List[Tuple[slice, Tuple[Tuple[int, int], ...]]]:
    """Batch rows with the same spans, as ``(rows, spans)``: consecutive equal rows share a call."""
    out = []
    for b, row in enumerate(spans):
        if out and out[-1][1] == row:
            out[-1] = (slice(out[-1][0].start, b + 1), row)
        else:
            out.append((slice(b, b + 1), row))
    return [(rows, row) for rows, row in out if row]


def _after(qr: range, kr: range, start: int, stop: int):
    """``(q rows, k rows, mask)`` within ``qr`` / ``kr`` of the span ``[start, stop)``'s keys after
    each of its queries, or None when there are none."""
    i0, qp = _cut(qr, start, stop)
    j0, kp = _cut(kr, start, stop)
    if not (len(qp) and len(kp) and kp[-1] > qp[0]):
        return None
    after = range(qp.start + 1, qp.stop + 1, qp.step)  # k_pos >= q_pos + 1: window (0, -1)
    mask = make_mask(False, after, kp, len(qp), len(kp), window=(0, -1))
    if mask.kind == EMPTY:
        return None
    return slice(i0, i0 + len(qp)), slice(j0, j0 + len(kp)), mask


@functools.lru_cache(maxsize=256)
def span_calls(
    q_ranges: Tuple[range, ...], k_ranges: Tuple[range, ...], spans: Spans
) -> List[Tuple[slice, slice, slice, Mask]]:
    """Extra kernel calls of one ring step: ``(batch rows, q rows, k rows, mask)`` for each span,
    the keys of the span after each query (``q_pos < k_pos``), empty ones dropped. ``q_ranges`` /
    ``k_ranges``: the shards' increasing position ranges in local order (``Shards``). Cached: the
    ring asks at every step of every layer (do not modify the list returned)."""
    q_off = [0, *itertools.accumulate(len(r) for r in q_ranges)]  # each range's first local row
    k_off = [0, *itertools.accumulate(len(r) for r in k_ranges)]
    calls = []
    for rows, row in _runs(spans):
        for (start, stop), (i, qr), (j, kr) in itertools.product(
            row, enumerate(q_ranges), enumerate(k_ranges)
        ):
            found = _after(qr, kr, start, stop)
            if found is not None:
                qs, ks, mask = found
                qs = slice(q_off[i] + qs.start, q_off[i] + qs.stop)
                ks = slice(k_off[j] + ks.start, k_off[j] + ks.stop)
                calls.append((rows, qs, ks, mask))
    return calls
