"""Paged attention's features (issue #42): ``softcap``, a sliding ``window`` on global positions (SP
striping included), a V cache whose head size ``Dv`` differs from K's, ``scale``, and ``sinks``
on the entry points, on every paged backend (``"reference"``, ``"torch"``, ``"triton"`` in the
CPU interpreter or on CUDA, ``"cpu"`` / ``"auto"``) and every call shape (``paged_attention``,
``paged_prefill``, ``plan_step(...).attend``).

The oracle is float64 math written out here: each sequence's keys gathered from the cache by
position (block ``table[t // block_size]``, slot ``t % block_size``, dequantized when the cache is
quantized), scores scaled, capped, masked by causality and window on global positions, softmax.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton (and ringkv) import it

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ringkv.kernels import paged, quant
from ringkv.kernels.paged import LayerCache, PagedSeq, paged_attention, paged_prefill, plan_step
from tests.checks import assert_close

try:
    import triton  # noqa: F401
    from ringkv.kernels import triton_paged
except ImportError:
    triton_paged = None

HAVE_TRITON = triton_paged is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYP = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
TOL = 2e-5  # float32 against float64: max error relative to 1 + max |oracle|
QUANT_NAMES = [None, None, "int8"] + (["fp8_e4m3"] if "fp8_e4m3" in quant.FORMATS else [])
CAPS = st.one_of(st.none(), st.floats(1.0, 5.0), st.just(50.0))
WINDOWS = st.sampled_from([-1, -1, 0, 1, 3, 9, 200])


# ----------------------------------------------------------------------------- problems and oracle


class Problem:
    """Sequences of ``total[i]`` tokens whose last ``new[i]`` are the queries; the cache holds SP
    rank ``sp_rank``'s share of each (global positions ``sp_rank, sp_rank + sp, ...``) in shuffled,
    non-contiguous blocks; ``k_val``/``v_val``: the cache's values as float64 (dequantized)."""

    def __init__(self, p, device="cpu"):
        self.p = p
        g = torch.Generator().manual_seed(p["seed"])
        sp, r, bs, hkv, d, dv = p["sp"], p["sp_rank"], p["bs"], p["hkv"], p["d"], p["dv"]
        self.local = [len(range(r, t, sp)) for t in p["total"]]  # keys stored here
        per_seq = [-(-n // bs) + p["spare"] for n in self.local]
        num_blocks = sum(per_seq) + 2
        k = torch.randn(num_blocks, bs, hkv, d, generator=g)
        v = torch.randn(num_blocks, bs, hkv, dv, generator=g)
        self.k_scale = self.v_scale = None
        if p["quant"]:
            fmt = quant.FORMATS[p["quant"]]
            (k, self.k_scale), (v, self.v_scale) = (
                quant.quantize(k, fmt, quant.rotation(d)),
                quant.quantize(v, fmt, quant.rotation(dv)),
            )
            self.k_val, self.v_val = (
                quant.dequantize(k, self.k_scale).double(),
                quant.dequantize(v, self.v_scale).double(),
            )
        else:
            self.k_val, self.v_val = k.double(), v.double()
        perm = torch.randperm(num_blocks, generator=g)
        self.table = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(per_seq):
            self.table[i, :nb] = perm[used : used + nb]
            used += nb
        self.q = (
            torch.randn(sum(p["new"]), p["h"], d, generator=g) * p["spread"]
        )  # (T, H, D) packed
        self.cu = [0] + torch.tensor(p["new"]).cumsum(0).tolist()
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.dev = dict(
            q=to(self.q),
            k=to(k),
            v=to(v),
            table=to(self.table),
            k_scale=to(self.k_scale),
            v_scale=to(self.v_scale),
        )
        self.cache = LayerCache(
            self.dev["k"], self.dev["v"], self.dev["k_scale"], self.dev["v_scale"]
        )

    def keys(self, i):
        """Sequence ``i``'s K ``(L, Hkv, D)``, V ``(L, Hkv, Dv)`` float64 and their global positions
        ``(L,)``, read from the cache slot by slot."""
        t = torch.arange(self.local[i])
        blocks = self.table[i, t // self.p["bs"]].long()
        slots = t % self.p["bs"]
        return (
            self.k_val[blocks, slots],
            self.v_val[blocks, slots],
            t * self.p["sp"] + self.p["sp_rank"],
        )


def oracle(q, k, v, q_pos, k_pos, *, causal, window, scale, softcap, sinks=None):
    """float64 attention of ``q (S, H, D)`` over ``k (L, Hkv, D)``, ``v (L, Hkv, Dv)``:
    ``out (S, H, Dv)``,
    ``lse (H, S)`` over the real keys; with ``sinks`` ``(H,)`` the output has them in its
    denominator."""
    h, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)  # (L, H, .)
    s = torch.einsum("shd,lhd->hsl", q.double(), kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, S)
    denom = lse if sinks is None else torch.logaddexp(lse, sinks.double()[:, None])
    p = torch.exp(s - torch.where(torch.isinf(denom), 0, denom)[..., None])
    return torch.einsum("hsl,lhd->shd", p, vv), lse


def expected(prob, *, causal=True, window=-1, softcap=None, scale=None, sinks=None):
    """The oracle's ``out (T, H, Dv)``, ``lse (H, T)`` of every query row of ``prob``."""
    p = prob.p
    scale = p["d"] ** -0.5 if scale is None else scale
    out = torch.zeros(prob.q.shape[0], p["h"], p["dv"], dtype=torch.float64)
    lse = torch.full((p["h"], prob.q.shape[0]), float("-inf"), dtype=torch.float64)
    for i, (a, b) in enumerate(zip(prob.cu, prob.cu[1:])):
        k, v, k_pos = prob.keys(i)
        q_pos = torch.arange(p["total"][i] - (b - a), p["total"][i])
        out[a:b], lse[:, a:b] = oracle(
            prob.q[a:b],
            k,
            v,
            q_pos,
            k_pos,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
        )
    return out, lse


@st.composite
def problems(draw, *, same_new=False, sp=True):
    """Block sizes, lengths (0, 1, across blocks and tiles), query counts (decode 1, chunks), GQA,
    ``D`` and ``Dv`` (smaller, equal, larger), SP striping (each rank), quantized caches."""
    n = draw(st.integers(1, 3))
    d = draw(st.sampled_from([16, 32]))
    hkv = draw(st.sampled_from([1, 2]))
    if same_new:
        new = [draw(st.sampled_from([1, 1, 2, 5]))] * n
    else:
        new = draw(st.lists(st.sampled_from([0, 1, 1, 3, 17]), min_size=n, max_size=n))
    prefix = draw(st.lists(st.sampled_from([0, 1, 4, 13, 40]), min_size=n, max_size=n))
    s = draw(st.sampled_from([1, 1, 2, 3])) if sp else 1
    return dict(
        n=n,
        bs=draw(st.sampled_from([3, 4, 16])),
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 2, 3])),
        d=d,
        dv=draw(st.sampled_from([8, d, 24, 48])),
        new=new,
        total=[a + b for a, b in zip(prefix, new)],
        sp=s,
        sp_rank=draw(st.integers(0, s - 1)),
        spare=draw(st.sampled_from([0, 1])),
        quant=draw(st.sampled_from(QUANT_NAMES)),
        spread=draw(st.sampled_from([1.0, 4.0])),
        seed=draw(st.integers(0, 2**16)),
    )


