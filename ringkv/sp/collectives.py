"""Small bounded collectives over an SP group: gather, sum, agree (decode, the HF patch), and the
all-to-all / all-gather / reduce-scatter of the Ulysses, USP and all-gather-KV attentions.

On CPU (gloo) every wait is bounded by ``timeout`` and a peer that died or never called ends
in ``RingTimeoutError``; on CUDA (NCCL) the process group's watchdog bounds the wait. A group
of one rank (or no process group at all) short-circuits without communication.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import DEFAULT_TIMEOUT, RingTimeoutError

__all__ = [
    "rank_world",
    "all_gather",
    "all_sum",
    "shared_sum",
    "shared_pool",
    "all_reduce_",
    "wait",
    "agree",
    "agree_once",
    "forget_agreed",
    "AGREED",
    "GroupMemory",
    "Memo",
    "all_to_all",
    "all_to_all_sizes",
    "Pending",
    "start_all_gather",
    "start_reduce_scatter",
    "CommStats",
]


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
        raise RingTimeoutError(
            f"{what}: rank {rank} got no answer from its peers within "
            f"{timeout.total_seconds():.0f}s (a peer died, hangs or called something else, or "
            f"the link to its host is down): {e}"
        ) from e


def all_gather(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_gather"
) -> List[torch.Tensor]:
    """Every rank's ``x`` (same shape and dtype on every rank), in group rank order."""
    rank, world = rank_world(group)
    if world == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    wait(dist.all_gather(parts, x, group=group, async_op=True), x, timeout, what)
    return parts


def all_sum(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_reduce"
) -> torch.Tensor:
    """The sum of ``x`` over the group (a new tensor; not differentiable)."""
    rank, world = rank_world(group)
    x = x.detach().clone().contiguous()
    return x if world == 1 else all_reduce_(x, group, timeout, what)


def shared_sum(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_reduce"
) -> torch.Tensor:
    """The sum of ``x`` over the group as the value, on every rank; as the gradient, ``x``'s own
    (this rank's share: the gradients summed over the group, as data parallelism's all-reduce
    does, are those of the sum). One bounded all-reduce."""
    return x + (all_sum(x, group, timeout, what) - x.detach())


def shared_pool(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    batch: int,
    group=None,
    timeout: Optional[timedelta] = None,
) -> torch.Tensor:
    """A weighted sum per batch row of tokens sharded over the group: ``x`` ``(n, H)`` this rank's
    tokens, ``rows`` ``(n,)`` the batch row of each (any value where ``weights`` is 0),
    ``weights`` ``(n,)`` -> ``(batch, H)``, the same on every rank (mean pooling: weights
    ``1 / count`` of the row's real tokens; CLS or last token: 1 at that token). The gradient is
    this rank's tokens' share (``shared_sum``). One all-reduce."""
    w = weights.to(device=x.device, dtype=x.dtype)
    local = x.new_zeros(batch, x.shape[-1]).index_add(0, rows.to(x.device), x * w[:, None])
    return shared_sum(local, group, timeout, "ringkv pooling")  # (batch, H)


def all_reduce_(
    x: torch.Tensor, group, timeout: Optional[timedelta] = None, what: str = "all_reduce"
) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (bounded like every wait here); returns ``x``."""
    wait(dist.all_reduce(x, group=group, async_op=True), x, timeout, what)
    return x


def agree(
    values: Sequence[int],
    names: Sequence[str],
    group=None,
    timeout: Optional[timedelta] = None,
    what: str = "ringkv",
    device=None,
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass the same ``values`` (one tiny
    all-gather).

    ``group`` may be a list of groups that together connect the ranks (the two axes of a 2D
    mesh): one all-gather per group, each carrying whether an earlier one found a difference,
    so every rank of the mesh raises, not only those of the group that disagrees.
    """
    problem = None
    for g in group if isinstance(group, (list, tuple)) else [group]:
        rank, world = rank_world(g)
        if world == 1:
            continue
        mine = torch.tensor(
            [int(v) for v in values] + [problem is not None], dtype=torch.int64, device=device
        )
        for r, theirs in enumerate(all_gather(mine, g, timeout, what)):
            diff = [n for n, a, b in zip(names, mine.tolist(), theirs.tolist()) if a != b]
            if diff and problem is None:
                problem = f"rank {r} disagrees with rank {rank} on {', '.join(diff)}"
            if theirs[-1] and problem is None:
                problem = f"rank {r} saw ranks that disagree (in its other group)"
    if problem:
        raise ValueError(
            f"{what}: {problem}; every rank of the "
            f"SP group must make the same call (same batch, sequence length, phase and tokens)"
        )


