"""Ulysses, USP (Ulysses x ring) and all-gather-KV attention on a real gloo world against
single-device attention (the reference and tolerances of tests/test_ring.py)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, settings, strategies as st

import ringkv
from ringkv.sp.ulysses import head_split
from tests.dist import RankError, World
from tests.test_ring import _assert_close, _inputs, _reference

SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@st.composite
def heads(draw, n):
    """Query / KV heads for a head split over ``n`` ranks: any ``H >= n`` whose KV heads divide it,
    so splits that are uneven (``n`` does not divide ``H``), with fewer KV heads than ranks and
    with KV heads that neither divide ``n`` nor are divided by it."""
    hkv = draw(st.integers(1, 3))
    least = -(-n // hkv)  # the smallest group that gives every rank a head
    g = draw(st.integers(least, least + 2))
    return hkv * g, hkv


@st.composite
def case(draw, method):
    if method == "usp":
        u, r = draw(st.sampled_from([(2, 2), (2, 2), (1, 4), (4, 1)]))
        n, split, dims = u * r, u, (u, r)
    else:
        n = draw(st.integers(1, 4))
        split, dims = (n if method == "ulysses" else 1), None
    layout = draw(st.sampled_from(ringkv.LAYOUTS))
    ring_n = dims[1] if dims else n
    unit = (
        2 if layout == "zigzag" and (dims is None or dims[0] % 2) else 1
    )  # local length granularity
    h, hkv = draw(heads(split))
    s = unit * draw(st.integers(1, 8 // unit)) * n
    w = st.integers(0, s)  # windows narrower and wider than a shard
    window = draw(
        st.one_of(
            st.just((-1, -1)), st.tuples(w, st.just(-1)), st.tuples(w, w), st.tuples(st.just(-1), w)
        )
    )
    return dict(
        n=n,
        dims=dims,
        layout=layout,
        causal=draw(st.booleans()),
        b=draw(st.integers(1, 2)),
        s=s,
        window=window,
        h=h,
        hkv=hkv,
        d=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16])),
        scale=draw(st.sampled_from([None, 0.3])),
        lse_grad=draw(st.booleans()),
        chunks=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        ring_n=ring_n,
    )


def _fixed(n, layout, h, hkv, dtype, dims=None, chunks=2, s=None):
    """A case that always runs: causal, a gradient through lse, GQA."""
    return dict(
        n=n,
        dims=dims,
        layout=layout,
        causal=True,
        b=2,
        s=s or 4 * n,
        window=(-1, -1),
        h=h,
        hkv=hkv,
        d=16,
        dtype=dtype,
        scale=None,
        lse_grad=True,
        chunks=chunks,
        seed=1,
        ring_n=dims[1] if dims else n,
    )


def _run_case(world, method, c):
    split = c["dims"][0] if c["dims"] else (c["n"] if method == "ulysses" else 1)
    kv = "split" if c["hkv"] % split == 0 else "fewer than ranks" if c["hkv"] < split else "uneven"
    event(
        f"world {c['dims'] or c['n']}, heads {c['h']}/{c['hkv']} "
        f"{'even' if c['h'] % split == 0 else 'uneven'}, kv heads {kv}"
    )
    event(
        f"{c['dtype']}, causal={c['causal']}, lse grad={c['lse_grad']}, "
        f"window={c['window'] != (-1, -1)}"
    )
    q, k, v, dout, dlse = _inputs(c)
    s, dt = c["s"], c["dtype"]
    want = _reference(q, k, v, dout, dlse, c["causal"], c["scale"], window=c["window"])
    kw = dict(window=c["window"], **(dict(chunks=c["chunks"]) if method == "allgather" else {}))
    results = world.check(
        "tests.variant_cases:forward_backward",
        c["n"],
        method,
        q,
        k,
        v,
        dout,
        dlse,
        c["causal"],
        c["layout"],
        c["scale"],
        c["dims"],
        kw,
    )
    seen = []
    for rank, res in enumerate(results):
        pos = res[5]
        if c["dims"] is None:
            assert torch.equal(pos, ringkv.positions(s, c["layout"], rank, c["n"]))
        else:
            u, r = c["dims"]
            ring_rank, part = divmod(rank, u)  # the mesh puts Ulysses innermost
            ring_shard = ringkv.positions(s, c["layout"], ring_rank, r)
            assert torch.equal(pos, ring_shard[part * (s // (u * r)) : (part + 1) * (s // (u * r))])
        seen.append(pos)
        for name, got, full, dim in zip(
            ["out", "lse", "dq", "dk", "dv"], res[:5], want, [1, 2, 1, 1, 1]
        ):
            _assert_close(f"{method} {name}", got, full.index_select(dim, pos), dt, rank)
        _assert_close(f"{method} unsharded out", res[6], want[0], dt, rank)
    assert torch.equal(
        torch.cat(seen).sort().values, torch.arange(s)
    )  # every token on exactly one rank


@settings(max_examples=20, **SETTINGS)
@given(c=case("ulysses"))
@example(c=_fixed(4, "zigzag", 4, 2, torch.bfloat16))  # KV heads replicated
@example(c=_fixed(4, "striped", 8, 4, torch.float32))  # KV heads split
@example(c=_fixed(2, "zigzag", 9, 3, torch.float32))  # SmolLM2: 5 + 4 heads, KV head 1 on both
@example(c=_fixed(3, "contiguous", 8, 2, torch.float32))  # 3 + 3 + 2, KV groups straddled
@example(
    c=dict(_fixed(4, "zigzag", 4, 2, torch.float32), window=(3, 1), causal=False)
)  # global order needed
def test_ulysses_matches_single_device(world, c):
    _run_case(world, "ulysses", c)


@settings(max_examples=20, **SETTINGS)
@given(c=case("allgather"))
@example(c=_fixed(3, "zigzag", 4, 2, torch.bfloat16, chunks=3))
@example(c=_fixed(4, "contiguous", 6, 3, torch.float32, chunks=3, s=20))  # uneven chunks
@example(c=dict(_fixed(2, "zigzag", 2, 1, torch.float32), window=(1, 2), causal=False))
def test_allgather_matches_single_device(world, c):
    _run_case(world, "allgather", c)


@settings(max_examples=15, **SETTINGS)
@given(c=case("usp"))
@example(c=_fixed(4, "zigzag", 4, 1, torch.bfloat16, dims=(2, 2)))  # KV heads replicated
@example(c=_fixed(4, "striped", 4, 2, torch.float32, dims=(2, 2)))  # KV heads split
@example(c=_fixed(4, "zigzag", 9, 3, torch.float32, dims=(2, 2)))  # uneven heads, ring of 2
@example(c=dict(_fixed(4, "zigzag", 4, 2, torch.float32, dims=(2, 2)), window=(2, -1)))
def test_usp_matches_single_device(world, c):
    _run_case(world, "usp", c)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 8), hkv=st.integers(1, 6), g=st.integers(1, 6))
def test_head_split_gives_every_head_once_with_its_kv_head(n, hkv, g):
    """Every query head on exactly one rank (ceil or floor of H/N each), and on every rank the
    kernel's GQA rule (local head i uses local KV head i // group) finds the head's own KV head."""
    h = hkv * g
    assume(h >= n)
    split = head_split(h, hkv, n)
    runs = [split.q_heads(r) for r in range(n)]
    assert [x for run in runs for x in run] == list(range(h))
    assert {len(run) for run in runs} <= {h // n, -(-h // n)}
    for r, run in enumerate(runs):
        kv, group = split.kv_heads_of(r), split.group(r)
        local = split.local_kv(r) or list(range(len(kv)))
        assert len(local) * group == len(run) and set(local) == set(range(len(kv)))
        assert [kv.start + local[i // group] for i in range(len(run))] == [x // g for x in run]


@pytest.mark.parametrize("dims", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("layout", ringkv.LAYOUTS)
def test_2d_shard_unshard_round_trip(world, dims, layout):
    x = torch.arange(2 * 16 * 16, dtype=torch.float32).reshape(2, 16, 16)
    for dim in (1, 2):
        res = world.check("tests.variant_cases:shard_roundtrip", 4, dims, x, layout, dim)
        u, r = dims
        for rank, (part, back, pos) in enumerate(res):
            ring_rank, p = divmod(rank, u)
            want = ringkv.positions(16, layout, ring_rank, r)[
                p * 16 // (u * r) : (p + 1) * 16 // (u * r)
            ]
            assert torch.equal(pos, want)
            assert torch.equal(
                ringkv.positions(16, layout, rank, 4, ulysses=u), want
            )  # by rank number, no groups
            assert torch.equal(part, x.index_select(dim, want))
            assert torch.equal(back, x)


def test_bytes_sent_per_method(world):
    b, s, h, hkv, d, n = 1, 16, 8, 4, 8, 4
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    f32, sl = 4, s // n
    kv_local = 2 * b * sl * hkv * d * f32
    for got in world.check("tests.variant_cases:bytes_sent", n, q, k, v):
        assert got["ring"] == (n - 1) * kv_local
        assert got["allgather"] == (n - 1) * kv_local
        # q, K, V out and out back, each (N-1)/N of the local tensor
        assert (
            got["ulysses"]
            == (b * sl * (h + 2 * hkv) * d * f32 + b * sl * h * d * f32) * (n - 1) // n
        )
        # 2x2: all-to-alls over 2 Ulysses ranks, then a ring of 2 over S/2 tokens and H/2 heads, KV
        # heads 1
        a2a = (b * sl * (h + 2 * hkv) * d * f32 + b * sl * h * d * f32) // 2
        assert got["usp"] == a2a + 2 * b * (2 * sl) * (hkv // 2) * d * f32


# ---- bad input: a clear error on every rank, never a hang -------------------------------------


def _all_raise(results, n, match, types=("ValueError",)):
    errs = [r for r in results if isinstance(r, RankError)]
    assert len(errs) == n and all(e.type in types and match in e.message for e in errs), results


@pytest.mark.parametrize(
    "method,n,kw,match",
    [
        (
            "ulysses",
            4,
            dict(q=(1, 4, 3, 16), k=(1, 4, 1, 16), v=(1, 4, 1, 16)),
            "heads (3) must be >= 4; valid world sizes for heads=3: 1..3",
        ),
        (
            "usp",
            4,
            dict(q=(1, 4, 2, 16), k=(1, 4, 1, 16), v=(1, 4, 1, 16), dims=(4, 1)),
            "usp_attention over 4 ranks splits the 2 query heads",
        ),
        (
            "allgather",
            3,
            dict(q=(1, 4, 2, 16), k=(1, 4, 2, 16), v=(1, 4, 2, 16), chunks=0),
            "chunks",
        ),
        (
            "usp",
            4,
            dict(q=(1, 3, 2, 16), k=(1, 3, 2, 16), v=(1, 3, 2, 16), dims=(1, 4), layout="zigzag"),
            "pad the global sequence to a multiple of 8",
        ),
    ],
)
def test_bad_input_raises_on_every_rank(world, method, n, kw, match):
    _all_raise(world.run("tests.variant_cases:call", n, method, kw), n, match)


def test_sp_groups_needs_the_world_size(world):
    _all_raise(
        world.run("tests.variant_cases:call", 4, "groups", dict(ulysses=3, ring=1)),
        4,
        "needs ulysses * ring == the world size 4",
    )


@pytest.mark.parametrize(
    "method,n,rank1",
    [
        ("ulysses", 2, dict(q=(1, 4, 4, 16))),
        ("allgather", 3, dict(chunks=1)),
        ("usp", 4, dict(q=(1, 4, 4, 16))),  # rank 1: the other Ulysses group must raise as well
        ("usp", 4, dict(causal=True)),
    ],
)
def test_ranks_that_disagree_all_raise(world, method, n, rank1):
    base = dict(q=(1, 4, 2, 16), k=(1, 4, 2, 16), v=(1, 4, 2, 16), layout="zigzag")
    base.update(dict(dims=(2, 2)) if method == "usp" else {})
    per_rank = [dict(base, **(rank1 if r == 1 else {})) for r in range(n)]
    _all_raise(
        world.run("tests.variant_cases:call", n, method, per_rank, timeout=60), n, "disagree"
    )


def test_peer_that_never_calls_gives_timeout_not_hang(fork_context):
    """The all-to-all's wait is bounded: without the argument check, a silent peer still ends in
    RingTimeoutError (a world of its own: the unmatched collective breaks the group)."""
    w = World(2, context=fork_context)
    try:
        t0 = time.time()
        kw = dict(q=(1, 4, 2, 16), k=(1, 4, 2, 16), v=(1, 4, 2, 16), check=False)
        res = w.run(
            "tests.variant_cases:call", 2, "ulysses", [kw, dict(skip=True)], 2.0, timeout=60
        )
        elapsed = time.time() - t0
    finally:
        w.close()
    assert res[1] == "skipped"
    assert (
        isinstance(res[0], RankError)
        and res[0].type == "RingTimeoutError"
        and "ulysses_attention" in res[0].message
    ), res
    assert elapsed < 30