# ----------------------------------------------------------------------------- decode layout


def decode_backends():
    names = ["reference", "torch", "cpu", "auto"]
    return names + (["triton"] if HAVE_TRITON else [])


@HYP
@given(
    p=problems(same_new=True, sp=False),
    causal=st.booleans(),
    softcap=CAPS,
    window=WINDOWS,
    scale=st.sampled_from([None, 0.3]),
    splits=st.sampled_from([None, 3]),
)
def test_paged_attention_features(p, causal, softcap, window, scale, splits):
    """``paged_attention`` (``(N, Q, H, D)``: the queries the last ``Q`` of each sequence's keys) on
    every backend against the oracle; ``"cpu"`` runs float32 only (else falls back) and, where it
    cannot take a feature, is refused with a ValueError naming it."""
    prob = Problem(p, DEVICE)
    n, nq = p["n"], p["new"][0]
    q = prob.dev["q"].view(n, nq, p["h"], p["d"])
    lens = torch.tensor(prob.local, dtype=torch.int32, device=DEVICE)
    want_o, want_l = expected(prob, causal=causal, window=window, softcap=softcap, scale=scale)
    want_o, want_l = want_o.view(n, nq, p["h"], p["dv"]), want_l.view(p["h"], n, nq).transpose(0, 1)
    kw = dict(
        causal=causal,
        softcap=softcap,
        window=window,
        scale=scale,
        k_scale=prob.dev["k_scale"],
        v_scale=prob.dev["v_scale"],
    )
    used = paged._used(softcap=softcap, window=window, dv=p["dv"] != p["d"])
    for backend in decode_backends():
        if backend == "cpu" and DEVICE != "cpu":
            continue
        if backend == "cpu" and not used <= paged.features("cpu", "decode"):
            with pytest.raises(ValueError, match="cannot take"):
                paged_attention(
                    q, prob.dev["k"], prob.dev["v"], prob.dev["table"], lens, backend=backend, **kw
                )
            continue
        out, lse = paged_attention(
            q, prob.dev["k"], prob.dev["v"], prob.dev["table"], lens, backend=backend, **kw
        )
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        assert_close(f"{backend} out", out, want_o, TOL)
        assert_close(f"{backend} lse", lse, want_l, TOL)
    if HAVE_TRITON and splits:  # the flash-decoding kernel for any Q, its key range split
        out, lse = triton_paged.paged_attention_triton(
            q, prob.dev["k"], prob.dev["v"], prob.dev["table"], lens, num_splits=splits, **kw
        )
        assert_close("triton split out", out, want_o, TOL)
        assert_close("triton split lse", lse, want_l, TOL)


