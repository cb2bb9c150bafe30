"""V with its own head size (MLA), logit soft-capping (Gemma 2) and attention sinks (gpt-oss):
every CPU kernel backend and every SP method (ring in each layout, windowed and packed,
Ulysses, USP, all-gather KV) against float64 attention written out here: outputs, LSE and
the gradients of q, k, v and the sinks (summed over the ranks, like any replicated weight's)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import ringkv
from ringkv import kernels
from ringkv.kernels import cpu_flash
from tests.dist import RankError
from tests.test_ring import _assert_close
from tests.test_sp_variants import case

SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
SINK_VALUES = [
    -30.0,
    -3.0,
    0.0,
    1.5,
    4.0,
    30.0,
]  # large negatives (no effect) and positives (the sink takes all)
CAPS = [None, None, 0.5, 2.0, 30.0]


def naive(
    q,
    k,
    v,
    sinks,
    *,
    causal,
    scale,
    window=(-1, -1),
    softcap=None,
    q_pos=None,
    k_pos=None,
    docs=None,
):
    """float64 attention written out: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), sinks
    (H,)
    -> out (B, Sq, H, Dv), lse (B, H, Sq) over the real keys (-inf where none is visible)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk, vv = (t.repeat_interleave(h // hkv, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp = torch.arange(sq) if q_pos is None else q_pos
    kp = torch.arange(sk) if k_pos is None else k_pos
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= qp[:, None] >= kp[None]
    if window[0] >= 0:
        vis &= kp[None] >= qp[:, None] - window[0]
    if window[1] >= 0:
        vis &= kp[None] <= qp[:, None] + window[1]
    if docs is not None:
        vis &= docs[:, None] == docs[None]
    s = s.masked_fill(~vis, float("-inf"))
    seen = vis.any(1)  # (Sq,)
    safe = torch.where(
        seen[:, None], s, torch.zeros_like(s)
    )  # no NaN (nor NaN gradient) on rows that see nothing
    lse = torch.where(seen, torch.logsumexp(safe, -1), torch.full_like(safe[..., 0], float("-inf")))
    if sinks is None:
        p = torch.softmax(safe, -1) * seen[:, None]
    else:
        p = torch.softmax(torch.cat([s, sinks.view(1, h, 1, 1).expand(b, h, sq, 1)], -1), -1)[
            ..., :-1
        ]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


def naive_grads(q, k, v, sinks, dout, dlse, **kw):
    """out, lse and the gradients of (out * dout).sum() + (lse * dlse).sum() in float64."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = None if sinks is None else sinks.detach().double().requires_grad_()
    out, lse = naive(*ins, s64, **kw)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.nan_to_num(0, 0, 0) * dlse.double()).sum()
    grads = torch.autograd.grad(loss, ins + ([s64] if s64 is not None else []))
    return (out.detach(), lse.detach(), *grads[:3], grads[3] if s64 is not None else None)


def _tensors(g, b, s, h, hkv, d, dv, dtype, sinks_on):
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s, hkv, dv, generator=g).to(dtype)
    dout = torch.randn(b, s, h, dv, generator=g)
    return q, k, v, dout


def _sinks(draw, h):
    return draw(
        st.one_of(st.none(), st.lists(st.sampled_from(SINK_VALUES), min_size=h, max_size=h))
    )


# --------------------------------------------------------------------------------------------
# single device: every CPU backend


@st.composite
def kernel_case(draw):
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([16, 32]))
    sq = draw(st.integers(1, 40))
    w = st.integers(0, 40)
    return dict(
        b=draw(st.integers(1, 2)),
        sq=sq,
        sk=draw(st.integers(1, 40)),
        h=h,
        hkv=hkv,
        d=d,
        dv=draw(st.sampled_from([d, d // 2, 48, 16])),
        causal=draw(st.booleans()),
        window=draw(st.one_of(st.just((-1, -1)), st.tuples(w, st.just(-1)), st.tuples(w, w))),
        offset=draw(st.integers(0, 20)),
        softcap=draw(st.sampled_from(CAPS)),
        sinks=_sinks(draw, h),
        dtype=draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16])),
        scale=draw(st.sampled_from([None, 0.3])),
        lse_grad=draw(st.booleans()),
        backend=draw(st.sampled_from(["reference", "sdpa", "cpu_flash", "auto"])),
        seed=draw(st.integers(0, 99)),
    )


@settings(max_examples=60, **SETTINGS)
@given(c=kernel_case())
@example(
    c=dict(
        b=1,
        sq=9,
        sk=9,
        h=4,
        hkv=2,
        d=32,
        dv=16,
        causal=True,
        window=(-1, -1),
        offset=0,
        softcap=2.0,
        sinks=[-30.0, 0.0, 4.0, 30.0],
        dtype=torch.float32,
        scale=None,
        lse_grad=True,
        backend="auto",
        seed=0,
    )
)
def test_kernels_match_float64(c):
    if c["backend"] == "cpu_flash":
        assume(c["dtype"] == torch.float32 and cpu_flash.library() is not None)
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["sq"], c["h"], c["d"], generator=g).to(c["dtype"])
    k = torch.randn(c["b"], c["sk"], c["hkv"], c["d"], generator=g).to(c["dtype"])
    v = torch.randn(c["b"], c["sk"], c["hkv"], c["dv"], generator=g).to(c["dtype"])
    dout = torch.randn(c["b"], c["sq"], c["h"], c["dv"], generator=g)
    dlse = torch.randn(c["b"], c["h"], c["sq"], generator=g) if c["lse_grad"] else None
    sinks = None if c["sinks"] is None else torch.tensor(c["sinks"])
    q_pos = range(
        c["offset"], c["offset"] + c["sq"]
    )  # queries after some keys, as in a ring step or decode
    kw = dict(causal=c["causal"], scale=c["scale"], window=c["window"], softcap=c["softcap"])
    module = kernels.BACKENDS[c["backend"]] if c["backend"] != "auto" else None
    if (
        c["softcap"] is not None
        and module is not None
        and "softcap" not in kernels.features(module)
    ):
        with pytest.raises(ValueError, match="softcap"):
            kernels.attention(q, k, v, q_positions=q_pos, backend=c["backend"], **kw)
        return
    want = naive_grads(q, k, v, sinks, dout, dlse, q_pos=torch.tensor(q_pos), **kw)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    out, lse = kernels.attention(*ins, q_positions=q_pos, backend=c["backend"], sinks=s, **kw)
    loss = (out.float() * dout).sum() + (
        0 if dlse is None else (lse.nan_to_num(0, 0, 0) * dlse).sum()
    )
    loss.backward()
    got = (out.detach(), lse.detach(), *(t.grad for t in ins), None if s is None else s.grad)
    for name, a, e in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, want):
        if e is not None:
            _assert_close(f"{c['backend']} {name}", a, e, c["dtype"], 0)
    # attention_backward gives the same gradients from attention's own out/lse
    grads = kernels.attention_backward(
        dout.to(q.dtype),
        q,
        k,
        v,
        out.detach(),
        lse.detach(),
        dlse=dlse,
        q_positions=q_pos,
        backend=c["backend"],
        sinks=sinks,
        **kw,
    )
    for name, a, e in zip(["dq", "dk", "dv", "dsinks"], grads, want[2:]):
        if e is not None:
            _assert_close(f"attention_backward {name}", a, e, c["dtype"], 0)


def test_padded_backend_sees_equal_head_sizes_and_describe_says_so():
    seen = []
    real = kernels.sdpa.forward

    def spy(q, k, v, *a, **kw):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, *a, **kw)

    q, k, v = torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 16)
    kernels.sdpa.forward = spy
    try:
        out, _ = kernels.attention(q, k, v, causal=True, backend="sdpa")
    finally:
        kernels.sdpa.forward = real
    assert seen and all(s == (32, 32, 32) for s in seen) and out.shape == (1, 8, 2, 16)
    info = kernels.describe("cpu", torch.float32)
    assert (
        info["features"]["sdpa"]["softcap"].startswith("no")
        and info["features"]["reference"]["softcap"] == "native"
    )
    assert info["features"]["sdpa"]["dv"].startswith("zero-padded")
    assert all(
        name in ("reference", "cpu_flash", "triton", "flash_attn")
        for kinds in info["auto_softcap"].values()
        for name in kinds.values()
    )


# --------------------------------------------------------------------------------------------
# every SP method on a gloo world


@st.composite
def sp_case(draw, method):
    c = draw(case(method))
    c["dv"] = draw(st.sampled_from([c["d"], 8, 24, 48]))
    c["softcap"] = draw(st.sampled_from(CAPS))
    c["sinks"] = _sinks(draw, c["h"])
    c["method"] = method
    return c


def _run(world, c, cu=None, docs=None):
    g = torch.Generator().manual_seed(c["seed"])
    q, k, v, dout = _tensors(
        g, c["b"], c["s"], c["h"], c["hkv"], c["d"], c["dv"], c["dtype"], c["sinks"]
    )
    dlse = torch.randn(c["b"], c["h"], c["s"], generator=g) if c["lse_grad"] else None
    sinks = None if c["sinks"] is None else torch.tensor(c["sinks"])
    want = naive_grads(
        q,
        k,
        v,
        sinks,
        dout,
        dlse,
        causal=c["causal"],
        scale=c["scale"],
        window=c["window"],
        softcap=c["softcap"],
        docs=docs,
    )
    results = world.check(
        "tests.feature_cases:forward_backward",
        c["n"],
        c["method"],
        q,
        k,
        v,
        sinks,
        dout,
        dlse,
        c,
        cu,
    )
    for rank, res in enumerate(results):
        for name, a, e in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], res, want):
            if e is not None:
                _assert_close(f"{c['method']} {name}", a, e, c["dtype"], rank)


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather", "usp"])
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_sp_methods_match_float64(world, method, data):
    _run(world, data.draw(sp_case(method)))


def _fixed(method, n, dims=None, layout="zigzag", window=(-1, -1)):
    """A case that always runs: causal, GQA, Dv < D, cap and sinks of both signs, a gradient through
    lse."""
    return dict(
        method=method,
        n=n,
        dims=dims,
        layout=layout,
        causal=True,
        b=1,
        s=8 * n,
        window=window,
        h=4,
        hkv=2,
        d=32,
        dv=16,
        dtype=torch.float32,
        scale=None,
        lse_grad=True,
        chunks=2,
        seed=3,
        ring_n=n,
        softcap=2.0,
        sinks=[-30.0, 0.0, 4.0, 30.0],
    )


@pytest.mark.parametrize(
    "c",
    [
        _fixed("ring", 4),
        _fixed("ring", 3, layout="striped", window=(5, 0)),
        dict(_fixed("ring", 2, layout="contiguous"), dv=48),
        _fixed("ulysses", 2),
        _fixed("ulysses", 3),  # uneven: heads 2 + 1 + 1, KV head 1 on two ranks
        _fixed("allgather", 3),
        _fixed("usp", 4, dims=(2, 2)),
        dict(_fixed("usp", 4, dims=(2, 2)), h=3, hkv=1, sinks=[-3.0, 0.0, 30.0]),  # 2 + 1 heads
    ],
    ids=lambda c: f"{c['method']}-{c['n']}-{c['layout']}-dv{c['dv']}-h{c['h']}",
)
def test_sp_methods_fixed(world, c):
    _run(world, c)


@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_packed_documents_ring_matches_float64(world, data):
    n = data.draw(st.integers(1, 4))
    lens = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    d = data.draw(st.sampled_from([16, 32]))
    c = dict(
        method="ring",
        n=n,
        dims=None,
        layout=data.draw(st.sampled_from(ringkv.LAYOUTS)),
        causal=True,
        b=1,
        s=cu[-1],
        window=data.draw(st.sampled_from([(-1, -1), (2, 0)])),
        h=2,
        hkv=1,
        d=d,
        dv=data.draw(st.sampled_from([d, 8, 48])),
        dtype=torch.float32,
        scale=None,
        lse_grad=data.draw(st.booleans()),
        chunks=1,
        seed=data.draw(st.integers(0, 99)),
        softcap=data.draw(st.sampled_from(CAPS)),
        sinks=_sinks(data.draw, 2),
    )
    _run(world, c, cu=cu, docs=docs)


def test_decode_attention_applies_sinks_once_after_the_merge(world):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 3, 4, 32, generator=g),
        torch.randn(1, 12, 2, 32, generator=g),
        torch.randn(1, 12, 2, 16, generator=g),
    )
    sinks = torch.tensor([-3.0, 0.0, 2.0, 30.0])
    q_pos = torch.arange(9, 12)
    want, _ = naive(
        q.double(),
        k.double(),
        v.double(),
        sinks.double(),
        causal=True,
        scale=None,
        softcap=5.0,
        q_pos=q_pos,
    )
    for out in world.check("tests.feature_cases:decode", 3, q, k, v, sinks, q_pos):
        _assert_close("decode out", out, want, torch.float32, 0)


@pytest.mark.parametrize(
    "field,other,match",
    [
        ("v", (1, 8, 2, 8), "v_head_dim"),
        ("softcap", 5.0, "softcap"),
        ("sinks", torch.zeros(2), "sinks"),
    ],
)
def test_ranks_that_disagree_on_a_feature_all_raise(world, field, other, match):
    base = dict(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16), layout="zigzag", causal=True)
    res = world.run(
        "tests.ring_cases:call", 3, [base, dict(base, **{field: other}), base], timeout=60
    )
    errs = [r for r in res if isinstance(r, RankError)]
    assert len(errs) == 3 and all(e.type == "ValueError" and match in e.message for e in errs), res
