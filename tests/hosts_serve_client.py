"""The client of tests/test_hosts_serve.py, run ON a host (``h.run(2, ["python", THIS, URL,
KEY])``): the real ``openai`` client and httpx against ``ringkv router`` at ``URL``.

It reads one JSON command a line on stdin and answers each with one JSON line on stdout, so
that the test (outside every namespace) drives it step by step and acts on the hosts (kills,
links) between steps. Streams run on threads of their own: ``stream`` returns once a stream
has ``after`` chunks, ``join`` when it ended. Every wait is bounded.

Commands (``op``): ``complete`` {prompt, max_tokens, base?} -> tokens, instance, cached;
``stream`` {name, prompt, max_tokens, after} -> id, instance; ``join`` {name, timeout} ->
tokens, error, instance, max_gap_s, seconds; ``get`` / ``post`` {path, body?, base?, timeout?}
-> status, json, seconds (admin calls carry the key); ``post_async`` {name, path, body} and
``result`` {name, timeout}: the same, on a thread; ``quit``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx
from openai import OpenAI

URL, KEY = sys.argv[1], sys.argv[2]
HEADERS = {"x-ringkv-admin-key": KEY}
streams: dict = {}
posts: dict = {}


def client(base=None) -> OpenAI:
    return OpenAI(base_url=(base or URL) + "/v1", api_key="none", max_retries=0, timeout=120)


def tokens_of(chunk) -> list:
    return [int(t) for c in chunk.choices for t in (c.logprobs.tokens if c.logprobs else [])]


def complete(prompt, max_tokens, base=None) -> dict:
    raw = client(base).completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    r = raw.parse()
    details = r.usage.prompt_tokens_details
    return {
        "tokens": tokens_of(r),
        "instance": raw.headers.get("x-ringkv-instance"),
        "cached": details.cached_tokens if details else 0,
    }


def stream(name, prompt, max_tokens, after) -> dict:
    s = streams[name] = {"tokens": [], "times": [], "error": None, "ready": threading.Event()}

    def run():
        t0 = time.monotonic()
        try:
            raw = client().completions.with_raw_response.create(
                model="tiny",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                logprobs=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            s["instance"] = raw.headers.get("x-ringkv-instance")
            for i, ch in enumerate(raw.parse()):
                s["id"] = ch.id
                s["tokens"] += tokens_of(ch)
                s["times"].append(time.monotonic())
                if i + 1 == after:
                    s["ready"].set()
        except Exception as e:  # noqa: BLE001 - reported to the test
            s["error"] = f"{type(e).__name__}: {e}"
        s["seconds"] = time.monotonic() - t0
        s["ready"].set()

    s["thread"] = threading.Thread(target=run, daemon=True)
    s["thread"].start()
    if not s["ready"].wait(120):
        return {"error": f"stream {name}: no {after} chunks in 120 s"}
    return {"id": s.get("id"), "instance": s.get("instance"), "error": s["error"]}


def join(name, timeout=120) -> dict:
    s = streams[name]
    s["thread"].join(timeout)
    if s["thread"].is_alive():
        return {"error": f"stream {name} still running after {timeout} s", "tokens": s["tokens"]}
    t = s["times"]
    return {
        "tokens": s["tokens"],
        "error": s["error"],
        "instance": s.get("instance"),
        "max_gap_s": max((b - a for a, b in zip(t, t[1:])), default=0.0),
        "seconds": s.get("seconds"),
    }


def http(method, path, body=None, base=None, timeout=180) -> dict:
    t0 = time.monotonic()
    try:
        r = httpx.request(method, (base or URL) + path, json=body, headers=HEADERS, timeout=timeout)
    except httpx.HTTPError as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}"}
    try:
        got = r.json()
    except ValueError:
        got = r.text
    return {"status": r.status_code, "json": got, "seconds": time.monotonic() - t0}


def post_async(name, path, body=None, timeout=180) -> dict:
    box = posts[name] = {}

    def run():
        box["reply"] = http("POST", path, body, timeout=timeout)

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return {"started": name}


def result(name, timeout=180) -> dict:
    box = posts[name]
    box["thread"].join(timeout)
    return box.get("reply") or {"error": f"{name}: no answer in {timeout} s"}


def main():
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            if op in ("get", "post"):
                out = http(op.upper(), **cmd)
            else:
                out = {
                    "complete": complete,
                    "stream": stream,
                    "join": join,
                    "post_async": post_async,
                    "result": result,
                }[op](**cmd)
        except Exception as e:  # noqa: BLE001 - the test sees it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
