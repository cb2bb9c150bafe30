"""The OpenAI protocol, written once for the instance (``app.py``) and the router (``router.py``).

- **Headers and ids.** ringkv's own headers between a router and its instances (``*_HEADER``)
  and a completion's id (``completion_id``).
- **Requests.** ``parse_json`` reads a body; ``CompletionRequest`` / ``ChatRequest`` check every
  field an instance takes (a ``BadRequest``: status, message and ``param`` as OpenAI names them)
  and build its ``SamplingParams`` (``parse_request``); ``RoutedRequest`` is what a router takes
  of a request it splits over instances, checked by the same parser, so that a router and an
  instance refuse the same body alike.
- **Choices.** ``Renderer`` turns an engine's ``RequestOutput`` deltas into OpenAI choice dicts
  (text, log-probs in the completion or chat form, echo, ``text_offset``, finish reason, usage);
  ``Collected`` folds a choice's dicts into its non-streamed answer (log-probs spliced). A router
  folds the choice dicts its instances stream the same way.
  ``fold`` folds a whole answer's choices.
- **Streams.** ``Encoder`` writes the server-sent events (chunks, the chat opening, usage, errors,
  ``[DONE]``); ``stream_frame`` puts them in their order around a front's chunks; ``merge`` reads
  many sub-streams as one, as named records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ClassVar, Dict, List, Optional

from ..engine import SamplingParams
from ..engine.params import Logprob

MAX_REQUEST_BYTES = 16 << 20  # default request body limit (ringkv serve --max-request-bytes)
# the request fields SamplingParams takes as they are (OpenAI's names, and vLLM's extensions)
SAMPLING_FIELDS = """temperature top_p top_k min_p n seed stop presence_penalty frequency_penalty
repetition_penalty ignore_eos stop_token_ids""".split()
DONE = "data: [DONE]\n\n"
# ringkv's own headers, between a router and its instances
ADMIN_HEADER = "x-ringkv-admin-key"  # the admin key (the endpoints a router drives)
PULL_HEADER = "x-ringkv-pull"  # a router's pull hint: "<holder URL> <tokens>"
REQUEST_ID_HEADER = "x-ringkv-request-id"  # a router's id for a request (it may migrate)
INSTANCE_HEADER = "x-ringkv-instance"  # the instance that served the request
UNCAPPED = 1 << 62  # a router's max_model_len: the instances cap max_tokens at their own


def completion_id(chat: bool) -> str:
    """A new completion's id: ``chatcmpl-`` (chat) or ``cmpl-``, then 24 hex digits."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


class BadRequest(Exception):
    """A request refused with ``status`` and an OpenAI error body (``param``, ``code``)."""

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

    @classmethod
    def relayed(cls, status: int, text: str) -> "BadRequest":
        """An upstream instance's error response, as this front's own."""
        try:
            err = json.loads(text)["error"]
            return cls(err.get("message", text), status, err.get("param"), err.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(text[:500], status)


def error_body(message: str, status: int, param=None, code=None) -> dict:
    kind = (
        "invalid_request_error"
        if status < 500
        else ("service_unavailable" if status == 503 else "internal_error")
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------
async def read_body(request, limit: int) -> bytes:
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


def parse_json(raw: bytes, model: Optional[str] = None) -> Dict[str, Any]:
    """A body as a JSON object; with ``model``, one that names another model is a 404."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also bad UTF-8, huge ints, deep nesting
        raise BadRequest(f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if model is not None and body.get("model") not in (None, model):
        raise BadRequest(
            f"the model {body.get('model')!r} does not exist; this server serves {model!r}",
            404,
            "model",
            "model_not_found",
        )
    return body


def _bool(body: dict, name: str, param: Optional[str] = None) -> bool:
    value = body.get(name)
    if value not in (None, True, False):
        raise BadRequest(f"{name} must be a bool, got {value!r:.80}", param=param or name)
    return bool(value)


def stream_flag(body: dict) -> bool:
    return _bool(body, "stream")


def stream_usage(body: dict) -> bool:
    """``stream_options.include_usage``."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(
            f"stream_options must be an object or null, got {options!r:.80}", param="stream_options"
        )
    value = (options or {}).get("include_usage")
    if value not in (None, True, False):
        raise BadRequest(
            f"stream_options.include_usage must be a bool, got {value!r:.80}",
            param="stream_options",
        )
    return bool(value)


def _ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(prompt) -> List:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str) or (prompt and _ids(prompt)):
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


