"""A load test of ``ringkv serve`` (a real process, a tiny model, the ``openai`` async client):
200 concurrent streaming clients, short and long, some of which disconnect mid-stream, past a
bounded waiting queue. Every admitted request completes or is aborted cleanly, 429s come only
from a full queue, the server returns to 0 running / 0 waiting / 0 KV blocks, its memory does
not grow from round to round, and a client that reads slowly delays nobody else."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.models import tiny_model  # noqa: E402
from tests.test_cluster import Proc  # noqa: E402

pytestmark = pytest.mark.slow
MAX_NUM_SEQS, MAX_WAITING = 16, 48


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", 7, num_hidden_layers=2, max_position_embeddings=512).save_pretrained(
        path, safe_serialization=True
    )
    s = Proc(
        "serve",
        "--model",
        str(path),
        "--block-size",
        "4",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-waiting",
        str(MAX_WAITING),
        "--served-model-name",
        "tiny",
    )
    yield s
    s.close()


def settle(s, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        g = s.metrics()
        if (
            g["ringkv_requests_running"]
            == g["ringkv_requests_waiting"]
            == g["ringkv_kv_cache_usage_ratio"]
            == 0
        ):
            return g
        assert time.time() < deadline, g
        time.sleep(0.2)


async def one(client, i: int, rng: random.Random, outcome: dict):
    """A client: short or long; some leave after a few tokens."""
    long = rng.random() < 0.3
    leave = long and rng.random() < 0.5  # a long one: still running when its client goes
    n = rng.randint(200, 400) if long else rng.randint(2, 12)
    prompt = [rng.randrange(3, 128) for _ in range(rng.randint(3, 80))]
    if (
        leave
    ):  # as long as the model's 512 positions allow: the client, one of 200 in one event loop,
        n = 510 - len(
            prompt
        )  # may read its first tokens late, and must still find the request running
    try:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        got, reason = 0, None
        async for ch in stream:
            for c in ch.choices:
                got += len(getattr(c, "token_ids", None) or [])
                reason = c.finish_reason or reason
            if leave and got >= 1:
                await stream.close()  # the client goes away mid-stream
                outcome[i] = "left"
                return
        assert reason == "length" and got == n, (i, reason, got, n)
        outcome[i] = "done"
    except openai.RateLimitError as e:
        assert e.response.headers.get("retry-after"), e
        outcome[i] = "429"


async def round_of(s, clients: int, seed: int) -> dict:
    outcome: dict = {}
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(
        base_url=s.url + "/v1",
        api_key="none",
        max_retries=0,
        timeout=300,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=400), timeout=300),
    ) as client:
        await asyncio.gather(
            *(one(client, i, random.Random(rng.random()), outcome) for i in range(clients))
        )
    return outcome


def test_200_streaming_clients_past_a_bounded_queue(server):
    proc = psutil.Process(server.proc.pid)
    before = settle(server)
    rss = []
    for r in range(2):
        outcome = asyncio.run(round_of(server, 200, seed=r))
        assert len(outcome) == 200, "a client got neither its tokens, a 429, nor left"
        counts = {k: sum(v == k for v in outcome.values()) for k in ("done", "left", "429")}
        assert counts["done"] + counts["left"] >= MAX_NUM_SEQS + MAX_WAITING, (
            counts
        )  # admitted before any 429
        assert counts["429"] > 0, counts  # 200 at once is past the queue
        settle(server)
        rss.append(proc.memory_info().rss)
    assert rss[1] < rss[0] + (64 << 20), rss  # the second round left no more behind than the first
    g = server.metrics()
    finished = {k: v for k, v in g.items() if k.startswith("ringkv_requests_finished_total")}
    assert sum(v for k, v in finished.items() if "abort" in k) > 0, (
        finished
    )  # the clients that left
    # under the bound, nobody is told to back off
    outcome = asyncio.run(round_of(server, MAX_NUM_SEQS + MAX_WAITING // 2, seed=9))
    assert "429" not in outcome.values(), outcome
    settle(server)
    assert server.metrics()["ringkv_requests_running"] == before["ringkv_requests_running"] == 0


def test_a_slow_reader_delays_nobody(server):
    """One client reads a long stream a chunk every 50 ms; 20 short requests sent meanwhile all
    finish long before it does (its tokens wait in its own queue: at most max_tokens small
    deltas; the engine never waits for a client), and the slow one still gets every token."""

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
        ) as client:
            # 100 deltas at 50 ms: ~5 s of reading, several times what the short requests take
            slow = await client.completions.create(
                model="tiny",
                prompt=[5, 6, 7],
                max_tokens=100,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            t0 = time.monotonic()

            async def read_slowly():
                got = 0
                async for ch in slow:
                    got += sum(len(getattr(c, "token_ids", None) or []) for c in ch.choices)
                    await asyncio.sleep(0.05)
                return got, time.monotonic() - t0

            async def short(i):
                r = await client.completions.create(
                    model="tiny", prompt=[9, i, 3], max_tokens=8, temperature=0
                )
                return r.choices[0].finish_reason, time.monotonic() - t0

            reader = asyncio.ensure_future(read_slowly())
            shorts = await asyncio.gather(*(short(i) for i in range(20)))
            got, slow_end = await reader
            return got, slow_end, shorts

    got, slow_end, shorts = asyncio.run(run())
    assert got == 100
    assert all(reason == "length" for reason, _ in shorts)
    assert max(t for _, t in shorts) < slow_end / 2, (shorts, slow_end)
    settle(server)
