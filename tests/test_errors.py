"""Bad input to the kernel entry points raises ValueError/TypeError naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from ringkv.kernels import attention, attention_backward
from ringkv.kernels.paged import paged_attention, paged_attention_reference
from ringkv.kernels.merge import merge


B, SQ, SK, H, HKV, D = 2, 4, 6, 4, 2, 16


def qkv(**shapes):
    """q (B, Sq, H, D), k/v (B, Sk, Hkv, D), with any of the six shapes overridden."""
    s = dict(b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D) | shapes
    return (
        torch.randn(s["b"], s["sq"], s["h"], s["d"]),
        torch.randn(s["b"], s["sk"], s["hkv"], s["d"]),
        torch.randn(s["b"], s["sk"], s["hkv"], s["d"]),
    )


Q, K, V = qkv()

ATTENTION_CASES = [
    # (name, args, kwargs, error, message)
    ("q not a tensor", (Q.tolist(), K, V), {}, TypeError, r"q must be a torch.Tensor, got list"),
    ("q 3-D", (Q[0], K, V), {}, ValueError, r"q must be 4-D \(batch, seq, heads, head_dim\)"),
    ("k 5-D", (Q, K[None], V), {}, ValueError, r"k must be 4-D"),
    ("v 2-D", (Q, K, V[0, 0]), {}, ValueError, r"v must be 4-D"),
    ("batch mismatch", (Q, *qkv(b=3)[1:]), {}, ValueError, r"same batch size, got 2 and 3"),
    ("head_dim mismatch", (Q, *qkv(d=32)[1:]), {}, ValueError, r"same head_dim, got 16 and 32"),
    ("k/v seq mismatch", (Q, K, V[:, :3]), {}, ValueError, r"k and v must have the same shape"),
    (
        "k/v kv_heads mismatch",
        (Q, K, V[:, :, :1]),
        {},
        ValueError,
        r"k and v must have the same shape",
    ),
    (
        "softcap 0",
        (Q, K, V),
        {"softcap": 0.0},
        ValueError,
        r"softcap must be None or a finite float > 0",
    ),
    (
        "softcap negative",
        (Q, K, V),
        {"softcap": -3},
        ValueError,
        r"softcap must be None or a finite float > 0",
    ),
    (
        "softcap nan",
        (Q, K, V),
        {"softcap": float("nan")},
        ValueError,
        r"softcap must be None or a finite float",
    ),
    (
        "sinks wrong shape",
        (Q, K, V),
        {"sinks": torch.zeros(3)},
        ValueError,
        r"sinks must have shape \(heads,\) = \(4,\)",
    ),
    (
        "sinks per kv head",
        (Q, K, V),
        {"sinks": torch.zeros(2)},
        ValueError,
        r"sinks must have shape",
    ),
    (
        "sinks int",
        (Q, K, V),
        {"sinks": torch.zeros(4, dtype=torch.long)},
        ValueError,
        r"sinks must be None or a floating tensor",
    ),
    (
        "sinks not a tensor",
        (Q, K, V),
        {"sinks": [0.0] * 4},
        ValueError,
        r"sinks must be None or a floating tensor",
    ),
    (
        "softcap on a backend without it",
        (Q, K, V),
        {"softcap": 5.0, "backend": "sdpa"},
        ValueError,
        r"softcap: backend 'sdpa' has no logit soft-capping",
    ),
    (
        "H % Hkv != 0",
        qkv(h=3),
        {},
        ValueError,
        r"query heads \(3\) must be a positive multiple of kv heads \(2\)",
    ),
    ("no query heads", qkv(h=0), {}, ValueError, r"query heads \(0\) must be a positive multiple"),
    ("no kv heads", qkv(hkv=0), {}, ValueError, r"multiple of kv heads \(0\)"),
    ("head_dim 0", qkv(d=0), {}, ValueError, r"head_dim must be at least 1"),
    (
        "int tensors",
        [t.long() for t in (Q, K, V)],
        {},
        TypeError,
        r"q must be a floating tensor.*int64",
    ),
    ("int v", (Q, K, V.int()), {}, TypeError, r"v must be a floating tensor.*int32"),
    (
        "mixed dtypes",
        (Q, K.half(), V),
        {},
        TypeError,
        r"share one dtype, got torch.float32, torch.float16",
    ),
    (
        "q_positions too short",
        (Q, K, V),
        dict(causal=True, q_positions=range(3)),
        ValueError,
        r"q_positions has 3 positions but the tensor has 4 tokens",
    ),
    (
        "k_positions tensor too long",
        (Q, K, V),
        dict(causal=True, k_positions=torch.arange(7)),
        ValueError,
        r"k_positions must have shape \(6,\)",
    ),
    (
        "positions 2-D",
        (Q, K, V),
        dict(causal=True, k_positions=torch.arange(6)[None]),
        ValueError,
        r"k_positions must have shape \(6,\)",
    ),
    (
        "positions float",
        (Q, K, V),
        dict(causal=True, q_positions=torch.arange(4.0)),
        TypeError,
        r"q_positions must be an integer tensor, got dtype torch.float32",
    ),
    (
        "positions bool",
        (Q, K, V),
        dict(causal=True, q_positions=torch.ones(4, dtype=torch.bool)),
        TypeError,
        r"q_positions must be an integer tensor",
    ),
    (
        "positions list",
        (Q, K, V),
        dict(causal=True, q_positions=[0, 1, 2, 3]),
        TypeError,
        r"q_positions must be None, a range or a 1-D integer tensor, got list",
    ),
    (
        "positions decreasing range",
        (Q, K, V),
        dict(causal=True, k_positions=range(5, -1, -1)),
        ValueError,
        r"k_positions must be increasing \(range step > 0\)",
    ),
    (
        "positions checked without causal",
        (Q, K, V),
        dict(q_positions=range(5)),
        ValueError,
        r"q_positions has 5 positions",
    ),
    (
        "causal not a bool",
        (Q, K, V),
        dict(causal=torch.ones(4, 6, dtype=torch.bool)),
        TypeError,
        r"causal must be True or False, got Tensor",
    ),
    (
        "unknown backend",
        (Q, K, V),
        dict(backend="flash"),
        ValueError,
        r"unknown backend 'flash'; choose one of \[.*'reference'.*\] or 'auto'",
    ),
    (
        "scale a string",
        (Q, K, V),
        dict(scale="0.1"),
        TypeError,
        r"scale must be a finite float.*'0.1'",
    ),
    (
        "scale a tensor",
        (Q, K, V),
        dict(scale=torch.tensor(0.1)),
        TypeError,
        r"scale must be a finite float",
    ),
    ("scale a bool", (Q, K, V), dict(scale=True), TypeError, r"scale must be a finite float.*True"),
    (
        "scale inf",
        (Q, K, V),
        dict(scale=float("inf")),
        TypeError,
        r"scale must be a finite float.*inf",
    ),
]


@pytest.mark.parametrize(
    "name,args,kwargs,error,message", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES]
)
def test_attention_rejects(name, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        attention(*args, **kwargs)


def test_unsupported_backend_names_the_way_out():
    if torch.cuda.is_available():
        pytest.skip("flash_attn may be usable here")
    with pytest.raises(
        ValueError, match=r"backend 'flash_attn' does not support cpu .*use backend='auto'"
    ):
        attention(Q, K, V, backend="flash_attn")


OUT, LSE = attention(Q, K, V)
DOUT = torch.randn_like(OUT)

BACKWARD_CASES = [
    (
        "dout wrong shape",
        dict(dout=DOUT[:, :3]),
        ValueError,
        r"dout must have shape \(2, 4, 4, 16\)",
    ),
    ("out wrong shape", dict(out=OUT[..., :8]), ValueError, r"out must have shape \(2, 4, 4, 16\)"),
    ("dout not a tensor", dict(dout=None), TypeError, r"dout must be a torch.Tensor, got NoneType"),
    (
        "dout int",
        dict(dout=DOUT.long()),
        TypeError,
        r"dout must have q's dtype torch.float32, got torch.int64",
    ),
    ("dout other dtype", dict(dout=DOUT.double()), TypeError, r"dout must have q's dtype"),
    (
        "lse wrong shape",
        dict(lse=LSE[..., :3]),
        ValueError,
        r"lse must have shape \(batch, heads, seq_q\) = \(2, 4, 4\)",
    ),
    ("lse not fp32", dict(lse=LSE.bfloat16()), TypeError, r"lse must be float32"),
    ("lse missing", dict(lse=None), TypeError, r"lse must be a float32 torch.Tensor"),
    ("dlse wrong shape", dict(dlse=torch.zeros(2, 4)), ValueError, r"dlse must have shape"),
    ("q int", dict(q=Q.long()), TypeError, r"q must be a floating tensor"),
    ("k/v mismatch", dict(v=V[:, :2]), ValueError, r"k and v must have the same shape"),
    (
        "H % Hkv",
        dict(k=K[:, :, :1].expand(-1, -1, 3, -1), v=V[:, :, :1].expand(-1, -1, 3, -1)),
        ValueError,
        r"query heads \(4\) must be a positive multiple of kv heads \(3\)",
    ),
    (
        "positions wrong length",
        dict(causal=True, q_positions=range(3)),
        ValueError,
        r"q_positions has 3 positions but the tensor has 4 tokens",
    ),
    (
        "positions wrong type",
        dict(causal=True, k_positions=(0, 1, 2, 3, 4, 5)),
        TypeError,
        r"k_positions must be None, a range or a 1-D integer tensor, got tuple",
    ),
    ("unknown backend", dict(backend="nope"), ValueError, r"unknown backend 'nope'"),
    ("scale a string", dict(scale="x"), TypeError, r"scale must be a finite float"),
]


@pytest.mark.parametrize(
    "name,change,error,message", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES]
)
def test_attention_backward_rejects(name, change, error, message):
    args = dict(dout=DOUT, q=Q, k=K, v=V, out=OUT, lse=LSE)
    kwargs = {key: change.pop(key) for key in list(change) if key not in args}
    args |= change
    with pytest.raises(error, match=message):
        attention_backward(*args.values(), **kwargs)


def test_attention_backward_accepts_what_attention_returns():
    dq, dk, dv = attention_backward(DOUT, Q, K, V, OUT, LSE, dlse=torch.zeros_like(LSE))
    assert dq.shape == Q.shape and dk.shape == K.shape and dv.shape == V.shape


# ---------------------------------------------------------------------------- paged decode

N, BS, NB = 2, 4, 8
PQ = torch.randn(N, 1, H, D)
KC, VC = torch.randn(NB, BS, HKV, D), torch.randn(NB, BS, HKV, D)
TABLE = torch.arange(NB).view(N, NB // N)  # (N, max_blocks): 4 blocks of 4 tokens each
LENS = torch.tensor([5, 9])

PAGED_CASES = [
    ("q not a tensor", dict(q=PQ.tolist()), TypeError, r"q must be a torch.Tensor, got list"),
    ("seq_lens a list", dict(seq_lens=[5, 9]), TypeError, r"seq_lens must be a torch.Tensor"),
    ("q 3-D", dict(q=PQ[:, 0]), ValueError, r"q must be \(N, Q, H, D\)"),
    (
        "cache 3-D",
        dict(k_cache=KC[0], v_cache=VC[0]),
        ValueError,
        r"k_cache \(num_blocks, block_size, Hkv, D\)",
    ),
    ("k/v cache mismatch", dict(v_cache=VC[:4]), ValueError, r"k_cache and v_cache must match"),
    ("head_dim mismatch", dict(q=torch.randn(N, 1, H, 8)), ValueError, r"need the same head_dim"),
    ("H % Hkv", dict(q=torch.randn(N, 1, 3, D)), ValueError, r"heads % kv_heads == 0"),
    (
        "no kv heads",
        dict(k_cache=KC[:, :, :0], v_cache=VC[:, :, :0]),
        ValueError,
        r"heads % kv_heads == 0",
    ),
    (
        "int tensors",
        dict(q=PQ.long(), k_cache=KC.long(), v_cache=VC.long()),
        TypeError,
        r"share one floating dtype, got torch.int64",
    ),
    (
        "mixed dtypes",
        dict(k_cache=KC.bfloat16()),
        TypeError,
        r"share one floating dtype, got torch.float32, torch.bfloat16, torch.float32",
    ),
    (
        "batch mismatch",
        dict(q=torch.randn(3, 1, H, D)),
        ValueError,
        r"block_table must be \(N, max_blocks\).*N = 3",
    ),
    ("table 1-D", dict(block_table=TABLE[0]), ValueError, r"block_table must be \(N, max_blocks\)"),
    (
        "seq_lens wrong length",
        dict(seq_lens=torch.tensor([5, 9, 1])),
        ValueError,
        r"seq_lens \(N,\)",
    ),
    (
        "table float",
        dict(block_table=TABLE.float()),
        TypeError,
        r"must be integer tensors, got torch.float32",
    ),
    ("seq_lens float", dict(seq_lens=LENS.float()), TypeError, r"must be integer tensors"),
    (
        "seq_lens past the table",
        dict(seq_lens=torch.tensor([5, 17])),
        ValueError,
        r"seq_lens must lie in \[0, max_blocks \* block_size = 16\]",
    ),
    (
        "seq_lens negative",
        dict(seq_lens=torch.tensor([-1, 9])),
        ValueError,
        r"seq_lens must lie in \[0",
    ),
    ("scale a string", dict(scale="x"), TypeError, r"scale must be a finite float"),
]


@pytest.mark.parametrize("name,change,error,message", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_reference_rejects(name, change, error, message):
    args = dict(q=PQ, k_cache=KC, v_cache=VC, block_table=TABLE, seq_lens=LENS)
    kwargs = {key: change.pop(key) for key in list(change) if key not in args}
    args |= change
    with pytest.raises(error, match=message):
        paged_attention_reference(*args.values(), **kwargs)


def test_paged_unknown_backend():
    with pytest.raises(
        ValueError, match=r"unknown paged backend 'nope'; choose from \[.*'reference'"
    ):
        paged_attention(PQ, KC, VC, TABLE, LENS, backend="nope")


def test_paged_reference_accepts_good_input():
    out, lse = paged_attention_reference(PQ, KC, VC, TABLE, LENS)
    assert out.shape == PQ.shape and lse.shape == (N, H, 1) and torch.isfinite(lse).all()


def test_merge_needs_partials():
    with pytest.raises(ValueError, match=r"same, non-zero number of outs and lses, got 0 and 0"):
        merge([], [])
    with pytest.raises(ValueError, match=r"got 1 and 2"):
        merge([OUT], [LSE, LSE])
