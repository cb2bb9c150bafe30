"""Causal and sliding-window masks on global positions, reduced to what a kernel executes fast.

A causal mask is ``q_pos >= k_pos`` on *global* token positions. A sliding window
``window=(left, right)`` (flash-attn's convention, ``-1`` = unbounded) keeps key ``j`` visible to
query ``i`` iff ``q_pos - left <= k_pos <= q_pos + right``; causal sets ``right = 0``.
Positions are given as ``None`` (the default alignment), a ``range`` (an arithmetic progression:
contiguous chunks, zigzag chunks and striped shards all are one) or a 1-D integer tensor.

``make_mask`` turns them into a :class:`Mask`:

- ``FULL``:   every query sees every key (no mask to apply);
- ``EMPTY``:  no query sees any key (the block is skipped: ``out = 0``, ``lse = -inf``);
- ``OFFSET``: key ``j`` is visible to query ``i`` iff ``j <= i + offset`` (an offset
  diagonal; ``offset = 0`` with ``Sq == Sk`` is the usual top-left causal mask);
- ``BAND``:   key ``j`` is visible to query ``i`` iff ``i + lo <= j <= i + offset`` (a window);
- ``DENSE``:  an explicit boolean ``(Sq, Sk)`` matrix, for position vectors with no structure.

Two ranges with the same step ``s`` always give ``FULL``, ``EMPTY``, ``OFFSET`` or ``BAND``:
``a + i*s <= b + j*s + r  <=>  j >= i + ceil((a - b - r) / s)`` (and likewise for the other bound),
so whole blocks outside a window classify as ``EMPTY`` by arithmetic alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

Positions = Union[None, range, torch.Tensor]

FULL, EMPTY, OFFSET, BAND, DENSE = "full", "empty", "offset", "band", "dense"
NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Mask:
    kind: str
    offset: int = 0  # OFFSET and BAND: the highest visible diagonal, j <= i + offset
    dense: Optional[torch.Tensor] = None  # bool (Sq, Sk) when kind == DENSE
    lo: int = 0  # BAND: the lowest visible diagonal, j >= i + lo

    def visible(self, sq: int, sk: int, device=None) -> torch.Tensor:
        """Bool ``(Sq, Sk)`` matrix of visible pairs (for references and tests)."""
        if self.kind == DENSE:
            return self.dense.to(device)
        if self.kind in (FULL, EMPTY):
            return torch.full((sq, sk), self.kind == FULL, dtype=torch.bool, device=device)
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        if self.kind == BAND:
            return (j <= i + self.offset) & (j >= i + self.lo)
        return j <= i + self.offset

    def pairs(self, sq: int, sk: int) -> int:
        """How many (query, key) pairs of an ``(Sq, Sk)`` block are visible."""
        if self.kind in (FULL, EMPTY):
            return sq * sk if self.kind == FULL else 0
        if self.kind == DENSE:
            return int(self.dense.sum())
        # host integers only (the ring counts pairs every step): row i sees keys [lo_i, hi_i) with
        # hi_i = clamp(i + offset + 1, 0, sk) and lo_i = clamp(i + lo, 0, sk) <= hi_i (lo <= offset)
        lo = _clamped_sum(self.lo, sq, sk) if self.kind == BAND else 0
        return _clamped_sum(self.offset + 1, sq, sk) - lo

    def block(self, q0: int, q1: int, k0: int, k1: int) -> "Mask":
        """The mask of the sub-block ``q[q0:q1]`` x ``k[k0:k1]``."""
        if self.kind in (FULL, EMPTY):
            return self
        if self.kind == DENSE:
            return _classify_dense(self.dense[q0:q1, k0:k1])
        lo = self.lo + q0 - k0 if self.kind == BAND else None
        return _classify_band(lo, self.offset + q0 - k0, q1 - q0, k1 - k0)


def _clamped_sum(c: int, n: int, m: int) -> int:
    """``sum(min(max(i + c, 0), m) for i in range(n))`` in closed form (``m >= 0``)."""
    a, b = max(0, -c), min(n, m - c + 1)  # rows with 0 <= i + c <= m: [a, b)
    inside = (b - a) * (a + b - 1 + 2 * c) // 2 if b > a else 0
    return inside + (n - min(n, max(0, m - c + 1))) * m  # rows with i + c > m see all m keys


def _classify_band(lo: Optional[int], hi: Optional[int], sq: int, sk: int) -> Mask:
    """The mask ``i + lo <= j <= i + hi`` of an ``(Sq, Sk)`` block (``None``: unbounded side)."""
    if hi is not None and hi >= sk - 1:
        hi = None  # every row sees up to the last key
    if lo is not None and lo <= -(sq - 1):
        lo = None  # every row sees down to the first key
    first = 0 if hi is None else max(0, -hi)  # rows [first, last] see at least one key
    last = sq - 1 if lo is None else min(sq - 1, sk - 1 - lo)
    if sq == 0 or sk == 0 or first > last or (lo is not None and hi is not None and lo > hi):
        return Mask(EMPTY)
    if lo is None:
        return Mask(FULL) if hi is None else Mask(OFFSET, offset=hi)
    return Mask(BAND, offset=sk - 1 if hi is None else hi, lo=lo)


def _classify_dense(dense: torch.Tensor) -> Mask:
    if dense.numel() == 0 or not bool(dense.any()):
        return Mask(EMPTY)
    if bool(dense.all()):
        return Mask(FULL)
    return Mask(DENSE, dense=dense)


def _as_tensor(pos: Positions, n: int, device) -> torch.Tensor:
    if isinstance(pos, range):
        return torch.arange(pos.start, pos.stop, pos.step, device=device)
    return pos.to(device=device, dtype=torch.long)


def check_window(window) -> Tuple[int, int]:
    """``window`` as ``(left, right)`` ints ``>= -1`` (``-1`` = unbounded), or a clear error."""
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(
            f"window must be a tuple of two ints (left, right), -1 = unbounded, got {window!r}"
        )
    if min(window) < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return int(window[0]), int(window[1])


def check_positions(name: str, pos: Positions, n: int) -> None:
    """Raise a clear error when ``pos`` cannot describe ``n`` tokens."""
    if pos is None:
        return
    if isinstance(pos, range):
        if len(pos) != n:
            raise ValueError(
                f"{name} has {len(pos)} positions but the tensor has {n} tokens; "
                f"pass one position per token"
            )
        if n > 1 and pos.step <= 0:
            raise ValueError(f"{name} must be increasing (range step > 0), got step {pos.step}")
        return
    if not isinstance(pos, torch.Tensor):
        raise TypeError(
            f"{name} must be None, a range or a 1-D integer tensor, got {type(pos).__name__}"
        )
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {pos.dtype}")
    if pos.dim() != 1 or pos.numel() != n:
        raise ValueError(
            f"{name} must have shape ({n},) (one position per token), got {tuple(pos.shape)}"
        )


def make_mask(
    causal: bool,
    q_positions: Positions,
    k_positions: Positions,
    sq: int,
    sk: int,
    device=None,
    window: Tuple[int, int] = NO_WINDOW,
) -> Mask:
    """Reduce ``causal`` + ``window`` + global positions to a :class:`Mask` for a ``(Sq, Sk)``
    block.

    With ``None`` positions, keys sit at ``0..Sk-1`` and queries are aligned to the end of
    the keys (``Sk - Sq + i``), as in flash-attn: a query block that continues a cache.
    ``window = (left, right)``: ``q_pos - left <= k_pos <= q_pos + right``, ``-1`` unbounded.
    """
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return Mask(EMPTY) if sq == 0 or sk == 0 else Mask(FULL)
    if q_positions is None:
        q_positions = range(sk - sq, sk)
    if k_positions is None:
        k_positions = range(0, sk)
    if (
        isinstance(q_positions, range)
        and isinstance(k_positions, range)
        and (q_positions.step == k_positions.step or sq <= 1 or sk <= 1)
    ):
        step = q_positions.step if sq > 1 else k_positions.step
        if sq <= 1 and sk <= 1:
            step = 1
        gap = q_positions.start - k_positions.start
        return _classify_band(
            None if left < 0 else -((left - gap) // step),  # ceil((gap - left) / step)
            None if right < 0 else (gap + right) // step,
            sq,
            sk,
        )
    on_host = all(
        isinstance(p, range) or p.device.type == "cpu" for p in (q_positions, k_positions)
    )
    at = "cpu" if on_host else device  # host positions: classify on the host (no device sync)
    qp = _as_tensor(q_positions, sq, at)
    kp = _as_tensor(k_positions, sk, at)
    dist = qp[:, None] - kp[None, :]  # (Sq, Sk): q_pos - k_pos
    visible = torch.ones(sq, sk, dtype=torch.bool, device=at)
    if right >= 0:
        visible &= dist >= -right
    if left >= 0:
        visible &= dist <= left
    mask = _classify_dense(visible)
    if on_host and mask.kind == DENSE:
        mask = _as_band(visible) or Mask(DENSE, dense=visible.to(device))
    return mask


def _as_band(visible: torch.Tensor) -> Optional[Mask]:
    """The ``OFFSET``/``BAND`` mask equal to the host matrix ``visible``, if there is one (e.g.
    a decode step over a sharded cache: older keys, then the new tokens' own diagonal), so the
    fused kernels run it instead of an explicit matrix."""
    sq, sk = visible.shape
    rows = visible.any(1)
    i = torch.arange(sq)[rows]
    first = visible[rows].int().argmax(1)
    last = sk - 1 - visible[rows].flip(1).int().argmax(1)
    lo, hi = first - i, last - i  # each row's visible diagonals, if they are one interval
    lo_off = None if bool((first == 0).all()) else int(lo.max())
    candidate = _classify_band(lo_off, int(hi.min()), sq, sk)
    return candidate if torch.equal(candidate.visible(sq, sk), visible) else None


@dataclass(frozen=True)
class Tile:
    """Rows ``[q0, q1)`` x keys ``[k0, k1)``; ``causal`` tiles are square, top-left causal."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def offset_tiles(offset: int, sq: int, sk: int) -> list:
    """Cover the visible part of an ``OFFSET`` mask with full tiles and one square causal tile.

    Rows ``i < -offset`` see nothing. With ``r0 = max(0, -offset)`` and ``c = r0 + offset``:
    every row ``>= r0`` sees keys ``[0, c)`` (full tile), the diagonal is the square causal
    tile ``rows [r0, r0+n) x keys [c, c+n)``, and rows past it see all keys from ``c`` on.
    Square causal tiles are what every fused kernel agrees on (top-left == bottom-right).
    """
    r0 = max(0, -offset)
    c = r0 + offset
    n = min(sq - r0, sk - c)
    tiles = []
    if c > 0:
        tiles.append(Tile(r0, sq, 0, c, False))
    if n > 0:
        tiles.append(Tile(r0, r0 + n, c, c + n, True))
    if r0 + n < sq and c < sk:
        tiles.append(Tile(r0 + n, sq, c, sk, False))
    return tiles
