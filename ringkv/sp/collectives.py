"""Small bounded collectives over an SP group (gather, sum, agree) for decode and the HF patch.

On CPU (gloo) every wait is bounded by ``timeout`` and a peer that died or never called ends
in ``RingTimeoutError``; on CUDA (NCCL) the process group's watchdog bounds the wait. A group
of one rank (or no process group at all) short-circuits without communication.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import DEFAULT_TIMEOUT, RingTimeoutError

__all__ = ["rank_world", "all_gather", "all_sum", "all_reduce_", "wait", "agree"]


def rank_world(group: Optional[dist.ProcessGroup] = None) -> tuple:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def wait(work, x: torch.Tensor, timeout: Optional[timedelta], what: str) -> None:
    timeout = timeout or DEFAULT_TIMEOUT
    try:
        work.wait(timeout) if x.device.type == "cpu" else work.wait()
    except RuntimeError as e:
        rank, world = rank_world()
        raise RingTimeoutError(f"{what}: rank {rank} got no answer from its peers within "
                               f"{timeout.total_seconds():.0f}s (a peer died, hangs or called something else): {e}") from e


def all_gather(x: torch.Tensor, group=None, timeout: Optional[timedelta] = None,
               what: str = "all_gather") -> List[torch.Tensor]:
    """Every rank's ``x`` (same shape and dtype on every rank), in group rank order."""
    rank, world = rank_world(group)
    if world == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    wait(dist.all_gather(parts, x, group=group, async_op=True), x, timeout, what)
    return parts


def all_sum(x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_reduce") -> torch.Tensor:
    """The sum of ``x`` over the group (a new tensor; not differentiable)."""
    rank, world = rank_world(group)
    x = x.detach().clone().contiguous()
    return x if world == 1 else all_reduce_(x, group, timeout, what)


def all_reduce_(x: torch.Tensor, group, timeout: Optional[timedelta] = None, what: str = "all_reduce") -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (bounded like every wait here); returns ``x``."""
    wait(dist.all_reduce(x, group=group, async_op=True), x, timeout, what)
    return x


def agree(values: Sequence[int], names: Sequence[str], group=None, timeout: Optional[timedelta] = None,
          what: str = "ringkv", device=None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass the same ``values`` (one tiny all-gather)."""
    rank, world = rank_world(group)
    if world == 1:
        return
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    for r, theirs in enumerate(all_gather(mine, group, timeout, what)):
        diff = [n for n, a, b in zip(names, mine.tolist(), theirs.tolist()) if a != b]
        if diff:
            raise ValueError(f"{what}: rank {r} disagrees with rank {rank} on {', '.join(diff)}; every rank of the "
                             f"SP group must make the same call (same batch, sequence length, phase and tokens)")
