"""``kernels/pointwise.py``: the eager CPU step's RMSNorm, RoPE and SiLU x up in C, against the
torch ops they replace (RoPE to the bit, the others to float32 rounding), on every target this CPU
runs, over drawn shapes; and where the torch ops run instead (autograd, tracing, layouts the
kernels do not take, shapes that do not fit), so a bad call gets torch's error, never a read out of
bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ringkv.kernels import native, pointwise as pw
from tests.test_kernel_isa import ISA

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")
HYP = settings(max_examples=25, deadline=None)


def test_on_here_where_a_compiler_is():
    assert pw.library() is not None
    s = pw.status()
    assert s["kernel"] == "pointwise" and s["tiles"]


@ISA
@HYP
@given(
    t=st.one_of(st.integers(1, 20), st.integers(200, 300)),
    d=st.integers(1, 200),
    plus_one=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_torch(isa, t, d, plus_one, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(t, d, generator=g) * 4, torch.randn(d, generator=g)
    got = pw._rms_norm(pw.library(isa), x, w, 1e-6, plus_one)
    want = pw._torch_rms_norm(x.double(), w.double(), 1e-6, plus_one)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


@ISA
@HYP
@given(
    t=st.integers(1, 40),
    hq=st.integers(1, 9),
    hk=st.integers(1, 4),
    half=st.integers(1, 40),
    extra=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_rope_is_torchs_to_the_bit(isa, t, hq, hk, half, extra, seed):
    g = torch.Generator().manual_seed(seed)
    rd = 2 * half  # the rotated channels; the rest of the head (extra) pass through
    q, k = torch.randn(t, hq, rd + extra, generator=g), torch.randn(t, hk, rd + extra, generator=g)
    cos, sin = torch.randn(t, 1, rd, generator=g), torch.randn(t, 1, rd, generator=g)
    qo, ko = pw._rope(pw.library(isa), q, k, cos, sin)
    assert torch.equal(qo, pw.rotate_half(q, cos, sin))
    assert torch.equal(ko, pw.rotate_half(k, cos, sin))


@ISA
@HYP
@given(n=st.integers(1, 3000), scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_silu_mul_matches_torch(isa, n, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(n, generator=g) * scale, torch.randn(n, generator=g)
    got = pw._silu_mul(pw.library(isa), gate, up)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)


def test_large_rows_split_over_threads_give_the_same_bits():
    """Past the size where the threads share the rows, each row is still one thread's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(400, 576, generator=g), torch.randn(576, generator=g)
    gate, up = torch.randn(400, 1536, generator=g), torch.randn(400, 1536, generator=g)
    lib, threads = pw.library(), torch.get_num_threads()
    many = pw._rms_norm(lib, x, w, 1e-5, False), pw._silu_mul(lib, gate, up)
    torch.set_num_threads(1)
    try:
        one = pw._rms_norm(lib, x, w, 1e-5, False), pw._silu_mul(lib, gate, up)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(many, one))
    assert torch.equal(many[0][7], pw._rms_norm(lib, x[7:8], w, 1e-5, False)[0])


def test_the_public_calls_run_the_kernels_without_autograd(monkeypatch):
    calls = []
    for name in ("_rms_norm", "_rope", "_silu_mul"):
        real = getattr(pw, name)
        monkeypatch.setattr(pw, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x, w = torch.randn(3, 8), torch.randn(8)
    q, k, cs = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    with torch.no_grad():
        pw.rms_norm(x, w, 1e-5)
        pw.rope(q, k, cs, cs)
        pw.silu_mul(x, x)
    assert calls == ["_rms_norm", "_rope", "_silu_mul"]
    calls.clear()
    # autograd on: torch's ops, with their gradients
    xg = x.clone().requires_grad_()
    pw.rms_norm(xg, w, 1e-5).sum().backward()
    assert xg.grad is not None and calls == []
    with torch.no_grad():
        # layouts and shapes the kernels do not take: torch's ops (and torch's errors)
        pw.rope(q.transpose(0, 1).contiguous().transpose(0, 1), k, cs, cs)
        pw.silu_mul(x, x[:, :1])  # broadcast
        pw.rms_norm(x.double(), w.double(), 1e-5)
        assert calls == []
        with pytest.raises(RuntimeError):
            pw.rms_norm(x, torch.randn(5), 1e-5)
        with pytest.raises(RuntimeError):
            pw.rope(q, torch.randn(2, 1, 8), cs, cs)  # fewer tokens than q
        with pytest.raises(RuntimeError):
            pw.silu_mul(x, torch.randn(2, 8))
    assert calls == []
    with torch.no_grad():  # a non-contiguous x: the norm runs on a contiguous copy
        want = pw._torch_rms_norm(x.t(), w[:3], 1e-5, False)
        torch.testing.assert_close(pw.rms_norm(x.t(), w[:3], 1e-5), want)
    assert calls == ["_rms_norm"]
    assert pw.rms_norm(torch.randn(3, 0), torch.randn(0), 1e-5).shape == (3, 0)  # torch's


def test_a_traced_graph_gets_the_torch_ops():
    """Under torch.compile (dynamo; the eager backend: no inductor) the kernels are not called:
    a ctypes call would break the graph, and the compiled graph fuses these ops itself."""

    def layer(x, w, q, k, cs):
        q, k = pw.rope(q, k, cs, cs)
        return pw.silu_mul(pw.rms_norm(x, w, 1e-5), x), q, k

    x, w = torch.randn(3, 8), torch.randn(8)
    q, k, cs = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    with torch.no_grad():
        traced = torch.compile(layer, backend="eager", fullgraph=True, dynamic=False)
        traced = traced(x, w, q, k, cs)
        eager = layer(x, w, q, k, cs)
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a, b)
