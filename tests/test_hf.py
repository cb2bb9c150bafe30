"""ringkv.patch_model on tiny random Llama / Qwen2 / Mistral (and SmolLM2) against the unpatched
model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from ringkv import hf
from tests.hf_cases import build

ARCHS = ("llama", "qwen2", "mistral")
_TOL = dict(atol=5e-5, rtol=1e-4)


def _ids(b, s, seed, vocab=128):
    return torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _reference(arch, seed, ids, config=None):
    model = build(arch, seed, **(config or {}))
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _check_train(
    world,
    arch,
    sp,
    layout,
    inputs,
    s,
    b=1,
    seed=0,
    positions=False,
    checkpointing=False,
    method="ring",
    ulysses=None,
    config=None,
    extra=None,
):
    ids = _ids(b, s, seed + s)
    logits, loss, grads = _reference(arch, seed, ids, config)
    res = world.check(
        "tests.hf_cases:train_step",
        sp,
        arch,
        seed,
        ids,
        layout,
        inputs,
        positions,
        checkpointing,
        method,
        ulysses,
        config,
        extra,
    )
    for r, got in enumerate(res):
        torch.testing.assert_close(
            got["logits"], logits, **_TOL, msg=lambda m: f"logits rank {r}: {m}"
        )
        assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (r, got["loss"], loss)
        assert got["helper"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert set(res[0]["grads"]) == set(grads)
    for name, want in grads.items():  # gradients summed over the SP group, as an all-reduce would
        total = sum(r["grads"][name] for r in res)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(
            total, want, atol=2e-5 * scale, rtol=1e-4, msg=lambda m: f"grad {name}: {m}"
        )
    return res


@pytest.mark.parametrize(
    "arch,sp,layout,inputs,s,b",
    [
        ("llama", 4, "zigzag", "full", 21, 1),  # padded to 24 automatically
        ("qwen2", 3, "striped", "shard", 18, 2),
        ("mistral", 2, "contiguous", "full", 16, 1),
        ("llama", 1, "zigzag", "shard", 10, 1),
        ("mistral", 3, "zigzag", "shard", 24, 1),
        ("qwen2", 2, "zigzag", "full", 7, 2),  # padded to 8
    ],
)
def test_train_matches_unpatched(world, arch, sp, layout, inputs, s, b):
    _check_train(world, arch, sp, layout, inputs, s, b, positions=(inputs == "shard" and sp == 3))


def test_train_with_activation_checkpointing(world):
    _check_train(world, "llama", 3, "zigzag", "full", 17, checkpointing=True)


@settings(
    max_examples=6,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    arch=st.sampled_from(ARCHS),
    sp=st.integers(1, 4),
    layout=st.sampled_from(ringkv.LAYOUTS),
    s=st.integers(2, 33),
    seed=st.integers(0, 1000),
)
def test_train_any_length_full_inputs(world, arch, sp, layout, s, seed):
    _check_train(world, arch, sp, layout, "full", s, seed=seed)


@pytest.mark.parametrize(
    "arch,sp,layout,s,b",
    [
        ("llama", 2, "zigzag", 13, 1),
        ("qwen2", 3, "contiguous", 9, 2),
        ("mistral", 4, "striped", 16, 1),
        ("llama", 4, "zigzag", 5, 2),  # some ranks cache no prompt token at all
    ],
)
def test_generate_matches_unpatched(world, arch, sp, layout, s, b):
    _check_generate(world, arch, sp, layout, s, b)


def _check_generate(
    world, arch, sp, layout, s, b, method="ring", ulysses=None, config=None, extra=None
):
    new = 8
    ids = _ids(b, s, 7 + s)
    with torch.no_grad():
        ref = build(arch, 0, **(config or {})).generate(
            ids,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    res = world.check(
        "tests.hf_cases:generate", sp, arch, 0, ids, layout, new, method, ulysses, config, extra
    )
    ref_scores = torch.stack(ref.scores, 1)
    for r, got in enumerate(res):
        assert torch.equal(got["tokens"], ref.sequences), (r, got["tokens"], ref.sequences)
        torch.testing.assert_close(got["scores"], ref_scores, **_TOL)
        assert got["seen"] == s + new - 1
    # the cache is sharded, not replicated: every cached position lives on exactly one rank
    cached = sorted(p for got in res for p in got["positions"])
    assert cached == list(range(s + new - 1))
    assert sum(got["local_keys"] for got in res) == s + new - 1
    assert all(got["local_keys"] == len(got["positions"]) for got in res)
    return res


# ---- other SP methods and sliding windows: the same checks ----


@pytest.mark.parametrize(
    "arch,sp,layout,inputs,s,method,ulysses,config",
    [
        (
            "llama",
            4,
            "zigzag",
            "full",
            13,
            "ulysses",
            None,
            None,
        ),  # 4 heads over 4 ranks, KV heads replicated
        ("qwen2", 2, "striped", "shard", 12, "ulysses", None, None),
        ("llama", 4, "zigzag", "full", 21, "usp", 2, None),  # 2 (ulysses) x 2 (ring), padded to 24
        ("mistral", 4, "contiguous", "shard", 16, "usp", 2, dict(sliding_window=5)),
        (
            "mistral",
            3,
            "zigzag",
            "full",
            23,
            "ring",
            None,
            dict(sliding_window=4),
        ),  # window < shard
        (
            "mistral",
            2,
            "contiguous",
            "full",
            17,
            "ring",
            None,
            dict(sliding_window=11),
        ),  # window > shard
        (
            "qwen2",
            4,
            "zigzag",
            "full",
            19,
            "ulysses",
            None,
            dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
        ),  # one windowed layer
    ],
)
def test_methods_and_windows_train_like_unpatched(
    world, arch, sp, layout, inputs, s, method, ulysses, config
):
    _check_train(world, arch, sp, layout, inputs, s, method=method, ulysses=ulysses, config=config)


@pytest.mark.parametrize(
    "arch,sp,layout,s,method,ulysses,config",
    [
        ("llama", 2, "zigzag", 9, "ulysses", None, None),
        ("qwen2", 4, "striped", 10, "usp", 2, None),
        (
            "mistral",
            4,
            "zigzag",
            11,
            "ring",
            None,
            dict(sliding_window=4),
        ),  # the window also bounds decode
    ],
)
def test_methods_and_windows_generate_like_unpatched(
    world, arch, sp, layout, s, method, ulysses, config
):
    _check_generate(world, arch, sp, layout, s, 1, method, ulysses, config)


# ---- SmolLM2's heads (9 query, 3 KV): Ulysses and USP split them unevenly ----

SMOLLM2_HEADS = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72)


@pytest.mark.parametrize(
    "method,sp,ulysses,layout,heads",
    [
        ("ulysses", 2, None, "zigzag", [5, 4]),
        ("ulysses", 3, None, "striped", [3, 3, 3]),
        ("ulysses", 4, None, "zigzag", [3, 2, 2, 2]),
        ("usp", 2, 2, "contiguous", [5, 4]),
        ("usp", 3, 3, "zigzag", [3, 3, 3]),
        ("usp", 4, 2, "zigzag", [5, 4]),  # 2 (Ulysses) x 2 (ring)
    ],
)
def test_smollm2_heads_train_and_generate_like_unpatched(
    world, worlds, method, sp, ulysses, layout, heads
):
    """Loss, every gradient, logits and greedy tokens of a model with SmolLM2's heads; USP on a
    world of its own size (its mesh spans the default world)."""
    w = world if method == "ulysses" else worlds(sp)
    args = ("llama", sp, layout)
    res = _check_train(w, *args, "full", 13, method=method, ulysses=ulysses, config=SMOLLM2_HEADS)
    assert res[0]["described"]["heads_per_rank"] == heads
    assert res[0]["described"]["shard_ulysses"] == (ulysses or 1)
    _check_generate(w, *args, 11, 1, method, ulysses, SMOLLM2_HEADS)


def test_auto_picks_from_the_time_model_and_runs_exactly(world):
    """``method="auto"`` on 4 CPU ranks with SmolLM2's heads picks what the planner's time model
    gives (Ulysses where the ring's per-hop latency dominates, at 64 tokens; the ring at 4096,
    where compute does and Ulysses' busiest rank has 3 heads of 9); exact either way, and
    ``describe`` says why."""
    from ringkv.planner.sp_method import choose_sp, local_rates

    r, link, _ = local_rates(torch.device("cpu"), "float32")  # the ranks' rates: 1 thread each
    want = {n: choose_sp(9, 3, 8, 4, n, r, link, act=4) for n in (64, 4096)}
    assert (want[64].method, want[4096].method) == ("ulysses", "ring")
    kw = dict(method="auto", config=SMOLLM2_HEADS)
    short = _check_train(world, "llama", 4, "zigzag", "full", 13, **kw, extra=dict(seq_len=64))
    got = short[0]["described"]
    assert (got["attention"], got["ulysses"], got["heads_per_rank"]) == ("ulysses", 4, [3, 2, 2, 2])
    assert got["why"].startswith("method='auto' chose ulysses") and "seq_len=64" in got["why"]
    res = _check_generate(
        world, "llama", 4, "zigzag", 9, 1, "auto", None, SMOLLM2_HEADS, dict(seq_len=4096)
    )
    got = res[0]["described"]
    assert got["attention"] == "ring" and got["why"].startswith("method='auto' chose ring")


@settings(
    max_examples=4,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    arch=st.sampled_from(ARCHS),
    sp=st.integers(1, 4),
    layout=st.sampled_from(ringkv.LAYOUTS),
    s=st.integers(1, 20),
    b=st.integers(1, 2),
)
def test_generate_any_prompt_length(world, arch, sp, layout, s, b):
    ids = _ids(b, s, s)
    with torch.no_grad():
        want = build(arch, 0).generate(
            ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    for got in world.check("tests.hf_cases:generate", sp, arch, 0, ids, layout, 4):
        assert torch.equal(got["tokens"], want)


@pytest.mark.parametrize(
    "arch,sp,layout",
    [("llama", 2, "zigzag"), ("qwen2", 4, "striped"), ("mistral", 3, "contiguous")],
)
def test_shard_inputs_prefill_then_decode(world, arch, sp, layout):
    steps, s = 3, 12
    ids = _ids(1, s + steps, 3)
    with torch.no_grad():
        want = build(arch, 0)(ids).logits
    res = world.check("tests.hf_cases:shard_prefill_decode", sp, arch, 0, ids, layout, steps)
    for got in res:
        torch.testing.assert_close(got["prefill"], want[:, :s], **_TOL)
        torch.testing.assert_close(got["steps"], want[:, s:], **_TOL)
    assert sum(got["local"] for got in res) == s + steps


@settings(
    max_examples=8,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sp=st.integers(1, 4),
    s=st.integers(1, 24),
    t=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_over_a_sharded_cache(world, sp, s, t, hkv, groups, seed):
    """Keys spread over ranks arbitrarily (some ranks may hold none): the merged result equals
    single-device causal attention, identically on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, t, hkv * groups, 16, generator=g)
    k, v = torch.randn(2, s + t, hkv, 16, generator=g), torch.randn(2, s + t, hkv, 16, generator=g)
    q_pos = torch.arange(s, s + t)
    owner = torch.randint(0, sp, (s + t,), generator=g)
    want, _ = ringkv.attention(
        q, k, v, causal=True, q_positions=q_pos, k_positions=torch.arange(s + t)
    )
    res = world.check("tests.hf_cases:decode", sp, q, k, v, q_pos, owner)
    for got in res:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, res[0])


