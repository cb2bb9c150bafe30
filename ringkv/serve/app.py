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
and ``GET /internal/attach/{id}`` (live migration), and the ``x-ringkv-request-id`` header (the
router's id for a request: it may migrate, and its stream then ends with a ``ringkv_moved`` event).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import threading
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..engine import SamplingParams
from ..engine.params import Logprob
from .engine import TTFT_BUCKETS, AsyncEngine, Busy, EngineDead, Moved, RequestTimeout

# request fields -> SamplingParams fields (OpenAI names, and vLLM's extensions)
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
}
MAX_REQUEST_BYTES = 16 << 20  # default request body limit (ringkv serve --max-request-bytes)
ADMIN_HEADER = "x-ringkv-admin-key"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


def error_body(message: str, status: int, param=None, code=None) -> dict:
    kind = (
        "invalid_request_error"
        if status < 500
        else ("service_unavailable" if status == 503 else "internal_error")
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
    return JSONResponse(
        error_body(
            "invalid or missing API key: send it as Authorization: Bearer <key>",
            401,
            code="invalid_api_key",
        ),
        status_code=401,
    )


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
    max_request_bytes = MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    app = FastAPI(title="ringkv", version="0.1.0")
    llm = engine.llm
    created = int(time.time())

    admin = admin or admin_key is not None

    @app.middleware("http")
    async def name_instance(request: Request, call_next):
        response = refused_key(request, api_key, protect_metrics) or await call_next(request)
        if instance_id is not None:
            response.headers["x-ringkv-instance"] = instance_id
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        return JSONResponse(
            error_body(str(e), e.status, e.param, e.code), status_code=e.status, headers=e.headers
        )

    @app.exception_handler(Busy)
    async def busy(_, e: Busy):
        return JSONResponse(
            error_body(str(e), 429, code="too_many_requests"),
            status_code=429,
            headers={"Retry-After": str(e.retry_after)},
        )

    @app.exception_handler(RequestTimeout)
    async def timed_out(_, e: RequestTimeout):
        return JSONResponse(error_body(str(e), 408, code="request_timeout"), status_code=408)

    @app.exception_handler(EngineDead)
    async def engine_dead(_, e: EngineDead):
        return JSONResponse(error_body(f"the engine failed: {e}", 503), status_code=503)

    @app.get("/health")
    async def health():
        if engine.dead:
            return JSONResponse({"status": "error", "error": engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "ringkv",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    async def body_of(request: Request) -> Dict[str, Any]:
        raw = await read_body(request, max_request_bytes)
        try:
            body = json.loads(raw)
        except (
            ValueError,
            RecursionError,
        ) as e:  # also bad UTF-8, ints of over 4300 digits, deep nesting
            raise BadRequest(f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise BadRequest(
                f"the model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                404,
                "model",
                "model_not_found",
            )
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompts = completion_prompts(body.get("prompt"))
        echo, max_tokens, logprobs = (
            body.get("echo"),
            body.get("max_tokens", 16),
            body.get("logprobs"),
        )
        if echo not in (None, True, False):
            raise BadRequest(f"echo must be a bool, got {echo!r:.80}", param="echo")
        zero = (
            bool(echo) and max_tokens == 0 and not isinstance(max_tokens, bool)
        )  # the prompt's log-probs only
        params = sampling_params(
            body,
            1 if zero else max_tokens,
            logprobs,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
        )
        return await respond(
            request, body, prompts, params, chat=False, echo=Echo(zero) if echo else None
        )

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """``{"prompt": ...}`` or ``{"messages": [...]}`` -> ``{"tokens", "count", "max_model_len"}``."""
        body = await body_of(request)
        prompt = chat_prompt(body) if "messages" in body else completion_prompts(body.get("prompt"))
        if len(prompt) != 1:
            raise BadRequest("tokenize takes one prompt", param="prompt")
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                engine.encoder, llm.encode, prompt[0]
            )
        except ValueError as e:
            raise BadRequest(str(e), param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    def chat_prompt(body: dict) -> List:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise BadRequest(
                "messages must be a non-empty list of {role, content} objects", param="messages"
            )
        if llm.tokenizer is None or getattr(llm.tokenizer, "chat_template", None) is None:
            raise BadRequest(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        return [[dict(m, content=_text_content(m.get("content"))) for m in messages]]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        prompts = chat_prompt(body)
        ids = body.get(
            "prompt_token_ids"
        )  # the conversation so far, already templated (a router's failover)
        if ids is not None:
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise BadRequest(
                    "prompt_token_ids must be a non-empty list of token ids",
                    param="prompt_token_ids",
                )
            prompts = [ids]
        if body.get("logprobs") not in (None, True, False):
            raise BadRequest(
                f"logprobs must be a bool, got {body['logprobs']!r:.80}", param="logprobs"
            )
        if body.get("echo"):
            raise BadRequest(
                "echo is for /v1/completions; chat completions do not echo", param="echo"
            )
        top = body.get("top_logprobs") or 0
        lp = top if body.get("logprobs") else None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", llm.max_model_len))
        params = sampling_params(body, max_tokens, lp, logprobs_param="top_logprobs")
        return await respond(request, body, prompts, params, chat=True)

    def routed_id(request: Request) -> Optional[str]:
        """A router's id for the request (``x-ringkv-request-id``), honoured from an admin only."""
        rid = request.headers.get("x-ringkv-request-id")
        if rid is None or not admin:
            return None
        check_admin(request, admin, admin_key)
        if not REQUEST_ID.fullmatch(rid):
            raise BadRequest(
                "x-ringkv-request-id must be 1-128 characters of A-Z a-z 0-9 . _ : / -"
            )
        return rid

    async def respond(
        request: Request,
        body: dict,
        prompts: List,
        params: SamplingParams,
        chat: bool,
        echo: Optional["Echo"] = None,
    ):
        routed = routed_id(request)
        rid = routed or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stream, include_usage = stream_flags(body)
        token_ids, salt = body.get("return_token_ids"), body.get("cache_salt")
        if token_ids not in (None, True, False):
            raise BadRequest(
                f"return_token_ids must be a bool, got {token_ids!r:.80}", param="return_token_ids"
            )
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 256):
            raise BadRequest(
                "cache_salt must be a string of 1 to 256 characters", param="cache_salt"
            )
        streams = []
        try:  # every prompt is validated before anything is answered
            for i, p in enumerate(prompts):
                name = (
                    None if routed is None else (routed if len(prompts) == 1 else f"{routed}/{i}")
                )
                streams.append(await engine.add(p, params, request_id=name, cache_salt=salt))
        except BaseException as e:  # the prompts taken so far are aborted: all or nothing
            for st in streams:
                await st.aclose()
            if isinstance(e, ValueError):
                raise BadRequest(str(e), param="messages" if chat else "prompt")
            raise
        if stream:
            return StreamingResponse(
                stream_events(rid, streams, params, chat, include_usage, bool(token_ids), echo),
                media_type="text/event-stream",
            )
        choices, prompt_tokens, cached = await _collect(request, streams, params)
        return JSONResponse(
            complete_response(rid, choices, prompt_tokens, cached, chat, bool(token_ids), echo)
        )

    # -- what a router drives (admin) ---------------------------------------------------------
    @app.get("/internal/state")
    async def state(request: Request, after: int = 0, epoch: str = ""):
        """Load, and the prefix cache's changes since event ``after`` of ``epoch`` (or the whole
        index, ``full``, when those are gone or the epoch is another: the engine restarted)."""
        check_admin(request, admin, admin_key)
        events, full = llm.blocks.events, None
        if events is None:
            raise BadRequest("this instance does not publish KV events", 409)
        last, new = events.since(after) if epoch == engine.epoch else (events.last, None)
        if new is None:  # the whole index, read on the engine's thread (where it changes)
            last, full = await asyncio.get_running_loop().run_in_executor(
                None, engine.call, lambda: (events.last, [h.hex() for h in llm.blocks.by_hash])
            )
            new = []
        info = llm.kv_cache_info()
        return {
            "id": instance_id,
            "epoch": engine.epoch,
            "model": llm.digest,
            "served_model_name": model_name,
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
            "last": last,
            "events": [[kind, h.hex()] for _, kind, h in new],
            "full": full,
        }

    @app.post("/internal/accept")
    async def accept(request: Request):
        """``{"host"}``: listen there for one request moving in; ``{"host", "port"}``."""
        check_admin(request, admin, admin_key)
        body = await body_of(request)
        host = body.get("host")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise BadRequest(
                "host must be this instance's address as the source reaches it", param="host"
            )
        engine.loop = asyncio.get_running_loop()
        try:
            port = await in_thread(engine.accept, host)
        except Exception as e:  # noqa: BLE001 - e.g. an address this host does not have
            raise BadRequest(f"cannot listen on {host!r}: {type(e).__name__}: {e}", param="host")
        return {"host": host, "port": port}

    @app.post("/internal/migrate")
    async def migrate(request: Request):
        """``{"request_id", "host", "port", "to"}``: move a running request to the instance
        ``to`` listening on ``host:port``; returns when it has moved (409 if it did not)."""
        check_admin(request, admin, admin_key)
        body = await body_of(request)
        rid, host, port, to = (body.get(k) for k in ("request_id", "host", "port", "to"))
        if (
            not isinstance(rid, str)
            or not isinstance(host, str)
            or not isinstance(to, str)
            or not isinstance(port, int)
            or isinstance(port, bool)
            or not 0 < port < 65536
        ):
            raise BadRequest(
                "migrate takes request_id, host, port (1-65535) and to (an instance id)"
            )
        from ..engine.remote import MigrationError
        from ..parallel.transfer import LinkError

        try:
            return await in_thread(engine.migrate_out, rid, host, port, to)
        except (ValueError, MigrationError, LinkError) as e:
            raise BadRequest(
                f"{type(e).__name__}: {e}", 409, param="request_id", code="not_migrated"
            )

    @app.get("/internal/attach/{rid:path}")
    async def attach(request: Request, rid: str, chat: bool = False):
        """The rest of a request that moved in, as the stream it came from (n = 1)."""
        check_admin(request, admin, admin_key)
        try:
            st = await asyncio.get_running_loop().run_in_executor(
                None, engine.call, engine.attach, rid
            )
        except KeyError:
            raise BadRequest(f"no request {rid!r} moved in to be attached", 404, param="request_id")
        return StreamingResponse(
            stream_events(rid, [st], SamplingParams(), chat, True, True),
            media_type="text/event-stream",
        )

    def sampling_params(
        body: dict,
        max_tokens,
        logprobs,
        logprobs_param: str = "logprobs",
        prompt_logprobs: Optional[int] = None,
    ) -> SamplingParams:
        kw = {dst: body[src] for src, dst in SAMPLING_FIELDS.items() if body.get(src) is not None}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = [kw["stop"]]
        if max_tokens is None:
            max_tokens = 16
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1:
            max_tokens = min(max_tokens, llm.max_model_len)
        params = SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kw
        )
        problem = params.problem()
        if problem:  # the message starts with the field's name; name it as the request did
            name = problem.split(" ", 1)[0]
            param = logprobs_param if name == "logprobs" else name
            raise BadRequest(param + problem[len(name) :], param=param)
        return params

    def complete_response(
        rid: str,
        choices: List["Choice"],
        prompt_tokens: int,
        cached: int,
        chat: bool,
        token_ids: bool,
        echo: Optional["Echo"] = None,
    ) -> dict:
        out, completion = [], 0
        for c in choices:
            if echo is not None:
                c.echo(echo, llm.tokenizer)
            completion += len(c.token_ids)
            if chat:
                out.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c.logprobs, llm.tokenizer),
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {
                        "index": c.index,
                        "text": c.head + c.text,
                        "finish_reason": c.finish_reason,
                        "logprobs": completion_logprobs(
                            c.logprobs,
                            llm.tokenizer,
                            c.head_logprobs,
                            0 if echo else len(c.prompt_text(llm.tokenizer)),
                        )[0],
                    }
                )
            if token_ids:
                out[-1]["token_ids"] = c.token_ids
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": out,
            "usage": usage(prompt_tokens, completion, cached),
        }

    async def stream_events(
        rid,
        streams,
        params: SamplingParams,
        chat: bool,
        include_usage: bool,
        token_ids: bool = False,
        echo: Optional["Echo"] = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new token of each choice, ``[DONE]`` at the end. The
        status line went out with the headers, so a failure after them is an error event, still
        followed by ``[DONE]``. If the client goes away, the response is cancelled here and the
        requests are aborted."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        counts, counted, finished = {"prompt": 0, "completion": 0, "cached": 0}, set(), set()
        offsets: Dict[
            int, int
        ] = {}  # completions' text_offset so far, per choice (set by its first chunk)
        heads: Dict[int, Choice] = {}  # per prompt: its first output, and what echo puts first

        def chunk(choices, **extra) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": model_name,
                        "choices": choices,
                        **extra,
                    }
                )
                + "\n\n"
            )

        def error_event(e: BaseException) -> str:
            status = (
                503 if isinstance(e, EngineDead) else 408 if isinstance(e, RequestTimeout) else 500
            )
            return "data: " + json.dumps(error_body(f"{type(e).__name__}: {e}", status)) + "\n\n"

        merged = _merge(streams)
        try:
            try:
                if chat:
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for i in range(len(streams) * params.n)
                        ]
                    )
                async for i, out in merged:
                    if isinstance(out, BaseException):
                        yield error_event(out)
                        continue
                    if isinstance(out, Moved):  # a router attaches to it there
                        yield (
                            "data: "
                            + json.dumps(
                                {
                                    "ringkv_moved": {
                                        "index": i,
                                        "to": out.to,
                                        "request_id": out.request_id,
                                    }
                                }
                            )
                            + "\n\n"
                        )
                        continue
                    first = {}
                    if i not in counted:
                        head = heads[i] = Choice(-1)
                        head.first = out
                        if echo is not None:
                            head.echo(echo, llm.tokenizer)
                        counted.add(i)
                        counts["prompt"] += len(out.prompt_token_ids)
                        counts["cached"] += out.num_cached_tokens
                        if token_ids:
                            first = {"prompt_token_ids": out.prompt_token_ids}
                    for o in out.outputs:
                        index = i * params.n + o.index
                        done = o.finish_reason is not None and index not in finished
                        text, ids, lps = o.text, o.token_ids, o.logprobs
                        if (
                            echo is not None and echo.zero
                        ):  # max_tokens 0: the token computed is not returned
                            text, ids, lps = "", [], (None if lps is None else [])
                        opening = (
                            index not in offsets
                        )  # the choice's first chunk (echo: with the prompt)
                        if not ids and not done and not opening:
                            continue
                        counts["completion"] += len(ids)
                        reason = _reason(o.finish_reason) if done else None
                        finished |= {index} if done else set()
                        if chat:
                            c = {
                                "index": index,
                                "delta": {"content": text},
                                "logprobs": chat_logprobs(lps, llm.tokenizer),
                                "finish_reason": reason,
                            }
                        else:
                            head = heads[i]
                            if opening:
                                offsets[index] = 0 if echo else len(head.prompt_text(llm.tokenizer))
                            lp, offsets[index] = completion_logprobs(
                                lps,
                                llm.tokenizer,
                                head.head_logprobs if opening else None,
                                offsets[index],
                            )
                            c = {
                                "index": index,
                                "text": (head.head if opening else "") + text,
                                "finish_reason": reason,
                                "logprobs": lp,
                            }
                        offsets.setdefault(index, 0)
                        if token_ids:
                            c["token_ids"] = ids
                        yield chunk([c], **first)
                        first = {}
                if include_usage:
                    yield chunk(
                        [], usage=usage(counts["prompt"], counts["completion"], counts["cached"])
                    )
            except Exception as e:  # noqa: BLE001 - the stream still ends with the error and [DONE]
                yield error_event(e)
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            for st in streams:
                await st.aclose()  # aborts whatever is unfinished (a disconnect)

    return app


