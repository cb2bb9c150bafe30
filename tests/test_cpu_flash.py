"""ringkv's own CPU flash kernel (``ringkv/kernels/cpu_flash.py``, ``csrc/flash_attention.c``)
against float64 attention, on shapes that cross its blocks.

``tests/test_kernels.py`` already runs every registered backend (this one included) on short
sequences; here the sequences are long enough to cross the kernel's blocks (96 query rows and
512 keys forward, 48 rows and 512 keys backward, panels of 32 keys with AVX-512, 16 with AVX2),
inputs are strided views (the ring hands the kernel heads-first K/V), masks are every kind it
takes (full, offset diagonals from all-blind to all-seeing, bands), and the gradient through lse
is included. These run the build of this process (``-march=native``, or ``RINGKV_KERNEL_ISA``)
on any CPU; ``tests/test_kernel_isa.py`` runs the same checks on each target's build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringkv import kernels
from ringkv.kernels import cpu_flash, native, reference
from ringkv.kernels.mask import BAND, DENSE, FULL, OFFSET, Mask
from tests.checks import assert_close

# only where there is no compiler, or the kernel is switched off: where one is, a kernel that fails
# to
# build fails these tests (tests/conftest.py turns the kernel on without its timing self-check)
pytestmark = pytest.mark.skipif(
    native.compiler() is None or os.environ.get("RINGKV_NATIVE_FLASH") == "0",
    reason="no C compiler here, or RINGKV_NATIVE_FLASH=0",
)

EPS = torch.finfo(torch.float32).eps
HYP = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``x`` ``(B, S, H, D)`` in another memory layout."""
    if how == "heads_first":  # what the ring passes on CPU: (B, H, S, D) memory
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "padded":  # a slice of a wider buffer: rows further apart than H * D
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 16)
        wide[..., 3 : 3 + x.shape[-1]] = x
        return wide[..., 3 : 3 + x.shape[-1]]
    return x


def oracle(q, k, v, dout, dlse, scale, mask, softcap=None):
    """float64 full softmax over the mask's visible pairs (``mask``: a ``Mask``, or a bool tensor
    broadcast to ``(B, H, Sq, Sk)``), scores capped as ``softcap * tanh(s / softcap)`` when given,
    gradients by autograd: out ``(B, Sq, H, Dv)``, lse, (dq, dk, dv). (``reference.forward`` keeps
    lse in float32, which is too coarse an oracle for sharp rows: with one visible key its p is
    1 - 1e-6, not 1, and dK is not exactly 0.)"""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kr, vr = (
        t.repeat_interleave(h // hkv, dim=2) for t in leaves[1:]
    )  # (B, Sk, H, D), (B, Sk, H, Dv)
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], kr) * scale  # (B, H, Sq, Sk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~(mask.visible(sq, sk) if isinstance(mask, Mask) else mask), float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)  # masked: exactly 0
    denom = e.sum(-1, keepdim=True)
    seen = denom > 0
    denom = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bkhd->bqhd", e / denom, vr)  # (B, Sq, H, Dv)
    lse = torch.where(seen, torch.log(denom) + m, torch.full_like(m, float("-inf")))[
        ..., 0
    ]  # (B, H, Sq)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + torch.where(seen[..., 0], lse * dlse.double(), torch.zeros_like(lse)).sum()
    loss.backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    sq = draw(st.sampled_from([1, 47, 48, 96, 97]) | st.integers(1, 230))
    sk = draw(st.sampled_from([1, 31, 32, 128, 129, 512, 513]) | st.integers(1, 700))
    hkv = draw(st.integers(1, 2))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([16, 48, 64, 80, 128]))
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
        mask=mask,
        scale=draw(st.floats(0.02, 1.0)),
        layout=draw(st.sampled_from(["contiguous", "heads_first", "padded"])),
        dlse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(p):
    g = torch.Generator().manual_seed(p["seed"])
    q, dout = (torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g) for _ in range(2))
    k, v = (torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g) for _ in range(2))
    dlse = torch.randn(p["b"], p["h"], p["sq"], generator=g) if p["dlse"] else None
    return q, k, v, dout, dlse


def sharpness(q, k, scale) -> float:
    """How much more than 1 out's error may be: a score ``s`` is computed with an error of about
    ``eps * |s|``, which ``p = exp(s - lse)`` carries into out as a relative error of that size.
    With scores up to ~50 (scale 1, head dim 128) torch's own op is 2.2e-5 off (48 x 170 keys), past
    ``32 eps`` of out's magnitude; so scores beyond 16 widen out's tolerance in proportion."""
    kr = k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kr)
    return max(1.0, scale * s.abs().max().item() / 16) if s.numel() else 1.0


