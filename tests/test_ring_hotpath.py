"""The ring's hot path (issue #15 items 2, 3, 6): the merge lives with the kernels, argument
agreement is remembered, no host synchronisation in ring forward/backward, one fused merge,
each block merged once, dK/dV on the wire in ``grad_comm_dtype``."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ringkv
from ringkv import kernels
from ringkv.kernels import merge as merge_mod, sdpa
from ringkv.kernels.mask import BAND, OFFSET, Mask
from ringkv.sp import LocalComm, layout as layout_mod
from tests.test_ring import _assert_close, _reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_import_nothing_from_sp():
    """Dependencies point downward: every module of ringkv.kernels imports without ringkv.sp
    (the ``ringkv`` package's own __init__, which imports sp, is bypassed)."""
    script = (
        f"import sys, types, pkgutil, importlib\n"
        f"pkg = types.ModuleType('ringkv'); pkg.__path__ = [{os.path.join(ROOT, 'ringkv')!r}]\n"
        f"sys.modules['ringkv'] = pkg\n"
        f"import ringkv.kernels as k\n"
        f"for m in pkgutil.iter_modules(k.__path__):\n"
        f"    try: importlib.import_module('ringkv.kernels.' + m.name)\n"
        f"    except ImportError: pass\n"
        "bad = sorted(m for m in sys.modules if m.startswith('ringkv.') and not "
        "m.startswith('ringkv.kernels'))\n"
        f"assert not bad, bad\n"
        "print('merge' in dir(k), len([m for m in sys.modules if "
        "m.startswith('ringkv.kernels.')]))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 8  # the modules were really imported
    assert ringkv.merge_ is merge_mod.merge_ and ringkv.merge is merge_mod.merge  # the public names


def _partials(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(2, 11, 3, 40, generator=g)
    lse = torch.randn(2, 3, 11, generator=g) * 4
    bo = torch.randn(2, 11, 3, 40, generator=g).to(dtype)
    bl = torch.randn(2, 3, 11, generator=g) * 4
    lse[0, 1, :3] = float("-inf")  # rows no partial saw so far
    acc[0, :3, 1] = 0
    bl[0, 1, 1:5] = float(
        "-inf"
    )  # rows 1, 2: neither partial saw a key; rows 3, 4: only the accumulator
    bl[1, 2, 7] = float("-inf")
    lse[1, 0, 5], bl[1, 0, 5] = 80.0, -60.0  # a large gap
    return acc, lse, bo, bl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_equals_eager(dtype):
    """The Triton merge (run by the interpreter here, compiled for sm_90 in test_triton) equals
    the eager torch merge, on strided views of the accumulator, with -inf rows and large gaps."""
    tm = pytest.importorskip("ringkv.kernels.triton_merge")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    acc, lse, bo, bl = _partials(0, dtype)
    want = acc.clone(), lse.clone()
    merge_mod.merge_eager_(want[0][:, 2:9], want[1][:, :, 2:9], bo[:, 2:9], bl[:, :, 2:9])
    got = acc.clone(), lse.clone()
    tm.merge_(got[0][:, 2:9], got[1][:, :, 2:9], bo[:, 2:9], bl[:, :, 2:9])  # views: rows 2..8
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1])) and not torch.isnan(got[0]).any()
    torch.testing.assert_close(
        got[1].nan_to_num(0, 0, 0), want[1].nan_to_num(0, 0, 0), atol=1e-6, rtol=1e-6
    )
    # a transposed accumulator (what sdpa returns) and a transposed block lse
    t = torch.randn(2, 3, 11, 40).transpose(1, 2)
    w, g2 = t.clone(), t.clone()
    merge_mod.merge_eager_(w, lse.clone(), bo, bl)
    tm.merge_(g2, lse.clone(), bo, bl.transpose(1, 2).contiguous().transpose(1, 2))
    torch.testing.assert_close(g2, w, atol=1e-6, rtol=1e-6)


