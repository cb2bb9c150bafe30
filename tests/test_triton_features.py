"""Triton attention's native features (issue #42): V with its own head size ``Dv`` and logit
soft-capping, forward and backward (the lse gradient included), under FULL / OFFSET / BAND masks.

The oracle is written out here in float64 with autograd (scores, ``cap * tanh(s / cap)``, the
mask, softmax over the visible keys), so the kernels' tanh derivative is checked against
differentiation rather than against the same formula. On a machine without CUDA the kernels run
in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported), so shapes
stay small; the ``cuda`` parametrizations (``pytest -m cuda``) run the same checks on a GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

# test_triton sets TRITON_INTERPRET on a machine without CUDA before triton imports, and skips
# without triton
from tests.checks import assert_close  # noqa: E402
from tests.test_triton import DEVICES, _device_ok, compile_for_sm90, tk  # noqa: E402
from ringkv.kernels.mask import BAND, EMPTY, FULL, OFFSET, Mask  # noqa: E402

DTYPES = [torch.float32, torch.float32, torch.float16, torch.bfloat16]  # fp32 drawn half the time
# (out, lse, grads): max error allowed, relative to 1 + max |oracle|
TOL = {
    torch.float32: (2e-5, 2e-5, 1e-4),
    torch.float16: (2e-3, 2e-4, 1e-2),
    torch.bfloat16: (1.6e-2, 2e-4, 6e-2),
}
HYP = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


def oracle(q, k, v, scale, mask, softcap):
    """float64 attention: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, H,
    Dv), lse (B, H, Sq) (-inf and out 0 for rows that see no key), differentiable by autograd."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(h // hkv, dim=2)  # (B, Sk, H, D): query head h reads kv head h // G
    vr = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale  # (B, H, Sq, Sk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    vis = mask.visible(sq, sk, q.device)
    seen = vis.any(-1)  # (Sq,)
    s = s.masked_fill(~vis, float("-inf"))
    s = torch.where(seen[:, None], s, torch.zeros_like(s))  # rows with no key: finite, zeroed below
    lse = torch.logsumexp(s, -1)  # (B, H, Sq)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vr)
    out = torch.where(seen[None, :, None, None], out, torch.zeros_like(out))
    return out, torch.where(seen, lse, torch.full_like(lse, float("-inf")))


def oracle_grads(q, k, v, scale, mask, softcap, dout, dlse):
    """float64 ``out, lse`` and the gradients of ``sum(out * dout) + sum(lse * dlse)`` (finite lse
    only)."""
    q, k, v = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out, lse = oracle(q, k, v, scale, mask, softcap)
    loss = (out * dout.double().cpu()).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isinf(lse), 0.0, lse * dlse.double().cpu()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@st.composite
def masks(draw, sq, sk):
    """FULL, EMPTY, causal (bottom-right), OFFSET from "nothing visible" to "all visible", and BAND
    windows (wide, narrow, ones leaving rows with no key)."""
    kind = draw(st.sampled_from([FULL, "causal", OFFSET, BAND, BAND, EMPTY]))
    if kind == "causal":
        return Mask(OFFSET, offset=sk - sq)
    if kind in (FULL, EMPTY):
        return Mask(kind)
    offset = draw(st.integers(-sq - 2, sk + 2))
    if kind == OFFSET:
        return Mask(OFFSET, offset=offset)
    return Mask(BAND, offset=offset, lo=offset - draw(st.integers(0, sq + sk + 2)))