def test_ranks_that_disagree_get_an_error_not_a_hang(world):
    a, b = _ids(1, 8, 1), _ids(1, 8, 2)
    res = world.check("tests.hf_cases:disagree", 2, "llama", 0, [a, b])
    assert all("input tokens" in m for m in res), res
    res = world.check("tests.hf_cases:disagree", 2, "llama", 0, [a, _ids(1, 13, 2)])
    assert all("sequence length" in m for m in res), res


def test_a_silent_peer_gives_an_error_within_the_timeout(fork_context):
    from tests.dist import World

    w = World(
        2, context=fork_context
    )  # its own world: the silent rank leaves a collective unmatched
    try:
        res = w.check("tests.hf_cases:silent_peer", 2, "llama", 0, _ids(1, 8, 0), 3.0, timeout=90)
    finally:
        w.close()
    kind, message, seconds = res[0]
    assert kind == "RingTimeoutError" and "3s" in message, res[0]
    assert seconds < 30, seconds


# ---- single-process errors (a one-rank "group": no process group needed) ----


@pytest.fixture(scope="module")
def tiny():
    return build("llama", 0)


def test_unpatch_restores(tiny):
    ids = _ids(1, 9, 0)
    with torch.no_grad():
        want = tiny(ids).logits
        hf.patch_model(tiny)
        assert tiny.config._attn_implementation == "ringkv"
        with pytest.raises(ValueError, match="already patched"):
            hf.patch_model(tiny)
        got = tiny(ids).logits  # one rank: the whole (padded) sequence, in zigzag order
        embedded = tiny(inputs_embeds=tiny.get_input_embeddings()(ids)).logits
        hf.unpatch_model(tiny)
        assert tiny.config._attn_implementation == "sdpa"
        torch.testing.assert_close(hf.gather_logits(got, seq_len=9), want, **_TOL)
        torch.testing.assert_close(hf.gather_logits(embedded, seq_len=9), want, **_TOL)
        torch.testing.assert_close(tiny(ids).logits, want)
    with pytest.raises(ValueError, match="not patched"):
        hf.unpatch_model(tiny)


