"""The records of a request the async engine serves: its stream (``RequestStream``), its state
on the engine's thread (``Running``; ``Adopted``: moved in, waiting for its client), and how it
may end besides finishing (``Moved``, ``EngineDead``, ``RequestTimeout``; ``Busy``: refused)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..engine import RequestOutput


@dataclass
class Running:
    """A request the engine's thread is serving."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    start: float  # perf_counter() when it was added
    tokens: int = 0  # output tokens delivered so far
    last: float = 0.0  # perf_counter() when its last tokens were delivered (0: none yet here)
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
class Abort:
    """Inbox: stop a request (its client went away)."""

    rid: str


class EngineDead(RuntimeError):
    """The engine failed (a rank died); requests cannot be served."""


class Busy(RuntimeError):
    """The waiting queue is full (``max_waiting``): try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(RuntimeError):
    """A request ran past ``request_timeout``; it was aborted and its blocks freed."""


class RequestStream:
    """The outputs of one request, as an async iterator."""

    def __init__(self, engine, rid: str):
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
