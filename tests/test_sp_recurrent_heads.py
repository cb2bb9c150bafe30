"""The head-parallel (all-to-all) form of the recurrent layers (ringkv.sp.recurrent_heads) on a
real gloo world (1-4 ranks where the heads divide, contiguous and zigzag, packed and unpacked,
short and empty chunks, fp32 and bf16), forward and backward, against (a) its state-passing twin
run on the same rows and (b) float64 per-token recurrences on each whole document (outputs,
final states, every gradient); the refusal when the heads do not divide; the byte counts and
the choice rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from ringkv.sp.pieces import seq_pieces
from ringkv.sp.recurrent_heads import (
    choose_form,
    heads_divide,
    heads_gated_delta_rule,
    heads_mamba2_scan,
    heads_selective_scan,
    layer_bytes,
)
from tests.dist import World
from tests.recurrent_cases import local_index
from tests.recurrent_heads_cases import OUT_DIM, SEQ
from tests.test_sp_delta import recurrence64
from tests.test_sp_recurrent import selective_recurrence, ssd_recurrence

TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
SAME = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # the two forms: the same float32 math
SETTINGS = settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def world():
    w = World(4)
    yield w
    w.close()


# ---------------------------------------------------------------------------------------------
# cases and tensors


@st.composite
def heads_case(draw, kind):
    n = draw(st.integers(1, 4))
    packed = draw(st.booleans())
    if packed:  # short documents leave ranks short or pad-only chunks
        lens = draw(st.lists(st.integers(1, 11), min_size=1, max_size=3))
        cu = tuple(int(c) for c in torch.tensor([0] + lens).cumsum(0))
        seq, b = cu[-1], 1
    else:
        cu, seq, b = None, draw(st.integers(1, 19)), draw(st.integers(1, 2))
    heads = n * draw(st.sampled_from([1, 2]))
    case = dict(
        kind=kind,
        n=n,
        layout=draw(st.sampled_from(["contiguous", "zigzag"])),
        cu=cu,
        seq=seq,
        b=b,
        heads=heads,
        dtype=draw(st.sampled_from([torch.float32] * 5 + [torch.bfloat16])),
        state=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    if kind in ("gdn", "kda"):  # GDN: q/k heads split with v's, or repeated per v head
        hk = heads if kind == "kda" else draw(st.sampled_from([1, heads, max(1, heads // 2)]))
        l2 = draw(st.booleans())
        case.update(hk=hk, dk=draw(st.sampled_from([4, 8])), dv=draw(st.sampled_from([3, 4])))
        opts = dict(use_qk_l2norm=l2, chunk_size=draw(st.sampled_from([2, 3, 8, 64])))
        opts["scale"] = None if l2 else draw(st.sampled_from([None, 0.4]))
    elif kind == "mamba2":  # B/C groups split with the heads (G % N == 0) or sent whole
        case.update(groups=draw(st.sampled_from([1, heads])), p=3, nstate=4)
        opts = dict(
            chunk_size=draw(st.sampled_from([1, 3, 8])),
            dt_softplus=draw(st.booleans()),
            dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.05, 1.5)])),
        )
    else:
        case.update(z=draw(st.booleans()), nstate=4)
        opts = dict(softplus=draw(st.booleans()))
    case["opts"] = opts
    return case


def _rnd(g):
    return lambda *shape: torch.randn(*shape, generator=g)


def tensors(case):
    """The whole sequence's tensors (``SEQ`` names, rows along their dim), parameters, dout
    and one dfinal per document."""
    g = torch.Generator().manual_seed(case["seed"])
    rnd, kind, dtype = _rnd(g), case["kind"], case["dtype"]
    b, s, h, ndoc = case["b"], case["seq"], case["heads"], len(_docs(case))
    if kind in ("gdn", "kda"):
        hk, dk, dv = case["hk"], case["dk"], case["dv"]
        k = F.normalize(rnd(b, s, hk, dk), dim=-1) * (0.3 + 0.7 * torch.rand(b, s, hk, 1))
        gshape = (b, s, h, dk) if kind == "kda" else (b, s, h)
        t = dict(q=rnd(b, s, hk, dk), k=k, v=rnd(b, s, h, dv), g=-2.0 * torch.rand(gshape) ** 2)
        t.update(beta=torch.rand(b, s, h, generator=g), params={})
        t.update(dout=rnd(b, s, h, dv), dfinal={d: rnd(b, h, dk, dv) for d in range(ndoc)})
    elif kind == "mamba2":
        gr, p, n = case["groups"], case["p"], case["nstate"]
        dt = (rnd(b, s, h) * 0.5 + (0 if case["opts"]["dt_softplus"] else 0.7)).abs()
        t = dict(x=rnd(b, s, h, p), dt=dt, B=rnd(b, s, gr, n), C=rnd(b, s, gr, n))
        t["params"] = dict(A=-torch.rand(h, generator=g) * 2, D=rnd(h), dt_bias=rnd(h) * 0.3)
        t.update(dout=rnd(b, s, h, p), dfinal={d: rnd(b, h, p, n) for d in range(ndoc)})
    else:
        n = case["nstate"]
        dt = (rnd(b, h, s) * 0.5 + (0 if case["opts"]["softplus"] else 0.7)).abs()
        t = dict(x=rnd(b, h, s), dt=dt, B=rnd(b, n, s), C=rnd(b, n, s))
        t["z"] = rnd(b, h, s) if case["z"] else None
        t["params"] = dict(A=-torch.rand(h, n, generator=g) * 2, D=rnd(h), delta_bias=rnd(h))
        t.update(dout=rnd(b, h, s), dfinal={d: rnd(b, h, n) for d in range(ndoc)})
    for name in SEQ[kind]:
        t[name] = None if t[name] is None else t[name].to(dtype)
    return t


def _docs(case):
    cu = case["cu"] or (0, case["seq"])
    return list(zip(cu[:-1], cu[1:]))


# ---------------------------------------------------------------------------------------------
# the float64 reference on each whole document


def _doc_fn(case):
    """``fn(doc tensors, params) -> (out, final)`` in float64, one document."""
    kind, o = case["kind"], case["opts"]
    if kind in ("gdn", "kda"):

        def fn(t, p):
            args = [t[k] for k in SEQ[kind]] + [o["scale"], o["use_qk_l2norm"]]
            out, finals = recurrence64(kind, *args, [(0, t["q"].shape[1])])
            return out, finals[0]

    elif kind == "mamba2":

        def fn(t, p):
            dt = F.softplus(t["dt"] + p["dt_bias"]) if o["dt_softplus"] else t["dt"] + p["dt_bias"]
            dt = dt.clamp(*o["dt_limit"])
            return ssd_recurrence(t["x"], dt, p["A"], t["B"], t["C"], p["D"])

    else:

        def fn(t, p):
            dt = t["dt"] + p["delta_bias"][:, None]
            dt = F.softplus(dt) if o["softplus"] else dt
            return selective_recurrence(t["x"], dt, p["A"], t["B"], t["C"], p["D"], t["z"])

    return fn


def reference64(case, t):
    """out, finals and gradients of the cases' loss, per document, float64."""
    kind = case["kind"]
    leaves = {
        k: None if v is None else v.detach().double().requires_grad_()
        for k, v in {**{k: t[k] for k in SEQ[kind]}, **t["params"]}.items()
    }
    fn, outs, finals = _doc_fn(case), [], {}
    for d, (a, b) in enumerate(_docs(case)):
        doc = {
            k: None if leaves[k] is None else leaves[k].narrow(dim, a, b - a)
            for k, dim in SEQ[kind].items()
        }
        out, finals[d] = fn(doc, {k: leaves[k] for k in t["params"]})
        outs.append(out)
    out = torch.cat(outs, OUT_DIM[kind])
    loss = (out * t["dout"].double()).sum()
    if case["state"]:
        loss = loss + sum((finals[d] * t["dfinal"][d].double()).sum() for d in finals)
    loss.backward()
    grads = {k: None if v is None else v.grad for k, v in leaves.items()}
    return dict(out=out.detach(), finals={d: f.detach() for d, f in finals.items()}, grads=grads)


