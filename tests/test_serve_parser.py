"""One request parser for a router and an instance: a real ``ringkv serve`` instance (a tiny
model, no tokenizer) and a real ``ringkv router`` before it refuse the same bad bodies with the
same status and the same OpenAI error body (the router checks them before it tokenizes)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from tests.models import saved_tiny_llama  # noqa: E402
from tests.test_cluster import Proc  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "test-admin-key"

COMPLETIONS = [
    {"prompt": [5, 6], "stream": True, "stream_options": {"include_usage": "yes"}},
    {"prompt": [5, 6], "stream_options": "x"},
    {"prompt": [5, 6], "return_token_ids": "yes"},
    {"prompt": [5, 6], "stream": "no"},
    {"prompt": [5, 6], "n": 0},
    {"prompt": [5, 6], "n": 129},
    {"prompt": [5, 6], "temperature": -1},
    {"prompt": [5, 6], "max_tokens": 0},
    {"prompt": [5, 6], "echo": "no"},
    {"prompt": [5, 6], "cache_salt": ""},
    {"prompt": {"a": 1}},
    {"prompt": []},
]
CHATS = [{"messages": []}, {"messages": "hi"}, {"messages": [{"content": "x"}]}]


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    tiny = saved_tiny_llama(tmp_path_factory, 3, num_hidden_layers=2, max_position_embeddings=256)
    inst = Proc("serve", "--model", tiny, "--block-size", "4", "--admin-key", KEY, key=KEY)
    try:
        router = Proc("router", "--upstream", inst.url, "--admin-key", KEY, key=KEY)
    except BaseException:
        inst.close()
        raise
    yield inst, router
    router.close()
    inst.close()


def answers(url: str, path: str, body) -> tuple:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    r = httpx.post(url + path, content=raw, headers=headers, timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_router_and_an_instance_refuse_the_same_bodies_alike(fronts, path):
    inst, router = fronts
    bodies = COMPLETIONS if path == "/v1/completions" else CHATS
    for body in bodies + [b"{", b"[1]"]:
        want = answers(inst.url, path, body)
        assert want[0] == 400 and want[1]["error"]["type"] == "invalid_request_error", (body, want)
        assert answers(router.url, path, body) == want, body
