"""``compile_decode=True`` (``ringkv/parallel/compiled.py``): decode steps run one compiled graph
per stage, attention an opaque op inside it. Greedy tokens equal the eager engine's on the real
SmolLM2-135M-Instruct (up to a genuine near-tie: none seen) for prompts of mixed lengths and
batches whose size changes between steps (requests finish at different steps), the engine
switching between the frozen decode graph (4 rows or more on CPU), the unfrozen graph (prefill,
chunks mixed with decode rows) and eager steps (1-3 rows); a pipeline and a sequence-parallel
mesh give transformers' tokens; unsupported settings fail at construction."""

from __future__ import annotations

import os
import platform

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.kernels import linear_cpu  # noqa: E402
from ringkv.parallel.compiled import CPU_MIN_ROWS, CompiledDecode, decode_buckets  # noqa: E402
from tests.models import needs_smollm2  # noqa: E402

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a young",
    "You are a careful assistant. Answer briefly. The river is long, the mountain is tall, "
    "the city is old and the sea is deep. Question: which is deep?",
    "Hi",
    "The history of the river valley begins with small farming villages",
]
NEAR_TIE = 1e-4  # a token may differ only where eager's top-2 log-probs are this close (relative)


@pytest.fixture(scope="module")
def engines():
    from tests.models import smollm2_path

    path = smollm2_path()
    eager = LLM(path, block_size=16, num_blocks=128, max_num_seqs=8)
    compiled = LLM(path, block_size=16, num_blocks=128, max_num_seqs=8, compile_decode=True)
    prompts = [eager.tokenizer.encode(t) for t in TEXTS]
    yield eager, compiled, prompts
    eager.close()
    compiled.close()


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def check_same(eager_outs, compiled_outs):
    """Token for token, or a first difference at a genuine near-tie of the eager logits."""
    for e, c in zip(eager_outs, compiled_outs):
        if e.token_ids == c.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(e.token_ids, c.token_ids)) if a != b)
        top = e.logprobs[i].top  # [(id, logprob), ...] of the raw logits, most likely first
        margin = top[0][1] - top[1][1]
        assert margin <= NEAR_TIE * max(1.0, abs(top[0][1])), (i, e.token_ids, c.token_ids, top)


@needs_smollm2
def test_greedy_equals_eager_as_requests_finish(engines):
    eager, compiled, prompts = engines
    lengths = [2, 4, 6, 8, 10, 12, 12]  # decode steps of 7, 6, 6, 5, 5, 4, 4, then 3, 3, 2, 2 rows
    params = [greedy(n) for n in lengths]
    before = compiled.rank_stats()[0]
    want = eager.generate(prompts, params, use_tqdm=False)
    got = compiled.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in got] == lengths
    check_same(want, got)
    assert [o.token_ids for o in got] == [
        o.token_ids for o in want
    ]  # what we observe: no near-tie at all
    after = compiled.rank_stats()[0]
    steps, compiled_steps = (
        after["steps"] - before["steps"],
        after["compiled_steps"] - before["compiled_steps"],
    )
    assert CPU_MIN_ROWS == 4 and steps == max(lengths)  # one prefill step, 11 decode steps
    assert (
        compiled_steps == 1 + 7
    )  # the prefill (the unfrozen graph), the decode steps of >= 4 rows; 1-3 rows: eager
    assert after["compile_s"] > 0
    assert after["linear"] == ("packed" if linear_cpu.available() else "mkl")
    assert eager.rank_stats()[0]["linear"] == after["linear"]  # eager steps: the same linears
    assert after["heap_kept"] == (platform.libc_ver()[0] == "glibc")  # worker.keep_heap


