"""Every attention backend usable here against a naive float64 full-softmax computation.

The naive version materialises the whole ``(Sq, Sk)`` score matrix in float64, builds the
causal mask from explicit position vectors (``q_pos[:, None] >= k_pos[None, :]``, not via
``make_mask``) and gets gradients from autograd. Low-precision inputs are compared against
the float64 computation on the *same rounded* inputs, so only the kernel's own error counts.
Backends come from the registry: whatever ``supports(q, mask)`` on this machine is tested.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringkv.kernels import BACKENDS, attention, make_mask
from ringkv.kernels.mask import DENSE, offset_tiles
from tests.checks import assert_close


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [16, 32, 64, 80, 128]


def tolerances(dtype):
    """(out, lse, gradient) tolerances, relative to ``1 + max|reference|``, from the dtype's eps.

    Low precision: the output is rounded once (eps/2), gradients pass through a few rounded
    products; lse is float32 computed from rounded inputs. float32: the sums over keys and
    head_dim, not the storage, dominate (and dk/dq see cancellation in dP - delta).
    """
    eps = torch.finfo(dtype).eps  # 1.2e-7 fp32, 9.8e-4 fp16, 7.8e-3 bf16
    if dtype == torch.float32:
        return 32 * eps, 32 * eps, 512 * eps
    return 2 * eps, eps / 8, 6 * eps


# ---------------------------------------------------------------------------- the oracle


def explicit_positions(q_pos, k_pos, sq, sk):
    """Position vectors as long tensors; ``None`` means keys ``0..Sk-1``, queries at the end."""

    def as_tensor(pos, default):
        if pos is None:
            return default
        return torch.tensor(list(pos), dtype=torch.long) if isinstance(pos, range) else pos.long()

    return as_tensor(q_pos, torch.arange(sk - sq, sk)), as_tensor(k_pos, torch.arange(sk))


def naive_attention(q, k, v, scale, causal, q_pos, k_pos):
    """float64 full softmax: q (B,Sq,H,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,H,D), lse (B,H,Sq)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(h // hkv, dim=2)  # (B, Sk, H, D): query head i uses kv head i // G
    vr = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale  # (B, H, Sq, Sk)
    if causal:
        qp, kp = explicit_positions(q_pos, k_pos, sq, sk)
        s = s.masked_fill(~(qp[:, None] >= kp[None, :]), float("-inf"))
    m = s.amax(-1, keepdim=True).detach() if sk else s.new_zeros(b, h, sq, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)  # masked entries: exactly 0
    denom = e.sum(-1, keepdim=True)  # (B, H, Sq, 1)
    seen = denom > 0
    denom = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bkhd->bqhd", e / denom, vr)  # (B, Sq, H, D)
    lse = torch.where(seen, torch.log(denom) + m, torch.full_like(m, float("-inf")))[..., 0]
    return out, lse


# ---------------------------------------------------------------------------- strategies


@st.composite
def position_pair(draw, sq, sk):
    """(q_positions, k_positions) in all accepted forms, with offsets that mask whole rows."""
    kind = draw(st.sampled_from(["none", "same_step", "same_step", "diff_step", "tensor", "mixed"]))
    if kind == "none":
        return None, None

    def a_range(n, step, start=None):
        start = draw(st.integers(-20, 60)) if start is None else start
        return range(start, start + n * step, step)

    def a_tensor(n):  # unsorted, duplicates likely, int32 or int64
        vals = draw(st.lists(st.integers(-5, 30), min_size=n, max_size=n))
        return torch.tensor(vals, dtype=draw(st.sampled_from([torch.int64, torch.int32])))

    if kind == "same_step":  # the ring's case: an offset diagonal, from all-blind to all-seeing
        step, k0 = draw(st.integers(1, 4)), draw(st.integers(-20, 60))
        q0 = k0 + draw(st.integers(-(sq + 1) * step, (sk + 1) * step))
        return a_range(sq, step, q0), a_range(sk, step, k0)
    if kind == "diff_step":
        return a_range(sq, draw(st.integers(1, 4))), a_range(sk, draw(st.integers(1, 4)))
    if kind == "tensor":
        return a_tensor(sq), a_tensor(sk)
    one = draw(st.sampled_from(["q", "k"]))
    pos_q = a_tensor(sq) if one == "q" else draw(st.sampled_from([None, a_range(sq, 1)]))
    pos_k = a_tensor(sk) if one == "k" else draw(st.sampled_from([None, a_range(sk, 2)]))
    return pos_q, pos_k


@st.composite
def problems(draw, max_s=40):
    b = draw(st.integers(1, 3))
    length = st.sampled_from([1, 2]) | st.integers(3, max_s) | st.integers(max_s // 2, max_s)
    sq, sk = draw(length), draw(length)  # independent: Sq < Sk, Sq == Sk, Sq > Sk
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.sampled_from([1, 2, 3]))  # MHA, GQA, and MQA when hkv == 1
    d = draw(st.sampled_from(HEAD_DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    causal = draw(st.sampled_from([True, True, True, False]))
    q_pos, k_pos = draw(position_pair(sq, sk)) if causal else (None, None)
    scale = draw(st.none() | st.floats(0.02, 0.5))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        b=b,
        sq=sq,
        sk=sk,
        h=h,
        hkv=hkv,
        d=d,
        dtype=dtype,
        causal=causal,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=scale,
        seed=seed,
    )


def make_inputs(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g)
    k = torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g)
    v = torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g)
    dout = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g)
    dlse = torch.randn(p["b"], p["h"], p["sq"], generator=g)
    return [t.to(p["dtype"]) for t in (q, k, v, dout)] + [dlse]


