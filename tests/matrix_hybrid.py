"""The whole feature matrix of issue #56 on every hybrid family: each family of
``tests.hybrid_cases.FAMILIES`` and ``MORE`` at sp = 2, 3 and 4 with packed documents,
``inputs="shard"``, gradient checkpointing, ``tile_mlp``, ``method="ulysses"`` and ``"auto"``
and left-padded ``generate``; ``torch.compile`` at sp = 2 and ``sp_trainer(Trainer)`` at sp = 2
and 4. The suite (``test_hf_hybrid.py``) runs each feature on a subset; this runs every cell
with the same comparisons (the suite's test bodies, called with other arguments). Not collected
by the suite (about 15 min on 2 cores); run it by name:

    python -m pytest -q -p no:cacheprovider tests/matrix_hybrid.py
"""

from __future__ import annotations

import pytest

from tests import test_hf_hybrid as t
from tests.hybrid_cases import FAMILIES, MORE

FAMILIES = FAMILIES + MORE

SP = (2, 3, 4)
LAYOUT = {2: "zigzag", 3: "contiguous", 4: "zigzag"}
# documents per row: shorter than a convolution, than a rank's piece, of one token
ROWS = {2: [[9, 2, 6]], 3: [[5, 7], [1, 11]], 4: [[3, 8, 1, 6]]}
LENGTHS = {2: [9, 3], 3: [7, 2, 5], 4: [11, 6]}
OPTS = (
    {"checkpointing": True},
    {"tile_mlp": 3, "checkpointing": True},
    {"method": "ulysses"},
    {"method": "auto"},
)


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed(world, family, sp):
    t.test_packed_documents_match_each_document_alone(world, family, sp, LAYOUT[sp], ROWS[sp])


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("family", FAMILIES)
def test_shard(world, family, sp):
    t.test_shard_inputs(world, family, sp, LAYOUT[sp])


# families whose MLPs are mixtures of experts: tile_mlp refuses them at patch time
MOE = ("qwen3_next", "granitemoehybrid", "jamba", "kimi_linear")
MOE += ("qwen3_5_moe", "lara_mini", "lfm2_moe", "bailing_hybrid")


@pytest.mark.parametrize("opts", OPTS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("family", FAMILIES)
def test_options(world, family, sp, opts):
    """Exact, or refused at patch time with the reason: the Ulysses attention where the heads
    (4) do not divide the group (sp = 3), ``tile_mlp`` on mixtures of experts."""
    if opts.get("method") == "ulysses" and sp == 3:
        refused = "valid world sizes"
    elif "tile_mlp" in opts and family in MOE:
        refused = "mixtures of experts are not tiled"
    else:
        refused = None
    if refused is None:
        t.test_checkpointing_tile_mlp_and_ulysses(world, family, sp, opts)
    else:
        with pytest.raises(AssertionError, match=refused):
            t.test_checkpointing_tile_mlp_and_ulysses(world, family, sp, opts)


@pytest.mark.parametrize("sp", SP)
@pytest.mark.parametrize("family", FAMILIES)
def test_generate(world, family, sp):
    t.test_generate_matches_unpatched(world, family, sp, LAYOUT[sp], LENGTHS[sp])


@pytest.mark.parametrize("family", FAMILIES)
def test_compile(world, family):
    t.test_compile_matches_eager_without_recompiles(world, family)


@pytest.mark.parametrize("sp", (2, 4))
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer(worlds, family, sp, tmp_path):
    t.trainer_matches(worlds(sp), family, sp, tmp_path)  # DDP over the whole world: sp of its own
