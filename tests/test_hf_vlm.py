"""ringkv.patch_model on vision-language models (issue #58 part 2): tiny random Qwen2.5-VL (3-D
multimodal RoPE), Qwen3-VL (interleaved 3-D RoPE, deepstack image features added inside the
decoder) and LLaVA-OneVision (anyres image tiles, 1-D positions), Qwen2-VL and Qwen3-VL-MoE on
fewer cases, one and several images per sample,
against the unpatched model on the same weights: the training loss, every gradient (vision tower
included: each rank's share summed over the group), eval logits (``gather_logits``) and greedy
``generate`` (tokens and scores: Qwen's decode positions come from the prefill's ``rope_deltas``)
at sp=2 and 3 in every layout; the positions the text decoder gets, sharded like the tokens; bad
batches and unsupported models refused. One gloo world of 3 ranks (sp=2 a subgroup of it).
``python -m tests.vlm_report`` prints the same comparisons as a table."""

from __future__ import annotations

import pytest
import torch

import ringkv
from ringkv import hf
from tests import vlm_cases as vc
from tests.dist import RankError

_TOL = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def world3(worlds):
    return worlds(3)


def differences(res: list, ref: dict) -> dict:
    """The largest differences of the ranks' results ``res`` from the unpatched ``ref``: loss,
    training logits, every gradient (summed over the group), eval logits, generate's scores; and
    whether every rank generated the same tokens."""
    out = dict(
        loss=max(abs(r["loss"] - ref["loss"]) for r in res),
        eval=max((r["eval_logits"] - ref["eval_logits"]).abs().max().item() for r in res),
        scores=max((r["scores"] - ref["scores"]).abs().max().item() for r in res),
        tokens=all(torch.equal(r["tokens"], ref["tokens"]) for r in res),
        grad=0.0,
    )
    assert set(res[0]["grads"]) == set(ref["grads"])
    for name, want in ref["grads"].items():
        out["grad"] = max(
            out["grad"], (sum(r["grads"][name] for r in res) - want).abs().max().item()
        )
    return out


def _check(world, arch, images, sp, layout, method="ring", keep_logits=None, rows=1, ckpt=False):
    """The patched model (``keep_logits=None``: the chunked loss; True: the loss from the logits,
    which are compared too; ``ckpt``: activation checkpointing) against the unpatched one."""
    kw = vc.inputs(arch, images, rows=rows)
    ref = vc.reference(arch, 0, kw, new_tokens=3)
    res = world.check(
        "tests.vlm_cases:patched_run", sp, arch, 0, kw, layout, 3, method, keep_logits, ckpt
    )
    for r, got in enumerate(res):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), (r, got["loss"])
        assert (got["logits"] is None) == (keep_logits is None)
        for key in ("logits", "eval_logits", "scores")[keep_logits is None :]:
            torch.testing.assert_close(got[key], ref[key], **_TOL, msg=lambda m: f"{key} {r}: {m}")
        assert torch.equal(got["tokens"], ref["tokens"]), (r, got["tokens"], ref["tokens"])
    assert set(res[0]["grads"]) == set(ref["grads"])
    for name, want in ref["grads"].items():  # each rank's share, summed as an all-reduce would
        total = sum(r["grads"][name] for r in res)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(
            total, want, atol=2e-5 * scale, rtol=1e-4, msg=lambda m: f"grad {name}: {m}"
        )
    return ref


@pytest.mark.parametrize(
    "arch,images,sp,layout",
    [
        (arch, images, sp, layout)
        for arch in vc.VLMS
        for images, sp, layout in (
            (1, 2, "zigzag"),
            (1, 3, "striped"),
            (2, 2, "contiguous"),
            (3 if arch != "llava_onevision" else 2, 3, "zigzag"),
        )
    ],
)
def test_matches_unpatched(world3, arch, images, sp, layout):
    """Loss (the chunked loss), every gradient, eval logits and generate as unpatched."""
    ref = _check(world3, arch, images, sp, layout)
    visual = [n for n in ref["grads"] if n.startswith(("model.visual.", "model.vision_tower."))]
    assert visual and all(ref["grads"][n].abs().max() > 0 for n in visual[:3])  # it learns
    if arch == "qwen3_vl":  # the deepstack features reach the loss (and their grads are checked)
        assert (
            ref["grads"]["model.visual.deepstack_merger_list.0.linear_fc2.weight"].abs().max() > 0
        )


@pytest.mark.parametrize(
    "arch,sp,layout,method,ckpt",
    [
        ("qwen2_5_vl", 2, "zigzag", "ulysses", False),  # 4 heads over 2 ranks
        ("qwen3_vl", 3, "contiguous", "ring", True),
        ("llava_onevision", 2, "striped", "ring", False),
    ],
)
def test_batches_of_two_and_the_loss_from_logits(world3, arch, sp, layout, method, ckpt):
    """Two samples per batch (each its own images), the loss from the logits (``keep_logits=True``,
    the logits compared too); Ulysses shards the merged sequence the same way; activation
    checkpointing replays the layers in backward."""
    _check(world3, arch, 2, sp, layout, method, keep_logits=True, rows=2, ckpt=ckpt)


