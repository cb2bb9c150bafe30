"""Moving running requests between engines: after a migration (full, incremental over several
rounds, through a file, across two processes), greedy and seeded-sampling outputs equal the
unmigrated run; mid-prefill and preempted requests move too; imported blocks serve prefix
hits only when the importer opts in; wrong snapshots are refused and the source keeps the
request; every field of a snapshot is checked and a refused import changes nothing (also
for random corruptions: hypothesis); the checksum covers the metadata; the model digest
tells checkpoints of one config apart; reclaimed held blocks lose nothing; random sequences
of steps, exports, imports and aborts never lose or duplicate a request."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("transformers")

from ringkv.engine import LLM, KVSnapshot, RequestState, SamplingParams  # noqa: E402
from ringkv.engine.snapshot import model_digest  # noqa: E402
from ringkv.model.loader import StateDictSource, open_model  # noqa: E402
from tests.models import tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0, num_hidden_layers=3)


def prompts(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 40, 70)]


_refs = {}


def unmoved_tokens(model, params):
    key = (id(model), repr(params))
    if key not in _refs:
        _refs[key] = [
            o.token_ids
            for o in LLM(model, block_size=4, num_blocks=128).generate(
                prompts(), params, use_tqdm=False
            )
        ]
    return _refs[key]


class Run:
    """Two engines and the outputs of every step of either."""

    def __init__(self, model, src_kw=None, dst_kw=None):
        self.a = LLM(
            model, **(src_kw or dict(block_size=4, num_blocks=128, max_num_batched_tokens=16))
        )
        self.b = LLM(model, **(dst_kw or dict(block_size=8, num_blocks=64)))
        self.outs = {}

    def step(self, e):
        for o in e.step():
            self.outs[o.request_id] = o

    def finish(self):
        for e in (self.a, self.b):
            while e.has_unfinished_requests():
                self.step(e)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["full", "incremental", "file"])
def test_migrated_requests_finish_as_if_never_moved(model, params, mode, tmp_path):
    r = Run(model)
    rids = [r.a.add_request(p, params) for p in prompts()]
    for _ in range(3):
        r.step(r.a)
    mid_prefill = [
        rid
        for rid in rids
        if r.a.sequences(rid)[0].num_computed < len(r.a.sequences(rid)[0].prompt_token_ids)
    ]
    assert mid_prefill  # chunked prefill is under way for some of them
    moved = 0
    for rid in rids:
        if r.a.request_state(rid) is not RequestState.ACTIVE:
            continue  # it finished here meanwhile
        if mode == "incremental":  # pre-copy while it runs, two more rounds, then stop
            snap = r.a.export_request(rid, stop=False)
            r.b.import_request(snap)
            for _ in range(2):
                r.step(r.a)
                if r.a.request_state(rid) is not RequestState.ACTIVE:
                    break
                nxt = r.a.export_request(rid, since=snap, stop=False)
                r.b.import_request(nxt)
                snap = nxt
            # finished on the source: the staged copy goes
            if r.a.request_state(rid) is not RequestState.ACTIVE:
                assert r.b.abort_request(rid)
                continue
            r.b.import_request(r.a.export_request(rid, since=snap))
        else:
            snap = r.a.export_request(rid)
            if mode == "file":
                snap.save(tmp_path / f"{rid}.safetensors")
                snap = KVSnapshot.load(tmp_path / f"{rid}.safetensors")
            r.b.import_request(snap)
        assert r.a.abort_request(rid)  # the source's copy goes once the import succeeded
        moved += 1
    assert moved >= 2
    r.finish()
    assert [r.outs[rid].token_ids for rid in rids] == unmoved_tokens(model, params)
    assert (
        r.a.core.blocks.num_free == r.a.core.blocks.num_blocks
        and r.b.core.blocks.num_free == r.b.core.blocks.num_blocks
    )


def test_a_preempted_request_moves_and_imported_blocks_serve_hits(model):
    r = Run(
        model, dict(block_size=4, num_blocks=24, max_num_batched_tokens=32)
    )  # 96 tokens: preemption
    rids = [r.a.add_request(p, GREEDY) for p in prompts()]
    while not r.a.num_preemptions:
        r.step(r.a)
    victim = next(s for s in r.a.core.scheduler.waiting if s.num_preemptions)
    snap = r.a.export_request(victim.request_id)
    assert snap.end == 0 and snap.k.shape[1] == 0  # its K/V were dropped: the receiver recomputes
    r.b.import_request(snap)
    r.a.abort_request(victim.request_id)
    r.finish()
    assert [r.outs[rid].token_ids for rid in rids] == unmoved_tokens(model, GREEDY)
    # a request moved after its prefill leaves its full blocks in the receiver's prefix cache
    c = Run(model)
    rid = c.a.add_request(prompts()[3], GREEDY)
    for _ in range(6):
        c.step(c.a)
    c.b.import_request(
        c.a.export_request(rid), cache_prefix=True
    )  # opt-in: by default imported K/V stay out
    hits = c.b.prefix_cache_hits
    again = c.b.generate(prompts()[3], GREEDY, use_tqdm=False)[0]
    assert (
        c.b.prefix_cache_hits - hits == (len(prompts()[3]) - 1) // 8 and again.num_cached_tokens > 0
    )


def test_wrong_snapshots_are_refused_and_the_source_keeps_the_request(model, tmp_path):
    r = Run(model)
    rid = r.a.add_request(prompts()[2], GREEDY)
    for _ in range(4):
        r.step(r.a)
    snap = r.a.export_request(rid)
    with pytest.raises(ValueError, match="stopped by an earlier export"):
        r.a.export_request(rid)
    other = LLM(tiny_model("llama", 0, num_hidden_layers=2), block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="another model"):
        other.import_request(snap)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model, block_size=4, num_blocks=64, kv_cache_dtype="int8").import_request(snap)
    path = tmp_path / "s.safetensors"
    snap.save(path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(ValueError, match="corrupt"):
        KVSnapshot.load(path)
    path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])  # one bit flipped in the K/V
    with pytest.raises(ValueError, match="checksum"):
        KVSnapshot.load(path)
    a2 = r.a.export_request  # an incremental snapshot applied to the wrong base
    r.a.resume_request(rid)
    base = a2(rid, stop=False)
    r.step(r.a)
    nxt = a2(rid, since=base, stop=False)
    with pytest.raises(ValueError, match="in order"):
        r.b.import_request(nxt)
    assert (
        r.b.request_state(rid) is not RequestState.STAGED
        and r.b.core.blocks.num_free == r.b.core.blocks.num_blocks
    )  # nothing changed
    r.finish()  # nothing lost: the source still finishes it
    assert r.outs[rid].token_ids == unmoved_tokens(model, GREEDY)[2]


def test_migration_across_two_processes(worlds):
    params = dict(temperature=0.8, max_tokens=12, seed=9)
    want = LLM(tiny_model("llama", 0, num_hidden_layers=3), block_size=4, num_blocks=128).generate(
        prompts(), SamplingParams(**params), use_tqdm=False
    )
    res = worlds(2).check(
        "tests.engine_cases:migrate_pair",
        2,
        ("tiny", "llama", 0, dict(num_hidden_layers=3)),
        prompts(),
        params,
    )
    assert res[1] == [o.token_ids for o in want] and res[0] == "sent"


class Migrations(RuleBasedStateMachine):
    """Two engines; requests added to either, stepped, moved (in full or pre-copied), aborted.
    Every request lives in exactly one place, and the ones that finish equal the unmoved run."""

    def __init__(self):
        super().__init__()
        self.run = None

    def make_run(self) -> Run:
        return Run(
            MODEL,
            dict(block_size=4, num_blocks=48, max_num_batched_tokens=24),
            dict(block_size=8, num_blocks=32, max_num_batched_tokens=24),
        )

    @initialize()
    def setup(self):
        self.run = self.make_run()
        self.engines = {"a": self.run.a, "b": self.run.b}
        self.where, self.aborted, self.prompt_of, self.pre = {}, set(), {}, {}

    @rule(i=st.integers(0, 3), e=st.sampled_from("ab"))
    def add(self, i, e):
        rid = f"r{len(self.where)}"
        self.engines[e].add_request(prompts()[i], GREEDY, request_id=rid)
        self.where[rid], self.prompt_of[rid] = e, i

    @rule(e=st.sampled_from("ab"))
    def step(self, e):
        if self.engines[e].has_unfinished_requests():
            self.run.step(self.engines[e])

    def _live(self):
        return [
            rid
            for rid, e in self.where.items()
            if self.engines[e].request_state(rid) is RequestState.ACTIVE
        ]

    @precondition(lambda self: self.run is not None)
    @rule(k=st.integers(0, 50), pre=st.booleans())
    def move(self, k, pre):
        live = self._live()
        if not live:
            return
        rid = live[k % len(live)]
        src, dst = self.where[rid], "b" if self.where[rid] == "a" else "a"
        s, d = self.engines[src], self.engines[dst]
        snap = None
        if pre and rid not in self.pre:
            snap = self._export(s, rid, stop=False)
            if snap is None:
                return
            try:
                d.import_request(snap)
            except ValueError:  # no room there: it stays here
                return
            self.pre[rid] = snap
            return
        base = self.pre.get(rid)
        snap = self._export(s, rid, since=base)
        if snap is None:
            return
        self.pre.pop(rid, None)
        try:
            d.import_request(snap)
        except ValueError:
            s.resume_request(rid)  # nothing lost
            if base is not None:
                d.abort_request(rid)
            return
        s.abort_request(rid)
        self.where[rid] = dst

    @staticmethod
    def _export(s, rid, **kw):
        """``s.export_request(rid, **kw)``, or None when the steps an export completes first (a
        pipeline-parallel engine keeps some in flight) finished the request: nothing to move."""
        try:
            return s.export_request(rid, **kw)
        except ValueError:
            assert s.core.pipeline.get(rid)[0].finished
            return None

    @rule(k=st.integers(0, 50))
    def abort(self, k):
        live = self._live()
        if live:
            rid = live[k % len(live)]
            if rid in self.pre:
                other = self.engines["b" if self.where[rid] == "a" else "a"]
                other.abort_request(rid)
                self.pre.pop(rid)
            self.engines[self.where[rid]].abort_request(rid)
            self.aborted.add(rid)

    @invariant()
    def each_request_lives_once(self):
        if self.run is None:
            return
        for rid, e in self.where.items():
            homes = [
                n
                for n, eng in self.engines.items()
                if eng.request_state(rid) in (RequestState.ACTIVE, RequestState.PAUSED)
            ]
            assert homes in ([], [e]), (rid, homes)

    def teardown(self):
        if self.run is None:
            return
        for rid in list(self.pre):  # pre-copies never completed: drop them
            other = self.engines["b" if self.where[rid] == "a" else "a"]
            other.abort_request(rid)
        self.run.finish()
        ref = unmoved_tokens(MODEL, GREEDY)
        for rid, i in self.prompt_of.items():
            if rid not in self.aborted:
                assert self.run.outs[rid].token_ids == ref[i], rid
        for eng in self.engines.values():
            assert eng.core.blocks.num_free == eng.core.blocks.num_blocks and not eng.request_ids(
                RequestState.STAGED
            )


MODEL = None


@pytest.fixture(scope="module", autouse=True)
def _machine_model(model):
    global MODEL
    MODEL = model


TestMigrations = Migrations.TestCase
TestMigrations.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


@pytest.mark.slow
def test_disaggregated_example_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    tiny_model("llama", 0, num_hidden_layers=2).save_pretrained(tmp_path, safe_serialization=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(root, "examples", "disaggregated.py"),
            "--model",
            str(tmp_path),
            "--requests",
            "6",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "outputs identical to one engine: True (6 requests, 48 tokens)" in r.stdout


def test_quantized_blocks_move_with_their_scales(model):
    kw = dict(block_size=4, num_blocks=128, kv_cache_dtype="int8", max_num_batched_tokens=16)
    want = [o.token_ids for o in LLM(model, **kw).generate(prompts(), GREEDY, use_tqdm=False)]
    r = Run(model, kw, dict(block_size=8, num_blocks=64, kv_cache_dtype="int8"))
    rids = [r.a.add_request(p, GREEDY) for p in prompts()]
    for _ in range(5):
        r.step(r.a)
    for rid in rids:
        if r.a.request_state(rid) is RequestState.ACTIVE:
            snap = KVSnapshot.from_bytes(r.a.export_request(rid).to_bytes())
            assert snap.k.dtype == torch.int8 and snap.k_scale is not None
            r.b.import_request(snap)
            r.a.abort_request(rid)
    r.finish()
    assert [r.outs[rid].token_ids for rid in rids] == want


# -- an import trusts nothing ------------------------------------------------------------------
def state(e):
    """What a refused import must leave exactly as it was (and the block invariants hold)."""
    e.core.blocks.check()
    staged = {
        rid: (
            st.last_id,
            st.kv_end,
            st.dropped,
            list(st.seq.token_ids),
            len(st.seq.logprobs),
            list(st.seq.block_table),
            st.seq.num_computed,
            st.seq.generator.get_state().sum().item(),
        )
        for rid, st in ((rid, e.staged(rid)) for rid in e.request_ids(RequestState.STAGED))
    }
    return (
        e.core.blocks.num_free,
        list(e.core.blocks.ref),
        dict(e.core.blocks.hash_of),
        e.request_ids(RequestState.ACTIVE),
        e.request_ids(RequestState.PAUSED),
        staged,
        [s.seq_id for s in e.core.scheduler.waiting],
        [s.seq_id for s in e.core.scheduler.running],
    )


def refused(e, snap, match=None, errors=(ValueError, TypeError), what=""):
    """``snap`` is refused (``errors``, naming ``match``) and ``e`` is unchanged."""
    before = state(e)
    with pytest.raises(errors, match=match):
        e.import_request(snap)
    assert state(e) == before, what


LOGPROBS = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=0)


def held(model):
    """Engine ``b`` with a staged import of request "s"; ``full``: a valid final snapshot of
    request "f", ``inc``: a valid final increment of "s" (both with log-probs and prompt
    log-probs, K/V, generated tokens)."""
    r = Run(model, dict(block_size=4, num_blocks=128, max_num_batched_tokens=64))
    r.a.add_request(prompts()[1], LOGPROBS, request_id="f")
    r.a.add_request(prompts()[3], LOGPROBS, request_id="s")
    for _ in range(3):
        r.step(r.a)
    full = r.a.export_request("f")
    pre = r.a.export_request("s", stop=False)
    r.b.import_request(pre)
    r.step(r.a)
    inc = r.a.export_request("s", since=pre)
    assert full.logprobs and inc.logprobs and full.k.shape[1] and inc.k.shape[1] and inc.token_ids
    return r, full, inc


V = 128  # tiny_config's vocab_size
r_ = dataclasses.replace
NAN, INF = float("nan"), float("inf")


def _lp(s, i, entry):
    return s.logprobs[:i] + [entry] + s.logprobs[i + 1 :]


def _poke(t, value):
    t = t.clone()
    t.view(-1)[0] = value
    return t


# (what is wrong, which snapshot it applies to: f = full / first, i = increment, the error must
# match, mutation)
MUTATIONS = [
    ("OOV token id", "fi", "token_ids", lambda s: r_(s, token_ids=s.token_ids + [V])),
    ("negative token id", "fi", "token_ids", lambda s: r_(s, token_ids=s.token_ids + [-1])),
    ("bool token id", "fi", "token_ids", lambda s: r_(s, token_ids=[True] + s.token_ids[1:])),
    (
        "float token id",
        "fi",
        "token_ids",
        lambda s: r_(s, token_ids=[float(s.token_ids[0])] + s.token_ids[1:]),
    ),
    (
        "token ids as a tensor",
        "fi",
        "token_ids",
        lambda s: r_(s, token_ids=torch.tensor(s.token_ids)),
    ),
    (
        "OOV prompt id",
        "fi",
        "prompt_token_ids",
        lambda s: r_(s, prompt_token_ids=s.prompt_token_ids + [V]),
    ),
    (
        "prompt not the tokens' start",
        "f",
        "token_ids",
        lambda s: r_(s, prompt_token_ids=[(t + 1) % V for t in s.prompt_token_ids]),
    ),
    ("empty prompt", "f", "prompt_token_ids", lambda s: r_(s, prompt_token_ids=[])),
    ("too many tokens", "fi", "max_model_len", lambda s: r_(s, token_ids=s.token_ids + [5] * 300)),
    ("max_tokens reached", "fi", "max_tokens", lambda s: r_(s, token_ids=s.token_ids + [5] * 12)),
    ("unknown params key", "fi", "params", lambda s: r_(s, params=dict(s.params, bogus=1))),
    (
        "negative temperature",
        "fi",
        "params",
        lambda s: r_(s, params=dict(s.params, temperature=-1.0)),
    ),
    ("max_tokens 0", "fi", "params", lambda s: r_(s, params=dict(s.params, max_tokens=0))),
    ("n = 2", "fi", "params", lambda s: r_(s, params=dict(s.params, n=2))),
    ("params not a dict", "fi", "params", lambda s: r_(s, params=None)),
    (
        "truncated generator state",
        "fi",
        "generator_state",
        lambda s: r_(s, generator_state=s.generator_state[:-1]),
    ),
    (
        "float generator state",
        "fi",
        "generator_state",
        lambda s: r_(s, generator_state=s.generator_state.float()),
    ),
    (
        "zero generator state",
        "fi",
        "generator_state",
        lambda s: r_(s, generator_state=torch.zeros_like(s.generator_state)),
    ),
    ("no generator state", "fi", "generator_state", lambda s: r_(s, generator_state=None)),
    ("K of a wrong head size", "fi", "'k'", lambda s: r_(s, k=s.k[..., :-1])),
    ("K of one token more", "fi", "'k'", lambda s: r_(s, k=torch.cat([s.k, s.k[:, -1:]], 1))),
    ("V of another dtype", "fi", "'v'", lambda s: r_(s, v=s.v.double())),
    ("K of another dtype", "fi", "'k'", lambda s: r_(s, k=s.k.half())),
    ("V with a NaN", "fi", "'v'", lambda s: r_(s, v=_poke(s.v, NAN))),
    ("K with an inf", "fi", "'k'", lambda s: r_(s, k=_poke(s.k, INF))),
    ("K as a list", "fi", "'k'", lambda s: r_(s, k=s.k.tolist())),
    ("scales for a float cache", "fi", "k_scale", lambda s: r_(s, k_scale=s.k[..., 0])),
    (
        "OOV log-prob token",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, [V] + s.logprobs[0][1:])),
    ),
    (
        "NaN log-prob",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, [s.logprobs[0][0], NAN, []])),
    ),
    (
        "+inf log-prob",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, [s.logprobs[0][0], INF, []])),
    ),
    (
        "malformed top log-prob",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, s.logprobs[0][:2] + [[[1]]])),
    ),
    (
        "bool top token",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, s.logprobs[0][:2] + [[[True, -1.0]]])),
    ),
    (
        "log-prob entry as a dict",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=_lp(s, 0, {"token_id": 1})),
    ),
    ("a log-prob missing", "fi", "logprobs", lambda s: r_(s, logprobs=s.logprobs[:-1])),
    (
        "a log-prob too many",
        "fi",
        "logprobs",
        lambda s: r_(s, logprobs=s.logprobs + s.logprobs[-1:]),
    ),
    ("log-probs not a list", "fi", "logprobs", lambda s: r_(s, logprobs=None)),
    ("prompt log-probs missing", "fi", "prompt_logprobs", lambda s: r_(s, prompt_logprobs=None)),
    (
        "prompt log-probs short",
        "fi",
        "prompt_logprobs",
        lambda s: r_(s, prompt_logprobs=s.prompt_logprobs[:-1]),
    ),
    (
        "prompt log-prob a string",
        "fi",
        "prompt_logprobs",
        lambda s: r_(s, prompt_logprobs=["x"] + s.prompt_logprobs[1:]),
    ),
    ("negative cached tokens", "fi", "num_cached_tokens", lambda s: r_(s, num_cached_tokens=-1)),
    (
        "cached tokens past the prompt",
        "fi",
        "num_cached_tokens",
        lambda s: r_(s, num_cached_tokens=10**6),
    ),
    ("bool cached tokens", "fi", "num_cached_tokens", lambda s: r_(s, num_cached_tokens=True)),
    ("bool request id", "fi", "request_id", lambda s: r_(s, request_id=True)),
    ("float request id", "fi", "request_id", lambda s: r_(s, request_id=1.5)),
    ("list request id", "fi", "request_id", lambda s: r_(s, request_id=[1])),
    ("int snapshot id", "fi", "snapshot_id", lambda s: r_(s, snapshot_id=5)),
    ("unknown base", "fi", "in order", lambda s: r_(s, base_id="nope")),
    ("int base", "fi", "base_id", lambda s: r_(s, base_id=7)),
    ("a first snapshot again", "i", "already exists", lambda s: r_(s, base_id=None)),
    ("final not a bool", "fi", "final", lambda s: r_(s, final="yes")),
    ("int salt", "fi", "cache_salt", lambda s: r_(s, cache_salt=5)),
    ("start moved on", "fi", "first token|continue", lambda s: r_(s, start=s.start + 1)),
    ("negative start", "fi", "start", lambda s: r_(s, start=-1)),
    ("end moved on", "fi", "end", lambda s: r_(s, end=s.end + 1)),
    ("end before start", "fi", "end", lambda s: r_(s, end=s.start - 1)),
    ("bool end", "fi", "end", lambda s: r_(s, end=True)),
    (
        "tokens_from moved on",
        "fi",
        "first token|continue",
        lambda s: r_(s, tokens_from=s.tokens_from + 1),
    ),
    ("tokens_from moved back", "i", "continue", lambda s: r_(s, tokens_from=s.tokens_from - 1)),
    (
        "logprobs_from moved on",
        "fi",
        "first token|continue",
        lambda s: r_(s, logprobs_from=s.logprobs_from + 1),
    ),
    ("another model", "fi", "another model", lambda s: r_(s, model="0" * 16)),
    ("another KV dtype", "fi", "kv_cache_dtype", lambda s: r_(s, kv_cache_dtype="int8")),
    ("format version 1", "fi", "version", lambda s: r_(s, version=1)),
    ("not a KVSnapshot", "fi", "KVSnapshot", lambda s: dataclasses.asdict(s)),
]
CASES = [(m, kind) for m in MUTATIONS for kind in m[1]]


def test_each_corrupted_field_is_refused_by_name_and_changes_nothing(model):
    r, full, inc = held(model)
    for (what, _, match, mutate), kind in CASES:
        refused(r.b, mutate(full if kind == "f" else inc), match, what=what)
    assert (
        r.b.generate(prompts()[0], GREEDY, use_tqdm=False)[0].token_ids
        == unmoved_tokens(model, GREEDY)[0]
    )
    for snap in (full, inc):  # the snapshots themselves are fine
        r.b.import_request(KVSnapshot.from_bytes(snap.to_bytes()))
    for rid in ("f", "s"):
        r.a.abort_request(rid)
    r.finish()
    assert [r.outs[rid].token_ids for rid in ("f", "s")] == [
        unmoved_tokens(model, GREEDY)[i] for i in (1, 3)
    ]
    assert r.outs["s"].prompt_logprobs == pytest.approx(
        LLM(model, block_size=4, num_blocks=64)
        .generate(prompts()[3], LOGPROBS, use_tqdm=False)[0]
        .prompt_logprobs,
        abs=1e-4,
    )  # other chunks: rounding
    assert r.b.core.blocks.num_free == r.b.core.blocks.num_blocks
    r.b.core.blocks.check()


@pytest.fixture(scope="module")
def held_engine(model):
    return held(model)


@settings(max_examples=30, deadline=None)
@given(case=st.sampled_from(CASES))
def test_any_corrupted_snapshot_is_refused_and_the_engine_serves_on(held_engine, model, case):
    r, full, inc = held_engine
    (what, _, _, mutate), kind = case
    refused(r.b, mutate(full if kind == "f" else inc), what=what)
    assert (
        r.b.generate(prompts()[0], GREEDY, use_tqdm=False)[0].token_ids
        == unmoved_tokens(model, GREEDY)[0]
    ), what


def test_quantized_snapshots_need_their_scales(model):
    kw = dict(block_size=4, num_blocks=64, kv_cache_dtype="int8")
    a, b = LLM(model, **kw), LLM(model, **kw)
    rid = a.add_request(prompts()[1], GREEDY)
    a.step()
    snap = a.export_request(rid)
    for bad, match in (
        (r_(snap, k_scale=snap.k_scale[..., :-1]), "k_scale"),
        (r_(snap, v_scale=snap.v_scale[:, :-1]), "v_scale"),
        (r_(snap, k_scale=snap.k_scale.float()), "k_scale"),
        (r_(snap, v_scale=None), "v_scale"),
        (r_(snap, v_scale=_poke(snap.v_scale, NAN)), "v_scale"),
        (r_(snap, k=snap.k.view(torch.uint8)), "'k'"),
    ):
        refused(b, bad, match)
    b.import_request(snap)


def test_a_refused_import_takes_no_blocks_and_a_failed_write_gives_them_back(model, monkeypatch):
    r = Run(model)
    rid = r.a.add_request(prompts()[3], GREEDY)
    for _ in range(6):
        r.step(r.a)
    snap = r.a.export_request(rid)
    free = r.b.core.blocks.num_free
    for _ in range(2):  # before the fix each bad generator state took 5 more free blocks
        refused(r.b, r_(snap, generator_state=snap.generator_state[:100]), "generator_state")
    assert r.b.core.blocks.num_free == free

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(r.b.core.cluster, "write_kv", broken)
    refused(r.b, snap, "device lost", RuntimeError)
    monkeypatch.undo()
    r.b.import_request(snap)
    r.a.abort_request(rid)
    r.finish()
    assert r.outs[rid].token_ids == unmoved_tokens(model, GREEDY)[3]


def _edit_meta(data: bytes, edit) -> bytes:
    """A safetensors buffer with its snapshot metadata changed by ``edit(meta)`` (tensors
    untouched)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["ringkv_snapshot"])
    edit(meta)
    header["__metadata__"]["ringkv_snapshot"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def test_the_checksum_covers_the_metadata(model):
    r = Run(model)
    rid = r.a.add_request(prompts()[2], GREEDY)
    for _ in range(4):
        r.step(r.a)
    data = r.a.export_request(rid).to_bytes()
    assert (
        KVSnapshot.from_bytes(_edit_meta(data, lambda m: None)).token_ids
        == r.a.sequences(rid)[0].token_ids
    )
    for edit in (
        lambda m: m["token_ids"].__setitem__(3, (m["token_ids"][3] + 1) % V),
        lambda m: m["params"].__setitem__("max_tokens", 100),
        lambda m: m.__setitem__("request_id", "other"),
    ):
        with pytest.raises(ValueError, match="checksum"):
            KVSnapshot.from_bytes(_edit_meta(data, edit))
    with pytest.raises(ValueError, match="format version 1"):  # a file of the old format
        KVSnapshot.from_bytes(
            _edit_meta(data, lambda m: m.update(version=1, tensors_sha256=m.pop("sha256")))
        )


def test_a_snapshot_of_another_checkpoint_with_the_same_config_is_refused(model, tmp_path):
    r = Run(model)
    rid = r.a.add_request(prompts()[2], GREEDY)
    for _ in range(4):
        r.step(r.a)
    snap = r.a.export_request(rid)
    tuned = LLM(
        tiny_model("llama", 1, num_hidden_layers=3), block_size=4, num_blocks=64
    )  # same config
    refused(tuned, snap, "another model")
    r.b.import_request(snap)  # the same model takes it
    # the digest is the checkpoint's: the same from a directory and in memory (a tied LM head
    # too), and for the same values in another storage dtype
    for m in (model, tiny_model("qwen2", 0)):
        m.save_pretrained(tmp_path / m.config.model_type, safe_serialization=True)
        assert model_digest(*open_model(str(tmp_path / m.config.model_type))[:2]) == model_digest(
            *open_model(m)[:2]
        )
    cfg, w, _ = open_model(model)
    half = {k: v.to(torch.bfloat16) for k, v in w.state.items()}
    assert (
        model_digest(cfg, StateDictSource(half))
        == model_digest(cfg, StateDictSource({k: v.float() for k, v in half.items()}))
        != model_digest(cfg, w)
    )


def test_imported_kv_stay_out_of_the_prefix_cache_by_default(model):
    r = Run(model)
    p = prompts()[3]
    rid = r.a.add_request(p, GREEDY)
    for _ in range(6):
        r.step(r.a)
    snap = r.a.export_request(rid)
    assert snap.end >= 2 * 8  # full blocks of the receiver's size
    forged = r_(snap, k=snap.k * -3, v=snap.v * -3)  # well-formed, wrong
    r.b.import_request(forged)
    r.b.abort_request(rid)
    out = r.b.generate(p, GREEDY, use_tqdm=False)[0]
    assert out.token_ids == unmoved_tokens(model, GREEDY)[3] and out.num_cached_tokens == 0
    # nor does what is computed on top of honest imported K/V enter it
    c = Run(model)
    rid = c.a.add_request(p, GREEDY)
    for _ in range(6):
        c.step(c.a)
    c.b.import_request(c.a.export_request(rid))
    c.a.abort_request(rid)
    c.finish()
    assert c.outs[rid].token_ids == unmoved_tokens(model, GREEDY)[3]
    assert c.b.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_reclaim_frees_held_blocks_and_loses_nothing(model):
    r = Run(model)
    paused, staged = (r.a.add_request(prompts()[i], GREEDY) for i in (1, 3))
    for _ in range(5):
        r.step(r.a)
    r.a.export_request(paused)  # stopped here, blocks held
    pre = r.a.export_request(staged, stop=False)
    r.b.import_request(pre)  # staged there, blocks held
    free = r.a.core.blocks.num_free
    assert (
        r.a.core.migration.reclaim()
        and r.a.core.blocks.num_free > free
        and not r.a.sequences(paused)[0].block_table
    )
    assert not r.a.core.migration.reclaim()  # nothing else held here
    r.a.resume_request(paused)  # recomputed from its tokens
    assert r.b.core.migration.reclaim() and r.b.core.blocks.num_free == r.b.core.blocks.num_blocks
    assert not r.b.core.migration.reclaim()
    r.b.core.blocks.check()
    r.step(r.a)
    nxt = r.a.export_request(staged, since=pre, stop=False)
    r.b.import_request(nxt)  # its tokens count, its K/V are dropped
    assert r.b.core.blocks.num_free == r.b.core.blocks.num_blocks
    with pytest.raises(ValueError, match="in order"):
        r.b.import_request(nxt)
    r.step(r.a)
    r.b.import_request(r.a.export_request(staged, since=nxt))  # runs, recomputed from scratch
    r.a.abort_request(staged)
    r.finish()
    assert [r.outs[rid].token_ids for rid in (paused, staged)] == [
        unmoved_tokens(model, GREEDY)[i] for i in (1, 3)
    ]
    for e in (r.a, r.b):
        assert e.core.blocks.num_free == e.core.blocks.num_blocks
        e.core.blocks.check()
