"""``/metrics`` on ``prometheus_client``: each front's registry is its own (two instances in one
process count apart), the TTFT and inter-token-latency histograms add up, and a router's
``requests`` counter is one family (its instances' samples and its own)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.test_openai_protocol import tiny_llm  # noqa: E402


def samples(text: str) -> dict:
    """Prometheus text, parsed strictly: {(name, ((label, value), ...)): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_an_instance_counts_its_own_tokens_and_latencies():
    from ringkv.serve.app import ServingInstance
    from ringkv.serve.engine import AsyncEngine

    engines = [AsyncEngine(tiny_llm()) for _ in range(2)]
    served = [ServingInstance(e, "tiny") for e in engines]

    async def run():
        req = served[0].parse(dict(prompt=[[1, 2, 3, 4, 5]], max_tokens=6, temperature=0), False)
        await served[0].answer("cmpl-m", req, await served[0].start(req))

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10  # the step's counts land after its outputs went out
        while samples(served[0].metrics())["ringkv_generation_tokens_total", ()] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        busy, idle = (samples(s.metrics()) for s in served)
    finally:
        for e in engines:
            e.shutdown()
    assert busy["ringkv_generation_tokens_total", ()] == 6
    assert idle["ringkv_generation_tokens_total", ()] == 0  # a registry of its own
    assert busy["ringkv_requests_finished_total", (("reason", "length"),)] == 1
    assert busy["ringkv_time_to_first_token_seconds_count", ()] == 1
    assert busy["ringkv_time_to_first_token_seconds_bucket", (("le", "+Inf"),)] == 1
    assert busy["ringkv_inter_token_latency_seconds_count", ()] == 5  # 6 tokens: 5 gaps
    assert busy["ringkv_inter_token_latency_seconds_sum", ()] > 0
    assert idle["ringkv_inter_token_latency_seconds_count", ()] == 0


def test_a_router_writes_each_family_once():
    from ringkv.serve.router import Router, ServingRouter

    router = Router()
    router.add("http://127.0.0.1:1", "a")
    router.counters["requests"] = 3
    text = ServingRouter(router).metrics()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    m = samples(text)
    assert m["ringkv_router_requests_total", ()] == 3
    assert m["ringkv_router_requests_total", (("instance", "a"),)] == 0
    assert m["ringkv_router_tier_blocks", (("instance", "a"), ("tier", "device"))] == 0
