"""ringkv's hybrid decoders (LFM2, Qwen3.5 text, Qwen3-Next, Bamba, Granite 4 hybrid,
Nemotron-H, Falcon-H1) against transformers' fp32 models on tiny random configs
(``tests.hybrid_cases``): prefill logits (in-memory and from a ``save_pretrained`` directory), the
recurrent state contract (a sequence run in pieces with its states carried equals it run whole; B
sequences' decode steps in one ``scan`` equal each alone), pipeline cuts, and the errors for
corrupt checkpoints and refused config options."""

import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.model import (  # noqa: E402
    DenseContext,
    HybridForCausalLM,
    ModelConfig,
    SequenceContext,
    load_model,
    state_layers,
)
from ringkv.model.loader import build  # noqa: E402
from ringkv.parallel.pp import apply_pp, stage_forward  # noqa: E402
from tests.hybrid_cases import build as hf_build  # noqa: E402
from tests.hybrid_cases import config as hf_config  # noqa: E402

FAMILIES = ["lfm2", "qwen3_5", "qwen3_next", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"]
KINDS = {  # the tiny configs' layer kinds
    "lfm2": ["conv", "attention", "conv"],
    "qwen3_5": ["gdn", "gdn", "attention"],
    "qwen3_next": ["gdn", "attention", "gdn"],
    "bamba": ["mamba2", "attention", "mamba2"],
    "granitemoehybrid": ["mamba2", "attention", "mamba2"],
    "nemotron_h": ["mamba2", "attention", "mlp", "mamba2"],
    "falcon_h1": ["attention+mamba2", "attention+mamba2"],
}
HOLDS_KV = ("attention", "attention+mamba2")
# Falcon-H1: every muP multiplier away from 1 (each part of the Mamba2's in_proj its own), so a
# missing one fails
FALCON_MUP = dict(
    embedding_multiplier=1.7,
    lm_head_multiplier=0.37,
    attention_in_multiplier=0.6,
    attention_out_multiplier=1.3,
    key_multiplier=0.45,
    ssm_in_multiplier=1.4,
    ssm_out_multiplier=0.7,
    ssm_multipliers=[0.8, 1.25, 0.6, 1.5, 0.9],
    mlp_multipliers=[1.6, 0.55],
)
# Qwen3-Next: 2 of 4 experts per token, and a dense MLP at layer 1 (the others MoE); Granite: 2
# of 4 experts, RoPE, and multipliers that are not 1
OVERRIDES = {
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    "granitemoehybrid": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=3.0,
    ),
    "falcon_h1": dict(FALCON_MUP, mamba_rms_norm=True),  # the gated norm (normed, then gated)
}
T = 27  # not a multiple of the scans' chunks (4; the delta rule's 64, and 4 in the piece test)
SPLITS = (1, 7, 13)  # pieces of 1, 6, 6 and 14 tokens: L=1 and pieces across chunk boundaries


