"""Backend plumbing that needs no GPU: flash-attn's version adapters, cuDNN's op schema, the probe,
the routing of backward and lse-gradient calls, and ``describe()``.

The flash-attn tests check *our adapters*, not flash-attn: each fake below has exactly the ``def``
line of one release's private function (file and tag cited), records how it was called and returns
distinct tensors, so a misplaced argument or a wrong return index fails here. Whether the real
kernels compute the right thing is the probe's job on a GPU (``kernels.dispatch._probe``).
"""

import json
import types
import warnings
from typing import Optional, Tuple

import pytest
import torch

import ringkv.kernels as K
from ringkv.kernels import block_backward, cudnn, pick, reference
from ringkv.kernels.flash_attn import FA2_ADAPTERS, FA3_ADAPTERS, FlashBackend, _tiles, select
from ringkv.kernels.merge import merge_
from ringkv.kernels.mask import BAND, FULL, OFFSET, Mask

CALLS = []


def _record(kind, args):
    CALLS.append((kind, dict(args)))


def _result(q):
    """(out, lse) a fake forward returns: out (B, S, H, D) like q, lse (B, H, S) fp32, both
    recognisable."""
    return q * 2, q.float().sum(-1).transpose(1, 2).contiguous() + 100


def _fill(dq, dk, dv):
    dq.fill_(1.0), dk.fill_(2.0), dv.fill_(3.0)


# ---- flash-attn v2.6.3, flash_attn/flash_attn_interface.py (same parameters in v2.6.0-v2.6.3)


def fa26_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    _record("fwd", locals())
    out, lse = _result(q)
    return (
        out,
        q,
        k,
        v,
        out + 1,
        lse,
        None,
        None,
    )  # out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state


def fa26_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _record("bwd", locals())
    _fill(dq, dk, dv)
    return dq, dk, dv, softmax_lse + 1  # dq, dk, dv, softmax_d


# ---- flash-attn v2.8.3, flash_attn/flash_attn_interface.py (same parameters since v2.7.0): torch
# custom
# ops (``torch.library.custom_op``, as there), forward returns (out, softmax_lse, S_dmask,
# rng_state),
# the backward fills dq, dk, dv and returns softmax_d


@torch.library.custom_op("ringkv_test::fa27_forward", mutates_args=())
def fa27_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _record("fwd", locals())
    out, lse = _result(q)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("ringkv_test::fa27_backward", mutates_args=("dq", "dk", "dv"))
def fa27_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _record("bwd", locals())
    _fill(dq, dk, dv)
    return softmax_lse + 1


# ---- FlashAttention-3 at tag v2.8.3, hopper/flash_attn_interface.py (same parameters
# v2.8.0-v2.8.3)


def fa3_28_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    _record("fwd", locals())
    return (*_result(q), None, None)  # out, softmax_lse, *rest


def fa3_28_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    sequed_q,
    sequed_k,
    max_seqlen_q,
    max_seqlen_k,
    dq,
    dk,
    dv,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):
    _record("bwd", locals())
    _fill(dq, dk, dv)
    return dq, dk, dv, softmax_lse + 1


# ---- FlashAttention-3 after v2.8.3 (main, 2025), hopper/flash_attn_interface.py: window split in
# two,
# ``out_``, the backward's ``is_causal``; forward returns (out, softmax_lse, out_accum,
# softmax_lse_accum)


def fa3_main_forward(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    qv=None,
    out_=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    _record("fwd", locals())
    return (*_result(q), torch.empty(0), torch.empty(0))


def fa3_main_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    sequed_q=None,
    sequed_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dq=None,
    dk=None,
    dv=None,
    softmax_scale=None,
    is_causal=False,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):
    _record("bwd", locals())
    _fill(dq, dk, dv)
    return softmax_lse + 1


RELEASES = [  # (table, version, forward, backward, adapter name)
    (FA2_ADAPTERS, "2.6.3", fa26_forward, fa26_backward, "flash-attn 2.6"),
    (FA2_ADAPTERS, "2.7.0.post2", fa27_forward, fa27_backward, "flash-attn 2.7-2.8"),
    (FA2_ADAPTERS, "2.8.3", fa27_forward, fa27_backward, "flash-attn 2.7-2.8"),
    (
        FA3_ADAPTERS,
        None,
        fa3_28_forward,
        fa3_28_backward,
        "FlashAttention-3 (window_size tuple, v2.8.0-v2.8.3)",
    ),
    (
        FA3_ADAPTERS,
        None,
        fa3_main_forward,
        fa3_main_backward,
        "FlashAttention-3 (window_size_left/right, after v2.8.3)",
    ),
]


def _backend(table, version, fwd, bwd):
    return FlashBackend(
        "fake",
        types.SimpleNamespace(_flash_attn_forward=fwd, _flash_attn_backward=bwd),
        table,
        version,
    )


