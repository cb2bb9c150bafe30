"""ringkv.patch_model on hybrid models (issue #56, part 2): tiny random models of every family whose
recurrent layers ringkv splits (``tests/hybrid_cases.py``: Qwen3-Next and Qwen3.5 with gated
DeltaNet, Falcon-H1, Bamba, Nemotron-H, Granite 4 hybrid and Zamba2 with Mamba2, Jamba with Mamba,
LFM2 with short convolutions, Kimi Linear with KDA beside MLA; ``MORE``: Qwen3.5-MoE, Lara-Mini,
OLMo-hybrid, LFM2-MoE, LFM3, Bailing-hybrid, the same mixers in other modules) against the unpatched
model on the same weights: the training loss through the chunked loss, every parameter's gradient
(summed over the SP group) and the eval logits, at sp=2 and 3; then, on a representative subset,
packed documents (each document alone as the oracle: the unpatched CPU path does not reset the state
at a document boundary, ringkv does), ``inputs="shard"``, gradient checkpointing, ``tile_mlp``,
``torch.compile``, ``sp_trainer(Trainer)`` and ``generate`` (left-padded, the recurrent cache kept
exactly; ``tests/matrix_hybrid.py`` runs every feature on every family). Last, every causal-LM
config class of transformers' auto mapping: accepted, or refused at patch time with a message naming
a class."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ringkv import hf
from tests.hybrid_cases import FAMILIES, MORE, build
from tests.test_hf_generate_padded import _left_padded
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
@pytest.mark.parametrize(
    "sp,layout,s", [(2, "zigzag", 13), (3, "contiguous", 14), (4, "zigzag", 21)]
)
def test_family_matches_unpatched(world, family, sp, layout, s):
    """Loss, every gradient and the eval logits as unpatched: zigzag over 2 ranks (13 tokens padded
    to 16: a rank holds two pieces, the pad rows at the end), contiguous over 3 (14 tokens padded to
    15), zigzag over 4 (21 padded to 24: pieces of 3, shorter than a convolution's 4 taps); chunked
    scans of 4 tokens, convolutions of 3 or 4 taps."""
    ids = _ids(2, s, sp)
    want = _reference(family, 0, ids)
    res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, layout)
    _assert_matches(res, *want)


@pytest.mark.parametrize("family", MORE)
@pytest.mark.parametrize("sp,layout,s", [(2, "zigzag", 13), (3, "contiguous", 14)])
def test_more_families_match_unpatched(world, family, sp, layout, s):
    """Families whose modeling modules hold the same mixers as one above (Qwen3.5-MoE, Lara-Mini
    and OLMo-hybrid's gated DeltaNet, LFM2-MoE and LFM3's short convolution, Bailing-hybrid's
    KDA): the same comparisons."""
    test_family_matches_unpatched(world, family, sp, layout, s)


@settings(
    max_examples=12,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
@given(
    family=st.sampled_from(FAMILIES),
    sp=st.sampled_from([1, 2, 3, 4]),
    layout=st.sampled_from(["contiguous", "zigzag"]),
    s=st.integers(2, 20),
    b=st.integers(1, 2),
    seed=st.integers(0, 1000),
)
def test_any_shape_matches_unpatched(world, family, sp, layout, s, b, seed):
    """Any length (lengths that leave a rank only pad rows, or pieces of one token), batch, world
    of 1-4 and layout."""
    ids = _ids(b, s, seed)
    want = _reference(family, seed % 3, ids)
    res = world.check("tests.hybrid_cases:train_step", sp, family, seed % 3, ids, layout)
    _assert_matches(res, *want)


@pytest.mark.parametrize(
    "family,sp,layout,s",
    [
        ("bamba", 4, "contiguous", 3),
        ("jamba", 3, "zigzag", 2),
        ("qwen3_next", 4, "zigzag", 2),
        ("kimi_linear", 3, "contiguous", 2),
        ("zamba2", 4, "zigzag", 3),
    ],
)
def test_a_rank_of_pad_rows_alone(world, family, sp, layout, s):
    """A sequence shorter than the group's pieces: the last rank holds only pad rows. Its backward
    still reaches the convolution before each scan (whose halo exchange waits for every rank): the
    SP forms' outputs on pad rows depend on no input, so the wrappers tie them to their inputs
    (without it the backward hung in the halo's all-reduce)."""
    ids = _ids(1, s, 1)
    res = world.check("tests.hybrid_cases:train_step", sp, family, 1, ids, layout, timeout=100)
    _assert_matches(res, *_reference(family, 1, ids))


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
    [
        ("qwen3_next", 2, "contiguous"),
        ("bamba", 2, "zigzag"),
        ("lfm2", 3, "contiguous"),
        ("jamba", 2, "zigzag"),
        ("kimi_linear", 3, "zigzag"),
    ],
)
def test_shard_inputs(world, family, sp, layout):
    """``inputs="shard"``: each rank passes its own shard of ids and labels."""
    ids = _ids(2, 6 * sp, 7)  # zigzag needs a multiple of 2 * sp
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
        ("kimi_linear", 3, {"checkpointing": True}),
        ("lfm2", 2, {"tile_mlp": 4, "checkpointing": True}),
        ("bamba", 3, {"tile_mlp": 3, "checkpointing": True}),
        ("qwen3_5", 2, {"tile_mlp": 5}),
        ("nemotron_h", 2, {"tile_mlp": 3}),  # its MLP layers: the layer's mixer is the MLP
        ("kimi_linear", 2, {"method": "ulysses"}),
        ("bamba", 2, {"method": "ulysses"}),
        ("jamba", 2, {"method": "ulysses", "checkpointing": True}),
        ("qwen3_next", 2, {"method": "auto"}),
        ("bamba", 3, {"method": "auto"}),
    ],
)
def test_checkpointing_tile_mlp_and_ulysses(world, family, sp, opts):
    """Gradient checkpointing (the recurrent layers replayed in backward with the step's pieces),
    ``tile_mlp`` (the MoE families' MLPs are not tiled), the Ulysses attention beside the
    recurrent layers' head-parallel form (``method="ulysses"``) and ``method="auto"`` (the ring
    beside the form ``choose_form`` picks; ``test_recurrent_form_follows_the_method``)."""
    ids = _ids(2, 15, 11)
    want = _reference(family, 0, ids)
    res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, "zigzag", opts)
    _assert_matches(res, *want)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "lfm2", "jamba", "kimi_linear"])
