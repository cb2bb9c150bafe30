"""An instance whose engine is being built answers: ``/health`` says "starting" (with the
start-up's last log line), every other path a 503 with ``Retry-After``, a router keeps it
*starting* (neither up nor dead) and routes to it once it is up; a build that fails stops the
server with its error (issue #60). A real uvicorn server on a loopback port, a real engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from ringkv.engine import LLM
from ringkv.serve import ServeConfig
from ringkv.serve import _app as instance_app
from ringkv.serve import _engine as async_engine
from ringkv.serve.policy import InstanceState
from ringkv.serve.router import Router, free_port
from ringkv.serve.starting import Starting, build_behind
from tests.models import saved_tiny_llama


def _server(gate):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    return server, thread, f"http://127.0.0.1:{port}"


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _get(url: str):
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def _poll(router, inst) -> None:
    async def poll():
        async with httpx.AsyncClient() as router.client:
            await router.poll(inst)

    asyncio.run(poll())


def test_starting_then_up_and_the_router_waits(tmp_path_factory):
    path = saved_tiny_llama(tmp_path_factory, 0)
    release, engines = threading.Event(), []
    config = ServeConfig(admin=True, model_name="tiny")

    def build():
        logging.getLogger("ringkv.parallel.compiled").info("ringkv: compiling the decode step")
        assert release.wait(60)
        return LLM(path, num_blocks=16, block_size=8, max_num_seqs=2)

    def ready(llm):
        engines.append(async_engine(llm, config))
        return instance_app(engines[0], config)

    gate = Starting()
    server, thread, url = _server(gate)
    built = build_behind(gate, server, build, ready)
    thread.start()
    try:
        health = _wait(lambda: _get(url + "/health"), "the port")
        assert health.status_code == 503
        _wait(lambda: "compiling" in _get(url + "/health").json()["detail"], "the progress line")
        assert _get(url + "/health").json() == {
            "status": "starting",
            "detail": "compiling the decode step",
        }
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "starting"
        assert "is starting" in r.json()["error"]["message"]

        router = Router(admin_key=None)
        inst = router.add(url)
        for _ in range(3):  # a starting instance is never counted down, however long it takes
            _poll(router, inst)
            assert inst.state == InstanceState.STARTING and "starting" in inst.error
            assert inst.failed_polls == 0

        release.set()
        _wait(lambda: _get(url + "/health").status_code == 200, "the engine")
        assert _get(url + "/health").json() == {"status": "ok"}
        r = httpx.post(
            url + "/v1/completions",
            # (a random model's greedy tokens may hit EOS: whether it does moves with last bits)
            json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        _poll(router, inst)
        assert inst.state == InstanceState.UP, inst.error
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
        for engine in engines:
            engine.shutdown()
        if "llm" in built:
            built["llm"].close()
    assert "error" not in built


def test_a_build_that_fails_says_so_and_stops_the_server():
    def build():
        raise ValueError("no model at '/nowhere'")

    gate = Starting()
    server, thread, url = _server(gate)
    built = build_behind(gate, server, build, lambda llm: pytest.fail("never ready"))
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"
    assert isinstance(built["error"], ValueError) and "llm" not in built
    assert gate.error == "ValueError: no model at '/nowhere'"
