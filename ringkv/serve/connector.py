"""The async engine's KV connector: how K/V moves between instances, off the engine's thread.

Other threads run engine calls on the engine's thread with ``call``. Live migration between
instances (``migrate_out`` / ``accept``) runs the protocol of ``engine/remote.py`` on a thread
of its own (the link's waits) while the engine's thread keeps stepping: only the exports and
imports run there. A request that moved out ends its stream with a ``Moved`` item; one that
moved in waits (its outputs buffered) for ``attach`` to take its stream, and is aborted if
nobody does.

Peer pull (issue #44): a request added with a ``Pull`` hint (a router's: another instance holds a
longer prefix of its prompt) may first fetch that prefix's K/V from the holder (``pull_prefix``,
after encoding, before the request is added): the cost model weighs the bytes to move over the
link rate measured on earlier pulls and migrations against the prefill time of those tokens at
the prefill rate measured on earlier requests (uncached prompt tokens / TTFT, EWMAs); unmeasured,
it pulls. This instance listens on a ``Link``, asks the holder (``POST /internal/share``, which
runs ``share`` there) to connect and send ``export_prefix`` over it, and imports what came
(``import_prefix``). Any failure falls back to recomputing: the request is added as usual.

A router reads the prefix cache's changes with ``kv_changes``. ``KVConnector`` is a part of
``AsyncEngine`` (``serve/engine.py``): its methods use the engine's ``call``, ``llm``, ``metrics``,
``info``, ``requests`` and ``loop``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Callable, Dict, List, Optional

from .records import Adopted, EngineDead, Moved, RequestStream, Running

log = logging.getLogger("ringkv.serve")
PULL_TIMEOUT = 10.0  # seconds a peer pull may take in all (the link's waits, the holder's answer)
CALL_TIMEOUT = 60.0  # seconds an engine call made for a pull or a share may wait for its thread
PULL_POLICIES = ("cost", "always")
ATTACH_TIMEOUT = 60.0  # seconds a request that moved in waits to be attached before it is aborted


@dataclass
class Pull:
    """A router's pull hint: the instance at URL ``holder`` holds ``tokens`` of the prompt's
    prefix. This instance listens on ``host`` (its address as the holder reaches it) and asks the
    holder with ``headers`` (its admin key)."""

    holder: str
    tokens: int
    host: str
    headers: dict = field(default_factory=dict)


class KVConnector:
    """Peer pull, live migration and the prefix cache's events of an ``AsyncEngine``."""

    def init_connector(self, pull_policy: Optional[str]) -> None:
        """``pull_policy``: how a pull hint is answered, ``"cost"`` (the cost model) or
        ``"always"`` (default: ``$RINGKV_KV_PULL_POLICY``, else ``"cost"``)."""
        pull_policy = pull_policy or os.environ.get("RINGKV_KV_PULL_POLICY") or "cost"
        if pull_policy not in PULL_POLICIES:
            raise ValueError(f"pull_policy must be one of {PULL_POLICIES}, got {pull_policy!r}")
        self.pull_policy = pull_policy
        self.adopted: Dict[str, Adopted] = {}  # moved in, not attached yet
        self.pulling: Dict[tuple, asyncio.Future] = {}  # (salt, prefix ids) -> its pull's end

    # -- migration between instances (each runs on a thread of its own) ---------------------
    def migrate_out(self, rid: str, host: str, port: int, to: str, timeout: float = 30.0) -> dict:
        """Move running request ``rid`` to the instance ``to`` listening (``accept``) on
        ``host:port``: a pre-copy while it keeps decoding here, then the final snapshot. Its
        stream here then ends with ``Moved(to, rid)``. Raises ``ValueError`` (it cannot move) or
        ``MigrationError`` (it did not move; it runs here again)."""
        from ..engine.remote import send_request
        from ..parallel.transfer import Link

        def check():
            r = self.requests.get(rid)
            if r is None:
                raise ValueError(f"request {rid!r} is not running on this instance")
            if not r.movable:
                raise ValueError(
                    f"request {rid!r} did not come through a router: its client could not follow it"
                )

        self.call(check)
        with Link.connect(host, port, timeout=timedelta(seconds=timeout)) as link:
            stats = send_request(_Source(self, to), rid, link, incremental=True)
        self.metrics.observe_link(stats["bytes"], stats["seconds"])
        return stats

    def accept(
        self,
        host: str,
        timeout: float = 30.0,
        *,
        loop: Optional[asyncio.AbstractEventLoop] = None,
    ) -> int:
        """Listen on ``host`` for one request moving in (``migrate_out`` on another instance);
        returns the port. The request, once imported, waits for ``attach``; its stream's items
        are put on ``loop`` (the caller's running event loop; default: the one of the last
        ``add``)."""
        from ..engine.remote import MigrationError, receive_request
        from ..parallel.transfer import Link, LinkError

        if loop is not None:
            self.loop = loop
        link = Link.listen(host, 0, timeout=timedelta(seconds=timeout))

        def run():
            try:
                with link:
                    link.accept()
                    receive_request(_Target(self), link)
            except (MigrationError, LinkError, EngineDead, ValueError):
                pass  # the source keeps the request; nothing is left here

        threading.Thread(target=run, name="ringkv-migrate-in", daemon=True).start()
        return link.port

    def attach(self, rid: str) -> "RequestStream":
        """The stream of a request that moved in (``KeyError`` if there is none to attach)."""
        return self.adopted.pop(rid).stream

    def _export(self, rid, kw: dict):
        snap = self.llm.export_request(rid, **kw)
        if kw.get("stop"):  # what a PP drain computed before the stop: to its client
            self._deliver([self.llm.request_output(rid, delta=True)])
        return snap

    def _moved(self, rid, to: str) -> None:
        self.llm.abort_request(rid)
        r = self.requests.pop(rid, None)
        self.metrics.migrations_out += 1
        if r is not None:
            r.loop.call_soon_threadsafe(r.queue.put_nowait, Moved(to, rid))

    def _import(self, snap, kw: dict):
        rid = self.llm.import_request(snap, **kw)
        if snap.final:  # it runs here now: buffer its outputs until its client attaches
            stream = RequestStream(self, rid)
            # tokens=1: its first token was timed where it started
            self.requests[rid] = Running(
                self.loop, stream.queue, time.perf_counter(), tokens=1, movable=True
            )
            self.adopted[rid] = Adopted(stream, time.monotonic() + ATTACH_TIMEOUT)
            self.metrics.migrations_in += 1
        return rid

    def _drop(self, rid) -> None:
        self.llm.abort_request(rid)
        self.requests.pop(rid, None)
        self.adopted.pop(rid, None)

    def _reap(self) -> None:
        """Abort what moved in and was never attached (its router went away)."""
        now = time.monotonic()
        for rid in [rid for rid, a in self.adopted.items() if a.deadline < now]:
            self._drop(rid)

    # -- peer pull (each side's waits off the engine's thread) ----------------------------
    def kv_bytes_per_token(self) -> float:
        """K/V bytes one prompt token moves: measured on the last pulled prefix, else this
        engine's (every rank's bytes per token, each token held by one of the ``sp`` ranks)."""
        if self.metrics.kv_bytes_per_token:
            return self.metrics.kv_bytes_per_token
        info = self.info
        ranks = info.get("per_rank") or []
        total = sum(r.get("bytes_per_token", 0) for r in ranks) / max(info.get("sp", 1), 1)
        return total or float(info.get("bytes_per_token", 0))

    def worth_pulling(self, tokens: int) -> bool:
        """The cost model: a pull's set-up (asking the holder, joining its link) plus moving
        ``tokens`` tokens' K/V at the measured link rate takes less time than prefilling them at
        the measured prefill rate (either unmeasured, or the ``"always"`` policy: pull). The
        set-up and the rate are measured apart, so that a first small pull (mostly set-up) does
        not make every larger one look slow."""
        m = self.metrics
        if self.pull_policy == "always" or m.link_rate is None or m.prefill_rate is None:
            return True
        move = (m.link_setup or 0.0) + tokens * self.kv_bytes_per_token() / m.link_rate
        return move < tokens / m.prefill_rate

    async def _engine_call(self, fn: Callable, *args):
        """``fn(*args)`` on the engine's thread, awaited from the event loop (bounded)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, partial(self.call, fn, *args, timeout=CALL_TIMEOUT))

    async def pull_prefix(self, ids: List[int], salt, pull: Pull) -> str:
        """Decide and (maybe) pull the prefix of prompt ``ids`` (``cache_salt`` ``salt``) that
        ``pull.holder`` holds; returns the outcome counted in ``metrics.pulls``: ``"pull"`` (this
        instance now holds more of it), ``"recompute"`` (nothing to gain, or the cost model says
        prefilling is faster) or ``"failed"`` (the pull failed: the request recomputes). Never
        raises (but ``CancelledError``); every wait is bounded by ``PULL_TIMEOUT``. Requests
        hinted the same prefix at once wait for the first one's pull, then decide (it is held:
        nothing to gain)."""
        key = (salt, tuple(ids[: pull.tokens]))
        first = self.pulling.get(key)
        if first is not None:  # the same prefix is on its way
            await asyncio.wait({first}, timeout=PULL_TIMEOUT)
        mine = first is None
        if mine:
            self.pulling[key] = asyncio.get_running_loop().create_future()
        try:
            outcome = await asyncio.wait_for(self._pull(ids, salt, pull), PULL_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - any failure: the request recomputes the prefix
            outcome = "failed"
            self.metrics.pull_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("ringkv: pulling a prefix from %s failed: %s", pull.holder, e)
        finally:
            if mine:
                self.pulling.pop(key).set_result(None)
        self.metrics.pulls[outcome] += 1
        return outcome

    async def _pull(self, ids: List[int], salt, pull: Pull) -> str:
        import httpx

        from ..parallel.transfer import Link

        held = await self._engine_call(self.llm.cached_tokens, ids, salt)
        lacking = min(pull.tokens, len(ids)) - held
        if lacking < self.info["tokens_per_block"] or not self.worth_pulling(lacking):
            return "recompute"
        link = Link.listen(pull.host, 0, timeout=timedelta(seconds=PULL_TIMEOUT))
        receiving = False
        try:
            body = {"host": pull.host, "port": link.port, "token_ids": ids, "cache_salt": salt}
            t0 = time.perf_counter()
            async with httpx.AsyncClient(timeout=PULL_TIMEOUT) as client:
                r = await client.post(
                    pull.holder.rstrip("/") + "/internal/share", json=body, headers=pull.headers
                )
            if r.status_code != 200:
                raise RuntimeError(f"the holder refused ({r.status_code}): {r.text[:200]}")
            receiving = True  # the receiving thread closes the link
            prefix, joined = await in_thread(self._receive, link)
            end = time.perf_counter()
        finally:
            if not receiving:
                link.close()
        now = await self._engine_call(self.llm.import_prefix, prefix)
        m = self.metrics
        m.observe_setup(joined - t0)
        m.observe_link(prefix.nbytes, end - joined)
        if prefix.token_ids:
            m.kv_bytes_per_token = prefix.nbytes / len(prefix.token_ids)
        m.pulled_bytes += prefix.nbytes
        if now <= held:
            raise RuntimeError(f"no block of the pulled prefix fit ({held} tokens held before)")
        m.pulled_tokens += now - held
        return "pull"

    @staticmethod
    def _receive(link):
        """Wait for the holder on ``link`` and receive its prefix; the link is closed after.
        Returns the prefix and ``perf_counter()`` when the holder joined."""
        from ..engine.remote import recv_prefix

        with link:
            link.accept()
            joined = time.perf_counter()
            return recv_prefix(link, "a cached prefix from the holder"), joined

    def share(self, host: str, port: int, ids: List[int], salt=None) -> int:
        """A peer pulls: connect to its link on ``host:port`` and send the K/V of the longest
        prefix of ``ids`` (salt ``salt``) this engine holds (``export_prefix``), on a thread of
        its own; returns the prefix tokens it holds at once. Raises ``ValueError`` if it holds
        none. Blocking: call it off the event loop."""
        from ..engine.remote import send_prefix
        from ..parallel.transfer import Link

        held = self.call(self.llm.cached_tokens, ids, salt, timeout=CALL_TIMEOUT)
        if held <= 0:
            raise ValueError("this instance holds no cached prefix of the prompt")

        def run():
            try:
                with Link.connect(host, port, timeout=timedelta(seconds=PULL_TIMEOUT)) as link:
                    try:
                        prefix = self.call(self.llm.export_prefix, ids, salt, timeout=CALL_TIMEOUT)
                    except Exception as e:  # noqa: BLE001 - told to the puller
                        prefix, error = None, f"{type(e).__name__}: {e}"
                    else:
                        error = "the prefix is no longer held here"
                    if prefix is None:
                        link.send_json({"ok": False, "error": error})
                        return
                    self.metrics.shared_bytes += send_prefix(link, prefix)
                    self.metrics.shared += 1
            except Exception:  # noqa: BLE001 - the puller's side fails too and recomputes
                pass

        threading.Thread(target=run, name="ringkv-share", daemon=True).start()
        return held

    def kv_changes(self, after: int, epoch: str) -> Optional[dict]:
        """The prefix cache's changes for a router, or None if this engine does not publish them
        (``kv_events=False``): ``{"last": number of the last event, "events": [[kind, hex hash],
        ...] after event ``after``, "full": None}`` (kind: ``STORED`` on the device, ``HOST`` or
        ``DISK``: best held in that tier now, ``REMOVED``: held nowhere), or, when those events
        are gone or ``epoch`` is not this engine's (it restarted), ``"events": []`` and
        ``"full"``: the whole index, ``[[hex hash, tier], ...]``. A hybrid model's adds
        ``"snapshots": {"events": [[kind, hex hash], ...], "full": None or [[hex hash, tier],
        ...]}``, its state snapshots under the hash of the block each ends, in the same shapes
        (numbered with the blocks' events: ``last`` counts both; ``full`` when the blocks' is);
        a dense model's has no ``"snapshots"``. Blocking (the index is read on the engine's
        thread): call it off the event loop."""
        events = self.llm.kv_events
        if events is None:
            return None
        full = snaps = None
        last, new = events.since(after) if epoch == self.epoch else (events.last, None)
        if new is None:  # the whole index, read on the engine's thread (where it changes)
            last, full, snaps = self.call(
                lambda: (events.last, self.llm.cached_blocks(), self.llm.cached_snapshots())
            )
            new = []
        out = {"last": last, "events": _events(new, snapshots=False), "full": _index(full)}
        if self.info.get("state") is not None:  # a hybrid model
            out["snapshots"] = {"events": _events(new, snapshots=True), "full": _index(snaps)}
        return out


def _events(log: List[tuple], snapshots: bool) -> List[list]:
    """``KVEvents`` entries (a block's ``(number, kind, hash)``, a snapshot's ``(number, kind,
    hash, SNAPSHOT)``) of blocks or of snapshots, as ``[[kind, hex hash], ...]``."""
    return [[kind, h.hex()] for _, kind, h, *snap in log if bool(snap) == snapshots]


def _index(held: Optional[List[tuple]]) -> Optional[List[list]]:
    """A whole index, ``(hash, tier)`` pairs, as ``[[hex hash, tier], ...]`` (None stays)."""
    return None if held is None else [[h.hex(), tier] for h, tier in held]


class _Source:
    """The engine calls ``send_request`` makes, on the engine's thread; a move ends the stream."""

    def __init__(self, engine, to: str):
        self.engine, self.to = engine, to

    def export_request(self, rid, **kw):
        return self.engine.call(self.engine._export, rid, kw)

    def resume_request(self, rid):
        return self.engine.call(self.engine.llm.resume_request, rid)

    def abort_request(self, rid):  # the target has it
        return self.engine.call(self.engine._moved, rid, self.to)


class _Target:
    """The engine calls ``receive_request`` makes, on the engine's thread."""

    def __init__(self, engine):
        self.engine = engine

    def import_request(self, snap, **kw):
        return self.engine.call(self.engine._import, snap, kw)

    def abort_request(self, rid):  # not received after all
        return self.engine.call(self.engine._drop, rid)


async def in_thread(fn, *args):
    """``fn(*args)`` on a daemon thread of its own, awaited (a migration's or a pull's waits
    never hold the process open at exit, as the default executor's threads would)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=run, name="ringkv-link", daemon=True).start()
    return await future
