"""Sequence-parallel gated delta rule and KDA (ringkv.sp.delta) on a real gloo world, forward and
backward, against (a) a float64 per-token recurrence written out here and (b) transformers' own
chunked functions run on the whole unsharded sequence (per document when packed); the local
references (ringkv.kernels.delta_ref) against transformers with a state in and out."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from ringkv.kernels.delta_ref import gated_delta_ref, kda_ref
from ringkv.sp import gated_delta_rule, kda
from ringkv.sp.pieces import seq_pieces
from tests.dist import World

TF = {"gdn": torch_chunk_gated_delta_rule, "kda": chunk_kimi_delta_attention}
REF = {"gdn": gated_delta_ref, "kda": kda_ref}


@pytest.fixture(scope="module")
def world():
    w = World(4)
    yield w
    w.close()


# ---------------------------------------------------------------------------------------------
# inputs and the two oracles


def _inputs(kind, b, t, hk, hv, dk, dv, dtype, seed, l2):
    """q, k, v, g, beta, dout in ``dtype`` (dout float32, rounded through ``dtype`` as the
    backward of ``o.float()`` rounds it). Without l2-normalisation k has norm <= 1 (beta k k^T
    stays a contraction)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    if not l2:
        k = F.normalize(k, dim=-1) * (0.3 + 0.7 * torch.rand(b, t, hk, 1, generator=gen))
    v = torch.randn(b, t, hv, dv, generator=gen)
    gshape = (b, t, hv, dk) if kind == "kda" else (b, t, hv)
    g = -2.0 * torch.rand(gshape, generator=gen) ** 2  # log decays in [-2, 0]
    beta = torch.rand(b, t, hv, generator=gen)
    dout = torch.randn(b, t, hv, dv, generator=gen).to(dtype).float()
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [dout]


def _docs(seq_len, cu):
    return [(0, seq_len)] if cu is None else list(zip(cu, cu[1:]))


