"""ringkv's own CPU C kernels with issue #42's attention features, against float64 math written
here.

Dense (``cpu_flash``, ``csrc/flash_attention.c``): V with its own head size ``Dv`` (smaller and
larger than ``D``; one that is not a multiple of 16 is zero-padded by the wrapper) and logit
soft-capping (the score is ``softcap * tanh(scale * q.k / softcap)`` before the mask, lse over the
capped scores, the backward through the tanh's derivative ``1 - (s / softcap)^2``), forward,
backward, ``backward_into`` and the gradient through lse, on shapes that cross the kernel's blocks
and masks of every kind it takes; on this process's build and on each target's (``isa=``).

Paged (``paged_cpu``, ``csrc/paged_attention.c``): a V cache of its own head size, ``softcap``,
a sliding ``window`` (left extent on global positions, SP striping included) and ``scale``, through
``paged_attention_cpu`` and the step's ``attend``.

The oracle is float64 autograd over the visible pairs (``oracle``, ``paged_oracle``), not
``reference``: its lse is float32, too coarse for the sharp rows these draw.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ringkv.kernels import cpu_flash, native, paged, paged_cpu
from ringkv.kernels.mask import BAND, FULL, OFFSET, Mask
from ringkv.kernels.paged_base import LayerCache, PagedSeq, query_limits
from tests.checks import assert_close
from tests.test_cpu_flash import oracle, sharpness, strided

pytestmark = pytest.mark.skipif(
    native.compiler() is None or os.environ.get("RINGKV_NATIVE_FLASH") == "0",
    reason="no C compiler here, or RINGKV_NATIVE_FLASH=0",
)

EPS = torch.finfo(torch.float32).eps
HYP = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
ISA = pytest.mark.parametrize(
    "isa",
    [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                isa not in native.supported_isas(), reason=f"this CPU cannot run {isa} code"
            ),
        )
        for isa in ("x86-64-v4", "x86-64-v3", "generic")
    ],
)
CAPS = st.one_of(st.none(), st.floats(1.0, 5.0), st.just(50.0))


# ---- dense: cpu_flash ----------------------------------------------------------------------------


@st.composite
def dense_problems(draw, small=False):
    b = draw(st.integers(1, 2))
    sq = draw(st.sampled_from([1, 47, 48, 96, 97]) | st.integers(1, 120 if small else 230))
    sk = draw(st.sampled_from([1, 31, 32, 129, 512, 513]) | st.integers(1, 300 if small else 700))
    hkv = draw(st.integers(1, 2))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([16, 48, 64, 128, 192]))
    dv = draw(
        st.sampled_from([16, 32, 128, 256, 24, 40, d])
    )  # 24, 40: padded to 32, 48 by the wrapper
    kind = draw(st.sampled_from([FULL, OFFSET, OFFSET, BAND]))
    hi = draw(st.integers(-sq - 2, sk + 2))  # from no row seeing a key to every row seeing all
    mask = (
        Mask(FULL)
        if kind == FULL
        else Mask(OFFSET, offset=hi)
        if kind == OFFSET
        else Mask(BAND, offset=hi, lo=hi - draw(st.integers(0, sk + 2)))
    )
    return dict(
        b=b,
        sq=sq,
        sk=sk,
        h=h,
        hkv=hkv,
        d=d,
        dv=dv,
        mask=mask,
        scale=draw(st.floats(0.02, 1.0)),
        softcap=draw(CAPS),
        layout=draw(st.sampled_from(["contiguous", "heads_first"])),
        dlse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_dense(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g)
    k = torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g)
    v = torch.randn(p["b"], p["sk"], p["hkv"], p["dv"], generator=g)
    dout = torch.randn(p["b"], p["sq"], p["h"], p["dv"], generator=g)
    dlse = torch.randn(p["b"], p["h"], p["sq"], generator=g) if p["dlse"] else None
    return q, k, v, dout, dlse


def check_dense(p, isa=None):
    """The build for ``isa`` on problem ``p``: forward (a blind row exactly 0), backward from the
    oracle's out/lse (dlse included when drawn), all against float64."""
    q, k, v, dout, dlse = make_dense(p)
    mask, scale, cap = p["mask"], p["scale"], p["softcap"]
    visible = mask.visible(p["sq"], p["sk"])
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dout, dlse, scale, visible, cap)
    out, lse = cpu_flash.forward(
        *(strided(t, p["layout"]) for t in (q, k, v)), scale, mask, softcap=cap, isa=isa
    )
    assert (
        out.shape == (p["b"], p["sq"], p["h"], p["dv"]) and out.dtype == lse.dtype == torch.float32
    )
    sharp = sharpness(
        q, k, scale
    )  # scores of tens: their rounding (eps * |s|) reaches out and lse alike
    assert_close("out", out, ref_out, 32 * EPS * sharp)
    assert_close("lse", lse, ref_lse, 32 * EPS * sharp)
    blind = torch.isinf(ref_lse)
    assert torch.equal(out.transpose(1, 2)[blind], torch.zeros_like(out.transpose(1, 2)[blind]))
    inputs = [strided(t, p["layout"]) for t in (dout, q, k, v)]
    grads = cpu_flash.backward(
        *inputs, ref_out.float(), ref_lse.float(), scale, mask, dlse, softcap=cap, isa=isa
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == torch.float32
        assert_close(name, got, want, 512 * EPS)


def test_features_are_declared():
    assert cpu_flash.FEATURES == frozenset({"softcap", "dv"})


# always run: blocks crossed with MLA's sizes (D 192 > Dv 128) and with Dv > D, each capped
MLA = dict(
    b=1,
    sq=97,
    sk=513,
    h=4,
    hkv=2,
    d=192,
    dv=128,
    mask=Mask(OFFSET, offset=400),
    scale=0.3,
    softcap=3.0,
    layout="heads_first",
    dlse=True,
    seed=5,
)
WIDE_V = dict(
    b=2,
    sq=130,
    sk=600,
    h=3,
    hkv=1,
    d=64,
    dv=256,
    mask=Mask(BAND, offset=40, lo=-300),
    scale=0.5,
    softcap=50.0,
    layout="contiguous",
    dlse=True,
    seed=6,
)


@HYP
@given(dense_problems())
@example(MLA)
@example(WIDE_V)
def test_dense_softcap_and_dv_equal_float64(p):
    check_dense(p)


@ISA
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=dense_problems(small=True))
@example(p=MLA)
@example(p=dict(WIDE_V, softcap=1.5))
def test_dense_features_on_each_target(isa, p):
    """The same on each target's build (its own tiles and vectors: tanh in 16, 8 or 4 lanes)."""
    check_dense(p, isa)


