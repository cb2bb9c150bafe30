"""The run-time tables of ``kernels``, ``sp`` and ``parallel``: one object per concern, each shown
by ``snapshot()`` and cleared by ``reset()`` (tests use these instead of editing the tables)."""

import pytest
import torch

import ringkv.kernels as K
from ringkv.kernels import paged, quant, reference
from ringkv.kernels.mask import FULL, Mask
from ringkv.parallel import mesh
from ringkv.sp import collectives, ring, usp


def test_backend_registry_registers_removes_and_forgets_its_probes():
    before = K.REGISTRY.snapshot()
    assert before["backends"] == sorted(K.BACKENDS) and before["preference"]["cpu"] == list(
        K.PREFERENCE["cpu"]
    )
    with pytest.raises(TypeError):
        K.BACKENDS["x"] = reference  # a read-only view: register_backend adds
    K.register_backend("mine", reference, preference={"cpu": 0})
    try:
        assert K.BACKENDS["mine"] is reference and K.PREFERENCE["cpu"][0] == "mine"
        K.pick("auto", torch.zeros(1, 8, 2, 16), Mask(FULL))
        assert any(k.startswith("mine/cpu/") for k in K.REGISTRY.snapshot()["probes"])
        K.REGISTRY.reset()
        assert K.REGISTRY.snapshot()["probes"] == {}
    finally:
        K.REGISTRY.remove("mine")
    assert K.REGISTRY.snapshot()["backends"] == before["backends"]
    assert K.REGISTRY.snapshot()["preference"] == before["preference"]


def test_paged_backends_register_and_reset_to_the_built_in_ones():
    built_in = paged.PAGED.snapshot()
    assert built_in["decode"] == sorted(paged._BACKENDS) and "reference" in built_in["prefill"]
    paged.PAGED.register("decode", "mine", paged.paged_attention_reference)
    assert paged.PAGED.table("decode")["mine"] is paged.paged_attention_reference
    assert paged.features("mine") == frozenset({"scale"})
    paged.PAGED.reset()
    assert paged.PAGED.snapshot() == built_in and "mine" not in paged._BACKENDS


def test_group_memory_keeps_the_most_recent_per_group():
    m = collectives.GroupMemory()
    for i in range(3):
        m.put("g", i, str(i), limit=2)
    assert m.snapshot() == {("g", 1): "1", ("g", 2): "2"}
    assert m.touch("g", 1) and not m.touch("g", 0) and not m.touch("h", 1)
    m.put("g", 3, "3", limit=2)  # 1 was used last: 2 goes
    assert m.snapshot() == {("g", 1): "1", ("g", 3): "3"} and m.get("g", 3) == "3"
    m.forget("g")
    assert m.snapshot() == {} and m.get("g", 3) is None
    m.put("h", 0, None, limit=1)
    m.reset()
    assert m.snapshot() == {}
    assert isinstance(ring.AUTO, collectives.GroupMemory)
    assert isinstance(collectives.AGREED, collectives.GroupMemory)
    assert ring.auto_decisions() == ring.AUTO.snapshot()


def test_memo_builds_once_per_key():
    built = []
    m = collectives.Memo()
    assert m.get("a", lambda: built.append(1) or "x") == "x" == m.get("a", lambda: "y")
    assert built == [1] and m.snapshot() == ["a"]
    m.reset()
    assert m.snapshot() == [] and m.get("a", lambda: "y") == "y"
    assert isinstance(usp.GROUPS, collectives.Memo) and isinstance(mesh.MESHES, collectives.Memo)


def test_byte_values_cache():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8 in this torch")
    quant.byte_values.cache_clear()
    lut = quant.byte_values(fp8)
    assert lut.shape == (256,) and quant.byte_values(fp8) is lut
    assert quant.byte_values.cache_info().currsize == 1


def test_triton_kernels_registry():
    tc = pytest.importorskip("ringkv.kernels.triton_common", reason="triton not installed")
    tc.build()
    snap = tc.KERNELS.snapshot()
    assert snap["pending"] == [] and {"dot", "online_step", "finish"} <= set(snap["built"])
    tc.KERNELS.reset()
    assert tc.KERNELS.snapshot()["tuned"] == []
