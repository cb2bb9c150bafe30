"""``kernels/linear_cpu.py``: the packed CPU linear of compiled decode steps against float64
``x @ W.T + b`` (its error no worse than MKL's own, over drawn shapes that cross the kernel's
row tiles and column panels), bitwise the same for any thread count, a module copy that packs
only its float32 linears and shares every other tensor, and bad packed weights rejected."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from ringkv.kernels import linear_cpu, native

# only where there is no compiler: where there is one, a kernel that fails to build fails these
# tests
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


def test_kernel_builds_where_a_compiler_is():
    assert (
        linear_cpu.library() is not None
    )  # (whether compiled decode uses it: its self-check, or the switch)
    assert (
        linear_cpu.packed_floats(1, 1) == linear_cpu.nr() in (8, 16, 32)
    )  # the build's panel width


@settings(max_examples=40, deadline=None)
@given(
    m=st.one_of(st.integers(1, 70), st.integers(129, 140)),
    n=st.integers(1, 100),
    k=st.one_of(st.integers(1, 90), st.integers(120, 400)),
    bias=st.booleans(),
    lead=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_as_closely_as_mkl(m, n, k, bias, lead, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(*lead, m, k, generator=g)  # (..., M, K)
    want = F.linear(
        x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
    )
    got = linear_cpu.PackedLinear(lin)(x)  # (..., M, N)
    assert got.shape == want.shape and got.dtype == torch.float32
    mkl = (lin(x).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 4 * mkl + 1e-5 * k**0.5


def test_bitwise_the_same_for_any_thread_count_and_row_count():
    torch.manual_seed(0)
    w, x = torch.randn(1000, 576), torch.randn(21, 576)  # panels and row tiles with remainders
    packed = linear_cpu.pack(w)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(torch.ops.ringkv.packed_linear(x, packed, 1000))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # K runs in chunks of 128 for up to 128 rows, in one piece past that: each sum keeps its k order
    more = torch.cat([x, torch.randn(140 - 21, 576)])
    assert torch.equal(torch.ops.ringkv.packed_linear(more, packed, 1000)[:21], outs[0])


def test_pack_linears_replaces_float32_linears_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(50, 24),
        nn.Linear(24, 40),
        nn.ReLU(),
        nn.Linear(40, 24, bias=False),
        nn.Linear(24, 8).double(),
    )
    x = torch.randint(0, 50, (7,))
    before = model[:4](x)
    embedding, bias, other = model[0].weight, model[1].bias, model[4]
    assert linear_cpu.pack_linears(model) is model and linear_cpu.is_packed(model)
    assert [type(m).__name__ for m in model] == [
        "Embedding",
        "PackedLinear",
        "ReLU",
        "PackedLinear",
        "Linear",  # float64: left to torch
    ]
    assert model[0].weight is embedding and model[1].bias is bias and model[4] is other
    assert not hasattr(model[1], "weight")  # the packed copy replaced the weight
    torch.testing.assert_close(model[:4](x), before, rtol=1e-5, atol=1e-5)
    assert not linear_cpu.is_packed(
        linear_cpu.pack_linears(nn.Sequential(nn.Linear(3, 3).double()))
    )


def test_bad_packed_weights_are_rejected():
    w = torch.randn(40, 16)
    packed = linear_cpu.pack(w)
    with pytest.raises(ValueError, match="do not hold"):
        torch.ops.ringkv.packed_linear(torch.randn(3, 16), packed, 80)  # not this weight's size
    with pytest.raises(ValueError, match="do not hold"):
        torch.ops.ringkv.packed_linear(torch.randn(3, 16).double(), packed, 40)
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        linear_cpu.pack(w.double())


def test_packing_lets_the_checkpoints_file_mapping_go(tmp_path):
    """Weights read from a safetensors file live in its mapping, which any one of them keeps
    whole: after packing, the parameters left (a norm's, a bias) must not hold it, or the packed
    copies come on top of the checkpoint's pages."""
    import gc

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.randn(256, 128), "norm": torch.ones(128)}, path)
    with safe_open(path, framework="pt", device="cpu") as f:
        w, norm = f.get_slice("w")[:], f.get_slice("norm")[:]
    model = nn.ModuleDict(dict(proj=nn.Linear(128, 256, bias=False), norm=nn.LayerNorm(128)))
    model["proj"].weight, model["norm"].weight = nn.Parameter(w), nn.Parameter(norm)
    del w, norm
    mapped = lambda: any(path in line for line in open("/proc/self/maps"))  # noqa: E731
    assert mapped()  # (what the test relies on: the tensors are views of the mapping)
    linear_cpu.pack_linears(model)
    gc.collect()
    assert not mapped()
    assert torch.equal(model["norm"].weight, torch.ones(128))