@pytest.mark.parametrize(
    "arch,sp,layout", [("qwen2_vl", 3, "contiguous"), ("qwen3_vl_moe", 2, "zigzag")]
)
def test_more_families_match_unpatched(world3, arch, sp, layout):
    """Qwen2-VL (its own vision tower, Qwen2.5-VL's 3-D RoPE) and Qwen3-VL-MoE (experts in the
    decoder, 4 each token's): two images, as the cases above."""
    _check(world3, arch, 2, sp, layout)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_text_only_batches(world3, arch):
    """No images: the model gives its text decoder no positions, ringkv supplies the global ones
    (the decoder makes its RoPE rows from them)."""
    _check(world3, arch, 0, 3, "striped")


@pytest.mark.parametrize(
    "arch,sp,layout", [("qwen2_5_vl", 3, "zigzag"), ("qwen3_vl", 2, "striped")]
)
def test_decode_forwards_without_positions_match_unpatched(world3, arch, sp, layout):
    """A prefill with a cache, then decode forwards that pass no positions: the model takes them
    from the cache's (global) length and the prefill's ``rope_deltas``, as unpatched."""
    kw = vc.inputs(arch, 2)
    want = vc.decode_steps(vc.build(arch, 0), kw, 3)
    res = world3.check("tests.vlm_cases:patched_decode", sp, arch, 0, kw, layout, 3)
    for got in res:
        torch.testing.assert_close(got, want, **_TOL)


def test_the_3d_positions_matter():
    """Qwen's 3-D positions move the logits (against plain 1-D positions): a split that lost them,
    or cut them in another layout than the tokens, could not match."""
    for arch in ("qwen2_5_vl", "qwen3_vl"):
        kw = vc.inputs(arch, 2)
        model = vc.build(arch, 0)
        with torch.no_grad():
            with_3d = model(**kw).logits
            plain = torch.arange(kw["input_ids"].shape[1])[None]
            plain = model(**kw, position_ids=plain).logits
        assert (with_3d - plain).abs().max() > 1e-3, arch


@pytest.mark.parametrize("arch,sp", [("qwen2_5_vl", 3), ("qwen3_vl", 2)])
def test_the_text_decoder_gets_this_ranks_shard_of_the_positions(world3, arch, sp):
    """In every layout the text decoder of rank r gets ``ringkv.shard`` of the whole (padded)
    ``(3, B, S)`` positions and embeddings the unpatched model computes."""
    kw = vc.inputs(arch, 2)
    model, full = vc.build(arch, 0), {}

    def grab(mod, args, kwargs):
        full.update(position_ids=kwargs["position_ids"], inputs_embeds=kwargs["inputs_embeds"])

    model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**kw, use_cache=False)
    pos, emb = full["position_ids"], full["inputs_embeds"]  # (3, 1, S), (1, S, E)
    assert pos.dim() == 3 and pos.shape[0] == 3 and not torch.equal(pos[1], pos[2])
    s = pos.shape[-1]
    for layout in ringkv.LAYOUTS:
        res = world3.check("tests.vlm_cases:text_inputs", sp, arch, 0, kw, layout)
        g = ringkv.sp.layout.granule(layout, sp)
        s_pad = -(-s // g) * g
        padded_pos = torch.cat([pos, pos.new_zeros(3, 1, s_pad - s)], 2)
        padded_emb = torch.cat([emb, emb.new_zeros(1, s_pad - s, emb.shape[2])], 1)
        for r, got in enumerate(res):
            want = ringkv.shard(padded_pos, 2, layout, rank=r, world=sp)  # (3, 1, S_pad / N)
            real = ringkv.positions(s_pad, layout, r, sp) < s  # the end padding's rows: any value
            assert got["position_ids"].shape == want.shape, (layout, r)
            assert torch.equal(got["position_ids"][..., real], want[..., real]), (layout, r)
            torch.testing.assert_close(
                got["inputs_embeds"], ringkv.shard(padded_emb, 1, layout, rank=r, world=sp)
            )


# ---- bad input and unsupported models ---------------------------------------------------------


def test_image_tokens_that_disagree_with_the_features_raise_the_models_error(world3):
    """One image token too few: the model's own ValueError, on every rank (it is raised before
    the sequence is split, after the ranks agreed on the call), and the world goes on."""
    kw = vc.inputs("qwen2_5_vl", 1)
    ids = kw["input_ids"].clone()
    ids[0, (ids[0] == vc.IMAGE).nonzero()[0]] = 7
    kw.update(input_ids=ids, mm_token_type_ids=(ids == vc.IMAGE).int())
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as want:
        with torch.no_grad():
            vc.build("qwen2_5_vl", 0)(**kw)
    res = world3.run("tests.vlm_cases:forward_error", 3, "qwen2_5_vl", 0, kw)
    assert res == [("ValueError", str(want.value))] * 3
    # the ranks are fine afterwards
    good = vc.inputs("qwen2_5_vl", 1)
    assert (
        world3.check("tests.vlm_cases:forward_error", 3, "qwen2_5_vl", 0, good) == [("ok", "")] * 3
    )


def test_ranks_given_other_images_all_raise(world3):
    """Rank 1 alone gets other pixels: a ValueError on every rank, before any attention."""
    res = world3.run("tests.vlm_cases:other_pixels", 2, "qwen3_vl", 0)
    for got in res:
        assert not isinstance(got, RankError) and got[0] == "ValueError", got
        assert "disagrees" in got[1] and "input tokens" in got[1], got


def test_unsupported_inputs_are_refused():
    """On one rank (the checks need no peer): inputs='shard' at patch time; padding masks and
    packed positions at the forward, naming them."""
    with pytest.raises(ValueError, match="inputs='full'"):
        hf.patch_model(vc.build("qwen2_5_vl", 0), inputs="shard")
    model = hf.patch_model(vc.build("llava_onevision", 0))
    kw = vc.inputs("llava_onevision", 2)
    mask = torch.ones_like(kw["input_ids"])
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="padding in attention_mask"):
        model(**kw, attention_mask=mask)
    s = kw["input_ids"].shape[1]
    packed = torch.cat([torch.arange(5), torch.arange(s - 5)])[None]
    with pytest.raises(ValueError, match="packed documents"):
        model(**kw, position_ids=packed)
    with torch.no_grad():  # the patched model still runs, and unpatches to the unpatched numbers
        want = vc.build("llava_onevision", 0)(**kw).logits
        got = hf.gather_logits(model(**kw).logits, "zigzag", seq_len=s)
        torch.testing.assert_close(got, want, **_TOL)
        torch.testing.assert_close(hf.unpatch_model(model)(**kw).logits, want)