def usable_backends(q, mask):
    names = [n for n, m in BACKENDS.items() if m.supports(q, mask)]
    assert "reference" in names  # the oracle runs everywhere; sdpa too on CPU
    if q.device.type == "cpu":
        assert "sdpa" in names
    return names


# ---------------------------------------------------------------------------- comparisons


def assert_lse(what, got, want, tol):
    assert got.dtype == torch.float32, f"{what}: lse dtype {got.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in lse"
    assert torch.equal(got == float("-inf"), want == float("-inf")), f"{what}: -inf pattern differs"
    assert not torch.isposinf(got).any()
    fin = torch.isfinite(want)
    assert_close(what, got[fin], want[fin], tol)


# The inputs here are CPU tensors, which the Triton backend takes only in Triton's interpreter
# (TRITON_INTERPRET=1, tests/conftest.py): ~95% of this module's time went to it (12 of 13 forward
# seconds, measured). tests/test_triton.py fuzzes those kernels against the reference with 120
# examples of its own; here they get fewer examples than the compiled backends.
INTERPRETED = {"triton"} if os.environ.get("TRITON_INTERPRET") == "1" else set()


def check_backends(p, dlse_too=False, only=None):
    """Every usable backend (``only``: those of them it names) against the float64 oracle."""
    q, k, v, dout, dlse = make_inputs(p)
    scale = p["scale"] if p["scale"] is not None else p["d"] ** -0.5
    tol, lse_tol, grad_tol = tolerances(p["dtype"])

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive_attention(*leaves, scale, p["causal"], p["q_pos"], p["k_pos"])
    grads = [dout.double()] + ([dlse.double()] if dlse_too else [])
    torch.autograd.backward([ref_out, ref_lse][: len(grads)], grads)
    ref_grads = [t.grad for t in leaves]

    mask = make_mask(p["causal"], p["q_pos"], p["k_pos"], p["sq"], p["sk"])
    for name in usable_backends(q, mask):
        if only is not None and name not in only:
            continue
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention(
            *x,
            scale=p["scale"],
            causal=p["causal"],
            q_positions=p["q_pos"],
            k_positions=p["k_pos"],
            backend=name,
        )
        assert out.dtype == q.dtype, f"{name}: out dtype {out.dtype}"
        assert_close(f"{name} out", out, ref_out.detach(), tol)
        assert_lse(f"{name} lse", lse, ref_lse.detach(), lse_tol)
        torch.autograd.backward([out, lse][: len(grads)], [dout, dlse][: len(grads)])
        for t, r, gname in zip(x, ref_grads, ("dq", "dk", "dv")):
            assert t.grad.dtype == t.dtype, f"{name} {gname}: dtype {t.grad.dtype}"
            assert_close(f"{name} {gname}", t.grad, r, grad_tol)


# ---------------------------------------------------------------------------- tests


COMPILED = set(BACKENDS) - INTERPRETED


@settings(max_examples=60)
@given(problems())
def test_backends_match_naive(p):
    check_backends(p, only=COMPILED)


NOTHING_INTERPRETED = pytest.mark.skipif(
    not INTERPRETED, reason="no interpreted backend: the tests above ran every usable one"
)


@NOTHING_INTERPRETED
@settings(max_examples=30)
@given(problems())
def test_interpreted_backends_match_naive(p):
    """The same problems for the interpreted backends, fewer of them (their own fuzzing is in
    tests/test_triton.py)."""
    check_backends(p, only=INTERPRETED)


@settings(max_examples=25)
@given(problems(max_s=24))
def test_gradient_through_lse(p):
    check_backends(p, dlse_too=True, only=COMPILED)


@NOTHING_INTERPRETED
@settings(max_examples=12)
@given(problems(max_s=24))
def test_interpreted_gradient_through_lse(p):
    check_backends(p, dlse_too=True, only=INTERPRETED)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_head_dim_and_dtype(d, dtype):
    # fixed cover of the grid hypothesis only samples: causal offset mask with a fully masked row
    p = dict(
        b=2,
        sq=5,
        sk=9,
        h=4,
        hkv=2,
        d=d,
        dtype=dtype,
        causal=True,
        q_pos=range(-1, 4),
        k_pos=range(0, 9),
        scale=None,
        seed=d,
    )
    check_backends(p)


