"""Moving running requests between engines of different meshes (tp, pp, sp, replicated KV
heads, block sizes, int8 and fp8 caches, spawned and under torchrun): after a full or an
incremental migration greedy and seeded outputs equal the unmigrated run, incremental
snapshots carry only what is new, every block is freed, and several multi-rank engines live in
one process (a hypothesis state machine moves requests between two of them)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import precondition, rule

pytest.importorskip("transformers")

from ringkv.engine import LLM, RequestState, SamplingParams  # noqa: E402
from tests import test_migrate  # noqa: E402
from tests.models import tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=5)

MESHES = {  # name -> LLM settings (each a different mesh or block size)
    "1": dict(block_size=8),
    "tp2": dict(tp=2, block_size=4),
    "pp2": dict(pp=2, block_size=8),
    "sp2": dict(sp=2, block_size=4),
    "tp2pp2": dict(tp=2, pp=2, block_size=4),
    "pp2sp2": dict(pp=2, sp=2, block_size=2),
    "tp4-int8": dict(tp=4, block_size=4, kv_cache_dtype="int8"),  # tp > Hkv: each head on two ranks
    "1-int8": dict(block_size=16, kv_cache_dtype="int8"),
    "sp3-fp8": dict(
        sp=3, block_size=8, kv_cache_dtype="fp8_e4m3"
    ),  # sp=3: a step's token is on one rank of three
    "pp2-fp8": dict(pp=2, block_size=4, kv_cache_dtype="fp8_e4m3"),
}
PAIRS = [
    ("tp2", "pp2"),
    ("sp2", "1"),
    ("1", "tp2pp2"),
    ("pp2sp2", "tp2"),
    ("tp4-int8", "1-int8"),
    ("sp3-fp8", "pp2-fp8"),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def engines(model):
    """Every mesh's engine, built on first use and kept for the module (several spawned
    multi-rank engines in this one process)."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = LLM(
                model, num_blocks=160, max_num_batched_tokens=16, timeout=60, **MESHES[name]
            )
        return made[name]

    yield get
    for e in reversed(list(made.values())):  # closed in another order than built
        e.close()


def prompts():
    return test_migrate.prompts()


_refs = {}


def unmoved_tokens(model, kv_cache_dtype):
    """Unmigrated outputs of every (prompt, params) request, on one rank with the same cache format
    (a quantized cache rounds K/V: its outputs are its own)."""
    if kv_cache_dtype not in _refs:
        llm = LLM(
            model,
            block_size=4,
            num_blocks=160,
            max_num_batched_tokens=16,
            kv_cache_dtype=kv_cache_dtype,
        )
        _refs[kv_cache_dtype] = [
            o.token_ids
            for o in llm.generate(
                [p for p in prompts() for _ in range(2)],
                [GREEDY, SEEDED] * len(prompts()),
                use_tqdm=False,
            )
        ]
    return _refs[kv_cache_dtype]


def _steps(e, outs):
    for o in e.step():
        outs[o.request_id] = o


def _finish(e, outs):
    while e.has_unfinished_requests():
        _steps(e, outs)


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_requests_move_between_meshes_and_finish_as_if_never_moved(engines, model, src, dst):
    a, b = engines(src), engines(dst)
    reqs = [(p, params) for p in prompts() for params in (GREEDY, SEEDED)]
    rids = [
        a.add_request(p, params, request_id=f"{src}>{dst}:{i}")
        for i, (p, params) in enumerate(reqs)
    ]
    outs = {}
    for _ in range(4):
        _steps(a, outs)
    moved = 0
    for i, rid in enumerate(rids):
        if a.request_state(rid) is not RequestState.ACTIVE:
            continue  # finished here already
        if i % 2:  # incremental: pre-copy while it runs, one more step, then only what is new
            first = a.export_request(rid, stop=False)
            b.import_request(first)
            _steps(a, outs)
            if a.request_state(rid) is not RequestState.ACTIVE:
                assert b.abort_request(rid)
                continue
            last = a.export_request(rid, since=first)
            assert (
                last.start == first.end and last.k.shape[1] == last.end - last.start
            )  # only what is new
            if first.end >= len(
                reqs[i][0]
            ):  # decoding: a step or two's tokens (pp=2 has two in flight)
                assert last.end - last.start <= 3 and len(last.token_ids) <= 3
            b.import_request(last)
        else:
            b.import_request(a.export_request(rid))
        assert a.abort_request(rid)
        moved += 1
    assert moved >= 4
    _finish(a, outs)
    _finish(b, outs)
    assert [outs[rid].token_ids for rid in rids] == unmoved_tokens(
        model, MESHES[src].get("kv_cache_dtype", "auto")
    )
    for e in (a, b):
        assert (
            e.core.blocks.num_free == e.core.blocks.num_blocks
            and not e.request_ids(RequestState.STAGED)
            and not e.request_ids(RequestState.PAUSED)
        )


