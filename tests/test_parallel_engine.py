"""The engine over a (pp, sp, tp) mesh of real gloo ranks: greedy tokens equal transformers'
``generate`` for every (tp, pp) with tp * pp <= 4 and sp in {2, 3, 4}, with chunked prefill,
prefix-cache hits and preemption happening; the KV cache per rank matches the seed formula;
bad configurations and disagreeing ranks fail on every rank."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("transformers")

from ringkv.engine import SamplingParams  # noqa: E402
from tests.models import hf_greedy, tiny_model  # noqa: E402

N_OUT = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT)
# (heads, kv heads) per arch and tp: KV heads split, or replicated when tp > kv heads
HEADS = {
    ("llama", 1): (4, 2),
    ("llama", 2): (4, 2),
    ("llama", 3): (6, 3),
    ("llama", 4): (8, 2),
    ("qwen2", 1): (4, 2),
    ("qwen2", 2): (4, 1),
    ("qwen2", 3): (3, 1),
    ("qwen2", 4): (4, 2),
    ("mistral", 1): (4, 2),
    ("mistral", 2): (6, 2),
    ("mistral", 3): (6, 3),
    ("mistral", 4): (4, 4),
}
_refs = {}


def spec(arch, heads, kv, layers=5, max_pos=512, seed=0):
    return (
        "tiny",
        arch,
        seed,
        dict(
            num_attention_heads=heads,
            num_key_value_heads=kv,
            hidden_size=16 * heads,
            num_hidden_layers=layers,
            max_position_embeddings=max_pos,
        ),
    )


def hf_greedy_tokens(s, prompts, n=N_OUT):
    """transformers' greedy tokens of the unsharded tiny model ``s`` describes (cached)."""
    key = (repr(s), tuple(map(tuple, prompts)), n)
    if key not in _refs:
        _refs[key] = hf_greedy(tiny_model(s[1], s[2], **s[3]), prompts, n)
    return _refs[key]


def prompts_short(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40, 33, 60, 1, 25)]
    return ps + [ps[4][:44] + [5, 6], ps[2][:36] + [9]]  # shared prefixes: prefix-cache hits


