"""Sequence layouts: which global tokens each SP rank holds.

- ``contiguous``: rank r holds tokens ``[r*S/N, (r+1)*S/N)``;
- ``zigzag``: the sequence is cut in ``2N`` chunks, rank r holds chunks ``r`` and ``2N-1-r``
  (causal work is balanced: early and late chunks pair up);
- ``striped``: token ``i`` lives on rank ``i mod N``.

A shard is described by ``chunks(...)``: a list of ``range``s of global positions, in the
order the tokens sit in the local tensor (always increasing). Masks and rotary embeddings
use these global positions.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather, rank_world

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def granule(layout: str, world: int) -> int:
    """The global sequence length must be a multiple of this."""
    check_layout(layout)
    return 2 * world if layout == "zigzag" else world


def check_seq_len(seq_len: int, layout: str, world: int) -> None:
    g = granule(layout, world)
    if seq_len % g:
        pad = -seq_len % g
        raise ValueError(f"layout {layout!r} over {world} ranks needs a sequence length divisible by {g}, "
                         f"got {seq_len}; pad the sequence by {pad} tokens (to {seq_len + pad})")


def chunks(seq_len: int, layout: str, rank: int, world: int) -> List[range]:
    """Global positions of rank ``rank``'s shard, as increasing ranges in local order."""
    check_seq_len(seq_len, layout, world)
    if layout == "contiguous":
        n = seq_len // world
        return [range(rank * n, (rank + 1) * n)]
    if layout == "zigzag":
        c = seq_len // (2 * world)
        hi = 2 * world - 1 - rank
        return [range(rank * c, (rank + 1) * c), range(hi * c, (hi + 1) * c)]
    return [range(rank, seq_len, world)]


def cut(ranges: List[range], lo: int, hi: int) -> List[range]:
    """The ranges of local rows ``[lo, hi)`` of a shard given by ``ranges`` (in local order)."""
    out, start = [], 0
    for r in ranges:
        a, b = max(lo - start, 0), min(hi - start, len(r))
        if a < b:
            out.append(r[a:b])
        start += len(r)
    return out


def usp_chunks(seq_len: int, layout: str, ring_rank: int, ring_world: int, ulysses_rank: int,
               ulysses_world: int) -> List[range]:
    """Global positions of a 2D rank's tokens: part ``ulysses_rank`` of ``ulysses_world``
    contiguous parts of ring rank ``ring_rank``'s shard in ``layout`` over ``ring_world``."""
    ranges = chunks(seq_len, layout, ring_rank, ring_world)
    n = seq_len // ring_world
    if n % ulysses_world:
        g = granule(layout, ring_world) * ulysses_world
        raise ValueError(f"layout {layout!r} over {ulysses_world} (ulysses) x {ring_world} (ring) ranks needs a "
                         f"sequence length divisible by {g}, got {seq_len}; pad the sequence by {-seq_len % g} tokens")
    part = n // ulysses_world
    return cut(ranges, ulysses_rank * part, (ulysses_rank + 1) * part)


def _is_2d(group, rank, ulysses_group, ring_group) -> bool:
    if ulysses_group is None and ring_group is None:
        return False
    if ulysses_group is None or ring_group is None or group is not None or rank is not None:
        raise ValueError("pass both ulysses_group and ring_group (see ringkv.sp_groups) for a 2D shard, "
                         "or group/rank/world for a 1D one, not both")
    return True


def _ranges(seq_len: int, layout: str, group, rank, world, ulysses_group, ring_group) -> List[range]:
    if not _is_2d(group, rank, ulysses_group, ring_group):
        if rank is None or world is None:
            rank, world = rank_world(group)
        return chunks(seq_len, layout, rank, world)
    (u, n_u), (r, n_r) = rank_world(ulysses_group), rank_world(ring_group)
    return usp_chunks(seq_len, layout, r, n_r, u, n_u)


def positions(seq_len: int, layout: str, rank: Optional[int] = None, world: Optional[int] = None, device=None, *,
              ulysses_group: Optional[dist.ProcessGroup] = None,
              ring_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Global positions ``(seq_len // world,)`` int64 of rank ``rank``'s tokens, in local order
    (default: this rank of the world; with ``ulysses_group``/``ring_group``: its 2D part)."""
    return torch.cat([torch.arange(r.start, r.stop, r.step, device=device)
                      for r in _ranges(seq_len, layout, None, rank, world, ulysses_group, ring_group)])


def _select(x: torch.Tensor, dim: int, ranges: List[range]) -> torch.Tensor:
    parts = [x.narrow(dim, r.start, len(r)) if r.step == 1 else
             x.index_select(dim, torch.arange(r.start, r.stop, r.step, device=x.device)) for r in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def shard(x: torch.Tensor, dim: int = 1, layout: str = "zigzag", group: Optional[dist.ProcessGroup] = None,
          *, rank: Optional[int] = None, world: Optional[int] = None,
          ulysses_group: Optional[dist.ProcessGroup] = None,
          ring_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (local op, no communication);
    with ``ulysses_group`` and ``ring_group``, its part of the 2D layout ``usp_attention`` takes."""
    return _select(x, dim, _ranges(x.shape[dim], layout, group, rank, world, ulysses_group, ring_group))


def unshard(x_local: torch.Tensor, dim: int = 1, layout: str = "zigzag",
            group: Optional[dist.ProcessGroup] = None, *, ulysses_group: Optional[dist.ProcessGroup] = None,
            ring_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather the shards of every rank and put them back in global order (not differentiable)."""
    check_layout(layout)
    if _is_2d(group, None, ulysses_group, ring_group):
        # the Ulysses parts of one ring shard, in order, are that ring rank's 1D shard
        x_local = torch.cat(all_gather(x_local, ulysses_group, what="unshard"), dim)
        group = ring_group
    rank, world = rank_world(group)
    if world == 1:
        return x_local
    parts = all_gather(x_local, group, what="unshard")
    seq_len = x_local.shape[dim] * world
    index = torch.cat([positions(seq_len, layout, r, world) for r in range(world)])  # global pos of gathered rows
    order = torch.empty_like(index)
    order[index] = torch.arange(seq_len)
    return torch.cat(parts, dim).index_select(dim, order.to(x_local.device))