def test_pairs_is_host_arithmetic():
    for sq, sk, hi, lo in itertools.product(range(1, 6), range(1, 6), range(-6, 7), range(-6, 7)):
        for m in [Mask(OFFSET, offset=hi)] + ([Mask(BAND, offset=hi, lo=lo)] if lo <= hi else []):
            assert m.pairs(sq, sk) == int(m.visible(sq, sk).sum()), (m, sq, sk)


class _NoHostSync(TorchDispatchMode):
    """Fails on the op that ``.item()``, ``.tolist()``-by-item and ``bool(tensor)`` go through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True, layout="zigzag"),
        dict(causal=False, layout="striped"),
        dict(causal=True, layout="contiguous", window=(5, 0)),
        dict(causal=True, layout="zigzag", cu_seqlens=[0, 13, 40, 48]),
    ],
)
def test_ring_forward_backward_make_no_host_sync(kw):
    """Every ring step of ranks 0..2 of 3 (LocalComm: the schedule without a network) under a
    dispatch mode that fails on a device-to-host read: forward and backward."""
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        bool(torch.ones(1) > 0)  # the mode does see a read
    cu = kw.get("cu_seqlens")
    s_local = 16 if cu is None else layout_mod.varlen_local_len(cu, kw["layout"], 3)
    for rank in range(3):
        q, k, v = (torch.randn(1, s_local, 4, 16, requires_grad=True) for _ in range(3))
        if rank == 0:  # the backend probes (once per process, they compare on the host) run first
            ringkv.ring_attention(q, k, v, comm=LocalComm(rank, 3), **kw).sum().backward()
            chosen = ringkv.kernels.pick("auto", q, Mask(OFFSET, offset=0), backward=True).__name__
            assert chosen.rsplit(".", 1)[-1] in (
                "cpu_flash",
                "sdpa",
            )  # a fused kernel, not the reference
        with _NoHostSync():
            out = ringkv.ring_attention(
                q, k, v, comm=LocalComm(rank, 3), grad_comm_dtype=torch.bfloat16, **kw
            )
            out.sum().backward()
        assert q.grad is not None and k.grad is not None


def test_cu_seqlens_tensor_is_read_once(monkeypatch):
    reads = []
    real = layout_mod._check_cu_seqlens
    monkeypatch.setattr(
        layout_mod, "_check_cu_seqlens", lambda cu: reads.append(torch.is_tensor(cu)) or real(cu)
    )
    cu = torch.tensor([0, 5, 12])
    q = torch.randn(1, 8, 2, 8)  # each document padded to 8, 4 rows per rank each
    for _ in range(3):
        ringkv.ring_attention(q, q, q, causal=True, cu_seqlens=cu, comm=LocalComm(0, 2))
    assert sum(reads) == 1  # tensors read (lists and tuples cost nothing to check)
    cu[1] = 6  # modified in place: read again
    ringkv.ring_attention(q, q, q, causal=True, cu_seqlens=cu, comm=LocalComm(0, 2))
    assert sum(reads) == 2


def test_each_block_partial_merged_once(monkeypatch):
    """In a ring forward every fused sdpa call's partial is merged into the accumulator exactly
    once, except the first partial over all rows, which becomes the accumulator (no merge)."""
    fused, merges = [], []
    real_fused, real_merge = sdpa._fused, merge_mod.merge_
    monkeypatch.setattr(sdpa, "_fused", lambda *a, **kw: fused.append(1) or real_fused(*a, **kw))
    counting = lambda *a: merges.append(1) or real_merge(*a)  # noqa: E731
    monkeypatch.setattr(sdpa, "merge_", counting)
    monkeypatch.setattr(kernels, "merge_", counting)
    for layout, causal, rank in [
        ("zigzag", True, 2),
        ("striped", True, 1),
        ("contiguous", False, 0),
        ("contiguous", True, 3),
    ]:
        fused.clear(), merges.clear()
        q = torch.randn(1, 16, 2, 8)
        ringkv.ring_attention(
            q, q, q, causal=causal, layout=layout, comm=LocalComm(rank, 4), backend="sdpa"
        )
        assert len(merges) == len(fused) - 1, (layout, causal, len(fused), len(merges))
    q = torch.randn(1, 16, 2, 8)
    fused.clear(), merges.clear()
    ringkv.ring_attention(
        q, q, q, causal=True, backend="sdpa"
    )  # one rank: one tile, nothing merged
    assert (len(fused), len(merges)) == (1, 0)


def test_sdpa_into_equals_out_of_place():
    """forward_into / backward_into accumulate what forward / backward return."""
    g = torch.Generator().manual_seed(3)
    q, dout = torch.randn(2, 12, 4, 16, generator=g), torch.randn(2, 12, 4, 16, generator=g)
    k, v = torch.randn(2, 9, 2, 16, generator=g), torch.randn(2, 9, 2, 16, generator=g)
    for off in (-4, -1, 0, 2, 5, 20):
        mask = Mask(OFFSET, offset=off)
        out, lse = sdpa.forward(q, k, v, 0.25, mask)
        ref_out, ref_lse = kernels.reference.forward(q, k, v, 0.25, mask)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        acc, acc_lse = merge_mod.empty_partial(2, 12, 4, 16)
        sdpa.forward_into(q, k, v, 0.25, mask, acc, acc_lse)
        torch.testing.assert_close(acc, out.float(), atol=1e-6, rtol=1e-6)
        want = sdpa.backward(dout, q, k, v, out, lse, 0.25, mask)
        got = [torch.ones(t.shape) for t in (q, k, v)]
        sdpa.backward_into(*got, dout, q, k, v, out, lse, 0.25, mask)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.float() + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather", "usp"])
def test_repeated_calls_make_no_agreement_collective(world, method):
    """First call: one argument check (one all-gather); the same configuration again: none; a
    changed configuration: one; the first configuration again: none (remembered)."""
    res = world.check("tests.hotpath_cases:agreement_counts", 4, method)
    agree = [[c[0] for c in r] for r in res]
    assert all(a == [1, 0, 0, 1, 0] for a in agree), agree
    if (
        method != "allgather"
    ):  # their only all-gathers are the argument checks (USP: one per mesh axis)
        per_check = 2 if method == "usp" else 1
        assert all([c[1] for c in r] == [per_check * a for a in (1, 0, 0, 1, 0)] for r in res), res


def test_grad_comm_dtype_bf16(world):
    """dK/dV on the wire in bf16: gradients still match the reference (fp32 inputs, a bf16-sized
    tolerance) and the backward's dK/dV messages are half the bytes."""
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 24, 4, 16, generator=g) for _ in range(4))
    want = _reference(q, k, v, dout, None, True, None)
    got = {
        dt: world.check("tests.hotpath_cases:grad_comm", 3, q, k, v, dout, True, "zigzag", dt)
        for dt in (None, torch.bfloat16)
    }
    for rank, res in enumerate(got[torch.bfloat16]):
        for name, grad, full in zip(["dq", "dk", "dv"], res[:3], want[2:]):
            _assert_close(
                name,
                grad,
                ringkv.shard(full, 1, "zigzag", rank=rank, world=3),
                torch.bfloat16,
                rank,
            )
        kv_bytes = 2 * 8 * 4 * 16 * 4  # one K/V message (fp32 inputs) per hop
        assert got[None][rank][3] == 2 * kv_bytes + 2 * kv_bytes  # 2 K/V hops, 2 dK/dV hops in fp32
        assert res[3] == 2 * kv_bytes + kv_bytes  # ... and the dK/dV hops in bf16: half
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        ringkv.ring_attention(q, k, v, grad_comm_dtype=torch.int8)