# ---------------------------------------------------------------------------------------------
# comparing


def _close(name, got, want, tol):
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(
        got.double(), want.double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}"
    )


def _assemble(case, per_rank, dim, shape):
    """Every rank's local rows put back in sequence order (pad rows dropped)."""
    pieces = seq_pieces(case["seq"], case["layout"], case["n"], cu_seqlens=case["cu"])
    out = torch.zeros(shape, dtype=torch.float64)
    dim %= len(shape)
    for r, local in enumerate(per_rank):
        index = local_index(pieces, r, case["cu"])
        real = (index >= 0).nonzero().flatten()
        if len(real):
            out.index_copy_(dim, index[real], local.double().index_select(dim, real))
    return out


def gathered(case, t, results, form):
    """One form's results as the whole sequence: out, finals (rank 0's, after checking every
    rank holds the same) and gradients (rows in order; parameters summed over the ranks)."""
    kind, res = case["kind"], [r[form] for r in results]
    out = _assemble(case, [r["out"] for r in res], OUT_DIM[kind], t["dout"].shape)
    finals = res[0]["finals"]
    for r, other in enumerate(res[1:], 1):
        if case["state"]:
            assert other["finals"].keys() == finals.keys(), f"{form}: rank {r}'s documents"
            for d in finals:
                assert torch.equal(other["finals"][d], finals[d]), f"{form}: rank {r}, doc {d}"
    grads = {}
    for k, dim in SEQ[kind].items():
        if t[k] is not None:
            grads[k] = _assemble(case, [r["grads"][k] for r in res], dim, t[k].shape)
    for k in t["params"]:
        grads[k] = sum(r["grads"][k].double() for r in res)
    return dict(out=out, finals=finals, grads=grads)


