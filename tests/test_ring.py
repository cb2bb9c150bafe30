"""Ring attention on a real gloo world against single-device attention."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from ringkv.kernels import attention
from tests.dist import RankError, World

TOL = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (4e-2, 4e-2), torch.float16: (5e-3, 5e-3)}


@st.composite
def ring_case(draw):
    n = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(ringkv.LAYOUTS))
    per = 2 if layout == "zigzag" else 1
    s_local = per * draw(st.integers(1, 12 // per))
    hkv = draw(st.sampled_from([1, 2, 3]))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    return dict(
        n=n,
        layout=layout,
        causal=draw(st.booleans()),
        b=draw(st.integers(1, 2)),
        s=s_local * n,
        h=h,
        hkv=hkv,
        d=draw(st.sampled_from([16, 32, 64, 80])),
        dtype=draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16, torch.float16])),
        scale=draw(st.sampled_from([None, 0.05, 0.5])),
        lse_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(case):
    """q, k, v ``(B, S, H|Hkv, D)`` in the case's dtype, dout and (with ``lse_grad``) dlse in
    fp32."""
    g = torch.Generator().manual_seed(case["seed"])
    b, s, h, hkv, d, dt = case["b"], case["s"], case["h"], case["hkv"], case["d"], case["dtype"]
    q = torch.randn(b, s, h, d, generator=g).to(dt)
    k, v = (torch.randn(b, s, hkv, d, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(b, s, h, d, generator=g)
    dlse = torch.randn(b, h, s, generator=g) if case["lse_grad"] else None
    return q, k, v, dout, dlse


def _reference(q, k, v, dout, dlse, causal, scale, window=(-1, -1)):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, causal=causal, scale=scale, window=window, backend="reference")
    loss = (out.float() * dout).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * dlse).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _assert_close(name, got, want, dtype, rank):
    atol, rtol = TOL[dtype]
    finite = want[torch.isfinite(want)].float()
    atol *= max(
        1.0, finite.abs().max().item() if finite.numel() else 1.0
    )  # errors scale with magnitude
    torch.testing.assert_close(
        got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name} on rank {rank}: {m}"
    )


@settings(
    max_examples=45,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=ring_case())
def test_ring_matches_single_device(world, case):
    q, k, v, dout, dlse = _inputs(case)
    dt = case["dtype"]
    want = _reference(q, k, v, dout, dlse, case["causal"], case["scale"])
    results = world.check(
        "tests.ring_cases:forward_backward",
        case["n"],
        q,
        k,
        v,
        dout,
        dlse,
        case["causal"],
        case["layout"],
        case["scale"],
        "auto",
    )
    dims = [1, 2, 1, 1, 1]  # out, lse, dq, dk, dv: the sequence dim
    for rank, res in enumerate(results):
        for name, got, full, dim in zip(["out", "lse", "dq", "dk", "dv"], res[:5], want, dims):
            ref = ringkv.shard(full, dim, case["layout"], rank=rank, world=case["n"])
            _assert_close(name, got, ref, dt, rank)


@pytest.mark.parametrize("layout", ringkv.LAYOUTS)
def test_deterministic(world, layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 4, 16, generator=g) for _ in range(3))
    assert all(world.check("tests.ring_cases:twice_bitwise", 3, q, k, v, True, layout))


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_causal_work_balance(world, layout):
    n, s = 4, 64
    q = torch.randn(1, s, 2, 16)
    res = world.check(
        "tests.ring_cases:forward_backward",
        n,
        q,
        q,
        q,
        torch.ones(q.shape),
        None,
        True,
        layout,
        None,
        "auto",
    )
    pairs = [r[5][0] for r in res]
    calls = [r[5][1] for r in res]
    assert sum(pairs) == s * (s + 1) // 2  # every visible pair computed exactly once
    chunk = s // n // (2 if layout == "zigzag" else 1)
    if (
        layout == "contiguous"
    ):  # the unbalanced baseline: the last rank does 2N-1 times the first's work
        assert pairs[-1] > 3 * pairs[0] and calls == [1, 2, 3, 4]
    else:
        assert max(pairs) - min(pairs) <= chunk * chunk, pairs
        assert max(calls) - min(calls) <= 1, calls


def test_group_of_one_is_plain_attention(world):
    q, k, v = torch.randn(2, 10, 4, 16), torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    (res,) = world.check(
        "tests.ring_cases:forward_backward",
        1,
        q,
        k,
        v,
        torch.ones(q.shape),
        None,
        True,
        "contiguous",
        None,
        "auto",
    )
    torch.testing.assert_close(res[0], attention(q, k, v, causal=True)[0])


def test_module_wraps_function():
    q = torch.randn(1, 8, 2, 16)
    mod = ringkv.RingAttention(causal=True, layout="zigzag")
    torch.testing.assert_close(mod(q, q, q), attention(q, q, q, causal=True)[0])
    assert "zigzag" in repr(mod)
    assert torch.equal(
        ringkv.RingAttention()(q, q, q), ringkv.ring_attention(q, q, q)
    )  # one set of defaults
    assert torch.equal(
        ringkv.RingAttention(causal=True, check=False, timeout=None)(q, q, q), mod(q, q, q)
    )


# ---- bad input: a clear error on every rank, never a hang -------------------------------------


def _errors(results):
    return [r for r in results if isinstance(r, RankError)]


def test_local_bad_input_raises_on_every_rank(world):
    for kw, match in [
        (dict(q=(1, 8, 3, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16)), "multiple of kv heads"),
        (
            dict(q=(1, 7, 2, 16), k=(1, 7, 2, 16), v=(1, 7, 2, 16), layout="zigzag"),
            "pad the global sequence",
        ),
        (dict(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16), layout="ring"), "unknown layout"),
        (dict(q=(1, 8, 2, 16), k=(1, 6, 2, 16), v=(1, 6, 2, 16)), "same local length"),
        (dict(q=(8, 2, 16), k=(8, 2, 16), v=(8, 2, 16)), "must be 4-D"),
    ]:
        res = world.run("tests.ring_cases:call", 3, kw)
        errs = _errors(res)
        assert len(errs) == 3, res
        assert all(e.type in ("ValueError", "TypeError") and match in e.message for e in errs), errs


@pytest.mark.parametrize(
    "field,rank1,match",
    [
        ("q", (1, 8, 4, 16), "heads"),
        ("dtype", torch.bfloat16, "dtype"),
        ("layout", "striped", "layout"),
        ("causal", True, "causal"),
    ],
)
def test_ranks_that_disagree_all_raise(world, field, rank1, match):
    """Arguments that differ across ranks: every rank raises ValueError naming the difference."""
    base = dict(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16), layout="zigzag", causal=False)
    other = dict(base, **{field: rank1})
    if field == "q":
        other.update(k=(1, 8, 2, 16), v=(1, 8, 2, 16))
    # as if an earlier case had run rank 1's arguments on every rank (a hypothesis draw can):
    # the ranks that disagree must still all raise ValueError, not time out
    world.check("tests.ring_cases:call", 3, other)
    res = world.run("tests.ring_cases:call", 3, [base, other, base], timeout=60)
    errs = _errors(res)
    assert len(errs) == 3 and all(e.type == "ValueError" and match in e.message for e in errs), res


def test_rank_that_never_calls_gives_timeout_not_hang(fork_context):
    w = World(3, context=fork_context)
    try:
        t0 = time.time()
        res = w.run(
            "tests.ring_cases:call",
            3,
            [dict(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16))] * 2 + [dict(skip=True)],
            2.0,
            timeout=60,
        )
        elapsed = time.time() - t0
    finally:
        w.close()
    assert res[2] == "skipped"
    assert all(isinstance(r, RankError) and r.type == "RingTimeoutError" for r in res[:2]), res
    assert elapsed < 30


def test_rank_dying_mid_ring_others_raise_within_timeout(fork_context):
    """Rank 1 exits in the middle of a ring; each survivor raises (now or at its next call)."""
    w = World(3, context=fork_context)
    try:
        t0 = time.time()
        for r in range(3):
            w.tasks[r].put(("tests.ring_cases:die_mid_ring", 3, (1, 10.0)))
        got = {}
        while len(got) < 2:
            rank, result = w.results.get(timeout=90)
            got[rank] = result
        elapsed = time.time() - t0
    finally:
        w.close()
    assert set(got) == {0, 2}
    assert all(isinstance(r, RankError) and r.type == "RingTimeoutError" for r in got.values()), got
    assert elapsed < 45
