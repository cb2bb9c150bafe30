"""A router's upstream streams: a client request's prompt (``Sub``) streamed from an instance,
followed across moves and failures.

- **Requests.** Each sub-request is always streamed from the instance (``return_token_ids``), so
  the router knows every token each choice got; its choice chunks go to the router's front as
  ``Delta``s, and its end (an error the client gets) as a ``Failure``.
- **Migration.** A stream that ends with ``ringkv_moved`` is followed to the target's
  ``/internal/attach``: the client's stream goes on with no gap and no duplicate.
- **Failover.** When an instance's stream breaks (the process died, its engine failed), the
  unfinished choices continue on a survivor: a choice that got no token yet is sent again as
  it was; one that did continues from its prompt plus the tokens it got (recomputed there),
  asking for the tokens it still may generate. Greedy text is the same as without the
  failure; a sampled choice continues with a fresh random stream.

A ``Sub`` works for a ``Router`` (``serve/router.py``, above this module): it asks it where to go
(``pick_waiting``), which instances are up, and opens its streams (``open``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from dataclasses import dataclass, field
from typing import AsyncIterator, List, Optional, Union

from .openai import PULL_HEADER, REQUEST_ID_HEADER, BadRequest
from .policy import DOWN_AFTER, POLL_S, Instance, InstanceState, NoInstance


def httpx_module():
    """``httpx``, imported when a router first needs it."""
    import httpx

    return httpx


class Failed(Exception):
    """An instance's stream broke: the choices go on elsewhere."""


class Full(Exception):
    """An instance's waiting queue is full (its 429): another may take the request."""


@dataclass
class ChoiceState:
    tokens: List[int] = field(default_factory=list)  # token ids delivered to the client
    finish_reason: Optional[str] = None


@dataclass
class Delta:
    """A sub-request's event: the chunk ``data`` of its choice ``choice`` (one choice each)."""

    choice: int
    data: dict


@dataclass
class Failure:
    """A sub-request's last event: ``error`` ends the client's answer; ``reject``: an instance
    refused the request (a 4xx), else none could serve it."""

    error: Exception
    reject: bool


END = None  # a sub-request's queue after its last stream ended


@dataclass
class Attempt:
    """One stream from one instance: the choices (indexes of its sub-request) it carries."""

    instance: Instance
    rid: str  # the engine's request id there
    choices: List[int]  # its choice i -> the sub-request's choice choices[i]
    pull: Optional[tuple] = None  # (holder URL, tokens): the pull hint sent with it
    moved_to: Optional[str] = None
    live: bool = True  # its stream is being read
    moved_at: float = float("-inf")  # when the load policy last moved it (monotonic)


