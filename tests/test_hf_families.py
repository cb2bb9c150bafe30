"""ringkv.patch_model on the families whose attention goes past plain softmax (issue #42 item 3):
gpt-oss (attention sinks, sliding and full layers alternating, MoE), Gemma 2 (attention soft-capping
at 2.0, a final logit cap, a sliding window) and DeepSeek-V3 (MLA: queries and keys of 24 dims,
values of 16, a KV cache of compressed latents, MoE). Tiny random models (``tests/family_cases.py``)
against the
unpatched model on the same weights: training loss, logits and every gradient (sinks included),
summed over the SP group (ring, Ulysses, USP); packed documents against each document alone; greedy
generate of left-padded and unpadded batches (tokens and scores); torch.compile against eager; and
StableLM, whose attention does not go through AttentionInterface, refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ringkv
from ringkv import hf
from tests.family_cases import FAMILIES, MORE, build
from tests.test_hf_generate_padded import _left_padded
from tests.test_hf_packed import _assert_matches, _batch, _grads, _per_document_reference

_TOL = dict(atol=5e-5, rtol=1e-4)


def _ids(b, s, seed):
    return torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _reference(family, seed, ids):
    """The unpatched model: logits, loss and gradients of one training step."""
    model = build(family, seed).train()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.item(), _grads(model)


def test_the_features_change_the_output():
    """The tiny models' features matter: without sinks, the attention soft-cap or the sliding
    window the unpatched model's last hidden states move (else the comparisons below could not see
    them dropped)."""
    ids = _ids(1, 16, 0)

    def hidden(family, edit=None, **overrides):
        model = build(family, 0, **overrides)
        with torch.no_grad():
            if edit:
                edit(model)
            return model.model(ids, use_cache=False).last_hidden_state

    def no_sinks(model):
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)

    def moved(family, edit=None, **overrides):
        return (hidden(family, edit, **overrides) - hidden(family)).abs().max().item()

    assert moved("gpt_oss", no_sinks) > 0.1
    assert moved("gpt_oss", layer_types=["full_attention"] * 2) > 0.1
    assert moved("gemma2", attn_logit_softcapping=None) > 0.1
    assert moved("gemma2", sliding_window=64) > 0.1
    mla = build("deepseek_v3", 0).model.layers[0].self_attn
    assert mla.qk_head_dim == 24 and mla.v_head_dim == 16


# ---- training ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,sp,method,ulysses,layout,b,s",
    [
        ("gpt_oss", 2, "ring", None, "zigzag", 2, 13),  # padded to 16; window 4 on layer 0
        ("gpt_oss", 4, "usp", 2, "zigzag", 1, 16),  # 2 heads (and their sinks) per Ulysses rank
        ("gemma2", 2, "ring", None, "contiguous", 1, 14),
        ("gemma2", 2, "ulysses", None, "striped", 2, 12),
        (
            "deepseek_v3",
            2,
            "ring",
            None,
            "striped",
            1,
            11,
        ),  # padded to 12; ring messages of K 24 + V 16
        ("deepseek_v3", 2, "ulysses", None, "zigzag", 1, 16),
    ],
)
def test_train_matches_unpatched(world, family, sp, method, ulysses, layout, b, s):
    ids = _ids(b, s, s)
    want = _reference(family, 0, ids)
    res = world.check("tests.family_cases:train_step", sp, family, 0, ids, layout, method, ulysses)
    _assert_matches(res, *want)
    if (
        family == "gpt_oss"
    ):  # the sinks learn: each rank's share adds up to the unpatched gradient (checked)
        assert all(
            want[2][f"model.layers.{i}.self_attn.sinks"].abs().max() > 1e-4 for i in range(2)
        )


@settings(
    max_examples=8,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
@given(
    family=st.sampled_from(FAMILIES),
    sp=st.sampled_from([1, 2, 3, 4]),
    ulysses=st.booleans(),
    layout=st.sampled_from(ringkv.LAYOUTS),
    s=st.integers(2, 24),
    b=st.integers(1, 2),
    seed=st.integers(0, 1000),
)
def test_train_any_shape(world, family, sp, ulysses, layout, s, b, seed):
    """Any length (padded to the layout's granule), batch, world of 1-4 and layout; Ulysses where
    the 4 heads split (sp 1, 2, 4)."""
    method = "ulysses" if ulysses and sp != 3 else "ring"
    ids = _ids(b, s, seed)
    want = _reference(family, seed, ids)
    res = world.check("tests.family_cases:train_step", sp, family, seed, ids, layout, method, None)
    _assert_matches(res, *want)


@pytest.mark.parametrize(
    "family,sp,method,ulysses,layout",
    [
        ("gemma3_text", 2, "ring", None, "zigzag"),
        ("gemma3_text", 2, "ulysses", None, "striped"),
        ("qwen3_moe", 3, "ring", None, "contiguous"),
        ("mla_wide", 3, "ring", None, "striped"),
        ("mla_wide", 4, "ulysses", None, "zigzag"),
        ("gemma2", 4, "usp", 2, "zigzag"),
        ("deepseek_v3", 4, "usp", 2, "striped"),
    ],
)
def test_more_families_and_methods_train_like_unpatched(world, family, sp, method, ulysses, layout):
    """Gemma 3 (q/k norms, sliding and full layers), Qwen3-MoE, MLA of other widths with a q LoRA,
    and USP for Gemma 2's cap and DeepSeek-V3's MLA: loss, logits and every gradient as
    unpatched."""
    assert family in FAMILIES + MORE
    ids = _ids(2, 20, 3)
    _assert_matches(
        world.check("tests.family_cases:train_step", sp, family, 0, ids, layout, method, ulysses),
        *_reference(family, 0, ids),
    )


# ---- packed documents ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,layout,form,rows",
    [
        ("gpt_oss", "zigzag", "position_ids", [[9, 2, 6]]),  # documents longer than the window
        ("gemma2", "striped", "flash", [[6, 1], [2, 5]]),  # cu_seq_lens_q/k, max_length_q/k; B = 2
        ("deepseek_v3", "contiguous", "all", [[3, 8, 1]]),
    ],
)
def test_packed_documents_match_each_document_alone(world, family, layout, form, rows):
    batch = _batch(rows, 3)
    want = _per_document_reference(family, 0, batch, model=build(family, 0).train())
    res = world.check("tests.family_cases:packed_train_step", 2, family, 0, batch, layout, form)
    _assert_matches(res, *want)


# ---- left-padded batched generate
# --------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,layout,lengths",
    [
        ("gpt_oss", "zigzag", [9, 3]),
        ("gpt_oss", "striped", [10, 10]),  # no padding: the ordinary decode path
        ("gemma2", "contiguous", [4, 10]),
        ("gemma2", "zigzag", [9]),
        ("deepseek_v3", "striped", [7, 2, 5]),
        ("deepseek_v3", "contiguous", [6, 6]),
    ],
)
def test_generate_matches_unpatched(world, family, layout, lengths):
    """Greedy generate of a (left-padded) batch: tokens and scores equal the unpatched model's; the
    sharded cache holds each row's real tokens exactly once (DeepSeek-V3's holds what its layers
    cache: the compressed latent, one head of 32 (keys) and the rotary key, 8 (values))."""
    new = 4
    ids, mask = _left_padded(lengths, 5)
    with torch.no_grad():
        ref = build(family, 0).generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    res = world.check("tests.family_cases:padded_generate", 2, family, 0, ids, mask, layout, new)
    for r, got in enumerate(res):
        assert torch.equal(got["tokens"], ref.sequences), (r, got["tokens"], ref.sequences)
        torch.testing.assert_close(
            got["scores"], torch.stack(ref.scores, 1), **_TOL, msg=lambda m: f"scores rank {r}: {m}"
        )
        if family == "deepseek_v3":
            assert set(got["widths"]) == {(1, 32, 8)}, got[
                "widths"
            ]  # (heads, key width, value width)
    for row, n in enumerate(lengths):
        cached = sorted(p for got in res for q, p in zip(got["rows"], got["positions"]) if q == row)
        assert cached == list(range(n + new - 1)), (row, cached)


# ---- torch.compile
# -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_matches_eager_without_recompiles(world, family):
    """torch.compile (aot_eager: dynamo and AOT autograd, no code generation) of the patched model:
    forward + backward equal eager (sinks' gradients through the eager attention's graph break
    included), new data of the same shape never recompiles, and the only graph breaks are ringkv's
    (``torch.compiler.disable``); eager equals the unpatched model."""
    batches = [_ids(1, 16, 20 + i) for i in range(2)]
    res = world.check(
        "tests.family_cases:compile_train", 2, family, 0, batches, "zigzag", timeout=600
    )
    for got in res:
        assert got["frames"][0] > 0 and got["frames"] == [got["frames"][0]] * len(batches), got[
            "frames"
        ]
        assert got["breaks"] and all("torch.compiler.disable" in b for b in got["breaks"]), got[
            "breaks"
        ]
        for i, step in enumerate(got["steps"]):
            e, c = step["eager"], step["compiled"]
            assert c["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6), (
                i,
                c["loss"],
                e["loss"],
            )
            assert set(c["grads"]) == set(e["grads"])
            for name, want in e["grads"].items():
                scale = max(1.0, want.abs().max().item())
                torch.testing.assert_close(
                    c["grads"][name],
                    want,
                    atol=2e-5 * scale,
                    rtol=1e-4,
                    msg=lambda m: f"step {i} grad {name}: {m}",
                )
    _, loss, grads = _reference(family, 0, batches[-1])
    assert res[0]["steps"][-1]["eager"]["loss"] == pytest.approx(loss, rel=1e-5)
    for name, want in grads.items():
        total = sum(r["steps"][-1]["eager"]["grads"][name] for r in res)
        torch.testing.assert_close(
            total,
            want,
            atol=2e-5 * max(1.0, want.abs().max().item()),
            rtol=1e-4,
            msg=lambda m: f"grad {name}: {m}",
        )


def test_stablelm_is_refused_at_patch_time():
    """StableLM's attention does not go through AttentionInterface: a TypeError that says so,
    nothing patched."""
    import transformers

    config = transformers.StableLmConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.StableLmForCausalLM(config)
    with pytest.raises(TypeError, match="AttentionInterface.*StableLmForCausalLM does not"):
        hf.patch_model(model)
    assert getattr(model, "_ringkv_state", None) is None
