"""Sliding windows and packed sequences (cu_seqlens): kernels, ring and layout against
single-device reference attention (per document for packed sequences), on real gloo worlds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from ringkv.kernels import BACKENDS, attention, make_mask, reference, run_differentiable
from ringkv.kernels.flash_attn import _tiles
from ringkv.kernels.mask import BAND, DENSE, EMPTY, FULL, Mask
from ringkv.sp.layout import varlen_chunks, varlen_index, varlen_local_len
from tests.dist import RankError
from tests.checks import assert_close
from tests.test_kernels import (
    assert_lse,
    explicit_positions,
    position_pair,
    tolerances,
)
from tests.test_ring import _assert_close, _inputs, _reference, ring_case

WORLD_SETTINGS = dict(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def window_matrix(q_pos, k_pos, sq, sk, causal, window):
    """The visible (Sq, Sk) pairs spelled out from position vectors (no make_mask)."""
    qp, kp = explicit_positions(q_pos, k_pos, sq, sk)
    qp, kp = qp[:, None], kp[None, :]
    left, right = window
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= kp <= qp
    if right >= 0:
        visible &= kp <= qp + right
    if left >= 0:
        visible &= kp >= qp - left
    return visible


windows = st.tuples(st.sampled_from([-1, 0, 1, 2, 5, 40]), st.sampled_from([-1, 0, 1, 3, 40]))


# ---------------------------------------------------------------------------- kernels


@st.composite
def window_problem(draw):
    sq, sk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    hkv = draw(st.integers(1, 2))
    q_pos, k_pos = draw(position_pair(sq, sk))
    return dict(
        b=draw(st.integers(1, 2)),
        sq=sq,
        sk=sk,
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 3])),
        d=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        causal=draw(st.booleans()),
        window=draw(windows),
        q_pos=q_pos,
        k_pos=k_pos,
        lse_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=25)
@given(p=window_problem())
def test_attention_window_matches_dense_reference_on_every_backend(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g).to(p["dtype"])
    k, v = (
        torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g).to(p["dtype"]) for _ in range(2)
    )
    dout = torch.randn(q.shape, generator=g).to(p["dtype"])
    dlse = torch.randn(p["b"], p["h"], p["sq"], generator=g) if p["lse_grad"] else None
    dense = window_matrix(p["q_pos"], p["k_pos"], p["sq"], p["sk"], p["causal"], p["window"])
    tol, lse_tol, grad_tol = tolerances(p["dtype"])

    def run(fn):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*x)
        torch.autograd.backward(
            [out, lse] if dlse is not None else [out], [dout, dlse] if dlse is not None else [dout]
        )
        return out.detach(), lse.detach(), *(t.grad for t in x)

    oracle = Mask(DENSE, dense=dense)  # the reference kernel on the explicit matrix
    want = run(
        lambda *x: run_differentiable(
            lambda q, k, v: reference.forward(q, k, v, p["d"] ** -0.5, oracle),
            lambda dout, dlse, q, k, v, out, lse: reference.backward(
                dout, q, k, v, out, lse, p["d"] ** -0.5, oracle, dlse
            ),
            *x,
            (),
        )
    )
    mask = make_mask(p["causal"], p["q_pos"], p["k_pos"], p["sq"], p["sk"], window=p["window"])
    names = [n for n, m in BACKENDS.items() if m.supports(q, mask)]
    assert "reference" in names and "sdpa" in names, names
    for name in names:
        got = run(
            lambda *x: attention(
                *x,
                causal=p["causal"],
                q_positions=p["q_pos"],
                k_positions=p["k_pos"],
                window=p["window"],
                backend=name,
            )
        )
        assert_close(f"{name} out", got[0], want[0].double(), tol)
        assert_lse(f"{name} lse", got[1], want[1], lse_tol)
        for gname, a, b in zip(("dq", "dk", "dv"), got[2:], want[2:]):
            assert_close(f"{name} {gname}", a, b.double(), grad_tol)
    # the functional backward agrees with autograd
    dq, dk, dv = ringkv.attention_backward(
        dout,
        q,
        k,
        v,
        want[0],
        want[1],
        causal=p["causal"],
        q_positions=p["q_pos"],
        k_positions=p["k_pos"],
        window=p["window"],
        dlse=dlse,
        backend="reference",
    )
    for gname, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want[2:]):
        assert_close(f"attention_backward {gname}", a, b.double(), grad_tol)


@settings(max_examples=60)
@given(st.integers(0, 12), st.integers(0, 12), st.booleans(), windows, st.data())
def test_make_mask_window_matches_explicit_matrix(sq, sk, causal, window, data):
    q_pos, k_pos = data.draw(position_pair(sq, sk))
    mask = make_mask(causal, q_pos, k_pos, sq, sk, window=window)
    want = window_matrix(q_pos, k_pos, sq, sk, causal, window)
    assert torch.equal(mask.visible(sq, sk), want), mask
    assert mask.pairs(sq, sk) == int(want.sum())
    if want.numel() == 0 or not want.any():
        assert mask.kind == EMPTY  # blocks outside the window are skipped by arithmetic
    elif want.all():
        assert mask.kind == FULL
    if all(isinstance(x, range) or x is None for x in (q_pos, k_pos)) and (
        q_pos is None or k_pos is None or q_pos.step == k_pos.step
    ):
        assert mask.kind != DENSE, "equal-step ranges must not need a dense mask"
    for q0, q1, k0, k1 in [(0, sq // 2, 0, sk), (sq // 3, sq, sk // 2, sk)]:
        assert torch.equal(mask.block(q0, q1, k0, k1).visible(q1 - q0, k1 - k0), want[q0:q1, k0:k1])


@settings(max_examples=40)
@given(st.integers(1, 16), st.integers(1, 16), st.integers(-20, 20), st.integers(0, 20))
def test_flash_attn_window_calls_cover_the_band(sq, sk, lo, width):
    """flash_attn runs a band as one call with window_size (flash-attn's bottom-right convention,
    -1 unbounded): emulated here, the call must cover the band exactly and no row is fully
    masked."""
    mask = Mask(BAND, offset=lo + width, lo=lo)  # any band, also ones make_mask would simplify
    want = mask.visible(sq, sk)
    got = torch.zeros(sq, sk, dtype=torch.long)
    if want.any():
        ((rows, keys, causal, (left, right)),) = _tiles(mask, sq, sk)
        n, m = rows.stop - rows.start, keys.stop - keys.start
        i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
        seen = (j <= i + (m - n) + right if right >= 0 else j >= 0) & (
            j >= i + (m - n) - left if left >= 0 else j >= 0
        )
        assert not causal and left >= 0 and right >= 0 and seen.any(1).all()
        got[rows, keys] += seen
    assert torch.equal(got == 1, want)


@pytest.mark.parametrize(
    "window,err",
    [
        ((-2, 0), ValueError),
        ((1,), TypeError),
        ((1.0, 2), TypeError),
        ((True, 1), TypeError),
        ("left", TypeError),
    ],
)
def test_bad_window_is_a_clear_error(window, err):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(err, match="window"):
        attention(q, q, q, window=window)


# ---------------------------------------------------------------------------- windowed ring


@st.composite
def window_ring_case(draw):
    case = draw(ring_case())
    s_local = case["s"] // case["n"]
    side = st.sampled_from(
        [-1, 0, 1, s_local // 2, s_local, s_local + 1, 2 * s_local + 1, case["s"]]
    )
    return dict(case, window=(draw(side), draw(side)))


@settings(max_examples=20, **WORLD_SETTINGS)
@given(case=window_ring_case())
def test_windowed_ring_matches_single_device(world, case):
    q, k, v, dout, dlse = _inputs(case)
    dt = case["dtype"]
    want = _reference(q, k, v, dout, dlse, case["causal"], case["scale"], case["window"])
    results = world.check(
        "tests.varlen_cases:window_forward_backward",
        case["n"],
        q,
        k,
        v,
        dout,
        dlse,
        case["causal"],
        case["layout"],
        case["scale"],
        case["window"],
    )
    for rank, res in enumerate(results):
        for name, got, full, dim in zip(
            ["out", "lse", "dq", "dk", "dv"], res[:5], want, [1, 2, 1, 1, 1]
        ):
            _assert_close(
                name,
                got,
                ringkv.shard(full, dim, case["layout"], rank=rank, world=case["n"]),
                dt,
                rank,
            )


@pytest.mark.parametrize(
    "causal,window,hops",
    [
        (
            True,
            (8, -1),
            (1, 2),
        ),  # window within one shard: one K/V hop; backward: that hop + dK/dV home
        (True, (9, -1), (2, 4)),  # one token more reaches two shards back
        (False, (0, 0), (0, 0)),  # every token sees only itself: no message at all
        (False, (3, 3), (3, 6)),  # rank 0 needs rank 1's keys: the ring's last step (N-1)
        (True, (-1, -1), (3, 6)),  # no window: the whole ring, N-1 hops each way
    ],
)
def test_windowed_ring_sends_only_the_hops_it_needs(world, causal, window, hops):
    n, s = 4, 32  # contiguous shards of 8 tokens
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, s, 2, 16, generator=g) for _ in range(4))
    want = _reference(q, k, v, dout, None, causal, None, window)
    results = world.check(
        "tests.varlen_cases:window_forward_backward",
        n,
        q,
        k,
        v,
        dout,
        None,
        causal,
        "contiguous",
        None,
        window,
    )
    assert [r[5] for r in results] == [hops] * n
    for rank, res in enumerate(results):
        for name, got, full, dim in zip(
            ["out", "lse", "dq", "dk", "dv"], res[:5], want, [1, 2, 1, 1, 1]
        ):
            _assert_close(
                name,
                got,
                ringkv.shard(full, dim, "contiguous", rank=rank, world=n),
                torch.float32,
                rank,
            )


# ---------------------------------------------------------------------------- varlen ring


@st.composite
def varlen_case(draw):
    n = draw(st.integers(1, 4))
    lengths = draw(
        st.lists(
            st.sampled_from([1, 2]) | st.integers(1, n - 1 if n > 1 else 1) | st.integers(3, 14),
            min_size=1,
            max_size=5,
        )
    )  # short docs (< world size, length 1) likely
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        n=n,
        layout=draw(st.sampled_from(ringkv.LAYOUTS)),
        cu=cu,
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1)] * 3 + [(0, -1), (2, -1), (1, 2), (4, 0)])),
        as_tensor=draw(st.booleans()),
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 2])),
        d=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16])),
        scale=draw(st.sampled_from([None, 0.3])),
        lse_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _per_document_reference(q, k, v, dout, dlse, cu, causal, scale, window):
    """Reference attention on each document on its own, concatenated: out, lse, dq, dk, dv."""
    parts = [
        _reference(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            dout[:, a:b],
            None if dlse is None else dlse[:, :, a:b],
            causal,
            scale,
            window,
        )
        for a, b in zip(cu, cu[1:])
    ]
    return [torch.cat([p[i] for p in parts], 2 if i == 1 else 1) for i in range(5)]


@settings(max_examples=20, **WORLD_SETTINGS)
@given(case=varlen_case())
def test_varlen_ring_matches_per_document_reference(world, case):
    _check_varlen(world, case)


def test_varlen_ring_bf16_gqa_window_fixed_case(world):
    """A fixed cover of what hypothesis only samples: bf16, GQA, a window, LSE gradient, 3 ranks."""
    _check_varlen(
        world,
        dict(
            n=3,
            layout="zigzag",
            cu=[0, 1, 3, 20, 21, 33],
            causal=True,
            window=(4, -1),
            as_tensor=True,
            hkv=2,
            h=4,
            d=32,
            dtype=torch.bfloat16,
            scale=None,
            lse_grad=True,
            seed=3,
        ),
    )


def _check_varlen(world, case):
    g = torch.Generator().manual_seed(case["seed"])
    s, h, hkv, d, dt = case["cu"][-1], case["h"], case["hkv"], case["d"], case["dtype"]
    q = torch.randn(1, s, h, d, generator=g).to(dt)
    k, v = (torch.randn(1, s, hkv, d, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(1, s, h, d, generator=g)
    dlse = torch.randn(1, h, s, generator=g) if case["lse_grad"] else None
    want = _per_document_reference(
        q, k, v, dout, dlse, case["cu"], case["causal"], case["scale"], case["window"]
    )
    cu = torch.tensor(case["cu"], dtype=torch.int32) if case["as_tensor"] else case["cu"]
    results = world.check(
        "tests.varlen_cases:varlen_forward_backward",
        case["n"],
        q,
        k,
        v,
        dout,
        dlse,
        case["causal"],
        case["layout"],
        case["scale"],
        case["window"],
        cu,
    )
    for rank, res in enumerate(results):  # every rank unsharded the whole packed result
        assert res[6], f"rank {rank}: pad rows must give out 0, lse -inf and no gradient"
        for name, got, full in zip(["out", "lse", "dq", "dk", "dv"], res[:5], want):
            _assert_close(name, got, full, dt, rank)
    pairs = sum(r[5][2] for r in results)
    assert pairs == int(
        sum(
            window_matrix(
                range(b - a), range(b - a), b - a, b - a, case["causal"], case["window"]
            ).sum()
            for a, b in zip(case["cu"], case["cu"][1:])
        )
    )


def test_zigzag_splits_every_document_for_balance(world):
    """A long and a short document: zigzag splits each one, so causal work stays balanced."""
    n, cu = 4, [0, 64, 72]
    q = torch.randn(1, 72, 2, 16)
    results = world.check(
        "tests.varlen_cases:varlen_forward_backward",
        n,
        q,
        q,
        q,
        torch.ones(q.shape),
        None,
        True,
        "zigzag",
        None,
        (-1, -1),
        cu,
    )
    pairs = [r[5][2] for r in results]
    assert sum(pairs) == 64 * 65 // 2 + 8 * 9 // 2
    assert max(pairs) - min(pairs) <= (64 // 8) ** 2 + 8, pairs
    assert [d for d, _ in varlen_chunks(cu, "zigzag", 0, n) if d >= 0] == [0, 0, 1, 1]


# ---------------------------------------------------------------------------- layout


@pytest.mark.parametrize("layout", ringkv.LAYOUTS)
def test_shard_unshard_positions_round_trip(world, layout):
    n, cu = 3, [0, 1, 3, 10, 11, 15]  # documents of 1, 2, 7, 1, 4 tokens
    x = torch.arange(15, dtype=torch.float32)[None, :, None].expand(1, 15, 2).contiguous() + 1
    res = world.check("tests.varlen_cases:roundtrip", n, x, cu, layout)
    starts = torch.tensor(cu[:-1])
    for rank, (local, pos, full) in enumerate(res):
        assert torch.equal(full, x)
        index = varlen_index(cu, layout, rank, n)
        assert local.shape == (1, varlen_local_len(cu, layout, n), 2) == (1, len(index), 2)
        real = index >= 0
        assert torch.equal(local[0, real, 0], x[0, index[real], 0]) and not local[0, ~real].any()
        doc = torch.searchsorted(starts, index[real], right=True) - 1
        assert torch.equal(pos[real], index[real] - starts[doc])  # position within its document
        assert (pos[~real] >= 1).all()
        assert torch.equal(pos, ringkv.positions(15, layout, rank, n, cu_seqlens=torch.tensor(cu)))


@pytest.mark.parametrize(
    "cu,match",
    [
        ([1, 5, 8], "start at 0"),
        ([0, 5, 5, 8], "strictly increasing"),
        ([0, 6, 4, 8], "strictly increasing"),
        ([0, 5, 9], "end at the packed sequence length 8"),
        ([0], "at least one document"),
        ([0.0, 8.0], "list of ints"),
        (torch.tensor([0.0, 8.0]), "integer tensor"),
    ],
)
def test_bad_cu_seqlens_in_shard_and_positions(cu, match):
    x = torch.randn(1, 8, 2)
    for fn in (
        lambda: ringkv.shard(x, 1, "zigzag", rank=0, world=2, cu_seqlens=cu),
        lambda: ringkv.positions(8, "zigzag", 0, 2, cu_seqlens=cu),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            fn()
    with pytest.raises(ValueError, match="one packed batch row"):
        ringkv.shard(torch.randn(2, 8, 2), 1, "zigzag", rank=0, world=2, cu_seqlens=[0, 8])


def test_bad_varlen_ring_input_raises_on_every_rank(world):
    shape = (1, 4, 2, 16)  # contiguous over 3 ranks: cu [0, 5, 11] pads to 6 + 6 -> 4 rows per rank
    for kw, match in [
        (dict(cu_seqlens=[1, 5, 11]), "start at 0"),
        (dict(cu_seqlens=[0, 5, 5, 11]), "strictly increasing"),
        (dict(cu_seqlens=[0, 5, 13]), "local rows"),  # last != S: the local length does not match
        (
            dict(cu_seqlens=[0, 5, 11], q=(2, 4, 2, 16), k=(2, 4, 2, 16), v=(2, 4, 2, 16)),
            "one batch row",
        ),
        (dict(window=(-3, 0)), "window"),
    ]:
        kw = dict(dict(q=shape, k=shape, v=shape, layout="contiguous"), **kw)
        res = world.run("tests.ring_cases:call", 3, kw)
        assert all(
            isinstance(r, RankError)
            and r.type in ("ValueError", "TypeError")
            and match in r.message
            for r in res
        ), res
    ok = world.check(
        "tests.ring_cases:call",
        3,
        dict(q=shape, k=shape, v=shape, layout="contiguous", cu_seqlens=[0, 5, 11]),
    )
    assert ok == [shape] * 3