def _close(a, b, scale):
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, scale), (a - b).abs().max().item()


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """``(family, hf model, our model, prompt ids (T,), HF's logits (T, V))``."""
    fam = request.param
    hf = hf_build(fam, 0, initializer_range=0.1, **OVERRIDES.get(fam, {}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms, biases, D, dt_bias and A_log away from their init: all matter
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = torch.randint(3, 128, (T,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    model, _, _ = load_model(hf)
    return fam, hf, model, ids, ref


def _logits(model, ids, ctx=None):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), ctx))


def test_logits_match_transformers(case, tmp_path):
    fam, hf, model, ids, ref = case
    assert isinstance(model, HybridForCausalLM)
    assert model.config.layer_kinds == KINDS[fam]
    assert model.config.kv_layers() == [i for i, k in enumerate(KINDS[fam]) if k in HOLDS_KV]
    scale = ref.abs().max().item()
    _close(_logits(model, ids), ref, scale)
    hf.save_pretrained(tmp_path)  # safetensors + config.json
    loaded, cfg, _ = load_model(str(tmp_path))
    assert cfg.layer_kinds == KINDS[fam]
    _close(_logits(loaded, ids), ref, scale)


def _small_chunks(model):
    """Chunks of 4 tokens in every scan (exact for any chunk: the pieces then cross them)."""
    for m in model.modules():
        if hasattr(m, "chunk_size"):
            m.chunk_size = 4


def test_pieces_with_carried_state_match_whole(case):
    fam, _, model, ids, ref = case
    _small_chunks(model)
    whole = _logits(model, ids)
    _close(whole, ref, ref.abs().max().item())
    ctx, outs = SequenceContext(), []
    for a, b in zip((0,) + SPLITS, SPLITS + (T,)):
        ctx.next(torch.arange(a, b))
        with torch.no_grad():
            outs.append(model.logits(model(ids[a:b], torch.arange(a, b), ctx)))
    _close(torch.cat(outs), whole, whole.abs().max().item())
    assert sorted(ctx.states) == sorted(state_layers(model))
    assert sorted(ctx.kv) == model.config.kv_layers()


def test_batched_decode_step_matches_each_alone(case):
    _, _, model, _, _ = case
    gen = torch.Generator().manual_seed(2)
    for idx, shapes in state_layers(model).items():
        mixer = model.model.layers[idx].mixer_module
        width = _input_width(mixer)
        states, prefixes = [], [torch.randn(1, n, width, generator=gen) for n in (5, 9, 2)]
        with torch.no_grad():
            for u in prefixes:  # each sequence's prefill from the zero state
                zeros = [torch.zeros(1, *s) for s in shapes]
                states.append(mixer.scan(u, zeros)[1])
            step = torch.randn(3, 1, width, generator=gen)
            batched = [torch.cat(s) for s in zip(*states)]  # (3, *shape) each
            y, new = mixer.scan(step, batched)
            for i, u in enumerate(prefixes):
                y1, new1 = mixer.scan(step[i : i + 1], states[i])
                whole_y, whole_s = mixer.scan(torch.cat([u, step[i : i + 1]], 1), zeros)
                _close(y[i], y1[0], 1.0)
                _close(y[i], whole_y[0, -1:], 1.0)
                for s, s1, sw in zip(new, new1, whole_s):
                    assert s.dtype == torch.float32 and s.shape[1:] == s1.shape[1:]
                    _close(s[i], s1[0], 1.0)
                    _close(s[i], sw[0], 1.0)


def _input_width(mixer) -> int:
    """The width F of the ``u (T, F)`` a mixer hands to ``recur`` (read off a recorded call)."""
    seen = []

    class Probe:
        def recur(self, layer, fn, u, shapes):
            seen.append(u.shape[-1])
            return fn(u[None], [torch.zeros(1, *s) for s in shapes])[0][0]

    with torch.no_grad():
        mixer(torch.zeros(1, mixer.out_proj.out_features), Probe())
    return seen[0]


def test_state_layers_and_pipeline_cut(case):
    fam, _, model, ids, _ = case
    cfg = model.config
    shapes = state_layers(model)
    assert sorted(shapes) == [i for i, k in enumerate(KINDS[fam]) if k not in ("attention", "mlp")]
    rc, k = cfg.recurrent, cfg.recurrent.conv_kernel
    want = {
        "conv": [(cfg.hidden_size, k - 1)],
        "mamba2": [
            (rc.heads * rc.head_dim + 2 * rc.groups * rc.state, k - 1),
            (rc.heads, rc.head_dim, rc.state),
        ],
        "gdn": [
            (2 * rc.k_heads * rc.k_head_dim + rc.heads * rc.head_dim, k - 1),
            (rc.heads, rc.k_head_dim, rc.head_dim),
        ],
    }
    want["attention+mamba2"] = want["mamba2"]
    for i, s in shapes.items():
        assert s == want[cfg.layer_kind(i)]
    whole = _logits(model, ids)
    stages = [copy.deepcopy(model) for _ in range(2)]  # cut in two pipeline stages
    cut = cfg.num_layers // 2
    apply_pp(stages[0], range(0, cut), first=True, last=False)
    apply_pp(stages[1], range(cut, cfg.num_layers), first=False, last=True)
    assert sorted(state_layers(stages[0])) + sorted(state_layers(stages[1])) == sorted(shapes)
    pos = torch.arange(T)
    with torch.no_grad():
        x = stage_forward(stages[0], ids, pos, DenseContext(pos))
        x = stage_forward(stages[1], x, pos, DenseContext(pos))
        _close(stages[1].logits(x), whole, whole.abs().max().item())


@pytest.mark.parametrize(
    "options",
    [
        {},  # no gated norm: y * silu(z) (transformers' default, and the engine tests')
        dict(mamba_rms_norm=True, mamba_norm_before_gate=False),  # gated, then normed per group
        dict(projectors_bias=True, mamba_proj_bias=True, attention_bias=True, mlp_bias=True),
    ],
    ids=["no_norm", "gate_before_norm", "biases"],
)
def test_falcon_h1_options_match_transformers(options):
    """Falcon-H1's Mamba2 without its gated norm or gating before it, and every bias (each
    Mamba2 projection its own option), all multipliers set, against transformers."""
    hf = hf_build("falcon_h1", 0, initializer_range=0.1, **FALCON_MUP, **options)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = torch.randint(3, 128, (T,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    model, cfg, _ = load_model(hf)
    assert cfg.layer_kinds == KINDS["falcon_h1"] and cfg.kv_layers() == [0, 1]
    _close(_logits(model, ids), ref, ref.abs().max().item())
    _small_chunks(model)  # pieces carrying the state (K/V and Mamba2 state in each layer)
    ctx, outs = SequenceContext(), []
    for a, b in zip((0,) + SPLITS, SPLITS + (T,)):
        ctx.next(torch.arange(a, b))
        with torch.no_grad():
            outs.append(model.logits(model(ids[a:b], torch.arange(a, b), ctx)))
    _close(torch.cat(outs), ref, ref.abs().max().item())


def _state(fam):
    hf = hf_build(fam, 0)
    return hf.config.to_dict(), dict(hf.state_dict())


def test_checkpoint_missing_a_mixer_weight_names_it():
    cfg, state = _state("lfm2")
    del state["model.layers.2.conv.conv.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.conv\.conv\.weight.*layer 2 is conv"):
        build(ModelConfig.from_hf(cfg), state)


def test_checkpoint_with_another_layer_pattern_names_the_layers():
    cfg, state = _state("bamba")
    cfg["attn_layer_indices"] = [0]  # the weights have attention at layer 1
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mamba\..*layer 0 is attention"):
        build(ModelConfig.from_hf(cfg), state)


def test_checkpoint_with_other_state_sizes_names_the_tensor(tmp_path):
    hf_build("qwen3_5", 0).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["linear_conv_kernel_dim"] = 3
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn\.conv1d\.weight"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "family, key, value",
    [
        ("nemotron_h", "mlp_hidden_act", "gelu"),
        ("nemotron_h", "residual_in_fp32", True),
        ("nemotron_h", "num_nextn_predict_layers", 1),
        ("nemotron_h", "layers_block_type", ["mamba", "attention", "moe", "mamba"]),
        ("qwen3_5", "hidden_act", "gelu"),
        ("bamba", "hidden_act", "relu"),
        ("granitemoehybrid", "position_embedding_type", "alibi"),
        ("lfm2", "layer_types", ["conv", "sliding_attention", "conv"]),
        ("falcon_h1", "mamba_use_mlp", False),
        ("falcon_h1", "ssm_multipliers", [1.0, 2.0]),
        ("falcon_h1", "mlp_multipliers", [1.0]),
        ("falcon_h1", "hidden_act", "gelu"),
    ],
)
def test_refused_config_options_are_named(family, key, value):
    cfg = hf_config(family).to_dict()
    cfg[key] = value
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(cfg)


def test_qwen3_5_image_text_checkpoint_loads_its_text_model(tmp_path):
    import transformers

    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5Config(
        text_config=hf_config("qwen3_5").to_dict(), vision_config=vision
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)  # model.language_model.*, model.visual.* and lm_head
    ids = torch.randint(3, 128, (T,))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    model, cfg, _ = load_model(str(tmp_path))
    assert cfg.model_type == "qwen3_5_text"
    _close(_logits(model, ids), ref, ref.abs().max().item())