def _window(call):
    return (
        tuple(call["window_size"])
        if "window_size" in call
        else (call["window_size_left"], call["window_size_right"])
    )


def _inputs(sq=6, sk=9):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, sq, 4, 16, generator=g)
    k, v = (torch.randn(2, sk, 2, 16, generator=g) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("table,version,fwd,bwd,name", RELEASES, ids=[r[4] for r in RELEASES])
def test_adapter_calls_each_release_with_its_own_arguments(table, version, fwd, bwd, name):
    be = _backend(table, version, fwd, bwd)
    assert be.adapter is not None and be.adapter.name == name, be.unavailable
    q, k, v = _inputs()
    CALLS.clear()
    out, lse = be.forward(q, k, v, 0.3, Mask(FULL))
    ((kind, c),) = CALLS
    assert (
        kind == "fwd"
        and c["softmax_scale"] == 0.3
        and c["causal"] is False
        and _window(c) == (-1, -1)
    )
    assert torch.equal(c["q"], q) and torch.equal(c["k"], k) and torch.equal(c["v"], v)
    for off in ("dropout_p", "softcap"):
        assert c.get(off, 0.0) == 0.0
    assert c.get("alibi_slopes") is None and c.get("return_softmax", False) is False
    assert all(c[p] is None for p in ("k_new", "page_table", "q_descale", "cu_seqlens_q") if p in c)
    want_out, want_lse = _result(q)  # unpacked from the right places (not out_padded, not a q copy)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)

    dout = torch.randn_like(q)
    lse = lse.clone()
    lse[0, 0, 0] = float("-inf")  # a row that saw no key goes in as 0
    CALLS.clear()
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, 0.3, Mask(FULL))
    ((kind, c),) = CALLS
    assert (
        kind == "bwd" and c["softmax_scale"] == 0.3 and c.get("causal", c.get("is_causal")) is False
    )
    assert (
        _window(c) == (-1, -1)
        and c.get("deterministic", False) is False
        and c.get("rng_state") is None
    )
    assert torch.equal(c["dout"], dout) and torch.equal(c["out"], out)
    assert c["softmax_lse"][0, 0, 0] == 0 and torch.equal(
        c["softmax_lse"].flatten()[1:], lse.flatten()[1:]
    )
    assert c["dq"].shape == q.shape and c["dk"].shape == k.shape  # GQA: dk/dv with the kv heads
    assert dq.dtype == torch.float32 and (dq == 1).all() and (dk == 2).all() and (dv == 3).all()


@pytest.mark.parametrize("table,version,fwd,bwd,name", RELEASES, ids=[r[4] for r in RELEASES])
def test_adapter_passes_tiles_causal_flag_and_window(table, version, fwd, bwd, name):
    """OFFSET masks: one call per tile of ``_tiles`` (causal only on the square one); BAND: the
    window."""
    be = _backend(table, version, fwd, bwd)
    q, k, v = _inputs()
    for mask in (Mask(OFFSET, offset=4), Mask(BAND, offset=2, lo=-3)):
        tiles = _tiles(mask, q.shape[1], k.shape[1])
        CALLS.clear()
        be.forward(q, k, v, 0.3, mask)
        be.backward(torch.randn_like(q), q, k, v, *_result(q), 0.3, mask)
        assert [c[0] for c in CALLS] == ["fwd"] * len(tiles) + ["bwd"] * len(tiles)
        for (_, c), (r, cols, causal, window) in zip(CALLS, tiles + tiles):
            assert c.get("causal", c.get("is_causal")) is causal and _window(c) == tuple(window)
            assert torch.equal(c["q"], q[:, r]) and torch.equal(c["k"], k[:, cols])


def test_adapter_selection_by_version_and_signature():
    for version in ("2.5.9", "2.9.0", "3.0.0"):
        adapter, why = select(FA2_ADAPTERS, fa27_forward, fa27_backward, version)
        assert adapter is None and "outside the supported 2.6-2.8" in why
    # a version's number with another release's functions: refused, not called wrongly
    for version, fwd, bwd in (
        ("2.6.3", fa27_forward, fa27_backward),
        ("2.7.4", fa26_forward, fa26_backward),
        ("2.8.0", fa27_forward, fa26_backward),
    ):
        be = _backend(FA2_ADAPTERS, version, fwd, bwd)
        assert be.adapter is None and "match none of" in be.unavailable
        assert not be.supports(torch.zeros(1, 4, 2, 64, dtype=torch.float16), Mask(FULL))
    assert select(FA3_ADAPTERS, fa26_forward, fa26_backward)[0] is None

    # a later optional parameter is fine, a later required one is not
    def later_optional(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
        new_flag=False,
    ):
        pass

    def later_required(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
        new_flag,
    ):
        pass

    assert select(FA2_ADAPTERS, later_optional, fa27_backward, "2.8.4")[0] is FA2_ADAPTERS[1]
    assert select(FA2_ADAPTERS, later_required, fa27_backward, "2.8.4")[0] is None


