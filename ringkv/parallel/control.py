"""The engine's control plane: ordered messages from the driver (rank 0) to every other rank,
and small per-rank values every rank can read.

Two transports, each for what it does well:

- **Steps travel as tensors** (``Channel``): one broadcast of int64 words over a gloo group of
  the engine's ranks per step (a second one only when a step outgrows the size both sides
  agreed on), posted asynchronously by the driver so pipeline stages still overlap. What a
  step carries is ``plan.py``'s delta, whose size does not grow with the context.
- **Everything else goes through the process group's key-value store**: setup, agreement
  checks, per-call messages (a call's end, reports, errors, shutdown) as JSON (never
  pickles), and the waits of idle ranks. A store wait can be retried, unlike a gloo receive,
  which closes its connection when it times out; so ranks idle on the store. A rank waits on
  its own connection in a thread and gives up when the store (on the driver's host) has not
  answered for the engine's timeout: an idle rank across a link that went down ends in an
  error, as a rank inside a step does.

The participants are *control ranks*: under torchrun, every rank (rank 0 drives); in spawn
mode, the driver (control rank 0, which computes nothing) and the spawned model ranks (model
rank ``r`` is control rank ``r + 1``). In spawn mode the driver never joins a default process
group: the step channel is a gloo group built straight from the engine's own store, so one
process can hold several spawned engines. The step results come back on the same group.

The driver opens a burst of steps with a ``"steps"`` message on the store; the other ranks
then read steps from the channel until a ``PARK`` word sends them back to the store. The
driver parks them whenever the engine goes idle and before any store message, so a rank waits
inside a broadcast only while the driver is stepping. A dead driver closes the connection (the
wait fails at once); a driver on a host whose link went down closes nothing, so every broadcast
of a burst is bounded by the engine's timeout: the next step must come within it (a gloo
collective cannot be cancelled, and one without a bound would also hold the process at exit).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..sp.collectives import wait
from ..sp.comm import DEFAULT_TIMEOUT, RingTimeoutError

POLL = timedelta(seconds=2)  # a waiting rank checks ``alive()`` this often
STEP, PARK = 1, 2  # the first word of a channel message
CHANNEL_TIMEOUT = timedelta(days=1)  # a burst's wait: the driver parks the ranks when it goes idle


class EngineError(RuntimeError):
    """A rank of the engine failed or died; the engine cannot continue (create a new one)."""


class Channel:
    """Ordered int64 messages from global rank 0 to every rank of ``group`` (gloo, CPU tensors).

    Each message is one broadcast of a buffer of ``cap`` bytes: ``[payload words, next cap,
    payload...]``; a payload that does not fit goes on in a second broadcast of exactly the
    rest. Each message announces the next one's ``cap`` (its own size plus an eighth), so
    steady steps take one broadcast of about their own size. The driver's
    broadcasts are asynchronous (a later stage may still be busy with an earlier step); it
    waits on the old ones (``reap``) so at most ``depth`` are pending."""

    MIN_CAP, MAX_CAP = 256, 1 << 20

    def __init__(self, group, rank: int, depth: int = 4, timeout: Optional[timedelta] = None):
        self.group, self.rank, self.depth = group, rank, depth
        self.timeout = timeout or DEFAULT_TIMEOUT  # every broadcast's own bound
        self.cap = 1024
        self.pending: "deque" = deque()  # (work, buffer) of the driver's broadcasts in flight
        self.last_bytes = 0  # bytes the last message received took
        self.posted = (
            None  # (work, buffer): the receive of the next message, posted early (``prefetch``)
        )

    def _broadcast(self, buf: torch.Tensor):
        """An asynchronous broadcast from control rank 0 on the group itself (it may be a group
        built without a default process group, which ``dist.broadcast`` cannot take)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        return self.group.broadcast([buf], opts)

    def _wait(self, work, sent: bool = False) -> None:
        """Wait for a broadcast (bounded by its own timeout) or, ``sent``, one of this rank's
        sends (``pending``); a failure names the driver or the peers it waited for."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            t = f"{self.timeout.total_seconds():.0f}s"
            if sent or self.rank == 0:
                why = (
                    f"rank {self.rank}: a message it sent (a step or a result) did not reach "
                    f"its peers within {t} (a rank died or hangs, or the link to its host is "
                    f"down)"
                )
            elif "timed out" in str(e).lower():
                why = (
                    f"rank {self.rank}: no step from the driver (rank 0) within {t} (it hangs, "
                    f"or the link between this host and the driver's is down)"
                )
            else:
                why = (
                    f"rank {self.rank}: lost the driver (rank 0): it closed its connection (it "
                    f"failed, its own error names the cause, or it died)"
                )
            raise RingTimeoutError(f"{why}: {e}") from e

    def _next_cap(self, words: int) -> int:
        """This message's size plus 1/8, in steps of ``MIN_CAP`` bytes (the next step is alike)."""
        return min(self.MAX_CAP, -(-(8 * (words + 2) * 9 // 8) // self.MIN_CAP) * self.MIN_CAP)

    def send(self, payload: torch.Tensor) -> int:
        """Broadcast ``payload`` (1-D int64, on the CPU); returns the bytes it took."""
        words, head = payload.numel(), self.cap // 8
        nxt = self._next_cap(words)
        first = torch.zeros(head, dtype=torch.int64)
        first[0], first[1] = words, nxt
        first[2 : 2 + min(words, head - 2)] = payload[: head - 2]
        bufs = [first] + ([payload[head - 2 :].clone()] if words > head - 2 else [])
        for buf in bufs:
            self.pending.append((self._broadcast(buf), buf))
        self.cap = nxt
        return sum(b.numel() * 8 for b in bufs)

    def prefetch(self) -> None:
        """Post the receive of the next message now (its size is known), so that it arrives
        while this rank computes: gloo moves a message only once both sides have posted it."""
        if self.posted is None:
            first = torch.empty(self.cap // 8, dtype=torch.int64)
            self.posted = (self._broadcast(first), first)

    def recv(self) -> torch.Tensor:
        """The next message's payload (1-D int64)."""
        self.prefetch()
        (work, first), self.posted = self.posted, None
        self._wait(work)
        words, nxt = int(first[0]), int(first[1])
        if not 0 <= words <= (1 << 40) or not self.MIN_CAP <= nxt <= self.MAX_CAP:
            raise EngineError(
                f"rank {self.rank}: a malformed control message ({words} words, next size {nxt})"
            )
        head, self.last_bytes = self.cap // 8 - 2, self.cap
        if words > head:
            rest = torch.empty(words - head, dtype=torch.int64)
            self._wait(self._broadcast(rest))
            self.last_bytes += rest.numel() * 8
            payload = torch.cat([first[2:], rest])
        else:
            payload = first[2 : 2 + words]
        self.cap = nxt
        return payload

    def reap(self, keep: Optional[int] = None) -> None:
        """Wait for the driver's oldest broadcasts until at most ``keep`` (default ``depth``)
        are in flight (a rank that lags holds the driver back here); ``keep=0``: all of them
        (before the group goes away)."""
        keep = self.depth if keep is None else keep
        while len(self.pending) > keep:
            self._wait(self.pending.popleft()[0], sent=True)


class ControlPlane:
    def __init__(
        self, store, prefix: str, rank: int, world: int, timeout: Optional[timedelta] = None
    ):
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world = rank, world
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.sent = self.received = 0
        self.channel: Optional[Channel] = None
        self.parked = True  # the other ranks read the store (not the channel)
        self._waiter: Optional[_StoreWaiter] = None  # ``_wait``'s thread and connection

    def open_channel(self, depth: int, direct: bool = False) -> None:
        """Create the step channel: a gloo group of every control rank. ``direct`` (spawn mode):
        built straight from this plane's store (no default process group needed); else
        ``new_group`` of the default group (every rank calls this in the same order)."""
        timeout = max(CHANNEL_TIMEOUT, self.timeout)
        if direct:
            group = dist.ProcessGroupGloo(
                dist.PrefixStore("channel", self.store), self.rank, self.world, timeout
            )
        else:
            group = dist.new_group(list(range(self.world)), backend="gloo", timeout=timeout)
        self.channel = Channel(group, self.rank, depth, self.timeout)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """A CPU tensor to control rank ``dst`` (step results, K/V boxes); waits only on old
        sends."""
        self.channel.pending.append((self.channel.group.send([t], dst, tag), t))
        self.channel.reap()

    def recv_from(self, rank: int, t: torch.Tensor, tag: int, what: str) -> torch.Tensor:
        """Fill ``t`` (CPU) with what control rank ``rank`` sends under ``tag``, within the
        timeout."""
        try:
            work = self.channel.group.recv([t], rank, tag)
        except RuntimeError as e:  # posting to a peer whose connection is closed fails at once
            raise RingTimeoutError(
                f"rank {self.rank}: {what}: rank {rank} closed its connection (it died, or "
                f"failed: its own error names the cause) or the link to its host is down: {e}"
            ) from e
        wait(work, t, self.timeout, what)
        return t

    # -- driver -> every rank ------------------------------------------------------------
    def publish(self, msg: dict) -> None:
        """A per-call message (JSON) on the store; the ranks are parked first."""
        self.park()
        self.store.set(f"m{self.sent}", json.dumps(msg))
        self.sent += 1

    def reap(self) -> None:
        """The driver: wait until at most ``depth`` step broadcasts are in flight."""
        self.channel.reap()

    def publish_step(self, payload: torch.Tensor) -> int:
        """A step's words on the channel (opening a burst if the ranks are parked); returns the
        bytes broadcast (the burst's opening store message not counted)."""
        if self.parked:
            self.store.set(f"m{self.sent}", json.dumps({"kind": "steps"}))
            self.sent += 1
            self.parked = False
        return self.channel.send(torch.cat([torch.tensor([STEP]), payload]))

    def park(self) -> None:
        """Send the other ranks back to the store (the driver is about to idle or to publish)."""
        if not self.parked:
            self.channel.send(torch.tensor([PARK]))
            self.channel.reap()
            self.parked = True

    def receive(
        self, timeout: Optional[timedelta] = None, alive: Callable[[], bool] = lambda: True
    ) -> dict:
        """The next message, in order: a dict from the store, or ``{"kind": "step", "words":
        payload}`` from the channel during a burst. ``timeout=None``: wait on the store as long
        as ``alive()`` holds."""
        while True:
            if not self.parked:
                words = self.channel.recv()
                if (
                    int(words[0]) == STEP
                ):  # more steps (or a PARK) follow soon: receive the next one early
                    self.channel.prefetch()
                    return {"kind": "step", "words": words[1:], "bytes": self.channel.last_bytes}
                self.parked = True
                continue
            key = f"m{self.received}"
            self._wait(key, timeout, alive, "the next message from the driver (rank 0)")
            data = self.store.get(key)
            if (
                self.store.add(f"a{self.received}", 1) == self.world - 1
            ):  # the last reader cleans up
                self.store.delete_key(key)
                self.store.delete_key(f"a{self.received}")
            self.received += 1
            msg = json.loads(data)
            if msg["kind"] != "steps":
                return msg
            self.parked = False

    # -- every rank <-> every rank -------------------------------------------------------
    def post(self, name: str, value) -> None:
        self.store.set(f"v/{name}/{self.rank}", json.dumps(value))

    def read(self, name: str, rank: int, timeout: Optional[timedelta] = None):
        key = f"v/{name}/{rank}"
        self._wait(key, timeout or self.timeout, lambda: True, f"{name!r} from rank {rank}")
        return json.loads(self.store.get(key))

    def exchange(self, name: str, value, timeout: Optional[timedelta] = None) -> List:
        """Every rank posts ``value``; returns all ranks' values in rank order (a spawn-mode
        driver posts None), each waited for within ``timeout`` (default the plane's). The last
        rank to have read them all deletes the keys, so repeated exchanges (one per call) leave
        the store as it was."""
        self.post(name, value)
        values = [self.read(name, r, timeout) for r in range(self.world)]
        if self.store.add(f"x/{name}", 1) == self.world:
            for r in range(self.world):
                self.store.delete_key(f"v/{name}/{r}")
            self.store.delete_key(f"x/{name}")
        return values

    def poll(self, name: str, rank: int):
        """The value ``rank`` posted under ``name``, or None (no wait)."""
        key = f"v/{name}/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _wait(
        self, key: str, timeout: Optional[timedelta], alive: Callable[[], bool], what: str
    ) -> None:
        """Until ``key`` is on the store: within ``timeout`` (None: as long as ``alive()`` holds),
        and while the store answers. The store's own wait cannot be bounded when the link to its
        host (the driver's) goes down: its wait's cancel then blocks until the link comes back.
        So a thread with its own connection (``Store.clone``) waits, in rounds of at most a
        quarter of the engine's timeout, and this one gives up once no round has come back for
        that timeout."""
        waiter = self._waiter
        if waiter is None or waiter.thread.is_alive():  # a connection no other wait uses
            rounds = min(POLL, self.timeout / 4)  # a healthy store answers well within it
            # torch < 2.8 has no Store.clone: the thread shares this rank's connection (a wait
            # on a dead link is still given up, but the connection stays blocked until it ends)
            own = self.store.clone() if hasattr(self.store, "clone") else self.store
            waiter = self._waiter = _StoreWaiter(own, rounds)
        end = time.monotonic() + timeout.total_seconds() if timeout is not None else float("inf")
        waiter.start(key)
        step = waiter.rounds.total_seconds()
        while not waiter.done.wait(max(0.0, min(step, end - time.monotonic()))):
            now, why = time.monotonic(), None
            quiet = now - waiter.answered
            if quiet > self.timeout.total_seconds():
                why = (
                    f"the control store (on the driver's host) did not answer for {quiet:.0f}s "
                    f"while this rank waited for {what}: the link to that host is down, or the "
                    f"host is gone"
                )
            elif now >= end:
                why = (
                    f"no {what} within {timeout.total_seconds():.0f}s (a rank died, hangs, or "
                    f"called something else)"
                )
            elif not alive():
                why = f"gave up waiting for {what}: the driver is gone"
            if why:
                waiter.stop = True
                raise RingTimeoutError(f"rank {self.rank}: {why}")
        if waiter.error is not None:
            raise RingTimeoutError(
                f"rank {self.rank}: the control store failed waiting for {what}: {waiter.error}"
            ) from waiter.error


class _StoreWaiter:
    """A thread that waits for one key at a time on its own store connection, in rounds of
    ``rounds``; ``answered``: when the store last answered (a round ended)."""

    def __init__(self, store, rounds: timedelta):
        self.store, self.rounds = store, rounds
        self.thread: Optional[threading.Thread] = None

    def start(self, key: str) -> None:
        self.done, self.error, self.stop = threading.Event(), None, False
        self.answered = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(key,), daemon=True)
        self.thread.name = "ringkv-store-wait"
        self.thread.start()

    def _run(self, key: str) -> None:
        while not self.stop:
            try:
                self.store.wait([key], self.rounds)
                break
            except Exception as e:  # the wait's timeout (the store answered) or a failure
                if "timeout" not in str(e).lower():
                    self.error = e
                    break
            self.answered = time.monotonic()
        self.done.set()


def parent_alive(parent_pid: int) -> Callable[[], bool]:
    return lambda: os.getppid() == parent_pid
