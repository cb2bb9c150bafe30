"""``AsyncEngine``: the engine on a thread of its own, fed by asyncio handlers.

The engine is not thread-safe, so one thread owns it: it takes new requests (as token ids)
and aborts from an inbox, runs ``LLM.step()`` while any request is unfinished (continuous
batching across clients: a request added mid-run joins the next step), and hands each
``RequestOutput`` to the asyncio queue of its request. Counters for ``/metrics`` are kept on
the same thread. Tokenizing and chat templating (``LLM.encode``) run on an encoder thread of
their own, so a large prompt does not delay the steps of the requests already running.

The KV connector (peer pull, live migration, the prefix cache's events) is ``serve/connector.py``;
the counters ``serve/metrics.py``; a request's records ``serve/records.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..engine import LLM, RequestOutput, SamplingParams
from .connector import KVConnector, Pull, in_thread
from .metrics import PULL_OUTCOMES, TTFT_BUCKETS, Metrics
from .records import Abort, Busy, EngineDead, Moved, RequestStream, RequestTimeout, Running

# names imported from here before the connector, the metrics and the records had modules
__all__ = [
    "PULL_OUTCOMES",
    "TTFT_BUCKETS",
    "AsyncEngine",
    "Busy",
    "EngineDead",
    "Metrics",
    "Moved",
    "Pull",
    "RequestStream",
    "RequestTimeout",
    "in_thread",
]


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
class Call:
    """Inbox: run ``fn(*args)`` on the engine's thread, its result (or error) in ``future``."""

    fn: Callable
    args: tuple
    future: Future


@dataclass
class Wake:
    """Inbox: look at ``_stop`` (shutting down)."""


class AsyncEngine(KVConnector):
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
        ``pull_policy``: how a pull hint is answered (``KVConnector.init_connector``)."""
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
        self.init_connector(pull_policy)
        if kv_events:
            llm.publish_kv_events()
        # this engine's life: a router that sees another one re-reads its index
        self.epoch = uuid.uuid4().hex
        self.inbox: "queue.Queue" = queue.Queue()
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the server's (set by add / the app)
        self.requests: Dict[str, Running] = {}
        self.metrics = Metrics()
        self.gauges = dict(running=0, waiting=0, kv_usage=0.0, hits=0, queries=0)
        self.info = llm.kv_cache_info()  # refreshed on the engine's thread (its tiers' usage)
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
            if added:
                self.observe(r, out, now)
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

    def observe(self, r: Running, out: RequestOutput, now: float) -> None:
        """``r`` got tokens at ``now``: its first (TTFT, and the prefill rate of its uncached
        prompt tokens) or its next (the inter-token latency since its last)."""
        if r.tokens == 0:
            self.metrics.observe_ttft(now - r.start)
            uncached = len(out.prompt_token_ids) - out.num_cached_tokens
            self.metrics.observe_prefill(uncached, now - r.start)
        elif r.last:
            self.metrics.itl.observe(now - r.last)
        r.last = now

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


def _set(fut: asyncio.Future, error: Optional[BaseException]) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