def chat_messages(body: dict, template: bool = True) -> List[dict]:
    """``messages``, each content as text; ``template``: whether the model has a chat template."""
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise BadRequest(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    if not template:
        raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
    return [dict(m, content=_text_content(m.get("content"))) for m in messages]


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


def sampling_params(
    body: dict,
    max_tokens,
    logprobs,
    max_model_len: int,
    logprobs_param: str = "logprobs",
    prompt_logprobs: Optional[int] = None,
) -> SamplingParams:
    """The request's ``SamplingParams``, refused (the field named as the request did) unless
    valid; ``max_tokens`` is capped at ``max_model_len``."""
    kw = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if isinstance(kw.get("stop"), str):
        kw["stop"] = [kw["stop"]]
    if max_tokens is None:
        max_tokens = 16
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1:
        max_tokens = min(max_tokens, max_model_len)
    params = SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kw
    )
    problem = params.problem()
    if problem:  # the message starts with the field's name
        name = problem.split(" ", 1)[0]
        param = logprobs_param if name == "logprobs" else name
        raise BadRequest(param + problem[len(name) :], param=param)
    return params


@dataclass
class OpenAIRequest:
    """What an instance serves: the checked fields of a completion or chat request."""

    chat: ClassVar[bool]
    prompts: List  # one engine request each: text, token ids, or (chat) a conversation
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage
    token_ids: bool  # return_token_ids
    cache_salt: Optional[str]
    echo: bool = False  # (completions) each choice starts with its prompt (and its log-probs)
    zero: bool = False  # echo with max_tokens 0: the token computed is dropped

    @staticmethod
    def _options(body: dict) -> dict:
        stream, usage = stream_flag(body), stream_usage(body)
        token_ids = _bool(body, "return_token_ids")
        salt = body.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 256):
            raise BadRequest(
                "cache_salt must be a string of 1 to 256 characters", param="cache_salt"
            )
        return dict(stream=stream, include_usage=usage, token_ids=token_ids, cache_salt=salt)


@dataclass
class CompletionRequest(OpenAIRequest):
    """``/v1/completions``."""

    chat: ClassVar[bool] = False

    @classmethod
    def parse(cls, body: dict, max_model_len: int) -> "CompletionRequest":
        prompts = completion_prompts(body.get("prompt"))
        echo = _bool(body, "echo")
        max_tokens, logprobs = body.get("max_tokens", 16), body.get("logprobs")
        zero = echo and max_tokens == 0 and not isinstance(max_tokens, bool)
        params = sampling_params(
            body,
            1 if zero else max_tokens,
            logprobs,
            max_model_len,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
        )
        return cls(prompts, params, echo=echo, zero=zero, **cls._options(body))


@dataclass
class ChatRequest(OpenAIRequest):
    """``/v1/chat/completions``: one conversation, or its ``prompt_token_ids`` (the template
    already applied: a router's failover)."""

    chat: ClassVar[bool] = True

    @classmethod
    def parse(cls, body: dict, max_model_len: int, template: bool = True) -> "ChatRequest":
        prompts: List = [chat_messages(body, template)]
        ids = body.get("prompt_token_ids")
        if ids is not None:
            if not ids or not _ids(ids):
                raise BadRequest(
                    "prompt_token_ids must be a non-empty list of token ids",
                    param="prompt_token_ids",
                )
            prompts = [ids]
        logprobs = _bool(body, "logprobs")
        if body.get("echo"):
            raise BadRequest(
                "echo is for /v1/completions; chat completions do not echo", param="echo"
            )
        top = body.get("top_logprobs") or 0
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", max_model_len))
        params = sampling_params(
            body, max_tokens, top if logprobs else None, max_model_len, "top_logprobs"
        )
        return cls(prompts, params, **cls._options(body))


def parse_request(
    body: dict, chat: bool, max_model_len: int, template: bool = True
) -> "OpenAIRequest":
    """The one parser of a completion (``chat=False``) or chat request, for an instance and a
    router alike (a router passes ``UNCAPPED``: the instances cap ``max_tokens``)."""
    if chat:
        return ChatRequest.parse(body, max_model_len, template)
    return CompletionRequest.parse(body, max_model_len)


