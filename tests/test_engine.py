"""Engine on a tiny random model (no transformers needed): paged cache + scheduler must give
exactly the tokens of a plain no-cache greedy loop, whatever the batching, chunking,
preemption or prefix-cache hits; sampling params and bad input behave."""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ringkv.engine import LLM, SamplingParams
from ringkv.kernels import paged
from ringkv.model import LlamaForCausalLM, ModelConfig

V = 61


def tiny_engine_model():
    """A 2-layer Llama of vocabulary ``V`` with random weights (seed 0) and sharpened logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits: fewer near-ties, so greedy is a strong check
        m.lm_head.weight.mul_(8)
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


_ref_cache = {}


def uncached_greedy(model, prompt, n):
    """Greedy continuation by re-running the whole sequence each step (no cache)."""
    key = (id(model), tuple(prompt), n)
    if key not in _ref_cache:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model.logits(model(torch.tensor(ids))[-1:]).argmax()))
        _ref_cache[key] = ids[len(prompt) :]
    return _ref_cache[key]


def make_prompts():
    base = [(i * 13 + 5) % V for i in range(48)]
    lengths = [3, 17, 40, 5, 33, 16, 1, 48]
    prompts = [[(i * 7 + j * 3) % V for j in range(n)] for i, n in enumerate(lengths)]
    prompts += [base[:36] + [1, 2], base[:40] + [9], base[:20]]  # shared prefixes
    return prompts


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=10)


class CharTokenizer:
    """ids <-> letters, enough to exercise stop strings and streaming text."""

    eos_token_id = None

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def run(model, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(model, **kw)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_greedy_matches_no_cache_loop_batched_and_one_by_one(model):
    expected = [uncached_greedy(model, p, 10) for p in PROMPTS]
    llm, outs = run(model, block_size=4, num_blocks=256)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert singles == expected
    llm.core.blocks.check()


def test_prefix_cache_hits_do_not_change_output(model):
    expected = [uncached_greedy(model, p, 10) for p in PROMPTS]
    llm, first = run(model, block_size=4, num_blocks=256)
    hits = llm.prefix_cache_hits  # one step admits the whole first batch: few or no hits yet
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.prefix_cache_hits > hits and any(o.num_cached_tokens for o in again)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == expected


def test_forced_hash_collisions_do_not_change_output(model):
    expected = [uncached_greedy(model, p, 10) for p in PROMPTS]
    llm, outs = run(model, block_size=4, num_blocks=256, hash_fn=lambda key: 42)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again] == expected


def test_preemption_and_chunked_prefill_keep_output(model):
    expected = [uncached_greedy(model, p, 10) for p in PROMPTS]
    # 16 blocks of 4 = 64 tokens: the batch cannot fit, sequences get preempted and recomputed
    llm, outs = run(model, block_size=4, num_blocks=16, max_num_batched_tokens=12)
    assert llm.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    llm.core.blocks.check()
    assert llm.core.blocks.num_free == llm.core.blocks.num_blocks  # nothing leaked


def test_core_parts_moved_to_llm_core_still_read_with_a_warning(model):
    """LLM forwards what users read; its old forwards of the core's parts (llm.scheduler, ...)
    still read the same objects for a release, each with a DeprecationWarning; others fail."""
    llm, _ = run(model, block_size=4, num_blocks=16)
    for name in sorted(type(llm).MOVED):
        with pytest.warns(DeprecationWarning, match=f"llm.core.{name}"):
            assert getattr(llm, name) is getattr(llm.core, name)
    assert llm.num_preemptions == llm.core.scheduler.num_preemptions
    with pytest.raises(AttributeError, match="no_such_part"):
        llm.no_such_part


@settings(max_examples=12, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(8, 80),
    max_seqs=st.integers(1, 6),
    max_tokens_step=st.integers(1, 40),
    caching=st.booleans(),
)
def test_any_engine_shape_gives_reference_tokens(
    model, block_size, num_blocks, max_seqs, max_tokens_step, caching
):
    cap = block_size * num_blocks
    prompts = [p for p in PROMPTS if len(p) + 6 <= cap][:6]
    if not prompts:
        return
    llm = LLM(
        model,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens_step,
        enable_prefix_caching=caching,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outs] == [uncached_greedy(model, p, 10)[:6] for p in prompts]
    llm.core.blocks.check()
    assert sum(llm.core.blocks.ref) == 0


def test_sampling_seed_top_k_and_stop_ids(model):
    llm = LLM(model, block_size=4, num_blocks=128)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=12, seed=7)
    a = llm.generate(PROMPTS[:4], p, use_tqdm=False)
    b = llm.generate(PROMPTS[:4], p, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0.9, max_tokens=12, seed=8), use_tqdm=False
    )
    assert [o.token_ids for o in c] != [o.token_ids for o in a]
    k1 = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=1.5, top_k=1, max_tokens=10), use_tqdm=False
    )
    assert [o.token_ids for o in k1] == [uncached_greedy(model, q, 10) for q in PROMPTS[:4]]
    ref = uncached_greedy(model, PROMPTS[1], 10)
    stop = llm.generate(
        PROMPTS[1],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[3]]),
        use_tqdm=False,
    )[0]
    first = ref.index(ref[3])
    assert stop.token_ids == ref[: first + 1] and stop.finish_reason == "stop"
    # EOS ends a request unless ignore_eos
    llm.eos_ids = {ref[2]}
    first = ref.index(ref[2])
    assert llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].token_ids == ref[: first + 1]
    assert (
        llm.generate(
            PROMPTS[1],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0].token_ids
        == ref
    )


def test_stop_strings_and_stream(model):
    llm = LLM(model, block_size=4, num_blocks=128, tokenizer=CharTokenizer())
    ref = uncached_greedy(model, PROMPTS[2], 10)
    text = CharTokenizer().decode(ref)
    stop = text[4:6]
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, stop=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    deltas = list(llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10)))
    assert [d.token_id for d in deltas] == ref
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason == "length"
    s = "abcde"
    assert llm.generate(s, GREEDY, use_tqdm=False)[0].prompt_token_ids == [0, 1, 2, 3, 4]


def test_bad_requests_fail_alone(model):
    llm = LLM(model, block_size=4, num_blocks=64, max_model_len=40)
    good = PROMPTS[1]
    outs = llm.generate(
        [good, [], list(range(45)), [V + 3], good, good],
        [GREEDY, GREEDY, GREEDY, GREEDY, SamplingParams(temperature=-1), SamplingParams(top_p=0)],
        use_tqdm=False,
    )
    assert outs[0].token_ids == uncached_greedy(model, good, 10) and outs[0].error is None
    for o, word in zip(outs[1:], ["empty", "max_model_len", "vocabulary", "temperature", "top_p"]):
        assert o.finish_reason == "error" and word in o.error and o.token_ids == []
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([good, good], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text without a tokenizer", GREEDY, use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate(3.5, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, block_size=4, num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="empty"):
        list(llm.stream([], GREEDY))
    # length limit: generation stops at max_model_len
    out = llm.generate(
        list(range(35)), SamplingParams(temperature=0, max_tokens=50), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_kv_cache_sized_from_memory_budget(model):
    from ringkv.cache import bytes_per_block

    per = bytes_per_block(2, 4, 2, 8, torch.float32)
    llm = LLM(model, block_size=4, kv_cache_memory=per * 10 + 5)
    assert llm.core.kv.num_blocks == 10 and llm.max_model_len == 40


def test_cache_salt_per_request(model):
    llm = LLM(model, block_size=4, num_blocks=128)
    p = PROMPTS[2]
    llm.generate(p, GREEDY, use_tqdm=False, cache_salt="alice")
    outs = llm.generate([p, p], GREEDY, use_tqdm=False, cache_salt=["bob", "alice"])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    assert outs[0].token_ids == outs[1].token_ids == uncached_greedy(model, p, 10)
    with pytest.raises(ValueError, match="cache salts"):
        llm.generate([p, p], GREEDY, use_tqdm=False, cache_salt=["x"])


@pytest.mark.parametrize(
    "first", [dict(), dict(prompt_logprobs=0)], ids=["plain", "prompt_logprobs"]
)
def test_request_finished_in_its_prefill_step_leaves_its_prompt_blocks_cached(model, first):
    """A request whose prefill step is also its last (max_tokens=1, or an echo-style
    prompt-log-probs request) registers the prompt blocks that step filled: the same prompt
    again hits every full block but the one holding its last token ((len - 1) // bs * bs)."""
    llm = LLM(model, block_size=16, num_blocks=64)
    for length in (20, 50, 32):  # a part-filled last block, several blocks, an exact multiple
        prompt = [(i * 11 + length) % V for i in range(length)]
        out = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=1, **first), use_tqdm=False
        )[0]
        assert out.num_cached_tokens == 0 and out.token_ids == uncached_greedy(model, prompt, 1)
        again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        assert again.num_cached_tokens == (length - 1) // 16 * 16, (length, again.num_cached_tokens)
        assert again.token_ids == out.token_ids
    llm.core.blocks.check()