class Sub:
    """A client request's prompt ``index``: sent to instances, followed across moves and
    failures."""

    def __init__(self, router, rid: str, index: int, path: str, body: dict, ids: List[int], n: int):
        self.router, self.rid, self.index, self.path = router, rid, index, path
        self.body, self.ids = body, ids
        self.n, self.choices = n, [ChoiceState() for _ in range(n)]
        self.prompt_tokens, self.cached = len(ids), None
        self.attempts: List[Attempt] = []
        self.queue: asyncio.Queue = asyncio.Queue()  # Delta | Failure | END
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()  # taken
        self.tasks: List[asyncio.Task] = []
        self.running = 0  # its tasks still streaming
        self.finished_on: Optional[str] = None
        self.ids_seq = itertools.count()

    async def events(self) -> AsyncIterator[Union[Delta, Failure]]:
        """What the client gets of this prompt, until every stream of it ended."""
        while (item := await self.queue.get()) is not END:
            yield item

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def body_for(self, choices: List[int]) -> dict:
        """The request that continues ``choices``: as sent, if none got a token yet; else one
        choice from its prompt plus the tokens it got, for the tokens it may still generate."""
        b = dict(
            self.body, stream=True, stream_options={"include_usage": True}, return_token_ids=True
        )
        got = [self.choices[c].tokens for c in choices]
        if len(choices) == self.n and not any(got):
            return b
        (c,) = choices
        ids = self.ids + self.choices[c].tokens
        b["n"], b["echo"] = 1, False  # (echo: the client has the prompt already)
        if "messages" in b:
            b["prompt_token_ids"] = ids
        else:
            b["prompt"] = ids
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(b.get(name), int):
                b[name] = max(1, b[name] - len(self.choices[c].tokens))
        if "messages" not in b and b.get("max_tokens") is None:
            b["max_tokens"] = max(1, 16 - len(self.choices[c].tokens))  # /v1/completions' default
        if b.get("seed") is not None:  # its random stream is lost: a reproducible new one
            b["seed"] = random.Random(f"{b['seed']}/{c}/{len(ids) - len(self.ids)}").getrandbits(63)
        return b

    def start(self, choices: List[int], exclude: frozenset = frozenset()) -> None:
        self.running += 1
        self.tasks.append(asyncio.create_task(self.run(choices, exclude)))

    async def run(self, choices: List[int], exclude: frozenset) -> None:
        try:
            await self._run(choices, exclude)
        except Exception as e:  # noqa: BLE001 - never leave the client waiting
            self.fail(e)
        finally:
            self.running -= 1
            if not self.running:  # every stream of it ended (its usage read): the last event
                self.queue.put_nowait(END)

    async def _run(self, choices: List[int], exclude: frozenset) -> None:
        """Stream ``choices`` from an instance, across moves; on a failure, go on elsewhere."""
        r = self.router
        tried = set(exclude)
        while True:
            try:
                inst, hint = await r.pick_waiting(
                    self.ids, self.body.get("cache_salt"), frozenset(tried)
                )
            except NoInstance as e:
                self.fail(e)
                return
            attempt = Attempt(
                inst, f"{self.rid}.{next(self.ids_seq)}" if self.attempts else self.rid, choices
            )
            attempt.pull = hint
            self.attempts.append(attempt)
            try:
                await self.follow(attempt, self.body_for(choices))
                return
            except BadRequest as e:
                self.fail(e, reject=True)
                return
            except Full as e:
                tried.add(attempt.instance.id)
                if all(i.id in tried for i in r.up()):  # every instance is full
                    retry = {"Retry-After": "1"}
                    self.fail(
                        BadRequest(str(e), 429, code="too_many_requests", headers=retry), True
                    )
                    return
            except Failed as e:
                inst = attempt.instance
                r.lost(inst, str(e))
                inst.counters["failovers"] += 1
                tried.add(inst.id)
                left = [c for c in choices if self.choices[c].finish_reason is None]
                if not left:
                    return
                whole = len(left) == self.n and not any(self.choices[c].tokens for c in left)
                if len(left) > 1 and not whole:  # each choice continues from its own tokens
                    for c in left[1:]:
                        self.start([c], frozenset(tried))
                    left = left[:1]
                choices = left
                if len(tried) >= len(r.instances):
                    tried = {inst.id}  # a restarted instance may take it again

    def fail(self, e: Exception, reject: bool = False) -> None:
        """Before the instance took the request: the client's answer is this error; after: an
        error event ends its stream."""
        if not self.accepted.done():
            self.accepted.set_exception(e)
        else:
            self.queue.put_nowait(Failure(e, reject))

    async def follow(self, attempt: Attempt, body: dict) -> None:
        r = self.router
        inst = attempt.instance
        inst.inflight += 1
        inst.counters["requests"] += 1
        try:
            url, method, payload = inst.url + self.path, "POST", body
            extra = {REQUEST_ID_HEADER: attempt.rid}
            if attempt.pull is not None:
                extra[PULL_HEADER] = "%s %d" % attempt.pull
                inst.counters["pull_hints"] += 1
            while True:
                await self.while_up(attempt, self.stream(attempt, method, url, payload, extra))
                if attempt.moved_to is None:
                    return
                target = r.by_id.get(attempt.moved_to)
                if target is None:
                    raise Failed(f"request moved to unknown instance {attempt.moved_to!r}")
                inst.inflight -= 1
                inst = attempt.instance = target
                inst.inflight += 1
                attempt.moved_to = None
                url, method, payload = f"{inst.url}/internal/attach/{attempt.rid}", "GET", None
                extra = {REQUEST_ID_HEADER: attempt.rid}
                if "messages" in self.body:
                    url += "?chat=true"
        except (OSError, httpx_module().HTTPError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            raise Failed(f"instance {inst.id}: {type(e).__name__}: {e}") from None
        finally:
            inst.inflight -= 1
            attempt.live = False

    async def stream(self, attempt: Attempt, method: str, url: str, payload, extra: dict) -> None:
        """Open the attempt's stream at its instance and ``read`` it to its end."""
        inst = attempt.instance
        async with self.router.open(method, url, payload, extra) as resp:
            if resp.status_code >= 400:
                text = (await resp.aread()).decode(errors="replace")
                if resp.status_code == 429:
                    raise Full(BadRequest.relayed(429, text))
                if resp.status_code < 500:
                    raise BadRequest.relayed(resp.status_code, text)
                raise Failed(f"instance {inst.id} answered {resp.status_code}: {text[:200]}")
            if not self.accepted.done():
                self.accepted.set_result(inst.id)
            await self.read(attempt, resp)

    async def while_up(self, attempt: Attempt, work) -> None:
        """Await ``work`` (the attempt's ``stream``), given up (``Failed``) once the polls find
        its instance down: a host whose link went down sends nothing, not even a reset, and
        neither the wait for its answer's headers nor a read has a timeout (a stream may
        rightly be silent for long): either would wait for it until its link came back."""
        inst = attempt.instance
        reading = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=POLL_S)
                if done:
                    return reading.result()
                if inst.state == InstanceState.DOWN or inst.failed_polls >= DOWN_AFTER:
                    raise Failed(
                        f"instance {inst.id} is down ({inst.error}); its stream went silent"
                    )
        finally:
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reading

    async def read(self, attempt: Attempt, resp) -> None:
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:  # the engine failed mid-stream: the choices go on elsewhere
                raise Failed(f"instance {attempt.instance.id}: {ev['error'].get('message')}")
            if "ringkv_moved" in ev:
                attempt.moved_to = ev["ringkv_moved"]["to"]
                continue
            if ev.get("usage") and not ev.get("choices"):
                if self.cached is None or attempt.rid != self.rid:  # the latest stream's count
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    )
                    self.cached = min(cached, self.prompt_tokens)
                continue
            for c in ev.get("choices", []):
                if "delta" in c and "role" in c["delta"] and not c["delta"].get("content"):
                    continue  # a chat stream's opening chunk: the front sends its own
                index = attempt.choices[c["index"]] if c["index"] < len(attempt.choices) else None
                if index is None:
                    raise Failed(
                        f"instance {attempt.instance.id} streamed an unknown choice {c['index']}"
                    )
                state = self.choices[index]
                if state.finish_reason is not None:
                    continue
                state.tokens += c.get("token_ids") or []
                if c.get("finish_reason") is not None:
                    state.finish_reason = c["finish_reason"]
                    self.finished_on = attempt.instance.id
                await self.queue.put(Delta(index, ev | {"choices": [c]}))
        if attempt.moved_to is None and (
            not done or any(self.choices[c].finish_reason is None for c in attempt.choices)
        ):
            raise Failed(f"instance {attempt.instance.id}: the stream ended early")
