"""A real gloo world of N CPU processes, started once and fed cases.

    world = World(4)                      # spawns 4 ranks, gloo over loopback
    results = world.run("tests.ring_cases:forward_backward", 3, args...)   # on ranks 0..2

Each case is a function ``fn(ctx, *args)`` importable by ``"module:function"``; ``ctx`` has
``rank``, ``world`` (the case's size) and ``group`` (a subgroup of the first ``size`` ranks:
SP groups inside a larger world). Every rank of the case must return within ``timeout``;
a rank's exception comes back as a ``RankError`` carrying its type name and message.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.multiprocessing as mp


@dataclass
class Ctx:
    rank: int
    world: int
    group: object


@dataclass
class RankError:
    rank: int
    type: str
    message: str
    trace: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, tasks, results, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("RINGKV_TIMEOUT_S", "60")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    groups = {
        n: (dist.new_group(list(range(n))) if n < size else dist.group.WORLD)
        for n in range(1, size + 1)
    }
    while True:
        task = tasks.get()
        if task is None:
            break
        name, n, args = task
        module, fn = name.split(":")
        try:
            out = getattr(importlib.import_module(module), fn)(Ctx(rank, n, groups[n]), *args)
            results.put((rank, out))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            results.put((rank, RankError(rank, type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


def settled_keys(store) -> int:
    """A key-value store's key count once it stops changing (a slower rank deletes what it read)."""
    last, deadline = store.num_keys(), time.monotonic() + 2
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = store.num_keys()
        if now == last:
            return now
        last = now
    return last


class World:
    def __init__(self, size: int, pg_timeout_s: float = 120.0, context=None):
        ctx = context or mp.get_context(
            "spawn"
        )  # context: e.g. a forkserver that imported torch once
        self.size = size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, size, port, self.tasks[r], self.results, pg_timeout_s),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(self, name: str, n: int, *args, timeout: float = 120.0) -> list:
        """Run case ``name`` on ranks ``0..n-1``; return each rank's result (or RankError)."""
        assert 1 <= n <= self.size
        for r in range(n):
            self.tasks[r].put((name, n, args))
        out = {}
        deadline = time.monotonic() + timeout
        while len(out) < n:
            try:
                rank, result = self.results.get(timeout=1)
            except queue.Empty:
                missing = sorted(set(range(n)) - set(out))
                for r in (
                    missing
                ):  # a rank that died (a fault test killed it) answers with its exit code
                    if not self.procs[r].is_alive() and self.results.empty():
                        out[r] = RankError(r, "died", f"exit code {self.procs[r].exitcode}", "")
                if time.monotonic() > deadline and len(out) < n:
                    raise TimeoutError(
                        f"ranks {missing} did not answer within {timeout}s"
                    ) from None
                continue
            out[rank] = result
        return [out[r] for r in range(n)]

    def check(self, name: str, n: int, *args, timeout: float = 120.0) -> list:
        """Like ``run`` but raise if any rank failed."""
        res = self.run(name, n, *args, timeout=timeout)
        errors = [r for r in res if isinstance(r, RankError)]
        if errors:
            raise AssertionError(
                "\n".join(f"rank {e.rank}: {e.type}: {e.message}\n{e.trace}" for e in errors)
            )
        return res

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def kill(self) -> None:
        """Stop every rank now (a world a fault test left inside a broken collective)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