@needs_smollm2
def test_full_batch_single_request_and_sampling(engines):
    eager, compiled, prompts = engines
    batch = prompts + [prompts[0] + prompts[2]]  # 8 rows = max_num_seqs, the largest bucket
    check_same(
        eager.generate(batch, greedy(5), use_tqdm=False),
        compiled.generate(
            batch, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
        ),
    )
    one = [
        prompts[3]
    ]  # a single request: 1-row decode steps, eager (a prefix-cache hit on its prompt)
    check_same(
        eager.generate(one, greedy(6), use_tqdm=False),
        compiled.generate(one, greedy(6), use_tqdm=False),
    )
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=3, ignore_eos=True)
    a = eager.generate(
        prompts[:3], seeded, use_tqdm=False
    )  # logits to the driver: the compiled LM head
    b = compiled.generate(prompts[:3], seeded, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@needs_smollm2
def test_chunked_prefill_and_mixed_steps(engines):
    """A token budget of 24 chunks the prompts and mixes chunks with decode rows: those steps run
    the unfrozen graph (CPU) and give eager's tokens."""
    eager, compiled, prompts = engines
    for llm in (eager, compiled):
        llm.core.pipeline.scheduler.max_num_batched_tokens = 24
    try:
        before = compiled.rank_stats()[0]
        want = eager.generate(prompts, greedy(7), use_tqdm=False)
        got = compiled.generate(prompts, greedy(7), use_tqdm=False)
        after = compiled.rank_stats()[0]
    finally:
        for llm in (eager, compiled):
            llm.core.pipeline.scheduler.max_num_batched_tokens = 2048
    check_same(want, got)
    compiled_steps, steps = (
        after["compiled_steps"] - before["compiled_steps"],
        after["steps"] - before["steps"],
    )
    assert steps > 7  # the prompts took several chunked steps
    assert compiled_steps > 6  # more than the <= 6 decode-only steps: chunked and mixed steps too


def test_buckets():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(6) == (1, 2, 4, 6) and decode_buckets(1) == (1,)
    cpu = CompiledDecode.__new__(CompiledDecode)  # bucket() only: nothing compiled
    cpu.cuda, cpu.buckets, cpu.largest, cpu.min_rows = False, decode_buckets(8), 8, CPU_MIN_ROWS
    assert [cpu.bucket(t) for t in (1, 3, 4, 5, 8, 9)] == [
        None,
        None,
        4,
        5,
        8,
        None,
    ]  # one dynamic graph
    assert [cpu.other(t) for t in (1, 3, 4, 9, 2048)] == [
        False,
        False,
        True,
        True,
        True,
    ]  # the unfrozen graph
    gpu = CompiledDecode.__new__(CompiledDecode)
    gpu.cuda, gpu.buckets, gpu.largest, gpu.min_rows = True, decode_buckets(6), 6, 1
    assert [gpu.bucket(t) for t in (1, 2, 3, 5, 6, 7)] == [
        1,
        2,
        4,
        6,
        6,
        None,
    ]  # padded up to a bucket
    assert not any(gpu.other(t) for t in (1, 7, 2048))  # CUDA: any other step eager


def test_bad_settings_fail_at_construction():
    from tests.models import tiny_model

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="compile_decode does not support tp=2"):
        LLM(model, tp=2, compile_decode=True, num_blocks=8)
    with pytest.raises(ValueError, match="compile_decode must be True, False or 'auto'"):
        LLM(model, compile_decode="yes", num_blocks=8)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        LLM(model, compile_decode=True, max_num_seqs=0, num_blocks=8)


def test_cli_flag():
    from ringkv.__main__ import _parser

    args = _parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--compile-decode"])
    assert args.compile_decode == "true"  # (EngineConfig reads "true" as True)
    assert _parser().parse_args(["serve", "--model", "m"]).compile_decode == "auto"  # the default


@pytest.mark.parametrize("mesh", [dict(pp=2), dict(sp=2)])
def test_mesh_greedy_equals_transformers(worlds, mesh):
    """Each rank compiles its own stage: a later pipeline stage takes hidden states, SP ranks merge
    their partial attention inside the opaque op."""
    import torch

    from tests.models import hf_greedy, tiny_model

    s = ("tiny", "llama", 0, dict(num_hidden_layers=3))
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 128, (n,), generator=g).tolist()
        for n in (3, 17, 9, 1, 30, 12, 5, 22, 8, 14)
    ]
    want = hf_greedy(tiny_model("llama", 0, num_hidden_layers=3), prompts, 6)
    # pp=2 keeps two steps in flight, each with half the sequences: 5 rows, compiled (>=
    # CPU_MIN_ROWS)
    kw = dict(mesh, block_size=4, num_blocks=128, max_num_seqs=10, compile_decode=True)
    res = worlds(2).check(
        "tests.engine_cases:generate",
        2,
        s,
        kw,
        prompts,
        SamplingParams(temperature=0, max_tokens=6),
        1,
        timeout=300,
    )
    for r in res:
        assert r["tokens"] == [want]
    for st in res[0]["stats"]:
        assert st["compiled_steps"] > 0 and st["compile_s"] > 0
