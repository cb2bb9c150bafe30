"""Sequence-parallel short convolution, Mamba2 SSD scan and Mamba selective scan on a real gloo
world (1-4 ranks, contiguous and zigzag, packed and unpacked, short and empty chunks, fp32 and
bf16), forward and backward, against (a) float64 per-token recurrences written out here and (b)
transformers' own functions run on each whole document."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings, strategies as st
from transformers.models.bamba.modeling_bamba import causal_conv1d_fn, mamba2_chunk_scan
from transformers.models.jamba.modeling_jamba import mamba_selective_scan

from ringkv.kernels.scan_ref import causal_conv1d_ref, selective_scan_ref, ssd_scan_ref
from ringkv.sp.layout import granule, shard
from ringkv.sp.pieces import seq_pieces
from ringkv.sp.recurrent import causal_conv1d, mamba2_scan, selective_scan
from tests.dist import World
from tests.recurrent_cases import local_index, pieces_of

TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def world():
    w = World(4)
    yield w
    w.close()


# ---------------------------------------------------------------------------------------------
# cases


@st.composite
def seq_case(draw):
    """World, layout, documents (packed: cu_seqlens, batch 1) and dtype."""
    n = draw(st.integers(1, 4))
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(1, 11), min_size=1, max_size=3))
        cu = tuple(int(c) for c in torch.tensor([0] + lens).cumsum(0))
        seq, b = cu[-1], 1
    else:
        cu, seq, b = None, draw(st.integers(1, 19)), draw(st.integers(1, 2))
    return dict(
        n=n,
        layout=draw(st.sampled_from(["contiguous", "zigzag"])),
        cu=cu,
        seq=seq,
        b=b,
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        state=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _docs(case):
    cu = case["cu"] or (0, case["seq"])
    return list(zip(cu[:-1], cu[1:]))


def _close(name, got, want, dtype):
    tol = TOL[dtype]
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(
        got.double(), want.double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}"
    )


def _assemble(case, results, key, dim, shape):
    """Every rank's local rows of ``results[r][key]`` put back in sequence order ``shape``."""
    pieces = pieces_of(case, case["n"])
    out = None
    for r, res in enumerate(results):
        local = res[key] if key != "out" else res["out"]
        index = local_index(pieces, r, case["cu"])
        real = (index >= 0).nonzero().flatten()
        if local is None:  # no gradient: only where the rank holds no real row
            assert not len(real), f"{key}: no gradient on rank {r}, which holds real rows"
            continue
        if out is None:
            out = local.new_zeros(shape)
        out.index_copy_(dim % out.dim(), index[real], local.index_select(dim % out.dim(), real))
    return out


def _check(case, results, want, dims, shapes):
    """SP results (outputs, finals, gradients) against a reference ``want`` (same keys)."""
    dtype, tag = case["dtype"], f"{want['tag']} {case}"
    _close(
        "out " + tag,
        _assemble(case, results, "out", dims["out"], shapes["out"]),
        want["out"],
        dtype,
    )
    for r, res in enumerate(results):
        if case["state"]:
            assert set(res["finals"]) == set(want["finals"]), tag
            for d, f in res["finals"].items():
                _close(f"final of doc {d} on rank {r} {tag}", f, want["finals"][d], dtype)
    for name, g in want["grads"].items():
        if g is None:
            continue
        if name in dims:  # a sharded input: rows back in order
            got = _assemble(case, [res["grads"] for res in results], name, dims[name], g.shape)
        else:  # a parameter: every rank's part summed
            got = sum(res["grads"][name] for res in results)
        _close(f"grad {name} {tag}", got, g, dtype)


def _reference(fn, case, tensors, params, dout, dfinal, seq_dim):
    """Run ``fn(doc_tensors, params) -> (out, final)`` per document on leaves (copies of
    ``tensors`` and ``params``), backward of the same loss as the cases; returns out, finals and
    the leaves' gradients."""
    leaves = {
        k: None if v is None else v.detach().clone().requires_grad_()
        for k, v in {**tensors, **params}.items()
    }
    outs, finals = [], {}
    for d, (a, b) in enumerate(_docs(case)):
        doc = {
            k: None if leaves[k] is None else leaves[k].narrow(seq_dim[k], a, b - a)
            for k in tensors
        }
        out, finals[d] = fn(doc, {k: leaves[k] for k in params})
        outs.append(out)
    out = torch.cat(outs, seq_dim["out"])
    loss = (out.double() * dout.double()).sum()
    if case["state"]:
        loss = loss + sum((finals[d].double() * dfinal[d].double()).sum() for d in finals)
    loss.backward()
    grads = {k: None if v is None else v.grad for k, v in leaves.items()}
    return dict(out=out.detach(), finals={d: f.detach() for d, f in finals.items()}, grads=grads)