@given(
    sp=st.integers(1, 4),
    block_size=st.integers(1, 5),
    start=st.integers(0, 40),
    n=st.integers(0, 9),
    quant=st.sampled_from([None, "int8", "fp8_e4m3"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_every_sp_rank_reads_back_exactly_its_tokens(sp, block_size, start, n, quant, seed):
    """``kvmove.read``/``write`` of any token range on every SP rank (some store none of a short
    range), through a shuffled block table: the ranks' boxes together are the range, each
    token once, on the rank ``t % sp``."""
    from ringkv.cache.kv_cache import KVCache
    from ringkv.kernels.quant import resolve
    from ringkv.parallel import kvmove

    g = torch.Generator().manual_seed(seed)
    end, lb = start + n, block_size * sp
    nblocks = -(-end // lb) + 1
    table = torch.randperm(nblocks, generator=g).tolist()
    first = start // lb
    part = table[first : max(first, -(-end // lb))]
    got = torch.full((n,), -1.0)
    for r in range(sp):
        kv = KVCache(
            2,
            1,
            4,
            block_size=block_size,
            num_blocks=nblocks,
            quant=resolve(quant) if quant else None,
        )
        mine = list(range(start + (r - start) % sp, end, sp))
        pos = torch.tensor(mine, dtype=torch.float32)  # a token's position, exact in its storage
        data = (
            (pos % 8 if quant else pos)[None, None, :, None, None]
            .expand(2, 2, len(mine), 1, 4)
            .to(kv.data.dtype)
        )
        scale = (
            None
            if kv.scale is None
            else pos[None, None, :, None].expand(2, 2, len(mine), 1).to(kv.scale.dtype)
        )
        kvmove.write(kv, part, first, start, end, data, scale, sp, r)
        back, back_scale = kvmove.read(kv, part, first, start, end, sp, r)
        assert back.shape == (2, 2, len(mine), 1, 4) and torch.equal(back, data)
        assert (back_scale is None) == (kv.scale is None) and (
            scale is None or torch.equal(back_scale, scale)
        )
        for i, p in enumerate(mine):
            assert p % sp == r and got[p - start] == -1
            got[p - start] = (
                (back if scale is None else back_scale)[0, 0, i, 0].float().flatten()[0]
            )
    assert torch.equal(got, torch.arange(start, end, dtype=torch.float32))


def test_an_export_completes_the_steps_in_flight_first(engines, model):
    """pp=2 keeps a step in flight after ``step()``: an export completes it first. A request that
    step finishes is not exported (nothing to move) and is reported by the next ``step()``; one
    it does not finish is exported with that step's token."""
    e = engines("pp2")
    p = SamplingParams(temperature=0, max_tokens=3)
    rids = [
        e.add_request(t, p, request_id=f"inflight{i}")
        for i, t in enumerate(([5, 6, 7, 8], [9, 10, 11]))
    ]
    outs = {}
    while True:
        _steps(e, outs)
        flying = {s.seq.request_id for batch in e.core.pipeline.inflight for s in batch}
        last = [r for r in rids if r in flying and len(e.sequences(r)[0].output_token_ids) == 2]
        if last:
            break
    with pytest.raises(ValueError, match="is finished; nothing to export"):
        e.export_request(last[0])
    other = next(r for r in rids if r != last[0])
    snap = e.export_request(other)
    assert len(snap.token_ids) == len(e.sequences(other)[0].token_ids)
    e.resume_request(other)
    _finish(e, outs)
    want = LLM(model, block_size=4, num_blocks=64).generate(
        [[5, 6, 7, 8], [9, 10, 11]], p, use_tqdm=False
    )
    assert [outs[r].token_ids for r in rids] == [o.token_ids for o in want]
    assert e.core.blocks.num_free == e.core.blocks.num_blocks


def test_a_snapshot_holds_the_same_kv_whatever_the_mesh(engines, model):
    """Every mesh exports K/V equal (to float rounding of its own summation order) to the
    single-rank engine's, in the same token-major layout."""
    p = prompts()[3]
    snaps = {}
    for name in ("1", "tp2", "pp2", "sp2", "pp2sp2"):
        e = engines(name)
        rid = e.add_request(p, GREEDY, request_id=f"same-{name}")
        while e.sequences(rid)[0].num_computed < len(p):
            e.step()
        snaps[name] = e.export_request(rid)
        assert e.abort_request(rid)
    one = snaps["1"]
    for name, s in snaps.items():
        assert s.k.shape == one.k.shape == (3, len(p), 2, 16), name
        assert torch.allclose(s.k, one.k, atol=1e-5) and torch.allclose(s.v, one.v, atol=1e-5), name


def test_migration_under_torchrun_both_ways(worlds, model):
    """A torchrun tp=2 engine exports to a one-rank engine on rank 0 and imports from it; rank 1
    follows the calls (ranks > 0 get None)."""
    params = dict(temperature=0.8, max_tokens=12, seed=9)
    want = [
        o.token_ids
        for o in LLM(model, block_size=4, num_blocks=128).generate(
            prompts(), SamplingParams(**params), use_tqdm=False
        )
    ]
    res = worlds(2).check(
        "tests.engine_cases:migrate_mesh_torchrun",
        2,
        ("tiny", "llama", 0, dict(num_hidden_layers=3)),
        prompts(),
        params,
    )
    assert res[0] == want and res[1] == "followed"


class MeshMigrations(test_migrate.Migrations):
    """``test_migrate.Migrations`` between a tp=2 engine and a pp=2 x sp=2 one (block sizes 4
    and 2), the same two engines for every example."""

    ENGINES = None
    moved = 0  # requests moved over all examples

    @precondition(lambda self: self.run is not None)
    @rule(k=st.integers(0, 50), pre=st.booleans())
    def move(self, k, pre):  # the base rule, counted
        before = dict(self.where)
        super().move(k, pre)
        MeshMigrations.moved += sum(self.where[r] != e for r, e in before.items())

    def make_run(self):
        r = test_migrate.Run.__new__(test_migrate.Run)
        r.a, r.b = self.ENGINES
        r.outs = {}
        return r


@pytest.fixture
def _mesh_machine(engines, model):
    MeshMigrations.ENGINES = (engines("tp2"), engines("pp2sp2"))
    test_migrate.MODEL = model
    yield
    MeshMigrations.ENGINES = None


def test_moves_between_two_multi_rank_engines_lose_nothing(_mesh_machine):
    from hypothesis.stateful import run_state_machine_as_test

    # a fixed walk first, so every run moves requests (in full and pre-copied, both ways) whatever
    # hypothesis draws below: ten drawn examples have moved nothing at all (seen once)
    MeshMigrations.moved = 0
    walk = MeshMigrations()
    walk.setup()
    for i, e in ((0, "a"), (1, "b"), (2, "a")):
        walk.add(i, e)
    for name, *args in (
        ("step", "a"),
        ("step", "b"),
        ("move", 0, True),
        ("move", 0, False),
        ("step", "a"),
        ("step", "b"),
        ("move", 1, False),
        ("step", "b"),
        ("move", 2, False),
    ):
        getattr(walk, name)(*args)
        walk.each_request_lives_once()
    walk.teardown()
    assert MeshMigrations.moved >= 3, MeshMigrations.moved

    run_state_machine_as_test(
        MeshMigrations, settings=settings(max_examples=10, stateful_step_count=20, deadline=None)
    )
