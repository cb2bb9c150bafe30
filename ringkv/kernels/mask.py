"""Causal masks on global positions, reduced to what a kernel can execute fast.

A causal mask is ``q_pos >= k_pos`` on *global* token positions. Positions are given as
``None`` (the default alignment), a ``range`` (an arithmetic progression: contiguous chunks,
zigzag chunks and striped shards all are one) or a 1-D integer tensor (anything else).

``make_mask`` turns them into a :class:`Mask`:

- ``FULL``:   every query sees every key (no mask to apply);
- ``EMPTY``:  no query sees any key (the block is skipped: ``out = 0``, ``lse = -inf``);
- ``OFFSET``: key ``j`` is visible to query ``i`` iff ``j <= i + offset`` (an offset
  diagonal; ``offset = 0`` with ``Sq == Sk`` is the usual top-left causal mask);
- ``DENSE``:  an explicit boolean ``(Sq, Sk)`` matrix, for position vectors with no structure.

Two ranges with the same step ``s`` always give ``FULL``, ``EMPTY`` or ``OFFSET``:
``a + i*s >= b + j*s  <=>  j <= i + floor((a - b) / s)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

Positions = Union[None, range, torch.Tensor]

FULL, EMPTY, OFFSET, DENSE = "full", "empty", "offset", "dense"


@dataclass(frozen=True)
class Mask:
    kind: str
    offset: int = 0
    dense: Optional[torch.Tensor] = None  # bool (Sq, Sk) when kind == DENSE

    def visible(self, sq: int, sk: int, device=None) -> torch.Tensor:
        """Bool ``(Sq, Sk)`` matrix of visible pairs (for references and tests)."""
        if self.kind == DENSE:
            return self.dense.to(device)
        if self.kind in (FULL, EMPTY):
            return torch.full((sq, sk), self.kind == FULL, dtype=torch.bool, device=device)
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        return j <= i + self.offset

    def block(self, q0: int, q1: int, k0: int, k1: int) -> "Mask":
        """The mask of the sub-block ``q[q0:q1]`` x ``k[k0:k1]``."""
        if self.kind in (FULL, EMPTY):
            return self
        if self.kind == DENSE:
            return _classify_dense(self.dense[q0:q1, k0:k1])
        return _classify_offset(self.offset + q0 - k0, q1 - q0, k1 - k0)


def _classify_offset(offset: int, sq: int, sk: int) -> Mask:
    if sq == 0 or sk == 0:
        return Mask(EMPTY)
    if offset >= sk - 1:
        return Mask(FULL)
    if offset + sq - 1 < 0:
        return Mask(EMPTY)
    return Mask(OFFSET, offset=offset)


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


def check_positions(name: str, pos: Positions, n: int) -> None:
    """Raise a clear error when ``pos`` cannot describe ``n`` tokens."""
    if pos is None:
        return
    if isinstance(pos, range):
        if len(pos) != n:
            raise ValueError(f"{name} has {len(pos)} positions but the tensor has {n} tokens; "
                             f"pass one position per token")
        if n > 1 and pos.step <= 0:
            raise ValueError(f"{name} must be increasing (range step > 0), got step {pos.step}")
        return
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be None, a range or a 1-D integer tensor, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {pos.dtype}")
    if pos.dim() != 1 or pos.numel() != n:
        raise ValueError(f"{name} must have shape ({n},) (one position per token), got {tuple(pos.shape)}")


def make_mask(causal: bool, q_positions: Positions, k_positions: Positions,
              sq: int, sk: int, device=None) -> Mask:
    """Reduce ``causal`` + global positions to a :class:`Mask` for a ``(Sq, Sk)`` block.

    With ``None`` positions, keys sit at ``0..Sk-1`` and queries are aligned to the end of
    the keys (``Sk - Sq + i``), as in flash-attn: a query block that continues a cache.
    """
    if not causal:
        return Mask(EMPTY) if sq == 0 or sk == 0 else Mask(FULL)
    if q_positions is None:
        q_positions = range(sk - sq, sk)
    if k_positions is None:
        k_positions = range(0, sk)
    if isinstance(q_positions, range) and isinstance(k_positions, range) \
            and (q_positions.step == k_positions.step or sq <= 1 or sk <= 1):
        step = q_positions.step if sq > 1 else k_positions.step
        if sq <= 1 and sk <= 1:
            step = 1
        return _classify_offset((q_positions.start - k_positions.start) // step, sq, sk)
    qp = _as_tensor(q_positions, sq, device)
    kp = _as_tensor(k_positions, sk, device)
    return _classify_dense(qp[:, None] >= kp[None, :])


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