def test_cudnn_op_schema_and_call_shapes():
    """The aten op's argument lists as ``cudnn.py`` passes them, and one call of each on meta
    tensors."""
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema
    assert [a.name for a in fwd.arguments] == [
        "query",
        "key",
        "value",
        "attn_bias",
        "compute_log_sumexp",
        "dropout_p",
        "is_causal",
        "return_debug_mask",
        "scale",
    ]
    assert [r.name for r in fwd.returns][:2] == ["output", "logsumexp"]
    assert [a.name for a in bwd.arguments] == [
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "philox_seed",
        "philox_offset",
        "attn_bias",
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
        "scale",
    ]
    q = torch.empty(2, 7, 4, 64, device="meta", dtype=torch.bfloat16)  # (B, Sq, H, D), GQA 2
    k = torch.empty(2, 9, 2, 64, device="meta", dtype=torch.bfloat16)
    out, lse = cudnn._fused(q, k, k, 0.1, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    dq, dk, dv = cudnn._fused_backward(q, q, k, k, out, lse, 0.1, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert not cudnn.supports(
        torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), Mask(FULL)
    )  # CUDA only


# ---------------------------------------------------------------------------- probe and routing


class Fake:
    """A CPU backend: the reference's results, optionally wrong in one need, optionally taking
    dlse."""

    def __init__(self, broken="", dlse=False):
        self.broken, self.dlse, self.calls = broken, dlse, []

    def supports(self, q, mask, dlse=False):
        return not dlse or self.dlse

    def forward(self, q, k, v, scale, mask):
        self.calls.append("forward")
        out, lse = reference.forward(q, k, v, scale, mask)
        return (out * 1.5, lse) if self.broken == "forward" else (out, lse)

    def backward(self, dout, q, k, v, out, lse, scale, mask, dlse=None):
        self.calls.append("lse_grad" if dlse is not None else "backward")
        grads = reference.backward(dout, q, k, v, out, lse, scale, mask, dlse)
        wrong = self.broken == ("lse_grad" if dlse is not None else "backward")
        return tuple(g * 2 for g in grads) if wrong else grads


@pytest.fixture
def registry():
    """Fresh probe cache and warnings; ``add(name, backend)`` puts a backend first on the CPU."""
    K.REGISTRY.reset()
    added = []

    def add(name, backend):
        K.register_backend(name, backend, preference={"cpu": 0})
        added.append(name)
        return backend

    yield add
    for name in added:
        K.REGISTRY.remove(name)
    K.REGISTRY.reset()


def _next_cpu(name):
    """The backend "auto" falls back to on the CPU when ``name`` is passed over."""
    return K.BACKENDS[
        next(
            n
            for n in K.PREFERENCE["cpu"]
            if n != name and not getattr(K.BACKENDS[n], "unavailable", "")
        )
    ]


def _name(module):
    return next(n for n, m in K.BACKENDS.items() if m is module)


def _problem():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 12, 2, 16, generator=g)
    k, v = (torch.randn(1, 12, 1, 16, generator=g) for _ in "kv")
    out, lse = reference.forward(q, k, v, 0.25, Mask(OFFSET, offset=0))
    return q, k, v, torch.randn(q.shape, generator=g), out, lse, torch.randn(lse.shape, generator=g)


def test_backend_failing_its_backward_probe_keeps_the_forward_only(registry):
    fake = registry("fake", Fake(broken="backward"))
    q, k, v, dout, out, lse, _ = _problem()
    mask = Mask(OFFSET, offset=0)
    assert pick("auto", q, mask) is fake
    with pytest.warns(UserWarning, match="'fake' failed probe: backward differs"):
        assert pick("auto", q, mask, backward=True) is _next_cpu("fake")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not on every call
        got = block_backward(dout, q, k, v, out, lse, scale=0.25, mask=mask)
    want = reference.backward(dout, q, k, v, out, lse, 0.25, mask)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    d = K.describe("cpu", torch.float32)
    assert d["auto"]["forward"]["offset"] == "fake" and d["auto"]["backward"]["offset"] == _name(
        _next_cpu("fake")
    )
    assert "backward differs" in d["skipped"]["fake"]["backward/offset"]


def test_forward_failure_is_not_picked(registry):
    registry("fake", Fake(broken="forward"))
    q = _problem()[0]
    with pytest.warns(UserWarning, match="forward differs"):
        assert pick("auto", q, Mask(FULL)) is _next_cpu("fake")


