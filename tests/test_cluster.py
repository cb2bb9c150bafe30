"""Many engine instances behind one front: real ``ringkv serve --replicas`` and ``ringkv router``
processes on loopback, driven by the real ``openai`` client.

- the router's index follows the engines' prefix caches (block hashes at every logical block
  size), and its routing policy;
- KV-aware routing: requests sharing a prefix land where it is cached and say so in
  ``usage.prompt_tokens_details.cached_tokens``;
- live migration mid-stream (``POST /admin/migrate``): the client's text equals the
  unmigrated run, greedy and seeded, completions and chat;
- failover: an instance SIGKILLed under load; every request completes with the text it would
  have had, and the instance restarts and rejoins;
- instances of different meshes (tp=2, pp=2) under ``ringkv router``: one joins at run time,
  requests migrate between them (by hand and by the load policy) with unchanged tokens;
- admin endpoints off by default, and bad admin input refused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import httpx  # noqa: E402
from openai import OpenAI  # noqa: E402

from ringkv.cache import BlockManager  # noqa: E402
from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.serve.router import Instance, Router, free_port  # noqa: E402
from tests.models import needs_smollm2, saved_tiny_llama  # noqa: E402

KEY = "test-admin-key"


class Proc:
    """``python -m ringkv <args> --port P``, waited for until ``/health`` answers 200 (with
    ``wait=False``: started, and waited for by ``wait_up()``, so that several start side by
    side)."""

    def __init__(self, *args: str, up: int = 1, key: str = None, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
        env.pop("RINGKV_ADMIN_KEY", None)
        self.headers = {} if key is None else {"x-ringkv-admin-key": key}
        self.name, self.up, self.deadline = args[0], up, time.time() + 300
        self.seen = []  # the /health statuses wait_up saw, in order
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ringkv", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)
        if wait:
            self.wait_up()

    def wait_up(self) -> "Proc":
        while time.time() < self.deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.proc.stdout.read()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                self.seen.append(r.json().get("status") if r.content[:1] == b"{" else r.text)
                if (
                    self.up == 0 or r.status_code == 200 and r.json().get("up", self.up) >= self.up
                ):  # 0: it answers
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"{self.name} did not start")

    def get(self, path: str, **kw):
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, body, **kw):
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=120, **kw)

    def instances(self) -> dict:
        return {i["id"]: i for i in self.get("/admin/instances").json()["instances"]}

    def metrics(self) -> dict:
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def wait_all_up(self, timeout: float = 120) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            inst = self.instances()
            if all(i["state"] == "up" for i in inst.values()):
                return inst
            time.sleep(0.5)
        raise AssertionError(f"instances not up: {self.instances()}")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the router's index and policy (no processes) ---------------------------------------------
@pytest.mark.parametrize("block_size,sp", [(4, 1), (4, 2), (3, 3), (16, 1)])
def test_the_index_matches_the_engines_prefix_cache(block_size, sp):
    """The router's chain of block hashes for a prompt finds exactly the blocks an engine with
    that logical block size (``block_size * sp``) would reuse, salted or not."""
    import random

    from ringkv.cache.block_manager import REMOVED, KVEvents

    rng = random.Random(block_size * 10 + sp)
    bm = BlockManager(64, block_size * sp)
    bm.events = KVEvents()
    base = [rng.randrange(50) for _ in range(40)]
    for salt in (None, "tenant-a"):
        table = bm.match_prefix(base, salt)
        assert bm.grow(table, len(base))
        bm.register(table, base, len(base), salt)
    inst = Instance("x", "http://127.0.0.1:1", tokens_per_block=block_size * sp)
    for _, kind, h in bm.events.since(0)[1]:
        if kind == REMOVED:
            inst.blocks.pop(h.hex(), None)
        else:
            inst.blocks[h.hex()] = kind
    router = Router()
    for cut in (0, 5, 17, 39, 40):
        prompt = base[:cut] + [rng.randrange(50, 60) for _ in range(7)]
        for salt in (None, "tenant-a", "tenant-b"):
            want = (
                len(bm.match_prefix(prompt + [0], salt)) * block_size * sp
            )  # + [0]: no last-token rule
            bm.free(bm.match_prefix(prompt + [0], salt))
            assert router.cached_tokens(inst, prompt, salt, {}) == want


@contextlib.contextmanager
def instance_in_thread(llm, instance_id: str):
    """The real instance app (``build_app`` over an ``AsyncEngine`` publishing KV events, as
    ``ringkv serve --admin`` runs it) served by uvicorn on loopback from a thread."""
    import uvicorn

    from ringkv.serve.app import build_app
    from ringkv.serve.engine import AsyncEngine

    engine = AsyncEngine(llm, kv_events=True)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, "tiny", instance_id=instance_id, admin=True),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert thread.is_alive() and time.time() < deadline, "the instance app did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def test_router_poll_drops_the_blocks_an_instance_evicted():
    """``Router.poll`` against two real instance apps: the STORED events of a prompt's blocks
    send that prompt to the instance holding them; once that instance's cache evicts them (a
    longer prompt needs every block), the REMOVED events take them out of the router's index,
    and the prompt goes where the load says."""
    import asyncio

    import torch

    from ringkv.cache.block_manager import STORED, block_hash
    from ringkv.model import LlamaForCausalLM, ModelConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        ModelConfig(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            eos_token_id=None,
        )
    ).eval()
    bs, nb = 4, 8
    held = [(i * 7 + 3) % 61 for i in range(20)]  # 5 full blocks
    evicting = [
        (i * 5 + 1) % 61 for i in range(bs * nb - 1)
    ]  # with its token: every block of the cache

    def chain(ids):
        out, parent = [], None
        for i in range(len(ids) // bs):
            parent = block_hash((parent, tuple(ids[i * bs : (i + 1) * bs]), None))
            out.append(parent.hex())
        return out

    async def scenario(url_a, url_b):
        router = Router(migration=False)
        router.client = httpx.AsyncClient()
        a, b = router.add(url_a, "a"), router.add(url_b, "b")
        try:

            async def complete(ids):
                r = await router.client.post(
                    url_a + "/v1/completions",
                    timeout=60,
                    json=dict(model="tiny", prompt=ids, max_tokens=1, temperature=0),
                )
                assert r.status_code == 200, r.text

            for inst in (a, b):
                await router.poll(inst)  # the whole (empty) index; from now on, events
                assert inst.state == "up" and inst.tokens_per_block == bs and inst.blocks == {}
                assert inst.snapshots is None  # a dense model: its blocks are all there is
            a.inflight = 1  # a is the busier one: the load alone would pick b
            await complete(held)
            await router.poll(a)
            assert set(chain(held)) <= a.blocks.keys()
            assert router.cached_tokens(a, held, None, {}) == len(held)
            assert router.pick(held).id == "a"
            await complete(evicting)  # evicts every block of `held`: REMOVED events
            await router.poll(a)
            assert set(chain(evicting)) <= a.blocks.keys()
            stale = {h for h in chain(held) if a.blocks.get(h) == STORED}
            assert not stale, (
                f"{len(stale)} of the {len(held) // bs} evicted blocks stayed in the router's index"
            )
            assert router.cached_tokens(a, held, None, {}) == 0
            assert router.pick(held).id == "b"
        finally:
            await router.client.aclose()

    # no host tier: an eviction from the device is a REMOVED event (test_kv_pull has the tiers)
    llms = [LLM(model, block_size=bs, num_blocks=nb, kv_host_memory=0) for _ in range(2)]
    with instance_in_thread(llms[0], "a") as url_a, instance_in_thread(llms[1], "b") as url_b:
        asyncio.run(scenario(url_a, url_b))
    assert llms[0].core.blocks.evictions >= len(held) // bs


def test_routing_policy():
    """kv: the longest cached prefix, unless that instance holds ``balance`` more requests than
    the least busy one; round-robin cycles; least-loaded takes the fewest in flight."""
    r = Router(balance=2)
    a, b, c = (r.add(f"http://127.0.0.1:{p}", i) for p, i in ((1, "a"), (2, "b"), (3, "c")))
    for i in (a, b, c):
        i.state, i.tokens_per_block = "up", 4
    ids = list(range(12))
    chain, parent = [], None
    from ringkv.cache.block_manager import STORED, block_hash

    for k in range(3):
        parent = block_hash((parent, tuple(ids[k * 4 : (k + 1) * 4]), None))
        chain.append(parent.hex())
    b.blocks, c.blocks = dict.fromkeys(chain[:1], STORED), dict.fromkeys(chain[:2], STORED)
    assert r.pick(ids).id == "c"
    c.inflight = 2
    assert r.pick(ids).id == "c"  # 2 more than the least busy: still fair
    c.inflight = 3
    assert r.pick(ids).id == "b"  # c is passed over: the best of the rest
    assert r.pick(ids, exclude=frozenset("b")).id == "a"
    assert r.pick(ids).id == "a"  # a claimed the whole prompt when it got it
    for i in (a, b, c):
        i.pending.clear()
    c.state = "down"
    c.inflight = 0
    assert r.pick(ids).id == "b"
    # a prompt just routed counts as cached where it went, before that instance's events say so
    fresh = [90, 91, 92, 93, 94, 95, 96, 97, 98]
    first = r.pick(fresh)
    first.inflight += 1
    assert r.pick(fresh) is first and r.pick(fresh[:8] + [7]) is first
    first.inflight -= 1
    r.routing = "round-robin"
    assert [r.pick(ids).id for _ in range(4)] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    r.routing = "least-loaded"
    b.inflight = 1
    assert r.pick(ids).id == "a"
    with pytest.raises(ValueError):
        r.add("http://127.0.0.1:1")  # known
    with pytest.raises(ValueError):
        r.add("ftp://x")


# -- SmolLM2 replicas behind `ringkv serve --replicas 2` ----------------------------------------
SYSTEM = [
    "You are a terse assistant who answers in one short sentence. " * 6,
    "You are a pirate. Answer every question as a pirate would, with nautical words. " * 5,
]


@pytest.fixture(scope="module")
def replicas():
    """``ringkv serve --replicas 2`` of SmolLM2, started: ``front`` waits for it, so that
    ``smol`` loads while the replicas start."""
    from tests.models import smollm2_path

    f = Proc(
        "serve",
        "--model",
        smollm2_path(),
        "--replicas",
        "2",
        "--admin",
        "--served-model-name",
        "smol",
        "--no-migration",
        "--max-num-seqs",
        "16",
        up=2,
        wait=False,
    )
    yield f
    f.close()


@pytest.fixture(scope="module")
def smol(replicas):
    from tests.models import smollm2_path

    return LLM(smollm2_path(), num_blocks=512)


@pytest.fixture(scope="module")
def front(replicas, smol):
    """The front of ``replicas``, both of them up."""
    return replicas.wait_up()


def greedy(llm, prompt, n: int, chat: bool = False, **kw) -> str:
    p = SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=n, **kw)
    return llm.generate([prompt], p, use_tqdm=False, apply_chat_template=chat)[0].text


@needs_smollm2
@pytest.mark.slow
def test_requests_sharing_a_prefix_go_where_it_is_cached(front, smol):
    where = {}
    for k in range(3):
        for s, system in enumerate(SYSTEM):
            prompt = f"{system}Question {k}: name a colour."
            r = front.client.completions.with_raw_response.create(
                model="smol", prompt=prompt, max_tokens=4, temperature=0
            )
            out = r.parse()
            assert out.choices[0].text == greedy(smol, prompt, 4)
            where.setdefault(s, set()).add(r.headers["x-ringkv-instance"])
            cached = out.usage.prompt_tokens_details.cached_tokens
            if k:  # the system prompt's blocks are cached where the first one went
                assert cached >= len(smol.encode(system)) // 16 * 16 - 16, (k, s, cached)
    assert all(len(v) == 1 for v in where.values()), where
    m = front.metrics()
    assert sum(v for k, v in m.items() if k.startswith("ringkv_router_prefix_hit_tokens_total")) > 0
    assert (
        m['ringkv_router_instance_up{instance="r0"}']
        == 1
        == m['ringkv_router_instance_up{instance="r1"}']
    )


def stream_and_migrate(front, kind: str, after: int = 4, **kw):
    """Stream a request, move it to the other instance after ``after`` chunks; its text, and
    the instances it went from and to."""
    create = front.client.chat.completions if kind == "chat" else front.client.completions
    raw = create.with_raw_response.create(model="smol", stream=True, **kw)
    src = raw.headers["x-ringkv-instance"]
    dst = "r1" if src == "r0" else "r0"
    text, moved = "", None
    for i, ch in enumerate(raw.parse()):
        if ch.choices:
            text += (ch.choices[0].delta.content or "") if kind == "chat" else ch.choices[0].text
        if i == after:
            moved = front.post("/admin/migrate", {"request_id": ch.id, "to": dst})
    assert moved is not None and moved.status_code == 200, moved and moved.text
    assert moved.json()["moved"][0]["source"] == src
    return text, src, dst


@needs_smollm2
@pytest.mark.slow
def test_a_request_migrated_mid_stream_streams_the_same_text(front, smol):
    before = front.metrics()
    prompt = "Once upon a time, in a land far away,"
    text, src, dst = stream_and_migrate(
        front, "completions", prompt=prompt, max_tokens=40, temperature=0
    )
    assert text == greedy(smol, prompt, 40)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    seeded = dict(messages=messages, max_tokens=32, temperature=0.9, seed=1234)
    want = front.client.chat.completions.create(model="smol", **seeded).choices[0].message.content
    text, _, _ = stream_and_migrate(front, "chat", after=6, **seeded)
    assert text == want
    after = front.metrics()
    moved_out = sum(
        after[f'ringkv_router_migrations_out_total{{instance="{i}"}}']
        - before[f'ringkv_router_migrations_out_total{{instance="{i}"}}']
        for i in ("r0", "r1")
    )
    assert moved_out == 2


@needs_smollm2
@pytest.mark.slow
def test_bad_admin_input_is_refused(front):
    assert front.post("/admin/migrate", {"request_id": "cmpl-nope", "to": "r1"}).status_code == 404
    assert front.post("/admin/migrate", {"request_id": 5, "to": "r1"}).status_code == 400
    assert front.post("/admin/migrate", ["x"]).status_code == 400
    assert httpx.post(front.url + "/admin/migrate", content=b"{", timeout=10).status_code == 400
    assert front.post("/admin/instances", {"url": "not a url"}).status_code == 400
    assert (
        front.post("/admin/instances", {"url": front.instances()["r0"]["url"]}).status_code == 409
    )
    assert httpx.delete(front.url + "/admin/instances/nope", timeout=10).status_code == 404
    # a stream that is running: to an unknown instance, and to where it already is
    raw = front.client.completions.with_raw_response.create(
        model="smol", prompt="Count: 1, 2, 3,", max_tokens=40, temperature=0, stream=True
    )
    src = raw.headers["x-ringkv-instance"]
    for i, ch in enumerate(raw.parse()):
        if i == 2:
            assert (
                front.post("/admin/migrate", {"request_id": ch.id, "to": "r9"}).status_code == 404
            )
            assert front.post("/admin/migrate", {"request_id": ch.id, "to": src}).status_code == 409
    # the replicas' own admin endpoints need the key the front gave them
    url = front.instances()["r0"]["url"]
    assert httpx.get(url + "/internal/state", timeout=10).status_code == 401
    assert (
        httpx.get(
            url + "/internal/state", headers={"x-ringkv-admin-key": "wrong"}, timeout=10
        ).status_code
        == 401
    )
    assert (
        front.client.completions.create(model="smol", prompt="Hi", max_tokens=2)
        .choices[0]
        .finish_reason
    )


@needs_smollm2
@pytest.mark.slow
def test_a_killed_instance_loses_no_request_and_rejoins(front, smol):
    prompts = [f"Story {i}: once upon a time there was a" for i in range(4)]
    messages = [{"role": "user", "content": "Describe a forest in two sentences."}]
    got, errors, started = {}, [], threading.Barrier(len(prompts) + 2)

    def one(i):  # 0-3: completions; 4: a chat with n = 2 (each choice continues on its own)
        try:
            if i < len(prompts):
                s = front.client.completions.create(
                    model="smol", prompt=prompts[i], max_tokens=48, temperature=0, stream=True
                )
            else:
                s = front.client.chat.completions.create(
                    model="smol", messages=messages, max_tokens=48, n=2, temperature=0, stream=True
                )
            text, n = ["", ""], 0
            for ch in s:
                for c in ch.choices:
                    text[c.index] += (c.text if i < len(prompts) else c.delta.content) or ""
                n += 1
                if n == 5:
                    started.wait(timeout=120)
            got[i] = text[0] if i < len(prompts) else text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
            started.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts) + 1)]
    for t in threads:
        t.start()
    started.wait(timeout=180)  # every stream is under way
    inst = front.instances()
    victim = max(inst.values(), key=lambda i: i["load"]["inflight"])
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.time()
    while front.instances()[victim["id"]]["state"] == "up":
        assert time.time() - t0 < 10, "the killed instance is still up after 10 s"
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=300)
    # the references, computed while the killed replica starts again; in one batch (as the
    # instances run them), not one by one: ~3x faster
    want = [
        o.text
        for o in smol.generate(
            prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
        )
    ]
    want += [[greedy(smol, messages, 48, chat=True)] * 2]
    again = greedy(smol, prompts[0], 8)
    assert not errors, errors
    assert [got.get(i) for i in range(len(prompts) + 1)] == want
    assert front.metrics()[f'ringkv_router_failovers_total{{instance="{victim["id"]}"}}'] >= 1
    inst = front.wait_all_up(180)  # the replica was started again and rejoined
    assert inst[victim["id"]]["pid"] != victim["pid"]
    r = front.client.completions.create(
        model="smol", prompt=prompts[0], max_tokens=8, temperature=0
    )
    assert r.choices[0].text == again


# -- instances of different meshes under `ringkv router` ------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory, 3, num_hidden_layers=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def meshes(tiny):
    """A tp=2 and a pp=2 instance, started side by side."""
    common = ("--model", tiny, "--block-size", "4", "--max-num-seqs", "8", "--admin-key", KEY)
    a = Proc("serve", *common, "--tp", "2", "--instance-id", "tp2", key=KEY, wait=False)
    b = Proc("serve", *common, "--pp", "2", "--instance-id", "pp2", key=KEY, wait=False)
    try:
        a.wait_up()
        b.wait_up()
    except BaseException:
        a.close()
        b.close()
        raise
    yield a, b
    a.close()
    b.close()


def tiny_reference(tiny, prompts, n: int):
    llm = LLM(tiny, block_size=4, num_blocks=256)
    return [
        o.token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    ]


def tokens_of(stream) -> list:
    out = []
    for ch in stream:
        out += [int(t) for c in ch.choices for t in (c.logprobs.tokens if c.logprobs else [])]
    return out


@pytest.mark.slow
def test_admin_is_off_by_default(meshes, tiny):
    plain = Proc("serve", "--model", tiny, "--block-size", "4", wait=False)
    router = Proc("router", "--upstream", meshes[0].url, up=0, wait=False)
    try:
        router.wait_up()  # (no model to load: up before plain)
        answering = time.time()
        for path in ("/admin/instances",):
            assert httpx.get(router.url + path, timeout=10).status_code == 404
        assert httpx.post(router.url + "/admin/migrate", json={}, timeout=10).status_code == 404
        plain.wait_up()
        for path in ("/internal/state", "/internal/attach/x"):
            assert httpx.get(plain.url + path, timeout=10).status_code == 404
        assert (
            httpx.post(
                plain.url + "/internal/accept", json={"host": "127.0.0.1"}, timeout=10
            ).status_code
            == 404
        )
        # this router has not got the instance's key: it cannot read its state, so routes
        # nowhere (after 2 s of its polls, most of which passed while plain started)
        time.sleep(max(0.0, answering + 2 - time.time()))
        assert httpx.get(router.url + "/health", timeout=10).status_code == 503
        assert (
            httpx.post(
                router.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60
            ).status_code
            == 503
        )
        # a request naming itself (x-ringkv-request-id) is an ordinary request on an instance
        # without admin
        r = httpx.post(
            plain.url + "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 2},
            headers={"x-ringkv-request-id": "mine"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["id"] != "mine"
    finally:
        plain.close()
        router.close()


@pytest.mark.slow
def test_instances_of_different_meshes_join_route_and_migrate(meshes, tiny):
    a, b = meshes
    router = Proc("router", "--upstream", a.url, "--admin-key", KEY, "--no-migration", key=KEY)
    try:
        r = httpx.post(
            router.url + "/admin/instances", json={"url": b.url, "id": "pp2"}, timeout=30
        )
        assert r.status_code == 401  # without the key
        r = router.post("/admin/instances", {"url": b.url, "id": "pp2"})
        assert r.status_code == 200, r.text
        inst = router.wait_all_up(60)
        assert set(inst) == {"u0", "pp2"}
        prompts = [[5 + i, 6, 7, 8, 9] * 3 for i in range(3)]
        # long enough that a loaded machine's client still reads the stream while it runs
        want = tiny_reference(tiny, prompts, 96)
        r = router.client.completions.create(
            model=tiny, prompt=prompts, max_tokens=96, temperature=0, logprobs=0
        )
        assert [
            [int(t) for t in c.logprobs.tokens] for c in sorted(r.choices, key=lambda c: c.index)
        ] == want
        for src_to in ("pp2", "u0"):  # there and back, mid-stream
            raw = router.client.completions.with_raw_response.create(
                model=tiny,
                prompt=prompts[1],
                max_tokens=96,
                temperature=0,
                logprobs=0,
                stream=True,
            )
            src = raw.headers["x-ringkv-instance"]
            dst = "pp2" if src == "u0" else "u0"
            got = []
            for i, ch in enumerate(raw.parse()):
                got += [
                    int(t) for c in ch.choices for t in (c.logprobs.tokens if c.logprobs else [])
                ]
                if i == 1:
                    m = router.post("/admin/migrate", {"request_id": ch.id, "to": dst})
                    assert m.status_code == 200, m.text
            assert got == want[1], src_to
        # drained and removed; requests still served by the other
        assert (
            httpx.delete(
                router.url + "/admin/instances/pp2", headers=router.headers, timeout=60
            ).status_code
            == 200
        )
        assert set(router.instances()) == {"u0"}
        r = router.client.completions.create(
            model=tiny, prompt=prompts[2], max_tokens=96, temperature=0, logprobs=0
        )
        assert [int(t) for t in r.choices[0].logprobs.tokens] == want[2]
    finally:
        router.close()


@pytest.mark.slow
def test_the_load_policy_moves_requests_and_keeps_their_tokens(meshes, tiny):
    """Requests pinned to one instance by their shared prefix: the policy moves some to the
    idle one while they decode; every output equals the reference."""
    a, b = meshes
    router = Proc(
        "router",
        "--upstream",
        a.url,
        "--upstream",
        b.url,
        "--admin-key",
        KEY,
        "--migration-threshold",
        "0.1",
        "--balance",
        "64",
        up=2,
        key=KEY,
    )
    try:
        base = [11, 12, 13, 14] * 6
        prompts = [base + [20 + i] for i in range(6)]
        want = tiny_reference(tiny, prompts, 200)
        warm = router.client.completions.create(
            model=tiny, prompt=base, max_tokens=1
        )  # caches the prefix
        assert warm.choices[0].finish_reason
        got, errors = {}, []

        def one(i):
            try:
                s = router.client.completions.create(
                    model=tiny,
                    prompt=prompts[i],
                    max_tokens=200,
                    temperature=0,
                    logprobs=0,
                    stream=True,
                )
                got[i] = tokens_of(s)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert [got[i] for i in range(len(prompts))] == want
        m = router.metrics()
        assert m["ringkv_router_auto_migrations_total"] >= 1, m
        assert m["ringkv_router_auto_migration"] == 1
    finally:
        router.close()


@pytest.mark.slow
def test_replicas_that_cannot_start_stop_the_front_with_the_reason(tmp_path):
    """A model directory without a config: each replica exits; after 3 tries the front gives
    up on them and exits 1, naming the replica's own error (no restart loop, no hang)."""
    bad = tmp_path / "empty-model"
    bad.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    nope = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringkv",
            "serve",
            "--model",
            str(tmp_path / "nope"),
            "--replicas",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # meanwhile
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringkv",
                "serve",
                "--model",
                str(bad),
                "--replicas",
                "2",
                "--port",
                str(free_port()),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 1, r.stderr
        assert "no config.json" in r.stderr and "every instance failed to start" in r.stderr
        _, stderr = nope.communicate(timeout=60)
        assert nope.returncode == 2 and "no model at" in stderr
    finally:
        if nope.poll() is None:
            nope.kill()
            nope.wait()