@pytest.mark.parametrize("length", [60, 440])
def test_decode_steps_hash_each_block_once(model, length):
    """Prefix caching hashes a block once, when it fills: the hashing of a run grows with the
    tokens it adds, not with (context x steps)."""
    calls = []

    def counting(key):
        calls.append(1)
        return hash(key)

    llm = LLM(model, block_size=16, num_blocks=128, hash_fn=counting, max_num_batched_tokens=4096)
    prompt = [(i * 7) % V for i in range(length)]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 40
    blocks = (length + 40) // 16
    assert len(calls) <= 2 * blocks + 2  # admission's lookup + one registration per full block


def test_streams_interleaved_with_each_other_and_generate(model):
    """Each stream yields one delta per token, none lost or merged, even when another stream
    or a generate call advanced its request in between."""
    tok = CharTokenizer()
    llm = LLM(model, block_size=4, num_blocks=128, tokenizer=tok)
    a, b = PROMPTS[1], PROMPTS[2]
    sa, sb = llm.stream(a, GREEDY), llm.stream(b, GREEDY)
    got_a, got_b = [next(sa)], [next(sb)]  # b's first step also advanced a
    got_a.append(next(sa))
    assert [o.token_ids for o in llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)] == [
        uncached_greedy(model, PROMPTS[3], 10)
    ]
    got_a += list(sa)
    got_b += list(sb)
    for got, ref in (
        (got_a, uncached_greedy(model, a, 10)),
        (got_b, uncached_greedy(model, b, 10)),
    ):
        assert [d.token_id for d in got] == ref
        assert "".join(d.text for d in got) == tok.decode(ref)
        assert got[-1].finish_reason == "length" and all(d.finish_reason is None for d in got[:-1])
    assert llm.core.blocks.num_free == llm.core.blocks.num_blocks


