"""A front over many ``ringkv serve`` instances: KV-aware routing, live migration, failover.

``ringkv serve --replicas N`` starts N instances on this host and this front; ``ringkv router
--upstream URL ...`` puts the same front before instances started anywhere (with ``--admin``
or the same ``--admin-key``). Clients see the OpenAI API of one ``ringkv serve``.

- **Index and routing** (``serve/policy.py``). Each instance publishes its prefix cache's block
  events (``GET /internal/state``; a hybrid model's, its state snapshots' too); the front polls
  them into one index (a new ``epoch``, the instance restarted, or a gap re-reads the instance's
  whole index) and sends each prompt (tokenized once, by an instance's ``/tokenize``) where its
  cached prefix is worth most (a hybrid's: up to the deepest snapshot it resumes from).
- **Pull hint.** When the chosen instance holds fewer prefix tokens (any tier) than the best
  holder by at least one of its logical blocks, the sub-request carries
  ``x-ringkv-pull: <holder URL> <tokens>``; the instance (which honours it from an admin only)
  decides by its cost model whether to pull those blocks from the holder before it adds the
  request (``AsyncEngine.pull_prefix``). ``--no-kv-pull`` sends no hints.
- **Requests** (``serve/upstream.py``). A client request is split into one sub-request (``Sub``)
  per prompt, always streamed from the instance (``return_token_ids``), so the front knows every
  token each choice got; a broken stream's choices go on elsewhere (failover).
- **Migration** (Llumnix-style, ``POST /admin/migrate`` or automatic when the instances' load,
  ``max(kv usage, requests in flight / max_num_seqs)``, differs by more than ``threshold``):
  the target listens, the source sends a pre-copy while the request keeps decoding and then
  the final snapshot; the source's stream ends with ``ringkv_moved`` and the front attaches to
  the target's stream. The client's stream goes on with no gap and no duplicate.
- **Replicas** (``serve/replicas.py``): the instances ``--replicas`` starts here, restarted
  when they exit.

This module holds the ``Router`` (the instances, their polls, migrations) and the front's app
(``ServingRouter``, ``build_router_app``, ``run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import tempfile
import threading
import time
from typing import AsyncIterator, Dict, List, Optional
from urllib.parse import urlparse

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cache.block_manager import STORED
from .app import MIGRATION_TIMEOUT, admin_posts, check_admin, migration_timeout, openai_app
from .metrics import RouterCollector, exposition, registry
from .openai import ADMIN_HEADER, INSTANCE_HEADER, MAX_REQUEST_BYTES, PULL_HEADER, BadRequest
from .openai import Encoder, RoutedRequest, completion_id, error_event, fold, merge, parse_json
from .openai import read_body, response, stream_frame, unless_disconnected, usage
from .policy import DOWN_AFTER, POLL_S, ROUTINGS, Instance, InstanceState, NoInstance
from .policy import RoutingPolicy, index
from .replicas import Terminated, free_port, new_key, on_sigterm, start_replicas, stop_replicas
from .replicas import supervise
from .upstream import Attempt, Delta, Failure, Sub, httpx_module

# names imported from here before serve/ was split by concern (tests, benchmarks, the CLI)
__all__ = [
    "PULL_HEADER",
    "Delta",
    "Failure",
    "Instance",
    "NoInstance",
    "Router",
    "ServingRouter",
    "Sub",
    "build_router_app",
    "free_port",
    "new_key",
    "run",
]

MIN_LEFT = 16  # the load policy moves only requests with this many tokens or more left
MOVE_EVERY = 10.0  # ... and each at most once in this many seconds


class Router(RoutingPolicy):
    """The front's state: the instances (``Instance``), their polls, the routing policy
    (``RoutingPolicy``), the sub-requests streaming now (``Sub``) and migrations."""

    def __init__(
        self,
        *,
        routing: str = "kv",
        migration: bool = True,
        threshold: float = 0.1,
        balance: int = 16,
        kv_pull: bool = True,
        admin: bool = False,
        admin_key: Optional[str] = None,
        upstream_key: Optional[str] = None,
        restart: bool = True,
        api_key: Optional[str] = None,
        protect_metrics: bool = False,
    ):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if not threshold > 0:
            raise ValueError(f"the migration threshold must be > 0, got {threshold!r}")
        if balance < 0:
            raise ValueError(f"balance must be >= 0, got {balance!r}")
        self.routing, self.migration = routing, migration
        self.threshold, self.balance, self.kv_pull = threshold, balance, kv_pull
        self.admin, self.admin_key = admin or admin_key is not None, admin_key
        self.upstream_key, self.restart = upstream_key, restart
        # the clients' key, also sent to the instances
        self.api_key, self.protect_metrics = api_key, protect_metrics
        self.instances: List[Instance] = []
        self.by_id: Dict[str, Instance] = {}
        self.subs: Dict[str, List[Sub]] = {}  # client request id -> its sub-requests (running)
        self.rr = itertools.count()
        self.client = None
        self.counters = dict(
            migrations=0, migration_failures=0, auto_migrations=0, requests=0, failed_requests=0
        )
        self.tasks: List[asyncio.Task] = []
        self.moving: set = set()  # instances a migration is leaving from now
        self.rebalancing: Optional[asyncio.Task] = None
        self.fatal: Optional[str] = None  # why the front stopped by itself
        self.server = None  # the uvicorn server (run)

    # -- instances -------------------------------------------------------------------------
    def add(self, url: str, id: Optional[str] = None, proc=None, argv=None) -> Instance:
        url = url.rstrip("/")
        p = urlparse(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"an instance URL must be http(s)://host:port, got {url!r}")
        if any(i.url == url for i in self.instances):
            raise ValueError(f"instance {url} is already known")
        id = id or f"u{len(self.instances)}"
        if id in self.by_id:
            raise ValueError(f"instance id {id!r} is already in use")
        inst = Instance(id, url, proc=proc, argv=argv)
        self.instances.append(inst)
        self.by_id[id] = inst
        return inst

    def up(self) -> List[Instance]:
        """The instances requests may go to."""
        return [i for i in self.instances if i.state == InstanceState.UP]

    def remove(self, inst: Instance) -> None:
        self.instances.remove(inst)
        del self.by_id[inst.id]
        if inst.proc is not None and inst.proc.poll() is None:
            inst.proc.terminate()

    def lost(self, inst: Instance, why: str) -> None:
        """A stream from ``inst`` broke: unless it answers at once, it is down."""
        if inst.proc is not None and inst.proc.poll() is not None:
            self.down(inst, f"its process exited ({inst.proc.returncode})")
        else:
            inst.failed_polls = max(inst.failed_polls, DOWN_AFTER - 1)  # the next one: down
            inst.error = why

    def down(self, inst: Instance, why: str) -> None:
        if inst.state != InstanceState.DRAINING:
            inst.state = InstanceState.DOWN
        inst.error, inst.blocks, inst.epoch, inst.last = why, {}, "", 0
        inst.snapshots = None

    def headers(self) -> dict:
        h = {} if self.upstream_key is None else {ADMIN_HEADER: self.upstream_key}
        return h if self.api_key is None else dict(h, authorization=f"Bearer {self.api_key}")

    @contextlib.asynccontextmanager
    async def open(self, method: str, url: str, payload, extra: dict):
        req = self.client.build_request(method, url, json=payload, headers=self.headers() | extra)
        resp = await self.client.send(req, stream=True)
        try:
            yield resp
        finally:
            await resp.aclose()

    async def poll(self, inst: Instance) -> None:
        if supervise(self, inst):  # a replica whose process exited
            return
        sent = time.time()
        try:
            r = await self.client.get(
                f"{inst.url}/internal/state",
                params={"after": inst.last, "epoch": inst.epoch},
                headers=self.headers(),
                timeout=2.0,
            )
            state = r.json()
            if r.status_code == 503 and state.get("status") == "starting":  # serve/starting.py
                if inst.state == InstanceState.UP:  # restarted behind our back: its index is gone
                    self.down(inst, "restarted")
                inst.failed_polls, inst.error = 0, state["error"]["message"][:300]
                return  # neither up nor dead: its engine is being built
            if r.status_code == 503 or state.get("dead"):  # its engine failed: it stays so
                self.down(
                    inst, f"its engine failed: {state.get('dead') or state.get('error')}"[:300]
                )
                if inst.proc is not None and inst.proc.poll() is None:
                    inst.proc.terminate()  # a replica of this front: started again once it exited
                return
            if r.status_code != 200:
                raise RuntimeError((state.get("error") or {}).get("message", r.text[:200]))
        except Exception as e:  # noqa: BLE001 - unreachable, refused, or not an instance
            inst.failed_polls += 1
            why = f"{type(e).__name__}: {e}"[:300]
            if (
                inst.state in (InstanceState.UP, InstanceState.DRAINING)
                and inst.failed_polls >= DOWN_AFTER
            ):
                self.down(inst, why)
            inst.error = why
            return
        inst.failed_polls, inst.last_ok = 0, sent
        snaps = state.get("snapshots")  # a hybrid model's: {"events": [...], "full": [...]}
        if state["epoch"] != inst.epoch or state["full"] is not None:
            # [[hex, tier], ...] (an instance before the tiers: hex strings, on its device)
            inst.blocks = dict(
                (e, STORED) if isinstance(e, str) else e for e in state["full"] or []
            )
            inst.snapshots = None if snaps is None else dict(snaps["full"] or [])
        index(inst.blocks, state["events"])
        if snaps is not None and inst.snapshots is not None:
            index(inst.snapshots, snaps["events"])
        now = time.monotonic()
        inst.pending = {h: t for h, t in inst.pending.items() if t > now and h not in inst.blocks}
        inst.epoch, inst.last, inst.load = state["epoch"], state["last"], state["load"]
        inst.tokens_per_block, inst.model = state["tokens_per_block"], state["model"]
        inst.kv_cache_dtype, inst.max_num_seqs = state["kv_cache_dtype"], state["max_num_seqs"]
        if inst.state in (InstanceState.STARTING, InstanceState.DOWN):
            inst.state, inst.error, inst.crashes = InstanceState.UP, None, 0

    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(
                *(self.poll(i) for i in list(self.instances)), return_exceptions=True
            )
            if self.instances and all(i.state == InstanceState.FAILED for i in self.instances):
                self.fatal = "every instance failed to start"
                if self.server is not None:
                    self.server.should_exit = True  # the front stops
                return
            if self.migration and (self.rebalancing is None or self.rebalancing.done()):
                self.rebalancing = asyncio.create_task(self.rebalance())  # polls go on meanwhile
            await asyncio.sleep(POLL_S)

    async def when_up(self, choose, wait: float = 30.0) -> Instance:
        """``choose()``, waiting up to ``wait`` seconds while no instance is up but a replica of
        this front is (re)starting; with none coming, its ``NoInstance`` at once."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return choose()
            except NoInstance:
                coming = self.restart and any(
                    i.proc is not None and i.state in (InstanceState.STARTING, InstanceState.DOWN)
                    for i in self.instances
                )
                if time.monotonic() > deadline or not coming:
                    raise
                await asyncio.sleep(0.2)

    async def pick_waiting(self, ids, salt, exclude: frozenset) -> tuple[Instance, Optional[tuple]]:
        """``route`` avoiding ``exclude`` (where the request failed), waiting for an instance
        (``when_up``); an excluded one that is up again may take it then."""

        def choose():
            nonlocal exclude
            try:
                return self.route(ids, salt, exclude)
            except NoInstance:
                relaxed = frozenset(
                    i
                    for i in exclude
                    if self.by_id.get(i) and self.by_id[i].state != InstanceState.UP
                )
                if relaxed == exclude:
                    raise
                exclude = relaxed
                return self.route(ids, salt, exclude)

        return await self.when_up(choose)

    async def tokenize(self, prompt, chat: bool) -> List[int]:
        payload = {"messages": prompt} if chat else {"prompt": prompt}
        if not chat and isinstance(prompt, list):
            return list(prompt)  # token ids already
        for _ in range(3):
            inst = await self.when_up(self.pick_tokenizer)
            try:
                r = await self.client.post(
                    inst.url + "/tokenize", json=payload, headers=self.headers(), timeout=30.0
                )
            except httpx_module().HTTPError as e:
                self.lost(inst, f"{type(e).__name__}: {e}")
                continue
            if r.status_code != 200:
                raise BadRequest.relayed(r.status_code, r.text)
            return r.json()["tokens"]
        raise NoInstance("no instance could tokenize the prompt")

    def pick_tokenizer(self) -> Instance:
        up = self.up()
        if not up:
            raise NoInstance("no instance is up to serve the request")
        return min(up, key=lambda i: i.inflight)

    # -- migration -------------------------------------------------------------------------
    def attempts_on(self, inst: Instance) -> List[tuple]:
        return [
            (sub, a)
            for subs in self.subs.values()
            for sub in subs
            for a in sub.attempts
            if a.live and a.instance is inst and len(a.choices) == 1 and a.moved_to is None
        ]

    async def migrate(
        self, sub: Sub, attempt: Attempt, target: Instance, timeout: float = MIGRATION_TIMEOUT
    ) -> dict:
        """Move ``attempt`` to ``target``; each wait of the move (on either instance) is
        bounded by ``timeout`` seconds. ``BadRequest`` if it did not move (it runs where it
        was)."""
        src = attempt.instance
        if target is src:
            raise BadRequest(f"the request already runs on {target.id}", 409, "to")
        if target.state != InstanceState.UP:
            raise BadRequest(f"instance {target.id} is {target.state}", 409, "to")
        if (target.model, target.kv_cache_dtype) != (src.model, src.kv_cache_dtype):
            raise BadRequest(
                f"instances {src.id} and {target.id} run another model or KV cache dtype", 409, "to"
            )
        self.moving.add(src.id)
        inst = target
        try:
            host = urlparse(target.url).hostname
            r = await self.client.post(
                f"{target.url}/internal/accept",
                json={"host": host, "timeout": timeout},
                headers=self.headers(),
                timeout=timeout,
            )
            if r.status_code != 200:
                raise BadRequest.relayed(r.status_code, r.text)
            inst = src
            r = await self.client.post(
                f"{src.url}/internal/migrate",
                headers=self.headers(),
                timeout=4 * timeout + 30.0,  # connect, the two snapshots, their acks
                json={
                    "request_id": attempt.rid,
                    "host": host,
                    "port": r.json()["port"],
                    "to": target.id,
                    "timeout": timeout,
                },
            )
            if r.status_code != 200:
                self.counters["migration_failures"] += 1
                raise BadRequest.relayed(r.status_code, r.text)
        except (
            httpx_module().HTTPError
        ) as e:  # unreachable (its link is down), or no answer in time
            self.counters["migration_failures"] += 1
            raise BadRequest(
                f"request {attempt.rid!r} did not move from {src.id} to {target.id}: instance "
                f"{inst.id} ({inst.url}) did not answer: {type(e).__name__}: {e}"[:1000],
                409,
                "to" if inst is target else "request_id",
                code="not_migrated",
            ) from None
        finally:
            self.moving.discard(src.id)
        self.counters["migrations"] += 1
        src.counters["migrations_out"] += 1
        target.counters["migrations_in"] += 1
        return dict(r.json(), request_id=sub.rid, attempt=attempt.rid, source=src.id, to=target.id)

    async def rebalance(self) -> None:
        """Move one running request from the busiest instance to the least busy one when
        their loads differ by more than ``threshold``."""
        up = [i for i in self.up() if i.id not in self.moving]
        if len(up) < 2:
            return
        src = max(up, key=Instance.score)
        peers = [
            i
            for i in up
            if i is not src and (i.model, i.kv_cache_dtype) == (src.model, src.kv_cache_dtype)
        ]
        if not peers:
            return
        dst = min(peers, key=Instance.score)
        # a move shifts one request: only when that narrows the gap without turning it around
        if src.score() - dst.score() <= self.threshold or src.inflight - dst.inflight < 2:
            return

        def left(item):  # tokens the request may still generate
            sub, a = item
            return (
                sub.body.get("max_tokens") or sub.body.get("max_completion_tokens") or 1 << 30
            ) - len(sub.choices[a.choices[0]].tokens)

        now = time.monotonic()
        movable = [
            (sub, a)
            for sub, a in self.attempts_on(src)
            if sub.choices[a.choices[0]].tokens
            and sub.choices[a.choices[0]].finish_reason is None
            and left((sub, a)) >= MIN_LEFT
            and now - a.moved_at > MOVE_EVERY
        ]
        if not movable:
            return
        sub, a = max(movable, key=left)  # the one with the most left to generate moves
        a.moved_at = now
        with contextlib.suppress(BadRequest, httpx_module().HTTPError):
            await self.migrate(sub, a, dst)
            self.counters["auto_migrations"] += 1