class Echo:
    """``/v1/completions`` with ``echo``: each choice starts with the prompt (and its log-probs
    when asked for); ``zero``: ``max_tokens`` 0, the token computed is dropped."""

    def __init__(self, zero: bool):
        self.zero = zero


async def in_thread(fn, *args):
    """``fn(*args)`` on a daemon thread of its own (a migration's waits never hold the process
    open at exit, as the default executor's threads would)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=run, name="ringkv-migrate", daemon=True).start()
    return await future


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Choice:
    """One choice of a non-streamed answer, accumulated from delta outputs."""

    def __init__(self, index: int):
        self.index, self.text, self.token_ids, self.logprobs, self.finish_reason = (
            index,
            "",
            [],
            None,
            None,
        )
        self.first = None  # its request's first output (the prompt's ids and log-probs)
        self.head, self.head_logprobs = "", None  # what echo puts before the completion

    def prompt_text(self, tok) -> str:
        p = self.first.prompt if self.first is not None else ""
        if isinstance(p, str):
            return p
        return "" if tok is None or self.first is None else tok.decode(self.first.prompt_token_ids)

    def echo(self, echo: Echo, tok) -> None:
        """The prompt before the completion: its text, and (log-probs asked) one entry per prompt
        token, the first without a log-prob (nothing predicts it)."""
        if echo.zero:
            self.text, self.token_ids = "", []
            self.logprobs = None if self.logprobs is None else []
        first = self.first
        self.head = self.prompt_text(tok)
        if first is not None and first.prompt_logprobs is not None:
            ids, top = (
                first.prompt_token_ids,
                first.prompt_top_logprobs or [None] * len(first.prompt_logprobs),
            )
            self.head_logprobs = [Logprob(ids[0], None, None)] + [
                Logprob(t, v, list(k or [])) for t, v, k in zip(ids[1:], first.prompt_logprobs, top)
            ]

    def add(self, o) -> None:
        self.text += o.text
        self.token_ids += o.token_ids
        if o.logprobs is not None:
            self.logprobs = (self.logprobs or []) + o.logprobs
        self.finish_reason = _reason(o.finish_reason)


async def _merge(streams):
    """``(stream index, output)`` from all streams as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, st):
        try:
            async for out in st:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _collect(request, streams, params: SamplingParams):
    """Every choice's final text, tokens and log-probs, and the prompt tokens; aborts all if
    the client disconnects meanwhile."""
    choices = [Choice(i) for i in range(len(streams) * params.n)]
    prompt_tokens, cached = {}, {}

    async def run():
        async for i, out in _merge(streams):
            if isinstance(out, BaseException):
                raise out
            if isinstance(out, Moved):  # a non-streamed answer cannot follow it (a router streams)
                raise EngineDead(f"the request moved to instance {out.to!r}")
            prompt_tokens[i] = len(out.prompt_token_ids)
            cached.setdefault(i, out.num_cached_tokens)
            for o in out.outputs:
                c = choices[i * params.n + o.index]
                c.first = c.first or out
                c.add(o)

    work = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.5)
            if done:
                work.result()
                return choices, sum(prompt_tokens.values()), sum(cached.values())
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not work.done():
            work.cancel()
        for st in streams:
            await st.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes: by its Content-Length before
    anything is read, else (chunked) as soon as the chunks read so far pass it."""
    too_big = BadRequest(
        f"the request body is larger than {limit} bytes (ringkv serve --max-request-bytes)",
        413,
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def stream_flags(body: dict) -> Tuple[bool, bool]:
    """``(stream, stream_options.include_usage)``, checked before anything is streamed."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream not in (None, True, False):
        raise BadRequest(f"stream must be a bool, got {stream!r:.80}", param="stream")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(
            f"stream_options must be an object or null, got {options!r:.80}", param="stream_options"
        )
    usage = (options or {}).get("include_usage")
    if usage not in (None, True, False):
        raise BadRequest(
            f"stream_options.include_usage must be a bool, got {usage!r:.80}",
            param="stream_options",
        )
    return bool(stream), bool(usage)


