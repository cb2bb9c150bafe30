"""Sampling against references computed from the logits: log-probs are log-softmax; sample
frequencies follow softmax(logits / T) restricted to the top-k / top-p / min-p set; penalties
follow their definitions; seeds reproduce; n samples share the prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ringkv.engine import LLM, SamplingParams
from ringkv.engine.params import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS
from ringkv.engine.sampling import apply_penalties, filter_logits, sample

LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.0, -0.5, -1.0, -3.0])


def rows(params: SamplingParams, n: int, prompt=(0,), output=()):
    return [
        SimpleNamespace(
            params=params,
            generator=torch.Generator().manual_seed(i),
            penalty=None,
            prompt_token_ids=list(prompt),
            output_token_ids=list(output),
        )
        for i in range(n)
    ]


def frequencies(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    tokens, _ = sample(LOGITS.expand(n, -1).clone(), rows(params, n))
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).float() / n


def restricted(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    p = probs * keep
    return p / p.sum()


def defined_distribution(t=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The definition, written out: softmax(l / T); top-k; top-p over the top-k renormalised
    distribution (the smallest most-likely set reaching top_p); min-p against the largest."""
    p = torch.softmax(LOGITS / t, dim=0)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = p.argsort(descending=True)
    if top_k > 0:
        keep[order[top_k:]] = False
    q = restricted(p, keep)
    mass = 0.0
    for i in order.tolist():
        if keep[i] and mass >= top_p:
            keep[i] = False
        mass += q[i].item()
    keep &= p >= min_p * p.max()
    return restricted(p, keep)


@pytest.mark.parametrize(
    "kw",
    [
        dict(t=0.5),
        dict(t=1.0),
        dict(t=2.0),
        dict(t=1.0, top_k=2),
        dict(t=0.8, top_p=0.7),
        dict(t=1.0, min_p=0.25),
        dict(t=1.3, top_k=4, top_p=0.8, min_p=0.1),
    ],
)
def test_sample_frequencies_follow_the_definition(kw):
    params = SamplingParams(
        temperature=kw["t"],
        top_k=kw.get("top_k", 0),
        top_p=kw.get("top_p", 1.0),
        min_p=kw.get("min_p", 0.0),
        max_tokens=1,
    )
    got, want = frequencies(params), defined_distribution(**kw)
    assert torch.allclose(got, want, atol=0.015), (got, want)
    assert bool((got[want == 0] == 0).all())  # never outside the set


@settings(max_examples=30, deadline=None)
@given(
    v=st.integers(2, 40),
    r=st.integers(1, 6),
    seed=st.integers(0, 1000),
    k=st.integers(0, 45),
    p=st.floats(0.05, 1.0),
    m=st.floats(0.0, 1.0),
)
def test_filter_keeps_the_defined_set(v, r, seed, k, p, m):
    x = torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * 3
    got = filter_logits(x, torch.full((r,), k), torch.full((r,), p), torch.full((r,), m))
    for i in range(r):
        probs = torch.softmax(x[i], 0)
        order = probs.argsort(descending=True)
        keep = torch.ones(v, dtype=torch.bool)
        if k > 0:
            keep[order[k:]] = False
        q = probs * keep / (probs * keep).sum()
        mass = 0.0
        for j in order.tolist():
            if keep[j] and mass >= p and j != order[0]:
                keep[j] = False
            mass += q[j].item()
        keep &= probs >= m * probs.max()
        assert torch.equal(torch.isfinite(got[i]), keep), (i, got[i], keep)
        assert torch.equal(got[i][keep], x[i][keep])


@pytest.mark.parametrize(
    "v, top_p, kept", [(4, 0.5, 2), (4, 0.25, 1), (8, 0.75, 6), (8, 0.5, 4), (2, 0.5, 1)]
)
def test_top_p_at_an_exact_tie_keeps_exactly_the_mass(v, top_p, kept):
    """Equal logits: each token's probability is 1/v, a power of two, so the running mass hits
    top_p exactly (no rounding) and the smallest set reaching it has top_p * v tokens; the
    token after it (whose preceding mass equals top_p) is out. The hypothesis test's random
    logits never land on such a tie."""
    x = torch.zeros(3, v)
    got = filter_logits(
        x, torch.zeros(3, dtype=torch.long), torch.full((3,), top_p), torch.zeros(3)
    )
    assert torch.isfinite(got).sum(dim=-1).tolist() == [kept] * 3, got
    # the sampler draws only those: `kept` distinct tokens, each about equally often
    n = 4000
    tokens, _ = sample(
        x[:1].expand(n, -1).clone(), rows(SamplingParams(temperature=1.0, top_p=top_p), n)
    )
    counts = torch.bincount(torch.tensor(tokens), minlength=v)
    assert int((counts > 0).sum()) == kept, counts
    assert bool((counts[counts > 0] > n / kept * 0.8).all()), counts