def check_info(info, s, tp, pp, sp, layers):
    kv = s[3]["num_key_value_heads"]
    stages = sorted({tuple(r["layers"]) for r in info["per_rank"]})
    assert (
        len(stages) == pp and stages[0][0] == 0 and stages[-1][1] == layers
    )  # contiguous stages, all layers
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:]))
    assert info["capacity_tokens"] == info["num_blocks"] * info["block_size"] * sp
    assert len(info["per_rank"]) == tp * pp * sp
    for r in info["per_rank"]:
        assert tuple(r["layers"]) == stages[r["pp_rank"]]
        per_token = (
            2 * (r["layers"][1] - r["layers"][0]) * max(1, kv // tp) * 16 * 4
        )  # the seed's formula, fp32
        assert r["bytes_per_token"] == per_token, r
        assert r["kv_cache_bytes"] == info["num_blocks"] * info["block_size"] * per_token, (
            r
        )  # really allocated


TP_PP = [(2, 1), (3, 1), (4, 1), (1, 2), (1, 3), (1, 4), (2, 2)]


def hf_prompt_logprobs(s, prompt):
    """transformers' ``log p(prompt[i] | prompt[:i])`` for ``i >= 1``: ``(len - 1,)`` float32."""
    with torch.no_grad():
        logp = torch.log_softmax(
            tiny_model(s[1], s[2], **s[3])(torch.tensor([prompt])).logits[0].float(), -1
        )
    return logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def got_logprobs(got):
    return torch.tensor([x for x in got if x is not None], dtype=torch.float32)


# what each family adds (tests.models): Qwen3 q/k norms; Gemma 2 soft-caps (attention 1.5, logits
# 3),
# windows of 6 on every other layer, query_pre_attn_scalar 24, sandwich norms, 1 + weight, GELU,
# scaled
# embeddings; Gemma 3 q/k norms, windows of 5 with their own RoPE base, logits capped at 4; Phi-3
# fused
# q/k/v and gate/up (split by heads / halves under TP), RoPE on half of each head, windows of 7
# everywhere
FAMILIES = ["qwen3", "gemma2", "gemma3_text", "phi3"]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("tp,pp,sp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_families_greedy_and_logprobs_equal_transformers_on_a_mesh(worlds, arch, tp, pp, sp):
    """Greedy tokens and prompt log-probs equal transformers' with TP, PP and SP (sequence-sharded
    cache, ring prefill of 8-token chunks and more), chunked prefill over the paged cache (16-token
    chunks: windows and caps on the cached keys) and prefix caching (the second round hits). The
    log-probs see what greedy tokens cannot (a soft-cap on the logits keeps their order)."""
    s = spec(arch, 4, 2)
    prompts = prompts_short(5)
    want = hf_greedy_tokens(s, prompts)
    n = tp * pp * sp
    kw = dict(
        tp=tp,
        pp=pp,
        sp=sp,
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        sp_prefill_min_tokens=8,
    )
    res = worlds(n).check("tests.engine_cases:generate", n, s, kw, prompts, GREEDY, 2, timeout=300)
    for r in res:
        assert r["tokens"] == [want, want]
    assert res[0]["hits"] > 0
    # the prompt's log-probs against transformers' (sensitive where 8 greedy tokens of a tiny model
    # are not)
    prompt = prompts[4]
    got = worlds(n).check("tests.engine_cases:prompt_logprobs", n, s, kw, prompt, timeout=300)[0]
    torch.testing.assert_close(
        got_logprobs(got), hf_prompt_logprobs(s, prompt), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_families_with_a_quantized_cache(worlds, arch):
    """An int8 cache with soft-caps and windows: SP and TP meshes equal the single-process engine,
    whose prompt log-probs stay near transformers' (the quantized keys are read with the same
    window and caps)."""
    s = spec(arch, 4, 2, layers=3)
    prompt = prompts_short(6)[4]
    kw = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16, kv_cache_dtype="int8")
    one = got_logprobs(worlds(1).check("tests.engine_cases:prompt_logprobs", 1, s, kw, prompt)[0])
    torch.testing.assert_close(one, hf_prompt_logprobs(s, prompt), atol=0.05, rtol=0)
    for mesh in (dict(sp=2, sp_prefill_min_tokens=8), dict(tp=2)):
        got = worlds(2).check("tests.engine_cases:prompt_logprobs", 2, s, dict(kw, **mesh), prompt)[
            0
        ]
        torch.testing.assert_close(got_logprobs(got), one, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tp,pp", TP_PP)
def test_tp_pp_greedy_equals_transformers(worlds, arch, tp, pp):
    s = spec(arch, *HEADS[(arch, tp)])  # 5 layers: pp = 2, 3, 4 split them unevenly
    prompts = prompts_short(tp * 10 + pp)
    want = hf_greedy_tokens(s, prompts)
    kw = dict(tp=tp, pp=pp, block_size=4, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
    res = worlds(tp * pp).check(
        "tests.engine_cases:generate", tp * pp, s, kw, prompts, GREEDY, 2, timeout=300
    )
    for r in res:  # every rank returns the same outputs
        assert r["tokens"] == [want, want]
    lead = res[0]
    assert (
        lead["preemptions"] > 0 and lead["hits"] > 0 and any(lead["cached"][1])
    )  # all three happened
    assert lead["free"] == 24  # nothing leaked
    assert lead["peak_in_flight"] == pp  # pipeline stages were kept busy
    check_info(lead["info"], s, tp, pp, 1, 5)


@pytest.mark.parametrize("sp,tp", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_sp_long_prompts_equal_transformers(worlds, sp, tp):
    s = spec("llama", 4, 2, layers=3, max_pos=4096)
    g = torch.Generator().manual_seed(sp)
    lb = 4 * sp  # tokens per logical block
    n1, n2 = 2500 - 2500 % lb, 700 - 700 % lb  # whole blocks: their first decode needs a new block
    long = torch.randint(3, 128, (n1,), generator=g).tolist()
    prompts = [
        long,
        torch.randint(3, 128, (n2,), generator=g).tolist(),
        long[:2100] + [7, 8, 9],
        [5, 9, 11, 13, 40],
        [77],
        torch.randint(3, 128, (300,), generator=g).tolist(),
    ]
    want = hf_greedy_tokens(s, prompts)
    # 1024-token chunks (the long prompt takes three), rings for >= 256 tokens, a cache that holds
    # the first two prompts but not their next token (preemption), a repeated prefix (hits)
    kw = dict(
        sp=sp,
        tp=tp,
        block_size=4,
        num_blocks=(n1 + n2) // lb,
        max_num_batched_tokens=1024,
        sp_prefill_min_tokens=256,
        max_num_seqs=4,
    )
    res = worlds(sp * tp).check(
        "tests.engine_cases:generate", sp * tp, s, kw, prompts, GREEDY, 2, timeout=600
    )
    for r in res:
        assert r["tokens"] == [want, want]
    lead = res[0]
    assert lead["preemptions"] > 0 and lead["hits"] > 0 and any(lead["cached"][1])
    check_info(lead["info"], s, tp, 1, sp, 3)


def test_sp_default_threshold_and_short_prompts(worlds):
    """Below the default ring threshold every prompt runs replicated; one long prompt rings."""
    s = spec("mistral", 4, 2, layers=2, max_pos=4096)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (1, 2, 3, 9, 1500)]
    want = hf_greedy_tokens(s, prompts)
    res = worlds(3).check(
        "tests.engine_cases:generate",
        3,
        s,
        dict(sp=3, block_size=16, num_blocks=64),
        prompts,
        GREEDY,
        1,
        timeout=300,
    )
    assert all(r["tokens"] == [want] for r in res)


def test_kv_is_striped_over_sp_ranks(worlds):
    """Every token's K/V lives on exactly one SP rank: rank r stores positions r, r+sp, ...; so a
    long sequence costs each rank 1/sp of the single-process bytes."""
    s = spec("llama", 4, 2, layers=2, max_pos=4096)
    prompt = torch.randint(3, 128, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_greedy_tokens(s, [prompt], 4)[0]
    computed = len(prompt) + 4 - 1  # the last sampled token never gets K/V
    kw = dict(block_size=16, num_blocks=128, sp_prefill_min_tokens=64)
    one = worlds(1).check("tests.engine_cases:cache_contents", 1, s, kw, prompt, 4)[0]
    assert one["tokens"] == want and one["written"] == computed
    for sp in (2, 4):
        res = worlds(sp).check(
            "tests.engine_cases:cache_contents", sp, s, dict(kw, sp=sp), prompt, 4
        )
        for r, got in enumerate(res):
            assert got["tokens"] == want
            assert got["written"] == len(range(r, computed, sp))  # exactly its striped share
            bytes_rank = got["written"] * got["info"]["bytes_per_token"]
            assert (
                abs(bytes_rank - one["written"] * one["info"]["bytes_per_token"] / sp)
                <= 16 * got["info"]["bytes_per_token"]
            )  # within one block of 1/sp
        assert got["info"]["capacity_tokens"] == sp * one["info"]["capacity_tokens"]


def test_stream_on_every_rank(worlds):
    s = spec("llama", 4, 2)
    prompt = prompts_short()[2]
    want = hf_greedy_tokens(s, [prompt])[0]
    res = worlds(2).check(
        "tests.engine_cases:stream", 2, s, dict(pp=2, block_size=4, num_blocks=64), prompt, GREEDY
    )
    assert res[0] == res[1] and [t for t, _, _ in res[0]] == want and res[0][-1][2] == "length"


def test_seeded_sampling_equals_single_process(worlds):
    s = spec("qwen2", 4, 2)
    prompts = prompts_short(3)[:5]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=N_OUT, seed=i) for i in range(5)
    ]
    kw = dict(block_size=4, num_blocks=64)
    single = worlds(1).check("tests.engine_cases:seeded", 1, s, kw, prompts, params)[0]
    assert single != hf_greedy_tokens(s, prompts)  # really sampled
    for tp, pp in ((2, 1), (1, 2)):
        res = worlds(2).check(
            "tests.engine_cases:seeded", 2, s, dict(kw, tp=tp, pp=pp), prompts, params
        )
        assert res[0] == res[1] == single


def test_ranks_read_only_their_slices(worlds, tmp_path):
    """Under TP each rank reads slices of the checkpoint (never a sharded tensor whole); under PP
    only its stage's layers. Besides, the driver reads a few rows of every tensor for the model
    digest of KV snapshots (``snapshot.DIGEST_ROWS`` rows along dim 0, small ones whole)."""
    from ringkv.engine.snapshot import DIGEST_ROWS

    s = spec("llama", 4, 2, layers=4)
    m = tiny_model(s[1], s[2], **s[3])
    m.save_pretrained(tmp_path, safe_serialization=True)
    total = sum(p.numel() * 4 for p in m.parameters())
    res = worlds(4).check(
        "tests.engine_cases:read_slices", 4, str(tmp_path), dict(tp=2, pp=2, num_blocks=8)
    )
    for r, got in enumerate(res):
        read = sum(b for _, _, b in got["seen"])
        assert read == got["weight_bytes"] < 0.35 * total, (
            r,
            read,
            total,
        )  # about 1/4 of the model
        for name, dim, _ in got["seen"]:
            assert dim is not None or "norm" in name, name  # only the small norms are read whole
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            assert layer is None or (layer < 2) == (r < 2), (
                r,
                name,
            )  # stage 0 = ranks 0-1, layers 0-1
        if r > 0:
            assert not got["digest"]
            continue
        assert {n for n, *_ in got["digest"]} == {
            n for n, _ in m.named_parameters()
        }  # every tensor, sampled
        for name, dim, start, stop, _ in got["digest"]:
            assert (dim, stop - start) == (0, 1) or "norm" in name, (
                name,
                dim,
                start,
                stop,
            )  # single rows
        assert len([d for d in got["digest"] if d[1] == 0]) <= DIGEST_ROWS * len(
            list(m.parameters())
        )


def test_bad_configurations_fail_on_every_rank_before_loading(worlds):
    s = spec("llama", 4, 2, layers=3)
    cases = [
        (dict(tp=2, pp_layers=[2, 2]), "pp_layers"),  # does not sum to 3 layers (pp defaults to 1)
        (dict(pp=2, pp_layers=[3, 0]), "pp_layers"),
        (dict(tp=4, num_blocks=4), "world has 2"),  # world of 2 != tp * pp * sp = 4
        (
            dict(tp=2, num_blocks=2, max_model_len=64),
            "max_model_len",
        ),  # 2 blocks of 16 tokens hold 32
        (dict(tp=2, kv_cache_memory=1000), "holds no block"),
    ]
    for kw, word in cases:
        res = worlds(2).run("tests.engine_cases:construct", 2, s, kw)
        for kind, msg, seconds in res:
            assert kind == "ValueError" and word in msg, (kw, kind, msg)


def test_disagreeing_ranks_fail_within_the_timeout(worlds):
    s = spec("llama", 4, 2, layers=2)
    res = worlds(2).run(
        "tests.engine_cases:construct", 2, s, [dict(tp=2, block_size=4), dict(tp=2, block_size=8)]
    )
    assert all(kind == "ValueError" and "different engine" in msg for kind, msg, _ in res), res
    res = worlds(2).check(
        "tests.engine_cases:disagree_call", 2, s, dict(pp=2, num_blocks=16), [[5, 6, 7], [5, 6]]
    )
    assert all("other prompts" in m for m in res), res


@st.composite
def mesh_case(draw):
    """A mesh of at most 4 ranks and a model and cache it can run."""
    tp, pp, sp = draw(
        st.sampled_from(
            [
                (1, 1, 2),
                (2, 1, 1),
                (1, 2, 1),
                (1, 1, 3),
                (3, 1, 1),
                (1, 3, 1),
                (2, 2, 1),
                (2, 1, 2),
                (1, 2, 2),
                (4, 1, 1),
                (1, 1, 4),
                (1, 4, 1),
            ]
        )
    )
    kv = draw(
        st.sampled_from([k for k in (1, 2, 3, 4, 6) if (k % tp == 0 if tp <= k else tp % k == 0)])
    )
    heads = kv * draw(st.sampled_from([g for g in (1, 2, 3, 4) if (kv * g) % tp == 0]))
    layers = draw(st.integers(pp, pp + 3))
    arch = draw(
        st.sampled_from(["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"])
    )
    s = (
        "tiny",
        arch,
        draw(st.integers(0, 3)),
        dict(
            num_attention_heads=heads,
            num_key_value_heads=kv,
            hidden_size=8 * heads,
            num_hidden_layers=layers,
            intermediate_size=draw(st.sampled_from([40, 96, 97])),
            max_position_embeddings=1024,
        ),
    )
    lengths = draw(st.lists(st.integers(1, 300), min_size=1, max_size=5))
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    need = max(lengths) + 6
    blocks = -(-need // (bs * sp)) + draw(
        st.integers(0, 40)
    )  # room for the longest, maybe not for all
    kw = dict(
        tp=tp,
        pp=pp,
        sp=sp,
        block_size=bs,
        num_blocks=blocks,
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(8, 400)),
        sp_prefill_min_tokens=draw(st.integers(1, 300)),
        enable_prefix_caching=draw(st.booleans()),
    )
    return s, kw, lengths, draw(st.integers(0, 2**16))


@settings(
    max_examples=int(os.environ.get("RINGKV_MESH_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=mesh_case())
def test_any_mesh_gives_single_process_tokens(worlds, case):
    """Whatever the mesh, model shape, block size, cache size and batch limits: the tokens of
    the single-process engine (itself checked against transformers above)."""
    s, kw, lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[0][: max(1, lengths[0] - 3)] + [9])  # a shared prefix
    params = SamplingParams(temperature=0, max_tokens=6)
    single = dict(kw, tp=1, pp=1, sp=1, num_blocks=kw["num_blocks"] * kw["sp"])  # the same capacity
    want = worlds(1).check("tests.engine_cases:seeded", 1, s, single, prompts, params)[0]
    n = kw["tp"] * kw["pp"] * kw["sp"]
    res = worlds(n).check("tests.engine_cases:seeded", n, s, kw, prompts, params, timeout=300)
    assert all(r == want for r in res), (kw, lengths)


def test_sp_triton_paged_kernels_equal_the_single_process_engine(worlds):
    """SP ranks on the CUDA path (here the Triton interpreter): chunks over each rank's striped
    keys through the varlen prefill kernel, decode through the decode kernel, merged across
    ranks."""
    pytest.importorskip("ringkv.kernels.triton_paged")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU")
    s = spec("llama", 4, 2, layers=2)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (21, 5)]
    kw = dict(
        block_size=4, num_blocks=64, max_num_batched_tokens=8
    )  # 8-token chunks, all replicated
    lp_one = worlds(1).check("tests.engine_cases:prompt_logprobs", 1, s, kw, prompts[0])[0]
    sp_kw = dict(kw, sp=2, sp_prefill_min_tokens=1000, paged_backend="triton")
    lp_sp = worlds(2).check("tests.engine_cases:prompt_logprobs", 2, s, sp_kw, prompts[0])
    torch.testing.assert_close(torch.tensor(lp_sp[0]), torch.tensor(lp_one), atol=1e-4, rtol=1e-4)
    res = worlds(2).check(
        "tests.engine_cases:generate",
        2,
        s,
        sp_kw,
        prompts[1:],
        SamplingParams(temperature=0, max_tokens=3),
        1,
    )
    assert all(r["tokens"] == [hf_greedy_tokens(s, prompts[1:], 3)] for r in res)