def test_tied_embedding_refuses_out_of_range_ids():
    """A ``PackedEmbedding`` reads the LM head's packed copy: an id outside the vocabulary is an
    ``IndexError`` naming the range (checked in the kernel, before it reads), like
    ``nn.Embedding``'s."""
    emb = nn.Embedding(50, 16)
    model = nn.ModuleDict(dict(embed=emb, head=nn.Linear(16, 50, bias=False)))
    model["head"].weight = emb.weight
    linear_cpu.pack_linears(model)
    assert isinstance(model["embed"], linear_cpu.PackedEmbedding)
    ids = torch.tensor([[0, 7, 49]])
    assert torch.equal(model["embed"](ids), emb.weight.detach()[ids])
    for bad in (50, -1):
        with pytest.raises(IndexError, match=r"\[0, 50\)"):
            model["embed"](torch.tensor([3, bad]))


def _shim_call(x, packed, n):
    """``aoti_torch_cpu_packed_linear`` called as an AOTInductor graph calls it: on torch's C tensor
    handles. The result tensor, or the function's error code."""
    import ctypes

    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = (
        ctypes.c_void_p,
        [ctypes.py_object, ctypes.c_char_p],
    )
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    assert linear_cpu.aoti_shim() is not None  # made ready: global, handed torch's C functions
    fn = linear_cpu.library().aoti_torch_cpu_packed_linear
    fn.restype, fn.argtypes = (
        ctypes.c_int32,
        [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p],
    )
    handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors([x, packed])  # new references
    out = ctypes.c_void_p()
    err = fn(*(api.PyCapsule_GetPointer(h, None) for h in handles), n, ctypes.byref(out))
    torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(handles)  # (released with these)
    if err:
        return err
    return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(api.PyCapsule_New(out, None, None))


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=2),  # leading dimensions
    m=st.integers(1, 20),
    n=st.integers(1, 70),
    k=st.integers(1, 80),
    layout=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    seed=st.integers(0, 2**16),
)
def test_the_c_shim_of_compiled_graphs_is_the_op(shape, m, n, k, layout, seed):
    """The op as compiled graphs call it (csrc/linear.c, ``linear_cpu.aoti_shim``): bitwise the
    Python op's result for any input layout a graph may hand over (views gathered first)."""
    g = torch.Generator().manual_seed(seed)
    packed = linear_cpu.pack(torch.randn(n, k, generator=g))
    x = {
        "contiguous": lambda: torch.randn(*shape, m, k, generator=g),
        "transposed": lambda: torch.randn(*shape, k, m, generator=g).transpose(-1, -2),
        "sliced": lambda: torch.randn(*shape, m, k + 3, generator=g)[..., 1 : k + 1],
        "expanded": lambda: torch.randn(1, k, generator=g).expand(*shape, m, k),
    }[layout]()
    got = _shim_call(x, packed, n)
    want = torch.ops.ringkv.packed_linear(x, packed, n)
    assert got.shape == (*shape, m, n) and got.is_contiguous() and torch.equal(got, want)


def test_the_c_shim_refuses_what_it_cannot_compute():
    packed = linear_cpu.pack(torch.randn(8, 4))
    assert _shim_call(torch.randn(3, 4, dtype=torch.float64), packed, 8) == 1  # not float32
    assert _shim_call(torch.randn(*[1] * 8, 4), packed, 8) == 1  # 9 dimensions
    assert _shim_call(torch.randn(3, 4), packed, 40) == 1  # not a (40, 4) weight's packing
    assert _shim_call(torch.randn(3, 5), packed, 8) == 1  # nor an (8, 5) one's
    empty = _shim_call(torch.randn(0, 4), packed, 8)
    assert empty.shape == (0, 8)
