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


def positions(seq_len: int, layout: str, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions ``(seq_len // world,)`` int64 of rank ``rank``'s tokens, in local order."""
    return torch.cat([torch.arange(r.start, r.stop, r.step, device=device)
                      for r in chunks(seq_len, layout, rank, world)])


def _select(x: torch.Tensor, dim: int, ranges: List[range]) -> torch.Tensor:
    parts = [x.narrow(dim, r.start, len(r)) if r.step == 1 else
             x.index_select(dim, torch.arange(r.start, r.stop, r.step, device=x.device)) for r in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def shard(x: torch.Tensor, dim: int = 1, layout: str = "zigzag", group: Optional[dist.ProcessGroup] = None,
          *, rank: Optional[int] = None, world: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (local op, no communication)."""
    if rank is None or world is None:
        rank, world = rank_world(group)
    return _select(x, dim, chunks(x.shape[dim], layout, rank, world))


def unshard(x_local: torch.Tensor, dim: int = 1, layout: str = "zigzag",
            group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather the shards of every rank and put them back in global order (not differentiable)."""
    check_layout(layout)
    rank, world = rank_world(group)
    if world == 1:
        return x_local
    parts = all_gather(x_local, group, what="unshard")
    seq_len = x_local.shape[dim] * world
    index = torch.cat([positions(seq_len, layout, r, world) for r in range(world)])  # global pos of gathered rows
    order = torch.empty_like(index)
    order[index] = torch.arange(seq_len)
    return torch.cat(parts, dim).index_select(dim, order.to(x_local.device))