def test_lse_gradient_runs_on_a_native_backend_and_never_silently_on_the_reference(registry):
    q, k, v, dout, out, lse, dlse = _problem()
    mask = Mask(OFFSET, offset=0)
    want = reference.backward(dout, q, k, v, out, lse, 0.25, mask, dlse)
    native = registry("native", Fake(dlse=True))
    got = block_backward(dout, q, k, v, out, lse, scale=0.25, mask=mask, dlse=dlse)
    assert native.calls[-1] == "lse_grad"  # taken natively, not by the reference
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    # an explicit backend without dlse: the call goes to "auto"'s choice for it, and it says so once
    with pytest.warns(
        UserWarning, match="'sdpa' takes no gradient through lse; .* run on 'native'"
    ):
        block_backward(dout, q, k, v, out, lse, scale=0.25, mask=mask, dlse=dlse, backend="sdpa")
    # a native one that fails its lse-gradient probe is passed over (to our C kernel where it
    # builds, the other backend here that takes dlse, else to the reference)
    registry("native2", Fake(dlse=True, broken="lse_grad"))
    K.REGISTRY.remove("native")
    with pytest.warns(UserWarning, match="lse_grad differs"):
        assert pick("auto", q, mask, dlse=True, backward=True) is (
            reference if K.BACKENDS["cpu_flash"].unavailable else K.BACKENDS["cpu_flash"]
        )


def test_describe_on_this_machine():
    d = K.describe("cpu", torch.float32)
    json.dumps(d)  # plain data, for logs
    assert d["order"] == K.PREFERENCE["cpu"]
    assert set(d["auto"]) == {"forward", "backward", "lse_grad"}
    assert set(d["auto"]["forward"]) == {"full", "offset", "band", "dense"}
    if K.BACKENDS["cpu_flash"].unavailable:  # RINGKV_NATIVE_FLASH=0 or no compiler: torch's op
        assert set(d["auto"]["forward"].values()) == {"sdpa"} == set(d["auto"]["backward"].values())
        assert set(d["auto"]["lse_grad"].values()) == {"reference"}
        assert d["skipped"]["sdpa"] == "unsupported (takes no gradient through lse)"
    else:
        # our C kernel for everything but dense masks, which go to torch's op (lse_grad: the
        # reference)
        for need in ("forward", "backward", "lse_grad"):
            assert d["auto"][need] == {
                "full": "cpu_flash",
                "offset": "cpu_flash",
                "band": "cpu_flash",
                "dense": "reference" if need == "lse_grad" else "sdpa",
            }
        assert d["skipped"]["cpu_flash"] == "unsupported"
        assert d["skipped"]["sdpa"]["forward/full"] == "after 'cpu_flash' in the preference order"
        assert (
            d["skipped"]["sdpa"]["lse_grad/dense"] == "unsupported (takes no gradient through lse)"
        )
    assert any(
        "lse_grad on 'reference'" in n for n in d["notes"]
    )  # the fallback is stated, not silent
    assert d["skipped"]["cudnn"] == "not in the cpu preference order"
    for name in ("flash_attn", "flash_attn3"):
        if K.BACKENDS[name].adapter is None:
            assert d["skipped"][name] == K.BACKENDS[name].unavailable


@pytest.mark.parametrize("table,version,fwd,bwd,name", RELEASES[1:2], ids=[RELEASES[1][4]])
def test_flash_into_paths_merge_each_call_once(table, version, fwd, bwd, name):
    """``forward_into`` merges every call's partial straight into the ring's accumulator (the same
    result as merging ``forward``'s), and one call over all rows comes back unmerged."""
    be = _backend(table, version, fwd, bwd)
    q, k, v = _inputs()
    g = torch.Generator().manual_seed(1)
    acc0, lse0 = torch.randn(2, 6, 4, 16, generator=g), torch.randn(2, 4, 6, generator=g)
    for mask in (Mask(OFFSET, offset=4), Mask(BAND, offset=2, lo=-3), Mask(FULL)):
        want = acc0.clone(), lse0.clone()
        merge_(*want, *be.forward(q, k, v, 0.3, mask))
        got = acc0.clone(), lse0.clone()
        CALLS.clear()
        be.forward_into(q, k, v, 0.3, mask, *got)
        assert len(CALLS) == len(_tiles(mask, 6, 9))
        torch.testing.assert_close(got, want)
        grads = [torch.ones(t.shape) for t in (q, k, v)]
        be.backward_into(*grads, torch.randn_like(q), q, k, v, *_result(q), 0.3, mask)
        for g_into, g_plain in zip(
            grads, be.backward(torch.randn_like(q), q, k, v, *_result(q), 0.3, mask)
        ):
            torch.testing.assert_close(g_into, g_plain + 1)  # added to what was there
    CALLS.clear()
    assert torch.equal(be.forward(q, k, v, 0.3, Mask(FULL))[0], _result(q)[0]) and len(CALLS) == 1
