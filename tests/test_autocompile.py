"""``compile_decode="auto"`` (``ringkv/parallel/autocompile.py``): the verdict comes from the
check's timings (injected here: no test depends on a real timing), is cached per key and shown by
``kv_cache_info()["compile"]``; either choice gives the eager engine's greedy tokens; a warm start
loads the artifact cache's compiled code, and a file of it that was changed is rebuilt, never
loaded. One cold compile of a tiny model in all (the other starts are warm or partial)."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch
from torch._dynamo.utils import counters

from ringkv.__main__ import _parser
from ringkv.engine import LLM, EngineConfig, SamplingParams
from ringkv.engine.core import _compile_mode
from ringkv.model import ModelConfig
from ringkv.parallel import autocompile
from tests.models import tiny_model

PACKAGES = ["decode-4-8.pt2", "head-2-8.pt2", "other-4.pt2"]  # max_num_seqs=8
PROMPTS = [[1, 5, 9, 13], [2, 4, 6], [7, 7, 7, 7, 7, 7], [3, 1, 4, 1, 5], [9, 8]]


def greedy():
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def inject(monkeypatch, compiled_ms: float, eager_ms: float):
    """The check's timings, as if measured: every row count at these medians."""
    calls = []

    def fake(compiled, eager, rows, **kw):
        calls.append(list(rows))
        return [(r, compiled_ms / 1e3, eager_ms / 1e3) for r in rows]

    monkeypatch.setattr(autocompile, "timings", fake)
    return calls


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 3)


@pytest.fixture(scope="module")
def want(model):
    with LLM(model, block_size=16, num_blocks=64, max_num_seqs=8, compile_decode=False) as llm:
        return tokens(llm)


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    d = tmp_path_factory.getbasetemp() / "compile-cache"  # one cache for the module's engines
    monkeypatch.setenv("RINGKV_CACHE", str(d))
    monkeypatch.delenv(autocompile.SWITCH, raising=False)  # the suite's "auto runs eager"
    return d


def build(model, compile_decode="auto"):
    torch._dynamo.reset()  # nothing compiled in memory: a start finds only the disk cache
    counters.clear()
    return LLM(model, block_size=16, num_blocks=64, max_num_seqs=8, compile_decode=compile_decode)


def test_modes_and_the_flag():
    assert EngineConfig().compile_decode == "auto"  # the default since issue #60
    assert [_compile_mode(v) for v in (True, False, "auto", "true", "False")] == [
        "on",
        "off",
        "auto",
        "on",
        "off",
    ]
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        _compile_mode("yes")
    parse = _parser().parse_args
    assert _compile_mode(parse(["serve", "--model", "m"]).compile_decode) == "auto"
    assert parse(["serve", "--model", "m", "--compile-decode", "auto"]).compile_decode == "auto"
    assert parse(["serve", "--model", "m", "--compile-decode"]).compile_decode == "true"
    assert parse(["serve", "--model", "m", "--compile-decode", "false"]).compile_decode == "false"


def test_the_suite_and_the_switch_keep_auto_eager(model, want, monkeypatch):
    monkeypatch.setenv(autocompile.SWITCH, "0")
    calls = inject(monkeypatch, 1.0, 2.0)
    with LLM(model, block_size=16, num_blocks=64, max_num_seqs=8, compile_decode="auto") as llm:
        info = llm.kv_cache_info()["compile"]
        assert (info["mode"], info["on"], info["why"]) == (
            "auto",
            False,
            "eager: RINGKV_COMPILE_DECODE=0",
        )
        assert tokens(llm) == want
    assert calls == []  # no check, no compile


def test_auto_where_compile_cannot_run_is_eager_and_says_why(model, monkeypatch):
    monkeypatch.delenv(autocompile.SWITCH, raising=False)
    calls = inject(monkeypatch, 1.0, 2.0)
    with LLM(model, block_size=16, num_blocks=64, max_num_seqs=3, compile_decode="auto") as llm:
        info = llm.kv_cache_info()["compile"]
        assert not info["on"] and "no decode step reaches 4 rows" in info["why"]
    assert calls == []


