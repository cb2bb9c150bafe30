"""Tensor parallelism for hybrid models: every family at tp=2 (and tp=2 x sp=2, tp=2 x pp=2) gives
transformers' greedy tokens and prompt log-probs, each TP rank holding only its recurrent heads'
state; ``check_tp`` refuses up front, naming the layer, a tp that cannot split a layer; a request
migrates with its state between engines of different tp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.engine.hybrid import slot_bytes  # noqa: E402
from ringkv.model.config import ModelConfig  # noqa: E402
from ringkv.parallel.tp import check_tp  # noqa: E402
from tests.engine_cases import model_from  # noqa: E402
from tests.test_engine_hybrid import ENGINE, GREEDY, prompts_for, reference  # noqa: E402

FAMILIES = ["lfm2", "qwen3_5", "qwen3_next", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1"]


def _cfg(family, **overrides) -> ModelConfig:
    return ModelConfig.from_hf(model_from(("hybrid", family, 0, overrides)).config.to_dict())


def _check_mesh(worlds, s, tp, pp=1, sp=1):
    """The engine on a ``tp x pp x sp`` world against transformers; what each rank saw."""
    prompts = prompts_for(1)
    want, want_lp = reference(s, prompts)
    kw = dict(ENGINE, tp=tp, pp=pp, sp=sp, state_checkpoint_blocks=2, sp_prefill_min_tokens=4)
    n = tp * pp * sp
    res = worlds(n).check(
        "tests.engine_cases:hybrid_rounds", n, s, kw, prompts, GREEDY, prompts[2], timeout=300
    )
    for r in res:
        assert r["tokens"] == [want, want]
    driver = res[0]
    tpb = 4 * sp  # the second round resumed from the snapshots at the prompts' last blocks
    assert driver["cached"][1] == [(len(p) - 1) // tpb * tpb for p in prompts]
    assert driver["info"]["state"]["restored"] > 0
    got = torch.tensor([x for x in driver["logprobs"] if x is not None])
    torch.testing.assert_close(got, want_lp, atol=2e-4, rtol=1e-4)
    return driver


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_transformers_and_each_rank_holds_its_heads_state(worlds, family):
    """tp=2: tokens and prompt log-probs as transformers'; each rank's state per slot is half the
    whole model's (every family's tiny model splits its heads, channels and groups evenly)."""
    s = ("hybrid", family, 0, {})
    driver = _check_mesh(worlds, s, tp=2)
    whole = slot_bytes(_cfg(family))
    assert [i["state_bytes_per_slot"] for i in driver["info"]["per_rank"]] == [whole // 2] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sp2_equals_transformers(worlds, family):
    _check_mesh(worlds, ("hybrid", family, 0, {}), tp=2, sp=2)


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_tp2_pp2_equals_transformers(worlds, family):
    _check_mesh(worlds, ("hybrid", family, 0, {}), tp=2, pp=2)


def test_a_shared_mamba2_group_is_replicated_and_its_norm_summed_over_ranks(worlds):
    """Bamba with one B/C group at tp=2: both ranks hold (and convolve) the group, the gated norm's
    statistics span both ranks' heads; a rank's state: half the heads, the whole group."""
    s = ("hybrid", "bamba", 0, {"mamba_n_groups": 1})
    driver = _check_mesh(worlds, s, tp=2)
    whole, cfg = slot_bytes(_cfg("bamba", mamba_n_groups=1)), _cfg("bamba", mamba_n_groups=1)
    rc, layers = cfg.recurrent, 2  # two Mamba2 layers; conv state (channels, K - 1)
    shared = layers * 2 * rc.state * (rc.conv_kernel - 1) * 4  # B and C: on both ranks
    assert [i["state_bytes_per_slot"] for i in driver["info"]["per_rank"]] == [
        (whole - shared) // 2 + shared
    ] * 2


@pytest.mark.parametrize(
    "family,overrides,recurrent,tp,named",
    [
        ("qwen3_5", {}, {}, 4, "layer 0 (gdn).*2 key heads"),
        ("bamba", {}, dict(heads=6, groups=3), 2, "layer 0 (mamba2).*3 B/C groups"),
        ("bamba", {}, dict(heads=2, groups=1, head_dim=32), 4, "layer 0 (mamba2).*2 SSD heads"),
        ("nemotron_h", {}, dict(heads=6, groups=2), 4, "layer 0 (mamba2).*6 SSD heads"),
        ("qwen3_next", {"moe_intermediate_size": 2}, {}, 4, "experts' width"),
    ],
)
def test_check_tp_refuses_a_tp_that_cannot_split_a_layer(family, overrides, recurrent, tp, named):
    cfg = _cfg(family, **overrides)
    cfg.recurrent = dataclasses.replace(cfg.recurrent, **recurrent)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_tp(cfg, tp)
    check_tp(_cfg(family), 2)  # the tiny models themselves split at tp=2


def _finish(llm, rid) -> list:
    while True:
        for out in llm.step():
            if out.request_id == rid and out.finished:
                return out.token_ids


def test_a_request_and_a_prefix_migrate_between_tp1_and_tp2():
    """A request stopped mid-decode on a tp=2 engine finishes on a tp=1 one and back (the driver
    assembles each state tensor from the ranks' heads and scatters each rank its own); a prefix
    exported at tp=2 resumes at tp=1 from its snapshot, with transformers' tokens."""
    s = ("hybrid", "bamba", 0, {})
    prompts = prompts_for(5)
    want, _ = reference(s, prompts)
    params = SamplingParams(temperature=0, max_tokens=len(want[2]))
    model = model_from(s)
    with LLM(model, **dict(ENGINE, tp=2)) as two, LLM(model, **ENGINE) as one:
        rid = two.add_request(prompts[2], params)
        while len(two.core.pipeline.get(rid)[0].output_token_ids) < 3:
            two.step()
        snap = two.export_request(rid)
        assert one.import_request(snap) == rid
        assert _finish(one, rid) == want[2]
        two.abort_request(rid)
        rid = one.add_request(prompts[4], params)
        while len(one.core.pipeline.get(rid)[0].output_token_ids) < 2:
            one.step()
        assert two.import_request(one.export_request(rid)) == rid
        assert _finish(two, rid) == want[4]
        one.abort_request(rid)
        base = prompts_for(6)[2]  # 40 tokens: snapshots every 2 blocks of 4
        two.generate([base], GREEDY, use_tqdm=False)
        prefix = two.export_prefix(base)
        assert prefix.state is not None
        assert one.import_prefix(prefix) == len(prefix.token_ids) > 0
        cold = one.generate([base + [9]], GREEDY, use_tqdm=False)[0]
        assert cold.num_cached_tokens == len(prefix.token_ids)
        with LLM(model, **dict(ENGINE, enable_prefix_caching=False)) as ref:
            assert cold.token_ids == ref.generate([base + [9]], GREEDY, use_tqdm=False)[0].token_ids
