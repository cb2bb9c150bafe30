"""The engine's control plane: ordered messages from the driver (rank 0) to every other rank,
and small per-rank values every rank can read, over the process group's key-value store.

Messages are JSON (token ids, block tables, settings: never pickles). A message is deleted by
the last rank that reads it. Waiting on a store is bounded and can be retried, unlike a
gloo receive, which closes its connection when it times out: workers idle between calls
here, never inside a collective.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as dist

from ..sp.comm import DEFAULT_TIMEOUT, RingTimeoutError

POLL = timedelta(seconds=2)  # a waiting rank checks ``alive()`` this often


class ControlPlane:
    def __init__(self, store, prefix: str, rank: int, world: int, timeout: Optional[timedelta] = None):
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world = rank, world
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.sent = self.received = 0

    # -- driver -> every rank ------------------------------------------------------------
    def publish(self, msg: dict) -> None:
        self.store.set(f"m{self.sent}", json.dumps(msg))
        self.sent += 1

    def receive(self, timeout: Optional[timedelta] = None, alive: Callable[[], bool] = lambda: True) -> dict:
        """The next message, in order. ``timeout=None``: wait as long as ``alive()`` holds."""
        key = f"m{self.received}"
        self._wait(key, timeout, alive, "the next message from the driver (rank 0)")
        data = self.store.get(key)
        if self.store.add(f"a{self.received}", 1) == self.world - 1:  # the last reader cleans up
            self.store.delete_key(key)
            self.store.delete_key(f"a{self.received}")
        self.received += 1
        return json.loads(data)

    # -- every rank <-> every rank -------------------------------------------------------
    def post(self, name: str, value) -> None:
        self.store.set(f"v/{name}/{self.rank}", json.dumps(value))

    def read(self, name: str, rank: int, timeout: Optional[timedelta] = None):
        key = f"v/{name}/{rank}"
        self._wait(key, timeout or self.timeout, lambda: True, f"{name!r} from rank {rank}")
        return json.loads(self.store.get(key))

    def exchange(self, name: str, value) -> List:
        """Every rank posts ``value``; returns all ranks' values in rank order. The last rank to
        have read them all deletes the keys, so repeated exchanges (one per call) leave the
        store as it was."""
        self.post(name, value)
        values = [self.read(name, r) for r in range(self.world)]
        if self.store.add(f"x/{name}", 1) == self.world:
            for r in range(self.world):
                self.store.delete_key(f"v/{name}/{r}")
            self.store.delete_key(f"x/{name}")
        return values

    def poll(self, name: str, rank: int):
        """The value ``rank`` posted under ``name``, or None (no wait)."""
        key = f"v/{name}/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _wait(self, key: str, timeout: Optional[timedelta], alive: Callable[[], bool], what: str) -> None:
        while True:  # with no timeout: wait in rounds of POLL while ``alive()``
            try:
                self.store.wait([key], timeout or POLL)
                return
            except Exception as e:  # the store's wait raises on its timeout; the store stays usable
                if "timeout" not in str(e).lower():
                    raise RingTimeoutError(f"rank {self.rank}: the control store failed waiting for {what}: {e}") from e
                if timeout is not None:
                    raise RingTimeoutError(f"rank {self.rank}: no {what} within {timeout.total_seconds():.0f}s "
                                           f"(a rank died, hangs, or called something else)") from None
            if not alive():
                raise RingTimeoutError(f"rank {self.rank}: gave up waiting for {what}: the driver is gone")


def parent_alive(parent_pid: int) -> Callable[[], bool]:
    return lambda: os.getppid() == parent_pid
