"""Atomicity of the tiered prefix cache (issue #44, part 4): a hypothesis state machine drives two
engines of different block sizes, each with a small device pool, a small host tier and a disk
tier, through requests of three tenants, steps, aborts, eviction pressure, prefix pulls between
them (directly and over a real ``Link``), corrupted disk-tier files and failed pulls (a link that
breaks mid-message, a holder that refuses, a prefix with wrong shapes, dtypes, model or NaN K/V).

After every rule: the block invariants hold on both engines, every block a live sequence holds is
referenced at least as often as it is held, the tiers agree with ``kv_cache_info()`` (each key
once, no more entries than slots), every pin an export took is released, and no tenant's request
or export reaches further than what was computed or pulled for its own salt. Every exported
prefix's K/V equal a cold engine's (no pull reads a block that was evicted and reused), and at
the end every request's tokens equal an uncached greedy run of its prompt."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from datetime import timedelta

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringkv.engine import LLM, SamplingParams
from ringkv.engine.remote import recv_prefix
from ringkv.engine.snapshot import PrefixKV
from ringkv.parallel.transfer import Link, LinkError
from tests.test_engine import tiny_engine_model, uncached_greedy
from tests.test_tiers import over_link

V = 61  # the tiny model's vocabulary
_P0 = [(i * 13 + 5) % V for i in range(20)]
PREFIXES = [  # shared prompt prefixes; the third branches off the first after 12 tokens
    _P0,
    [(i * 7 + 3) % V for i in range(16)],
    _P0[:12] + [(i * 5 + 1) % V for i in range(12)],
]
SUFFIXES = [[1], [2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
SALTS = [None, "t1", "t2"]
FILE_OVERHEAD = 1024  # bytes of a disk-tier file besides its K/V (its header: ~520 here)
LINK_TIMEOUT = timedelta(seconds=20)

MODEL = None
_REF = None  # a cold engine with a large pool and no tiers: the K/V every export must equal
_REF_KV = {}


def model():
    global MODEL
    if MODEL is None:
        MODEL = tiny_engine_model()
    return MODEL


def reference_kv(tokens):
    """K/V ``(layers, len(tokens), Hkv, D)`` of ``tokens`` computed cold (prefill of
    ``tokens + [0]`` on a fresh-enough engine)."""
    global _REF
    key = tuple(tokens)
    if key not in _REF_KV:
        if _REF is None:
            _REF = LLM(model(), block_size=2, num_blocks=1024, kv_host_memory=0)
        ids = list(tokens) + [0]
        _REF.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        pre = _REF.export_prefix(ids)
        assert pre is not None and len(pre.token_ids) >= len(tokens)
        n = len(tokens)
        _REF_KV[key] = (pre.k[:, :n].clone(), pre.v[:, :n].clone())
    return _REF_KV[key]


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def unique_prompt(seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (length,), generator=g).tolist()


def state(e):
    """What a refused pull must leave exactly as it was."""
    b, t = e.core.blocks, e.core.tiers
    return (
        b.num_free,
        list(b.ref),
        dict(b.by_hash),
        list(b.evictable),
        b.promotions,
        None if t is None else (list(t.slot_of), None if t.disk is None else t.disk.keys()),
    )


def partial_send(port: int, prefix: PrefixKV) -> None:
    """A holder that dies mid-pull: the length and header of a real ``send_prefix`` message and
    the first half of its K bytes (in the header's chunks), then the link closes, and its
    connection with it."""
    chunk = 256
    link = Link.connect("127.0.0.1", port, timeout=LINK_TIMEOUT)
    try:
        tensors = {"k": prefix.k, "v": prefix.v}
        head = {
            "prefix": dict(
                model=prefix.model,
                kv_cache_dtype=prefix.kv_cache_dtype,
                token_ids=prefix.token_ids,
                cache_salt=prefix.cache_salt,
            ),
            "tensors": [[n, str(t.dtype)[6:], list(t.shape), 1] for n, t in tensors.items()],
            "chunk": chunk,
        }
        data = json.dumps(head).encode()
        k = prefix.k.contiguous().reshape(-1).view(torch.uint8)
        half = [k[i : i + chunk].clone() for i in range(0, k.numel() // 2, chunk)]
        length = torch.tensor([len(data)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        link._stream("send", [length, body, *half], "half a prefix")
    finally:
        link.close()


class TieredCache(RuleBasedStateMachine):
    """Engines ``a`` (block size 2 or 4, 48 tokens of pool) and ``b`` (block size 8 or 16, 64
    tokens), a host and a disk tier on both (b's host tier may be off: then its evictions go
    straight to disk); tier sizes in blocks."""

    def __init__(self):
        super().__init__()
        self.engines = {}

    @initialize(
        host_a=st.sampled_from([2, 6]),
        host_b=st.sampled_from([0, 3]),
        disk_a=st.sampled_from([3, 12]),
        disk_b=st.sampled_from([4, 10]),
        bs_a=st.sampled_from([2, 4]),
        bs_b=st.sampled_from([8, 16]),
    )
    def setup(self, host_a, host_b, disk_a, disk_b, bs_a, bs_b):
        self.dir = tempfile.mkdtemp(prefix="ringkv-atomic-")
        self.engines["a"] = self.start("a", bs_a, host_a, disk_a)
        self.engines["b"] = self.start("b", bs_b, host_b, disk_b)
        self.reqs = {}  # request id -> (engine, prompt, salt, max_tokens)
        self.outs = {}  # request id -> its last output
        self.aborted = set()
        # (engine, salt) -> [(request id or "pulled", tokens)]: what was computed or pulled there
        self.known = {}
        self.checked = set()  # finished requests whose cached tokens were checked

    # -- helpers --------------------------------------------------------------------------
    POOL = {"a": 48, "b": 64}  # tokens of each engine's device pool, whatever its block size

    def start(self, name, bs, host, disk):
        """Engine ``name`` of block size ``bs``, host and disk tiers of ``host`` and ``disk``
        blocks (its disk tier in the same directory whatever the rest)."""
        entry = 2 * bs * 2 * 8 * 4 * 2  # 2 layers x bs tokens x 2 KV heads of 8 x fp32 x K, V
        return LLM(
            model(),
            block_size=bs,
            num_blocks=self.POOL[name] // bs,
            max_num_batched_tokens=24,
            kv_host_memory=host * entry,
            kv_disk=os.path.join(self.dir, name),
            kv_disk_size=disk * (entry + FILE_OVERHEAD),
        )

    def full(self, prompt, n):
        """The sequence a request computes: its prompt and its (greedy) output."""
        return list(prompt) + uncached_greedy(model(), prompt, n)

    def bound(self, e, salt, tokens, rid=None) -> int:
        """The longest prefix of ``tokens`` anything of tenant ``salt`` put into engine ``e``
        (other than request ``rid`` itself)."""
        return max(
            (lcp(tokens, t) for r, t in self.known.get((e, salt), []) if r != rid), default=0
        )

    def collect(self, name):
        for o in self.engines[name].step():
            self.outs[o.request_id] = o

    def live(self, name):
        e = self.engines[name]
        return [rid for rid, r in self.reqs.items() if r[0] == name and e.request_state(rid)]

    def add(self, name, prompt, salt, n):
        rid = f"r{len(self.reqs)}"
        self.engines[name].add_request(
            prompt, SamplingParams(temperature=0, max_tokens=n), request_id=rid, cache_salt=salt
        )
        self.reqs[rid] = (name, prompt, salt, n)
        self.known.setdefault((name, salt), []).append((rid, self.full(prompt, n)))
        return rid

    def export(self, src, prompt, salt):
        """``src.export_prefix``, checked: its pins released, its tokens within the tenant's,
        its K/V those of a cold run."""
        e = self.engines[src]
        refs = list(e.core.blocks.ref)
        pre = e.export_prefix(prompt, salt)
        assert e.core.blocks.ref == refs, "an export left blocks pinned"
        if pre is None:
            return None
        n = len(pre.token_ids)
        assert n % e.core.blocks.block_size == 0 and pre.token_ids == prompt[:n]
        assert pre.cache_salt == salt
        assert n <= self.bound(src, salt, prompt), "an export reached another tenant's blocks"
        k, v = reference_kv(pre.token_ids)
        torch.testing.assert_close(pre.k, k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pre.v, v, atol=1e-4, rtol=1e-4)
        return pre

    def imported(self, dst, pre, n):
        """``n`` tokens of ``pre`` went into ``dst``'s cache."""
        e = self.engines[dst]
        assert 0 <= n <= len(pre.token_ids) and n % e.core.blocks.block_size == 0
        if n:
            self.known.setdefault((dst, pre.cache_salt), []).append(("pulled", pre.token_ids[:n]))
            probe = pre.token_ids[:n] + [0]
            assert e.cached_tokens(probe, pre.cache_salt) >= n

    # -- rules ----------------------------------------------------------------------------
    @precondition(lambda self: self.engines)
    @rule(
        name=st.sampled_from("ab"),
        i=st.integers(0, len(PREFIXES) - 1),
        j=st.integers(0, len(SUFFIXES) - 1),
        salt=st.sampled_from(SALTS),
        n=st.integers(1, 4),
        steps=st.integers(0, 3),
    )
    def request(self, name, i, j, salt, n, steps):
        """A request of a shared prefix, and ``steps`` steps of its engine."""
        self.add(name, PREFIXES[i] + SUFFIXES[j], salt, n)
        self.step(name, steps)

    @precondition(lambda self: self.engines)
    @rule(name=st.sampled_from("ab"), steps=st.integers(1, 8))
    def step(self, name, steps):
        for _ in range(steps):
            self.collect(name)

    @precondition(lambda self: self.engines)
    @rule(name=st.sampled_from("ab"), k=st.integers(0, 50))
    def abort(self, name, k):
        live = self.live(name)
        if live:
            rid = live[k % len(live)]
            if self.engines[name].abort_request(rid):
                self.aborted.add(rid)

    @precondition(lambda self: self.engines)
    @rule(
        name=st.sampled_from("ab"),
        seed=st.integers(0, 10**6),
        length=st.integers(24, 44),
        salt=st.sampled_from(SALTS),
    )
    def pressure(self, name, seed, length, salt):
        """A long unique prompt, run until it is done: its blocks evict the pool's cached ones
        to the tiers (and may preempt the requests running beside it)."""
        rid = self.add(name, unique_prompt(seed, length), salt, 2)
        for _ in range(200):
            if not self.engines[name].request_state(rid):
                break
            self.collect(name)

    @precondition(lambda self: self.reqs)
    @rule(k=st.integers(0, 1000), other=st.booleans(), n=st.integers(1, 4), steps=st.integers(0, 3))
    def again(self, k, other, n, steps):
        """An earlier request's prompt and tenant again, on its engine or the other (a hit on
        the device, a promotion from a tier, or a miss), and ``steps`` steps there."""
        name, prompt, salt, _ = list(self.reqs.values())[k % len(self.reqs)]
        name = {"a": "b", "b": "a"}[name] if other else name
        self.add(name, prompt, salt, n)
        self.step(name, steps)

    @precondition(lambda self: self.reqs)
    @rule(
        k=st.integers(0, 1000),
        wire=st.booleans(),
        then=st.booleans(),
        tenant=st.booleans(),
        settle=st.booleans(),
    )
    def pull(self, k, wire, then, tenant, settle):
        """The other engine pulls the cached prefix of an earlier request's prompt from the
        engine that ran it (``settle``: once that request is done there; else whatever it holds
        so far, its other requests running), over a real link or directly, and ``then`` gets the
        request. ``tenant``: under another tenant's salt, which may reach only what that tenant
        computed."""
        rid, (src, prompt, salt, _) = list(self.reqs.items())[k % len(self.reqs)]
        for _ in range(200 if settle else 0):
            if not self.engines[src].request_state(rid):
                break
            self.collect(src)
        if tenant:
            salt = SALTS[(SALTS.index(salt) + 1 + k % 2) % len(SALTS)]
        dst = "b" if src == "a" else "a"
        pre = self.export(src, prompt, salt)
        if pre is not None:
            if wire:
                moved = over_link(pre)
                assert moved.token_ids == pre.token_ids and moved.cache_salt == pre.cache_salt
                assert torch.equal(moved.k, pre.k) and torch.equal(moved.v, pre.v)
                pre = moved
            self.imported(dst, pre, self.engines[dst].import_prefix(pre))
        if then:
            self.add(dst, prompt, salt, 2)

    @precondition(lambda self: self.engines)
    @rule(
        dst=st.sampled_from("ab"),
        i=st.integers(0, len(PREFIXES) - 1),
        salt=st.sampled_from(SALTS),
    )
    def pull_link_breaks(self, dst, i, salt):
        """The holder dies mid-message: the receiver gets a ``LinkError``, the target is
        unchanged and recomputes the request instead."""
        e = self.engines[dst]
        prompt = PREFIXES[i] + SUFFIXES[0]
        n = len(prompt) // 8 * 8
        k, v = reference_kv(prompt[:n])
        pre = PrefixKV(e.digest, "float32", prompt[:n], salt, k, v)
        before = state(e)
        with Link.listen("127.0.0.1", 0, timeout=LINK_TIMEOUT) as lst:
            t = threading.Thread(target=partial_send, args=(lst.port, pre))
            t.start()
            try:
                with pytest.raises(LinkError):
                    lst.accept()
                    recv_prefix(lst)
            finally:
                t.join(timeout=60)
        assert not t.is_alive()
        assert state(e) == before
        self.add(dst, prompt, salt, 2)

    BAD = ["short", "heads", "model", "kv_dtype", "dtype", "nan", "inf", "ids", "salt", "scale"]

    @precondition(lambda self: self.engines)
    @rule(
        dst=st.sampled_from("ab"),
        i=st.integers(0, len(PREFIXES) - 1),
        salt=st.sampled_from(SALTS),
        bad=st.sampled_from(BAD),
    )
    def pull_refused(self, dst, i, salt, bad):
        """A prefix a broken or foreign holder sent: refused with ``ValueError``/``TypeError``
        before anything is allocated, promoted or registered; and a holder asked to export an
        invalid prompt refuses and keeps nothing pinned."""
        e = self.engines[dst]
        prompt = PREFIXES[i]
        n = len(prompt) // 8 * 8
        k, v = (t.clone() for t in reference_kv(prompt[:n]))
        f = dict(
            model=e.digest,
            kv_cache_dtype="float32",
            token_ids=prompt[:n],
            cache_salt=salt,
            k=k,
            v=v,
        )
        if bad == "short":
            f["k"], f["v"] = k[:, :-1], v[:, :-1]
        elif bad == "heads":
            f["k"] = torch.cat([k, k[:, :, :1]], 2)
        elif bad == "model":
            f["model"] = "0" * 64
        elif bad == "kv_dtype":
            f["kv_cache_dtype"] = "int8"
        elif bad == "dtype":
            f["k"], f["v"] = k.double(), v.double()
        elif bad == "nan":
            k[1, n // 2, 0, 3] = float("nan")
        elif bad == "inf":
            v[0, n - 1, 1, 0] = float("-inf")
        elif bad == "ids":
            f["token_ids"] = prompt[: n - 1] + [V]
        elif bad == "salt":
            f["cache_salt"] = 7
        elif bad == "scale":
            f["k_scale"] = torch.ones(k.shape[:3], dtype=torch.float16)
            f["v_scale"] = torch.ones(k.shape[:3], dtype=torch.float16)
        before = state(e)
        with pytest.raises((ValueError, TypeError)):
            e.import_prefix(PrefixKV(**f))
        assert state(e) == before, f"a refused import ({bad}) changed the engine"
        with pytest.raises(ValueError):
            e.export_prefix(prompt[:5] + [V] + prompt[6:], salt)
        assert state(e) == before, "a refused export changed the engine"

    @precondition(lambda self: self.engines)
    @rule(
        name=st.sampled_from("ab"),
        small=st.booleans(),
        host=st.sampled_from([0, 2, 6]),
        disk=st.sampled_from([2, 4, 12]),
    )
    def restart(self, name, small, host, disk):
        """The instance goes down (its requests are lost) and a new one starts on the same disk
        directory, with the smaller or larger of its block sizes and other tier sizes: it
        indexes the files its predecessors wrote for its own block size (deleting the oldest
        beyond its bound) and promotes from them; files of the other size are not its own."""
        self.engines[name].close()
        for rid, r in self.reqs.items():
            if r[0] == name and (rid not in self.outs or not self.outs[rid].finished):
                self.aborted.add(rid)
        bs = {"a": (2, 4), "b": (8, 16)}[name][0 if small else 1]
        self.engines[name] = self.start(name, bs, host, disk)

    @precondition(lambda self: self.engines)
    @rule(name=st.sampled_from("ab"), k=st.integers(0, 1000), cut=st.floats(0.0, 0.99))
    def corrupt(self, name, k, cut):
        """Damage a disk-tier file: a flipped byte, or truncation. A promotion or export that
        reaches it must refuse it and recompute (the K/V and token checks see the rest)."""
        d = self.engines[name].core.tiers.disk.path
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        if not files:
            return
        path = os.path.join(d, files[k % len(files)])
        with open(path, "r+b") as fh:
            data = fh.read()
            if not data:  # truncated to nothing already
                return
            at = int(cut * len(data))
            if k % 2:
                fh.seek(at)
                fh.write(bytes([data[at] ^ 0xFF]))
            else:
                fh.truncate(at)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def blocks_consistent(self):
        for e in self.engines.values():
            b = e.core.blocks
            b.check()
            held = [0] * b.num_blocks
            for seqs in e.core.pipeline.active.values():
                for s in seqs:
                    if not s.finished:
                        for blk in s.block_table:
                            held[blk] += 1
            bad = [(blk, h, b.ref[blk]) for blk, h in enumerate(held) if h > b.ref[blk]]
            assert not bad, f"blocks held by live sequences beyond their references: {bad}"

    @invariant()
    def tiers_consistent(self):
        for name, e in self.engines.items():
            info, t = e.kv_cache_info()["tiers"], e.core.tiers
            b = e.core.blocks
            assert info["device"]["cached"] == len(b.by_hash)
            assert info["device"]["blocks"] == b.num_blocks - b.num_free
            assert info["device"]["promotions"] == b.promotions
            slots = list(t.slot_of.values())
            assert len(set(slots)) == len(slots) <= t.host_blocks
            assert t.fresh <= t.host_blocks  # slots handed out so far: in use or given back
            assert sorted(slots + t.free_slots) == list(range(t.fresh))
            if t.host_blocks:
                assert info["host"]["blocks"] == len(t.slot_of) <= info["host"]["capacity_blocks"]
            else:
                assert info["host"] is None and not t.slot_of
            hashes = [h for h, _ in t.keys()]
            assert len(set(hashes)) == len(hashes), "a tier entry listed twice"
            disk = t.disk.keys()
            assert len(set(disk)) == len(disk) == info["disk"]["blocks"]
            assert info["disk"]["bytes"] <= info["disk"]["capacity_bytes"]
            assert info["disk"]["enabled"], info["disk"]["error"]
            files = set(os.listdir(t.disk.path))
            assert {key.hex() + ".safetensors" for key in disk} <= files
            cached = e.cached_blocks()
            assert len({h for h, _ in cached}) == len(cached), "a block listed in two tiers"

    @invariant()
    def tenants_apart(self):
        for rid, o in self.outs.items():
            if rid in self.checked or not o.finished or rid in self.aborted:
                continue
            name, prompt, salt, _ = self.reqs[rid]
            self.checked.add(rid)
            limit = self.bound(name, salt, prompt, rid)
            assert o.num_cached_tokens <= limit, (
                f"request {rid} (salt {salt!r}) got {o.num_cached_tokens} cached tokens, but its "
                f"tenant computed or pulled only {limit} of its prompt there"
            )

    def teardown(self):
        try:
            if not self.engines:
                return
            for name, e in self.engines.items():
                for _ in range(2000):
                    if not e.has_unfinished_requests():
                        break
                    self.collect(name)
                assert not e.has_unfinished_requests(), f"engine {name} never went idle"
            self.tenants_apart()
            for rid, (name, prompt, salt, n) in self.reqs.items():
                if rid in self.aborted:
                    continue
                o = self.outs[rid]
                assert o.finish_reason == "length", (rid, o.finish_reason, o.error)
                assert o.token_ids == uncached_greedy(model(), prompt, n), (
                    f"request {rid} on {name} (salt {salt!r}, {len(prompt)} tokens, "
                    f"{o.num_cached_tokens} cached) differs from a cold run"
                )
            for e in self.engines.values():
                e.core.blocks.check()
                assert e.core.blocks.num_free == e.core.blocks.num_blocks, "blocks leaked"
        finally:
            for e in self.engines.values():
                e.close()
            if self.engines:
                shutil.rmtree(self.dir, ignore_errors=True)


TestTieredCache = TieredCache.TestCase
TestTieredCache.settings = settings(max_examples=15, stateful_step_count=30, deadline=None)


def test_an_import_into_a_busy_pool_takes_only_free_blocks():
    """A pull into an engine whose running request holds most of its pool imports the whole
    blocks its free blocks hold, never one of the running request's; both requests' tokens
    then equal a cold run."""
    m = model()
    long, prompt = unique_prompt(7, 44), PREFIXES[2] + SUFFIXES[1]
    a = LLM(m, block_size=4, num_blocks=32, kv_host_memory=0)
    b = LLM(m, block_size=8, num_blocks=8, kv_host_memory=0, max_num_batched_tokens=64)
    try:
        a.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        pre = a.export_prefix(prompt)
        assert len(pre.token_ids) == 24
        rid = b.add_request(long, SamplingParams(temperature=0, max_tokens=4))
        b.step()
        (seq,) = b.sequences(rid)
        held, refs = list(seq.block_table), list(b.core.blocks.ref)
        assert len(held) == 6 and b.core.blocks.num_free == 2
        assert b.import_prefix(pre) == 16  # two of its three blocks fit
        assert seq.block_table == held and [b.core.blocks.ref[x] for x in held] == [
            refs[x] for x in held
        ]
        b.core.blocks.check()
        outs = {}
        while b.has_unfinished_requests():
            for o in b.step():
                outs[o.request_id] = o
        assert outs[rid].token_ids == uncached_greedy(m, long, 4)
        (o,) = b.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert o.token_ids == uncached_greedy(m, prompt, 4) and o.num_cached_tokens == 16
        assert b.core.blocks.num_free == b.core.blocks.num_blocks
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_promotion_does_not_push_its_own_chain_out_of_the_tiers(tier, tmp_path):
    """A prompt whose two blocks a tier of 2 blocks holds (the host tier, or a disk tier behind
    none), in a pool of 6 blocks with 1 empty and 5 evictable: both blocks fit, so both must be
    promoted. (Found by this file: ``match_prefix`` allocates each promoted block while it walks
    the chain, before any entry is loaded; the second allocation evicts a device block into the
    full tier, whose least recently used entry is the chain's own second block, still to be
    loaded: it is dropped, counted as a load failure, and recomputed.)"""
    m = model()
    entry = 2 * 4 * 2 * 8 * 4 * 2  # one 4-token block: 2 layers x 2 KV heads of 8 x fp32 x K, V
    kw = dict(kv_host_memory=2 * entry)
    if tier == "disk":
        kw = dict(kv_host_memory=0, kv_disk=str(tmp_path), kv_disk_size=2 * (entry + FILE_OVERHEAD))
    e = LLM(m, block_size=4, num_blocks=6, **kw)
    try:
        one = SamplingParams(temperature=0, max_tokens=1)
        q = [30] + list(range(40, 48))  # 2 full blocks and 1 token
        x = [50] + list(range(1, 23))  # 23 tokens: its 6 blocks evict q's 2 to the tier
        e.generate([q], one, use_tqdm=False)
        e.generate([x], one, use_tqdm=False)
        assert [blk for blk, _ in e.core.blocks.locate(q[:-1])] == [None, None]  # both in the tier
        assert len(e.core.blocks.empty) == 1 and len(e.core.blocks.evictable) == 5
        (o,) = e.generate([q], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert o.token_ids == uncached_greedy(m, q, 3)
        assert (o.num_cached_tokens, e.core.tiers.load_failures) == (8, 0), (
            f"{o.num_cached_tokens} of 8 tokens promoted, "
            f"{e.core.tiers.load_failures} load failures"
        )
        e.core.blocks.check()
    finally:
        e.close()