def test_errors_name_the_fix(tiny):
    import transformers

    bloom = transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)
    )
    with pytest.raises(TypeError, match="AttentionInterface"):
        hf.patch_model(bloom)
    with pytest.raises(TypeError, match="AttentionInterface"):
        hf.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sp=2 but the SP group has 1"):
        hf.patch_model(tiny, sp=2)
    with pytest.raises(ValueError, match="unknown layout"):
        hf.patch_model(tiny, layout="diagonal")
    ids = _ids(2, 8, 0)
    hf.patch_model(tiny)
    try:
        with pytest.raises(ValueError, match="padding"):
            tiny(ids, attention_mask=torch.tensor([[0] * 2 + [1] * 6, [1] * 8]))
        tiny(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))  # no padding: fine
        with pytest.raises(ValueError, match="position_ids"):
            tiny(ids, position_ids=torch.arange(8).unsqueeze(0) + 3)
        cache = transformers.DynamicCache()
        cache.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
        with pytest.raises(ValueError, match="already holds tokens"):
            tiny(ids, cache=cache)
        with pytest.raises(RuntimeError, match="outside the forward"):
            tiny.model(ids)  # a submodule bypasses the input hooks
    finally:
        hf.unpatch_model(tiny)
    hf.patch_model(tiny, inputs="shard")
    try:
        with pytest.raises(ValueError, match="pad the sequence by 1"):
            tiny(_ids(1, 7, 0))  # zigzag needs an even length even on one rank
    finally:
        hf.unpatch_model(tiny)