def completion_prompts(prompt) -> List:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))
            for p in prompt
        )
    ):
        return list(prompt)
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of those",
        param="prompt",
    )


def _text_content(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(t, str) for t in parts):
            return "".join(parts)
    if content is None:
        return ""
    raise BadRequest(
        "messages: content must be a string or a list of {type: text, text: string} parts",
        param="messages",
    )


def _reason(reason: Optional[str]) -> Optional[str]:
    return {"stop": "stop", "length": "length"}.get(reason, reason)


def token_text(tokenizer, token_id: int) -> str:
    """How a token reads in log-prob listings (its id when there is no tokenizer)."""
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


def completion_logprobs(
    lps: Optional[List[Logprob]], tok, head: Optional[List[Logprob]] = None, offset: int = 0
):
    """OpenAI's legacy ``logprobs`` of ``head + lps`` (``head``: echo's prompt entries; the
    first has no log-prob), ``text_offset`` counted from ``offset``; and the offset after them."""
    if lps is None and head is None:
        return None, offset
    lps = (head or []) + (lps or [])
    tokens = [token_text(tok, lp.token_id) for lp in lps]
    starts = []
    for t in tokens:
        starts.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [
            None if lp.top is None else {token_text(tok, t): v for t, v in lp.top} for lp in lps
        ],
        "text_offset": starts,
    }, offset