# ----------------------------------------------------------------------------- varlen prefill


@HYP
@given(
    p=problems(),
    causal=st.booleans(),
    softcap=CAPS,
    window=WINDOWS,
    scale=st.sampled_from([None, 0.3]),
)
def test_paged_prefill_features(p, causal, softcap, window, scale):
    """``paged_prefill`` (packed queries, explicit positions, SP-striped keys) on the reference and
    Triton backends against the oracle."""
    prob = Problem(p, DEVICE)
    ints = dict(dtype=torch.int32, device=DEVICE)
    args = (
        prob.dev["q"],
        prob.dev["k"],
        prob.dev["v"],
        prob.dev["table"],
        torch.tensor(prob.cu, **ints),
        torch.tensor(prob.local, **ints),
    )
    kw = dict(
        max_seqlen_q=max(p["new"]),
        q_start=torch.tensor([t - n for t, n in zip(p["total"], p["new"])], **ints),
        causal=causal,
        sp=p["sp"],
        sp_rank=p["sp_rank"],
        k_scale=prob.dev["k_scale"],
        v_scale=prob.dev["v_scale"],
        softcap=softcap,
        window=window,
        scale=scale,
    )
    want_o, want_l = expected(prob, causal=causal, window=window, softcap=softcap, scale=scale)
    for backend in ["reference", "auto"] + (["triton"] if HAVE_TRITON else []):
        out, lse = paged_prefill(*args, backend=backend, **kw)
        assert out.dtype == args[0].dtype and lse.shape == want_l.shape
        assert_close(f"{backend} out", out, want_o, TOL)
        assert_close(f"{backend} lse", lse, want_l, TOL)


# ----------------------------------------------------------------------------- engine steps


def step_backends():
    return ["reference", "torch", "cpu", "auto"] + (["triton"] if HAVE_TRITON else [])


@HYP
@given(
    p=problems(),
    softcap=CAPS,
    window=WINDOWS,
    scale=st.sampled_from([None, 0.3]),
    with_lse=st.booleans(),
)
@example(
    p=dict(
        n=1,
        bs=3,
        hkv=1,
        h=1,
        d=16,
        dv=8,
        new=[1],
        total=[1],
        sp=2,
        sp_rank=1,
        spare=0,
        quant=None,
        spread=1.0,
        seed=0,
    ),
    softcap=None,
    window=-1,
    scale=None,
    with_lse=False,
)  # no key on this rank
def test_plan_step_attend_features(p, softcap, window, scale, with_lse):
    """``plan_step(...).attend(q, cache, lse=..., scale=, softcap=, window=)``: decode rows and
    chunks of one step, over one SP rank's striped share, on every backend, row by row against the
    oracle (causal on global positions: a row that sees no key here has out 0, lse -inf)."""
    prob = Problem(p, DEVICE)
    seqs = [
        PagedSeq(row=a, start=t - (b - a), n=b - a, block_table=prob.table[i].tolist())
        for i, (a, b, t) in enumerate(zip(prob.cu, prob.cu[1:], p["total"]))
        if b > a
    ]
    want_o, want_l = expected(prob, window=window, softcap=softcap, scale=scale)
    for backend in step_backends():
        step = plan_step(
            seqs,
            block_size=p["bs"],
            sp=p["sp"],
            sp_rank=p["sp_rank"],
            device=DEVICE,
            backend=backend,
        )
        parts = step.attend(
            prob.dev["q"], prob.cache, lse=with_lse, scale=scale, softcap=softcap, window=window
        )
        rows = (
            torch.cat([part.rows.cpu() for part in parts])
            if parts
            else torch.zeros(0, dtype=torch.long)
        )
        assert sorted(rows.tolist()) == list(range(prob.q.shape[0])), f"{backend}: every row once"
        for part in parts:
            r = part.rows.cpu()
            assert_close(f"{backend} out", part.out, want_o[r], TOL)
            if with_lse:
                assert_close(f"{backend} lse", part.lse, want_l[:, r], TOL)


