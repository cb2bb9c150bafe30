"""Paged decode: the torch reference against direct attention, and the Triton flash-decoding
kernel (ringkv/kernels/triton_paged.py) against the reference.

Block tables are random draws from a shared pool: non-contiguous, shuffled, and blocks
shared between sequences. Without CUDA the Triton kernel runs in the CPU interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton (and ringkv) import it

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringkv.kernels import attention, paged
from ringkv.kernels.paged import paged_attention, paged_attention_reference

try:
    import triton  # noqa: F401
    from ringkv.kernels import triton_paged
except ImportError:
    triton_paged = None
needs_triton = pytest.mark.skipif(triton_paged is None, reason="triton not installed")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
# (out, lse): max error allowed relative to 1 + max |reference|
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-4)}
HYP = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def assert_close(actual, expected, tol, what):
    a, e = actual.float().cpu(), expected.float().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in the result"
    assert torch.equal(torch.isinf(a), torch.isinf(e)), f"{what}: infinities differ"
    fin = torch.isfinite(e)
    if fin.any():
        err = (a[fin] - e[fin]).abs().max().item()
        bound = tol * (1 + e[fin].abs().max().item())
        assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@st.composite
def paged_problems(draw):
    n = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([3, 4, 16]))
    max_blocks = draw(st.integers(1, 6))
    hkv = draw(st.sampled_from([1, 2]))
    # lengths 0 and 1, multiples of the block size and ragged ones, up to the table's capacity
    lens = draw(st.lists(st.one_of(st.sampled_from([0, 1, bs, max_blocks * bs]),
                                   st.integers(0, max_blocks * bs)), min_size=n, max_size=n))
    return dict(n=n, nq=draw(st.sampled_from([1, 2, 4])), h=hkv * draw(st.sampled_from([1, 2, 4])),
                hkv=hkv, d=draw(st.sampled_from([16, 32, 64])), bs=bs, max_blocks=max_blocks,
                num_blocks=draw(st.integers(max_blocks, 2 * max_blocks + 3)), lens=lens,
                causal=draw(st.booleans()), dtype=draw(st.sampled_from(list(TOL))),
                seed=draw(st.integers(0, 2**16)))


def make_paged(p, device):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["n"], p["nq"], p["h"], p["d"], generator=g)
    kc = torch.randn(p["num_blocks"], p["bs"], p["hkv"], p["d"], generator=g)
    vc = torch.randn(p["num_blocks"], p["bs"], p["hkv"], p["d"], generator=g)
    # each row a random pick from the pool: shuffled, non-contiguous, shared between sequences
    table = torch.stack([torch.randperm(p["num_blocks"], generator=g)[: p["max_blocks"]]
                         for _ in range(p["n"])]).int()
    lens = torch.tensor(p["lens"], dtype=torch.int32)
    q, kc, vc = (t.to(device=device, dtype=p["dtype"]) for t in (q, kc, vc))
    return q, kc, vc, table.to(device), lens.to(device)


@HYP
@given(p=paged_problems())
def test_reference_matches_direct_attention(p):
    """The reference against gathering each sequence's keys by hand + ``kernels.attention``."""
    q, kc, vc, table, lens = make_paged(p, "cpu")
    out, lse = paged_attention_reference(q, kc, vc, table, lens, causal=p["causal"])
    for i, length in enumerate(p["lens"]):
        slots = [(int(table[i, t // p["bs"]]), t % p["bs"]) for t in range(length)]
        k = torch.stack([kc[b, s] for b, s in slots])[None] if slots else kc[:0, 0][None]
        v = torch.stack([vc[b, s] for b, s in slots])[None] if slots else vc[:0, 0][None]
        # default positions: keys 0..L-1, the Q queries aligned to the end (L - Q + i)
        o, l = attention(q[i:i + 1], k, v, causal=p["causal"])  # "auto": sdpa on CPU
        assert_close(out[i], o[0], TOL[p["dtype"]][0], f"out of sequence {i}")
        assert_close(lse[i], l[0], TOL[p["dtype"]][1], f"lse of sequence {i}")


@HYP
@given(p=paged_problems())
def test_batched_torch_backend_matches_reference(p):
    """The engine's CPU path (one padded gather for all sequences) against the per-sequence loop."""
    q, kc, vc, table, lens = make_paged(p, "cpu")
    out, lse = paged_attention(q, kc, vc, table, lens, causal=p["causal"], backend="torch")
    ref_out, ref_lse = paged_attention_reference(q, kc, vc, table, lens, causal=p["causal"])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, TOL[p["dtype"]][0], "out")
    assert_close(lse, ref_lse, TOL[p["dtype"]][1], "lse")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=paged_problems(), splits=st.sampled_from([None, 1, 3, 8]))
def test_triton_matches_reference(device, p, splits):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of Triton kernels need TRITON_INTERPRET=1 (set before triton is imported)")
    q, kc, vc, table, lens = make_paged(p, device)
    out, lse = triton_paged.paged_attention_triton(q, kc, vc, table, lens, causal=p["causal"],
                                                   num_splits=splits)
    ref_out, ref_lse = paged_attention_reference(q, kc, vc, table, lens, causal=p["causal"])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    t_out, t_lse = TOL[p["dtype"]]
    assert_close(out, ref_out, t_out, "out")
    assert_close(lse, ref_lse, t_lse, "lse")


@needs_triton
def test_registered_and_splits_fill_a_gpu(monkeypatch):
    assert paged._BACKENDS["triton"] is triton_paged.paged_attention_triton
    monkeypatch.setattr(triton_paged, "_num_sms", lambda device: 132)  # an H100/H200
    # one 128K-token sequence with 8 kv heads: >= 2 programs per SM, chunks >= MIN_CHUNK
    splits = triton_paged.num_splits_for(128 * 1024, 8, torch.device("cuda"))
    assert splits * 8 >= 2 * 132 and 128 * 1024 / splits >= triton_paged.MIN_CHUNK
    assert triton_paged.num_splits_for(300, 8, torch.device("cuda")) == 2  # short: few splits
    assert triton_paged.num_splits_for(128 * 1024, 64 * 8, torch.device("cuda")) == 1  # big batch