class GroupMemory:
    """Per group, an ordered memory (key -> value, the least recently used dropped first past a
    limit): what every rank of a group must hold alike (agreements, ``"auto"`` decisions), so that
    all drop the same entries. ``snapshot()`` shows it, ``forget(group)`` drops one group's,
    ``reset()`` all of it (on every rank of the groups)."""

    def __init__(self):
        self._groups: Dict[object, "OrderedDict[object, object]"] = {}

    def get(self, group, key, default=None):
        return self._groups.get(group, {}).get(key, default)

    def touch(self, group, key) -> bool:
        """Whether ``key`` is remembered for ``group``; if so it becomes the most recent."""
        seen = self._groups.get(group)
        if seen is None or key not in seen:
            return False
        seen.move_to_end(key)
        return True

    def put(self, group, key, value, limit: int) -> None:
        """Remember ``key -> value`` for ``group``, keeping at most ``limit`` entries."""
        seen = self._groups.setdefault(group, OrderedDict())
        seen[key] = value
        if len(seen) > limit:
            seen.popitem(last=False)

    def forget(self, group) -> None:
        self._groups.pop(group, None)

    def snapshot(self) -> dict:
        """``{(group, key): value}``, oldest first within a group."""
        return {(g, k): v for g, seen in self._groups.items() for k, v in seen.items()}

    def reset(self) -> None:
        self._groups.clear()


class Memo:
    """Values built once per key (process groups of a device mesh): ``get(key, make)``;
    ``snapshot()`` lists the keys, ``reset()`` drops them all (their process group destroyed)."""

    def __init__(self):
        self._values: dict = {}

    def get(self, key, make: Callable[[], object]):
        if key not in self._values:
            self._values[key] = make()
        return self._values[key]

    def snapshot(self) -> list:
        return list(self._values)

    def reset(self) -> None:
        self._values.clear()


AGREED = GroupMemory()  # groups -> (what, values) that all ranks agreed on
AGREED_PER_GROUP = 1024  # remembered configurations per group (least recently used dropped first)


def forget_agreed(group=None) -> None:
    """Drop what ``agree_once`` remembers for calls on exactly ``group`` (default: the world),
    on this rank: the next call on it checks again. Every rank of ``group`` must call it (a rank
    that remembers and one that does not make different collectives); calls over several groups
    (USP's) keep theirs. Tests whose case needs a first call use it."""
    AGREED.forget((dist.group.WORLD if group is None else group,))


def agree_once(
    values: Sequence[int],
    names: Sequence[str],
    group=None,
    timeout: Optional[timedelta] = None,
    what: str = "ringkv",
    device=None,
) -> bool:
    """``agree``, remembered: a call whose ``(group, what, values)`` already agreed makes no
    collective (and no host synchronisation). Returns whether it communicated.

    ``values`` must be known on the host (shapes, settings, checksums of host lists), never read
    from device tensors. Only agreement is remembered: ranks that disagree all raise ``ValueError``
    and the next call checks again. A rank whose call differs from a configuration its peers
    already agreed on makes a collective they do not: it ends in ``RingTimeoutError`` (the
    bounded wait), or in the ring's own errors, not in the ``ValueError`` of a first call.
    The memory is per group (so every rank of a group drops the same entries), bounded by
    ``AGREED_PER_GROUP``; the group objects are held, so their ids are never reused.
    """
    groups = tuple(group) if isinstance(group, (list, tuple)) else (group,)
    if all(rank_world(g)[1] == 1 for g in groups):
        return False
    gkey = tuple(dist.group.WORLD if g is None else g for g in groups)
    key = (what, tuple(int(v) for v in values))
    if AGREED.touch(gkey, key):
        return False
    agree(values, names, group, timeout, what, device)
    AGREED.put(gkey, key, None, AGREED_PER_GROUP)
    return True


@dataclass
class CommStats:
    """What this rank sent to other ranks in one forward of ``method`` (for tests and benchmarks):
    pass a ``CommStats()`` as ``stats=`` to ``ulysses_attention``, ``allgather_attention`` or
    ``usp_attention`` and the call fills it."""

    method: str = ""
    bytes_sent: int = 0


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Pending:
    """An asynchronous collective: ``wait()`` waits (bounded like ``wait``) and returns its
    result."""

    def __init__(
        self,
        work,
        out: torch.Tensor,
        timeout: Optional[timedelta],
        what: str,
        finish: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        sent: int = 0,
    ):
        self.work, self.out, self.timeout, self.what, self.finish = work, out, timeout, what, finish
        self.sent = sent  # bytes this rank sends to other ranks

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            wait(self.work, self.out, self.timeout, self.what)
            self.work = None
        return self.finish(self.out)


