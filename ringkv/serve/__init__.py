"""An OpenAI-compatible HTTP server over the engine (``ringkv serve``)."""

from __future__ import annotations

from typing import Optional

from .engine import AsyncEngine, EngineDead

__all__ = ["AsyncEngine", "EngineDead", "build_app", "serve", "follow_forever"]


def build_app(engine: AsyncEngine, model_name: str, max_request_bytes: Optional[int] = None):
    from .app import build_app as build

    return build(engine, model_name, max_request_bytes)


def serve(llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "ringkv",
          log_level: str = "warning", max_request_bytes: Optional[int] = None) -> None:
    """Serve ``llm`` until interrupted; request bodies over ``max_request_bytes`` (default
    16 MiB) get a 413. Under torchrun, call it on rank 0; the other ranks must run
    ``follow_forever(llm)`` (``ringkv serve`` does both)."""
    import uvicorn

    engine = AsyncEngine(llm)
    try:
        uvicorn.run(build_app(engine, model_name, max_request_bytes), host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
        llm.cluster.shutdown_followers()


def follow_forever(llm) -> None:
    """Torchrun ranks > 0 of a served engine: run rank 0's steps until it shuts down."""
    while llm.cluster.follow(idle=True)["kind"] != "shutdown":
        pass