@st.composite
def problems(draw):
    sq, sk = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([16, 32, 24]))
    return dict(
        b=draw(st.integers(1, 2)),
        sq=sq,
        sk=sk,
        hkv=hkv,
        h=hkv * draw(st.sampled_from([1, 2, 3])),
        d=d,
        dv=draw(st.sampled_from([d, 8, 16, 32, 40])),
        mask=draw(masks(sq, sk)),
        softcap=draw(st.one_of(st.none(), st.floats(1.0, 5.0), st.just(50.0))),
        scale=draw(st.sampled_from([None, 0.3, 1.0])),
        amp=draw(st.sampled_from([1.0, 3.0])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


# the cases the issue names, pinned so every run has them: Dv < D, Dv > D, a small and a large cap
PINNED = [
    dict(
        b=1,
        sq=37,
        sk=45,
        hkv=2,
        h=4,
        d=32,
        dv=16,
        mask=Mask(OFFSET, offset=3),
        softcap=1.0,
        scale=None,
        amp=3.0,
        dtype=torch.float32,
        seed=1,
    ),
    dict(
        b=2,
        sq=29,
        sk=40,
        hkv=1,
        h=3,
        d=16,
        dv=32,
        mask=Mask(BAND, offset=4, lo=-17),
        softcap=50.0,
        scale=1.0,
        amp=1.0,
        dtype=torch.float32,
        seed=2,
    ),
]


def make_inputs(p, device):
    """q, k, v in ``p["dtype"]`` on ``device``, and float64 dout / dlse (``amp`` widens the
    scores)."""
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["sq"], p["h"], p["d"], generator=g) * p["amp"]
    k = torch.randn(p["b"], p["sk"], p["hkv"], p["d"], generator=g)
    v = torch.randn(p["b"], p["sk"], p["hkv"], p["dv"], generator=g)
    dout = torch.randn(p["b"], p["sq"], p["h"], p["dv"], generator=g, dtype=torch.float64)
    dlse = torch.randn(p["b"], p["h"], p["sq"], generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=p["dtype"]) for t in (q, k, v)] + [dout, dlse]


def _scale(p):
    return 1 / math.sqrt(p["d"]) if p["scale"] is None else p["scale"]


def _cap(p):
    return {} if p["softcap"] is None else dict(softcap=p["softcap"])


def check_block(p, device, with_dlse):
    """One block: forward out/lse, then backward from that out/lse, against the float64 oracle."""
    q, k, v, dout, dlse = make_inputs(p, device)
    scale, mask = _scale(p), p["mask"]
    out, lse = tk.forward(q, k, v, scale, mask, **_cap(p))
    want = oracle_grads(q, k, v, scale, mask, p["softcap"], dout, dlse if with_dlse else None)
    t_out, t_lse, t_grad = TOL[p["dtype"]]
    assert (
        out.dtype == q.dtype
        and out.shape == (p["b"], p["sq"], p["h"], p["dv"])
        and lse.dtype == torch.float32
    )
    assert_close("out", out, want[0], t_out)
    assert_close("lse", lse, want[1], t_lse)
    if mask.kind == EMPTY:  # the registry answers EMPTY blocks; the module still gives zeros
        return
    grads = tk.backward(
        dout.to(device, q.dtype),
        q,
        k,
        v,
        out,
        lse,
        scale,
        mask,
        dlse.float().to(device) if with_dlse else None,
        **_cap(p),
    )
    for name, a, e in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert a.dtype == torch.float32, name
        assert_close(name, a, e, t_grad)


def check_split(p, device, split, with_dlse):
    """Keys in two blocks ``[:split]`` and ``[split:]`` (each with its own sub-mask, as a ring step
    sees them), merged by lse; each block's backward from the *final* out/lse (some rows see no key
    of one block but have a finite lse); dq summed over blocks, dk/dv concatenated."""
    q, k, v, dout, dlse = make_inputs(p, device)
    scale, mask, sq, sk = _scale(p), p["mask"], p["sq"], p["sk"]
    parts = [(0, split), (split, sk)]
    outs, lses = [], []
    for k0, k1 in parts:
        o, s = tk.forward(q, k[:, k0:k1], v[:, k0:k1], scale, mask.block(0, sq, k0, k1), **_cap(p))
        outs.append(o.double())
        lses.append(s.double())
    lse = torch.logaddexp(*lses)
    w = [
        torch.where(torch.isinf(s), 0.0, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)))
        for s in lses
    ]  # (B, H, Sq) each block's share of the row
    out = sum(wi.transpose(1, 2)[..., None] * o for wi, o in zip(w, outs)).to(q.dtype)
    lse = lse.float()
    want = oracle_grads(q, k, v, scale, mask, p["softcap"], dout, dlse if with_dlse else None)
    t_out, t_lse, t_grad = TOL[p["dtype"]]
    assert_close("merged out", out, want[0], t_out)
    assert_close("merged lse", lse, want[1], t_lse)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dks, dvs = [], []
    for k0, k1 in parts:
        g = tk.backward(
            dout.to(device, q.dtype),
            q,
            k[:, k0:k1],
            v[:, k0:k1],
            out,
            lse,
            scale,
            mask.block(0, sq, k0, k1),
            dlse.float().to(device) if with_dlse else None,
            **_cap(p),
        )
        dq += g[0].double().cpu()
        dks.append(g[1])
        dvs.append(g[2])
    for name, a, e in zip(("dq", "dk", "dv"), (dq, torch.cat(dks, 1), torch.cat(dvs, 1)), want[2:]):
        assert_close(name, a, e, t_grad)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=problems(), with_dlse=st.booleans())
