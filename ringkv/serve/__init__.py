"""An OpenAI-compatible HTTP server over the engine (``ringkv serve``)."""

from __future__ import annotations

from typing import Optional

from ..engine.core import with_settings
from .config import ServeConfig
from .engine import AsyncEngine, EngineDead

__all__ = ["AsyncEngine", "EngineDead", "ServeConfig", "build_app", "serve", "follow_forever"]


def build_app(engine: AsyncEngine, model_name: str, max_request_bytes: Optional[int] = None, **kw):
    from .app import build_app as build

    return build(engine, model_name, max_request_bytes, **kw)


def serve(llm, config: Optional[ServeConfig] = None, **settings) -> None:
    """Serve ``llm`` until interrupted, as ``config`` says (``ServeConfig``), or with its fields
    as keywords (``serve(llm, port=8001, api_key=KEY)``; keywords override a given config).
    ``llm``: an ``LLM``, or a function of no arguments that builds one: the port then opens
    first and ``/health`` answers 503 ``{"status": "starting", "detail": ...}`` while it runs
    (``serve/starting.py``); a build that raises stops the server and ``serve`` raises it.
    Request bodies over ``max_request_bytes`` (default 16 MiB) get a 413. ``instance_id``
    names it in the ``x-ringkv-instance`` header (default ``host:port``); ``admin`` (or an
    ``admin_key``) turns on the endpoints a router drives; ``api_key``: ``/v1/*`` needs
    ``Authorization: Bearer <api_key>`` (and ``/metrics`` with ``protect_metrics``);
    ``max_waiting``: a 429 past that many waiting requests; ``request_timeout``: seconds after
    which a request is aborted; ``model_name``: the name clients use (default ``"ringkv"``).
    The front's fields (``replicas``, ``routing``, ...) are not read here. Under torchrun,
    call it on rank 0; the other ranks must run ``follow_forever(llm)`` (``ringkv serve`` does
    both)."""
    import uvicorn

    from .starting import Starting, build_behind

    c = with_settings(ServeConfig, config, settings, "serve")
    gate, engines = Starting(), []
    server = uvicorn.Server(uvicorn.Config(gate, host=c.host, port=c.port, log_level=c.log_level))

    def ready(built):
        engines.append(_engine(built, c))
        return _app(engines[0], c)

    built = build_behind(gate, server, llm if callable(llm) else lambda: llm, ready)
    try:
        server.run()
    finally:
        for engine in engines:
            engine.shutdown()
        if "llm" in built:
            built["llm"].shutdown_followers()
            if callable(llm):  # built here: closed here
                built["llm"].close()
    if "error" in built:
        raise built["error"]


def _engine(llm, c: ServeConfig) -> AsyncEngine:
    return AsyncEngine(
        llm,
        kv_events=c.admin or c.admin_key is not None,
        max_waiting=c.max_waiting,
        request_timeout=c.request_timeout,
        pull_policy=c.kv_pull_policy,
    )


def _app(engine: AsyncEngine, c: ServeConfig):
    return build_app(
        engine,
        "ringkv" if c.model_name is None else c.model_name,
        c.max_request_bytes,
        instance_id=c.instance_id or f"{c.host}:{c.port}",
        admin=c.admin or c.admin_key is not None,
        admin_key=c.admin_key,
        api_key=c.api_key,
        protect_metrics=c.protect_metrics,
    )


def follow_forever(llm) -> None:
    """Torchrun ranks > 0 of a served engine: run rank 0's steps until it shuts down."""
    while llm.follow(idle=True)["kind"] != "shutdown":
        pass