def test_auto_runs_eager_when_slower_then_a_warm_start_compiles_when_faster(
    model, want, cache, monkeypatch
):
    calls = inject(monkeypatch, 3.0, 2.0)  # compiled slower: eager
    with build(model) as llm:
        info = llm.kv_cache_info()["compile"]
        assert (info["on"], info["by"], info["artifacts"]) == (False, "auto (measured)", "cold")
        assert "not faster" in info["why"] and info["verdict"]["eager_ms"] == [2.0, 2.0]
        packages = cache / "compile" / info["key"] / "inductor" / "aoti"
        assert sorted(p.name for p in packages.iterdir()) == PACKAGES  # built, to be timed
        layers = model.config.num_hidden_layers
        for p in packages.iterdir():  # the packed linears run in C (csrc/linear.c's shim): only
            src = wrapper_source(p)  # attention, one op a layer, goes back through Python
            assert src.count(b"aoti_torch_cpu_packed_linear(") > 1
            assert src.count(b"proxy_executor_call_function(") == (
                0 if p.name.startswith("head") else layers
            )
        assert tokens(llm) == want
        assert llm.rank_stats()[0]["compiled_steps"] == 0
    assert calls == [[4, 8]]
    key = cache / "compile" / info["key"]
    assert not json.loads((key / "verdict.json").read_text())["4,8"]["compile"]

    # an eager verdict cached: no compile at all
    inject(monkeypatch, 1.0, 9.0)
    with build(model) as llm:
        info = llm.kv_cache_info()["compile"]
        assert (info["on"], info["by"]) == (False, "auto (cached verdict)")
        assert "artifacts" not in info and not counters["inductor"]

    # no verdict stored: measured again, compiled faster -> compiled, from the disk cache
    (key / "verdict.json").unlink()
    calls = inject(monkeypatch, 1.0, 2.0)
    with build(model) as llm:
        info = llm.kv_cache_info()["compile"]
        assert (info["on"], info["by"], info["artifacts"]) == (True, "auto (measured)", "warm")
        assert info["verdict"]["compile"] and info["verdict"]["rows"] == [4, 8]
        assert not counters["inductor"]  # the packages loaded, nothing compiled
        assert tokens(llm) == want
        assert llm.rank_stats()[0]["compiled_steps"] > 0
    assert calls == [[4, 8]]
    assert json.loads((key / "verdict.json").read_text())["4,8"]["compile"]


def wrapper_source(package) -> bytes:
    """The C++ an AOTInductor package was compiled from (its ``*wrapper.cpp``)."""
    with zipfile.ZipFile(package) as z:
        return b"".join(z.read(n) for n in z.namelist() if n.endswith("wrapper.cpp"))


