"""Request-rate sweep against a running ``ringkv serve`` (started here unless ``--url``).

    python benchmarks/serve.py --model smollm2 --rates 0.5 1 2 4 --requests 32 \\
        --json results/serve.json \\
        --plot results/serve.png

For each rate: ``--requests`` streamed completions arrive as a Poisson process (exponential
gaps, seeded), prompts of mixed lengths cut from a fixed text, output lengths drawn from
``--min-tokens``-``--max-tokens`` (EOS ignored, so every request produces them). Reported
per rate: output tokens/s and requests/s over the run, time to first token (TTFT),
inter-token latency (ITL, the gaps between a request's streamed tokens) and end-to-end
latency percentiles. ``inf`` sends every request at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

TEXT = (
    "The history of the river valley begins with small farming villages that grew along its banks. "
    "Over centuries, traders arrived from the coast, bringing salt, cloth and new ideas about "
    "writing and numbers. The villages became towns, the towns built walls, and the walls became "
    "the borders of the first small kingdoms. Scholars still argue about which of these kingdoms "
    "was the oldest. "
)


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def one(client, url, model, prompt, max_tokens, bar):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
    bar.update(1)
    return dict(
        ttft=times[0] - t0 if times else float("nan"),
        e2e=time.perf_counter() - t0,
        itl=[b - a for a, b in zip(times, times[1:])],
        tokens=len(times),
    )


async def sweep_rate(url, model, rate, prompts, lengths, seed, bar):
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        tasks = []
        t0 = time.perf_counter()
        for p, n in zip(prompts, lengths):
            tasks.append(asyncio.create_task(one(client, url, model, p, n, bar)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    itl = [x for r in res for x in r["itl"]]
    tokens = sum(r["tokens"] for r in res)
    return dict(
        rate=rate,
        requests=len(res),
        wall_s=wall,
        output_tokens=tokens,
        tok_s=tokens / wall,
        req_s=len(res) / wall,
        ttft_p50=percentile([r["ttft"] for r in res], 50),
        ttft_p90=percentile([r["ttft"] for r in res], 90),
        ttft_p99=percentile([r["ttft"] for r in res], 99),
        itl_p50=percentile(itl, 50),
        itl_p90=percentile(itl, 90),
        itl_p99=percentile(itl, 99),
        e2e_p50=percentile([r["e2e"] for r in res], 50),
        e2e_p99=percentile([r["e2e"] for r in res], 99),
        itl_mean=statistics.fmean(itl) if itl else float("nan"),
    )


def start_server(model_path, name, extra):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringkv",
            "serve",
            "--model",
            model_path,
            "--port",
            str(port),
            "--served-model-name",
            name,
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, a preset of benchmarks/models.py, or a directory",
    )
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--served-model-name", default="bench")
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.5, 1, 2, 4],
        help="requests/s (inf: all at once)",
    )
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--server-args", default="", help="extra arguments for ringkv serve (e.g. '--pp 2')"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from benchmarks.models import describe, machine, machine_line, model_path, write_json

    path = model_path(args.model)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(path, args.served_model_name, args.server_args.split())
    try:
        try:
            tok = AutoTokenizer.from_pretrained(path)
            corpus = tok.encode(TEXT * 40)
        except Exception:  # a random model: token ids
            tok, corpus = None, [random.Random(1).randrange(3, 1000) for _ in range(8000)]
        rng = random.Random(args.seed)
        rows = []
        bar = tqdm(total=len(args.rates) * args.requests, desc="requests", unit="req")
        for k, rate in enumerate(args.rates):
            prompts, lengths = [], []
            for _ in range(args.requests):
                n, start = (
                    rng.randint(min(args.min_prompt, args.max_prompt), args.max_prompt),
                    rng.randrange(0, 1000),
                )
                ids = corpus[start : start + n]
                prompts.append(tok.decode(ids) if tok is not None else ids)
                lengths.append(rng.randint(min(args.min_tokens, args.max_tokens), args.max_tokens))
            rows.append(
                asyncio.run(
                    sweep_rate(
                        url, args.served_model_name, rate, prompts, lengths, args.seed + k, bar
                    )
                )
            )
        bar.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    mach = (
        machine()
    )  # the server started here inherits this environment (its threads: torch's default)
    print(
        machine_line(mach)
        + ("" if args.url is None else f" (this client's; the server at {args.url} may differ)")
    )
    print(
        f"{describe(args.model)}, ringkv serve {args.server_args}, {args.requests} requests per "
        f"rate, prompts {args.min_prompt}-{args.max_prompt} tokens, outputs "
        f"{args.min_tokens}-{args.max_tokens} tokens"
    )
    print(
        "| rate (req/s) | output tok/s | req/s | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 / p99 "
        "(ms) | E2E p50 / p99 (s) |"
    )
    print("|---:|---:|---:|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']:g} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50']:.2f} / "
            f"{r['ttft_p90']:.2f} / "
            f"{r['ttft_p99']:.2f} | {1e3 * r['itl_p50']:.0f} / {1e3 * r['itl_p90']:.0f} / "
            f"{1e3 * r['itl_p99']:.0f} | "
            f"{r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} |"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                server_args=args.server_args,
                cores=mach["cores"],
                rows=rows,
                machine=mach,
            ),
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [
            r["rate"]
            if r["rate"] != float("inf")
            else 2 * max(x for x in args.rates if x != float("inf"))
            for r in rows
        ]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(xs, [r["tok_s"] for r in rows], "o-")
        a.set_xlabel("offered load (requests/s)")
        a.set_ylabel("output tokens/s")
        b.plot(xs, [r["ttft_p50"] for r in rows], "o-", label="TTFT p50")
        b.plot(xs, [r["ttft_p99"] for r in rows], "o--", label="TTFT p99")
        b.plot(xs, [r["itl_p50"] for r in rows], "s-", label="ITL p50")
        b.set_xlabel("offered load (requests/s)")
        b.set_ylabel("seconds")
        b.set_yscale("log")
        b.legend()
        fig.suptitle(f"ringkv serve: {describe(args.model)}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
