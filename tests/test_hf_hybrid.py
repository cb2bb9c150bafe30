"""ringkv.patch_model on hybrid models (issue #56, part 2): tiny random models of every family whose
recurrent layers ringkv splits (``tests/hybrid_cases.py``: Qwen3-Next and Qwen3.5 with gated
DeltaNet, Falcon-H1, Bamba, Nemotron-H, Granite 4 hybrid and Zamba2 with Mamba2, Jamba with Mamba,
LFM2 with short convolutions, Kimi Linear with KDA beside MLA) against the unpatched model on the
same weights: the training loss through the chunked loss, every parameter's gradient (summed over
the SP group) and the eval logits, at sp=2 and 3; then, on a representative subset, packed
documents (each document alone as the oracle: the unpatched CPU path does not reset the state at a
document boundary, ringkv does), ``inputs="shard"``, gradient checkpointing, ``tile_mlp``,
``torch.compile``, ``sp_trainer(Trainer)`` and ``generate`` (refused at the call). Last, every
causal-LM config class of transformers' auto mapping: accepted, or refused at patch time with a
message naming a class."""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_cases import FAMILIES, build
from tests.test_hf_packed import _assert_matches, _grads

_TOL = dict(atol=5e-5, rtol=1e-4)


def _ids(b, s, seed):
    return torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _reference(family, seed, ids):
    """The unpatched model: eval logits, training loss and gradients."""
    model = build(family, seed).train()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    model.eval()
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    return logits, out.loss.item(), _grads(model)


# ---- every family, sp = 2 and 3 -----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sp,layout,s", [(2, "zigzag", 13), (3, "contiguous", 14)])
def test_family_matches_unpatched(world, family, sp, layout, s):
    """Loss, every gradient and the eval logits as unpatched: zigzag over 2 ranks (13 tokens padded
    to 16: a rank holds two pieces, the pad rows at the end), contiguous over 3 (14 tokens padded to
    15); chunked scans of 4 tokens, convolutions of 3 or 4 taps."""
    ids = _ids(2, s, sp)
    want = _reference(family, 0, ids)
    res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, layout)
    _assert_matches(res, *want)
