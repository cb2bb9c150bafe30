"""ringkv's C kernels built for each target ISA, and the self-check that decides whether one runs.

Every kernel (``csrc/flash_attention.c``, ``linear.c``, ``paged_attention.c``) chooses its register
tiles when it is compiled: AVX-512 (``x86-64-v4``), AVX2 + FMA (``x86-64-v3``: what an AVX2-only
CPU such as an AMD EPYC of issue #41 runs) or a generic 128-bit target. Here each build this CPU can
run is called in this process (``isa=``) and compared with float64: the ``x86-64-v3`` and
``generic`` builds on any x86-64 machine with AVX2, ``x86-64-v4`` where the CPU has AVX-512.

The self-check's tests check its mechanism (a verdict computed once, cached beside the build,
read back instead of timing again, reported by ``describe()``, bypassed by the switches, and a
"torch is faster" verdict turning the kernel off in dispatch) with timings injected through
``native.measure``; none depends on which path is actually faster here.
"""

from __future__ import annotations

import json
import platform
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringkv import kernels as K
from ringkv.kernels import cpu_flash, linear_cpu, native, paged, paged_cpu, pointwise, reference
from ringkv.kernels.mask import BAND, FULL, OFFSET, Mask
from ringkv.kernels.paged_base import LayerCache, paged_attention_reference, query_limits
from tests.checks import assert_close
from tests.test_cpu_flash import EPS, check, make, oracle, problems
from tests.test_paged import spread_problem

pytestmark = pytest.mark.skipif(
    native.compiler() is None or platform.system() != "Linux",
    reason="no C compiler here (or not Linux)",
)

NAMED = ("x86-64-v4", "x86-64-v3", "generic")
KERNELS = ("flash_attention", "linear", "paged_attention", "pointwise")
SWITCHES = (
    "RINGKV_NATIVE_FLASH",
    "RINGKV_NATIVE_LINEAR",
    "RINGKV_NATIVE_PAGED",
    "RINGKV_NATIVE_POINTWISE",
)
MODULES = (cpu_flash, linear_cpu, paged_cpu, pointwise)  # each kernel's module, as KERNELS
TILES = {
    "x86-64-v4": "avx512",
    "x86-64-v3": "avx2",
    "generic": "generic",
}  # what each build says it is
NR = {"x86-64-v4": 32, "x86-64-v3": 16, "generic": 8}  # the packed linear's panel width per build
ISA = pytest.mark.parametrize(
    "isa",
    [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                isa not in native.supported_isas(), reason=f"this CPU cannot run {isa} code"
            ),
        )
        for isa in NAMED
    ],
)
HYP = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


# ---- targets and builds -------------------------------------------------------------------------

AVX512_CPU = (
    "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma bmi1 bmi2 f16c movbe abm "
    "avx512f avx512bw avx512cd avx512dq avx512vl\n"
)
EPYC_CPU = (
    "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm\n"
)


def test_supported_isas_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for cpuinfo, want in (
        (AVX512_CPU, ("x86-64-v4", "x86-64-v3", "generic")),
        (EPYC_CPU, ("x86-64-v3", "generic")),
        (EPYC_CPU.replace(" movbe", ""), ("generic",)),  # v3 needs every one of its flags
        (AVX512_CPU.replace(" avx512vl", ""), ("x86-64-v3", "generic")),
        ("", ("generic",)),
    ):
        monkeypatch.setattr(native, "_cpuinfo", lambda c=cpuinfo: c)
        assert native.supported_isas() == want
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "_cpuinfo", lambda: AVX512_CPU)
    assert native.supported_isas() == ("generic",)


