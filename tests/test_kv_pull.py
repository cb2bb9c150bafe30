"""Peer pull of a cached prefix and tier-aware routing (issue #44): real ``ringkv serve``
instances of a tiny model behind a real ``ringkv router``, driven by the real ``openai`` client.

- a request whose prefix another instance holds, routed elsewhere (the holder busy, balance 0),
  is served after its instance pulled that prefix: its ``cached_tokens`` cover it, one ``pull``
  decision is counted, and its tokens equal a cold run's;
- the holder SIGKILLed before the pull: the request still gets the same tokens (a ``failed``
  decision, then a recompute);
- ``--no-kv-pull``: no hint, no pull, a recompute;
- the pull hint from a plain client (no admin key) is ignored; from an admin it is honoured;
  requests hinted the same prefix at once pull it once;
- the router's score prefers device > host > disk > peer > recompute (hand-filled indexes).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import httpx  # noqa: E402

from ringkv.cache.block_manager import DISK, HOST, STORED, block_hash  # noqa: E402
from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.serve.router import PULL_HEADER, Router, free_port  # noqa: E402
from tests.models import saved_tiny_llama  # noqa: E402
from tests.test_cluster import KEY, Proc  # noqa: E402

BS = 4  # tokens per block of every instance here
PREFIX = 32  # tokens of each shared prefix: 8 blocks


# -- the router's score (no processes) ---------------------------------------------------------
def chain_of(ids, tpb=BS, salt=None):
    out, parent = [], None
    for i in range(len(ids) // tpb):
        parent = block_hash((parent, tuple(ids[i * tpb : (i + 1) * tpb]), salt))
        out.append(parent.hex())
    return out


def test_the_score_prefers_device_then_host_then_disk_then_a_peer():
    r = Router(balance=64)
    insts = {
        name: r.add(f"http://127.0.0.1:{port}", name)
        for port, name in enumerate(("recompute", "peer", "disk", "host", "device"), 1)
    }
    for i in insts.values():
        i.state, i.tokens_per_block, i.model, i.kv_cache_dtype = "up", BS, "m", "auto"
    ids = list(range(3, 3 + 12))
    chain = chain_of(ids)
    for name, tier in (("device", STORED), ("host", HOST), ("disk", DISK)):
        insts[name].blocks = dict.fromkeys(chain, tier)
    insts["peer"].blocks = {}  # holds nothing: a peer holds the prompt (pull)
    insts["recompute"].model = "another"  # cannot pull from them: recomputes
    order, out = [], frozenset()
    while len(order) < len(insts):
        got = r.pick(ids, exclude=out)
        got.pending.clear()  # (the claim of the prompt routed there: not what is measured)
        order.append(got.id)
        out = out | {got.id}
    assert order == ["device", "host", "disk", "peer", "recompute"]
    # a longer prefix in a slower tier can outweigh a shorter one on the device
    insts["device"].blocks = dict.fromkeys(chain[:1], STORED)
    assert r.pick(ids).id == "host"
    # with pulling off, holding nothing is worth nothing: the least loaded of those wins
    r.kv_pull, insts["host"].pending = False, {}
    for name in ("device", "host", "disk"):
        insts[name].state = "down"
    insts["peer"].inflight = 1
    assert r.pick(ids).id == "recompute"


def test_the_pull_hint_names_the_longest_holder():
    r = Router()
    a, b, c = (r.add(f"http://127.0.0.1:{p}", n) for p, n in ((1, "a"), (2, "b"), (3, "c")))
    for i in (a, b, c):
        i.state, i.tokens_per_block, i.model, i.kv_cache_dtype = "up", BS, "m", "auto"
    ids = list(range(3, 3 + 14))  # 3 whole blocks and 2 tokens
    chain = chain_of(ids, salt="t")
    a.blocks = dict.fromkeys(chain[:3], HOST)  # a host tier counts: the holder pulls it up
    b.blocks = dict.fromkeys(chain[:2], STORED)
    assert r.pull_hint(c, ids, "t") == (a.url, 12)
    assert r.pull_hint(b, ids, "t") == (a.url, 12)  # one block more than b holds
    assert r.pull_hint(a, ids, "t") is None  # it holds the most
    # routed to c (a and b excluded): the hint is sent, and c's claim on the prompt (it will
    # hold it) makes the next request there go without one
    assert r.route(ids, "t", frozenset("ab")) == (c, (a.url, 12))
    assert r.route(ids, "t", frozenset("ab")) == (c, None)
    assert r.pull_hint(c, ids, None) is None  # another tenant's blocks: not its prefix
    c.pending = {h: time.monotonic() + 30 for h in chain}  # c computes it now: it will hold it
    assert r.pull_hint(c, ids, "t") is None
    c.pending = {}
    # another block size: b holds 8 tokens; a holds less than one of b's blocks more
    b.tokens_per_block, b.blocks = 8, dict.fromkeys(chain_of(ids, 8, "t"), STORED)
    assert r.pull_hint(b, ids, "t") is None
    a.kv_cache_dtype = "fp8"  # another KV dtype: not a holder for c; b (other blocks) is
    assert r.pull_hint(c, ids, "t") == (b.url, 8)
    b.model = "another"
    assert r.pull_hint(c, ids, "t") is None
    a.kv_cache_dtype, r.kv_pull = "auto", False
    assert r.pull_hint(c, ids, "t") is None


# -- the cost model, and a failed pull, in process -------------------------------------------
def test_the_cost_model_and_a_pull_from_nowhere(tiny):
    import asyncio

    from ringkv.serve.engine import AsyncEngine, Pull

    with pytest.raises(ValueError, match="pull_policy"):
        AsyncEngine(LLM(tiny, block_size=BS, num_blocks=16), pull_policy="sometimes")
    e = AsyncEngine(LLM(tiny, block_size=BS, num_blocks=64), pull_policy="cost")
    try:
        m = e.metrics
        per_token = e.kv_bytes_per_token()
        assert per_token == 2 * 4 * 2 * 16 * 4  # K and V x layers x KV heads x head_dim x fp32
        assert e.worth_pulling(64)  # unmeasured: pull
        m.observe_link(1 << 20, 1.0)
        assert e.worth_pulling(64)  # the prefill rate is not measured yet
        m.observe_prefill(1000, 1.0)  # 1 ms a token
        m.link_rate = per_token * 2000  # 0.5 ms a token
        assert e.worth_pulling(64)
        m.link_rate = per_token * 500  # 2 ms a token: recompute
        assert not e.worth_pulling(64)
        # a fast link whose set-up takes 0.1 s: a pull pays off past 100 tokens
        m.link_rate, m.link_setup = per_token * 1e6, 0.1
        assert not e.worth_pulling(64) and e.worth_pulling(256)
        e.pull_policy = "always"
        assert e.worth_pulling(64)
        # a holder that is not there: "failed" at once, the link closed, nothing imported
        ids = list(range(3, 3 + PREFIX + 3))
        hint = Pull(f"http://127.0.0.1:{free_port()}", PREFIX, "127.0.0.1")
        t0 = time.monotonic()
        assert asyncio.run(e.pull_prefix(ids, None, hint)) == "failed"
        assert time.monotonic() - t0 < 10
        assert m.pulls == {"pull": 0, "recompute": 0, "failed": 1} and m.pull_error
        assert not [t for t in threading.enumerate() if t.name == "ringkv-link"]  # none waits
        assert e.llm.cached_tokens(ids) == 0
        # nothing to gain (the hint's prefix is shorter than a block more): recompute
        hint.tokens = BS - 1
        assert asyncio.run(e.pull_prefix(ids, None, hint)) == "recompute"
    finally:
        e.shutdown()


# -- real instances -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory, 3, num_hidden_layers=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cold(tiny):
    """Greedy tokens of a prompt on a fresh engine (no cache shared with anyone)."""
    llm = LLM(tiny, block_size=BS, num_blocks=256)

    def run(prompt, n):
        params = SamplingParams(temperature=0, max_tokens=n)
        return llm.generate([prompt], params, use_tqdm=False)[0].token_ids

    return run


@pytest.fixture(scope="module")
def instances(tiny):
    """Instances a, b and c (c: a holder to kill), started side by side. Each pulls whenever
    hinted (the ``always`` policy: on this tiny model a recompute is cheaper than a link's
    set-up, so the cost model would rightly refuse; ``test_the_cost_model`` checks it)."""
    common = ("--model", tiny, "--served-model-name", "tiny", "--block-size", str(BS))
    common += ("--max-num-seqs", "8", "--admin-key", KEY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGKV_KV_PULL_POLICY", "always")  # (the flag: --kv-pull-policy always)
        procs = {n: Proc("serve", *common, "--instance-id", n, key=KEY, wait=False) for n in "abc"}
    try:
        for p in procs.values():
            p.wait_up()
        yield procs
    finally:
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def front(instances):
    """A router over a, b and c, balance 0: a busy instance is passed over."""
    urls = [x for p in instances.values() for x in ("--upstream", p.url)]
    r = Proc("router", *urls, "--admin-key", KEY, "--no-migration", "--balance", "0", key=KEY)
    try:
        r.wait_all_up(120)
        yield r
    finally:
        r.close()


def ids_of(r) -> dict:
    """The router's instance id -> instance URL."""
    return {i: v["url"] for i, v in r.instances().items()}