def _start_all_to_all(x: torch.Tensor, group, timeout, what, finish=lambda t: t) -> Pending:
    # x (N, ...): row j goes to rank j; the result (N, ...) has row i from rank i
    rank, world = rank_world(group)
    if x.shape[0] != world:
        raise ValueError(
            f"{what}: all_to_all needs a leading dim of the group size {world}, got "
            f"{tuple(x.shape)}"
        )
    if world == 1:
        return Pending(None, x, timeout, what, finish)
    x = x.contiguous()
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=group, async_op=True)
    return Pending(work, out, timeout, what, finish, _nbytes(x) // world * (world - 1))


def start_all_gather(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_gather"
) -> Pending:
    """Post an all-gather of ``x`` (same shape on every rank); ``wait()`` gives
    ``(N, *x.shape)``."""
    rank, world = rank_world(group)
    if world == 1:
        return Pending(None, x.unsqueeze(0), timeout, what)
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    work = dist.all_gather(
        list(out.unbind(0)), x, group=group, async_op=True
    )  # into views of one buffer
    return Pending(work, out, timeout, what, sent=_nbytes(x) * (world - 1))


def start_reduce_scatter(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "reduce_scatter"
) -> Pending:
    """Post a reduce-scatter of ``x`` ``(N, ...)``: ``wait()`` gives the sum over ranks of their
    ``x[rank]``. Done as an all-to-all and a local sum (what gloo and NCCL all have; the same
    bytes on the wire as a ring reduce-scatter)."""
    return _start_all_to_all(x, group, timeout, what, finish=lambda t: t.sum(0))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, timeout, what, *xs):
        ctx.args = (group, timeout, what)
        pending = [_start_all_to_all(x, group, timeout, what) for x in xs]
        return tuple(p.wait() for p in pending)

    @staticmethod
    def backward(ctx, *grads):  # the adjoint of an all-to-all is the same all-to-all
        pending = [_start_all_to_all(g.contiguous(), *ctx.args) for g in grads]
        return (None, None, None, *(p.wait() for p in pending))


def all_to_all(
    *xs: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "all_to_all"
) -> tuple:
    """Exchange rows: row ``j`` of every ``x`` ``(N, ...)`` goes to rank ``j``; returns a tuple of
    ``(N, ...)`` tensors whose row ``i`` came from rank ``i``. Differentiable (the backward is the
    same exchange of the gradients, always all of them, so every rank communicates alike)."""
    rank, world = rank_world(group)
    if world == 1:
        return xs
    return _AllToAll.apply(group, timeout, what, *xs)


def _start_all_to_all_sizes(x, send: Sequence[int], recv: Sequence[int], group, timeout, what):
    # x (sum(send),): the j-th run of send[j] elements goes to rank j; the result (sum(recv),)
    # holds recv[i] elements from rank i, in rank order
    rank = rank_world(group)[0]
    out = x.new_empty(sum(recv))
    work = dist.all_to_all_single(
        out, x.contiguous(), list(recv), list(send), group=group, async_op=True
    )
    return Pending(work, out, timeout, what, sent=(sum(send) - send[rank]) * x.element_size())


class _AllToAllSizes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, timeout, what, send, recv, x):
        ctx.args = (group, timeout, what, send, recv)
        return _start_all_to_all_sizes(x, send, recv, group, timeout, what).wait()

    @staticmethod
    def backward(ctx, grad):  # the adjoint: the same exchange with the sizes swapped
        group, timeout, what, send, recv = ctx.args
        back = _start_all_to_all_sizes(grad, recv, send, group, timeout, what).wait()
        return None, None, None, None, None, back


def all_to_all_sizes(
    x: torch.Tensor,
    send: Sequence[int],
    recv: Sequence[int],
    group=None,
    timeout: Optional[timedelta] = None,
    what: str = "all_to_all",
) -> torch.Tensor:
    """An all-to-all of runs of different sizes: ``x`` ``(sum(send),)`` is cut into runs of
    ``send[j]`` elements, run ``j`` going to rank ``j``; returns ``(sum(recv),)`` holding
    ``recv[i]`` elements from rank ``i``, in rank order (``recv[i]`` must be what rank ``i`` sends
    here). Differentiable (the backward swaps the sizes; every rank communicates alike)."""
    if rank_world(group)[1] == 1:
        return x
    return _AllToAllSizes.apply(group, timeout, what, tuple(send), tuple(recv), x)