def test_flags_per_target_and_the_default_from_the_environment(monkeypatch):
    assert "-march=x86-64-v3" in native.flags("x86-64-v3") and "-march=x86-64-v4" in native.flags(
        "x86-64-v4"
    )
    assert "-march=native" in native.flags("native")
    assert not any(
        f.startswith(("-march", "-mtune")) for f in native.flags("generic")
    )  # the compiler's default
    with pytest.raises(ValueError, match="choose one of"):
        native.flags("avx2")
    monkeypatch.delenv("RINGKV_KERNEL_ISA", raising=False)
    assert native.default_isa() == "native"
    monkeypatch.setenv("RINGKV_KERNEL_ISA", "x86-64-v3")
    assert native.default_isa() == "x86-64-v3"
    monkeypatch.setenv("RINGKV_KERNEL_ISA", "avx2")
    with pytest.raises(ValueError, match="RINGKV_KERNEL_ISA='avx2'"):
        native.default_isa()


def test_a_header_the_kernels_include_is_in_their_build_key(monkeypatch, tmp_path):
    """Editing csrc/vexp.h builds the kernels that include it again, never loads a stale .so."""
    src = tmp_path / "csrc"
    shutil.copytree(native.CSRC, src)
    monkeypatch.setattr(native, "CSRC", src)
    monkeypatch.setenv("RINGKV_CACHE", str(tmp_path))
    native._build.cache_clear()
    try:
        before = native.build("pointwise", "generic").path
        (src / "vexp.h").write_text((src / "vexp.h").read_text() + "\n/* edited */\n")
        native._build.cache_clear()
        after = native.build("pointwise", "generic").path
        assert before != after and before.exists() and after.exists()
    finally:
        native._build.cache_clear()


def test_a_target_this_cpu_cannot_run_is_never_loaded(monkeypatch):
    monkeypatch.setattr(native, "supported_isas", lambda: ("generic",))
    with pytest.warns(UserWarning, match="cannot run x86-64-v4 code"):
        assert native.build("linear", "x86-64-v4") is None
    assert native.build("linear", "generic") is not None


@ISA
def test_each_target_builds_its_own_tiles(isa):
    paths = set()
    for name in KERNELS:
        b = native.build(name, isa)
        assert b is not None and b.isa == isa
        assert b.tiles.startswith(TILES[isa] + ":"), (name, b.tiles)
        paths.add(b.path)
        assert native.build(name, "native").path != b.path  # the flags are in the key
    assert len(paths) == len(KERNELS)
    assert linear_cpu.nr(isa) == NR[isa]
    assert linear_cpu.packed_floats(NR[isa] + 1, 10, isa=isa) == 2 * NR[isa] * 10
    assert linear_cpu.pack(torch.randn(NR[isa] + 1, 10), isa=isa).numel() == 2 * NR[isa] * 10


def test_kernel_isa_sets_the_build_of_the_process(monkeypatch):
    """``RINGKV_KERNEL_ISA=x86-64-v3`` on any AVX2 machine: the kernels the process runs are the
    AVX2 builds (what the whole suite runs under it)."""
    if "x86-64-v3" not in native.supported_isas():
        pytest.skip("this CPU cannot run x86-64-v3 code")
    monkeypatch.setenv("RINGKV_KERNEL_ISA", "x86-64-v3")
    _forget()
    try:
        assert linear_cpu.nr() == 16
        assert cpu_flash.library() is cpu_flash.library("x86-64-v3")
        assert paged_cpu.library() is paged_cpu.library("x86-64-v3")
    finally:
        _forget()


# ---- each build against float64 ----------------------------------------------------------------


@ISA
@HYP
@given(p=problems())
def test_flash_matches_float64_on_every_target(isa, p):
    check(p, isa)


# query rows around every target's row tiles (3, 6, 12) and blocks (48, 96), keys around its panels
# (16, 32) and blocks (512), head dims whose last column chunk is partial (16, 48, 80 against
# chunks of 16, 32 and 64 columns)
EDGES = [
    (sq, sk, d, mask)
    for sq, sk, d in (
        (1, 1, 16),
        (5, 17, 48),
        (7, 33, 80),
        (13, 15, 16),
        (49, 95, 48),
        (97, 513, 80),
    )
    for mask in (Mask(FULL), Mask(OFFSET, offset=sk - sq), Mask(BAND, offset=2, lo=-9))
]