def decisions(inst: Proc) -> dict:
    m = inst.metrics()
    return {o: m[f'ringkv_kv_pull_decisions_total{{outcome="{o}"}}'] for o in PULL_OUTCOMES}


PULL_OUTCOMES = ("pull", "recompute", "failed")


def complete(client, prompt, n=8, **kw):
    """One greedy completion: (its tokens, cached prompt tokens, the instance header)."""
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, logprobs=0, **kw
    )
    out = raw.parse()
    tokens = [int(t) for t in out.choices[0].logprobs.tokens]
    return tokens, out.usage.prompt_tokens_details.cached_tokens, raw.headers["x-ringkv-instance"]


def indexed(r: Proc) -> dict:
    """The router's instance id -> blocks its index holds there."""
    return {i: v["cached_blocks"] for i, v in r.instances().items()}


def wait_indexed(r: Proc, id: str, blocks: int, timeout: float = 30) -> None:
    """Until the router's index holds ``blocks`` blocks of instance ``id``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if indexed(r)[id] >= blocks:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never indexed {blocks} blocks of {id}: {r.instances()}")


def routed_while_busy(r: Proc, prefix, cold) -> tuple:
    """Cache ``prefix`` on an instance through the router, keep that instance busy with a long
    stream sharing it, and send a request sharing it meanwhile (balance 0: it goes elsewhere).
    Returns (holder id, target id, cached tokens, tokens, want)."""
    known = indexed(r)
    _, _, holder = complete(r.client, prefix + [90, 91, 92], 2)
    wait_indexed(r, holder, known[holder] + PREFIX // BS)
    busy = r.client.completions.with_raw_response.create(
        model="tiny",
        prompt=prefix + [93, 94, 95],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert busy.headers["x-ringkv-instance"] == holder  # its prefix is there, all are idle
    stream = busy.parse()
    try:
        next(iter(stream))  # it runs there now
        prompt = prefix + [96, 97, 98]
        got, cached, target = complete(r.client, prompt, 16)
    finally:
        stream.close()
    assert target != holder
    return holder, target, cached, got, cold(prompt, 16)


def test_a_request_routed_off_the_holder_pulls_its_prefix(front, instances, cold):
    urls = ids_of(front)
    by_url = {p.url: p for p in instances.values()}
    before = {n: decisions(p) for n, p in instances.items()}
    prefix = [(7 * i + 5) % 120 + 3 for i in range(PREFIX)]
    holder, target, cached, got, want = routed_while_busy(front, prefix, cold)
    assert got == want  # pulled K/V give the cold run's tokens
    assert cached == PREFIX  # every block of the shared prefix came from the holder
    t = by_url[urls[target]]
    after = decisions(t)
    name = next(n for n, p in instances.items() if p is t)
    assert after["pull"] - before[name]["pull"] == 1, (before, after)
    assert after["failed"] == before[name]["failed"]
    m = t.metrics()
    assert m["ringkv_kv_pulled_tokens_total"] >= PREFIX
    assert m["ringkv_kv_pulled_bytes_total"] > 0 and m["ringkv_kv_link_bytes_per_second"] > 0
    assert m["ringkv_kv_link_setup_seconds"] > 0
    assert by_url[urls[holder]].metrics()["ringkv_kv_shared_total"] >= 1
    rm = front.metrics()
    assert rm[f'ringkv_router_pull_hints_total{{instance="{target}"}}'] >= 1
    assert rm[f'ringkv_router_tier_blocks{{instance="{holder}",tier="device"}}'] >= PREFIX // BS


def test_no_kv_pull_recomputes(instances, cold):
    a, b = instances["a"], instances["b"]
    r = Proc(
        "router",
        *("--upstream", a.url, "--upstream", b.url),
        *("--admin-key", KEY, "--no-migration", "--balance", "0", "--no-kv-pull"),
        key=KEY,
    )
    try:
        r.wait_all_up(120)
        before = {n: decisions(instances[n]) for n in "ab"}
        prefix = [(11 * i + 2) % 120 + 3 for i in range(PREFIX)]
        holder, target, cached, got, want = routed_while_busy(r, prefix, cold)
        assert got == want
        assert cached == 0  # recomputed: nobody told it to pull
        assert {n: decisions(instances[n]) for n in "ab"} == before
        m = r.metrics()
        assert m["ringkv_router_kv_pull"] == 0
        assert sum(v for k, v in m.items() if k.startswith("ringkv_router_pull_hints")) == 0
    finally:
        r.close()


def test_a_pull_hint_from_a_plain_client_is_ignored(instances, cold):
    """The hint sent straight to an instance: ignored without the admin key or with a wrong
    one (not even weighed), honoured with it (as a router sends it)."""
    a, b = instances["a"], instances["b"]
    before = decisions(b)
    for k, key in enumerate((None, "not-the-key", KEY)):
        prefix = [(13 * i + k + 1) % 120 + 3 for i in range(PREFIX)]  # a fresh one each time
        complete(a.client, prefix + [90, 91, 92], 2)  # cached on a
        prompt = prefix + [96, 97, 98]
        headers = {PULL_HEADER: f"{a.url} {PREFIX}"}
        if key is not None:
            headers["x-ringkv-admin-key"] = key
        got, cached, _ = complete(b.client, prompt, extra_headers=headers)
        honoured = key == KEY
        assert got == cold(prompt, 8)
        assert cached == (PREFIX if honoured else 0), key
        assert decisions(b) == dict(before, pull=before["pull"] + honoured), key
    # a malformed hint from an admin is a 400 naming the header
    r = httpx.post(
        b.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        headers={PULL_HEADER: "nowhere", "x-ringkv-admin-key": KEY},
        timeout=60,
    )
    assert r.status_code == 400 and PULL_HEADER in r.text


def test_requests_hinted_the_same_prefix_at_once_pull_it_once(instances, cold):
    a, b = instances["a"], instances["b"]
    prefix = [(19 * i + 6) % 120 + 3 for i in range(PREFIX)]
    complete(a.client, prefix + [90, 91, 92], 2)  # cached on a
    prompts = [prefix + [96 + k, 97, 98] for k in range(3)]
    headers = {PULL_HEADER: f"{a.url} {PREFIX}", "x-ringkv-admin-key": KEY}
    before, got = decisions(b), {}

    def one(k):
        got[k] = complete(b.client, prompts[k], extra_headers=headers)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k, prompt in enumerate(prompts):
        assert got[k][:2] == (cold(prompt, 8), PREFIX)
    after = decisions(b)
    # one pull; the others waited for it and found the prefix held (nothing left to gain)
    assert after == dict(before, pull=before["pull"] + 1, recompute=before["recompute"] + 2)


def test_a_holder_killed_before_the_pull_costs_a_recompute(front, instances, cold):
    """c holds the prefix; it is SIGKILLed; the request goes to c (the router has not seen it
    die), fails over to a or b with the hint to pull from c, whose pull fails: the request
    recomputes and gets the cold run's tokens."""
    c = instances["c"]
    cid = next(i for i, u in ids_of(front).items() if u == c.url)
    prefix = [(17 * i + 4) % 120 + 3 for i in range(PREFIX)]
    known = indexed(front)[cid]
    complete(c.client, prefix + [90, 91, 92], 2)  # cached on c
    wait_indexed(front, cid, known + PREFIX // BS)
    prompt = prefix + [96, 97, 98]
    want = cold(prompt, 8)
    before = {n: decisions(instances[n]) for n in "ab"}
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(timeout=30)
    got, cached, where = complete(front.client, prompt)
    assert got == want and cached == 0
    assert where != cid
    after = {n: decisions(instances[n]) for n in "ab"}
    failed = sum(after[n]["failed"] - before[n]["failed"] for n in "ab")
    pulled = sum(after[n]["pull"] - before[n]["pull"] for n in "ab")
    assert (failed, pulled) == (1, 0), (before, after)