def _to64(d):
    return {k: None if v is None else v.double() for k, v in d.items()}


# ---------------------------------------------------------------------------------------------
# float64 per-token recurrences


def conv_recurrence(x, weight, bias, activation):
    """x (B, C, L) one document -> out (B, C, L), tail (B, C, K): token by token."""
    k, outs = weight.shape[-1], []
    for t in range(x.shape[-1]):
        acc = torch.zeros_like(x[..., 0]) + (0 if bias is None else bias)
        for j in range(k):
            if t - (k - 1) + j >= 0:
                acc = acc + weight[:, j] * x[..., t - (k - 1) + j]
        outs.append(F.silu(acc) if activation else acc)
    tail = F.pad(x, (k, 0))[..., -k:]
    return torch.stack(outs, -1), tail


def ssd_recurrence(x, dt, A, B, C, D):
    """x (B, L, H, P), dt processed (B, L, H), B/C (B, L, G, N) -> y, final (B, H, P, N)."""
    rep = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + (
            (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        )
        y = torch.einsum("bhpn,bhn->bhp", h, C[:, t])
        ys.append(y if D is None else y + D[:, None] * x[:, t])
    return torch.stack(ys, 1), h


def selective_recurrence(x, dt, A, B, C, D, z):
    """x/dt/z (B, D, L), dt processed, A (D, N), B/C (B, N, L) -> y (B, D, L), final (B, D, N)."""
    h = x.new_zeros(x.shape[0], x.shape[1], A.shape[1])
    ys = []
    for t in range(x.shape[-1]):
        h = (
            torch.exp(dt[..., t, None] * A) * h
            + (dt[..., t] * x[..., t])[..., None] * B[:, None, :, t]
        )
        y = (h * C[:, None, :, t]).sum(-1)
        y = y if D is None else y + D * x[..., t]
        ys.append(y if z is None else y * F.silu(z[..., t]))
    return torch.stack(ys, -1), h


# ---------------------------------------------------------------------------------------------
# the convolution


@st.composite
def conv_case(draw):
    case = draw(seq_case())
    case.update(
        c=draw(st.sampled_from([1, 3])),
        k=draw(st.sampled_from([1, 2, 3, 4])),
        activation=draw(st.sampled_from([None, "silu"])),
        bias=draw(st.booleans()),
    )
    return case


def _conv_tensors(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, c, s, k, dtype = case["b"], case["c"], case["seq"], case["k"], case["dtype"]
    return dict(
        x=torch.randn(b, c, s, generator=g).to(dtype),
        weight=torch.randn(c, k, generator=g).to(dtype),
        bias=torch.randn(c, generator=g).to(dtype) if case["bias"] else None,
        dout=torch.randn(b, c, s, generator=g),
        dfinal={d: torch.randn(b, c, k, generator=g) for d in range(len(_docs(case)))},
    )


def _conv_refs(case, t):
    seq_dim = dict(x=-1, out=-1)
    args = (case, dict(x=t["x"]), dict(weight=t["weight"], bias=t["bias"]), t["dout"], t["dfinal"])

    def rec(doc, p):
        return conv_recurrence(doc["x"], p["weight"], p["bias"], case["activation"])

    def hf(doc, p):
        out = causal_conv1d_fn(doc["x"], p["weight"], p["bias"], activation=case["activation"])
        return out, F.pad(doc["x"], (case["k"], 0))[..., -case["k"] :]

    a = _reference(rec, *args[:1], _to64(args[1]), _to64(args[2]), *args[3:], seq_dim)
    return [dict(a, tag="float64 recurrence"), dict(_reference(hf, *args, seq_dim), tag="hf")]


@SETTINGS
@example(
    case=dict(
        n=4,
        layout="zigzag",
        cu=None,
        seq=5,
        b=1,
        dtype=torch.float32,
        state=True,
        seed=1,
        c=3,
        k=4,
        activation="silu",
        bias=True,
    )
)
@example(
    case=dict(
        n=3,
        layout="zigzag",
        cu=(0, 2, 9, 10),
        seq=10,
        b=1,
        dtype=torch.float32,
        state=False,
        seed=2,
        c=3,
        k=4,
        activation=None,
        bias=False,
    )
)
@given(case=conv_case())
def test_causal_conv1d(world, case):
    t = _conv_tensors(case)
    results = world.check("tests.recurrent_cases:conv", case["n"], case, t, timeout=300)
    shape = t["x"].shape
    for want in _conv_refs(case, t):
        _check(case, results, want, dict(out=-1, x=-1), dict(out=shape))


# ---------------------------------------------------------------------------------------------
# Mamba2 SSD


@st.composite
def ssd_case(draw):
    case = draw(seq_case())
    groups = draw(st.sampled_from([1, 2]))
    case.update(
        h=groups * draw(st.sampled_from([1, 2])),
        groups=groups,
        p=draw(st.sampled_from([1, 3])),
        nstate=draw(st.sampled_from([1, 4])),
        chunk=draw(st.sampled_from([1, 2, 3, 8])),
        D=draw(st.booleans()),
        dt_bias=draw(st.booleans()),
        softplus=draw(st.booleans()),
        limit=draw(st.sampled_from([(0.0, float("inf")), (0.05, 1.5)])),
    )
    return case


def _ssd_tensors(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, s, h, p, n, gr = case["b"], case["seq"], case["h"], case["p"], case["nstate"], case["groups"]
    dtype = case["dtype"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        x=rnd(b, s, h, p).to(dtype),
        dt=(rnd(b, s, h) * 0.5 + (0 if case["softplus"] else 0.7)).abs().to(dtype),
        B=rnd(b, s, gr, n).to(dtype),
        C=rnd(b, s, gr, n).to(dtype),
        A=-torch.rand(h, generator=g) * 2,
        D=rnd(h) if case["D"] else None,
        dt_bias=rnd(h) * 0.3 if case["dt_bias"] else None,
        dout=rnd(b, s, h, p),
        dfinal={d: rnd(b, h, p, n) for d in range(len(_docs(case)))},
    )


def _ssd_refs(case, t):
    seq_dim = dict(x=1, dt=1, B=1, C=1, out=1)
    tensors = {k: t[k] for k in ("x", "dt", "B", "C")}
    params = {k: t[k] for k in ("A", "D", "dt_bias")}

    def rec(doc, p):
        # dt processed in the input dtype, as transformers does (dt + dt_bias.to(dt.dtype)): in
        # bf16 a value rounded across the clamp's limit would otherwise flip its gradient
        dt, bias = doc["dt"].to(case["dtype"]), p["dt_bias"]
        dt = dt + (0 if bias is None else bias.to(dt.dtype))
        dt = (F.softplus(dt) if case["softplus"] else dt).clamp(*case["limit"]).double()
        return ssd_recurrence(doc["x"], dt, p["A"], doc["B"], doc["C"], p["D"])

    def hf(doc, p):
        return mamba2_chunk_scan(
            doc["x"],
            doc["dt"],
            p["A"],
            doc["B"],
            doc["C"],
            case["chunk"],
            D=p["D"],
            dt_bias=p["dt_bias"],
            dt_softplus=case["softplus"],
            dt_limit=case["limit"],
            return_final_states=True,
        )

    a = _reference(rec, case, _to64(tensors), _to64(params), t["dout"], t["dfinal"], seq_dim)
    b = _reference(hf, case, tensors, params, t["dout"], t["dfinal"], seq_dim)
    return [dict(a, tag="float64 recurrence"), dict(b, tag="hf")]


@SETTINGS
@example(
    case=dict(
        n=4,
        layout="zigzag",
        cu=(0, 3, 12),
        seq=12,
        b=1,
        dtype=torch.float32,
        state=True,
        seed=3,
        h=4,
        groups=2,
        p=3,
        nstate=4,
        chunk=2,
        D=True,
        dt_bias=True,
        softplus=True,
        limit=(0.0, float("inf")),
    )
)
@example(
    case=dict(
        n=2,
        layout="contiguous",
        cu=None,
        seq=1,
        b=1,
        dtype=torch.float32,
        state=False,
        seed=5,
        h=2,
        groups=1,
        p=3,
        nstate=4,
        chunk=8,
        D=True,
        dt_bias=True,
        softplus=True,
        limit=(0.0, float("inf")),
    )
)  # rank 1: pad only
@example(
    case=dict(
        n=3,
        layout="zigzag",
        cu=None,
        seq=17,
        b=2,
        dtype=torch.float32,
        state=True,
        seed=6,
        h=2,
        groups=2,
        p=3,
        nstate=4,
        chunk=3,
        D=False,
        dt_bias=False,
        softplus=False,
        limit=(0.05, 1.5),
    )
)
@example(
    case=dict(
        n=1,
        layout="contiguous",
        cu=None,
        seq=11,
        b=1,
        dtype=torch.bfloat16,
        state=False,
        seed=830,
        h=2,
        groups=1,
        p=1,
        nstate=4,
        chunk=1,
        D=True,
        dt_bias=True,
        softplus=False,
        limit=(0.05, 1.5),
    )
)  # bf16 dt + dt_bias rounded across the clamp's limit (the oracle once added them in float64)
@given(case=ssd_case())
def test_mamba2_scan(world, case):
    t = _ssd_tensors(case)
    results = world.check("tests.recurrent_cases:ssd", case["n"], case, t, timeout=300)
    dims = dict(out=1, x=1, dt=1, B=1, C=1)
    for want in _ssd_refs(case, t):
        _check(case, results, want, dims, dict(out=t["x"].shape))


# ---------------------------------------------------------------------------------------------
# Mamba selective scan


@st.composite
def selective_case(draw):
    case = draw(seq_case())
    case.update(
        d=draw(st.sampled_from([1, 3])),
        nstate=draw(st.sampled_from([1, 4])),
        D=draw(st.booleans()),
        z=draw(st.booleans()),
        delta_bias=draw(st.booleans()),
        softplus=draw(st.booleans()),
    )
    return case


def _selective_tensors(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, d, s, n, dtype = case["b"], case["d"], case["seq"], case["nstate"], case["dtype"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        x=rnd(b, d, s).to(dtype),
        dt=(rnd(b, d, s) * 0.5 + (0 if case["softplus"] else 0.7)).abs().to(dtype),
        B=rnd(b, n, s).to(dtype),
        C=rnd(b, n, s).to(dtype),
        z=rnd(b, d, s).to(dtype) if case["z"] else None,
        A=-torch.rand(d, n, generator=g) * 2,
        D=rnd(d) if case["D"] else None,
        delta_bias=rnd(d) * 0.3 if case["delta_bias"] else None,
        dout=rnd(b, d, s),
        dfinal={i: rnd(b, d, n) for i in range(len(_docs(case)))},
    )


def _selective_refs(case, t):
    seq_dim = dict(x=-1, dt=-1, B=-1, C=-1, z=-1, out=-1)
    tensors = {k: t[k] for k in ("x", "dt", "B", "C", "z")}
    params = {k: t[k] for k in ("A", "D", "delta_bias")}

    def rec(doc, p):
        dt = doc["dt"] + (0 if p["delta_bias"] is None else p["delta_bias"][:, None])
        dt = F.softplus(dt) if case["softplus"] else dt
        return selective_recurrence(doc["x"], dt, p["A"], doc["B"], doc["C"], p["D"], doc["z"])

    def hf(doc, p):
        return mamba_selective_scan(
            doc["x"],
            doc["dt"],
            p["A"],
            doc["B"],
            doc["C"],
            D=p["D"],
            z=doc["z"],
            delta_bias=p["delta_bias"],
            delta_softplus=case["softplus"],
            return_last_state=True,
        )

    a = _reference(rec, case, _to64(tensors), _to64(params), t["dout"], t["dfinal"], seq_dim)
    b = _reference(hf, case, tensors, params, t["dout"], t["dfinal"], seq_dim)
    return [dict(a, tag="float64 recurrence"), dict(b, tag="hf")]


@SETTINGS
@example(
    case=dict(
        n=2,
        layout="contiguous",
        cu=None,
        seq=9,
        b=2,
        dtype=torch.float32,
        state=False,
        seed=4,
        d=3,
        nstate=4,
        D=True,
        z=True,
        delta_bias=True,
        softplus=True,
    )
)
@example(
    case=dict(
        n=4,
        layout="contiguous",
        cu=None,
        seq=3,
        b=1,
        dtype=torch.bfloat16,
        state=True,
        seed=7,
        d=3,
        nstate=4,
        D=True,
        z=False,
        delta_bias=False,
        softplus=True,
    )
)  # rank 3: pad only
@given(case=selective_case())
def test_selective_scan(world, case):
    t = _selective_tensors(case)
    results = world.check("tests.recurrent_cases:selective", case["n"], case, t, timeout=300)
    dims = dict(out=-1, x=-1, dt=-1, B=-1, C=-1, z=-1)
    for want in _selective_refs(case, t):
        _check(case, results, want, dims, dict(out=t["x"].shape))


# ---------------------------------------------------------------------------------------------
# references, errors, no process group


def test_references_carry_state_across_a_split():
    """Each reference from an initial state continues the whole run exactly."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 13, generator=g), torch.randn(3, 4, generator=g)
    whole = causal_conv1d_ref(x, w, None, "silu")
    torch.testing.assert_close(
        causal_conv1d_ref(x[..., 5:], w, None, "silu", x[..., 2:5]), whole[..., 5:]
    )
    xs, dt, B, C = (torch.randn(2, 13, 2, k, generator=g) for k in (3, 1, 4, 4))
    dt, A = dt[..., 0].abs(), -torch.rand(2, generator=g)
    y, f = ssd_scan_ref(xs, dt, A, B, C, 4)
    y1, f1 = ssd_scan_ref(xs[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], 4)
    y2, f2 = ssd_scan_ref(xs[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], 3, f1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(f2, f)
    xs, dt, Bs, Cs = (torch.randn(2, k, 13, generator=g) for k in (3, 3, 4, 4))
    A = -torch.rand(3, 4, generator=g)
    y, f = selective_scan_ref(xs, dt.abs(), A, Bs, Cs)
    y1, f1 = selective_scan_ref(xs[..., :6], dt[..., :6].abs(), A, Bs[..., :6], Cs[..., :6])
    y2, f2 = selective_scan_ref(xs[..., 6:], dt[..., 6:].abs(), A, Bs[..., 6:], Cs[..., 6:], f1, 5)
    torch.testing.assert_close(torch.cat([y1, y2], -1), y)
    torch.testing.assert_close(f2, f)


def test_no_process_group_is_one_rank():
    """``group=None`` without torch.distributed: one rank, no communication, packed docs."""
    cu = (0, 5, 12)
    pieces = seq_pieces(0, "zigzag", 1, cu_seqlens=cu)
    index = local_index(pieces, 0, cu)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 3, 12, generator=g), torch.randn(3, 3, generator=g)
    xl = torch.cat([x, torch.zeros(1, 3, 1)], -1)[..., torch.where(index < 0, 12, index)]
    out, tails = causal_conv1d(xl, w, pieces=pieces, return_tail=True)
    want = torch.cat([causal_conv1d_fn(x[..., a:b], w) for a, b in zip(cu[:-1], cu[1:])], -1)
    torch.testing.assert_close(out[..., index >= 0], want[..., index[index >= 0]])
    torch.testing.assert_close(tails[1], x[..., 9:12])


@pytest.mark.parametrize(
    "what, words",
    [
        ("conv", "weight must have shape (3, *)"),
        ("rows", "local sequence has"),
        ("selective", "B must have shape"),
    ],
)
def test_bad_shapes_raise_before_any_collective(world, what, words):
    for msg in world.check("tests.recurrent_cases:bad_call", 2, what):
        assert msg is not None and words in msg, msg


def test_ranks_that_disagree_all_raise(world):
    for msg in world.check("tests.recurrent_cases:disagree", 2):
        assert msg is not None and "disagrees" in msg and "batch" in msg, msg


def test_inputs_without_grad_build_no_graph():
    """Nothing needs a gradient: no graph (a frozen model's inference keeps no activations)."""
    pieces = seq_pieces(7, "zigzag", 1)
    x, dt = torch.randn(1, 8, 2, 3), torch.rand(1, 8, 2)
    y = mamba2_scan(
        x,
        dt,
        -torch.rand(2),
        torch.randn(1, 8, 1, 4),
        torch.randn(1, 8, 1, 4),
        chunk_size=4,
        pieces=pieces,
    )
    assert not y.requires_grad
    x, dt = torch.randn(1, 3, 8), torch.rand(1, 3, 8)
    y = selective_scan(
        x, dt, -torch.rand(3, 2), torch.randn(1, 2, 8), torch.randn(1, 2, 8), pieces=pieces
    )
    assert not y.requires_grad


@settings(max_examples=25, deadline=None)
@given(case=seq_case())
def test_rows_by_pieces_are_the_layouts_shard(case):
    """The cases' rows (chosen by the pieces) are ``layout.shard``'s, pad rows aside."""
    s = case["seq"]
    x = torch.arange(1, s + 1, dtype=torch.float32)[None, :, None]  # (1, S, 1), no zero
    pieces = pieces_of(case, case["n"])
    for r in range(case["n"]):
        index = local_index(pieces, r, case["cu"])
        if case["cu"] is None:
            g = granule(case["layout"], case["n"])
            padded = torch.cat([x, x.new_zeros(1, -(-s // g) * g - s, 1)], 1)
            want = shard(padded, 1, case["layout"], rank=r, world=case["n"])
        else:
            want = shard(x, 1, case["layout"], rank=r, world=case["n"], cu_seqlens=case["cu"])
        got = torch.where(index < 0, 0, index + 1).float()[None, :, None]
        torch.testing.assert_close(got, want)


def test_a_continued_document_and_the_state_after_every_piece():
    """``initial_state`` continues a document (an engine's later chunk) and ``"pieces"`` gives
    the state after every piece (its checkpoints): both equal the references run from that
    state, for the convolution, the SSD scan and the gated delta rule (one rank: the fold is
    the same code as across ranks). Doc 0 (11 tokens, continued) is cut at 4 and 5, then pad
    rows, then doc 1 (6 tokens, fresh)."""
    from ringkv.kernels.delta_ref import gated_delta_ref
    from ringkv.kernels.scan_ref import process_dt
    from ringkv.sp.delta import gated_delta_rule
    from ringkv.sp.pieces import Piece, Pieces

    spans = [(0, 0, 4), (0, 4, 5), (0, 5, 11), (-1, 0, 2), (1, 0, 6)]  # (doc, start, stop)
    ps, row = [], 0
    for doc, a, b in spans:
        ps.append(Piece(0, range(row, row + b - a), doc, a))
        row += b - a
    pieces = Pieces(1, (tuple(ps),), (11, 6))
    doc0, ends = slice(0, 11), (4, 5, 11)
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def close(got, want):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    x, w, halo = rnd(1, 3, row), rnd(3, 4), rnd(1, 3, 3)
    out, tails = causal_conv1d(
        x, w, None, "silu", pieces=pieces, initial_state={0: halo}, return_tail="pieces"
    )
    close(out[..., doc0], causal_conv1d_ref(x[..., doc0], w, None, "silu", halo))
    seen = torch.cat([halo, x[..., doc0]], -1)
    for e in ends:
        close(tails[(0, e)], seen[..., e - 1 : e + 3])
    close(tails[(1, 6)], x[..., row - 4 : row])

    xs, dt, B, C = rnd(1, row, 2, 3), rnd(1, row, 2), rnd(1, row, 1, 4), rnd(1, row, 1, 4)
    A, D, h0 = -rnd(2).abs(), rnd(2), rnd(1, 2, 3, 4)
    y, after = mamba2_scan(
        xs, dt, A, B, C, chunk_size=3, D=D, dt_softplus=True, pieces=pieces,
        initial_state={0: h0}, return_final_state="pieces",
    )  # fmt: skip
    dtp = process_dt(dt, None, True)
    for e in ends:
        want, h = ssd_scan_ref(xs[:, :e], dtp[:, :e], A, B[:, :e].expand(-1, -1, 2, -1),
                               C[:, :e].expand(-1, -1, 2, -1), 3, initial_state=h0)  # fmt: skip
        close(after[(0, e)], h.float())
    close(y[:, doc0], want + D[:, None] * xs[:, doc0])

    q, k, v = rnd(1, row, 1, 4), rnd(1, row, 1, 4), rnd(1, row, 2, 3)
    gd, beta, s0 = -rnd(1, row, 2).abs(), rnd(1, row, 2).sigmoid(), rnd(1, 2, 4, 3)
    o, after = gated_delta_rule(
        q, k, v, gd, beta, use_qk_l2norm=True, chunk_size=3, pieces=pieces,
        initial_state={0: s0}, return_final_state="pieces",
    )  # fmt: skip
    for e in ends:
        want, h = gated_delta_ref(q[:, :e], k[:, :e], v[:, :e], gd[:, :e], beta[:, :e], None,
                                  s0, 3, use_qk_l2norm=True)  # fmt: skip
        close(after[(0, e)], h.float())
    close(o[:, doc0], want)
