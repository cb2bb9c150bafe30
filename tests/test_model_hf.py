"""ringkv's decoder against transformers on tiny random Llama (llama3 RoPE), Qwen2 (qkv bias,
tied embeddings), Qwen3 (q/k norms, tied embeddings), Mistral, Gemma 2 (soft-caps, alternating
windows, query_pre_attn_scalar, sandwich norms), Gemma 3 text (q/k norms, local and global RoPE)
and Phi-3 (fused projections, partial RoPE, windows) configs: prefill logits and paged decode
steps; config.json dicts as checkpoints on the Hub write them."""

import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.model import ModelConfig  # noqa: E402
from ringkv.model.loader import load_hf_model  # noqa: E402
from tests.models import tiny_config, tiny_model  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"]
NEW = (
    "gemma2",
    "gemma3_text",
    "phi3",
)  # tests.models.tiny_model makes their norms, caps and windows matter
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request):
    import transformers

    if request.param in NEW:
        return tiny_model(request.param, 0, num_hidden_layers=3)
    torch.manual_seed(0)
    cfg = tiny_config(request.param)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1; make them matter
        for layer in m.model.layers:
            if request.param == "qwen2":
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
            if request.param == "qwen3":
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def hf_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


def test_config_reads_arch_details(hf_model):
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    arch = hf_model.config.model_type
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.tie_word_embeddings == (
        arch in ("qwen2", "qwen3") + NEW[:2]
    )
    assert cfg.qk_norm == (arch in ("qwen3", "gemma3_text"))
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if arch == "llama" else None)
    assert cfg.norm_plus_one == cfg.sandwich_norms == (arch in NEW[:2]) and cfg.fused_proj == (
        arch == "phi3"
    )
    assert cfg.attn_softcap == (1.5 if arch == "gemma2" else None)
    assert cfg.final_softcap == {"gemma2": 3.0, "gemma3_text": 4.0}.get(arch)
    assert cfg.attn_scale == (24**-0.5 if arch in NEW[:2] else None)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    assert windows == {"gemma2": [5, -1, 5], "gemma3_text": [4, -1, 4], "phi3": [6, 6, 6]}.get(
        arch, [-1, -1]
    )
    assert cfg.local_rope_theta == (10000.0 if arch == "gemma3_text" else None)
    assert cfg.partial_rotary_factor == (0.5 if arch == "phi3" else 1.0)


def test_config_json_as_the_hub_writes_it():
    """Older config.json layouts: Gemma 3's top-level RoPE bases and window pattern, Gemma 2
    without layer_types, Qwen2's windows from max_window_layers; refused: longrope, the
    multimodal Gemma 3."""
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=7,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    g3 = ModelConfig.from_hf(
        dict(
            base,
            model_type="gemma3_text",
            head_dim=16,
            rope_theta=1e6,
            rope_scaling=None,
            rope_local_base_freq=1e4,
            sliding_window=512,
            sliding_window_pattern=6,
            query_pre_attn_scalar=16,
            hidden_activation="gelu_pytorch_tanh",
        )
    )
    assert [g3.window(i) for i in range(7)] == [511] * 5 + [-1, 511]
    assert (g3.rope_theta, g3.local_rope_theta, g3.attn_scale, g3.tie_word_embeddings) == (
        1e6,
        1e4,
        0.25,
        True,
    )
    g3 = ModelConfig.from_hf(
        dict(base, model_type="gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0})
    )
    assert (
        g3.rope_scaling["factor"] == 8.0
        and g3.local_rope_scaling is None
        and g3.local_rope_theta == 1e4
    )
    assert (
        g3.rope_theta == 1e6 and g3.hidden_act == "gelu_pytorch_tanh" and g3.sliding_window == 4096
    )
    from ringkv.model.rope import rope_index

    g3 = ModelConfig.from_hf(
        dict(base, model_type="gemma3_text", sliding_window=None)
    )  # no window: the RoPEs stay
    assert [g3.window(i) for i in range(7)] == [-1] * 7 and [
        rope_index(g3, i) for i in range(7)
    ] == [1] * 5 + [0, 1]
    g2 = ModelConfig.from_hf(
        dict(
            base,
            model_type="gemma2",
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=144,
        )
    )
    assert [g2.window(i) for i in range(7)] == [4095, -1] * 3 + [4095] and g2.attn_softcap == 50.0
    q2 = ModelConfig.from_hf(
        dict(
            base, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=4
        )
    )
    assert [q2.window(i) for i in range(7)] == [-1] * 4 + [7] * 3
    assert (
        ModelConfig.from_hf(dict(base, model_type="qwen2", sliding_window=8)).sliding_window is None
    )
    assert [
        ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=8)).window(i)
        for i in (0, 6)
    ] == [7, 7]
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf(
            dict(
                base,
                model_type="phi3",
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                },
            )
        )
    with pytest.raises(ValueError, match="gemma3_text"):
        ModelConfig.from_hf(dict(base, model_type="gemma3"))
    with pytest.raises(ValueError, match="activation"):
        ModelConfig.from_hf(dict(base, model_type="gemma2", hidden_activation="relu"))


def test_prefill_logits_match(hf_model):
    model, _ = load_hf_model(hf_model)
    ids = torch.randint(3, 128, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ours = model.logits(model(torch.tensor(ids)))
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), **TOL)


def test_paged_decode_logits_match(hf_model):
    """Prefill in chunks, then decode token by token over the paged cache; every step's logits
    equal HF's full forward at that position."""
    llm = LLM(hf_model, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    ids = torch.randint(3, 128, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    (seq,) = llm.core.make_request(ids, SamplingParams(temperature=0))
    llm.core.scheduler.add(seq)
    steps = 0
    while steps < 8:
        batch = llm.core.scheduler.schedule()
        logits = llm.core.logits(batch)
        for s in batch:
            s.seq.num_computed = s.start + s.n
        if not batch[0].completes:  # a prefill chunk (16 tokens a step)
            continue
        ref = hf_logits(hf_model, seq.token_ids)[-1]
        torch.testing.assert_close(logits[0], ref, **TOL)
        seq.token_ids.append(int(ref.argmax()))
        steps += 1
    llm.core.scheduler.finish(seq)


def test_engine_greedy_matches_hf_generate(hf_model):
    llm = LLM(hf_model, block_size=4, num_blocks=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=8,
                pad_token_id=0,
            )
        assert o.token_ids == ref[0, len(p) :].tolist()  # both stop after EOS (id 2), included


def test_sliding_window_beyond_the_window():
    """Mistral's window (every layer) is applied, not a cap on max_model_len: greedy output of
    prompts several windows long equals transformers'."""
    m = tiny_model("mistral", 0, sliding_window=6)
    llm = LLM(m, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    assert llm.max_model_len == 256  # max_position_embeddings, not the window
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 30, 45)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    from tests.models import hf_greedy

    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def test_linear_rope_scaling_matches_transformers():
    import transformers

    torch.manual_seed(0)
    cfg = tiny_config("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model, ours = load_hf_model(m)
    assert ours.rope_scaling["rope_type"] == "linear"
    ids = torch.randint(3, 128, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        got = model.logits(model(torch.tensor(ids)))
    torch.testing.assert_close(got, hf_logits(m, ids), **TOL)