def replace(path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_corrupt_entry_is_rebuilt_never_loaded(model, want, cache):
    if not (cache / "compile").is_dir():  # run alone: fill the cache (else the test above did)
        build(model, True).close()
    key = next((cache / "compile").iterdir())
    inductor = key / "inductor"
    decode, head = (next((inductor / "aoti").glob(f"{g}-*.pt2")) for g in ("decode", "head"))
    # damaged packages, as another process finds them (a new inode)
    replace(decode, b"\0" * 64)  # not a package at all: loading it would fail
    replace(head, head.read_bytes()[:-7] + b"garbage")  # a package whose code may be wrong
    damaged, why = autocompile.ArtifactCache(key.name, {}, cache / "compile").check()
    assert sorted(damaged) == sorted(str(p.relative_to(inductor)) for p in (decode, head))
    assert "does not match its manifest" in why
    with build(model, True) as llm:
        info = llm.kv_cache_info()["compile"]
        assert info["on"] and info["artifacts"].startswith("rebuilt (")
        assert counters["inductor"]  # the deleted packages, compiled again
        assert tokens(llm) == want
    assert autocompile.ArtifactCache(key.name, {}, cache / "compile").check() == ([], "")
    assert decode.stat().st_size > 64


def test_another_checkpoint_of_the_architecture_runs_its_own_weights(model, want, cache):
    """The packages hold no weights: an engine loads its model's tensors into them."""
    other = tiny_model("llama", 4)  # the same architecture (the same key), other weights
    with LLM(other, block_size=16, num_blocks=64, max_num_seqs=8) as llm:
        other_want = tokens(llm)
    assert other_want != want
    for m, w in ((model, want), (other, other_want), (model, want)):
        with build(m, True) as llm:
            assert llm.kv_cache_info()["compile"]["artifacts"] in ("cold", "warm")
            assert tokens(llm) == w
            assert llm.rank_stats()[0]["compiled_steps"] > 0


def test_no_manifest_means_nothing_is_loaded(tmp_path):
    c = autocompile.ArtifactCache("k", {}, tmp_path)
    (c.inductor / "ab").mkdir(parents=True)
    (c.inductor / "ab" / "x.py").write_text("print('half written')")
    damaged, why = c.check()
    assert damaged == ["ab/x.py"] and "no manifest" in why
    with c.compiling():
        assert not c.inductor.exists() and c.state.startswith("rebuilt (no manifest")
        (c.inductor / "cd").mkdir(parents=True)
        (c.inductor / "cd" / "y.py").write_text("ok")
    assert c.check() == ([], "")
    with c.compiling():
        assert c.state == "warm"


def test_the_verdict_rule_and_the_key(monkeypatch):
    v = autocompile.verdict_of([(4, 0.0010, 0.0010), (16, 0.0020, 0.0030)])
    assert v["compile"] and v["rows"] == [4, 16]  # 3.0 ms <= 0.95 x 4.0 ms
    assert not autocompile.verdict_of([(4, 0.0039, 0.0040)])["compile"]  # within WIN: eager
    assert autocompile.check_rows(8, 4) == (4, 8)
    assert autocompile.check_rows(256, 4) == (4, 16, 64, 256)
    mc = ModelConfig.from_hf(tiny_model("llama", 3).config.to_dict())
    key, parts = autocompile.cache_key(mc, torch.float32, "cpu", range(0, 2), True, True, "packed")
    assert set(parts) == {
        "model", "dtype", "device", "stage", "linear", "torch", "isa", "cpu", "threads", "ringkv",
        "source",
    }  # fmt: skip
    assert parts["threads"] == torch.get_num_threads() and parts["torch"] == torch.__version__
    torch.set_num_threads(torch.get_num_threads() + 1)
    try:
        other, _ = autocompile.cache_key(mc, torch.float32, "cpu", range(2), True, True, "packed")
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)
    assert other != key
    autocompile.source_digest.cache_clear()  # changed code (here: as if) is another key
    monkeypatch.setattr(autocompile, "source_digest", lambda: "changed")
    assert autocompile.cache_key(mc, torch.float32, "cpu", range(2), True, True, "packed")[0] != key


@pytest.mark.parametrize(
    "settings,why",
    [
        (dict(tp=2), "eager: tp=2 (compile_decode supports tp=1 only)"),
        (dict(device="cuda"), "eager: the compiled path is untested on cuda"),
    ],
)
def test_auto_where_compile_cannot_run_is_no_error(model, settings, why, monkeypatch):
    """tp > 1 and a GPU: "auto" resolves to eager when the shape is made (before any rank or
    device is touched), where True raises (tp) as before."""
    from ringkv.engine.core import EngineCore

    monkeypatch.delenv(autocompile.SWITCH, raising=False)
    core = object.__new__(EngineCore)  # just the configuration checks
    core.config = ModelConfig.from_hf(model.config.to_dict())
    core.device = torch.device(settings.get("device", "cpu"))
    core.dtype = torch.float32
    c = EngineConfig(num_blocks=8, tp=settings.get("tp", 1), compile_decode="auto")
    shape = core._make_shape(c)
    assert shape.compile_buckets is None and shape.compile_why.startswith(why)
    assert shape.compile_mode == "auto"
