"""RingComm: one batched isend/irecv per ring hop, into buffers the caller reuses.

Rank ``r`` of the group sends to ``r+1`` and receives from ``r-1`` (mod N). A group of size 1
short-circuits to a local copy so the same ring code runs unchanged.

A hop posts its receives before its sends. gloo's TCP transport is a rendezvous: a payload
leaves only once the receiver's "ready to receive" note has arrived, and both directions
between two ranks share one connection. A send posted first to a peer already waiting is
written at once, so the note for this rank's own receive from that peer queued behind it and
crossed the link only after the whole payload: with ``N = 2`` (each rank's next is its
previous) the two directions ran one after the other. Across two hosts at 100 Mbit/s the
engine's ``sp=2`` prefill took 1.31-1.38 s instead of 0.91-0.96 s (docs/plan.md).

On CPU (gloo) every wait is bounded by ``timeout``; on CUDA (NCCL) waits are stream-ordered
and the process group's own timeout (its watchdog) bounds them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("RINGKV_TIMEOUT_S", "300")))


class RingTimeoutError(RuntimeError):
    """A ring peer did not answer in time (it died, hangs, or disagrees on the schedule)."""


class RingComm:
    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        timeout: Optional[timedelta] = None,
        tag: int = 0,
    ):
        self.group, self.tag = group, tag  # distinct tags keep two rings on one group apart (gloo)
        self.timeout = timeout or DEFAULT_TIMEOUT
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world = 0, 1
        if self.world > 1:
            self.next, self.prev = self._global(1), self._global(-1)
        self._reqs: List[dist.Work] = []

    def with_tag(self, tag: int) -> "RingComm":
        """A second ring on the same group (its messages never match this one's)."""
        return RingComm(self.group, self.timeout, tag)

    def _global(self, offset: int) -> int:
        peer = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, peer) if self.group else peer

    def send_recv(
        self, send: List[torch.Tensor], recv: List[torch.Tensor], offset: int = 1
    ) -> "RingComm":
        """Post sends of ``send`` to the next rank and receives into ``recv`` from the previous one.

        ``offset``: send to rank ``r + offset`` and receive from ``r - offset`` instead (mod N),
        e.g. ``-h`` returns what travelled ``h`` hops straight back to its owner.
        """
        if self._reqs:
            raise RuntimeError("RingComm: wait() for the previous hop before posting the next")
        if self.world == 1:
            for s, r in zip(send, recv):
                r.copy_(s)
            return self
        dst, src = (
            (self.next, self.prev) if offset == 1 else (self._global(offset), self._global(-offset))
        )
        # receives first: their notes must not queue behind our payloads (the module docstring)
        ops = [dist.P2POp(dist.irecv, t, src, self.group, self.tag) for t in recv]
        ops += [dist.P2POp(dist.isend, t, dst, self.group, self.tag) for t in send]
        self._hop = (len(recv), len(ops), dst, src)  # for an error that names the peer
        try:
            self._reqs = dist.batch_isend_irecv(ops)
        except RuntimeError as e:  # posting to a peer whose connection is closed fails at once
            raise RingTimeoutError(
                f"ring hop on rank {self.rank}/{self.world}: {self._peer(0, 1)} failed: a peer "
                f"closed its connection (it died, or failed: its own error names the cause) or "
                f"the link to its host is down: {e}"
            ) from e
        self._bounded = not send[0].is_cuda  # NCCL: stream-ordered waits, the watchdog bounds them
        return self

    def wait(self) -> None:
        reqs, self._reqs = self._reqs, []
        for i, req in enumerate(reqs):
            try:
                req.wait(self.timeout) if self._bounded else req.wait()
            except RuntimeError as e:
                raise RingTimeoutError(
                    f"ring hop on rank {self.rank}/{self.world}: {self._peer(i, len(reqs))} "
                    f"failed or timed out after {self.timeout.total_seconds():.0f}s (a peer "
                    f"died, hangs, or called with other arguments, or the link to its host is "
                    f"down): {e}"
                ) from e

    def _peer(self, i: int, n: int) -> str:
        """What request ``i`` of a hop's ``n`` is: the receives come first, then the sends
        (one request per message; a backend that coalesces them returns one for all)."""
        recvs, total, dst, src = self._hop
        if n != total:
            return f"the exchange with ranks {dst} and {src}"
        return f"the receive from rank {src}" if i < recvs else f"the send to rank {dst}"


class LocalComm(RingComm):
    """Ring position ``rank`` of ``world`` with no communication: each hop copies the block it
    would send into the receive buffer. For timing the ring schedule without the network
    (benchmarks: overlap and ``--virtual`` runs); the attention it produces is not meaningful."""

    def __init__(self, rank: int, world: int):
        self.group, self.tag, self.timeout = None, 0, DEFAULT_TIMEOUT
        self.rank, self.world = rank, world
        self._reqs = []

    def with_tag(self, tag: int) -> "LocalComm":
        return LocalComm(self.rank, self.world)

    def send_recv(self, send, recv, offset: int = 1):
        for s, r in zip(send, recv):
            r.copy_(s)
        return self
