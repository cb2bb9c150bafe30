"""ringkv's decoder against transformers on tiny random Llama (llama3 RoPE), Qwen2 (qkv bias,
tied embeddings), Qwen3 (q/k norms, tied embeddings) and Mistral configs: prefill logits and
paged decode steps."""

import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.model import ModelConfig  # noqa: E402
from ringkv.model.loader import load_hf_model  # noqa: E402
from tests.models import tiny_config  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request):
    import transformers

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
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.tie_word_embeddings == (arch in ("qwen2", "qwen3"))
    assert cfg.qk_norm == (arch == "qwen3")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if arch == "llama" else None)


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
    (seq,) = llm._make(ids, SamplingParams(temperature=0), False)
    llm.scheduler.add(seq)
    steps = 0
    while steps < 8:
        batch = llm.scheduler.schedule()
        logits = llm.runner.run(batch)
        for s in batch:
            s.seq.num_computed = s.start + s.n
        if not batch[0].completes:  # a prefill chunk (16 tokens a step)
            continue
        ref = hf_logits(hf_model, seq.token_ids)[-1]
        torch.testing.assert_close(logits[0], ref, **TOL)
        seq.token_ids.append(int(ref.argmax()))
        steps += 1
    llm.scheduler.finish(seq)


def test_engine_greedy_matches_hf_generate(hf_model):
    llm = LLM(hf_model, block_size=4, num_blocks=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 23, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=8, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()  # both stop after EOS (id 2), included


def test_sliding_window_caps_max_model_len():
    import transformers

    m = transformers.AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=32)).eval()
    assert LLM(m, block_size=4, num_blocks=64).max_model_len == 32  # exact within the window
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(m, block_size=4, num_blocks=64, max_model_len=64)


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
