"""Quantized KV cache: quantize/dequantize error bounds (never NaN/inf), paged attention over a
quantized cache equals the reference over the dequantized values (every backend), engines on
any mesh compute what the single-process engine computes with the same quantized cache, and
prompt log-probs equal transformers' log-softmax."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ringkv.engine import LLM, SamplingParams
from ringkv.kernels import quant
from ringkv.kernels.paged import _BACKENDS, paged_attention, paged_attention_reference
from ringkv.kernels.quant import FORMATS, dequantize, quantize, rotation

NAMES = sorted(FORMATS)
REL = {"int8": None, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}  # fp8: relative precision (half an ulp)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    t=st.integers(1, 5),
    h=st.integers(1, 3),
    d=st.sampled_from([8, 16, 48, 64, 128]),
    magnitude=st.sampled_from([0.0, 1e-30, 1e-6, 1e-2, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 1000),
    outlier=st.booleans(),
)
def test_quantize_error_is_bounded(name, t, h, d, magnitude, seed, outlier):
    fmt = FORMATS[name]
    x = torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)) * magnitude
    if outlier:
        x[..., 0] *= 50  # one large channel, as keys have
    rot = rotation(d)
    q, s = quantize(x, fmt, rot)
    assert q.dtype == fmt.dtype and s.dtype == torch.float16 and s.shape == x.shape[:-1]
    y = dequantize(q, s)
    assert torch.isfinite(y).all() and torch.isfinite(s.float()).all()
    xr = x @ rot if fmt.rotate else x
    err = (y - xr).abs()
    scale = s.float()[..., None]
    if name == "int8":  # half a step, where the step is the (fp16) scale
        assert bool((err <= 0.5 * scale * 1.01 + 1e-30).all()), err.max()
    else:  # no worse in total than plain amax scaling, whose error per value is relative
        amax_scale = (
            (xr.abs().amax(-1, keepdim=True) / fmt.qmax).clamp(2**-24, 65504).half().float()
        )
        bound = xr.abs() * REL[name] + amax_scale * 2**-9
        assert float(err.square().sum()) <= float(bound.square().sum()) * 1.0001 + 1e-30
    if magnitude == 0.0:
        assert bool((y == 0).all())


def test_huge_values_saturate_without_inf():
    x = torch.tensor([[[1e30, -1e30, 3.0, 0.0]]])
    for fmt in FORMATS.values():
        y = dequantize(*quantize(x, fmt, rotation(4)))
        assert torch.isfinite(y).all()


def test_rotation_is_orthogonal_and_shared():
    for d in (16, 64, 80, 96):
        r = rotation(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
        assert torch.equal(r, rotation(d))  # every rank builds the same one


def test_unsupported_dtype_names_the_supported_ones():
    with pytest.raises(ValueError, match="int8"):
        quant.resolve("int4")
    assert quant.resolve("fp8").name == "fp8_e4m3" and quant.resolve("auto") is None


def quantized_cache(num_blocks, bs, hkv, d, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    (kq, ks), (vq, vs) = quantize(k, fmt, rotation(d)), quantize(v, fmt, rotation(d))
    return (kq, vq, ks, vs), (dequantize(kq, ks), dequantize(vq, vs))


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    n=st.integers(1, 3),
    nq=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 3]),
    causal=st.booleans(),
    seed=st.integers(0, 100),
    backend=st.sampled_from(sorted(b for b in _BACKENDS)),
)
def test_paged_attention_over_a_quantized_cache_equals_the_reference_on_its_values(
    name, n, nq, hkv, g, causal, seed, backend
):
    bs, d, num_blocks = 4, 16, 12
    (kq, vq, ks, vs), (kf, vf) = quantized_cache(num_blocks, bs, hkv, d, FORMATS[name], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(n, nq, hkv * g, d, generator=gen)
    lens = torch.randint(nq, 3 * bs + 1, (n,), generator=gen)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:3] for _ in range(n)]).int()
    want_o, want_l = paged_attention_reference(q, kf, vf, table, lens, causal=causal)
    got_o, got_l = paged_attention(
        q, kq, vq, table, lens, causal=causal, backend=backend, k_scale=ks, v_scale=vs
    )
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(got_l, want_l, atol=2e-5, rtol=2e-4)


# ---- the engine ----


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    from tests.models import tiny_model

    return tiny_model("llama", 0, num_hidden_layers=3)


def test_prompt_logprobs_equal_transformers_log_softmax(hf_model):
    ids = torch.randint(3, 128, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    llm = LLM(hf_model, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )  # caches the prompt
    out = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert out.num_cached_tokens == 0  # computed again: a cache hit would skip positions
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-5, rtol=1e-5)
    assert len(out.prompt_logprobs) == len(ids) - 1 and out.prompt_top_logprobs is None
    values, top = torch.log_softmax(logits, -1)[:-1].topk(5)
    out = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5), use_tqdm=False
    )[0]
    assert [[t for t, _ in x] for x in out.prompt_top_logprobs] == top.tolist()
    torch.testing.assert_close(
        torch.tensor([[v for _, v in x] for x in out.prompt_top_logprobs]),
        values,
        atol=2e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=2e-5, rtol=1e-5)
    for bad in (21, -1, True, 2.0):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.add_request(ids, SamplingParams(prompt_logprobs=bad))


def test_prompt_top_logprobs_on_every_mesh(worlds):
    """tp, pp and sp (the ring prefill: each prompt row on its own SP rank) give the same prompt
    log-probs and top-k alternatives as one process, in a batch with requests asking fewer."""
    pytest.importorskip("transformers")
    s = ("tiny", "llama", 0, dict(num_hidden_layers=4, max_position_embeddings=1024))
    prompt = torch.randint(3, 128, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    kw = dict(block_size=4, num_blocks=128, max_num_batched_tokens=32)
    lp, top = worlds(1).check("tests.engine_cases:prompt_logprobs", 1, s, kw, prompt, 4)[0]
    assert len(top) == len(lp) == len(prompt) - 1 and all(len(x) == 4 for x in top)
    for mesh in (dict(tp=2), dict(pp=2), dict(sp=2, sp_prefill_min_tokens=16)):
        got_lp, got_top = worlds(2).check(
            "tests.engine_cases:prompt_logprobs", 2, s, dict(kw, **mesh), prompt, 4
        )[0]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(lp), atol=1e-4, rtol=1e-4)
        assert [[t for t, _ in x] for x in got_top] == [[t for t, _ in x] for x in top], mesh
        torch.testing.assert_close(
            torch.tensor(got_top)[..., 1], torch.tensor(top)[..., 1], atol=1e-4, rtol=1e-4
        )


def test_bytes_per_token_counts_the_scales(hf_model):
    auto = LLM(hf_model, block_size=4, num_blocks=8).kv_cache_info()
    for name in NAMES:
        info = LLM(hf_model, block_size=4, num_blocks=8, kv_cache_dtype=name).kv_cache_info()
        # 3 layers x 2 KV heads x (16 one-byte values + a 2-byte scale), for K and for V
        assert info["bytes_per_token"] == 2 * 3 * 2 * (16 + 2) and info["kv_cache_dtype"] == name
        assert info["per_rank"][0]["kv_cache_bytes"] == 8 * 4 * info["bytes_per_token"]
    assert auto["bytes_per_token"] == 2 * 3 * 2 * 16 * 4
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(hf_model, kv_cache_dtype="fp4")


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_quantized_cache_with_prefix_hits_and_preemption(hf_model, name):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 45, 12, 60)]
    prompts.append(prompts[1][:40] + [7])
    params = SamplingParams(temperature=0, max_tokens=8)
    big = LLM(hf_model, block_size=4, num_blocks=128, kv_cache_dtype=name)
    first = [o.token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    assert first == [
        o.token_ids for o in big.generate(prompts, params, use_tqdm=False)
    ]  # with hits: the same
    assert big.prefix_cache_hits > 0
    small = LLM(
        hf_model, block_size=4, num_blocks=24, max_num_batched_tokens=16, kv_cache_dtype=name
    )
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.num_preemptions > 0 and all(len(o.token_ids) == 8 for o in outs)
    assert small.core.blocks.num_free == small.core.blocks.num_blocks


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_meshes_with_a_quantized_cache_equal_the_single_process_engine(worlds, name):
    pytest.importorskip("transformers")
    s = ("tiny", "qwen2", 0, dict(num_hidden_layers=4, max_position_embeddings=1024))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 90, 300, 33)]
    params = SamplingParams(temperature=0, max_tokens=8)
    kw = dict(block_size=4, num_blocks=256, kv_cache_dtype=name, max_num_batched_tokens=128)
    want = worlds(1).check("tests.engine_cases:seeded", 1, s, kw, prompts, params)[0]
    for mesh in (dict(tp=2), dict(pp=2), dict(sp=2, sp_prefill_min_tokens=16, num_blocks=128)):
        res = worlds(2).check("tests.engine_cases:seeded", 2, s, dict(kw, **mesh), prompts, params)
        assert res[0] == res[1] == want, mesh
    plp = dict(kw, max_num_batched_tokens=32)
    lp_one = worlds(1).check("tests.engine_cases:prompt_logprobs", 1, s, plp, prompts[2])[0]
    lp_sp = worlds(2).check(
        "tests.engine_cases:prompt_logprobs",
        2,
        s,
        dict(plp, sp=2, num_blocks=128, sp_prefill_min_tokens=16),
        prompts[2],
    )
    torch.testing.assert_close(torch.tensor(lp_sp[0]), torch.tensor(lp_one), atol=1e-4, rtol=1e-4)