def test_logprobs_are_log_softmax_of_the_raw_logits():
    params = SamplingParams(
        temperature=0.7, top_k=3, logprobs=4, repetition_penalty=1.5, max_tokens=1
    )
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(x.clone(), rows(params, 5, prompt=[1, 2]))
    ref = torch.log_softmax(x, dim=-1)
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        assert lp.token_id == tok and lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        top = ref[i].topk(4)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_penalties_follow_their_definitions():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    in_prompt = torch.tensor([[True, True, False, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(x, [p], in_prompt, counts)
    want = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.5, 3.0 / 2 - 0.5 - 0.25, -2.0]])
    assert torch.allclose(got, want)
    # and they steer greedy decoding: token 3 (the largest logit) was generated 3 times already
    greedy = SamplingParams(temperature=0, frequency_penalty=1.0)
    tokens, _ = sample(x.clone(), rows(greedy, 1, prompt=[0], output=[3, 3, 3]))
    assert tokens == [0]
    tokens, _ = sample(x.clone(), rows(SamplingParams(temperature=0), 1, output=[3, 3, 3]))
    assert tokens == [3]


@pytest.mark.parametrize("t", [1e-39, 1e-6, 0.0])
def test_tiny_temperatures_are_greedy(t):
    """Below GREEDY_TEMPERATURE a row takes the argmax: l / 1e-39 overflows to inf and the
    softmax to NaN (which used to give token 0)."""
    x = torch.tensor([[0.5, -1.0, 2.0, 3.0, 1.0]]).expand(3, -1).clone()
    tokens, _ = sample(x, rows(SamplingParams(temperature=t), 3))
    assert tokens == [3, 3, 3]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(stop=5), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop={"a": 1}), "stop"),
        (dict(stop=["x"] * (MAX_STOP + 1)), "stop"),
        (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
        (dict(temperature=10**400), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=1 << 63), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(seed=1 << 64), "seed"),
        (dict(seed="1"), "seed"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(n=2.0), "n"),
        (dict(n=[2]), "n"),
        (dict(logprobs=True), "logprobs"),
        (dict(min_p={}), "min_p"),
        (dict(presence_penalty=10**400), "presence_penalty"),
        (dict(max_tokens="5"), "max_tokens"),
    ],
)
def test_problem_checks_types_and_bounds_and_names_the_field(kw, field):
    problem = SamplingParams(**kw).problem()
    assert problem is not None and problem.split(" ", 1)[0] == field, problem
    assert len(problem) < 300  # a huge rejected value is not echoed whole


def test_bounds_are_inclusive():
    ok = SamplingParams(
        stop=["x" * MAX_STOP_CHARS] * MAX_STOP,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        seed=(1 << 63) - 1,
        top_k=-1,
        temperature=1e-39,
    )
    assert ok.problem() is None


# ---- on the engine ----

from tests.test_engine import tiny_engine_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


def test_engine_logprobs_match_the_models_log_softmax(model):
    llm = LLM(model, block_size=4, num_blocks=64)
    prompt = [3, 14, 15, 9, 2, 6]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False
    )[0]
    ids = list(prompt)
    with torch.no_grad():
        for tok, lp in zip(out.token_ids, out.logprobs):
            ref = torch.log_softmax(model.logits(model(torch.tensor(ids))[-1:])[0], dim=-1)
            assert tok == int(ref.argmax()) and lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-5)
            assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
            ids.append(tok)


def test_n_samples_are_distinct_reproducible_and_share_the_prompt(model):
    llm = LLM(model, block_size=4, num_blocks=128)
    prompt = list(range(3, 30))  # 6 full blocks before the last token
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=11)
    hits = llm.prefix_cache_hits
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(a.outputs) == 4 and [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 4  # distinct samples
    assert a.token_ids == a.outputs[0].token_ids
    assert llm.core.blocks.hits - hits == 3 * 6  # samples 1..3 reused the prompt's 6 full blocks
    b = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]  # reproducible
    single = llm.generate(
        prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=11), use_tqdm=False
    )[0]
    assert single.token_ids == a.outputs[0].token_ids  # sample 0 uses the seed itself
    assert llm.core.blocks.num_free == llm.core.blocks.num_blocks


def test_step_api_and_abort_free_blocks(model):
    llm = LLM(model, block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7], list(range(10, 40)), [1] * 9]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, p in enumerate(prompts):
        llm.add_request(p, params, request_id=f"r{i}")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1, 2], params, request_id="r0")
    with pytest.raises(ValueError, match="empty prompt"):
        llm.add_request([], params)
    got, steps = {}, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id] = out
            assert len(out.token_ids) <= 6
        steps += 1
        if steps == 2:
            assert llm.abort_request("r1") and not llm.abort_request("r1")
    assert got["r0"].token_ids == want[0] and got["r2"].token_ids == want[2]
    assert (
        got["r1"].finish_reason is None and len(got["r1"].token_ids) < 6
    )  # stopped early, never finished
    assert (
        llm.core.blocks.num_free == llm.core.blocks.num_blocks and not llm.has_unfinished_requests()
    )


def test_engine_tiny_temperatures_are_greedy_and_unbounded_stops_refused(model):
    llm = LLM(model, block_size=4, num_blocks=64)
    prompts = [[3, 14, 15, 9, 2, 6], [7, 7, 1]]
    want = [
        o.token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    ]
    assert all(
        any(want_ids) for want_ids in want
    )  # not the all-zero answer of an overflowed softmax
    for t in (1e-39, 1e-6):
        got = llm.generate(
            prompts, SamplingParams(temperature=t, max_tokens=6, seed=1), use_tqdm=False
        )
        assert [o.token_ids for o in got] == want, t
    out = llm.generate(prompts[0], SamplingParams(stop=["x"] * (MAX_STOP + 1)), use_tqdm=False)[0]
    assert out.finish_reason == "error" and out.error.startswith("stop must hold at most")