def test_compile_matches_eager_without_recompiles(world, family):
    """torch.compile (aot_eager) of a patched hybrid model: forward + backward equal eager, new data
    of the same shape never recompiles, the only graph breaks are ringkv's
    (``torch.compiler.disable``: the hooks, the attention and the recurrent layers' SP forms)."""
    batches = [_ids(1, 16, 30 + i) for i in range(2)]
    res = world.check(
        "tests.hybrid_cases:compile_train", 2, family, 0, batches, "zigzag", timeout=600
    )
    _, loss, grads = _reference(family, 0, batches[-1])
    for got in res:
        assert got["frames"][0] > 0 and got["frames"] == [got["frames"][0]] * 2, got["frames"]
        assert got["breaks"] and all("torch.compiler.disable" in b for b in got["breaks"]), got[
            "breaks"
        ]
        for i, step in enumerate(got["steps"]):
            e, c = step["eager"], step["compiled"]
            assert c["loss"] == pytest.approx(e["loss"], rel=1e-5, abs=1e-6), (i, c, e)
            assert set(c["grads"]) == set(e["grads"])
            for name, want in e["grads"].items():
                torch.testing.assert_close(
                    c["grads"][name], want, atol=2e-5 * max(1.0, want.abs().max().item()), rtol=1e-4
                )
    assert res[0]["steps"][-1]["eager"]["loss"] == pytest.approx(loss, rel=1e-5)
    for name, want in grads.items():
        total = sum(r["steps"][-1]["compiled"]["grads"][name] for r in res)
        torch.testing.assert_close(
            total, want, atol=2e-5 * max(1.0, want.abs().max().item()), rtol=1e-4
        )