def compare(name, got, want, tol, state):
    _close(f"{name}: out", got["out"], want["out"], tol)
    if state:
        assert sorted(got["finals"]) == sorted(want["finals"]), name
        for d, f in want["finals"].items():
            _close(f"{name}: final state of document {d}", got["finals"][d], f, tol)
    for k, g in want["grads"].items():
        if g is not None:
            _close(f"{name}: gradient of {k}", got["grads"][k], g, tol)


def check(world, case):
    t = tensors(case)
    results = world.check("tests.recurrent_heads_cases:both", case["n"], case, t, timeout=300)
    heads, state = (gathered(case, t, results, f) for f in ("heads", "state"))
    for r, res in enumerate(results):
        assert res["heads"]["out"].dtype == res["state"]["out"].dtype, f"rank {r}: out dtype"
    tag = f"{case['kind']} {case}"
    compare(f"heads vs state passing, {tag}", heads, state, SAME[case["dtype"]], case["state"])
    want = reference64(case, t)
    compare(f"heads vs float64, {tag}", heads, want, TOL[case["dtype"]], case["state"])


# ---------------------------------------------------------------------------------------------
# the draws, and fixed cases (the planted bugs need: zigzag, packed, several pieces a rank)


@SETTINGS
@given(case=heads_case("gdn"))
def test_heads_gated_delta_rule(world, case):
    check(world, case)


@SETTINGS
@given(case=heads_case("kda"))
def test_heads_kda(world, case):
    check(world, case)


@SETTINGS
@given(case=heads_case("mamba2"))
def test_heads_mamba2_scan(world, case):
    check(world, case)


@SETTINGS
@given(case=heads_case("selective"))
def test_heads_selective_scan(world, case):
    check(world, case)


def _fixed(kind, n, layout, cu, dtype, extra, opts, seq=13, heads=4, b=1):
    case = dict(kind=kind, n=n, layout=layout, cu=cu, seq=cu[-1] if cu else seq, b=b)
    case.update(heads=heads, dtype=dtype, state=True, seed=11, opts=opts, **extra)
    return case


FIXED = [
    _fixed("gdn", 4, "zigzag", (0, 9, 21, 26), torch.float32, dict(hk=2, dk=8, dv=4),
           dict(use_qk_l2norm=True, chunk_size=3, scale=None)),
    _fixed("gdn", 2, "zigzag", None, torch.bfloat16, dict(hk=1, dk=8, dv=4),
           dict(use_qk_l2norm=True, chunk_size=4, scale=None), seq=23, b=2),
    _fixed("kda", 2, "contiguous", (0, 5, 17), torch.float32, dict(hk=4, dk=4, dv=3),
           dict(use_qk_l2norm=False, chunk_size=8, scale=0.4)),
    _fixed("mamba2", 4, "zigzag", (0, 3, 15), torch.float32, dict(groups=2, p=3, nstate=4),
           dict(chunk_size=3, dt_softplus=True, dt_limit=(0.0, float("inf")))),
    _fixed("selective", 3, "zigzag", None, torch.float32, dict(z=True, nstate=4),
           dict(softplus=True), seq=17, heads=3),
]  # fmt: skip


