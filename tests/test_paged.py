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

from ringkv.cache.kv_cache import KVCache
from ringkv.kernels import attention, native, paged, paged_cpu, quant
from ringkv.kernels.paged import paged_attention, paged_attention_reference
from tests.checks import assert_close

try:
    import triton  # noqa: F401
    from ringkv.kernels import triton_paged
except ImportError:
    triton_paged = None
needs_triton = pytest.mark.skipif(triton_paged is None, reason="triton not installed")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
# (out, lse): max error allowed relative to 1 + max |reference|
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-4)}
HYP = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def paged_problems(draw):
    n = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([3, 4, 16]))
    max_blocks = draw(st.integers(1, 6))
    hkv = draw(st.sampled_from([1, 2]))
    # lengths 0 and 1, multiples of the block size and ragged ones, up to the table's capacity
    lens = draw(
        st.lists(
            st.one_of(
                st.sampled_from([0, 1, bs, max_blocks * bs]), st.integers(0, max_blocks * bs)
            ),
            min_size=n,
            max_size=n,
        )
    )
    return dict(
        n=n,
        nq=draw(st.sampled_from([1, 2, 4])),
        h=hkv * draw(st.sampled_from([1, 2, 4])),
        hkv=hkv,
        d=draw(st.sampled_from([16, 32, 64])),
        bs=bs,
        max_blocks=max_blocks,
        num_blocks=draw(st.integers(max_blocks, 2 * max_blocks + 3)),
        lens=lens,
        causal=draw(st.booleans()),
        dtype=draw(st.sampled_from(list(TOL))),
        seed=draw(st.integers(0, 2**16)),
    )


def make_paged(p, device):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["n"], p["nq"], p["h"], p["d"], generator=g)
    kc = torch.randn(p["num_blocks"], p["bs"], p["hkv"], p["d"], generator=g)
    vc = torch.randn(p["num_blocks"], p["bs"], p["hkv"], p["d"], generator=g)
    # each row a random pick from the pool: shuffled, non-contiguous, shared between sequences
    table = torch.stack(
        [torch.randperm(p["num_blocks"], generator=g)[: p["max_blocks"]] for _ in range(p["n"])]
    ).int()
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
        o, ls = attention(q[i : i + 1], k, v, causal=p["causal"])  # "auto": sdpa on CPU
        assert_close(f"out of sequence {i}", out[i], o[0], TOL[p["dtype"]][0])
        assert_close(f"lse of sequence {i}", lse[i], ls[0], TOL[p["dtype"]][1])


@HYP
@given(p=paged_problems(), backend=st.sampled_from(["torch", "cpu"]))
def test_batched_cpu_backends_match_reference(p, backend):
    """The engine's CPU paths against the per-sequence loop: "torch" (one padded gather for all
    sequences) and "cpu" (the compiled kernel reading the cache in place; float32 only, other
    dtypes go to "torch", so it is drawn in float32)."""
    if backend == "cpu":
        p = dict(p, dtype=torch.float32)
    q, kc, vc, table, lens = make_paged(p, "cpu")
    out, lse = paged_attention(q, kc, vc, table, lens, causal=p["causal"], backend=backend)
    ref_out, ref_lse = paged_attention_reference(q, kc, vc, table, lens, causal=p["causal"])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, TOL[p["dtype"]][0])
    assert_close("lse", lse, ref_lse, TOL[p["dtype"]][1])


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=paged_problems(), splits=st.sampled_from([None, 1, 3, 8]))
def test_triton_matches_reference(device, p, splits):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "CPU runs of Triton kernels need TRITON_INTERPRET=1 (set before triton is imported)"
        )
    q, kc, vc, table, lens = make_paged(p, device)
    out, lse = triton_paged.paged_attention_triton(
        q, kc, vc, table, lens, causal=p["causal"], num_splits=splits
    )
    ref_out, ref_lse = paged_attention_reference(q, kc, vc, table, lens, causal=p["causal"])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    t_out, t_lse = TOL[p["dtype"]]
    assert_close("out", out, ref_out, t_out)
    assert_close("lse", lse, ref_lse, t_lse)


