"""Left-padded batched ``generate`` through ringkv.patch_model (issue #24 part 2b): tokens and
scores equal the unpatched model's on the same padded batch, on 1-4 ranks, every layout, Llama /
Qwen2 / Mistral; the sharded KV cache holds every real token exactly once and never a pad; bad
masks and position ids are a ValueError on every rank, before any collective."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from tests.hf_cases import build

ARCHS = ("llama", "qwen2", "mistral")
_TOL = dict(atol=5e-5, rtol=1e-4)
WORLD_SETTINGS = dict(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None
)


def _left_padded(lengths, seed, vocab=128):
    """``ids`` (pads 0) and ``attention_mask`` ``(B, max(lengths))``, zeros as a prefix of each
    row."""
    b, s = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(b, s, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, s - n :] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _check(world, arch, sp, layout, lengths, new=5, seed=0, config=None):
    ids, mask = _left_padded(lengths, seed)
    with torch.no_grad():
        ref = build(arch, 0, **(config or {})).generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    res = world.check("tests.hf_cases:padded_generate", sp, arch, 0, ids, mask, layout, new, config)
    ref_scores = torch.stack(ref.scores, 1)
    b, s = ids.shape
    for r, got in enumerate(res):
        assert torch.equal(got["tokens"], ref.sequences), (r, got["tokens"], ref.sequences)
        torch.testing.assert_close(
            got["scores"], ref_scores, **_TOL, msg=lambda m: f"scores rank {r}: {m}"
        )
        assert got["seen"] == s + new - 1  # what generate's own cache would report
        assert got["lengths"] == [n + new - 1 for n in lengths]
        assert len(set(got["local_keys"])) == 1 and got["local_keys"][0] == len(
            got["positions"]
        ) == len(got["rows"])
    # the cache is sharded and holds no pad: each row's cached positions, over all ranks, are
    # exactly
    # 0..n+new-2 (its real tokens and the generated ones before the last), each on one rank
    for row, n in enumerate(lengths):
        cached = sorted(p for got in res for q, p in zip(got["rows"], got["positions"]) if q == row)
        assert cached == list(range(n + new - 1)), (row, cached)
    assert sum(got["local_keys"][0] for got in res) == sum(lengths) + b * (new - 1)


@pytest.mark.parametrize(
    "arch,sp,layout,lengths",
    [
        ("llama", 2, "zigzag", [7, 3]),
        ("qwen2", 3, "contiguous", [2, 9, 5]),
        ("mistral", 4, "striped", [1, 6]),  # a row of one token; some ranks hold none of it
        ("llama", 4, "zigzag", [11, 1, 4]),
        ("qwen2", 1, "zigzag", [3, 8]),
    ],
)
def test_padded_generate_matches_unpatched(world, arch, sp, layout, lengths):
    _check(world, arch, sp, layout, lengths)


def test_padded_generate_with_a_sliding_window(world):
    _check(world, "mistral", 3, "zigzag", [10, 4], new=6, config=dict(sliding_window=4))


def test_rows_without_padding_pass_a_mask_of_ones(world):
    """A mask of ones (generate drops it) keeps the ordinary path: equal rows, unchanged."""
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = build("llama", 0).generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    for got in world.check("tests.hf_cases:generate", 3, "llama", 0, ids, "zigzag", 4):
        assert torch.equal(got["tokens"], want)


@settings(max_examples=8, **WORLD_SETTINGS)
@given(
    arch=st.sampled_from(ARCHS),
    sp=st.integers(1, 4),
    layout=st.sampled_from(ringkv.LAYOUTS),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_padded_generate_any_lengths(world, arch, sp, layout, lengths, seed):
    _check(world, arch, sp, layout, lengths, new=3, seed=seed)


# ---- errors ----


def _prefill_errors(world, sp, kwargs, method="ring", only_rank0=False):
    res = world.check(
        "tests.hf_cases:forward_error", sp, "llama", 0, "zigzag", "full", kwargs, method, only_rank0
    )
    return [kind for kind, _ in res], [m for _, m in res]


def _gen_kwargs(mask, **extra):
    ids = torch.randint(3, 128, tuple(mask.shape), generator=torch.Generator().manual_seed(0))
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)
    return dict(
        dict(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
        ),
        **extra,
    )


@pytest.mark.parametrize(
    "mask,extra,match",
    [
        ([[0, 1, 1, 0, 1, 1]], {}, "a hole"),
        ([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1]], {}, "a hole"),
        ([[1, 1, 1, 1, 0, 0]], {}, "right padding"),
        ([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], {}, "all padding"),
        (
            [[0, 0, 1, 1, 1, 1]],
            dict(position_ids=None),
            "position_ids = attention_mask.cumsum(-1) - 1",
        ),
        (
            [[0, 0, 1, 1, 1, 1]],
            dict(position_ids=torch.arange(6)[None]),
            "position_ids = attention_mask.cumsum",
        ),
        (
            [[0, 0, 1, 1, 1, 1]],
            dict(labels=torch.ones(1, 6, dtype=torch.long)),
            "labels with a left-padded batch",
        ),
    ],
)
def test_bad_padded_prefill_is_a_value_error_on_every_rank(world, mask, extra, match):
    kw = _gen_kwargs(torch.tensor(mask))
    kw.update(extra)
    if kw["position_ids"] is None:
        del kw["position_ids"]
    kinds, messages = _prefill_errors(world, 3, kw)
    assert kinds == ["ValueError"] * 3, (kinds, messages)
    assert all(match in m for m in messages), messages


def test_padded_generate_needs_the_ring(world):
    kinds, messages = _prefill_errors(
        world, 2, _gen_kwargs(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])), method="ulysses"
    )
    assert kinds == ["ValueError"] * 2 and all("method='ring'" in m for m in messages), messages


def test_bad_padded_prefill_raises_before_any_collective(world):
    res = world.check(
        "tests.hf_cases:forward_error",
        2,
        "llama",
        0,
        "zigzag",
        "full",
        _gen_kwargs(torch.tensor([[0, 1, 0, 1, 1, 1]])),
        "ring",
        True,
    )
    assert res[0][0] == "ValueError" and "a hole" in res[0][1] and res[1][0] == "skipped", res


@pytest.mark.parametrize(
    "bad,match",
    [
        ("pattern", "pad pattern cannot change"),
        ("new_pad", "pad pattern cannot change"),
        ("short", "pad pattern cannot change"),
        ("no_mask", "needs its attention_mask"),
        ("positions", "each row's next positions"),
    ],
)
def test_bad_padded_decode_step_is_a_value_error_on_every_rank(world, bad, match):
    ids, mask = _left_padded([5, 2, 7], 1)
    for only_rank0 in (False, True):
        res = world.check(
            "tests.hf_cases:padded_decode_error", 3, "llama", ids, mask, bad, only_rank0
        )
        called = res[:1] if only_rank0 else res
        assert [k for k, _ in called] == ["ValueError"] * len(called), res
        assert all(match in m for _, m in called), res
        if only_rank0:
            assert [k for k, _ in res[1:]] == ["skipped"] * 2, res


def test_a_good_padded_decode_step_passes(world):
    ids, mask = _left_padded([5, 2, 7], 1)
    assert (
        world.check("tests.hf_cases:padded_decode_error", 3, "llama", ids, mask, "none")
        == [("ok", "")] * 3
    )