@dataclass
class RoutedRequest:
    """What a router takes of a request before it splits it into one sub-request per prompt,
    checked by ``parse_request`` as an instance checks it (a router streams from the instances
    with its own stream options; the client's are these)."""

    chat: bool
    prompts: List  # completions: each prompt; chat: the messages
    n: int
    stream: bool
    include_usage: bool
    token_ids: bool

    @classmethod
    def parse(cls, body: dict, chat: bool) -> "RoutedRequest":
        req = parse_request(body, chat, UNCAPPED)
        prompts = [body["messages"]] if chat else req.prompts
        return cls(chat, prompts, req.params.n, req.stream, req.include_usage, req.token_ids)


# -- choices ----------------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


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


def chat_logprobs(lps: Optional[List[Logprob]], tok) -> Optional[dict]:
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


@dataclass
class Head:
    """What a completion choice starts with: echo's prompt text and log-probs, and the
    ``text_offset`` of its first token."""

    text: str
    logprobs: Optional[List[Logprob]]
    offset: int


class Renderer:
    """One client request's engine outputs (``RequestOutput`` deltas of its prompts' streams) as
    OpenAI choice dicts, with the usage they add up to. Choice ``i * n + k`` is sample ``k`` of
    stream ``i``; a completion's first dict of a choice carries what echo puts first."""

    def __init__(self, req: OpenAIRequest, tokenizer):
        self.req, self.tok, self.n = req, tokenizer, req.params.n
        self.heads: Dict[int, Head] = {}  # per stream, set by its first output
        self.offsets: Dict[int, int] = {}  # a completion choice's text_offset so far
        self.finished: set = set()
        self.prompt = self.completion = self.cached = 0

    def opens(self, i: int, out) -> bool:
        """Whether ``out`` is stream ``i``'s first output (its prompt is counted then)."""
        if i in self.heads:
            return False
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens
        self.heads[i] = self._head(out)
        return True

    def _head(self, out) -> Head:
        if self.req.chat:
            return Head("", None, 0)
        p, tok = out.prompt, self.tok
        text = p if isinstance(p, str) else "" if tok is None else tok.decode(out.prompt_token_ids)
        if not self.req.echo:
            return Head("", None, len(text))
        lps = None
        if out.prompt_logprobs is not None:  # the first prompt token has none: nothing predicts it
            ids = out.prompt_token_ids
            top = out.prompt_top_logprobs or [None] * len(out.prompt_logprobs)
            lps = [Logprob(ids[0], None, None)] + [
                Logprob(t, v, list(k or [])) for t, v, k in zip(ids[1:], out.prompt_logprobs, top)
            ]
        return Head(text, lps, 0)

    def choices(self, i: int, out, every: bool = False):
        """The choice dicts of output ``out`` of stream ``i`` (after ``opens``); ``every``: also
        those that bring nothing new (a stream leaves them out)."""
        for o in out.outputs:
            index = i * self.n + o.index
            done = o.finish_reason is not None and index not in self.finished
            text, ids, lps = o.text, o.token_ids, o.logprobs
            if self.req.zero:  # max_tokens 0: the token computed is not returned
                text, ids, lps = "", [], (None if lps is None else [])
            opening = index not in self.offsets  # the choice's first dict (echo: the prompt)
            if not ids and not done and not opening and not every:
                continue
            self.completion += len(ids)
            reason = o.finish_reason if done else None
            if done:
                self.finished.add(index)
            if self.req.chat:
                self.offsets[index] = 0
                c = {
                    "index": index,
                    "delta": {"content": text},
                    "logprobs": chat_logprobs(lps, self.tok),
                    "finish_reason": reason,
                }
            else:
                head = self.heads[i]
                lp, self.offsets[index] = completion_logprobs(
                    lps,
                    self.tok,
                    head.logprobs if opening else None,
                    head.offset if opening else self.offsets[index],
                )
                c = {
                    "index": index,
                    "text": (head.text if opening else "") + text,
                    "finish_reason": reason,
                    "logprobs": lp,
                }
            if self.req.token_ids:
                c["token_ids"] = ids
            yield c

    def usage(self) -> dict:
        return usage(self.prompt, self.completion, self.cached)


