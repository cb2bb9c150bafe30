"""Triton attention (ringkv/kernels/triton_attn.py) against the reference backend.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported), so shapes stay small. The ``cuda`` parametrizations
(``pytest -m cuda``) run the same checks on a GPU and skip elsewhere.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton (and ringkv) import it

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton not installed", allow_module_level=True)

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringkv.kernels import BACKENDS, attention, block_backward, block_forward, pick, reference
from ringkv.kernels.mask import DENSE, EMPTY, FULL, OFFSET, Mask
from tests.checks import assert_close

tk = pytest.importorskip("ringkv.kernels.triton_attn", reason="triton not installed")

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
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (out, lse, grads): max error allowed, relative to 1 + max |reference|
TOL = {
    torch.float32: (2e-5, 2e-5, 1e-4),
    torch.float16: (2e-3, 1e-4, 8e-3),
    torch.bfloat16: (1.6e-2, 1e-4, 6e-2),
}


def _device_ok(device):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "CPU runs of Triton kernels need TRITON_INTERPRET=1 (set before triton is imported)"
        )


def make_inputs(b, sq, sk, h, hkv, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g)
    k = torch.randn(b, sk, hkv, d, generator=g)
    v = torch.randn(b, sk, hkv, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


@st.composite
def problems(draw):
    sq = draw(st.integers(1, 70))
    sk = draw(st.integers(1, 70))
    hkv = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from([FULL, OFFSET, OFFSET, EMPTY]))
    # offsets from "every row sees nothing" through the diagonal to "every row sees everything"
    offset = draw(st.integers(-sq - 2, sk + 2))
    return dict(
        b=draw(st.integers(1, 2)),
        sq=sq,
        sk=sk,
        h=hkv * groups,
        hkv=hkv,
        d=draw(st.sampled_from([16, 32, 64])),
        dtype=draw(st.sampled_from(DTYPES)),
        mask=Mask(kind, offset=offset if kind == OFFSET else 0),
        scale=draw(st.sampled_from([None, 0.05, 0.3])),
        seed=draw(st.integers(0, 2**16)),
    )


def _scale(p):
    return 1 / math.sqrt(p["d"]) if p["scale"] is None else p["scale"]


def check_forward(p, device):
    q, k, v = make_inputs(
        p["b"], p["sq"], p["sk"], p["h"], p["hkv"], p["d"], p["dtype"], device, p["seed"]
    )
    out, lse = tk.forward(q, k, v, _scale(p), p["mask"])
    ref_out, ref_lse = reference.forward(q, k, v, _scale(p), p["mask"])
    t_out, t_lse, _ = TOL[p["dtype"]]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, t_out)
    assert_close("lse", lse, ref_lse, t_lse)
    return q, k, v


def check_backward(p, device, merged, with_dlse):
    """Backward of one block given the rows' *final* out/lse, as a ring step calls it.

    ``merged``: out/lse come from attention over this block plus an extra key block (so some
    rows have a finite lse although this block shows them no key); otherwise from the block
    alone (rows that see nothing have lse = -inf and must get zero gradients).
    """
    q, k, v = make_inputs(
        p["b"], p["sq"], p["sk"], p["h"], p["hkv"], p["d"], p["dtype"], device, p["seed"]
    )
    scale, mask = _scale(p), p["mask"]
    g = torch.Generator().manual_seed(p["seed"] + 1)
    dout = torch.randn(q.shape, generator=g).to(device, q.dtype)
    if merged:
        k2, v2 = (
            torch.randn(p["b"], 5, p["hkv"], p["d"], generator=g).to(device, q.dtype) for _ in "kv"
        )
        o1, l1 = reference.forward(q, k, v, scale, mask)
        o2, l2 = reference.forward(q, k2, v2, scale, Mask(FULL))
        lse = torch.logaddexp(l1, l2)
        w1 = torch.exp(l1 - lse).transpose(1, 2)[..., None]  # (B, Sq, H, 1)
        out = (w1 * o1.float() + (1 - w1) * o2.float()).to(q.dtype)
    else:
        out, lse = reference.forward(q, k, v, scale, mask)
    dlse = torch.randn(lse.shape, generator=g).to(device) if with_dlse else None
    got = block_backward(
        dout, q, k, v, out, lse, scale=scale, mask=mask, dlse=dlse, backend="triton"
    )
    want = reference.backward(dout, q, k, v, out, lse, scale, mask, dlse)
    tol = TOL[p["dtype"]][2]
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32, name
        assert_close(name, a, e, tol)


HYP = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=problems())
def test_forward_matches_reference(device, p):
    _device_ok(device)
    check_forward(p, device)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=problems(), merged=st.booleans(), with_dlse=st.booleans())
def test_backward_matches_reference(device, p, merged, with_dlse):
    _device_ok(device)
    check_backward(p, device, merged, with_dlse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [80, 128])
@pytest.mark.parametrize("kind,offset", [(FULL, 0), (OFFSET, -3)])
def test_padded_head_dims(device, d, kind, offset):
    """Head dims that are not powers of two (80) and the large end (128), small sequences."""
    _device_ok(device)
    for dtype in (torch.float32, torch.bfloat16):
        p = dict(
            b=1,
            sq=37,
            sk=45,
            h=4,
            hkv=2,
            d=d,
            dtype=dtype,
            mask=Mask(kind, offset=offset),
            scale=None,
            seed=d,
        )
        check_forward(p, device)
        check_backward(p, device, merged=False, with_dlse=False)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    q0=st.integers(-45, 45),
    k0=st.integers(0, 10),
    step=st.sampled_from([1, 2]),
    causal=st.booleans(),
    groups=st.sampled_from([1, 2]),
    dtype=st.sampled_from(DTYPES),
)
def test_autograd_through_registry(device, sq, sk, q0, k0, step, causal, groups, dtype):
    """``attention(..., backend="triton")``: out, lse and the gradients of both vs the reference."""
    _device_ok(device)
    qpos, kpos = range(q0, q0 + step * sq, step), range(k0, k0 + step * sk, step)
    base = make_inputs(1, sq, sk, 2 * groups, 2, 32, dtype, device, sq * 100 + sk)
    g = torch.Generator().manual_seed(q0 + 50)
    dout = torch.randn(base[0].shape, generator=g).to(device, dtype)
    dlse = torch.randn(1, 2 * groups, sq, generator=g).to(device)
    results = {}
    for backend in ("triton", "reference"):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out, lse = attention(
            q, k, v, causal=causal, q_positions=qpos, k_positions=kpos, backend=backend
        )
        # lse of rows that see nothing is -inf: keep its gradient finite by masking those rows
        torch.autograd.backward([out, torch.where(torch.isinf(lse), 0.0, lse)], [dout, dlse])
        results[backend] = (out, lse, q.grad, k.grad, v.grad)
    t_out, t_lse, t_grad = TOL[dtype]
    for name, a, e, tol in zip(
        ("out", "lse", "dq", "dk", "dv"),
        results["triton"],
        results["reference"],
        (t_out, t_lse, t_grad, t_grad, t_grad),
    ):
        assert_close(name, a, e, tol)


@pytest.mark.parametrize("device", DEVICES)
def test_offset_sweep_across_tile_boundaries(device):
    """Every offset from "nothing visible" to "all visible" on one ragged shape, so each
    loop bound (skipped tiles, unmasked tiles, the masked diagonal) meets every remainder
    modulo the tile sizes."""
    _device_ok(device)
    sq, sk = 37, 50
    for offset in range(-sq - 1, sk + 1):
        p = dict(
            b=1,
            sq=sq,
            sk=sk,
            h=2,
            hkv=1,
            d=16,
            dtype=torch.float32,
            mask=Mask(OFFSET, offset=offset),
            scale=None,
            seed=offset + 100,
        )
        check_forward(p, device)
        if offset % 3 == 0:
            check_backward(p, device, merged=offset % 2 == 0, with_dlse=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_autotuned_configs_match_reference(monkeypatch):
    """The autotuned launch path (the other CUDA tests may pin one config for speed)."""
    monkeypatch.setenv("RINGKV_TRITON_AUTOTUNE", "1")
    p = dict(
        b=2,
        sq=300,
        sk=260,
        h=8,
        hkv=2,
        d=128,
        dtype=torch.bfloat16,
        mask=Mask(OFFSET, offset=-40),
        scale=None,
        seed=1,
    )
    check_forward(p, "cuda")
    check_backward(p, "cuda", merged=True, with_dlse=True)


_COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringkv.kernels import triton_attn as tk, triton_merge as tm, triton_paged as tp

tk.build()
PTRS = {
    "Q",
    "K",
    "V",
    "Out",
    "DO",
    "DK",
    "DV",
    "DQ",
    "Lse",
    "DLse",
    "Delta",
    "Lse2",
    "OutP",
    "LseP",
}
FP32 = {"Lse", "DLse", "Delta", "Lse2", "DK", "DV", "DQ", "OutP", "LseP"}


def build(name, dt, consts, warps=4, stages=2, types=None):
    fn = getattr(tk, name, None) or getattr(tp, name, None) or getattr(tm, name)
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in (types or {}):
            sig[a] = types[a]
        elif a in ("KScale", "VScale"):
            sig[a] = "*fp16"
        elif a in PTRS:
            sig[a] = "*fp32" if a in FP32 else "*" + dt
        elif a in ("BlockTable", "SeqLens", "CuSeqlensQ", "QStart"):
            sig[a] = "*i32"
        elif a in ("qk_scale", "scale", "cap2"):
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    triton.compile(
        ASTSource(fn, sig, consts),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    print("compiled", name, dt, consts, flush=True)


for dt, prec, bd, bm, bn, w, st in [
    ("fp16", "tf32", 128, 128, 64, 8, 3),
    ("bf16", "tf32", 64, 64, 32, 4, 2),
    ("fp32", "ieee", 32, 64, 32, 4, 2),
]:
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        build(
            name,
            dt,
            dict(
                IS_OFFSET=dt != "bf16",
                IS_BAND=False,
                SOFTCAP=False,
                KV_SAME=True,
                PREC=prec,
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_D=bd,
                BLOCK_DV=bd,
            ),
            w,
            st,
        )
build("_bwd_preprocess", "bf16", dict(HAS_DLSE=True, BLOCK_M=32, BLOCK_D=128))
PAGED = dict(
    CAUSAL=True,
    SOFTCAP=False,
    HAS_WINDOW=False,
    HAS_START=False,
    PREC="tf32",
    BLOCK_R=16,
    BLOCK_N=32,
    BLOCK_D=128,
    BLOCK_DV=128,
)
build("_paged_split_kernel", "fp16", dict(PAGED, QUANT=False))
for kv in (
    "*i8",
    "*fp8e4nv",
):  # a quantized cache: one-byte values and fp16 scales (and every feature, Dv < D)
    build(
        "_paged_split_kernel",
        "bf16",
        dict(PAGED, QUANT=True, SOFTCAP=True, HAS_WINDOW=True, HAS_START=True, BLOCK_DV=64),
        types={"K": kv, "V": kv},
    )
build("_paged_reduce_kernel", "fp16", dict(BLOCK_S=64, BLOCK_D=128))
for dt in ("bf16", "fp32"):  # the fused LSE merge: fp32 accumulator, block out in the inputs' dtype
    build(
        "_merge_kernel",
        "fp32",
        dict(BLOCK_R=32, BLOCK_D=128),
        types={"BOut": "*" + dt, "BLse": "*fp32"},
    )
PREFILL = dict(
    CAUSAL=True,
    HAS_START=True,
    SOFTCAP=False,
    HAS_WINDOW=False,
    PREC="tf32",
    BLOCK_M=64,
    BLOCK_N=32,
    BLOCK_D=128,
    BLOCK_DV=128,
)
build("_paged_prefill_kernel", "bf16", dict(PREFILL, QUANT=False))
for kv in ("*i8", "*fp8e4nv"):
    build(
        "_paged_prefill_kernel",
        "bf16",
        dict(PREFILL, QUANT=True, SOFTCAP=True, HAS_WINDOW=True, BLOCK_DV=64),
        types={"K": kv, "V": kv},
    )
build(
    "_paged_prefill_kernel",
    "fp32",
    dict(
        PREFILL,
        QUANT=False,
        CAUSAL=False,
        HAS_START=False,
        PREC="ieee",
        BLOCK_M=32,
        BLOCK_D=64,
        BLOCK_DV=32,
    ),
    stages=1,
)
"""