def chat_logprobs(lps: Optional[List[Logprob]], tok):
    if lps is None:
        return None

    def entry(t: int, v: float) -> dict:
        text = token_text(tok, t)
        return {"token": text, "logprob": v, "bytes": list(text.encode())}

    return {
        "content": [
            dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ]
    }


def prometheus(engine: AsyncEngine) -> str:
    m, g = engine.metrics, engine.gauges
    lines = [
        "# HELP ringkv_requests_running Requests being computed.",
        "# TYPE ringkv_requests_running gauge",
        f"ringkv_requests_running {g['running']}",
        "# HELP ringkv_requests_waiting Requests waiting to be admitted.",
        "# TYPE ringkv_requests_waiting gauge",
        f"ringkv_requests_waiting {g['waiting']}",
        "# HELP ringkv_kv_cache_usage_ratio Fraction of KV cache blocks held by requests.",
        "# TYPE ringkv_kv_cache_usage_ratio gauge",
        f"ringkv_kv_cache_usage_ratio {g['kv_usage']:.6f}",
        "# HELP ringkv_prefix_cache_hit_rate Prompt blocks served from the prefix cache / blocks looked up.",
        "# TYPE ringkv_prefix_cache_hit_rate gauge",
        f"ringkv_prefix_cache_hit_rate {g['hits'] / g['queries'] if g['queries'] else 0.0:.6f}",
        "# TYPE ringkv_prefix_cache_hits_total counter",
        f"ringkv_prefix_cache_hits_total {g['hits']}",
        "# TYPE ringkv_prefix_cache_queries_total counter",
        f"ringkv_prefix_cache_queries_total {g['queries']}",
        "# HELP ringkv_prompt_tokens_total Prompt tokens of admitted requests.",
        "# TYPE ringkv_prompt_tokens_total counter",
        f"ringkv_prompt_tokens_total {m.prompt_tokens}",
        "# HELP ringkv_generation_tokens_total Tokens generated.",
        "# TYPE ringkv_generation_tokens_total counter",
        f"ringkv_generation_tokens_total {m.generation_tokens}",
        "# HELP ringkv_generation_tokens_per_second Tokens generated per second over the last 10 s.",
        "# TYPE ringkv_generation_tokens_per_second gauge",
        f"ringkv_generation_tokens_per_second {engine.tokens_per_second():.3f}",
        "# HELP ringkv_requests_finished_total Finished requests by reason.",
        "# TYPE ringkv_requests_finished_total counter",
    ]
    lines += [
        f'ringkv_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(m.finished.items())
    ]
    lines += [
        "# HELP ringkv_time_to_first_token_seconds Time from admission to the first token.",
        "# TYPE ringkv_time_to_first_token_seconds histogram",
    ]
    lines += [
        f'ringkv_time_to_first_token_seconds_bucket{{le="{b}"}} {n}'
        for b, n in zip(TTFT_BUCKETS, m.ttft_buckets)
    ]
    lines += [
        f'ringkv_time_to_first_token_seconds_bucket{{le="+Inf"}} {m.ttft_count}',
        f"ringkv_time_to_first_token_seconds_sum {m.ttft_sum:.6f}",
        f"ringkv_time_to_first_token_seconds_count {m.ttft_count}",
    ]
    return "\n".join(lines) + "\n"