# ----------------------------------------------------------------------------- sinks


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    p=problems(same_new=True, sp=False),
    softcap=CAPS,
    window=WINDOWS,
    sink=st.sampled_from([-30.0, -1.0, 0.0, 2.0, 30.0]),
)
def test_sinks_on_the_entry_points(p, softcap, window, sink):
    """``sinks`` ``(H,)`` (large negatives and positives): ``out`` has one more logit per head in
    its denominator, ``lse`` stays over the real keys; decode layout and varlen prefill."""
    prob = Problem(p, DEVICE)
    n, nq, h = p["n"], p["new"][0], p["h"]
    sinks = (torch.linspace(-1.0, 1.0, h) + sink).to(DEVICE)
    want_o, want_l = expected(prob, window=window, softcap=softcap, sinks=sinks.cpu())
    ints = dict(dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(prob.local, **ints)
    scales = dict(k_scale=prob.dev["k_scale"], v_scale=prob.dev["v_scale"])
    for backend in ["reference", "auto"] + (["triton"] if HAVE_TRITON else []):
        out, lse = paged_attention(
            prob.dev["q"].view(n, nq, h, p["d"]),
            prob.dev["k"],
            prob.dev["v"],
            prob.dev["table"],
            lens,
            softcap=softcap,
            window=window,
            sinks=sinks,
            backend=backend,
            **scales,
        )
        assert_close(f"{backend} out", out, want_o.view(n, nq, h, -1), TOL)
        assert_close(f"{backend} lse (real keys)", lse, want_l.view(h, n, nq).transpose(0, 1), TOL)
        out, lse = paged_prefill(
            prob.dev["q"],
            prob.dev["k"],
            prob.dev["v"],
            prob.dev["table"],
            torch.tensor(prob.cu, **ints),
            lens,
            max_seqlen_q=nq,
            softcap=softcap,
            window=window,
            sinks=sinks,
            backend=backend,
            **scales,
        )
        assert_close(f"{backend} prefill out", out, want_o, TOL)
        assert_close(f"{backend} prefill lse (real keys)", lse, want_l, TOL)


# ----------------------------------------------------------------------------- bad input

N, BS, NB, H, HKV, D = 2, 4, 8, 4, 2, 16
PQ = torch.randn(N, 1, H, D)
KC, VC = torch.randn(NB, BS, HKV, D), torch.randn(NB, BS, HKV, 24)
TABLE = torch.arange(NB).view(N, NB // N).int()
LENS = torch.tensor([5, 9], dtype=torch.int32)
BAD = [
    (dict(softcap=0.0), "softcap"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap="2"), "softcap"),
    (dict(softcap=True), "softcap"),
    (dict(window=-2), "window"),
    (dict(window=1.5), "window"),
    (dict(window=True), "window"),
    (dict(window="3"), "window"),
    (dict(v_cache=VC[:4]), "v_cache"),
    (dict(v_cache=VC[:, :2]), "v_cache"),
    (dict(v_cache=VC[:, :, :1]), "v_cache"),
    (dict(v_cache=VC[0]), "v_cache"),
    (dict(sinks=torch.zeros(H + 1)), "sinks"),
    (dict(sinks=torch.zeros(1, H)), "sinks"),
    (dict(sinks=torch.zeros(H, dtype=torch.long)), "sinks"),
    (dict(sinks=[0.0] * H), "sinks"),
]


@pytest.mark.parametrize("change,name", BAD, ids=[f"{k}-{i}" for i, (c, k) in enumerate(BAD)])
def test_bad_features_are_value_errors_naming_the_argument(change, name):
    args = dict(q=PQ, k_cache=KC, v_cache=VC, block_table=TABLE, seq_lens=LENS)
    kwargs = {k: change[k] for k in change if k not in args}
    args |= {k: change[k] for k in change if k in args}
    backends = ["reference", "torch", "cpu", "auto"] + (["triton"] if HAVE_TRITON else [])
    for backend in backends:
        with pytest.raises(ValueError, match=name):
            paged_attention(*args.values(), backend=backend, **kwargs)
    if "sinks" not in kwargs:
        with pytest.raises(ValueError, match=name):
            paged.paged_attention_reference(*args.values(), **kwargs)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    for backend in ["reference"] + (["triton"] if HAVE_TRITON else []):
        with pytest.raises(ValueError, match=name):
            paged_prefill(
                args["q"][:, 0],
                args["k_cache"],
                args["v_cache"],
                TABLE,
                cu,
                LENS,
                max_seqlen_q=1,
                backend=backend,
                **kwargs,
            )
    if kwargs and set(kwargs) <= {
        "softcap",
        "window",
    }:  # a step's attend (per layer: the cache is not checked)
        seqs = [PagedSeq(row=0, start=4, n=1, block_table=[0, 1])]
        for backend in step_backends():
            with pytest.raises(ValueError, match=name):
                plan_step(seqs, block_size=BS, backend=backend).attend(
                    PQ[:1, 0], LayerCache(KC, VC), **kwargs
                )


def test_auto_never_picks_a_backend_without_the_feature():
    """``features``: every backend's by name; ``auto_backend`` passes over ``"cpu"`` for a call it
    cannot do, and ``"cpu"`` asked for by name then refuses, naming the argument."""
    for name in ("reference", "torch") + (("triton",) if triton_paged is not None else ()):
        assert paged.features(name, "decode") == paged.features(name, "step") == paged.ALL_FEATURES
    for want, arg in (
        (frozenset({"softcap"}), "softcap"),
        (frozenset({"window"}), "window"),
        (frozenset({"dv"}), "v_cache"),
    ):
        if want <= paged.features("cpu", "decode"):
            continue
        assert paged.auto_backend("cpu", want=want) != "cpu"
        kw = {"softcap": dict(softcap=2.0), "window": dict(window=2), "v_cache": {}}[arg]
        vc = VC if arg == "v_cache" else VC[..., :D]
        with pytest.raises(ValueError, match=arg):
            paged_attention(PQ, KC, vc, TABLE, LENS, backend="cpu", **kw)


# ----------------------------------------------------------------------------- compiled kernels

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringkv.kernels import triton_attn as tk, triton_paged as tp

tk.build()


def build(name, dt, consts, types=None):
    fn = getattr(tp, name)
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in (types or {}):
            sig[a] = types[a]
        elif a in ("KScale", "VScale"):
            sig[a] = "*fp16"
        elif a in ("Q", "K", "V", "Out"):
            sig[a] = "*" + dt
        elif a in ("OutP", "LseP", "Lse"):
            sig[a] = "*fp32"
        elif a in ("BlockTable", "SeqLens", "CuSeqlensQ", "QStart"):
            sig[a] = "*i32"
        elif a in ("qk_scale", "cap2"):
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    triton.compile(
        ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)
    )
    print("compiled", name, dt, consts, flush=True)