@pytest.mark.parametrize(
    "family,sp,layout,lengths",
    [
        ("qwen3_next", 2, "zigzag", [9, 3]),
        ("bamba", 3, "contiguous", [8, 8]),  # no padding: the ordinary decode path
        ("lfm2", 2, "contiguous", [4, 10]),
        ("jamba", 2, "zigzag", [11, 6]),
        ("kimi_linear", 3, "zigzag", [7, 2, 5]),
        ("zamba2", 2, "zigzag", [6, 9]),
    ],
)
def test_generate_matches_unpatched(world, family, sp, layout, lengths):
    """Greedy generate of a (left-padded) batch: tokens and scores equal the unpatched model's. The
    prefill's SP forms leave each row's conv tail and recurrent state in transformers' cache, the
    same on every rank, and every decode step runs the layers' own recurrent step on it."""
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
    res = world.check(
        "tests.hybrid_cases:padded_generate", sp, family, 0, ids, mask, layout, new, timeout=300
    )
    for r, got in enumerate(res):
        assert torch.equal(got["tokens"], ref.sequences), (r, got["tokens"], ref.sequences)
        torch.testing.assert_close(
            got["scores"], torch.stack(ref.scores, 1), **_TOL, msg=lambda m: f"scores rank {r}: {m}"
        )
        assert got["states"] and all(got["states"])
        for mine, first in zip(got["states"], res[0]["states"]):
            for a, b in zip(mine, first):
                assert torch.equal(a, b)


# ---- patch time ----------------------------------------------------------------------------------


def test_hybrid_options_are_refused_at_patch_time():
    """layout="striped" and method="usp" on a hybrid model: ValueErrors naming the model and why;
    nothing is patched (a later patch works)."""
    model = build("bamba", 0)
    with pytest.raises(ValueError, match="BambaForCausalLM.*striped"):
        hf.patch_model(model, layout="striped")
    with pytest.raises(ValueError, match="usp.*BambaForCausalLM"):
        hf.patch_model(model, method="usp", ulysses=1)
    assert getattr(model, "_ringkv_state", None) is None
    hf.unpatch_model(hf.patch_model(model))


def test_ranks_with_other_layer_shapes_are_refused_alike(world):
    """A rank whose hybrid model has another state size (Bamba's d_state 16 instead of 8): the
    same ValueError on every rank at patch time, before any forward's collective."""
    res = world.check("tests.hybrid_cases:mismatched_patch", 3, "bamba", 0, dict(mamba_d_state=16))
    for got in res:
        assert got is not None and got[0] == "ValueError", got
        assert "BambaForCausalLM" in got[1] and "parameter shapes" in got[1], got


@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
def test_a_rank_dying_in_a_recurrent_layer_gives_an_error_within_the_timeout(fork_context, family):
    """The other rank dies as it enters its first recurrent layer: rank 0, inside that layer's
    convolution halo and state passing, gets ringkv's timeout error naming the timeout, not a
    hang."""
    from tests.dist import World

    w = World(2, context=fork_context)  # its own world: the dead rank leaves a collective open
    try:
        res = w.run(
            "tests.hybrid_cases:dead_in_mixer", 2, family, 0, _ids(1, 12, 0), 3.0, timeout=90
        )
    finally:
        w.close()
    kind, message, seconds = res[0]
    assert kind == "RingTimeoutError" and "3s" in message, res[0]
    assert seconds < 30, seconds
    assert "this rank died" in str(res[1]), res[1]


def test_unpatch_restores_the_modeling_functions():
    """The wrappers are counted per modeling module: they stay while one patched model of the
    family is left, and the module's own functions are back after the last ``unpatch_model``; an
    unpatched model of the family runs the originals meanwhile, and equals itself."""
    import transformers.models.bamba.modeling_bamba as mb

    own = {n: getattr(mb, n) for n in ("causal_conv1d_forward", "mamba2_scan_forward")}
    ids = _ids(1, 10, 2)
    plain = build("bamba", 0)
    with torch.no_grad():
        before = plain(ids, use_cache=False).logits
    a, b = hf.patch_model(build("bamba", 0)), hf.patch_model(build("bamba", 0))
    assert all(getattr(mb, n) is not f for n, f in own.items())
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, use_cache=False).logits, before, rtol=0, atol=0)
        torch.testing.assert_close(a(ids).logits, before, **_TOL)  # one rank: the same model
    hf.unpatch_model(a)
    assert all(getattr(mb, n) is not f for n, f in own.items())
    hf.unpatch_model(b)
    assert all(getattr(mb, n) is f for n, f in own.items())
    assert not hasattr(b.model.layers[0].mamba, "_ringkv_state")
    assert not hasattr(b.model.layers[0].mamba.conv1d, "_ringkv_state")