def test_rows_without_keys_are_zero_with_minus_inf_lse():
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    for q_pos, k_pos in [
        (range(0, 4), range(2, 5)),
        (torch.tensor([0, 5, 1, 9]), torch.tensor([3, 3, 2])),
    ]:
        for name in usable_backends(q, make_mask(True, q_pos, k_pos, 4, 3)):
            out, lse = attention(
                q, k, v, causal=True, q_positions=q_pos, k_positions=k_pos, backend=name
            )
            blind = explicit_positions(q_pos, k_pos, 4, 3)
            blind = ~(blind[0][:, None] >= blind[1][None, :]).any(1)  # rows seeing nothing
            assert blind.any()
            assert torch.equal(out[0, blind], torch.zeros_like(out[0, blind])), name
            assert (
                torch.isneginf(lse[0][:, blind]).all() and torch.isfinite(lse[0][:, ~blind]).all()
            ), name


# ---------------------------------------------------------------------------- mask.py


@settings(max_examples=60)
@given(st.integers(0, 12), st.integers(0, 12), st.data())
def test_make_mask_matches_explicit_matrix(sq, sk, data):
    q_pos, k_pos = data.draw(position_pair(sq, sk))
    mask = make_mask(True, q_pos, k_pos, sq, sk)
    qp, kp = explicit_positions(q_pos, k_pos, sq, sk)
    want = qp[:, None] >= kp[None, :]  # (Sq, Sk)
    assert torch.equal(mask.visible(sq, sk), want), mask
    if want.numel() == 0 or not want.any():
        assert mask.kind == "empty"
    elif want.all():
        assert mask.kind == "full"
    both_ranges = all(isinstance(x, range) or x is None for x in (q_pos, k_pos))
    if both_ranges and (q_pos is None or k_pos is None or q_pos.step == k_pos.step):
        assert mask.kind != DENSE, "equal-step ranges must not need a dense mask"
    assert make_mask(False, q_pos, k_pos, sq, sk).kind == ("full" if sq and sk else "empty")
    for q0, q1, k0, k1 in [(0, sq // 2, 0, sk), (sq // 3, sq, sk // 2, sk)]:  # sub-blocks
        assert torch.equal(mask.block(q0, q1, k0, k1).visible(q1 - q0, k1 - k0), want[q0:q1, k0:k1])


@settings(max_examples=60)
@given(st.integers(1, 20), st.integers(2, 20), st.data())
def test_offset_tiles_cover_the_mask_once(sq, sk, data):
    offset = data.draw(st.integers(-(sq - 1), sk - 2))  # the range where make_mask gives OFFSET
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    want = j <= i + offset
    count = torch.zeros(sq, sk, dtype=torch.long)
    for t in offset_tiles(offset, sq, sk):
        assert 0 <= t.q0 < t.q1 <= sq and 0 <= t.k0 < t.k1 <= sk, t
        tile = torch.ones(t.q1 - t.q0, t.k1 - t.k0, dtype=torch.bool)
        if t.causal:
            assert t.q1 - t.q0 == t.k1 - t.k0, f"causal tile not square: {t}"
            tile = tile.tril()
        count[t.q0 : t.q1, t.k0 : t.k1] += tile
    assert count.max() <= 1, "tiles overlap"
    assert torch.equal(count == 1, want), "tiles' union differs from the mask"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_host_positions_classify_exactly_and_find_the_band(data):
    """Host (CPU) position tensors are classified on the host: the mask equals the brute-force
    matrix, and a decode step over a sharded cache (sorted older keys, then the new tokens)
    comes out as a fused-kernel mask (full / offset / band), not an explicit matrix."""
    old = sorted(data.draw(st.sets(st.integers(0, 60), max_size=12)))
    start = data.draw(st.integers(61, 70))
    t = data.draw(st.integers(1, 4))
    owner = data.draw(st.booleans())  # the rank that caches the new tokens holds them at the end
    k = torch.tensor(old + (list(range(start, start + t)) if owner else []), dtype=torch.long)
    q = torch.arange(start, start + t)
    causal = data.draw(st.booleans())
    window = data.draw(st.sampled_from([(-1, -1), (5, 0), (20, -1), (3, 2)]))
    if k.numel() == 0:
        return
    mask = make_mask(causal, q, k, t, k.numel(), window=window)
    dist = q[:, None] - k[None, :]
    want = torch.ones(t, k.numel(), dtype=torch.bool)
    right = 0 if causal else window[1]
    if right >= 0:
        want &= dist >= -right
    if window[0] >= 0:
        want &= dist <= window[0]
    assert torch.equal(mask.visible(t, k.numel()), want)
    if (
        causal and window[0] < 0
    ):  # every row sees a prefix of the sorted keys: full or offset, never a matrix
        assert mask.kind != DENSE, (mask, k.tolist(), q.tolist())