@needs_triton
def test_registered_and_splits_fill_a_gpu(monkeypatch):
    assert paged._BACKENDS["triton"] is triton_paged.paged_attention_triton
    monkeypatch.setattr(triton_paged, "_num_sms", lambda device: 132)  # an H100/H200
    # one 128K-token sequence with 8 kv heads: >= 2 programs per SM, chunks >= MIN_CHUNK
    splits = triton_paged.num_splits_for(128 * 1024, 8, torch.device("cuda"))
    assert splits * 8 >= 2 * 132 and 128 * 1024 / splits >= triton_paged.MIN_CHUNK
    assert triton_paged.num_splits_for(300, 8, torch.device("cuda")) == 2  # short: few splits
    assert triton_paged.num_splits_for(128 * 1024, 64 * 8, torch.device("cuda")) == 1  # big batch


# ---- varlen prefill: many new tokens per sequence (chunks, prefix-continued prompts) ----

QUANT_NAMES = [None, "int8"] + (["fp8_e4m3"] if "fp8_e4m3" in quant.FORMATS else [])


@st.composite
def prefill_problems(draw):
    n = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([3, 4, 16]))
    sp = draw(st.sampled_from([1, 1, 2, 3]))
    hkv = draw(st.sampled_from([1, 2]))
    # per sequence: new tokens (0, 1, across query tiles) after a cached prefix (0: a fresh prompt)
    new = draw(
        st.lists(st.sampled_from([0, 1, 5, 17]), min_size=n, max_size=n)
    )  # 17: two query tiles
    prefix = draw(st.lists(st.sampled_from([0, 1, 7, 20]), min_size=n, max_size=n))
    return dict(
        n=n,
        bs=bs,
        sp=sp,
        sp_rank=draw(st.integers(0, sp - 1)),
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 3])),
        d=draw(st.sampled_from([16, 32])),
        new=new,
        prefix=prefix,
        extra_tiles=draw(st.sampled_from([0, 20])),
        causal=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        quant=draw(st.sampled_from(QUANT_NAMES)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_prefill(p, device):
    """Packed q, a (maybe quantized) cache holding each sequence's keys this rank stores (positions
    sp_rank, sp_rank + sp, ... < prefix + new), and the dequantized K/V of each sequence."""
    g = torch.Generator().manual_seed(p["seed"])
    sp, r, bs, hkv, d = p["sp"], p["sp_rank"], p["bs"], p["hkv"], p["d"]
    local = [len(range(r, a + b, sp)) for a, b in zip(p["prefix"], p["new"])]  # keys stored here
    per_seq = [-(-n // bs) + 1 for n in local]  # blocks per table row (one spare)
    num_blocks = sum(per_seq) + 2
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    scales = None
    if p["quant"]:
        fmt, rot = quant.FORMATS[p["quant"]], quant.rotation(d)
        (kc, ks), (vc, vs) = quant.quantize(kc, fmt, rot), quant.quantize(vc, fmt, rot)
        scales = (ks, vs)
        k_val, v_val = quant.dequantize(kc, ks), quant.dequantize(vc, vs)
    else:
        kc, vc = kc.to(p["dtype"]), vc.to(p["dtype"])
        k_val, v_val = kc.float(), vc.float()
    perm = torch.randperm(
        num_blocks, generator=g
    )  # each sequence's blocks: shuffled, non-contiguous
    width = max(per_seq)
    table = torch.zeros(p["n"], width, dtype=torch.int32)
    keys, used = [], 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = perm[used : used + nb]
        used += nb
        blocks = table[i, :nb].long()
        keys.append(
            (
                k_val[blocks].reshape(-1, hkv, d)[: local[i]],
                v_val[blocks].reshape(-1, hkv, d)[: local[i]],
            )
        )
    q = torch.randn(sum(p["new"]), p["h"], d, generator=g).to(p["dtype"])  # (T, H, D)
    cu = torch.tensor([0] + torch.tensor(p["new"]).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(local, dtype=torch.int32)
    start = torch.tensor(p["prefix"], dtype=torch.int32)

    def to(t):
        return t.to(device)

    args = (to(q), to(kc), to(vc), to(table), to(cu), to(lens))
    kw = dict(
        max_seqlen_q=max(p["new"]) + p["extra_tiles"],
        causal=p["causal"],
        sp=sp,
        sp_rank=r,
        q_start=to(start) if sp > 1 or p["seed"] % 2 else None,  # default: the cache's last tokens
        k_scale=to(scales[0]) if scales else None,
        v_scale=to(scales[1]) if scales else None,
    )
    return args, kw, keys


def direct_prefill(q, keys, p):
    """float64 softmax of each sequence's queries over its hand-gathered keys; positions by hand."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    a, g = 0, p["h"] // p["hkv"]
    for (k, v), pre, new in zip(keys, p["prefix"], p["new"]):
        qpos = torch.arange(pre, pre + new)
        kpos = torch.arange(k.shape[0]) * p["sp"] + p["sp_rank"]
        visible = (
            (kpos[None, :] <= qpos[:, None])
            if p["causal"]
            else torch.ones(new, k.shape[0], dtype=torch.bool)
        )
        kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))  # (L, H, D)
        s = torch.einsum("thd,lhd->htl", q[a : a + new].double(), kk) * p["d"] ** -0.5
        s = s.masked_fill(~visible, float("-inf"))
        ls = torch.logsumexp(s, -1)  # (H, T)
        w = torch.exp(s - torch.where(torch.isinf(ls), 0, ls)[..., None]).nan_to_num()
        out[a : a + new] = torch.einsum("htl,lhd->thd", w, vv)
        lse[:, a : a + new] = ls
        a += new
    return out, lse


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=prefill_problems())
def test_prefill_triton_matches_reference(device, p):
    """The varlen prefill kernel, and the torch reference, against direct attention on hand-gathered
    keys: varlen batches, prefix-continued chunks, striped SP shares, GQA, bf16, int8/fp8 caches."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "CPU runs of Triton kernels need TRITON_INTERPRET=1 (set before triton is imported)"
        )
    args, kw, keys = make_prefill(p, device)
    want_o, want_l = direct_prefill(args[0].cpu(), keys, p)
    # bf16: p (and a quantized cache's values) are rounded to bf16 before the products, as on a GPU
    tol_o, tol_l = (
        (2e-5, 2e-5) if p["dtype"] == torch.float32 else (1.6e-2, 1.6e-2 if p["quant"] else 1e-4)
    )
    for impl in (triton_paged.paged_prefill_triton, paged.paged_prefill_reference):
        out, lse = impl(*args, **kw)
        assert (
            out.dtype == args[0].dtype and lse.dtype == torch.float32 and lse.shape == want_l.shape
        )
        assert_close(f"{impl.__name__} out", out, want_o, tol_o)
        assert_close(f"{impl.__name__} lse", lse, want_l, tol_l)


@needs_triton
def test_triton_backend_sends_single_tokens_to_decode_and_chunks_to_prefill(monkeypatch):
    """The dispatcher: Q = 1 (or forced splits) -> flash-decoding; Q > 1 -> the prefill kernel,
    whose (N * Q, H, D) / (H, N * Q) results come back as (N, Q, H, D) / (N, H, Q)."""
    calls = []
    for name in ("paged_decode_triton", "paged_prefill_triton"):
        real = getattr(triton_paged, name)
        monkeypatch.setattr(
            triton_paged, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
        )
    p = dict(
        n=2,
        nq=3,
        h=4,
        hkv=2,
        d=16,
        bs=4,
        max_blocks=5,
        num_blocks=9,
        lens=[3, 19],
        causal=True,
        dtype=torch.float32,
        seed=3,
    )
    q, kc, vc, table, lens = make_paged(p, "cpu")
    want = paged_attention_reference(q, kc, vc, table, lens)
    got = paged_attention(q, kc, vc, table, lens, backend="triton")
    assert calls == ["paged_prefill_triton"]
    assert_close("out", got[0], want[0], 2e-5)
    assert_close("lse", got[1], want[1], 2e-5)
    paged_attention(q[:, -1:], kc, vc, table, lens, backend="triton")
    triton_paged.paged_attention_triton(q, kc, vc, table, lens, num_splits=2)
    assert calls[1:] == ["paged_decode_triton", "paged_decode_triton"]
    with pytest.raises(ValueError, match="sp_rank"):
        paged.paged_prefill(
            q[0], kc, vc, table, torch.tensor([0, 3, 3]), lens, max_seqlen_q=3, sp=2, sp_rank=2
        )


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_cpu_kernel_builds_and_is_the_cpu_default():
    """Where a C compiler is, the kernel builds and ``auto`` picks it on the CPU (a failed build
    would silently fall back to the slower "torch" backend)."""
    assert paged_cpu.available()
    assert paged.auto_backend("cpu") == "cpu"


def test_cpu_kernel_checks_blocks_and_ignores_the_thread_count():
    """A block id outside the cache where a query reads is a ValueError, not a wild read; one
    past the read range is not looked at; the result is bitwise the same on 1 and 2 threads."""
    if not paged_cpu.available():
        pytest.skip(
            "the kernel did not build here (test_cpu_kernel_builds_and_is_the_cpu_default says why)"
        )
    g = torch.Generator().manual_seed(0)
    q, kc, vc = (
        torch.randn(3, 2, 6, 32, generator=g),
        torch.randn(10, 4, 2, 32, generator=g),
        torch.randn(10, 4, 2, 32, generator=g),
    )
    table = torch.tensor([[1, 2, 3], [4, 5, 99], [7, -1, -5]], dtype=torch.int32)
    lens = torch.tensor(
        [12, 8, 4], dtype=torch.int32
    )  # row 1 reads blocks 4, 5; row 2 block 7 only
    out, lse = paged_attention(q, kc, vc, table, lens, backend="cpu")
    ref_out, ref_lse = paged_attention_reference(q, kc, vc, table, lens)
    assert_close("out", out, ref_out, 2e-5)
    assert_close("lse", lse, ref_lse, 2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = paged_attention(q, kc, vc, table, lens, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, out)
    for bad in (99, -1):
        forged = table.clone()
        forged[0, 1] = bad
        with pytest.raises(ValueError, match="outside"):
            paged_attention(q, kc, vc, forged, lens, backend="cpu")
    with pytest.raises(ValueError, match="capacity"):
        paged_attention(q, kc, vc, table, lens + 1, backend="cpu")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    hkv=st.integers(1, 4),
    d=st.sampled_from([8, 24, 64]),
    t=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_cache_write_in_c_is_index_copy(hkv, d, t, seed):
    """``KVCache.write`` of a float32 CPU cache (one C call, ``paged_cpu.write``) stores what
    torch's ``index_copy_`` stores; a slot outside the cache is an IndexError before anything is
    written; what the kernel does not take (float64 rows) goes through torch, the same."""
    if paged_cpu.library() is None:
        pytest.skip(
            "the kernel did not build here (test_cpu_kernel_builds_and_is_the_cpu_default says why)"
        )
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(2, hkv, d, block_size=4, num_blocks=8)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g))
    ref = kv.data.clone()
    slots = torch.randperm(32, generator=g)[:t]
    k, v = (torch.randn(t, hkv, d, generator=g) for _ in range(2))
    assert paged_cpu.write(kv.k(1).view(-1, hkv, d), kv.v(1).view(-1, hkv, d), k, v, slots)
    for i, x in enumerate((k, v)):
        ref[1, i].view(-1, hkv, d).index_copy_(0, slots, x)
    assert torch.equal(kv.data, ref)
    kv.write(0, k.double(), v.double(), slots)  # not the kernel's: torch's path
    for i, x in enumerate((k, v)):
        ref[0, i].view(-1, hkv, d).index_copy_(0, slots, x)
    assert torch.equal(kv.data, ref)
    if t:
        forged = slots.clone()
        forged[-1] = 32
        with pytest.raises(IndexError, match="outside"):
            kv.write(1, k + 1, v + 1, forged)
        assert torch.equal(kv.data, ref)


def spread_problem(d, nq, g, spread, lens, seed):
    """Sequences of ``lens`` keys in a shuffled paged cache (block size 16, 2 K/V heads, GQA ``g``),
    ``nq`` queries each with scores scaled by ``spread``:
    ``q, k_cache, v_cache, table, seq_lens``."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv = 16, 2
    blocks = max(1, -(-max(lens) // bs))
    q = torch.randn(len(lens), nq, hkv * g, d, generator=gen) * spread
    kc, vc = (torch.randn(len(lens) * blocks + 1, bs, hkv, d, generator=gen) for _ in range(2))
    table = (
        torch.randperm(kc.shape[0], generator=gen)[: len(lens) * blocks]
        .view(len(lens), blocks)
        .int()
    )
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    d=st.sampled_from([8, 20, 24, 64, 128, 136]),
    nq=st.integers(1, 3),
    g=st.sampled_from([1, 3]),
    spread=st.sampled_from([1.0, 8.0, 25.0]),
    lens=st.lists(st.integers(0, 90), min_size=1, max_size=6),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_softmax_and_head_sizes(d, nq, g, spread, lens, causal, seed):
    """The kernel's own softmax (a vectorized exp, the row's last partial group of 8 through a
    padded copy) and its V sums (kept in registers for head sizes that are multiples of 8 up to
    128, a plain loop otherwise) against the float64 reference, with scores spread so that many
    of exp(score - max) fall below float32's normal range; up to 6 sequences, so that work items
    are whole sequences (at least 2 per thread) or single K/V heads."""
    if not paged_cpu.available():
        pytest.skip(
            "the kernel did not build here (test_cpu_kernel_builds_and_is_the_cpu_default says why)"
        )
    q, kc, vc, table, seq_lens = spread_problem(d, nq, g, spread, lens, seed)
    out, lse = paged_attention(q, kc, vc, table, seq_lens, causal=causal, backend="cpu")
    ref_out, ref_lse = paged_attention_reference(
        q.double(), kc.double(), vc.double(), table, seq_lens, causal=causal
    )
    assert_close("out", out, ref_out, 2e-5)
    assert_close("lse", lse, ref_lse, 2e-5)


def _rows_dense(parts, t, h, d):
    out, lse = torch.zeros(t, h, d), torch.full((h, t), float("nan"))
    for p in parts:
        out[p.rows] = p.out.float()
        if p.lse is not None:
            lse[:, p.rows] = p.lse
    return out, lse


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    sp=st.sampled_from([1, 2]),
    bs=st.sampled_from([4, 16]),
    quant_fmt=st.sampled_from([None, "int8"]),
    backend=st.sampled_from(["torch", "cpu"]),
)
def test_cpu_steps_of_many_sequences(seed, sp, bs, quant_fmt, backend):
    """A step of many sequences (decode rows and a few chunks, lengths 1-200, SP-striped or not):
    every row's out and lse from the "torch" backend (which pads each length group to its own
    longest) and the "cpu" one (the compiled kernel; a quantized cache goes to "torch") equal the
    reference backend's."""
    from ringkv.kernels.paged import PagedSeq, LayerCache, plan_step
    from ringkv.kernels.paged_torch import GROUP_MIN

    g = torch.Generator().manual_seed(seed)
    hkv, h, d, num_blocks = 2, 4, 16, 2200
    rng = torch.randint(1, 200, (2 * GROUP_MIN + 9,), generator=g).tolist()
    seqs, row = [], 0
    pool = torch.randperm(num_blocks, generator=g).tolist()
    for i, total in enumerate(rng):
        n = (
            (3 if i % 16 == 7 else 12) if i % 8 == 7 and total > 12 else 1
        )  # 12 > paged_cpu.MAX_QUERIES
        table = [pool.pop() for _ in range(max(1, -(-(total // sp + 1) // bs)))]
        seqs.append(PagedSeq(row=row, start=total - n, n=n, block_table=table))
        row += n
    q = torch.randn(row, h, d, generator=g)
    k, v = (
        torch.randn(num_blocks, bs, hkv, d, generator=g),
        torch.randn(num_blocks, bs, hkv, d, generator=g),
    )
    cache = LayerCache(k, v)
    if quant_fmt is not None:
        fmt, rot = quant.FORMATS[quant_fmt], quant.rotation(d)
        (kq, ks), (vq, vs) = quant.quantize(k, fmt, rot), quant.quantize(v, fmt, rot)
        cache = LayerCache(kq, vq, ks, vs)
    for rank in range(sp):
        torch_step = plan_step(seqs, block_size=bs, sp=sp, sp_rank=rank, backend=backend)
        if backend == "torch":
            assert len(torch_step.groups) >= 3  # the decode rows were split
        ref = plan_step(seqs, block_size=bs, sp=sp, sp_rank=rank, backend="reference")
        want_out, want_lse = _rows_dense(ref.attend(q, cache), row, h, d)
        got_out, got_lse = _rows_dense(torch_step.attend(q, cache), row, h, d)
        assert_close("out", got_out, want_out, 2e-5)
        assert_close("lse", got_lse, want_lse, 2e-5)
        if sp == 1:  # the engine's path without lse (every row sees a key)
            fast_out, _ = _rows_dense(torch_step.attend(q, cache, lse=False), row, h, d)
            assert_close("out (no lse)", fast_out, want_out, 2e-5)