def test_model_level_limits():
    # 4 heads cannot split over 5 ranks: a rank would get none (before any collective)
    with pytest.raises(ValueError, match=r"heads \(4\) must be >= 5; valid world sizes .* 1..4"):
        hf.method.choose(build("llama", 0), "ulysses", None, None, 5, None, False)
    with pytest.raises(ValueError, match="ulysses=U"):
        hf.patch_model(build("llama", 0), method="usp", ulysses=2)  # one rank
    with pytest.raises(ValueError, match="seq_len"):
        hf.patch_model(build("llama", 0), method="auto", seq_len=0)
    with pytest.raises(ValueError, match="method must be"):
        hf.patch_model(build("llama", 0), method="ring2")
    dropped = hf.patch_model(build("llama", 0, attention_dropout=0.1)).train()
    with pytest.raises(ValueError, match="dropout"):
        dropped(_ids(1, 8, 0))


# ---- the real model ----


@pytest.mark.slow
def test_smollm2_sp2_zigzag(world):
    from transformers import AutoTokenizer

    from tests.models import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    text = (
        "Ring attention splits a long sequence across devices. Each device keeps its own queries, "
        "passes keys and values around a ring, and merges partial softmax results. Explain why "
        "this is exact:"
    )
    ids = tok(text, return_tensors="pt").input_ids[:, :64]
    model = build("smollm2", 0)
    with torch.no_grad():
        want = model(ids).logits
        ref = model.generate(
            ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    del model
    res = world.check("tests.hf_cases:smollm2", 2, ids, 4, timeout=300)
    for got in res:
        torch.testing.assert_close(got["logits"], want, atol=2e-4, rtol=1e-3)
        assert torch.equal(got["tokens"], ref), (
            tok.decode(got["tokens"][0, -4:]),
            tok.decode(ref[0, -4:]),
        )


# ---- the example under torchrun ----


def test_example_runs_under_torchrun(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(root, "examples", "hf_long_context.py"),
        "--seq",
        "64",
        "--new-tokens",
        "2",
    ]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "max |logits - unpatched|" in p.stdout and "rank 1" in p.stdout, p.stdout


def test_the_single_module_names_still_import_from_ringkv_hf():
    """ringkv.hf became a package (#55): every public name of the old module still imports."""
    from ringkv.hf import AGREE_NAMES, ATTN_NAME, IGNORE_INDEX, LEFT_PAD_HELP, METHODS  # noqa: F401
    from ringkv.hf import PACKING_KEYS, PADDING_HELP, ShardedKVCache  # noqa: F401
    from ringkv.hf import causal_lm_loss, gather_logits, packed_cu_seqlens  # noqa: F401
    from ringkv.hf import patch_model, ringkv_attention, unpatch_model  # noqa: F401

    assert ShardedKVCache.__module__ == "ringkv.hf.attention" and IGNORE_INDEX == -100