def recurrence64(kind, q, k, v, g, beta, scale, l2, docs):
    """The rule token by token in float64: ``S <- diag(exp g) S``, ``S <- S + beta k (v - S^T
    k)^T``, ``o = S^T (scale q)``, the state reset at each document's start. Returns
    ``o (B, T, H_v, D_v)`` and each document's final state ``(B, H_v, D_k, D_v)``."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if k.shape[2] != v.shape[2]:  # each q/k head serves H_v // H_k consecutive v heads
        q, k = (x.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for x in (q, k))
    if l2:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    b, _, h, dk = k.shape
    outs, finals = [], []
    for start, stop in docs:
        s = q.new_zeros(b, h, dk, v.shape[-1])
        for t in range(start, stop):
            decay = g[:, t].exp()
            s = s * (decay[..., None] if kind == "kda" else decay[..., None, None])
            pred = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
            delta = beta[:, t, :, None] * (v[:, t] - pred)
            s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
            outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
        finals.append(s)
    return torch.stack(outs, 1), finals


def _with_grads(fn, tensors, dout):
    """``fn(*leaves) -> (o, finals)``, and the gradients of ``sum(o * dout)``."""
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    o, finals = fn(*leaves)
    (o.double() * dout.double()).sum().backward()
    return o.detach(), [x.grad for x in leaves], [f.detach() for f in finals]


def oracle64(kind, tensors, dout, opts, docs):
    q, k, v, g, beta = (x.double() for x in tensors)
    return _with_grads(
        lambda *xs: recurrence64(
            kind, *xs, opts.get("scale"), opts.get("use_qk_l2norm", False), docs
        ),
        (q, k, v, g, beta),
        dout,
    )


def oracle_transformers(kind, tensors, dout, opts, docs):
    """transformers' function on each whole document (its default chunk size, 64). It takes no
    ``scale`` (always ``D_k ** -0.5``, after the l2norm): a drawn scale (drawn only without
    l2norm) goes into q as ``q * scale * sqrt(D_k)`` in float32, as transformers scales q inside,
    and the output is rounded to the input dtype once, as transformers does."""
    scale, dtype = opts.get("scale"), tensors[0].dtype

    def run(q, *xs):
        if scale is not None:
            q = q.float() * (scale * q.shape[-1] ** 0.5)
        outs, finals = [], []
        for a, b in docs:
            o, f = TF[kind](
                *(x[:, a:b] for x in (q, *xs)),
                output_final_state=True,
                use_qk_l2norm_in_kernel=opts.get("use_qk_l2norm", False),
            )
            outs.append(o.to(dtype))
            finals.append(f)
        return torch.cat(outs, 1), finals

    return _with_grads(run, tensors, dout)


# ---------------------------------------------------------------------------------------------
# comparing


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-120)))
    return torch.exp2(e - 7)


def assert_close(name, got, want, dtype, loose=False):
    """float32: close to float64 (relative to the largest value); bfloat16: within one bf16
    unit in the last place of ``want`` (both sides are float32-exact values rounded once).
    ``loose``: transformers in bfloat16 sums the gradients of the repeated q/k heads (GQA) in
    bfloat16 (it repeats before its float32 cast), so its dq/dk are off by a bf16 rounding of the
    per-head terms: two ulps plus 2^-8 of the largest value."""
    got, want = got.double(), want.double()
    big = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    if dtype == torch.float32:
        torch.testing.assert_close(
            got, want, atol=3e-5 * big, rtol=3e-4, msg=lambda m: f"{name}: {m}"
        )
        return
    err = (got - want).abs()
    bound = _ulp_bf16(want) * (2 if loose else 1) + (2**-8 if loose else 2e-5) * big
    bad = err > bound
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements off by more than one bf16 ulp; "
        f"worst {err.max().item():.3g} at {want.flatten()[err.flatten().argmax()].item():.4g}"
    )


def check_case(world, kind, n, layout, seq_len, cu, tensors, opts, junk=False):
    """Run on ``n`` ranks; compare o, the five gradients and the final states with both oracles
    (``junk``: pad rows hold large random values on the ranks)."""
    *inputs, dout = tensors
    dtype = inputs[0].dtype
    res = world.check(
        "tests.delta_cases:forward_backward", n, kind, tensors, layout, seq_len, cu, opts, junk
    )
    (full, finals), others = res[0], [r[1] for r in res[1:]]
    for r, f in enumerate(others, 1):
        assert f.keys() == finals.keys()
        assert all(torch.equal(f[d], finals[d]) for d in f), f"rank {r}'s final states differ"
    docs = _docs(seq_len, cu)
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    for label, oracle in (("float64", oracle64), ("transformers", oracle_transformers)):
        o, grads, want_finals = oracle(kind, inputs, dout, opts, docs)
        for name, got, want in zip(names, full, [o] + grads):
            assert_close(f"{kind} {name} vs {label}", got, want, dtype, label != "float64")
        assert sorted(finals) == list(range(len(docs)))
        for d, want in enumerate(want_finals):  # float32 states: close whatever the input dtype
            torch.testing.assert_close(
                finals[d].double(),
                want.double(),
                atol=3e-5 * max(1.0, want.abs().max().item()),
                rtol=3e-4,
                msg=lambda m, d=d: f"{kind} final state of document {d} vs {label}: {m}",
            )


# ---------------------------------------------------------------------------------------------
# the hypothesis draws


@st.composite
def sp_case(draw, kind):
    n = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["contiguous", "zigzag"]))
    packed = draw(st.booleans())
    if packed:  # short documents leave ranks short or pad-only chunks
        lens = draw(st.lists(st.integers(1, 14), min_size=1, max_size=3))
        cu, b = [0] + [sum(lens[: i + 1]) for i in range(len(lens))], 1
        seq_len = cu[-1]
    else:
        cu, b, seq_len = None, draw(st.integers(1, 2)), draw(st.integers(1, 33))
    hk = draw(st.sampled_from([1, 2]))
    hv = hk * (draw(st.sampled_from([1, 2])) if kind == "gdn" else 1)
    dk, dv = draw(st.sampled_from([4, 8])), draw(st.sampled_from([3, 4]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    l2 = draw(st.booleans())
    opts = dict(
        use_qk_l2norm=l2,
        chunk_size=draw(st.sampled_from([2, 3, 8, 64])),
        scale=None if l2 else draw(st.sampled_from([None, 0.4])),
    )
    tensors = _inputs(kind, b, seq_len, hk, hv, dk, dv, dtype, draw(st.integers(0, 2**16)), l2)
    return n, layout, seq_len, cu, tensors, opts, draw(st.booleans())


SETTINGS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(case=sp_case("gdn"))
def test_gated_delta_rule_sp(world, case):
    check_case(world, "gdn", *case)


@SETTINGS
@given(case=sp_case("kda"))
def test_kda_sp(world, case):
    check_case(world, "kda", *case)


# ---------------------------------------------------------------------------------------------
# fixed cases: the ones the planted bugs need, always run

FIXED = [
    ("gdn", 4, "zigzag", [0, 9, 30, 37], torch.float32, 4),
    ("kda", 3, "zigzag", None, torch.float32, 3),
    ("kda", 2, "contiguous", [0, 13, 20], torch.float32, 8),
    ("gdn", 4, "contiguous", None, torch.bfloat16, 64),
    ("kda", 4, "zigzag", [0, 5, 40], torch.bfloat16, 4),
    ("gdn", 1, "contiguous", [0, 20, 23, 30], torch.float32, 4),  # three batches of pieces
]


@pytest.mark.parametrize("kind, n, layout, cu, dtype, chunk", FIXED)
def test_fixed_cases(world, kind, n, layout, cu, dtype, chunk):
    seq_len = 45 if cu is None else cu[-1]
    b = 2 if cu is None else 1
    hv = 4 if kind == "gdn" else 2  # GDN: two v heads per q/k head
    tensors = _inputs(kind, b, seq_len, 2, hv, 8, 4, dtype, 7, True)
    opts = dict(use_qk_l2norm=True, chunk_size=chunk)
    check_case(world, kind, n, layout, seq_len, cu, tensors, opts)


# ---------------------------------------------------------------------------------------------
# the local references against transformers, with a state in and out


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("t, chunk", [(1, 64), (23, 8), (40, 64), (17, 5)])
@pytest.mark.parametrize("l2", [False, True])
def test_reference_matches_transformers(kind, t, chunk, l2):
    """o, final state and the gradients of q, k, v, g, beta and the initial state."""
    hv = 4 if kind == "gdn" else 2
    *xs, dout = _inputs(kind, 2, t, 2, hv, 8, 5, torch.float32, t + chunk, l2)
    s0 = torch.randn(2, hv, 8, 5, generator=torch.Generator().manual_seed(1))
    leaves = lambda: [x.clone().requires_grad_() for x in (*xs, s0)]  # noqa: E731
    results = []
    for fn in (
        lambda *a: REF[kind](*a[:5], initial_state=a[5], chunk_size=chunk, use_qk_l2norm=l2),
        lambda *a: TF[kind](
            *a[:5], initial_state=a[5], output_final_state=True, use_qk_l2norm_in_kernel=l2
        ),
    ):
        ins = leaves()
        o, final = fn(*ins)
        ((o * dout).sum() + (final * 0.3).sum()).backward()
        results.append([o, final] + [x.grad for x in ins])
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dstate"]
    for name, got, want in zip(names, *results):
        assert_close(f"{kind} reference {name}", got.detach(), want.detach(), torch.float32)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reference_strong_decay(kind):
    """log decays down to -40 per token (exp(G) underflows within a chunk): finite, and equal to
    the float64 recurrence, gradients finite."""
    *xs, dout = _inputs(kind, 1, 150, 2, 2, 16, 8, torch.float32, 0, True)
    xs[3] = xs[3] * 20
    leaves = [x.clone().requires_grad_() for x in xs]
    o, final = REF[kind](*leaves, use_qk_l2norm=True, chunk_size=64)
    (o * dout).sum().backward()
    want, want_final = recurrence64(kind, *xs, None, True, [(0, 150)])
    assert_close(f"{kind} o", o.detach(), want, torch.float32)
    assert_close(f"{kind} final", final.detach(), want_final[0], torch.float32)
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_reference_scale_and_bf16():
    """``scale`` multiplies q after the l2norm; bf16 in, float32 inside, bf16 out."""
    *xs, _ = _inputs("gdn", 1, 19, 1, 2, 4, 3, torch.bfloat16, 3, True)
    o, final = gated_delta_ref(*xs, scale=0.7, use_qk_l2norm=True, chunk_size=4)
    want, want_final = recurrence64("gdn", *xs, 0.7, True, [(0, 19)])
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert_close("o", o, want, torch.bfloat16)
    assert_close("final", final, want_final[0], torch.float32)


# ---------------------------------------------------------------------------------------------
# world 1 without a process group, and bad input


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("cu", [None, [0, 6, 7, 20]])
def test_world1_without_process_group(kind, cu):
    """group None and no torch.distributed: no communication, same answers."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    t = 20
    hv = 4 if kind == "gdn" else 2
    *xs, dout = _inputs(kind, 1, t, 2, hv, 8, 4, torch.float32, 5, True)
    pieces = seq_pieces(t, "zigzag" if cu is None else "contiguous", 1, cu_seqlens=cu)  # no pad
    fn = gated_delta_rule if kind == "gdn" else kda
    ins = [x.clone().requires_grad_() for x in xs]
    o, finals = fn(*ins, use_qk_l2norm=True, chunk_size=4, pieces=pieces, return_final_state=True)
    (o * dout).sum().backward()
    o64, grads, finals64 = oracle64(kind, xs, dout, dict(use_qk_l2norm=True), _docs(t, cu))
    for name, got, want in zip(
        ["o", "dq", "dk", "dv", "dg", "dbeta"], [o] + [x.grad for x in ins], [o64] + grads
    ):
        assert_close(f"{kind} world 1 {name}", got.detach(), want, torch.float32)
    assert sorted(finals) == list(range(len(finals64)))
    for d, want in enumerate(finals64):
        assert_close(f"{kind} world 1 final {d}", finals[d], want, torch.float32)