@ISA
def test_flash_tile_edges_on_every_target(isa):
    for i, (sq, sk, d, mask) in enumerate(EDGES):
        p = dict(b=1, sq=sq, sk=sk, h=3, hkv=1, d=d, dlse=True, seed=i)
        q, k, v, dout, dlse = make(p)
        ref_out, ref_lse, ref_grads = oracle(q, k, v, dout, dlse, 0.3, mask)
        out, lse = cpu_flash.forward(q, k, v, 0.3, mask, isa=isa)
        assert_close(f"out {sq}x{sk}x{d} {mask.kind}", out, ref_out, 32 * EPS)
        assert_close(f"lse {sq}x{sk}x{d} {mask.kind}", lse, ref_lse, 32 * EPS)
        grads = cpu_flash.backward(
            dout, q, k, v, ref_out.float(), ref_lse.float(), 0.3, mask, dlse, isa=isa
        )
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(f"{name} {sq}x{sk}x{d} {mask.kind}", got, want, 512 * EPS)


@ISA
def test_flash_result_does_not_depend_on_the_thread_count(isa):
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 150, 4, 48, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 300, 2, 48, generator=g) for _ in range(2))
    mask = Mask(BAND, offset=100, lo=-50)
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = cpu_flash.forward(q, k, v, 0.2, mask, isa=isa)
            runs.append(
                (out, lse, *cpu_flash.backward(dout, q, k, v, out, lse, 0.2, mask, isa=isa))
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@ISA
@HYP
@given(
    m=st.one_of(st.integers(1, 40), st.integers(125, 140)),
    n=st.integers(1, 70),
    k=st.one_of(st.integers(1, 40), st.integers(120, 300)),
    lead=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_float64_on_every_target(isa, m, n, k, lead, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(*lead, m, k, generator=g)
    want = F.linear(x.double(), w.double())
    got = linear_cpu.packed_linear(x, linear_cpu.pack(w, isa=isa), n, isa=isa)
    assert got.shape == want.shape and got.dtype == torch.float32
    mkl = (F.linear(x, w).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 4 * mkl + 1e-5 * k**0.5


@ISA
def test_linear_bitwise_the_same_for_any_thread_count_and_row_count(isa):
    torch.manual_seed(0)
    w, x = (
        torch.randn(203, 300),
        torch.randn(21, 300),
    )  # panels and row tiles with remainders on every target
    packed = linear_cpu.pack(w, isa=isa)
    threads, outs = torch.get_num_threads(), []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(linear_cpu.packed_linear(x, packed, 203, isa=isa))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    more = torch.cat(
        [x, torch.randn(140 - 21, 300)]
    )  # past 128 rows: each tile over all of K, same order
    assert torch.equal(linear_cpu.packed_linear(more, packed, 203, isa=isa)[:21], outs[0])
    with pytest.raises(ValueError, match="do not hold"):
        linear_cpu.packed_linear(x, packed[:-1], 203, isa=isa)


@ISA
@HYP
@given(
    d=st.sampled_from([8, 20, 64, 128, 136]),
    nq=st.integers(1, 3),
    g=st.sampled_from([1, 3]),
    spread=st.sampled_from([1.0, 25.0]),
    lens=st.lists(st.integers(0, 90), min_size=1, max_size=6),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_matches_float64_on_every_target(isa, d, nq, g, spread, lens, causal, seed):
    q, kc, vc, table, seq_lens = spread_problem(d, nq, g, spread, lens, seed)
    limits = query_limits(seq_lens, nq, causal)
    out, lse = paged_cpu.attend(q, LayerCache(kc, vc), table, limits, isa=isa)
    ref_out, ref_lse = paged_attention_reference(
        q.double(), kc.double(), vc.double(), table, seq_lens, causal=causal
    )
    assert_close("out", out, ref_out, 2e-5)
    assert_close("lse", lse, ref_lse, 2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(paged_cpu.attend(q, LayerCache(kc, vc), table, limits, isa=isa)[0], out)
    finally:
        torch.set_num_threads(threads)


# ---- the self-check ----------------------------------------------------------------------------


def _forget():
    """This process's builds, libraries and verdicts forgotten (as in a new process)."""
    native._build.cache_clear()
    for m in MODULES:
        for f in (m._lib, m._default, m.status):
            f.cache_clear()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No kernel loaded or judged yet, no RINGKV_NATIVE_* switch, and a ``RINGKV_CACHE`` of this
    test's own that holds copies of the kernels already built (nothing compiles again). Yields
    its ``kernels`` folder."""
    home = tmp_path / "kernels"
    home.mkdir()
    for name in KERNELS:
        built = native.build(name)
        shutil.copy(built.path, home / built.path.name)
    monkeypatch.setenv("RINGKV_CACHE", str(tmp_path))
    for switch in SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    _forget()
    yield home
    _forget()  # later tests load again under the suite's settings


class Timings:
    """``native.measure`` replaced: runs each call once (they must work) and reports the given
    seconds (kernel, torch), counting how often it was asked."""

    def __init__(self, kernel_s: float, torch_s: float):
        self.result, self.calls = (kernel_s, torch_s), 0

    def __call__(self, kernel, torch_path, **kw):
        kernel()
        torch_path()
        self.calls += 1
        return self.result


def test_self_check_runs_once_is_cached_beside_the_build_and_read_back(fresh, monkeypatch):
    timings = Timings(0.001, 0.002)
    monkeypatch.setattr(native, "measure", timings)
    for m in MODULES:
        s = m.status()
        assert (s["on"], s["by"], s["why"], s["kernel_us"], s["torch_us"]) == (
            True,
            "self-check",
            "",
            1000.0,
            2000.0,
        )
        assert s["isa"] == native.default_isa() and s["tiles"] and s["call"]
    assert timings.calls == len(MODULES)
    files = sorted(fresh.glob("*.json"))
    assert [f.name.rsplit("-", 1)[0] for f in files] == sorted(KERNELS)
    for f in files:
        assert f.with_suffix(".so").exists()  # beside its build, under the build's key
        (entry,) = json.loads(f.read_text()).values()  # one per torch version and thread count
        assert (entry["on"], entry["kernel_us"], entry["torch_us"]) == (True, 1000.0, 2000.0)
    _forget()  # a new process: reads the verdicts, times nothing
    assert [m.status()["by"] for m in MODULES] == ["self-check (cached)"] * len(MODULES)
    assert timings.calls == len(MODULES)
    d = K.describe("cpu", torch.float32)
    json.dumps(d)
    assert set(d["native"]) == {
        *KERNELS,
        "flash_attention (full)",
    }  # cpu_flash's full blocks: a verdict apart
    for s in d["native"].values():
        assert (s["on"], s["kernel_us"], s["torch_us"]) == (True, 1000.0, 2000.0)
    assert d["auto"]["forward"]["offset"] == "cpu_flash"
    assert linear_cpu.available() and paged_cpu.available() and paged.auto_backend("cpu") == "cpu"


def test_torch_faster_turns_each_kernel_off_in_dispatch(fresh, monkeypatch):
    monkeypatch.setattr(native, "measure", Timings(0.003, 0.001))
    q = torch.randn(1, 40, 2, 64)
    assert cpu_flash.unavailable.startswith(
        "off: torch's fused op (sdpa) was faster in the self-check (3000 us against 1000 us"
    )
    assert K.pick("auto", q, Mask(OFFSET, offset=0)) is K.sdpa
    assert K.pick("auto", q, Mask(FULL), dlse=True, backward=True) is reference
    assert not linear_cpu.available()
    assert not linear_cpu.is_packed(linear_cpu.pack_linears(nn.Sequential(nn.Linear(4, 4))))
    assert not paged_cpu.available() and paged.auto_backend("cpu") == "torch"
    d = K.describe("cpu", torch.float32)
    assert (
        d["auto"]["forward"]["full"] == "sdpa"
        and d["skipped"]["cpu_flash"] == cpu_flash.unavailable
    )
    for s in d["native"].values():
        assert (s["on"], s["kernel_us"], s["torch_us"]) == (
            False,
            3000.0,
            1000.0,
        ) and "=1 turns it on" in s["why"]
    # asked for by name, each still runs
    mask = Mask(OFFSET, offset=0)
    torch.testing.assert_close(
        cpu_flash.forward(q, q, q, 0.1, mask)[0], reference.forward(q, q, q, 0.1, mask)[0]
    )
    assert cpu_flash.supports(q, mask) and paged_cpu.supports(q, LayerCache(q, q))


def test_flash_full_blocks_have_a_verdict_of_their_own(fresh, monkeypatch):
    """The AVX2 build wins diagonal blocks (it skips their masked panels) and can lose full ones
    to torch's op: full blocks are timed apart, and where they lose ``"auto"`` sends them to sdpa
    while the diagonal blocks stay on the kernel (which still runs when asked for by name)."""
    kinds, real = [], cpu_flash._timed_call
    monkeypatch.setattr(
        cpu_flash,
        "_timed_call",
        lambda isa, kind="causal": (kinds.append(kind), real(isa, kind))[1],
    )
    monkeypatch.setattr(
        native,
        "measure",
        lambda kernel, torch_path, **kw: (
            kernel(),
            torch_path(),
            (0.001, 0.002) if kinds[-1] == "causal" else (0.003, 0.002),
        )[2],
    )
    q = torch.randn(1, 40, 2, 64)
    assert K.pick("auto", q, Mask(OFFSET, offset=0)) is cpu_flash
    assert K.pick("auto", q, Mask(FULL)) is K.sdpa
    assert K.pick("auto", q, Mask(BAND, offset=0, lo=-8)) is cpu_flash
    assert K.pick("auto", q, Mask(FULL), backward=True) is K.sdpa
    assert kinds == ["causal", "full"]  # each timed once
    assert K.pick("cpu_flash", q, Mask(FULL)) is cpu_flash
    d = K.describe("cpu", torch.float32)
    assert d["auto"]["forward"]["full"] == "sdpa" and d["auto"]["forward"]["offset"] == "cpu_flash"
    full = d["native"]["flash_attention (full)"]
    assert (full["on"], full["kernel_us"], full["torch_us"]) == (False, 3000.0, 2000.0), full
    assert (
        "full block" in full["call"]
        and "sdpa" in full["why"]
        and d["native"]["flash_attention"]["on"]
    )
    _forget()  # a new process reads both verdicts from the one file beside the build
    assert cpu_flash.status("full")["by"] == "self-check (cached)" and kinds == ["causal", "full"]


def test_the_switches_bypass_the_self_check(fresh, monkeypatch):
    def never(*a, **kw):
        raise AssertionError("timed despite the switch")

    monkeypatch.setattr(native, "measure", never)
    for switch in SWITCHES:
        monkeypatch.setenv(switch, "1")
    for m, switch in zip(MODULES, SWITCHES):
        s = m.status()
        assert (s["on"], s["by"], s["kernel_us"], s["torch_us"]) == (
            True,
            f"{switch}=1",
            None,
            None,
        )
    assert not list(fresh.glob("*.json"))
    _forget()
    for switch in SWITCHES:
        monkeypatch.setenv(switch, "0")
    for m, switch in zip(MODULES, SWITCHES):
        s = m.status()
        assert (s["on"], s["by"], s["why"]) == (False, f"{switch}=0", f"off: {switch}=0")
        assert m.library() is None
    assert cpu_flash.unavailable == "off: RINGKV_NATIVE_FLASH=0"


def test_measure_interleaves_and_takes_medians(monkeypatch):
    clock, order = [0.0], []

    def call(name, cost):
        def run():
            order.append(name)
            clock[0] += cost

        return run

    monkeypatch.setattr(native.time, "perf_counter", lambda: clock[0])
    k_s, t_s = native.measure(call("k", 1.0), call("t", 3.0), budget_s=0.0, min_rounds=5)
    assert (k_s, t_s) == (1.0, 3.0)
    assert order == ["k", "t"] + ["k", "t", "t", "k"] * 2 + ["k", "t"]  # warm-ups, then alternating
