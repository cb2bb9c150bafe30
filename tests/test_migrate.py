"""Moving running requests between engines: after a migration (full, incremental over several
rounds, through a file, across two processes), greedy and seeded-sampling outputs equal the
unmigrated run; mid-prefill and preempted requests move too; imported blocks serve prefix
hits; wrong snapshots are refused and the source keeps the request; random sequences of
steps, exports, imports and aborts never lose or duplicate a request."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("transformers")

from ringkv.engine import LLM, KVSnapshot, SamplingParams  # noqa: E402
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


def reference(model, params):
    key = (id(model), repr(params))
    if key not in _refs:
        _refs[key] = [o.token_ids for o in LLM(model, block_size=4, num_blocks=128).generate(
            prompts(), params, use_tqdm=False)]
    return _refs[key]


class Run:
    """Two engines and the outputs of every step of either."""

    def __init__(self, model, src_kw=None, dst_kw=None):
        self.a = LLM(model, **(src_kw or dict(block_size=4, num_blocks=128, max_num_batched_tokens=16)))
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
    mid_prefill = [rid for rid in rids if r.a._active[rid][0].num_computed < len(r.a._active[rid][0].prompt_token_ids)]
    assert mid_prefill  # chunked prefill is under way for some of them
    moved = 0
    for rid in rids:
        if rid not in r.a._active:
            continue  # it finished here meanwhile
        if mode == "incremental":  # pre-copy while it runs, two more rounds, then stop
            snap = r.a.export_request(rid, stop=False)
            r.b.import_request(snap)
            for _ in range(2):
                r.step(r.a)
                if rid not in r.a._active:
                    break
                nxt = r.a.export_request(rid, since=snap, stop=False)
                r.b.import_request(nxt)
                snap = nxt
            if rid not in r.a._active:  # finished on the source: the staged copy goes
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
    assert [r.outs[rid].token_ids for rid in rids] == reference(model, params)
    assert r.a.blocks.num_free == r.a.blocks.num_blocks and r.b.blocks.num_free == r.b.blocks.num_blocks


def test_a_preempted_request_moves_and_imported_blocks_serve_hits(model):
    r = Run(model, dict(block_size=4, num_blocks=24, max_num_batched_tokens=32))  # 96 tokens: preemption
    rids = [r.a.add_request(p, GREEDY) for p in prompts()]
    while not r.a.scheduler.num_preemptions:
        r.step(r.a)
    victim = next(s for s in r.a.scheduler.waiting if s.num_preemptions)
    snap = r.a.export_request(victim.request_id)
    assert snap.end == 0 and snap.k.shape[1] == 0  # its K/V were dropped: the receiver recomputes
    r.b.import_request(snap)
    r.a.abort_request(victim.request_id)
    r.finish()
    assert [r.outs[rid].token_ids for rid in rids] == reference(model, GREEDY)
    # a request moved after its prefill leaves its full blocks in the receiver's prefix cache
    c = Run(model)
    rid = c.a.add_request(prompts()[3], GREEDY)
    for _ in range(6):
        c.step(c.a)
    c.b.import_request(c.a.export_request(rid))
    hits = c.b.prefix_cache_hits
    again = c.b.generate(prompts()[3], GREEDY, use_tqdm=False)[0]
    assert c.b.prefix_cache_hits - hits == (len(prompts()[3]) - 1) // 8 and again.num_cached_tokens > 0


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
    assert rid not in r.b._staged and r.b.blocks.num_free == r.b.blocks.num_blocks  # nothing changed
    r.finish()  # nothing lost: the source still finishes it
    assert r.outs[rid].token_ids == reference(model, GREEDY)[2]


def test_migration_across_two_processes(worlds):
    params = dict(temperature=0.8, max_tokens=12, seed=9)
    want = LLM(tiny_model("llama", 0, num_hidden_layers=3), block_size=4, num_blocks=128).generate(
        prompts(), SamplingParams(**params), use_tqdm=False)
    res = worlds(2).check("tests.engine_cases:migrate_pair", 2, ("tiny", "llama", 0, dict(num_hidden_layers=3)),
                          prompts(), params)
    assert res[1] == [o.token_ids for o in want] and res[0] == "sent"


class Migrations(RuleBasedStateMachine):
    """Two engines; requests added to either, stepped, moved (in full or pre-copied), aborted.
    Every request lives in exactly one place, and the ones that finish equal the unmoved run."""

    def __init__(self):
        super().__init__()
        self.run = None

    @initialize()
    def setup(self):
        self.run = Run(MODEL, dict(block_size=4, num_blocks=48, max_num_batched_tokens=24),
                       dict(block_size=8, num_blocks=32, max_num_batched_tokens=24))
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
        return [rid for rid, e in self.where.items() if rid in self.engines[e]._active]

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
            snap = s.export_request(rid, stop=False)
            try:
                d.import_request(snap)
            except ValueError:  # no room there: it stays here
                return
            self.pre[rid] = snap
            return
        base = self.pre.pop(rid, None)
        snap = s.export_request(rid, since=base)
        try:
            d.import_request(snap)
        except ValueError:
            s.resume_request(rid)  # nothing lost
            if base is not None:
                d.abort_request(rid)
            return
        s.abort_request(rid)
        self.where[rid] = dst

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
            homes = [n for n, eng in self.engines.items() if rid in eng._active or rid in eng._paused]
            assert homes in ([], [e]), (rid, homes)

    def teardown(self):
        if self.run is None:
            return
        for rid in list(self.pre):  # pre-copies never completed: drop them
            other = self.engines["b" if self.where[rid] == "a" else "a"]
            other.abort_request(rid)
        self.run.finish()
        ref = reference(MODEL, GREEDY)
        for rid, i in self.prompt_of.items():
            if rid not in self.aborted:
                assert self.run.outs[rid].token_ids == ref[i], rid
        for eng in self.engines.values():
            assert eng.blocks.num_free == eng.blocks.num_blocks and not eng._staged


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
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(root, "examples", "disaggregated.py"), "--model", str(tmp_path), "--requests", "6",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
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
        if rid in r.a._active:
            snap = KVSnapshot.from_bytes(r.a.export_request(rid).to_bytes())
            assert snap.k.dtype == torch.int8 and snap.k_scale is not None
            r.b.import_request(snap)
            r.a.abort_request(rid)
    r.finish()
    assert [r.outs[rid].token_ids for rid in rids] == want
