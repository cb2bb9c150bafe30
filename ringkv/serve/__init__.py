"""An OpenAI-compatible HTTP server over the engine (``ringkv serve``)."""

from __future__ import annotations

from typing import Optional

from .engine import AsyncEngine, EngineDead

__all__ = ["AsyncEngine", "EngineDead", "build_app", "serve", "follow_forever"]


def build_app(engine: AsyncEngine, model_name: str, max_request_bytes: Optional[int] = None, **kw):
    from .app import build_app as build

    return build(engine, model_name, max_request_bytes, **kw)


def serve(
    llm,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "ringkv",
    log_level: str = "warning",
    max_request_bytes: Optional[int] = None,
    instance_id: Optional[str] = None,
    admin: bool = False,
    admin_key: Optional[str] = None,
    api_key: Optional[str] = None,
    protect_metrics: bool = False,
    max_waiting: Optional[int] = None,
    request_timeout: Optional[float] = None,
) -> None:
    """Serve ``llm`` until interrupted; request bodies over ``max_request_bytes`` (default
    16 MiB) get a 413. ``instance_id`` names it in the ``x-ringkv-instance`` header (default
    ``host:port``); ``admin`` (or an ``admin_key``) turns on the endpoints a router drives;
    ``api_key``: ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (and ``/metrics`` with
    ``protect_metrics``); ``max_waiting``: a 429 past that many waiting requests;
    ``request_timeout``: seconds after which a request is aborted. Under
    torchrun, call it on rank 0; the other ranks must run ``follow_forever(llm)`` (``ringkv serve``
    does both)."""
    import uvicorn

    admin = admin or admin_key is not None
    engine = AsyncEngine(
        llm, kv_events=admin, max_waiting=max_waiting, request_timeout=request_timeout
    )
    app = build_app(
        engine,
        model_name,
        max_request_bytes,
        instance_id=instance_id or f"{host}:{port}",
        admin=admin,
        admin_key=admin_key,
        api_key=api_key,
        protect_metrics=protect_metrics,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
        llm.cluster.shutdown_followers()


def follow_forever(llm) -> None:
    """Torchrun ranks > 0 of a served engine: run rank 0's steps until it shuts down."""
    while llm.cluster.follow(idle=True)["kind"] != "shutdown":
        pass
