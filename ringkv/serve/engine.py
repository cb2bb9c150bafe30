"""``AsyncEngine``: the engine on a thread of its own, fed by asyncio handlers.

The engine is not thread-safe, so one thread owns it: it takes new requests (as token ids)
and aborts from an inbox, runs ``LLM.step()`` while any request is unfinished (continuous
batching across clients: a request added mid-run joins the next step), and hands each
``RequestOutput`` to the asyncio queue of its request. Counters for ``/metrics`` are kept on
the same thread. Tokenizing and chat templating (``LLM.encode``) run on an encoder thread of
their own, so a large prompt does not delay the steps of the requests already running.

Other threads run engine calls on its thread with ``call``. Live migration between instances
(``migrate_out`` / ``accept``) runs the protocol of ``engine/remote.py`` on a thread of its own
(the link's waits) while the engine's thread keeps stepping: only the exports and imports run
there. A request that moved out ends its stream with a ``Moved`` item; one that moved in waits
(its outputs buffered) for ``attach`` to take its stream, and is aborted if nobody does.

Peer pull (issue #44): a request added with a ``Pull`` hint (a router's: another instance holds a
longer prefix of its prompt) may first fetch that prefix's K/V from the holder (``pull_prefix``,
after encoding, before the request is added): the cost model weighs the bytes to move over the
link rate measured on earlier pulls and migrations against the prefill time of those tokens at
the prefill rate measured on earlier requests (uncached prompt tokens / TTFT, EWMAs); unmeasured,
it pulls. This instance listens on a ``Link``, asks the holder (``POST /internal/share``, which
runs ``share`` there) to connect and send ``export_prefix`` over it, and imports what came
(``import_prefix``). Any failure falls back to recomputing: the request is added as usual.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Callable, Dict, List, Optional

from ..engine import LLM, RequestOutput, SamplingParams

log = logging.getLogger("ringkv.serve")
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PULL_TIMEOUT = 10.0  # seconds a peer pull may take in all (the link's waits, the holder's answer)
CALL_TIMEOUT = 60.0  # seconds an engine call made for a pull or a share may wait for its thread
EWMA = 0.3  # weight of the newest measurement of the link and prefill rates
PULL_OUTCOMES = ("pull", "recompute", "failed")
PULL_POLICIES = ("cost", "always")


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft_buckets: List[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    migrations_in: int = 0
    migrations_out: int = 0
    rejected: int = 0  # 429s (max_waiting)
    recent: deque = field(default_factory=deque)  # (time, tokens) of the last steps, for tokens/s
    # peer pull: hints by outcome (PULL_OUTCOMES), what came in, what went out to pullers
    pulls: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(PULL_OUTCOMES, 0))
    pulled_tokens: int = 0  # prompt tokens this instance holds more thanks to pulls
    pulled_bytes: int = 0
    shared: int = 0  # prefixes sent to pulling peers
    shared_bytes: int = 0
    pull_error: Optional[str] = None  # why the last failed pull failed
    link_rate: Optional[float] = None  # bytes/s of pulls and migrations (EWMA); None: unmeasured
    link_setup: Optional[float] = None  # seconds before a pull's first byte (EWMA): ask, join
    prefill_rate: Optional[float] = None  # uncached prompt tokens / TTFT (EWMA), tokens/s
    kv_bytes_per_token: Optional[float] = None  # of a pulled prefix (measured)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, b in enumerate(TTFT_BUCKETS):
            if seconds <= b:
                self.ttft_buckets[i] += 1

    def observe_link(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` took ``seconds``: the link rate's EWMA."""
        if nbytes > 0 and seconds > 0:
            self.link_rate = _ewma(self.link_rate, nbytes / seconds)

    def observe_setup(self, seconds: float) -> None:
        """A pull's holder was asked and its link joined after ``seconds``."""
        self.link_setup = _ewma(self.link_setup, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request's ``tokens`` uncached prompt tokens gave its first token after ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate = _ewma(self.prefill_rate, tokens / seconds)


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class Pull:
    """A router's pull hint: the instance at URL ``holder`` holds ``tokens`` of the prompt's
    prefix. This instance listens on ``host`` (its address as the holder reaches it) and asks the
    holder with ``headers`` (its admin key)."""

    holder: str
    tokens: int
    host: str
    headers: dict = field(default_factory=dict)


@dataclass
class Add:
    """Inbox: admit a request (its prompt already encoded) and reply on ``added``."""

    rid: str
    ids: List[int]
    params: SamplingParams
    settings: dict  # add_request's keywords (cache_salt)
    loop: asyncio.AbstractEventLoop
    added: asyncio.Future  # set (None or the error) once the engine took it
    queue: asyncio.Queue  # its outputs
    movable: bool = False


@dataclass
class Running:
    """A request the engine's thread is serving."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    start: float  # perf_counter() when it was added
    tokens: int = 0  # output tokens delivered so far
    movable: bool = False  # its client follows a move (a router): it may migrate


@dataclass
class Adopted:
    """A request that moved in: its stream waits for ``attach`` until ``deadline``
    (``time.monotonic()``), then the request is aborted."""

    stream: "RequestStream"
    deadline: float


@dataclass
class Moved:
    """A stream's last item: the request now runs on instance ``to`` (``attach`` there)."""

    to: str
    request_id: str


@dataclass
class Call:
    """Inbox: run ``fn(*args)`` on the engine's thread, its result (or error) in ``future``."""

    fn: Callable
    args: tuple
    future: Future


@dataclass
class Abort:
    """Inbox: stop a request (its client went away)."""

    rid: str


@dataclass
class Wake:
    """Inbox: look at ``_stop`` (shutting down)."""


class EngineDead(RuntimeError):
    """The engine failed (a rank died); requests cannot be served."""


class Busy(RuntimeError):
    """The waiting queue is full (``max_waiting``): try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(RuntimeError):
    """A request ran past ``request_timeout``; it was aborted and its blocks freed."""


ATTACH_TIMEOUT = 60.0  # seconds a request that moved in waits to be attached before it is aborted


class AsyncEngine:
    def __init__(
        self,
        llm: LLM,
        *,
        kv_events: bool = False,
        max_waiting: Optional[int] = None,
        request_timeout: Optional[float] = None,
        pull_policy: Optional[str] = None,
    ):
        """``kv_events``: publish the prefix cache's changes (``kv_changes``) for a router.
        ``max_waiting``: requests past that many waiting get ``Busy``; ``request_timeout``:
        seconds after which a request is aborted (its stream ends with ``RequestTimeout``).
        ``pull_policy``: how a pull hint is answered, ``"cost"`` (the cost model) or
        ``"always"`` (default: ``$RINGKV_KV_PULL_POLICY``, else ``"cost"``)."""
        pull_policy = pull_policy or os.environ.get("RINGKV_KV_PULL_POLICY") or "cost"
        if pull_policy not in PULL_POLICIES:
            raise ValueError(f"pull_policy must be one of {PULL_POLICIES}, got {pull_policy!r}")
        self.pull_policy = pull_policy
        for name, v in (("max_waiting", max_waiting), ("request_timeout", request_timeout)):
            if v is not None and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or v <= 0
                or name == "max_waiting"
                and not isinstance(v, int)
            ):
                raise ValueError(
                    f"{name} must be a positive "
                    f"{'int' if name == 'max_waiting' else 'number'}, got {v!r}"
                )
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        # requests on their way to the engine's thread (the asyncio side counts them)
        self.pending = 0
        self.llm = llm
        if kv_events:
            llm.publish_kv_events()
        self.adopted: Dict[str, Adopted] = {}  # moved in, not attached yet
        # this engine's life: a router that sees another one re-reads its index
        self.epoch = uuid.uuid4().hex
        self.inbox: "queue.Queue" = queue.Queue()
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the server's (set by add / the app)
        self.requests: Dict[str, Running] = {}
        self.metrics = Metrics()
        self.gauges = dict(running=0, waiting=0, kv_usage=0.0, hits=0, queries=0)
        self.info = llm.kv_cache_info()  # refreshed on the engine's thread (its tiers' usage)
        self.pulling: Dict[tuple, asyncio.Future] = {}  # (salt, prefix ids) -> its pull's end
        self._info_at = time.monotonic()
        self.dead: Optional[str] = None
        self._ids = itertools.count()
        self._stop = False
        # one worker: HF tokenizers are not guaranteed safe for concurrent encodes
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="ringkv-encode")
        self.thread = threading.Thread(target=self._run, name="ringkv-engine", daemon=True)
        self.thread.start()

    # -- asyncio side ----------------------------------------------------------------------
    async def add(
        self,
        prompt,
        params: SamplingParams,
        *,
        apply_chat_template: bool = False,
        request_id: Optional[str] = None,
        pull: Optional[Pull] = None,
        **kw,
    ) -> "RequestStream":
        """Queue a request (a string, token ids or chat messages); raises ``ValueError`` if it
        is invalid (nothing was added). The prompt is encoded on the encoder thread and the
        engine's thread gets token ids. The returned stream yields a *delta*
        ``RequestOutput`` (the new token of each sample) after every step that advanced the
        request; ``aclose()`` aborts it and frees its blocks. ``request_id`` names it (a router's
        id; it may then migrate), else it gets one. ``pull``: a peer holds a longer prefix of the
        prompt (``pull_prefix`` runs before the request is added; it never fails the request)."""
        if self.dead:
            raise EngineDead(self.dead)
        if self.max_waiting is not None and self.queued() >= self.max_waiting:
            self.metrics.rejected += 1
            raise Busy(
                f"the server is busy: {self.max_waiting} requests are waiting (--max-waiting); "
                "retry later",
                retry_after=1,
            )
        self.pending += 1
        try:
            return await self._enqueue(prompt, params, apply_chat_template, request_id, kw, pull)
        finally:
            self.pending -= 1

    def queued(self) -> int:
        """Requests that will wait: those waiting or on their way in, less the free running
        slots."""
        g, slots = self.gauges, self.llm.engine_config.max_num_seqs
        return g["waiting"] + self.pending - max(0, slots - g["running"])

    async def _enqueue(
        self, prompt, params, apply_chat_template, request_id, kw, pull=None
    ) -> "RequestStream":
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(
                self.encoder, self.llm.encode, prompt, apply_chat_template
            )
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a chat template that refuses the messages
            raise ValueError(f"the prompt could not be encoded: {type(e).__name__}: {e}") from e
        if pull is not None:
            await self.pull_prefix(ids, kw.get("cache_salt"), pull)
        added: asyncio.Future = loop.create_future()
        stream = RequestStream(self, request_id or f"req-{next(self._ids)}")
        self.loop = loop
        self.inbox.put(
            Add(
                stream.id,
                ids,
                params,
                kw,
                loop,
                added,
                stream.queue,
                movable=request_id is not None,
            )
        )
        await added
        return stream

    def call(self, fn: Callable, *args, timeout: Optional[float] = None):
        """``fn(*args)`` on the engine's thread (from any other thread): its result, or its
        error."""
        if self.dead:
            raise EngineDead(self.dead)
        future: Future = Future()
        self.inbox.put(Call(fn, args, future))
        return future.result(timeout)

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
        ``"full"``: the whole index, ``[[hex hash, tier], ...]``. Blocking (the index is read on
        the engine's thread): call it off the event loop."""
        events = self.llm.kv_events
        if events is None:
            return None
        full = None
        last, new = events.since(after) if epoch == self.epoch else (events.last, None)
        if new is None:  # the whole index, read on the engine's thread (where it changes)
            last, full = self.call(
                lambda: (events.last, [[h.hex(), t] for h, t in self.llm.cached_blocks()])
            )
            new = []
        return {"last": last, "events": [[kind, h.hex()] for _, kind, h in new], "full": full}

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

    def _expire(self) -> None:
        """Abort the requests that ran past ``request_timeout``."""
        now = time.perf_counter()
        for rid in [
            rid for rid, r in self.requests.items() if now - r.start > self.request_timeout
        ]:
            r = self.requests.pop(rid)
            self.llm.abort_request(rid)
            self.metrics.finished["timeout"] = self.metrics.finished.get("timeout", 0) + 1
            r.loop.call_soon_threadsafe(
                r.queue.put_nowait,
                RequestTimeout(
                    f"the request ran longer than {self.request_timeout:g} s "
                    "(--request-timeout); it was aborted"
                ),
            )
            self._update_gauges()  # /metrics shows it gone before its client reads the end

    def _reap(self) -> None:
        """Abort what moved in and was never attached (its router went away)."""
        now = time.monotonic()
        for rid in [rid for rid, a in self.adopted.items() if a.deadline < now]:
            self._drop(rid)

    def shutdown(self) -> None:
        self._stop = True
        self.inbox.put(Wake())
        self.thread.join(timeout=30)
        self.encoder.shutdown(wait=False, cancel_futures=True)

    # -- the engine's thread ----------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        while not self._stop:
            try:
                self._drain(block=not llm.has_unfinished_requests())
                if self._stop:
                    break
                if llm.has_unfinished_requests():
                    outs = llm.step(delta=True)
                    self._deliver(outs)
                self._update_gauges()
                if self.adopted:
                    self._reap()
                if self.request_timeout is not None and self.requests:
                    self._expire()
            except Exception as e:  # noqa: BLE001 - the engine is gone: fail every request, keep answering
                self.dead = f"{type(e).__name__}: {e}"
                for r in list(self.requests.values()):
                    r.loop.call_soon_threadsafe(r.queue.put_nowait, EngineDead(self.dead))
                self.requests.clear()
                while not self._stop:  # reject what still comes in
                    self._drain(block=True)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(msg, Add):
                self._add(msg)
            elif isinstance(msg, Call):
                if msg.future.set_running_or_notify_cancel():
                    try:
                        msg.future.set_result(msg.fn(*msg.args))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        msg.future.set_exception(e)
            elif isinstance(msg, Abort) and msg.rid in self.requests:
                del self.requests[msg.rid]
                self.llm.abort_request(msg.rid)
                self.metrics.finished["abort"] = self.metrics.finished.get("abort", 0) + 1

    def _add(self, m: Add) -> None:
        if self.dead:
            m.loop.call_soon_threadsafe(_set, m.added, EngineDead(self.dead))
            return
        try:
            self.llm.add_request(m.ids, m.params, request_id=m.rid, **m.settings)
        except Exception as e:  # noqa: BLE001 - an invalid request fails alone
            m.loop.call_soon_threadsafe(_set, m.added, e)
            return
        self.requests[m.rid] = Running(m.loop, m.queue, time.perf_counter(), movable=m.movable)
        self.metrics.prompt_tokens += len(m.ids)
        m.loop.call_soon_threadsafe(_set, m.added, None)

    def _deliver(self, outs: List[RequestOutput]) -> None:
        now, new = time.perf_counter(), 0
        for out in outs:  # delta outputs: each holds the tokens new since the last step
            r = self.requests.get(out.request_id)
            if r is None:
                continue
            added = sum(len(o.token_ids) for o in out.outputs)
            if r.tokens == 0 and added:
                self.metrics.observe_ttft(now - r.start)
                uncached = len(out.prompt_token_ids) - out.num_cached_tokens
                self.metrics.observe_prefill(uncached, now - r.start)
            new += added
            r.tokens += added
            if out.finished:
                del self.requests[out.request_id]
                reason = out.finish_reason or "unknown"
                self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
            r.loop.call_soon_threadsafe(r.queue.put_nowait, out)
        self.metrics.generation_tokens += new
        self.metrics.recent.append((now, new))
        while self.metrics.recent and now - self.metrics.recent[0][0] > 10:
            self.metrics.recent.popleft()

    def _update_gauges(self) -> None:
        self.gauges = self.llm.load()
        if time.monotonic() - self._info_at > 0.5:  # its tiers' usage, for /metrics
            self.info, self._info_at = self.llm.kv_cache_info(), time.monotonic()

    def tokens_per_second(self) -> float:
        recent = list(self.metrics.recent)
        if len(recent) < 2:
            return 0.0
        span = recent[-1][0] - recent[0][0]
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0


class _Source:
    """The engine calls ``send_request`` makes, on the engine's thread; a move ends the stream."""

    def __init__(self, engine: AsyncEngine, to: str):
        self.engine, self.to = engine, to

    def export_request(self, rid, **kw):
        return self.engine.call(self.engine._export, rid, kw)

    def resume_request(self, rid):
        return self.engine.call(self.engine.llm.resume_request, rid)

    def abort_request(self, rid):  # the target has it
        return self.engine.call(self.engine._moved, rid, self.to)


class _Target:
    """The engine calls ``receive_request`` makes, on the engine's thread."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def import_request(self, snap, **kw):
        return self.engine.call(self.engine._import, snap, kw)

    def abort_request(self, rid):  # not received after all
        return self.engine.call(self.engine._drop, rid)


class RequestStream:
    """The outputs of one request, as an async iterator."""

    def __init__(self, engine: AsyncEngine, rid: str):
        self.engine, self.id = engine, rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self.queue.get()
        if isinstance(out, BaseException):
            self.done = True
            raise out
        if isinstance(out, Moved):
            self.done = True
            return out
        self.done = out.finished
        return out

    async def aclose(self) -> None:
        """Abort the request unless it finished (a client that went away)."""
        if not self.done:
            self.done = True
            self.engine.inbox.put(Abort(self.id))


def _set(fut: asyncio.Future, error: Optional[BaseException]) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


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