def _tiny_recurrent_models():
    """Tiny models of families whose layers ringkv cannot split: (model, the class the refusal
    must name)."""
    import transformers

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    return [
        (transformers.MambaForCausalLM(transformers.MambaConfig(**small)), "MambaMixer"),
        (
            transformers.Mamba2ForCausalLM(
                transformers.Mamba2Config(num_heads=8, head_dim=16, n_groups=1, **small)
            ),
            "Mamba2Mixer",
        ),
        (
            transformers.RecurrentGemmaForCausalLM(
                transformers.RecurrentGemmaConfig(
                    num_attention_heads=4, lru_width=64, intermediate_size=96, **small
                )
            ),
            "RecurrentGemmaRecurrentBlock",
        ),
        (transformers.RwkvForCausalLM(transformers.RwkvConfig(**small)), "RwkvForCausalLM"),
    ]


def test_a_convolution_beside_a_known_mixer_is_refused():
    """A decoder layer holding a known mixer is not refused for its name
    (``OlmoHybridLinearAttentionDecoderLayer``), but a convolution over the sequence of its own
    still is, named."""
    model = build("olmo_hybrid", 0)
    hf.unpatch_model(hf.patch_model(model))  # accepted as it is
    model.model.layers[0].extra = torch.nn.Conv1d(4, 4, 3)
    with pytest.raises(TypeError, match="OlmoHybridLinearAttentionDecoderLayer"):
        hf.patch_model(model)


def test_unknown_recurrent_layers_are_refused_naming_the_class():
    for model, cls in _tiny_recurrent_models():
        with pytest.raises(TypeError, match=cls):
            hf.patch_model(model)
        assert getattr(model, "_ringkv_state", None) is None


# ---- every causal LM of transformers' auto mapping -----------------------------------------------

# families of the auto mapping whose default config cannot build a model (transformers' own
# defaults are incomplete for them); every other one must build
_NO_DEFAULT_MODEL = 25


def _meta_model(key: str, cls_name: str):
    """``key``'s causal LM from its default config (2 layers where the config takes that), built on
    the meta device: the modules without weights, all that patch-time classification reads."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = getattr(transformers, cls_name)
    for kw in (dict(num_hidden_layers=2), {}):
        try:
            with torch.device("meta"):
                return cls(CONFIG_MAPPING[key](**kw))
        except Exception:  # noqa: BLE001 - a config that cannot build this way
            continue
    return None


def test_every_causal_lm_is_accepted_or_refused_at_patch_time():
    """Each config class of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``patch_model`` (one rank)
    accepts it, or raises TypeError/ValueError naming a class of the model; never another error.
    The hybrid families are accepted with their recurrent layers (``state.hybrid``), and models
    with recurrent layers ringkv does not split are refused naming that layer's class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    verdict, unbuilt = {}, []
    for key, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        model = _meta_model(key, cls_name)
        if model is None:
            unbuilt.append(key)
            continue
        classes = {type(m).__name__ for m in model.modules()}
        try:
            hf.patch_model(model)
        except (TypeError, ValueError) as e:
            named = [c for c in classes if c in str(e)]
            assert named, (key, str(e))
            verdict[key] = "refused: " + str(e)
            continue
        verdict[key] = "hybrid" if hf.patch.patch_state(model).hybrid else "accepted"
        hf.unpatch_model(model)
    assert len(unbuilt) <= _NO_DEFAULT_MODEL, unbuilt
    for key in ("qwen3_next", "qwen3_5_text", "falcon_h1", "bamba", "nemotron_h", "jamba"):
        assert verdict[key] == "hybrid", (key, verdict[key])
    for key in ("granitemoehybrid", "zamba2", "kimi_linear", "qwen3_5_moe_text", "lara_mini"):
        assert verdict[key] == "hybrid", (key, verdict[key])
    for key in ("olmo_hybrid", "lfm3", "bailing_hybrid"):
        assert verdict[key] == "hybrid", (key, verdict[key])
    for key, layer in (
        ("mamba", "MambaMixer"),
        ("mamba2", "Mamba2Mixer"),
        ("falcon_mamba", "FalconMambaMixer"),
        ("recurrent_gemma", "RecurrentGemmaRecurrentBlock"),
        ("zamba", "ZambaMambaMixer"),
        ("minimax", "MiniMaxLightningAttention"),
        ("xlstm", "xLSTM"),
        ("qwen4_exp_text", "Qwen4Exp"),
        ("rwkv", "Rwkv"),
    ):
        assert verdict[key].startswith("refused") and layer in verdict[key], (key, verdict[key])
    assert verdict["llama"] == "accepted" and verdict["qwen2"] == "accepted"
    # multimodal: Gemma 3 is split (its image spans: hf/image_mask.py); a VLM whose mask ringkv
    # does not split is refused naming its media
    assert verdict["gemma3"] == "accepted", verdict["gemma3"]
    gemma4 = verdict["gemma4"]
    assert "pixel_values" in gemma4 and "Gemma4ForConditionalGeneration" in gemma4, gemma4