# -- the front's app ----------------------------------------------------------------------
class ServingRouter:
    """What the front's routes do, over a ``Router``: a client request is split into one
    ``Sub`` per prompt, whose instances' choice chunks are streamed on or folded into the
    answer with the protocol of ``serve/openai.py``."""

    def __init__(self, router: Router, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.router, self.max_request_bytes = router, max_request_bytes
        self.registry = registry(RouterCollector(router))  # /metrics

    async def body(self, request: Request) -> dict:
        return parse_json(await read_body(request, self.max_request_bytes))

    def check_admin(self, request: Request) -> None:
        check_admin(request, self.router.admin, self.router.admin_key)

    async def complete(self, request: Request, chat: bool):
        """``/v1/completions`` or ``/v1/chat/completions``: answered once every prompt was
        taken by an instance (or with the first refusal)."""
        body = await self.body(request)
        req = RoutedRequest.parse(body, chat)
        rid, subs = await self.start(req, body)
        try:
            first = [await s.accepted for s in subs]
        except BaseException:
            self.finish(rid)
            raise
        headers = {INSTANCE_HEADER: first[0]}
        model = body.get("model")
        if req.stream:
            events = self.events(rid, req, subs, model)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:  # its client going away aborts it on the instances
            answer = await unless_disconnected(self.collect(rid, req, subs, model), request)
        finally:
            self.finish(rid)
        headers[INSTANCE_HEADER] = subs[-1].finished_on or headers[INSTANCE_HEADER]
        return JSONResponse(answer, headers=headers)

    async def start(self, req: RoutedRequest, body: dict):
        """The request's id and its ``Sub``s (each prompt tokenized once), started."""
        router = self.router
        path = "/v1/chat/completions" if req.chat else "/v1/completions"
        rid = completion_id(req.chat)
        ids = [await router.tokenize(p, req.chat) for p in req.prompts]
        subs = []
        for i, t in enumerate(ids):
            b = dict(body, prompt_token_ids=t) if req.chat else dict(body, prompt=t)
            name = rid if len(ids) == 1 else f"{rid}/{i}"
            subs.append(Sub(router, name, i, path, b, t, req.n))
        router.subs[rid] = subs
        router.counters["requests"] += 1
        for s in subs:
            s.start(list(range(req.n)))
        return rid, subs

    def finish(self, rid: str) -> None:
        for s in self.router.subs.pop(rid, []):
            for t in s.tasks:
                t.cancel()

    def account(self, subs: List[Sub]) -> dict:
        """The usage of ``subs`` (counted on the instances that finished them)."""
        for s in subs:
            inst = self.router.by_id.get(s.finished_on or "")
            if inst is not None:
                inst.counters["prompt_tokens"] += s.prompt_tokens
                inst.counters["cached_tokens"] += s.cached or 0
        return usage(
            sum(s.prompt_tokens for s in subs),
            sum(len(ch.tokens) for s in subs for ch in s.choices),
            sum(s.cached or 0 for s in subs),
        )

    async def deltas(self, subs: List[Sub]) -> AsyncIterator:
        """``(sub, Delta)`` of every sub as they come, until each ended or one failed (the
        last item then: ``(sub, Failure)``, counted)."""
        async with contextlib.aclosing(merge([s.events() for s in subs])) as merged:
            async for item in merged:
                failed = isinstance(item.value, Failure)
                self.router.counters["failed_requests"] += failed
                yield subs[item.index], item.value
                if failed:
                    return

    def events(self, rid: str, req: RoutedRequest, subs: List[Sub], model) -> AsyncIterator[str]:
        """The client's event stream (``stream_frame``): each instance chunk under its
        client-side choice index; a failure is an error event, then ``[DONE]``."""
        encode = Encoder(rid, req.chat, model)
        return stream_frame(
            encode,
            len(subs) * req.n,
            self._chunks(encode, rid, req, subs),
            lambda: self.account(subs),
            req.include_usage,
            lambda e: error_event(str(e), getattr(e, "status", 503)),
        )

    async def _chunks(self, encode: Encoder, rid: str, req: RoutedRequest, subs: List[Sub]):
        """The chunks of ``subs``' choices; a failure raises its error. The request is over at
        the end."""
        try:
            async for s, d in self.deltas(subs):
                if isinstance(d, Failure):
                    raise d.error
                encode.model = encode.model or d.data.get("model")
                c = dict(d.data["choices"][0], index=s.index * req.n + d.choice)
                if not req.token_ids:
                    c.pop("token_ids", None)
                first = req.token_ids and "prompt_token_ids" in d.data and d.choice == 0
                extra = {"prompt_token_ids": d.data["prompt_token_ids"]} if first else {}
                yield encode.chunk([c], **extra)
        finally:
            self.finish(rid)

    async def collect(self, rid: str, req: RoutedRequest, subs: List[Sub], model) -> dict:
        """The non-streamed answer: every choice's chunks folded (``fold``)."""
        learnt = [model]  # the model's name, from the instances' chunks if the client named none

        async def chunks():
            async for s, d in self.deltas(subs):
                if isinstance(d, Failure):
                    raise d.error if d.reject else NoInstance(str(d.error))
                learnt[0] = learnt[0] or d.data.get("model")
                yield dict(d.data["choices"][0], index=s.index * req.n + d.choice)

        choices = await fold(chunks(), len(subs) * req.n)
        return response(rid, req.chat, learnt[0], choices, req.token_ids, self.account(subs))

    def health(self) -> JSONResponse:
        up = len(self.router.up())
        body = {
            "status": "ok" if up else "error",
            "instances": len(self.router.instances),
            "up": up,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    async def models(self) -> JSONResponse:
        router = self.router
        inst = router.pick_tokenizer()
        r = await router.client.get(inst.url + "/v1/models", headers=router.headers(), timeout=10.0)
        return JSONResponse(r.json(), status_code=r.status_code)

    def metrics(self) -> str:
        return exposition(self.registry)

    # -- admin -------------------------------------------------------------------------------
    def instances(self) -> dict:
        router = self.router
        return {
            "instances": [i.view() for i in router.instances],
            "routing": router.routing,
            "migration": router.migration,
            "threshold": router.threshold,
        }

    async def join(self, body: dict) -> dict:
        """``{"url", "id"?}``: a ``ringkv serve`` instance joins (routed to once it answers)."""
        url, id = body.get("url"), body.get("id")
        if not isinstance(url, str) or (
            id is not None and not (isinstance(id, str) and 0 < len(id) <= 64)
        ):
            raise BadRequest(
                "join takes url (http://host:port) and an optional id (a string)", param="url"
            )
        try:
            inst = self.router.add(url, id)
        except ValueError as e:
            raise BadRequest(str(e), 409 if "already" in str(e) else 400, "url")
        await self.router.poll(inst)
        return inst.view()

    async def drain(self, id: str, timeout: float = 600.0) -> dict:
        """Take no new requests there, wait for its streams to end, remove it (a replica stops)."""
        inst = self.router.by_id.get(id)
        if inst is None:
            raise BadRequest(f"no instance {id!r}", 404, "id")
        inst.state = InstanceState.DRAINING
        deadline = time.monotonic() + timeout
        while inst.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if inst.inflight:
            raise BadRequest(f"instance {id} still streams {inst.inflight} requests", 409, "id")
        self.router.remove(inst)
        return {"id": id, "removed": True}

    async def migrate(self, body: dict) -> dict:
        """``{"request_id", "to", "timeout"?}``: move a running request (the ``id`` its client
        got) to instance ``to``; returns when it has moved. ``timeout`` (seconds, default 30)
        bounds each wait of the move: a link that stops carrying fails it (409) that soon."""
        router = self.router
        rid, to = body.get("request_id"), body.get("to")
        timeout = migration_timeout(body)
        if not isinstance(rid, str) or not isinstance(to, str):
            raise BadRequest("migrate takes request_id (a completion's id) and to (an instance id)")
        subs = router.subs.get(rid)
        if not subs:
            raise BadRequest(f"no running request {rid!r}", 404, "request_id")
        target = router.by_id.get(to)
        if target is None:
            raise BadRequest(f"no instance {to!r}", 404, "to")
        moved = []
        for s in subs:
            running = [
                a
                for a in s.attempts
                if a.live and a.moved_to is None and not s.done and a.instance is not target
            ]
            for a in running:
                if len(a.choices) != 1:
                    raise BadRequest("only requests with n = 1 can migrate", 409, "request_id")
                if s.choices[a.choices[0]].finish_reason is None:
                    moved.append(await router.migrate(s, a, target, timeout))
        if not moved:
            raise BadRequest(f"request {rid!r} has nothing left to move to {to}", 409, "request_id")
        return {"request_id": rid, "to": to, "moved": moved}


def build_router_app(router: Router, max_request_bytes: int = MAX_REQUEST_BYTES):
    """The front's app over ``router`` (its HTTP client and polls live as long as the app)."""
    httpx = httpx_module()
    serving = ServingRouter(router, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        router.client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, read=None),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )
        router.tasks.append(asyncio.create_task(router.poll_forever()))
        try:
            yield
        finally:
            for t in router.tasks:
                t.cancel()
            await router.client.aclose()

    app = openai_app(
        serving,
        {NoInstance: lambda e: BadRequest(str(e), 503)},
        api_key=router.api_key,
        protect_metrics=router.protect_metrics,
        title="ringkv router",
        lifespan=lifespan,
    )

    @app.get("/admin/instances")
    async def instances(request: Request):
        serving.check_admin(request)
        return serving.instances()

    @app.delete("/admin/instances/{id}")
    async def drain(request: Request, id: str, timeout: float = 600.0):
        serving.check_admin(request)
        return await serving.drain(id, timeout)

    admin_posts(app, serving, {"/admin/instances": serving.join, "/admin/migrate": serving.migrate})
    return app


def run(
    router: Router,
    *,
    host: str,
    port: int,
    log_level: str = "warning",
    replicas: Optional[List[List[str]]] = None,
    max_request_bytes: Optional[int] = None,
) -> None:
    """Serve the front until interrupted; ``replicas``: the ``ringkv serve`` argument lists of
    the instances to start here (each then gets ``--port``, ``--instance-id`` and the key)."""
    import uvicorn

    procs = []
    logs = tempfile.mkdtemp(prefix="ringkv-replicas-")
    # uvicorn re-raises the SIGTERM that stopped it: let it end this function, not the process
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    terminated = False
    try:
        start_replicas(router, replicas or [], logs, procs)
        app = build_router_app(router, max_request_bytes or MAX_REQUEST_BYTES)
        router.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level)
        )
        router.server.run()
    except Terminated:
        terminated = True
    finally:
        stop_replicas(router.instances, procs, logs)
        if main:
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.raise_signal(signal.SIGTERM)  # the process ends of it, as it would have
