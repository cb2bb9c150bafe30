"""``grad_comm_dtype="auto"`` on a real gloo world: the default stays bit-exact, the opt-in's
bf16 dK/dV stay within their error bound against the reference, and every rank takes the same
decision even when its own measurements differ from its peers'."""

from __future__ import annotations

import pytest
import torch

import ringkv
from ringkv.sp import ring as ring_mod
from tests.test_ring import TOL, _reference

CASES = "tests.ring_auto_cases"


def _inputs(seed=3, s=48, h=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, h, d, generator=g)
    k, v = (torch.randn(1, s, hkv, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g)


def _errors(res, want, n):
    """Max |got - reference| of dq, dk, dv over ranks, each relative to the reference's max."""
    errs = []
    for j, full in enumerate(want[2:]):
        err = max(
            (r[1 + j] - ringkv.shard(full, 1, "zigzag", rank=rank, world=n)).abs().max().item()
            for rank, r in enumerate(res)
        )
        errs.append(err / full.abs().max().item())
    return errs


def test_default_and_auto_on_a_fast_link_are_bit_exact(world):
    """The default (float32 dK/dV) is bit-identical to explicit float32, and to ``"auto"`` both in
    its first (measuring) call and where it decided for float32 (a threshold no link reaches):
    same out, dq, dk, dv to the bit, every rank, every call."""
    q, k, v, dout = _inputs()
    base = world.check(f"{CASES}:calls", 4, q, k, v, dout, None, 1)
    f32 = world.check(f"{CASES}:calls", 4, q, k, v, dout, torch.float32, 1)
    auto = world.check(f"{CASES}:calls", 4, q, k, v, dout, "auto", 2, 1e12)
    for rank in range(4):
        want = base[rank][0][0]
        assert want[4] == "None" and want[5] is None
        for got in [f32[rank][0][0], *auto[rank][0]]:
            assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4])), rank
        first, second = auto[rank][0]
        assert first[4] == "None" and first[5] > 0  # measured, decided float32
        assert second[4] == "None" and second[5] == first[5]
        assert auto[rank][1][-1] is None and auto[rank][2] == 1  # AutoWire.dtype, one decision
    assert len({r[1] for r in auto}) == 1  # the same decision (same floats) on every rank


def test_auto_on_a_slow_link_sends_bf16_within_its_error_bound(world):
    """A threshold of 0 (every link "slow"): the first call measures and sends float32 (exact),
    the later ones bf16 dK/dV: half their bytes, gradients within bf16's tolerance of the
    reference and measurably different from float32's (the lossy choice was taken); the forward
    and dq stay bit-exact."""
    q, k, v, dout = _inputs(seed=5)
    want = _reference(q, k, v, dout, None, True, None)
    exact = world.check(f"{CASES}:calls", 4, q, k, v, dout, None, 1)
    res = world.check(f"{CASES}:calls", 4, q, k, v, dout, "auto", 3, 0.0)
    for rank, (got, decision, count) in enumerate(res):
        assert [g[4] for g in got] == ["None", "torch.bfloat16", "torch.bfloat16"], rank
        assert decision[-1] == torch.bfloat16 and count == 1
        assert all(torch.equal(a, b) for a, b in zip(got[0][:4], exact[rank][0][0][:4]))
        for g in got[1:]:
            assert torch.equal(g[0], exact[rank][0][0][0]) and torch.equal(
                g[1], exact[rank][0][0][1]
            )
    f32 = _errors([e[0][0] for e in exact], want, 4)
    bf16 = _errors([r[0][2] for r in res], want, 4)
    atol, _ = TOL[torch.bfloat16]
    assert max(f32) < 1e-5, f32
    assert bf16[0] == f32[0]  # dq never travels
    assert max(bf16[1:]) < atol, bf16  # the documented bound: bf16's tolerance (4e-2 of the max)
    assert max(bf16[1:]) > 10 * max(f32[1:]), (bf16, f32)  # and it did round to bf16


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_takes_the_same_decision(world, n):
    """Each rank feeds its own measurements and threshold into the decision: the slowest link,
    the slowest compute and the highest threshold over the group decide, on every rank, in both
    directions (one rank alone sees a slow link: all send bf16; one rank alone wants float32: its
    threshold wins)."""
    ranks = range(n)
    slow_one = world.check(
        f"{CASES}:decide",
        n,
        [0.1] * n,
        [2.0 if r == n - 1 else 0.1 for r in ranks],
        [1.0] * n,
        [1.0] * n,
    )
    assert len(set(slow_one)) == 1
    t, st, c, ratio, thr, dtype = slow_one[0]
    assert (st, c, ratio, thr, dtype) == (2.0, 1.0, 2.0, 1.0, torch.bfloat16)
    careful_one = world.check(
        f"{CASES}:decide",
        n,
        [0.1] * n,
        [1.5] * n,
        [1.0 + r for r in ranks],  # the slowest compute: ratio 1.5 / n
        [5.0 if r == 0 else 0.0 for r in ranks],
    )
    assert len(set(careful_one)) == 1
    assert careful_one[0][2:] == (float(n), 1.5 / n, 5.0, None)


def test_auto_end_to_end_agrees_and_is_recorded(world):
    """At world 3 with the default threshold: whatever the loopback link measures, the ranks agree
    (same ratio and dtype in every call's stats and in ``auto_decisions()``), and the checks of
    the argument reject what "auto" is not."""
    q, k, v, dout = _inputs(seed=9, s=36)
    res = world.check(f"{CASES}:calls", 3, q, k, v, dout, "auto", 2)
    assert len({r[1] for r in res}) == 1 and res[0][1] is not None
    assert len({(g[4], g[5]) for r in res for g in r[0][1:]}) == 1
    ratio = res[0][1][3]
    assert ratio == res[0][0][0][5] > 0
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        ring_mod.check_grad_comm_dtype("bf16")
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        ringkv.RingAttention(grad_comm_dtype="automatic")
    # one rank, or no backward: nothing to measure, float32, no collective
    assert ringkv.ring_attention(q, k, v, causal=True, grad_comm_dtype="auto").shape == q.shape


def test_auto_decides_once_per_shape_and_keeps_a_bounded_table(world):
    """Packed batches whose documents' boundaries change every call share one decision (before,
    each new packing measured again, losing a hop's overlap each step, and the table grew every
    step); across many shapes the group keeps at most ``AUTO_PER_GROUP`` decisions, the same on
    every rank."""
    res = world.check(f"{CASES}:packed_and_shapes", 2, 3)
    for packed, shapes in res:
        assert packed == [1, 1, 1, 1], packed
        assert shapes == [2, 3, 3, 3, 3], shapes
    assert len({tuple(map(tuple, r)) for r in res}) == 1
