"""Gemma 3 multimodal under ``patch_model``: each image attends to all of itself (transformers'
mask from ``token_type_ids``), split across ranks. Exact training loss, every gradient (vision
tower included, summed over the group), eval logits and greedy ``generate`` against the
unpatched model, with one and several images per sample, at sp=2 and 3; the options ringkv cannot
honour are refused at patch time."""

from __future__ import annotations

import pytest
import torch

from ringkv import hf
from tests import gemma3_cases as cases
from tests.checks import assert_close

NEW_TOKENS = 3

# (sp, layout, text runs around the images of each row, method, activation checkpointing)
CASES = [
    (2, "zigzag", [[4, 6]], "ring", False),  # one image
    (3, "contiguous", [[3, 5, 2]], "ring", True),  # two images, each across a rank boundary
    (3, "striped", [[2, 4, 3], [11, 9]], "ulysses", False),  # rows with their own images
    (4, "zigzag", [[3, 5, 2]], "usp", False),  # 2 (Ulysses) x 2 (ring)
]


@pytest.mark.parametrize("sp, layout, rows, method, checkpointing", CASES)
def test_gemma3_images_match_unpatched(world, sp, layout, rows, method, checkpointing):
    kw = cases.inputs(rows)
    assert cases.build(0)(**kw).logits.shape[1] == kw["input_ids"].shape[1]  # the model runs it
    want = cases.reference(0, kw, NEW_TOKENS)
    args = (0, kw, layout, NEW_TOKENS, method, checkpointing)
    for rank, got in enumerate(world.check("tests.gemma3_cases:patched_run", sp, *args)):
        what = f"rank {rank} of sp={sp} {layout} {method}"
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * (1 + abs(want["loss"])), what
        assert_close(f"eval logits, {what}", got["eval_logits"], want["eval_logits"], 1e-5)
        assert torch.equal(got["tokens"], want["tokens"]), what
        assert got["grads"].keys() == want["grads"].keys(), what
        tower = [g for name, g in want["grads"].items() if name.startswith("model.vision_tower")]
        assert tower and max(g.abs().max().item() for g in tower) > 1e-4  # the pixels matter
        for name, g in want["grads"].items():
            assert_close(f"grad {name}, {what}", got["grads"][name], g, 1e-5)


def test_gemma3_options_ringkv_cannot_honour_are_refused():
    """At patch time use_bidirectional_attention; at the forward, image tokens in a decode step.
    (Other VLMs with such masks, PaliGemma: test_hf_vlm.py.)"""
    model = cases.build(0, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        hf.patch_model(model)
    model = hf.patch_model(cases.build(0))  # one rank: image tokens in a decode step are refused
    kw = cases.inputs([[2, 1]])
    with torch.no_grad():
        cache = model(**kw, use_cache=True).cache
        step = dict(input_ids=torch.tensor([[cases.IMAGE]]), token_type_ids=torch.ones(1, 1).long())
        with pytest.raises(ValueError, match="token_type_ids mark image tokens in a decode step"):
            model(**step, cache=cache)
