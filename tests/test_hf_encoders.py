"""ringkv.patch_model on encoders and bidirectional attention (issue #58 part 3): tiny random
ModernBERT (a local window of +-4 tokens on layer 1, smaller than the rows), BERT, RoBERTa,
XLM-R and a Llama run bidirectionally, at sp=2 and 3 in the zigzag and contiguous layouts, against
the unpatched model on the same weights, with right-padded batches: masked-LM loss and logits,
sequence classification loss and logits (CLS and mean pooling), pooled embeddings (``pooling=``
mean, CLS and last token) and every gradient summed over the SP group. Unsupported models and
options are refused at patch time (or, for a KV cache, at the call) with a ``ValueError``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ringkv import hf
from tests.encoder_cases import batch, build, reference

_TOL = dict(atol=5e-5, rtol=1e-4)


def _assert_matches(res, want, mask):
    real = mask.bool()
    for head, ref in want.items():
        for r, got in enumerate(res):
            got = got[head]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), (head, r)
            if ref["logits"] is not None:
                g, w = got["logits"], ref["logits"]
                if g.dim() == 3:  # per token: the real tokens (the pads' outputs are not used)
                    g, w = g[real], w[real]
                torch.testing.assert_close(g, w, **_TOL, msg=lambda m: f"{head} logits {r}: {m}")
            if ref["pooled"] is not None:
                torch.testing.assert_close(
                    got["pooled"], ref["pooled"], **_TOL, msg=lambda m: f"{head} pooled {r}: {m}"
                )
        assert set(res[0][head]["grads"]) == set(ref["grads"]), head
        for name, w in ref["grads"].items():  # summed over the SP group, as an all-reduce would
            total = sum(got[head]["grads"][name] for got in res)
            scale = max(1.0, w.abs().max().item())
            torch.testing.assert_close(
                total, w, atol=2e-5 * scale, rtol=1e-4, msg=lambda m: f"{head} grad {name}: {m}"
            )


@pytest.mark.parametrize(
    "family,sp,layout,lengths,method",
    [
        ("modernbert", 2, "zigzag", [21, 13], "ring"),
        ("modernbert", 3, "contiguous", [24, 9], "ring"),
        ("bert", 2, "contiguous", [21, 8], "ring"),
        ("bert", 3, "zigzag", [24, 24], "ring"),  # no padding: plain rows
        ("roberta", 2, "zigzag", [17, 21], "ring"),
        ("roberta", 3, "contiguous", [21, 11], "ring"),
        ("xlm_roberta", 2, "contiguous", [21, 21], "ring"),
        ("xlm_roberta", 3, "zigzag", [5, 19], "ring"),
        ("llama", 2, "zigzag", [21, 12], "ring"),
        ("llama", 3, "contiguous", [20, 7], "ring"),
        ("modernbert", 2, "striped", [24, 24], "ulysses"),  # unpadded rows: any method
        ("llama", 2, "zigzag", [20, 20], "ulysses"),
        ("bert", 4, "zigzag", [24, 24], "usp"),  # Ulysses 2 x ring 2 over the whole world
    ],
)
def test_encoder_matches_unpatched(world, family, sp, layout, lengths, method):
    data = batch(family, len(lengths), max(lengths), lengths, seed=sp)
    want = reference(family, 0, data)
    res = world.check("tests.encoder_cases:encoder_step", sp, family, 0, data, layout, method)
    _assert_matches(res, want, data["mask"])


@settings(
    max_examples=6,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
@given(
    family=st.sampled_from(["modernbert", "bert", "roberta", "llama"]),
    sp=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["zigzag", "contiguous", "striped"]),
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=3),
    checkpointing=st.booleans(),
)
def test_encoder_any_shape(world, family, sp, layout, lengths, checkpointing):
    """Any right padding (a row of one token too), world of 1-3, layout, with or without
    activation checkpointing."""
    data = batch(family, len(lengths), max(lengths), lengths, seed=len(lengths))
    want = reference(family, 0, data)
    res = world.check(
        "tests.encoder_cases:encoder_step", sp, family, 0, data, layout, "ring", checkpointing
    )
    _assert_matches(res, want, data["mask"])


def test_the_window_and_the_padding_matter():
    """ModernBERT's local window changes its output at this length, and so do the pads when the
    mask is dropped (else the comparisons above could not see either lost)."""
    data = batch("modernbert", 2, 21, [21, 13], seed=0)
    model = build("modernbert", "base:mean", 0)
    with torch.no_grad():
        h = model(data["ids"], attention_mask=data["mask"]).last_hidden_state
        unmasked = model(data["ids"]).last_hidden_state
        model.config.sliding_window = 64  # the local layer sees the whole row
        wide = model(data["ids"], attention_mask=data["mask"]).last_hidden_state
    assert (wide - h).abs().max() > 1e-2
    assert (unmasked[1, :13] - h[1, :13]).abs().max() > 1e-3  # 20x the tolerance


# ---- refusals ----------------------------------------------------------------------------------


def _bert_decoder(cross: bool):
    import transformers

    from tests.encoder_cases import config

    c = config("bert")
    c.is_decoder, c.add_cross_attention = True, cross
    return transformers.BertModel(c)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: _bert_decoder(True), "cross-attention"),
        (lambda: _auto("ForPreTraining", "bert"), "BertForPreTraining"),
        (lambda: _auto("ForMultipleChoice", "modernbert"), "ModernBertForMultipleChoice"),
        (lambda: _auto("ForCausalLM", "llama"), "LlamaForCausalLM"),
        (lambda: _mixed_llama(), "mixes causal and bidirectional"),
        (lambda: _unknown_encoder(), "CamembertModel is a bidirectional model ringkv does not"),
    ],
)
def test_unsupported_models_are_refused_at_patch_time(make, match):
    with pytest.raises(ValueError, match=match):
        hf.patch_model(make())


def test_unsupported_options_are_refused():
    model = build("llama", "base:mean", 0)
    with pytest.raises(ValueError, match="inputs='full'"):
        hf.patch_model(model, inputs="shard")
    hf.patch_model(model)
    ids = torch.randint(3, 100, (1, 8))
    with pytest.raises(ValueError, match="no KV cache"):
        model(ids, use_cache=True)
    with pytest.raises(ValueError, match="pooling must be"):
        model(ids, pooling="max")
    uly = hf.patch_model(build("bert", "mlm", 0), method="ulysses")  # one rank: 2 heads split
    with pytest.raises(ValueError, match="method='ring'"):
        uly(torch.randint(3, 100, (1, 7)), attention_mask=torch.ones(1, 7, dtype=torch.long))
    mlm = hf.patch_model(build("bert", "mlm", 0))
    labels = ids.clone()
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    with pytest.raises(ValueError, match="at a pad"):
        mlm(ids, attention_mask=mask, labels=labels)


def _auto(suffix, family):
    import transformers

    from tests.encoder_cases import config

    c = config(family)
    name = {"bert": "Bert", "modernbert": "ModernBert", "llama": "Llama"}[family] + suffix
    model = getattr(transformers, name)(c)
    if family == "llama":
        for m in model.modules():
            if hasattr(m, "is_causal"):
                m.is_causal = False
    return model


def _unknown_encoder():  # RoBERTa's architecture under another name: refused, not guessed
    import transformers

    return transformers.CamembertModel(transformers.CamembertConfig(**_small()))


def _small():
    return dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
    )


def _mixed_llama():
    model = build("llama", "base:mean", 0)
    model.layers[0].self_attn.is_causal = True
    return model


# ---- every masked LM of transformers' auto mapping --------------------------------------------


def test_every_masked_lm_is_accepted_or_refused_at_patch_time():
    """Each config class of ``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, built on the meta device:
    ``patch_model`` (one rank) accepts it (the encoders above: bidirectional) or raises
    TypeError/ValueError naming a class of the model; never another error."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    from tests.test_hf_hybrid import _meta_model

    transformers.logging.set_verbosity_error()
    verdict = {}
    for key, cls_name in MODEL_FOR_MASKED_LM_MAPPING_NAMES.items():
        model = _meta_model(key, cls_name)
        if model is None:
            continue
        classes = {type(m).__name__ for m in model.modules()}
        try:
            hf.patch_model(model)
        except (TypeError, ValueError) as e:
            assert [c for c in classes if c in str(e)], (key, str(e))
            verdict[key] = "refused: " + str(e)
            continue
        state = hf.patch.patch_state(model)
        verdict[key] = "bidirectional" if state.encoder is not None else "causal"
        hf.unpatch_model(model)
    for key in ("modernbert", "bert", "roberta", "xlm-roberta"):
        assert verdict[key] == "bidirectional", (key, verdict[key])
    assert len(verdict) >= 30, sorted(verdict)
