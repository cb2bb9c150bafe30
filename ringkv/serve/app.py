"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (FastAPI/Starlette).

``/v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). A bad request gets a 4xx
with an OpenAI-style error body and changes nothing; a client that disconnects aborts its
request (its KV blocks are freed). What one request can cost before it is refused is bounded:
its body (``max_request_bytes``, a 413, read in chunks and never parsed past the limit), its
prompt text (``LLM.max_prompt_chars``, refused before tokenizing) and its stop lists
(``SamplingParams.problem``); tokenizing runs off the engine's thread.

Beyond OpenAI's API: ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served from
the prefix cache), an ``x-ringkv-instance`` header naming the instance, the request fields
``cache_salt`` (prefix-cache blocks are shared only between requests with the same salt, e.g.
per tenant) and ``return_token_ids`` (each choice carries its ``token_ids``; a stream's first
chunk the ``prompt_token_ids``), ``prompt_token_ids`` in place of a chat's messages (the template
already applied), and ``POST /tokenize``. With ``admin`` on (``ringkv serve --admin`` or
``--admin-key``), the endpoints a router (``serve/router.py``) drives: ``GET /internal/state``
(load and the prefix cache's block events), ``POST /internal/accept``, ``POST /internal/migrate``
and ``GET /internal/attach/{id}`` (live migration), ``POST /internal/share`` (a peer pulls a cached
prefix: ``{"host", "port", "token_ids", "cache_salt"}`` -> ``{"tokens"}``, then this instance
connects to the peer's link there and sends the prefix's K/V), the ``x-ringkv-request-id`` header
(the router's id for a request: it may migrate, and its stream then ends with a ``ringkv_moved``
event) and the ``x-ringkv-pull`` header (``<holder URL> <tokens>``: the holder has a longer
prefix of the prompt; this instance may pull it before it adds the request, see
``AsyncEngine.pull_prefix``). Both headers are honoured from an admin only; a hint from anyone
else is ignored (it would let a client make the instance connect anywhere).

The routes are short: ``ServingInstance`` holds what they do, over the protocol of
``serve/openai.py`` (requests, choices, the event stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
from typing import AsyncIterator, Optional
from urllib.parse import urlparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..engine import SamplingParams
from .engine import AsyncEngine, Busy, EngineDead, Moved, Pull, RequestTimeout, in_thread
from .metrics import EngineCollector, exposition, registry
from .openai import ADMIN_HEADER, INSTANCE_HEADER, MAX_REQUEST_BYTES, PULL_HEADER, REQUEST_ID_HEADER
from .openai import BadRequest, ChatRequest, CompletionRequest, Encoder, OpenAIRequest, Raised
from .openai import Renderer, chat_messages, completion_id, completion_prompts, error_body
from .openai import error_event, event, fold, merge, parse_json, parse_request, read_body, response
from .openai import stream_frame, unless_disconnected

REQUEST_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


MIGRATION_TIMEOUT = 30.0  # seconds any wait of a move between instances takes at most


def migration_timeout(body: dict) -> float:
    """A move's ``timeout`` (seconds, 0 < t <= 600; absent: ``MIGRATION_TIMEOUT``)."""
    t = body.get("timeout", MIGRATION_TIMEOUT)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 600:
        raise BadRequest("timeout must be seconds, more than 0 and at most 600", param="timeout")
    return float(t)


def check_admin(request: Request, admin: bool, admin_key: Optional[str]) -> None:
    """Admin endpoints: a 404 unless ``admin``; with ``admin_key``, a 401 without it in the
    ``x-ringkv-admin-key`` header (compared in constant time)."""
    if not admin:
        raise BadRequest(
            "not found (admin endpoints are off; start with --admin or --admin-key)", 404
        )
    if admin_key is not None and not hmac.compare_digest(
        request.headers.get(ADMIN_HEADER, "").encode(), admin_key.encode()
    ):
        raise BadRequest(
            f"admin endpoints need the admin key in the {ADMIN_HEADER} header",
            401,
            code="invalid_admin_key",
        )


def refused_key(
    request: Request, api_key: Optional[str], protect_metrics: bool
) -> Optional[JSONResponse]:
    """The 401 for a keyed path (``/v1/*``, ``/tokenize``, and ``/metrics`` with
    ``protect_metrics``) without ``Authorization: Bearer <api_key>`` (compared in constant time)."""
    path = request.url.path
    if api_key is None or not (
        path.startswith("/v1/") or path == "/tokenize" or (protect_metrics and path == "/metrics")
    ):
        return None
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if hmac.compare_digest(token.encode(), api_key.encode()):
        return None
    return refusal(
        BadRequest(
            "invalid or missing API key: send it as Authorization: Bearer <key>",
            401,
            code="invalid_api_key",
        )
    )


def refusal(e: BadRequest) -> JSONResponse:
    return JSONResponse(
        error_body(str(e), e.status, e.param, e.code), status_code=e.status, headers=e.headers
    )


class ServingInstance:
    """What the routes of one instance do, over its ``AsyncEngine``: each method takes the
    request's parsed parts and returns the answer (a dict, or the event stream's strings)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        *,
        instance_id: Optional[str] = None,
        admin: bool = False,
        admin_key: Optional[str] = None,
        max_request_bytes: Optional[int] = None,
    ):
        limit = MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1, got {limit!r}")
        self.engine, self.llm, self.model_name = engine, engine.llm, model_name
        self.instance_id, self.max_request_bytes = instance_id, limit
        self.admin, self.admin_key = admin or admin_key is not None, admin_key
        self.created = int(time.time())
        self.registry = registry(EngineCollector(engine))  # /metrics

    # -- requests ------------------------------------------------------------------------------
    async def body(self, request: Request) -> dict:
        """The request's JSON object (413 past ``max_request_bytes``; 404 for another model)."""
        return parse_json(await read_body(request, self.max_request_bytes), self.model_name)

    def check_admin(self, request: Request) -> None:
        check_admin(request, self.admin, self.admin_key)

    def parse(self, body: dict, chat: bool) -> OpenAIRequest:
        return parse_request(body, chat, self.llm.max_model_len, self.has_template)

    @property
    def has_template(self) -> bool:
        tok = self.llm.tokenizer
        return tok is not None and getattr(tok, "chat_template", None) is not None

    def routed_id(self, request: Request) -> Optional[str]:
        """A router's id for the request (``x-ringkv-request-id``), honoured from an admin only."""
        rid = request.headers.get(REQUEST_ID_HEADER)
        if rid is None or not self.admin:
            return None
        self.check_admin(request)
        if not REQUEST_ID.fullmatch(rid):
            raise BadRequest(
                f"{REQUEST_ID_HEADER} must be 1-128 characters of A-Z a-z 0-9 . _ : / -"
            )
        return rid

    def pull_hint(self, request: Request) -> Optional[Pull]:
        """A router's pull hint (the ``x-ringkv-pull`` header), from an admin only: anyone else's
        is ignored. A malformed one from an admin is a 400."""
        value = request.headers.get(PULL_HEADER)
        if value is None or not self.admin:
            return None
        try:
            self.check_admin(request)
        except BadRequest:
            return None
        holder, _, tokens = value.strip().rpartition(" ")
        url = urlparse(holder)
        if url.scheme not in ("http", "https") or not url.hostname or not tokens.isdigit():
            raise BadRequest(f"{PULL_HEADER} must be '<holder URL> <tokens>', got {value!r:.200}")
        headers = {} if self.admin_key is None else {ADMIN_HEADER: self.admin_key}
        host = request.url.hostname or "127.0.0.1"  # this instance, as its router reaches it
        return Pull(holder, int(tokens), host, headers)

    async def start(
        self, req: OpenAIRequest, routed: Optional[str] = None, pull: Optional[Pull] = None
    ) -> list:
        """One engine stream per prompt, all or none (a prompt the engine refuses is a 400);
        ``pull``: a router's pull hint for each prompt."""
        streams = []
        try:
            for i, p in enumerate(req.prompts):
                name = (
                    None if routed is None else routed if len(req.prompts) == 1 else f"{routed}/{i}"
                )
                streams.append(
                    await self.engine.add(
                        p, req.params, request_id=name, pull=pull, cache_salt=req.cache_salt
                    )
                )
        except BaseException as e:  # the prompts taken so far are aborted
            for st in streams:
                await st.aclose()
            if isinstance(e, ValueError):
                raise BadRequest(str(e), param="messages" if req.chat else "prompt")
            raise
        return streams

    async def complete(self, request: Request, chat: bool):
        """``/v1/completions`` or ``/v1/chat/completions``: every prompt is checked and taken by
        the engine before anything is answered."""
        req = self.parse(await self.body(request), chat)
        routed = self.routed_id(request)
        rid = routed or completion_id(chat)
        streams = await self.start(req, routed, self.pull_hint(request))
        if req.stream:
            return StreamingResponse(self.events(rid, req, streams), media_type="text/event-stream")
        return JSONResponse(await self.answer(rid, req, streams, request))

    async def answer(self, rid: str, req: OpenAIRequest, streams, request=None) -> dict:
        """The non-streamed answer of ``streams``; aborts them all if the client of ``request``
        disconnects meanwhile."""
        try:
            work = self._collect(rid, req, streams)
            return await (work if request is None else unless_disconnected(work, request))
        finally:
            for st in streams:
                await st.aclose()

    async def _collect(self, rid: str, req: OpenAIRequest, streams) -> dict:
        render = Renderer(req, self.llm.tokenizer)

        async def chunks():
            async with contextlib.aclosing(merge(streams)) as merged:
                async for item in merged:
                    if isinstance(item, Raised):
                        raise item.error
                    out = item.value
                    if isinstance(out, Moved):  # a non-streamed answer cannot follow it
                        raise EngineDead(f"the request moved to instance {out.to!r}")
                    render.opens(item.index, out)
                    for c in render.choices(item.index, out, every=True):
                        yield c

        choices = await fold(chunks(), len(streams) * req.params.n)
        return response(rid, req.chat, self.model_name, choices, req.token_ids, render.usage())

    def events(self, rid: str, req: OpenAIRequest, streams) -> AsyncIterator[str]:
        """Server-sent events (``stream_frame``): a chunk per new token of each choice. If the
        client goes away, the response is closed here and the requests are aborted."""
        encode, render = Encoder(rid, req.chat, self.model_name), Renderer(req, self.llm.tokenizer)
        return stream_frame(
            encode,
            len(streams) * req.params.n,
            self._chunks(encode, render, req, streams),
            render.usage,
            req.include_usage,
            failure_event,
        )

    async def _chunks(self, encode: Encoder, render: Renderer, req, streams) -> AsyncIterator[str]:
        """The chunks of ``streams`` (a failed one: its error event; a moved one: the
        ``ringkv_moved`` event a router follows); they are all closed at the end."""
        merged = merge(streams)
        try:
            async for item in merged:
                if isinstance(item, Raised):
                    yield failure_event(item.error)
                    continue
                out = item.value
                if isinstance(out, Moved):  # a router attaches to it there
                    moved = {"index": item.index, "to": out.to, "request_id": out.request_id}
                    yield event({"ringkv_moved": moved})
                    continue
                opens = render.opens(item.index, out) and req.token_ids
                first = {"prompt_token_ids": out.prompt_token_ids} if opens else {}
                for c in render.choices(item.index, out):
                    yield encode.chunk([c], **first)
                    first = {}
        finally:
            await merged.aclose()
            for st in streams:
                await st.aclose()  # aborts whatever is unfinished (a disconnect)

    async def tokenize(self, body: dict) -> dict:
        """``{"prompt": ...}`` or ``{"messages": [...]}`` -> ``{"tokens", "count",
        "max_model_len"}``."""
        if "messages" in body:
            prompt = [chat_messages(body, self.has_template)]
        else:
            prompt = completion_prompts(body.get("prompt"))
        if len(prompt) != 1:
            raise BadRequest("tokenize takes one prompt", param="prompt")
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self.engine.encoder, self.llm.encode, prompt[0])
        except ValueError as e:
            raise BadRequest(str(e), param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

    def health(self) -> JSONResponse:
        if self.engine.dead:
            return JSONResponse({"status": "error", "error": self.engine.dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "ringkv",
            "max_model_len": self.llm.max_model_len,
        }
        return {"object": "list", "data": [model]}

    def metrics(self) -> str:
        return exposition(self.registry)

    # -- what a router drives (admin) ----------------------------------------------------------
    async def state(self, after: int = 0, epoch: str = "") -> dict:
        """Load, and the prefix cache's changes since event ``after`` of ``epoch`` (or the whole
        index, ``full``, when those are gone or the epoch is another: the engine restarted)."""
        engine, llm = self.engine, self.llm
        changes = await asyncio.get_running_loop().run_in_executor(
            None, engine.kv_changes, after, epoch
        )
        if changes is None:
            raise BadRequest("this instance does not publish KV events", 409)
        info = llm.kv_cache_info()
        return {
            "id": self.instance_id,
            "epoch": engine.epoch,
            "model": llm.digest,
            "served_model_name": self.model_name,
            "kv_cache_dtype": info.get("kv_cache_dtype"),
            "tokens_per_block": info["tokens_per_block"],
            "max_num_seqs": llm.engine_config.max_num_seqs,
            "dead": engine.dead,
            "load": dict(
                engine.gauges,
                migrations_in=engine.metrics.migrations_in,
                migrations_out=engine.metrics.migrations_out,
                prompt_tokens=engine.metrics.prompt_tokens,
            ),
            **changes,
        }

    async def accept(self, body: dict) -> dict:
        """``{"host", "timeout"?}``: listen there for one request moving in (every wait of the
        move bounded by ``timeout`` seconds, default 30); ``{"host", "port"}``."""
        host, timeout = body.get("host"), migration_timeout(body)
        if not isinstance(host, str) or not host or len(host) > 255:
            raise BadRequest(
                "host must be this instance's address as the source reaches it", param="host"
            )
        loop = asyncio.get_running_loop()
        try:
            port = await in_thread(lambda: self.engine.accept(host, timeout, loop=loop))
        except Exception as e:  # noqa: BLE001 - e.g. an address this host does not have
            raise BadRequest(f"cannot listen on {host!r}: {type(e).__name__}: {e}", param="host")
        return {"host": host, "port": port}

    async def migrate(self, body: dict) -> dict:
        """``{"request_id", "host", "port", "to", "timeout"?}``: move a running request to the
        instance ``to`` listening on ``host:port`` (every wait bounded by ``timeout`` seconds,
        default 30); returns when it has moved (409 if it did not)."""
        rid, host, port, to = (body.get(k) for k in ("request_id", "host", "port", "to"))
        timeout = migration_timeout(body)
        port_ok = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
        if not (port_ok and all(isinstance(x, str) for x in (rid, host, to))):
            raise BadRequest(
                "migrate takes request_id, host, port (1-65535) and to (an instance id)"
            )
        from ..engine.remote import MigrationError
        from ..parallel.transfer import LinkError

        try:
            return await in_thread(self.engine.migrate_out, rid, host, port, to, timeout)
        except (ValueError, MigrationError, LinkError) as e:
            raise BadRequest(
                f"{type(e).__name__}: {e}", 409, param="request_id", code="not_migrated"
            )

    async def share(self, body: dict) -> dict:
        """``{"host", "port", "token_ids", "cache_salt"?}``: a peer pulls the cached prefix of
        ``token_ids``; answers ``{"tokens": prefix tokens held here}`` (409 if none), then
        connects to the peer's link on ``host:port`` and sends the prefix's K/V."""
        host, port, ids, salt = (body.get(k) for k in ("host", "port", "token_ids", "cache_salt"))
        port_ok = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
        ids_ok = (
            isinstance(ids, list)
            and 0 < len(ids) <= self.llm.max_model_len
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        )
        if not (
            port_ok
            and ids_ok
            and isinstance(host, str)
            and 0 < len(host) <= 255
            and (salt is None or isinstance(salt, str))
        ):
            raise BadRequest(
                "share takes host, port (1-65535), token_ids (1 to max_model_len ints >= 0) "
                "and an optional cache_salt (a string)"
            )
        try:
            held = await in_thread(self.engine.share, host, port, ids, salt)
        except ValueError as e:
            raise BadRequest(str(e), 409, param="token_ids", code="not_cached")
        return {"tokens": held}

    async def attach(self, rid: str, chat: bool = False) -> AsyncIterator[str]:
        """The rest of a request that moved in, as the stream it came from (n = 1)."""
        engine = self.engine
        try:
            st = await asyncio.get_running_loop().run_in_executor(
                None, engine.call, engine.attach, rid
            )
        except KeyError:
            raise BadRequest(f"no request {rid!r} moved in to be attached", 404, param="request_id")
        kind = ChatRequest if chat else CompletionRequest
        req = kind([], SamplingParams(), True, True, True, None)
        return self.events(rid, req, [st])


def failure_event(e: BaseException) -> str:
    """The error event of a stream the engine failed."""
    status = 503 if isinstance(e, EngineDead) else 408 if isinstance(e, RequestTimeout) else 500
    return error_event(f"{type(e).__name__}: {e}", status)


def openai_app(
    serving,
    refusals: dict,
    *,
    api_key: Optional[str],
    protect_metrics: bool,
    instance_id: Optional[str] = None,
    **fastapi,
) -> FastAPI:
    """The routes an instance and a router both serve, over ``serving`` (a ``ServingInstance``
    or a ``ServingRouter``): ``/health``, ``/v1/models``, ``/metrics``, the completions, the API
    key's 401, the ``x-ringkv-instance`` header (with ``instance_id``), and the error answer of a
    ``BadRequest`` and of each exception type in ``refusals`` (``type -> (e -> BadRequest)``)."""
    app = FastAPI(**fastapi)
    app.state.serving = serving

    @app.middleware("http")
    async def keyed(request: Request, call_next):
        response = refused_key(request, api_key, protect_metrics) or await call_next(request)
        if instance_id is not None:
            response.headers[INSTANCE_HEADER] = instance_id
        return response

    def handler(as_bad_request):
        async def handle(_, e: Exception):
            return refusal(as_bad_request(e))

        return handle

    for kind, as_bad_request in {BadRequest: lambda e: e, **refusals}.items():
        app.add_exception_handler(kind, handler(as_bad_request))

    @app.get("/health")
    async def health():
        return serving.health()

    @app.get("/v1/models")
    async def models():
        return await serving.models()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(serving.metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.complete(request, chat=True)

    return app


def admin_posts(app: FastAPI, serving, routes: dict) -> None:
    """``POST path``: ``routes[path](body)``, for an admin only (``serving.check_admin``)."""

    def route(path, call):
        @app.post(path)
        async def admin_post(request: Request):
            serving.check_admin(request)
            return await call(await serving.body(request))

    for path, call in routes.items():
        route(path, call)


def build_app(
    engine: AsyncEngine,
    model_name: str,
    max_request_bytes: Optional[int] = None,
    *,
    instance_id: Optional[str] = None,
    admin: bool = False,
    admin_key: Optional[str] = None,
    api_key: Optional[str] = None,
    protect_metrics: bool = False,
) -> FastAPI:
    """The app; request bodies over ``max_request_bytes`` (default ``MAX_REQUEST_BYTES``) get a
    413. ``instance_id``: the ``x-ringkv-instance`` header; ``admin``/``admin_key``: the
    internal endpoints a router drives (off by default); ``api_key``: every ``/v1/*`` and
    ``/tokenize`` request (and ``/metrics`` with ``protect_metrics``) needs it, else a 401."""
    serving = ServingInstance(
        engine,
        model_name,
        instance_id=instance_id,
        admin=admin,
        admin_key=admin_key,
        max_request_bytes=max_request_bytes,
    )
    app = openai_app(
        serving,
        {
            Busy: lambda e: BadRequest(
                str(e), 429, code="too_many_requests", headers={"Retry-After": str(e.retry_after)}
            ),
            RequestTimeout: lambda e: BadRequest(str(e), 408, code="request_timeout"),
            EngineDead: lambda e: BadRequest(f"the engine failed: {e}", 503),
        },
        api_key=api_key,
        protect_metrics=protect_metrics,
        instance_id=instance_id,
        title="ringkv",
        version="0.1.0",
    )

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(await serving.body(request))

    @app.get("/internal/state")
    async def state(request: Request, after: int = 0, epoch: str = ""):
        serving.check_admin(request)
        return await serving.state(after, epoch)

    admin_posts(
        app,
        serving,
        {
            "/internal/accept": serving.accept,
            "/internal/migrate": serving.migrate,
            "/internal/share": serving.share,
        },
    )

    @app.get("/internal/attach/{rid:path}")
    async def attach(request: Request, rid: str, chat: bool = False):
        serving.check_admin(request)
        events = await serving.attach(rid, chat)
        return StreamingResponse(events, media_type="text/event-stream")

    return app
