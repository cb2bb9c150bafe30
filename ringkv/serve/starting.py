"""An instance that answers while its engine is being built (``ringkv serve``'s start-up).

Building the engine loads the model and, with ``compile_decode``, compiles its decode step: from
about a second to minutes on a cold compile cache. ``ringkv serve`` opens its port first and
builds the engine behind a ``Starting`` app, which answers every request itself until the real
app is ready:

- ``/health``: 503 ``{"status": "starting", "detail": ...}``, ``detail`` the start-up's last step
  (``"loading the model"``, then what is compiling, for which batch sizes: the ``ringkv`` logger's
  messages while the engine is built);
- any other path: 503 with ``Retry-After`` and an OpenAI error body saying the engine is starting
  (``/internal/state`` too: a router keeps such an instance *starting*, neither up nor dead);
- a build that failed: 503 ``{"status": "error", "detail": why}`` until the server stops.

Then every request goes to the real app (``ready``), with nothing of this left in its path but one
attribute test.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Callable, Optional

from .openai import error_body

RETRY_AFTER_S = 5


class Starting:
    """The ASGI app of an instance whose engine is being built (see the module's docstring)."""

    def __init__(self, detail: str = "loading the model"):
        self.app = None  # the real app, once ready
        self.detail, self.error = detail, None

    def ready(self, app) -> None:
        self.app = app

    def failed(self, why: str) -> None:
        self.error = why

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # the real app has no start-up or shut-down of its own
            while True:
                kind = (await receive())["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        status = "error" if self.error else "starting"
        detail = self.error or self.detail
        if scope["path"] == "/health":
            body = {"status": status, "detail": detail}
        else:
            why = "failed to start" if self.error else "is starting"
            body = error_body(f"the engine {why}: {detail}", 503, code=status)
            body["status"] = status
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"retry-after", b"%d" % RETRY_AFTER_S)]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class Progress(logging.Handler):
    """While the engine is built: the ``ringkv`` logger's messages (INFO up) become
    ``starting.detail``; those of WARNING up are still printed to stderr, as without it."""

    def __init__(self, starting: Starting):
        super().__init__(logging.INFO)
        self.starting = starting
        self.logger = logging.getLogger("ringkv")
        self.level_was: Optional[int] = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.starting.detail = message.removeprefix("ringkv: ")
        if record.levelno >= logging.WARNING and not logging.getLogger().handlers:
            print(message, file=sys.stderr, flush=True)  # what logging's last resort prints

    def __enter__(self) -> "Progress":
        self.level_was = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_was)


def build_behind(gate: Starting, server, build: Callable, ready: Callable) -> dict:
    """Build the engine on a thread while ``server`` (a ``uvicorn.Server`` of ``gate``) answers:
    once it listens, ``build()`` (its log lines becoming ``gate.detail``), then
    ``gate.ready(ready(llm))``. Returns the dict the thread fills: ``llm``, and ``error`` (the
    exception) when either step raised, which also stops the server."""
    out: dict = {}

    def run() -> None:
        while not server.started and not server.should_exit:  # the port opens first
            time.sleep(0.01)
        try:
            with Progress(gate):
                out["llm"] = build()
            gate.ready(ready(out["llm"]))
        except BaseException as e:  # noqa: BLE001 - the caller re-raises it
            out["error"] = e
            gate.failed(f"{type(e).__name__}: {e}"[:500])
            server.should_exit = True

    threading.Thread(target=run, name="ringkv-start", daemon=True).start()
    return out