def _bad(kind, t):
    """(shapes, kwargs, words the message must hold) for calls that must be refused."""
    hv = 4 if kind == "gdn" else 2
    q, v = (1, t, 2, 8), (1, t, hv, 4)
    g = (1, t, hv, 8) if kind == "kda" else (1, t, hv)
    beta = (1, t, hv)
    ok = [q, q, v, g, beta]
    cases = [
        ([q, (1, t, 2, 6), v, g, beta], {}, "k has shape"),
        ([q, q, (1, t + 3, hv, 4), g, beta], {}, "v has shape"),
        ([q, q, v, (1, t, hv, 3) if kind == "kda" else (1, t, hv + 1), beta], {}, "g has shape"),
        ([q, q, v, g, (1, t)], {}, "beta must be a 3-D"),
        ([q, q, v, g, beta], {"chunk_size": 0}, "chunk_size"),
        (
            [(1, t - 1, 2, 8), (1, t - 1, 2, 8), (1, t - 1, hv, 4)]
            + [(1, t - 1) + s[2:] for s in (g, beta)],
            {},
            "T_local",
        ),
    ]
    if kind == "gdn":
        cases.append(([q, q, (1, t, 3, 4), (1, t, 3), (1, t, 3)], {}, "multiple"))
    else:
        cases.append(([q, q, (1, t, 4, 4), (1, t, 4, 8), (1, t, 4)], {}, "same head count"))
    return ok, cases


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_bad_input_world1(kind):
    ok, cases = _bad(kind, 12)
    fn = gated_delta_rule if kind == "gdn" else kda
    pieces = seq_pieces(12, "contiguous", 1)
    for shapes, kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            fn(*(torch.zeros(s) for s in shapes), pieces=pieces, **kwargs)
    with pytest.raises(ValueError, match="built for 2 ranks"):
        fn(*(torch.zeros(s) for s in ok), pieces=seq_pieces(12, "contiguous", 2))
    with pytest.raises(TypeError, match="Pieces"):
        fn(*(torch.zeros(s) for s in ok), pieces=[(0, 12)])
    with pytest.raises(ValueError, match="recurrent layers"):
        seq_pieces(12, "striped", 1)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_bad_input_refused_on_every_rank(world, kind):
    """A wrong shape is refused on every rank of a world of 3 with the same message, before any
    collective (no rank waits for the others); a good call then still works."""
    _, cases = _bad(kind, 12)  # 12 rows over 3 ranks, contiguous: 4 rows each
    for shapes, kwargs, words in cases[:2] + cases[-2:]:
        local = [(s[0], s[1] // 3) + tuple(s[2:]) for s in shapes]
        res = world.check("tests.delta_cases:bad_input", 3, kind, local, 12, "contiguous", kwargs)
        assert all(r != "ok" and r[0] == "ValueError" for r in res), res
        assert len({r[1].replace(f"rank {i}", "rank") for i, r in enumerate(res)}) == 1, res
    check_case(
        world,
        kind,
        3,
        "contiguous",
        12,
        None,
        _inputs(kind, 1, 12, 2, 4 if kind == "gdn" else 2, 8, 4, torch.float32, 1, True),
        dict(use_qk_l2norm=True),
    )


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("seq_len, cu", [(21, [0, 3, 21]), (3, None)])
def test_inputs_without_grad_record_no_graph(world, kind, seq_len, cu):
    """A frozen model's inference under grad mode: no rank records the gather (nothing to wait
    for in a backward; 3 tokens at world 4 zigzag leave rank 3 pad rows alone); same output."""
    hv = 4 if kind == "gdn" else 2
    tensors = _inputs(kind, 1, seq_len, 2, hv, 8, 4, torch.float32, 11, True)
    opts = dict(use_qk_l2norm=True, chunk_size=4)
    res = world.check(
        "tests.delta_cases:forward_only", 4, kind, tensors, "zigzag", seq_len, cu, opts
    )
    assert [r[1] for r in res] == [False] * 4
    want, _ = recurrence64(kind, *tensors[:5], None, True, _docs(seq_len, cu))
    assert_close(f"{kind} o without grad", res[0][0], want, torch.float32)