def check(p, isa=None):
    """The kernel built for ``isa`` (default: this process's) on problem ``p`` against the oracle:
    forward (rows that see no key exactly 0) and backward with the oracle's out/lse."""
    q, k, v, dout, dlse = make(p)
    mask, scale = p["mask"], p["scale"]
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dout, dlse, scale, mask)
    out, lse = cpu_flash.forward(
        *(strided(t, p["layout"]) for t in (q, k, v)), scale, mask, isa=isa
    )
    assert out.dtype == lse.dtype == torch.float32
    assert_close("out", out, ref_out, 32 * EPS * sharpness(q, k, scale))
    assert_close("lse", lse, ref_lse, 32 * EPS)
    blind = torch.isinf(ref_lse)  # rows that see no key: exactly 0
    assert torch.equal(out.transpose(1, 2)[blind], torch.zeros_like(out.transpose(1, 2)[blind]))

    inputs = [strided(t, p["layout"]) for t in (dout, q, k, v)]
    grads = cpu_flash.backward(
        *inputs, ref_out.float(), ref_lse.float(), scale, mask, dlse, isa=isa
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == torch.float32
        assert_close(name, got, want, 512 * EPS)


@HYP
@given(problems())
def test_forward_and_backward_equal_float64_attention(p):
    check(p)


def test_backward_into_adds_to_strided_accumulators():
    """The ring's path: gradients added in place into views of bigger float32 buffers."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(1, 150, 4, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 300, 2, 64, generator=g) for _ in range(2))
    mask = Mask(OFFSET, offset=120)
    out, lse = reference.forward(q, k, v, 0.125, mask)
    want = cpu_flash.backward(dout, q, k, v, out, lse, 0.125, mask)
    big = [torch.randn(1, 2 * t.shape[1], t.shape[2], 64, generator=g) for t in (q, k, v)]
    views = [
        b.transpose(1, 2).contiguous().transpose(1, 2)[:, 5 : 5 + t.shape[1]]
        for b, t in zip(big, (q, k, v))
    ]
    before = [x.clone() for x in views]
    cpu_flash.backward_into(*views, dout, q, k, v, out, lse, 0.125, mask)
    for name, view, b0, w in zip(("dq", "dk", "dv"), views, before, want):
        torch.testing.assert_close(view, b0 + w, rtol=0, atol=1e-5, msg=name)


def test_result_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 200, 4, 32, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 600, 2, 32, generator=g) for _ in range(2))
    mask = Mask(BAND, offset=300, lo=-50)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = cpu_flash.forward(q, k, v, 0.2, mask)
            runs.append((out, lse, *cpu_flash.backward(dout, q, k, v, out, lse, 0.2, mask)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_auto_picks_it_for_float32_only():
    q = torch.zeros(1, 8, 2, 64)
    assert kernels.pick("auto", q, Mask(OFFSET, offset=0)) is cpu_flash
    assert (
        kernels.pick("auto", q, Mask(FULL), dlse=True, backward=True) is cpu_flash
    )  # lse gradient natively
    assert kernels.pick("auto", q.bfloat16(), Mask(FULL)) is kernels.sdpa
    assert kernels.pick("auto", torch.zeros(1, 8, 2, 8), Mask(FULL)) is kernels.sdpa  # head_dim 8
    assert (
        kernels.pick("auto", q, Mask(DENSE, dense=torch.ones(8, 8, dtype=torch.bool)))
        is kernels.sdpa
    )


def test_turned_off_by_its_environment_variable():
    script = (
        "import torch, ringkv.kernels as K\n"
        "from ringkv.kernels.mask import Mask, FULL\n"
        "print(K.pick('auto', torch.zeros(1, 4, 1, 64), Mask(FULL)).__name__, "
        "K.BACKENDS['cpu_flash'].unavailable)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RINGKV_NATIVE_FLASH": "0"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ringkv.kernels.sdpa off: RINGKV_NATIVE_FLASH=0"), r.stdout


def test_ab_benchmark_runs_and_writes_its_table(tmp_path):
    """benchmarks/cpu_flash_ab.py on tiny shapes: a row per shape, mask and pass, in the JSON."""
    from benchmarks import cpu_flash_ab

    out = tmp_path / "ab.json"
    assert (
        cpu_flash_ab.main(
            ["--rounds", "1", "--shapes", "40,2,1,16", "100,3,3,32", "--json", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    m, rows = res["machine"], res["rows"]
    assert m["cpu"] and m["isa"] and res["threads"] == m["threads"] == 1 and type(m["cores"]) is int
    assert [(r["seq"], r["mask"], r["pass_"]) for r in rows] == [
        (s, m, p) for s in (40, 100) for m in ("causal", "full") for p in ("fwd", "bwd")
    ]
    assert all(
        r["torch_s"] > 0 and r["ours_s"] > 0 and r["ratio"] == r["ours_s"] / r["torch_s"]
        for r in rows
    )