@pytest.mark.parametrize("dv", [32, 40])
def test_backward_into_adds_capped_gradients_to_strided_accumulators(dv):
    """The ring's path: dq, dk, dv (``Dv != D``; 40 goes through the padded copy) added in place
    into views of bigger float32 buffers, with a cap and a gradient through lse."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 150, 4, 64, generator=g)
    k, v = torch.randn(1, 300, 2, 64, generator=g), torch.randn(1, 300, 2, dv, generator=g)
    dout, dlse = torch.randn(1, 150, 4, dv, generator=g), torch.randn(1, 4, 150, generator=g)
    mask = Mask(OFFSET, offset=120)
    out, lse = cpu_flash.forward(q, k, v, 0.3, mask, softcap=3.0)
    want = cpu_flash.backward(dout, q, k, v, out, lse, 0.3, mask, dlse, softcap=3.0)
    big = [torch.randn(1, 2 * t.shape[1], t.shape[2], t.shape[3], generator=g) for t in (q, k, v)]
    views = [
        b.transpose(1, 2).contiguous().transpose(1, 2)[:, 5 : 5 + t.shape[1]]
        for b, t in zip(big, (q, k, v))
    ]
    before = [x.clone() for x in views]
    cpu_flash.backward_into(*views, dout, q, k, v, out, lse, 0.3, mask, dlse, softcap=3.0)
    for name, view, b0, w in zip(("dq", "dk", "dv"), views, before, want):
        torch.testing.assert_close(view, b0 + w, rtol=0, atol=1e-5, msg=name)
    _, _, (_, _, ref_dv) = oracle(q, k, v, dout, dlse, 0.3, mask.visible(150, 300), 3.0)
    assert_close("dv", want[2], ref_dv, 512 * EPS)


def test_capped_result_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 200, 4, 48, generator=g), torch.randn(2, 600, 2, 48, generator=g)
    v, dout = torch.randn(2, 600, 2, 32, generator=g), torch.randn(2, 200, 4, 32, generator=g)
    mask = Mask(BAND, offset=300, lo=-50)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = cpu_flash.forward(q, k, v, 0.2, mask, softcap=2.5)
            runs.append(
                (out, lse, *cpu_flash.backward(dout, q, k, v, out, lse, 0.2, mask, softcap=2.5))
            )
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_bad_softcap_and_head_sizes_are_refused():
    q, k, v = torch.zeros(1, 4, 2, 64), torch.zeros(1, 4, 2, 64), torch.zeros(1, 4, 2, 32)
    for cap in (0.0, -1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="softcap"):
            cpu_flash.forward(q, k, v, 0.1, Mask(FULL), softcap=cap)
    with pytest.raises(ValueError, match="head size"):
        cpu_flash.forward(q, torch.zeros(1, 4, 2, 48), v, 0.1, Mask(FULL))


# ---- paged: paged_cpu ----------------------------------------------------------------------------

needs_paged = pytest.mark.skipif(
    os.environ.get("RINGKV_NATIVE_PAGED") == "0", reason="RINGKV_NATIVE_PAGED=0"
)
WINDOWS = st.one_of(st.just(-1), st.sampled_from([0, 1, 5, 17]), st.integers(0, 120))


def paged_oracle(q, keys, values, q_pos, k_pos, scale, causal, window, softcap):
    """float64 attention of one sequence's queries ``q (Q, H, D)`` over its keys
    ``keys (L, Hkv, D)``,
    ``values (L, Hkv, Dv)``: query ``i`` (global position ``q_pos[i]``) sees key ``j`` (at
    ``k_pos[j]``) iff ``k_pos <= q_pos`` (causal) and ``k_pos >= q_pos - window`` (``window >= 0``).
    Returns out ``(Q, H, Dv)``, lse ``(H, Q)``."""
    if len(k_pos) == 0:
        return torch.zeros(*q.shape[:2], values.shape[-1], dtype=torch.float64), torch.full(
            (q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64
        )
    visible = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    out, lse, _ = oracle(
        q[None].double(),
        keys[None].double(),
        values[None].double(),
        torch.zeros(1, q.shape[0], q.shape[1], values.shape[-1]),
        None,
        scale,
        visible,
        softcap,
    )
    return out[0], lse[0]


def paged_cache(g, num_blocks, bs, hkv, d, dv):
    return torch.randn(num_blocks, bs, hkv, d, generator=g), torch.randn(
        num_blocks, bs, hkv, dv, generator=g
    )


def gathered(cache, blocks, length):
    """The first ``length`` keys of a sequence whose blocks are ``blocks``: ``(length, Hkv, D)``."""
    return cache[torch.as_tensor(blocks, dtype=torch.long)].reshape(-1, *cache.shape[2:])[:length]


@st.composite
def paged_problems(draw):
    n = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([3, 4, 16]))
    max_blocks = draw(st.integers(1, 8))
    hkv = draw(st.sampled_from([1, 2]))
    lens = draw(
        st.lists(
            st.one_of(
                st.sampled_from([0, 1, bs, max_blocks * bs]), st.integers(0, max_blocks * bs)
            ),
            min_size=n,
            max_size=n,
        )
    )
    d = draw(st.sampled_from([16, 24, 64, 128]))
    return dict(
        n=n,
        nq=draw(st.sampled_from([1, 2, 4])),
        h=hkv * draw(st.sampled_from([1, 2, 3])),
        hkv=hkv,
        d=d,
        dv=draw(st.sampled_from([8, 16, 32, 64, 128, 136, d])),
        bs=bs,
        max_blocks=max_blocks,
        lens=lens,
        causal=draw(st.booleans()),
        softcap=draw(CAPS),
        window=draw(WINDOWS),
        scale=draw(st.none() | st.floats(0.05, 1.0)),
        spread=draw(st.sampled_from([1.0, 4.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def check_paged(p, isa=None):
    g = torch.Generator().manual_seed(p["seed"])
    num_blocks = p["n"] * p["max_blocks"] + 2
    kc, vc = paged_cache(g, num_blocks, p["bs"], p["hkv"], p["d"], p["dv"])
    q = torch.randn(p["n"], p["nq"], p["h"], p["d"], generator=g) * p["spread"]
    table = (
        torch.randperm(num_blocks, generator=g)[: p["n"] * p["max_blocks"]].view(p["n"], -1).int()
    )
    lens = torch.tensor(p["lens"], dtype=torch.int32)
    scale = p["d"] ** -0.5 if p["scale"] is None else p["scale"]
    if isa is None:
        out, lse = paged_cpu.paged_attention_cpu(
            q,
            kc,
            vc,
            table,
            lens,
            scale=p["scale"],
            causal=p["causal"],
            softcap=p["softcap"],
            window=p["window"],
        )
    else:
        nq = p["nq"]
        pos = lens.long()[:, None] - nq + torch.arange(nq)
        out, lse = paged_cpu.attend(
            q,
            LayerCache(kc, vc),
            table,
            query_limits(lens, nq, p["causal"]),
            p["scale"],
            starts=paged_cpu.window_starts(pos, p["window"]),
            softcap=p["softcap"],
            isa=isa,
        )
    assert out.shape == (p["n"], p["nq"], p["h"], p["dv"]) and lse.shape == (
        p["n"],
        p["h"],
        p["nq"],
    )
    for i, length in enumerate(p["lens"]):
        keys, values = gathered(kc, table[i], length), gathered(vc, table[i], length)
        want_o, want_l = paged_oracle(
            q[i],
            keys,
            values,
            torch.arange(length - p["nq"], length),
            torch.arange(length),
            scale,
            p["causal"],
            p["window"],
            p["softcap"],
        )
        assert_close(
            f"out of sequence {i}",
            out[i],
            want_o,
            32 * EPS * sharpness(q[i : i + 1], keys[None], scale),
        )
        assert_close(
            f"lse of sequence {i}",
            lse[i],
            want_l,
            32 * EPS * sharpness(q[i : i + 1], keys[None], scale),
        )


@needs_paged
@HYP
@given(paged_problems())
@example(
    dict(
        n=3,
        nq=4,
        h=6,
        hkv=2,
        d=128,
        dv=64,
        bs=16,
        max_blocks=8,
        lens=[128, 77, 3],
        causal=True,
        softcap=30.0,
        window=17,
        scale=None,
        spread=4.0,
        seed=1,
    )
)
def test_paged_softcap_window_and_dv_equal_float64(p):
    """``paged_attention_cpu``: the kernel's cap (tanh, 8 at a time and a padded tail), its window
    (a first key per query: the softmax and the V sums start there) and a V cache of its own head
    size (in registers for multiples of 8 up to 128, a plain loop otherwise: 136)."""
    check_paged(p)


@needs_paged
@ISA
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=paged_problems())
def test_paged_features_on_each_target(isa, p):
    check_paged(p, isa)


def step_case(seed, sp, bs, d, dv, many):
    """A step of decode rows and short chunks (and, with ``many``, chunks longer than
    ``paged_cpu.MAX_QUERIES``, which go to the torch plan): ``seqs``, ``q (T, H, D)``, the cache
    (this rank's striped share is what it holds: any values do), H, Hkv."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = 6, 2
    totals = torch.randint(1, 90, (9,), generator=g).tolist()
    pool = torch.randperm(400, generator=g).tolist()
    seqs, row = [], 0
    for i, total in enumerate(totals):
        n = min(total, (1, 3, 12 if many else 5)[i % 3])
        table = [pool.pop() for _ in range(max(1, -(-(total // sp + 1) // bs)))]
        seqs.append(PagedSeq(row=row, start=total - n, n=n, block_table=table))
        row += n
    kc, vc = paged_cache(g, 400, bs, hkv, d, dv)
    return seqs, torch.randn(row, h, d, generator=g), kc, vc, h


@needs_paged
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    sp=st.sampled_from([1, 2, 3]),
    bs=st.sampled_from([4, 16]),
    dims=st.sampled_from([(64, 64), (64, 32), (32, 96), (128, 128)]),
    softcap=CAPS,
    window=WINDOWS,
    scale=st.none() | st.floats(0.05, 1.0),
    many=st.booleans(),
    rank=st.integers(0, 2),
)
@example(seed=1, sp=2, bs=4, dims=(64, 32), softcap=2.0, window=5, scale=None, many=True, rank=1)
@example(seed=2, sp=3, bs=16, dims=(32, 96), softcap=None, window=20, scale=0.3, many=False, rank=2)
def test_paged_step_features_on_striped_shares(
    seed, sp, bs, dims, softcap, window, scale, many, rank
):
    """``CpuStep.attend`` on an SP rank's striped share (local key ``i`` at global position
    ``sp_rank + i * sp``): the window's first key per query from global positions; every row's out
    and lse (and out without lse) against float64."""
    d, dv = dims
    sp_rank = rank % sp
    seqs, q, kc, vc, h = step_case(seed, sp, bs, d, dv, many)
    step = paged_cpu.plan_step(seqs, block_size=bs, sp=sp, sp_rank=sp_rank)
    cache = LayerCache(kc, vc)
    parts = step.attend(q, cache, scale=scale, softcap=softcap, window=window)
    fast = step.attend(q, cache, lse=False, scale=scale, softcap=softcap, window=window)
    got_out, got_lse = torch.zeros(q.shape[0], h, dv), torch.full((h, q.shape[0]), float("nan"))
    fast_out = torch.full((q.shape[0], h, dv), float("nan"))
    for part in parts:
        got_out[part.rows], got_lse[:, part.rows] = part.out, part.lse
    for part in fast:
        fast_out[part.rows] = part.out
    s = d**-0.5 if scale is None else scale
    for seq in seqs:
        length = seq.keys(sp, sp_rank)
        keys, values = gathered(kc, seq.block_table, length), gathered(vc, seq.block_table, length)
        rows = slice(seq.row, seq.row + seq.n)
        want_o, want_l = paged_oracle(
            q[rows],
            keys,
            values,
            torch.arange(seq.start, seq.start + seq.n),
            torch.arange(length) * sp + sp_rank,
            s,
            True,
            window,
            softcap,
        )
        tol = 32 * EPS * sharpness(q[None, rows], keys[None], s)
        assert_close(f"out of rows {rows}", got_out[rows], want_o, tol)
        assert_close(f"lse of rows {rows}", got_lse[:, rows], want_l, tol)
        if seq.n <= paged_cpu.MAX_QUERIES:  # the kernel's rows without lse: the same numbers
            assert torch.equal(fast_out[rows], got_out[rows])
        else:
            assert_close(f"out of rows {rows} (no lse)", fast_out[rows], want_o, tol)


def test_window_starts_on_striped_positions():
    """The first local key in a window, against counting: local key ``i`` of rank ``r`` of ``sp`` is
    at ``r + i * sp``; a query at ``p`` with window ``W`` sees it iff ``p - W <= r + i * sp``."""
    p = torch.arange(0, 40)
    assert paged_cpu.window_starts(p, -1) is None
    for sp in (1, 2, 3, 4):
        for r in range(sp):
            for w in (0, 1, 2, 5, 7):
                want = [next(i for i in range(100) if r + i * sp >= x - w) for x in p.tolist()]
                assert paged_cpu.window_starts(p, w, sp, r).clamp_min(0).tolist() == want, (
                    sp,
                    r,
                    w,
                )


@needs_paged
def test_paged_window_reads_no_block_before_it():
    """Blocks wholly before every query's window are not read: a table whose early entries are
    freed (-1, or ids outside the cache) gives the same result; one inside the window is refused."""
    g = torch.Generator().manual_seed(3)
    kc, vc = paged_cache(g, 12, 4, 2, 32, 16)
    q = torch.randn(2, 2, 4, 32, generator=g)
    table = torch.randperm(12, generator=g)[:10].view(2, 5).int()
    lens = torch.tensor(
        [20, 17], dtype=torch.int32
    )  # queries at 18, 19 and 15, 16; window 5: keys >= 13 and 10
    want = paged_cpu.paged_attention_cpu(q, kc, vc, table, lens, softcap=3.0, window=5)
    freed = table.clone()
    freed[0, :3], freed[1, :2] = -1, 99  # keys 0-11 and 0-7: before every query's window
    got = paged_cpu.paged_attention_cpu(q, kc, vc, freed, lens, softcap=3.0, window=5)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    freed[1, 2] = -1  # keys 8-11: sequence 1's window starts at 10
    with pytest.raises(ValueError, match="block ids outside"):
        paged_cpu.paged_attention_cpu(q, kc, vc, freed, lens, softcap=3.0, window=5)


@needs_paged
def test_paged_entry_points_take_the_features_on_cpu():
    """Through ``paged.paged_attention`` and ``paged.plan_step`` with ``backend="cpu"``: the kernel
    takes them (no ValueError, no fallback), and ``FEATURES`` says so."""
    assert paged_cpu.FEATURES == frozenset({"softcap", "window", "dv"})
    g = torch.Generator().manual_seed(4)
    kc, vc = paged_cache(g, 8, 16, 1, 64, 32)
    q = torch.randn(2, 1, 3, 64, generator=g)
    table, lens = (
        torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        torch.tensor([40, 33], dtype=torch.int32),
    )
    out, lse = paged.paged_attention(
        q, kc, vc, table, lens, backend="cpu", softcap=4.0, window=9, scale=0.2
    )
    for i, length in enumerate((40, 33)):
        want_o, want_l = paged_oracle(
            q[i],
            gathered(kc, table[i], length),
            gathered(vc, table[i], length),
            torch.tensor([length - 1]),
            torch.arange(length),
            0.2,
            True,
            9,
            4.0,
        )
        assert_close("out", out[i], want_o, 64 * EPS)
        assert_close("lse", lse[i], want_l, 64 * EPS)
    step = paged.plan_step(
        [
            PagedSeq(row=0, start=39, n=1, block_table=[0, 1, 2]),
            PagedSeq(row=1, start=32, n=1, block_table=[3, 4, 5]),
        ],
        block_size=16,
        backend="cpu",
    )
    parts = step.attend(q[:, 0], LayerCache(kc, vc), softcap=4.0, window=9, scale=0.2)
    assert torch.equal(torch.cat([p.out for p in parts]), out[:, 0])