def test_sp_trainer_step_matches_one_unpatched_process(world, tmp_path):
    """``sp_trainer(Trainer)``, sp=4 over the whole world (dp=1): one SGD step (lr 1) leaves the
    weights the unpatched Trainer's step leaves, on every rank."""
    trainer_matches(world, "jamba", 4, tmp_path)


def trainer_matches(world, family, sp, tmp_path):
    """One SGD step of ``sp_trainer(Trainer)`` at ``sp`` (a world of its own: dp = 1) against the
    unpatched Trainer's: the logged loss and every weight after the step, on every rank."""
    import transformers

    from tests.hybrid_cases import trainer_args

    rows = _ids(2, 14, 9)
    model = build(family, 0).train()
    args = transformers.TrainingArguments(**trainer_args(str(tmp_path / "ref"), 2, ddp=False))
    data = [dict(input_ids=r, labels=r) for r in rows]
    ref = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    res = world.check(
        "tests.hybrid_cases:trainer_step", sp, family, 0, rows, "zigzag", str(tmp_path), timeout=300
    )
    for got in res:
        assert got["loss"] == pytest.approx(ref.training_loss, rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["weights"][name], p.detach(), atol=2e-5, rtol=1e-4)


def test_recurrent_form_follows_the_method():
    """``hf.recurrent.form``: ring -> state passing; ulysses -> head-parallel where the heads
    divide the group (else state passing); auto -> ``choose_form``'s pick (tested with the
    forms in test_sp_recurrent_heads); one rank -> state passing."""
    from types import SimpleNamespace

    from ringkv.hf.recurrent import form
    from ringkv.sp.pieces import seq_pieces
    from ringkv.sp.recurrent_heads import choose_form

    gdn = dict(k_heads=2, v_heads=4, heads=4, d_k=128, d_v=128)
    mamba2 = dict(heads=4, head_dim=64, state=128, groups=1)

    def run(method, world, kind, dims):
        state = SimpleNamespace(method=method, world=world)
        return form(state, kind, dims, seq_pieces(4096, "zigzag", world))

    assert run("ring", 2, "gdn", gdn) == "state"
    assert run("ulysses", 2, "gdn", gdn) == "heads"
    assert run("ulysses", 3, "gdn", gdn) == "state"  # 4 heads over 3 ranks
    assert run("ulysses", 2, "mamba2", mamba2) == "heads"
    assert run("auto", 1, "gdn", gdn) == "state"
    for kind, dims in (("gdn", gdn), ("mamba2", mamba2)):
        want = choose_form(kind, dims, seq_pieces(4096, "zigzag", 2), 2)
        assert run("auto", 2, kind, dims) == want