for cap, win, start in ((True, True, True), (False, True, False), (True, False, False)):
    build(
        "_paged_split_kernel",
        "bf16",
        dict(
            CAUSAL=False,
            QUANT=True,
            SOFTCAP=cap,
            HAS_WINDOW=win,
            HAS_START=start,
            PREC="tf32",
            BLOCK_R=16,
            BLOCK_N=32,
            BLOCK_D=128,
            BLOCK_DV=64,
        ),
        types={"K": "*i8", "V": "*i8"},
    )
    build(
        "_paged_prefill_kernel",
        "fp16",
        dict(
            CAUSAL=True,
            QUANT=False,
            HAS_START=start,
            SOFTCAP=cap,
            HAS_WINDOW=win,
            PREC="tf32",
            BLOCK_M=64,
            BLOCK_N=32,
            BLOCK_D=64,
            BLOCK_DV=128,
        ),
    )
"""


@pytest.mark.skipif(
    triton_paged is None or torch.cuda.is_available(),
    reason="needs triton; a GPU runs them instead",
)
def test_feature_kernels_compile_for_sm90(tmp_path):
    """The feature variants (softcap, window, positions, Dv's own tile) through the real compiler
    path
    for sm_90 (TTIR -> PTX -> cubin): catches what the interpreter accepts but the compiler
    rejects."""
    from tests.test_triton import (
        compile_for_sm90,
    )  # sets TRITON_INTERPRET for this process on import

    assert compile_for_sm90(_COMPILE_SCRIPT, tmp_path, timeout=600).count("compiled") == 6
