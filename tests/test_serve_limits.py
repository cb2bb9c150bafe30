"""``ringkv serve`` exposed: an API key, a bounded waiting queue (429 + Retry-After), a request
timeout; a real server process (a tiny model, token-id prompts) and the real ``openai`` client."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from tests.models import saved_tiny_llama  # noqa: E402
from tests.test_cluster import Proc  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory, 5, num_hidden_layers=2, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def servers(tiny):
    """This module's two servers, started side by side (~3.5 s, not ~10 one after the other):
    ``server`` (2 computed at once, 2 waiting, a key, protected metrics) and ``hasty`` (requests
    may run 1.5 s: far less than 3,500 tokens take on any CPU here)."""
    s = Proc(
        "serve",
        "--model",
        tiny,
        "--block-size",
        "4",
        "--max-num-seqs",
        "2",
        "--max-waiting",
        "2",
        "--request-timeout",
        "30",
        "--api-key",
        KEY,
        "--protect-metrics",
        "--served-model-name",
        "tiny",
        wait=False,
    )
    h = Proc(
        "serve",
        "--model",
        tiny,
        "--block-size",
        "4",
        "--request-timeout",
        "1.5",
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
        wait=False,
    )
    try:
        s.wait_up()
        h.wait_up()
    except BaseException:
        s.close()
        h.close()
        raise
    for x in (s, h):
        x.auth = {"authorization": f"Bearer {KEY}"}
        x.client = openai.OpenAI(base_url=x.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield s, h
    s.close()
    h.close()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def metric(s, name: str) -> float:
    for line in httpx.get(s.url + "/metrics", headers=s.auth, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_the_api_key_is_needed_and_checked(server, tiny):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": KEY},
        {"x-api-key": KEY},
    ):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (
            headers,
            r.text,
        )
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401  # --protect-metrics
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # always open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=server.url + "/v1", api_key="nope", max_retries=0
        ).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
    want = (
        LLM(tiny, block_size=4, num_blocks=64)
        .generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        .token_ids
    )
    r = server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0, logprobs=0
    )
    assert [int(t) for t in r.choices[0].logprobs.tokens] == want


def test_past_max_waiting_requests_get_429_and_the_admitted_ones_complete(server):
    """2 computed at once, 2 waiting: of 10 simultaneous requests some get a 429 with
    Retry-After, and every one that was admitted completes."""
    results, lock = [], threading.Lock()
    go = threading.Barrier(10)

    def one(i):
        go.wait()
        r = httpx.post(
            server.url + "/v1/completions",
            headers=server.auth,
            timeout=120,
            json={
                "model": "tiny",
                "prompt": [5 + i, 6, 7],
                "max_tokens": 150,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 4  # 2 running + 2 waiting at the least
    for r in results:
        if r.status_code == 429:
            assert (
                int(r.headers["retry-after"]) >= 1
                and r.json()["error"]["code"] == "too_many_requests"
            )
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 150
    assert metric(server, "ringkv_requests_running") == 0
    assert metric(server, "ringkv_requests_waiting") == 0


@pytest.fixture(scope="module")
def hasty(servers):
    """A server whose requests may run 1.5 s: far less than 3,500 tokens take on any CPU here."""
    return servers[1]


def test_a_request_past_the_timeout_is_aborted_and_freed(hasty):
    server = hasty
    t0 = time.time()
    events = []
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=server.auth,
        timeout=120,
        json={
            "model": "tiny",
            "prompt": [9, 8, 7],
            "max_tokens": 3500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) % 20 == 0:
                    time.sleep(0.05)  # a slow reader, too
    took = time.time() - t0
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "request-timeout" in error["message"], error
    assert 1.5 < took < 60, took
    assert metric(server, "ringkv_requests_running") == 0
    assert metric(server, "ringkv_kv_cache_usage_ratio") == 0
    r = server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