@example(p=PINNED[0], with_dlse=True)
@example(p=PINNED[1], with_dlse=False)
def test_block_matches_float64(device, p, with_dlse):
    _device_ok(device)
    check_block(p, device, with_dlse)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(p=problems(), frac=st.floats(0.0, 1.0), with_dlse=st.booleans())
@example(p=dict(PINNED[0], mask=Mask(BAND, offset=10, lo=-12)), frac=0.5, with_dlse=True)
def test_split_keys_merged_by_lse(device, p, frac, with_dlse):
    _device_ok(device)
    if p["mask"].kind == EMPTY:
        p = dict(p, mask=Mask(FULL))
    check_split(p, device, round(frac * p["sk"]), with_dlse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,dv,dtype", [(192, 128, torch.bfloat16), (64, 96, torch.float32)])
def test_wide_head_dims(device, d, dv, dtype):
    """MLA's shape (qk 192, v 128: padded to 256 and 128 wide tiles) and a non-power-of-two Dv >
    D."""
    _device_ok(device)
    p = dict(
        b=1,
        sq=21,
        sk=35,
        hkv=1,
        h=2,
        d=d,
        dv=dv,
        mask=Mask(OFFSET, offset=14),
        softcap=5.0,
        scale=None,
        amp=2.0,
        dtype=dtype,
        seed=d + dv,
    )
    check_block(p, device, with_dlse=True)


def test_module_contract():
    assert tk.FEATURES == frozenset({"softcap", "dv"})
    q = torch.zeros(1, 4, 2, 32)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert tk.supports(q, Mask(BAND, offset=2, lo=-1)) == interp
    if not interp:
        return
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match="softcap"):
            tk.forward(q, q, q, 1.0, Mask(FULL), softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            tk.backward(q, q, q, q, q, torch.zeros(1, 2, 4), 1.0, Mask(FULL), softcap=bad)
    with pytest.raises(ValueError, match="Dv"):
        tk.forward(q, q, torch.zeros(1, 4, 2, 512), 1.0, Mask(FULL))


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringkv.kernels import triton_attn as tk

tk.build()
PTRS = {"Q", "K", "V", "Out", "Lse", "DO", "DK", "DV", "DQ", "Delta", "Lse2"}
FP32 = {"Lse", "Delta", "Lse2", "DK", "DV", "DQ"}
for dt, prec, bd, bdv in [
    ("bf16", "tf32", 256, 128),
    ("fp16", "tf32", 32, 64),
    ("fp32", "ieee", 32, 16),
    ("fp16", "tf32", 64, 64),
]:
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        fn = getattr(tk, name)
        consts = dict(
            IS_OFFSET=True,
            IS_BAND=dt != "fp16" or bd == bdv,
            SOFTCAP=dt != "fp32",
            KV_SAME=bd == bdv,
            PREC=prec,
            BLOCK_M=64,
            BLOCK_N=32,
            BLOCK_D=bd,
            BLOCK_DV=bdv,
        )
        sig = {
            a: "constexpr"
            if a in consts
            else ("*fp32" if a in FP32 else "*" + dt)
            if a in PTRS
            else "fp32"
            if a in ("qk_scale", "cap2", "scale")
            else "i32"
            for a in fn.arg_names
        }
        triton.compile(
            ASTSource(fn, sig, consts),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4, num_stages=1 if bd > 128 else 2),
        )
        print("compiled", name, dt, flush=True)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels for real instead")
def test_feature_kernels_compile_for_sm90(tmp_path):
    """The softcap, BAND and Dv != D variants through the real compiler for sm_90 (what the
    interpreter accepts but the compiler rejects: names bound under a constexpr ``if``, tile
    shapes)."""
    assert compile_for_sm90(_COMPILE_SCRIPT, tmp_path).count("compiled") == 12