def test_vlms_whose_masks_are_not_split_are_refused_at_patch_time():
    """PaliGemma (its prefix attends to itself both ways) is refused, naming why."""
    import transformers

    config = transformers.PaliGemmaConfig(
        text_config=dict(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            model_type="gemma",
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        image_token_id=299,
    )
    model = transformers.PaliGemmaForConditionalGeneration(config)
    with pytest.raises(TypeError, match="PaliGemmaForConditionalGeneration") as e:
        hf.patch_model(model)
    assert "pixel_values" in str(e.value) and "both ways" in str(e.value)


# families of the image-text-to-text auto mapping whose default config cannot build a model here
# (incomplete defaults, or packages this environment lacks); every other one must build
_NO_DEFAULT_VLM = 12


def _meta_vlm(key: str, cls_name: str):
    """``key``'s model from its default config (2 text layers and 1 vision layer where the config
    takes that), on the meta device: all that patch-time checks read; None if it cannot build."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    small = dict(text_config=dict(num_hidden_layers=2))
    for kw in (dict(small, vision_config=dict(num_hidden_layers=1, depth=1)), small, {}):
        try:
            with torch.device("meta"):
                return getattr(transformers, cls_name)(CONFIG_MAPPING[key](**kw))
        except Exception:  # noqa: BLE001 - a config that cannot build this way
            continue
    return None


def test_every_image_text_model_is_accepted_or_refused_at_patch_time():
    """Each class of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``: ``patch_model`` (one rank)
    accepts it, or raises TypeError/ValueError naming a class of the model; never another error.
    A model that takes media is accepted only in a family whose split is verified
    (``hf.vlm.SPLIT``); the families tested above are."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    verdict, unbuilt = {}, []
    for key, cls_name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        model = _meta_vlm(key, cls_name)
        if model is None:
            unbuilt.append(key)
            continue
        try:
            hf.patch_model(model)
        except (TypeError, ValueError) as e:
            assert any(type(m).__name__ in str(e) for m in model.modules()), (key, str(e))
            verdict[key] = "refused"
            continue
        verdict[key] = "accepted"
        assert key in hf.vlm.SPLIT or not hf.vlm.media_inputs(model), key
        hf.unpatch_model(model)
    assert len(unbuilt) <= _NO_DEFAULT_VLM, unbuilt
    assert all(verdict[key] == "accepted" for key in vc.VLMS + vc.MORE)
    for key in ("gemma3", "idefics3", "paligemma"):  # Gemma 3 once its image mask is split
        assert verdict[key] == ("accepted" if key in hf.vlm.SPLIT else "refused"), key