def test_stop_string_across_tokens_is_never_streamed(model):
    tok = CharTokenizer()
    llm = LLM(model, block_size=4, num_blocks=128, tokenizer=tok)
    ref = tok.decode(uncached_greedy(model, PROMPTS[2], 10))
    stop = ref[3:6]  # spans three tokens
    deltas = list(llm.stream(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, stop=[stop])))
    assert (
        "".join(d.text for d in deltas) == ref[: ref.index(stop)]
        and deltas[-1].finish_reason == "stop"
    )


def test_triton_paged_kernels_give_reference_results(model, monkeypatch, request):
    """The engine's CUDA path, here under the Triton interpreter: one-token rows through the
    decode kernel, later prefill chunks and prefix-continued prompts through the varlen prefill
    kernel. Prompt log-probs of a chunked prompt equal a plain forward's (and, over an int8
    cache, the torch backend's); a prompt continuing a cached prefix gives the reference tokens."""
    tp = pytest.importorskip("ringkv.kernels.triton_paged")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
    calls = []
    for name in ("paged_decode_triton", "paged_prefill_triton"):
        real = getattr(tp, name)
        monkeypatch.setattr(
            tp, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
        )
    request.addfinalizer(paged.PAGED.reset)
    paged.PAGED.register("prefill", "triton", tp.paged_prefill_triton)
    prompt, cont = PROMPTS[-3], PROMPTS[-2]  # 38 tokens; 41 sharing the first 36
    with torch.no_grad():
        want = torch.log_softmax(model.logits(model(torch.tensor(prompt))).float(), -1)[:-1]
    want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    kw = dict(block_size=4, num_blocks=40, max_num_batched_tokens=12)  # 12-token chunks
    llm, outs = run(model, [prompt], params, paged_backend="triton", **kw)
    torch.testing.assert_close(torch.tensor(outs[0].prompt_logprobs), want, atol=1e-4, rtol=1e-4)
    assert outs[0].token_ids == uncached_greedy(model, prompt, 10)[:3]
    again = llm.generate([cont], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert (
        again[0].token_ids == uncached_greedy(model, cont, 10)[:3]
        and again[0].num_cached_tokens == 36
    )
    assert {"paged_decode_triton", "paged_prefill_triton"} <= set(calls)
    llm.core.blocks.check()
    int8 = [
        run(model, [prompt], params, paged_backend=b, kv_cache_dtype="int8", **kw)[1][
            0
        ].prompt_logprobs
        for b in ("triton", "torch")
    ]
    torch.testing.assert_close(torch.tensor(int8[0]), torch.tensor(int8[1]), atol=1e-4, rtol=1e-4)


_FAULTS = r"""
import json, resource, sys, torch
from ringkv.parallel.worker import keep_heap

def faults():  # minor page faults of allocating, touching and freeing 48 MiB, the 4th time
    for _ in range(4):  # (the 2nd may not fit the 1st's place: memalign asks a few bytes more)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(12 << 20)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
on = keep_heap()
print(json.dumps(dict(default=default, on=on, kept=faults())))
"""


def test_keep_heap_stops_a_steps_large_blocks_faulting_afresh():
    """A CPU worker calls ``keep_heap``: a block freed by one step is reused by the next, not
    given back to the OS and faulted in (zeroed) again. Process-wide, so in a process of its own;
    48 MiB is past what glibc's own threshold reaches (32 MiB), so it maps it afresh by default."""
    import json
    import platform
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    if platform.libc_ver()[0] != "glibc":
        assert not got["on"]
        return
    assert got["on"]
    assert got["default"] > 10_000  # 12,288 pages: glibc's default faults them in every time
    assert got["kept"] < 500