@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"{c['kind']}-{c['n']}-{c['layout']}")
def test_fixed_cases(world, case):
    check(world, case)


# ---------------------------------------------------------------------------------------------
# refusals, world 1, bytes and the rule


BAD = [("gdn", 6, "6 value heads"), ("mamba2", 2, "2 heads"), ("selective", 5, "5 channels")]


@pytest.mark.parametrize("kind, hv, label", BAD)
def test_heads_that_do_not_divide_are_refused_on_every_rank(world, kind, hv, label):
    msgs = world.check("tests.recurrent_heads_cases:bad_heads", 4, kind, hv)
    assert all(m is not None and label in m and "group of 4 ranks" in m for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs


def test_world1_without_process_group():
    """group None and no torch.distributed: no communication; packed documents."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    case = _fixed("gdn", 1, "zigzag", (0, 6, 7, 20), torch.float32, dict(hk=1, dk=4, dv=3),
                  dict(use_qk_l2norm=True, chunk_size=4, scale=None), heads=2)  # fmt: skip
    t = tensors(case)
    pieces = seq_pieces(0, "zigzag", 1, cu_seqlens=case["cu"])
    idx = local_index(pieces, 0, case["cu"])
    rows = torch.where(idx < 0, 0, idx)
    leaves = [t[k].index_select(1, rows).clone().requires_grad_() for k in SEQ["gdn"]]
    opts = dict(case["opts"], pieces=pieces, return_final_state=True)
    o, finals = heads_gated_delta_rule(*leaves, **opts)
    assert torch.equal(o[:, idx < 0], torch.zeros_like(o[:, idx < 0]))
    o.backward(t["dout"].index_select(1, rows) * (idx >= 0)[None, :, None, None])
    case["state"] = False
    want = reference64(case, t)
    _close("world 1 out", o.detach()[:, idx >= 0], want["out"][:, idx[idx >= 0]], 2e-4)
    _close("world 1 dq", leaves[0].grad[:, idx >= 0], want["grads"]["q"][:, idx[idx >= 0]], 2e-4)
    assert sorted(finals) == [0, 1, 2]


def test_other_kinds_world1_no_grad_graph():
    """Inputs without gradient build no graph; world 1 works for the scans too."""
    pieces = seq_pieces(7, "zigzag", 1)
    y = heads_mamba2_scan(
        torch.randn(1, 8, 2, 3), torch.rand(1, 8, 2), -torch.rand(2), torch.randn(1, 8, 1, 4),
        torch.randn(1, 8, 1, 4), chunk_size=4, pieces=pieces,
    )  # fmt: skip
    assert not y.requires_grad and y.shape == (1, 8, 2, 3) and y[:, 7].abs().max() == 0
    y = heads_selective_scan(
        torch.randn(1, 3, 8), torch.rand(1, 3, 8), -torch.rand(3, 2), torch.randn(1, 2, 8),
        torch.randn(1, 2, 8), pieces=pieces,
    )  # fmt: skip
    assert not y.requires_grad and y.shape == (1, 3, 8) and y[..., 7].abs().max() == 0


GDN = dict(k_heads=16, v_heads=32, d_k=128, d_v=128, itemsize=2)  # Qwen3-Next-80B's sizes
MAMBA2 = dict(heads=128, head_dim=64, state=128, groups=8, itemsize=2)  # Nemotron-H-ish


def test_layer_bytes():
    """State passing: constant in S, as the gather sends it; heads: grows with S/N."""
    small, big = (seq_pieces(s, "zigzag", 2) for s in (4096, 16384))
    b1, b2 = layer_bytes("gdn", GDN, small, 2), layer_bytes("gdn", GDN, big, 2)
    assert b1["state"] == b2["state"] == 2 * 32 * 128 * 256 * 4  # 2 pieces, F and T, to 1 peer
    per_tok = 2 * 16 * 128 + 2 * 32 * 128 + 2 * 32  # q k, v and o, g beta
    assert b1["heads"] == 2048 * per_tok * 2 // 2 and b2["heads"] == 4 * b1["heads"]
    assert layer_bytes("gdn", GDN, small, 1) == dict(state=0, heads=0)
    m = layer_bytes("mamba2", MAMBA2, seq_pieces(4096, "contiguous", 4), 4)
    assert m["state"] == 1 * (128 * 64 * 128 + 128) * 4 * 3
    assert m["heads"] == 1024 * ((128 * 65 + 2 * 8 * 128) * 2 + 128 * 64 * 4) * 3 // 4


BYTES = [
    _fixed("gdn", 2, "zigzag", None, torch.float32, dict(hk=2, dk=8, dv=4),
           dict(use_qk_l2norm=True, chunk_size=4, scale=None), seq=24),
    _fixed("gdn", 4, "zigzag", (0, 9, 21), torch.bfloat16, dict(hk=2, dk=8, dv=4),
           dict(use_qk_l2norm=True, chunk_size=4, scale=None)),  # q/k repeated, float32
    _fixed("kda", 3, "contiguous", None, torch.float32, dict(hk=3, dk=4, dv=3),
           dict(use_qk_l2norm=False, chunk_size=8, scale=None), heads=3),
    _fixed("mamba2", 2, "zigzag", None, torch.bfloat16, dict(groups=1, p=3, nstate=4),
           dict(chunk_size=3, dt_softplus=True, dt_limit=(0.0, float("inf")))),  # B/C whole
    _fixed("mamba2", 2, "zigzag", (0, 3, 15), torch.float32, dict(groups=2, p=3, nstate=4),
           dict(chunk_size=3, dt_softplus=True, dt_limit=(0.0, float("inf")))),  # B/C split
    _fixed("selective", 4, "zigzag", None, torch.float32, dict(z=True, nstate=4),
           dict(softplus=True), seq=17),
]  # fmt: skip


def _dims(case):
    c = case
    if c["kind"] == "gdn":
        return dict(k_heads=c["hk"], v_heads=c["heads"], d_k=c["dk"], d_v=c["dv"])
    if c["kind"] == "kda":
        return dict(heads=c["heads"], d_k=c["dk"], d_v=c["dv"])
    if c["kind"] == "mamba2":
        return dict(heads=c["heads"], head_dim=c["p"], state=c["nstate"], groups=c["groups"])
    return dict(channels=case["heads"], state=case["nstate"], z=case["z"])


@pytest.mark.parametrize("case", BYTES, ids=lambda c: f"{c['kind']}-{c['n']}-{c['dtype']}")
def test_layer_bytes_are_what_is_sent(world, case):
    """``layer_bytes`` against the bytes each rank hands to torch.distributed in a forward."""
    dims = dict(_dims(case), batch=case["b"], itemsize=case["dtype"].itemsize)
    pieces = seq_pieces(case["seq"], case["layout"], case["n"], cu_seqlens=case["cu"])
    want = layer_bytes(case["kind"], dims, pieces, case["n"])
    got = world.check("tests.recurrent_heads_cases:sent_bytes", case["n"], case, tensors(case))
    assert all(g == want for g in got), (want, got)
    assert want["state"] > 0 and want["heads"] > 0


def test_choose_form():
    pieces = seq_pieces(4096, "zigzag", 2)
    assert choose_form("gdn", GDN, seq_pieces(4096, "zigzag", 1), 1) == "state"
    odd = dict(GDN, v_heads=6, k_heads=3)
    assert choose_form("gdn", odd, seq_pieces(4096, "zigzag", 4), 4) == "state"
    assert not heads_divide("gdn", dict(GDN, v_heads=6), 4) and heads_divide("gdn", GDN, 4)
    # the benchmark's layers (docs/performance.md): GDN runs by heads, Mamba2 by state passing
    bench_gdn = dict(k_heads=4, v_heads=8, d_k=128, d_v=128, itemsize=4)
    bench_m2 = dict(heads=8, head_dim=64, state=128, groups=1, itemsize=4)
    for s in (4096, 16384, 65536):  # both forms' costs grow as S/N: the choice keeps
        p = seq_pieces(s, "zigzag", 2)
        assert choose_form("gdn", bench_gdn, p, 2) == "heads"
        assert choose_form("mamba2", bench_m2, p, 2) == "state"
    assert choose_form("gdn", GDN, pieces, 2) == "heads"
    # a slow link (or fast compute) turns GDN to state passing, a fast link Mamba2 to heads
    assert choose_form("gdn", GDN, pieces, 2, link_bytes_per_s=1e7) == "state"
    assert choose_form("mamba2", bench_m2, pieces, 2, link_bytes_per_s=1e11) == "heads"
    with pytest.raises(ValueError, match="kind"):
        choose_form("conv", GDN, pieces, 2)