class Collected:
    """One choice of a non-streamed answer, folded from its choice dicts (stream chunks):
    text, token ids, log-probs spliced (either form) and the finish reason."""

    def __init__(self, index: int):
        self.index, self.text, self.token_ids = index, "", []
        self.logprobs: Optional[dict] = None
        self.finish_reason: Optional[str] = None

    def add(self, c: dict) -> None:
        self.text += (c["delta"].get("content") or "") if "delta" in c else (c.get("text") or "")
        self.token_ids += c.get("token_ids") or []
        lp = c.get("logprobs")
        if lp:
            if self.logprobs is None:
                self.logprobs = {k: [] for k in lp}
            for k, v in lp.items():
                if isinstance(v, list):
                    self.logprobs.setdefault(k, []).extend(v)
        if c.get("finish_reason") is not None:
            self.finish_reason = c["finish_reason"]

    def view(self, chat: bool, token_ids: bool) -> dict:
        """The choice in a non-streamed answer (the fields in the order of a stream's chunks)."""
        c: Dict[str, Any] = {"index": self.index}
        if chat:
            c["message"] = {"role": "assistant", "content": self.text}
            c["logprobs"], c["finish_reason"] = self.logprobs, self.finish_reason
        else:
            c["text"], c["finish_reason"], c["logprobs"] = (
                self.text,
                self.finish_reason,
                self.logprobs,
            )
        return c | {"token_ids": self.token_ids} if token_ids else c


async def fold(chunks: AsyncIterator[dict], count: int) -> List[Collected]:
    """A non-streamed answer's ``count`` choices, each folded from its choice dicts in
    ``chunks`` (their ``index``: the client's)."""
    choices = [Collected(i) for i in range(count)]
    async for c in chunks:
        choices[c["index"]].add(c)
    return choices


def response(rid: str, chat: bool, model, choices: List[Collected], token_ids: bool, use) -> dict:
    """A non-streamed answer."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [c.view(chat, token_ids) for c in choices],
        "usage": use,
    }


# -- streams ----------------------------------------------------------------------------------
def event(data) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(data) + "\n\n"


def error_event(message: str, status: int) -> str:
    return event(error_body(message, status))


class Encoder:
    """The chunks of one streamed answer (``id``, ``object``, ``created``, ``model``, then
    ``choices``); ``model`` may be learnt after the first chunk (a router)."""

    def __init__(self, rid: str, chat: bool, model):
        self.rid, self.chat, self.model = rid, chat, model
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())

    def chunk(self, choices: List[dict], **extra) -> str:
        head = {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model}
        return event({**head, "choices": choices, **extra})

    def opening(self, count: int) -> str:
        """A chat stream's first chunk: every choice's role."""
        delta = {"role": "assistant", "content": ""}
        return self.chunk(
            [
                {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                for i in range(count)
            ]
        )

    def usage(self, use: dict) -> str:
        return self.chunk([], usage=use)


async def stream_frame(
    encode: Encoder,
    count: int,
    body: AsyncIterator[str],
    usage: Callable[[], dict],
    include_usage: bool,
    failure: Callable[[Exception], str],
) -> AsyncIterator[str]:
    """A streamed answer's events in their order: (chat) the opening chunk of its ``count``
    choices, the events of ``body``, the usage chunk (``usage()``, read once ``body`` ended; sent
    with ``include_usage``), ``[DONE]``. The status line went out with the headers, so a failure
    of ``body`` is an error event (``failure(e)``), still followed by ``[DONE]``. Closing the
    frame closes ``body`` (a client that went away)."""
    async with contextlib.aclosing(body):
        try:
            if encode.chat:
                yield encode.opening(count)
            async for text in body:
                yield text
            use = usage()
            if include_usage:
                yield encode.usage(use)
        except Exception as e:  # noqa: BLE001 - the stream still ends with the error and [DONE]
            yield failure(e)
        yield DONE


@dataclass
class Item:
    """From ``merge``: the next item of sub-stream ``index``."""

    index: int
    value: Any


@dataclass
class Raised:
    """From ``merge``: sub-stream ``index`` ended with ``error``."""

    index: int
    error: BaseException


async def merge(streams) -> AsyncIterator:
    """``Item``s (and ``Raised``) of every async iterator in ``streams`` as they come, until each
    has ended."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, st):
        try:
            async for value in st:
                await queue.put(Item(i, value))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(Raised(i, e))
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            record = await queue.get()
            if record is None:
                left -= 1
            else:
                yield record
    finally:
        for t in tasks:
            t.cancel()


async def unless_disconnected(work, request):
    """``await work``, cancelled (and ``CancelledError`` raised) if the client of ``request``
    goes away meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
        return task.result()
    finally:
        task.cancel()