def compile_for_sm90(script: str, tmp_path, timeout: int = 300) -> str:
    """Run a compile script in a fresh interpreter (no TRITON_INTERPRET; an error fails only its
    test), with triton's PTX/cubin scratch files in a temporary folder (it leaves them behind);
    its stdout. The scripts of this module, test_triton_features.py and test_paged_features.py
    run in ONE interpreter, once per test session (``tests/sm90.py``)."""
    from tests import sm90

    return sm90.compile_for_sm90(script, tmp_path, timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels for real instead")
def test_kernels_compile_for_sm90(tmp_path):
    """Without a GPU, compile the kernels for sm_90 (Hopper) through the real compiler path
    (TTIR -> PTX -> cubin, triton's bundled ptxas): catches what the interpreter accepts but
    the compiler rejects. No GPU is needed to compile, only to run."""
    assert compile_for_sm90(_COMPILE_SCRIPT, tmp_path).count("compiled") == 20


def test_registry_and_supports():
    assert BACKENDS["triton"] is tk
    q = torch.zeros(1, 4, 2, 32)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert tk.supports(q, Mask(FULL)) == interp
    assert tk.supports(q, Mask(OFFSET, offset=2), dlse=True) == interp
    assert tk.supports(q, Mask(EMPTY)) == interp
    assert not tk.supports(q, Mask(DENSE, dense=torch.ones(4, 4, dtype=torch.bool)))
    assert not tk.supports(torch.zeros(1, 4, 2, 512), Mask(FULL))
    assert not tk.supports(q.double(), Mask(FULL))
    if interp:
        with pytest.raises(ValueError, match="does not support"):
            pick("triton", q, Mask(DENSE, dense=torch.ones(4, 4, dtype=torch.bool)))
        # EMPTY blocks never reach the kernel: the registry answers them
        out, lse = block_forward(q, q, q, scale=1.0, mask=Mask(EMPTY), backend="triton")
        assert torch.isinf(lse).all() and not out.any()


_HUGE_OFFSETS_SCRIPT = r"""
import mmap
import torch
from ringkv.kernels import paged, reference, triton_attn as tk, triton_paged as tp
from ringkv.kernels.mask import OFFSET, Mask

R = 2**26  # elements from one row (or cache block) to the next: row 32 starts at element 2**31
S, H, HKV, D = 40, 2, 1, 16  # the interpreter's BLOCK_M = 32, BLOCK_N = 16: tiles cross 2**31
# 10 GiB of address space, no memory: only the pages the kernels touch get backed (MAP_NORESERVE)
mm = mmap.mmap(-1, S * R * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
buf = torch.frombuffer(mm, dtype=torch.float32)
views, col = {}, 0
for name, heads in dict(
    q=H, k=HKV, v=HKV, out=H, dout=H, dq=H, dk=HKV, dv=HKV, kc=2 * HKV, vc=2 * HKV
).items():
    views[name] = buf.as_strided(
        (1, S, heads, D), (S * R, R, D, 1), col
    )  # (B, S, heads, D), rows R apart
    col += heads * D
g = torch.Generator().manual_seed(0)
small = {n: torch.randn(views[n].shape, generator=g) for n in ("q", "k", "v", "dout", "kc", "vc")}
for n, t in small.items():
    views[n].copy_(t)
q, k, v, dout = (views[n] for n in ("q", "k", "v", "dout"))


def close(a, b, what):
    err = (a - b).abs().max().item()
    assert err < 1e-4, (what, err)


mask = Mask(OFFSET, offset=3)
lse = torch.full((1, H, S), float("-inf"))
tk._forward(q, k, v, views["out"], lse, 0.25, mask)
ref_out, ref_lse = reference.forward(small["q"], small["k"], small["v"], 0.25, mask)
close(views["out"], ref_out, "out")
close(lse, ref_lse, "lse")
dlse = torch.randn(1, H, S, generator=g)
tk._backward(
    dout, q, k, v, views["out"], lse, views["dq"], views["dk"], views["dv"], 0.25, mask, dlse
)
want = reference.backward(
    small["dout"], small["q"], small["k"], small["v"], ref_out, ref_lse, 0.25, mask, dlse
)
for name, w in zip(("dq", "dk", "dv"), want):
    close(views[name], w, name)

# paged: a cache of S blocks of 2 tokens, R elements apart; the table reaches the far blocks
kc, vc = (views[n][0].reshape(S, 2, HKV, D) for n in ("kc", "vc"))
table = torch.tensor([[39, 33, 2, 36, 31, 35]], dtype=torch.int32)
lens = torch.tensor([11], dtype=torch.int32)
qd = torch.randn(1, 1, H, D, generator=g)
got = tp.paged_attention_triton(qd, kc, vc, table, lens, num_splits=2)
want = paged.paged_attention_reference(qd, kc, vc, table, lens)
close(got[0], want[0], "paged out")
close(got[1], want[1], "paged lse")
print("ok")
"""


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not sys.platform.startswith("linux"),
    reason="needs the CPU interpreter and Linux's MAP_NORESERVE",
)
def test_offsets_past_2_to_31_elements():
    """Row offsets ``row * stride`` past 2**31 elements (``S_local * H * D >= 2**31``: 512K tokens
    at H=32, D=128). Such tensors cannot be allocated here, so the inputs and outputs are views
    whose rows lie 2**26 elements apart in a 10 GiB *reserved but untouched* anonymous mapping:
    the interpreter reads and writes raw addresses like a GPU, so an int32 product wraps to a
    negative offset and the run crashes (or reads garbage) instead of matching the reference.
    A subprocess, so a crash fails this test rather than the session."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    r = subprocess.run(
        [sys.executable, "-c", _HUGE_OFFSETS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        f"rc={r.returncode} (-11: segfault from a wrapped int32 offset)\n"
        + r.stdout[-2000:]
        + r.stderr[-3000:]
    )
