"""guidellm (an external OpenAI-API benchmark client) and ``benchmarks/serve.py`` against one
``ringkv serve``.

    python benchmarks/guidellm_vs_ours.py --json results/guidellm_vs_ours.json

Each guidellm setting runs twice by default (``--guidellm-prefetch 0 64``): with guidellm's default
data loader, whose worker process generates 4096 synthetic prompts ahead (``prefetch_factor``), and
with ``--data-loader kind=pytorch,prefetch_factor=64``. On a 2-core machine the default loader's
process took most of a core during the first seconds of each run, next to the server; measured
TTFT p50 (2026-12-02, SmolLM2, 256/64 tokens), default vs prefetch 64: synchronous 0.81 vs 0.15 s,
Poisson 1 req/s 7.2-18.7 vs 0.39-0.41 s, 16 at once 2.0-2.1 vs 1.1-1.3 s.

Starts one server (``OMP_NUM_THREADS=1``, SmolLM2-135M-Instruct, served as ``smol``), sends one
warm-up request, then for each setting runs guidellm and, right after it, ``benchmarks/serve.py
--url`` with the same prompt/output lengths, request count and offered load:

* ``sync``: guidellm ``synchronous`` (one request at a time); serve.py has no such mode (guidellm
  only).
* ``poisson R``: Poisson arrivals at R req/s (guidellm ``poisson``, serve.py ``--rates R``). The two
  draw different arrival sequences (their own seeds): at R = 1 and 24 requests, guidellm's 24
  arrivals span 15.2 s, serve.py's 29.3 s, so their throughput columns are not the same offered
  load.
* ``burst N``: N requests at once (guidellm ``concurrent`` with N streams and N requests, serve.py
  ``--rates inf --requests N``).

Both send streamed ``/v1/completions`` with ``ignore_eos`` and ``temperature=0``. guidellm's prompts
are synthetic text of exactly ``--prompt-tokens`` tokens (its own tokenizer count); serve.py's are
token slices of a fixed text (``--min-prompt = --max-prompt``). guidellm comes with the test
extra (``pip install -e '.[test]'``; it moves click and multidict to the versions it pins); any
other environment's ``guidellm`` works too (``--guidellm PATH``).

Metric definitions differ between the clients; the table keeps each client's own:

* TTFT: both from sending the request to the first streamed token (percentiles over requests).
* ITL: guidellm's is per request, (last token - first token) / (output tokens - 1), its percentiles
  weighted by tokens; serve.py's percentiles are over every gap between streamed tokens, so its p99
  shows single slow steps that a per-request mean smooths out.
* output tok/s, req/s: both computed here as totals over the run's wall time (guidellm: its
  benchmark ``duration``, first request sent to last response; serve.py: first request to last).
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

from ringkv.serve.router import free_port  # noqa: E402


def start_server(model_path: str, name: str, log_path: str):
    import httpx

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(log_path, "w")
    cmd = [
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
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(open(log_path).read()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def warm_up(url: str, name: str) -> None:
    import httpx

    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": name,
            "prompt": "Hello " * 200,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    r.raise_for_status()


def guidellm_cmd(
    exe, url, name, model_path, setting, n, prompt_tokens, output_tokens, out_json, prefetch=0
):
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": name,
        "request_format": "/v1/completions",
        "extras": {"body": {"temperature": 0}},
    }
    kind, value = setting
    profile = {
        "sync": "kind=synchronous",
        "poisson": f"kind=poisson,rate={value:g}",
        "constant": f"kind=constant,rate={value:g}",
        "burst": f"kind=concurrent,streams={int(value)}",
    }[kind]
    return [
        exe,
        "run",
        "--backend",
        json.dumps(backend, separators=(",", ":")),
        "--tokenizer",
        f"kind=huggingface_auto,model={model_path}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--profile",
        profile,
        "--constraint",
        f"kind=max_requests,count={n}",
        "--output",
        f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ] + (["--data-loader", f"kind=pytorch,prefetch_factor={prefetch}"] if prefetch else [])


def serve_cmd(url, name, setting, n, prompt_tokens, output_tokens, out_json):
    kind, value = setting
    rate = "inf" if kind == "burst" else f"{value:g}"
    return [
        sys.executable,
        os.path.join(HERE, "serve.py"),
        "--model",
        "smollm2",
        "--url",
        url,
        "--served-model-name",
        name,
        "--rates",
        rate,
        "--requests",
        str(n),
        "--min-prompt",
        str(prompt_tokens),
        "--max-prompt",
        str(prompt_tokens),
        "--min-tokens",
        str(output_tokens),
        "--max-tokens",
        str(output_tokens),
        "--json",
        out_json,
    ]


def parse_guidellm(path: str) -> dict:
    with open(path) as f:
        b = json.load(f)["benchmarks"][0]
    m = b["metrics"]
    ok = m["request_totals"]["successful"]
    errored = m["request_totals"]["errored"]
    dur = b["duration"]
    tokens = m["output_token_count"]["successful"]["total_sum"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = m["inter_token_latency_ms"]["successful"]["percentiles"]
    return dict(
        requests=ok,
        errored=errored,
        wall_s=dur,
        output_tokens=tokens,
        ttft_p50=ttft["p50"] / 1e3,
        ttft_p99=ttft["p99"] / 1e3,
        itl_p50=itl["p50"] / 1e3,
        itl_p99=itl["p99"] / 1e3,
        tok_s=tokens / dur,
        req_s=ok / dur,
        guidellm_output_tok_s_mean=m["output_tokens_per_second"]["successful"]["mean"],
        guidellm_req_s_mean=m["requests_per_second"]["successful"]["mean"],
        prompt_tokens_p50=m["prompt_token_count"]["successful"]["percentiles"]["p50"],
    )


def parse_serve(path: str) -> dict:
    with open(path) as f:
        r = json.load(f)["rows"][0]
    return dict(
        requests=r["requests"],
        errored=0,
        wall_s=r["wall_s"],
        output_tokens=r["output_tokens"],
        ttft_p50=r["ttft_p50"],
        ttft_p99=r["ttft_p99"],
        itl_p50=r["itl_p50"],
        itl_p99=r["itl_p99"],
        tok_s=r["tok_s"],
        req_s=r["req_s"],
    )


def run(cmd, env, log_path):
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        with open(log_path) as f:
            raise RuntimeError(f"{cmd[:2]} exited {rc}:\n{f.read()[-4000:]}")
    return time.perf_counter() - t0


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = os.path.join(os.path.dirname(sys.executable), "guidellm")
    ap.add_argument(
        "--guidellm",
        default=here if os.path.exists(here) else shutil.which("guidellm"),
        help="the guidellm executable (default: this Python's environment's, else on PATH)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument(
        "--sync-requests", type=int, default=8, help="requests of the synchronous run (0: skip)"
    )
    ap.add_argument("--rates", type=float, nargs="*", default=[1.0], help="Poisson rates (req/s)")
    ap.add_argument("--rate-requests", type=int, default=24, help="requests per Poisson rate")
    ap.add_argument("--burst", type=int, nargs="*", default=[16], help="requests sent all at once")
    ap.add_argument(
        "--guidellm-prefetch",
        type=int,
        nargs="+",
        default=[0, 64],
        help="guidellm runs per setting, one per data-loader prefetch_factor (0: guidellm's "
        "default, 4096 synthetic prompts generated ahead by a loader process)",
    )
    ap.add_argument(
        "--guidellm-workers",
        type=int,
        default=1,
        help="GUIDELLM__MAX_WORKER_PROCESSES (its default is 10 processes; 1 on a 2-core machine)",
    )
    ap.add_argument(
        "--out-dir", default=None, help="keep the raw outputs and logs here (default: a temp dir)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from benchmarks.models import model_path

    path = model_path("smollm2")
    name = "smol"
    out = args.out_dir or tempfile.mkdtemp(prefix="guidellm_vs_ours_")
    os.makedirs(out, exist_ok=True)
    genv = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        GUIDELLM__MAX_WORKER_PROCESSES=str(args.guidellm_workers),
    )
    senv = dict(os.environ, HF_HUB_OFFLINE="1")
    version = subprocess.run(
        [args.guidellm, "--version"], capture_output=True, text=True
    ).stdout.strip()

    settings = (
        ([("sync", 1, args.sync_requests)] if args.sync_requests else [])
        + [("poisson", r, args.rate_requests) for r in args.rates]
        + [("burst", b, b) for b in args.burst]
    )
    rows, commands = [], []
    proc, url, server_cmd = start_server(path, name, os.path.join(out, "server.log"))
    loads = [load_average()]
    try:
        warm_up(url, name)
        for kind, value, n in settings:
            label = {
                "sync": "synchronous",
                "poisson": f"poisson {value:g} req/s",
                "burst": f"{n} at once",
            }[kind]
            tag = f"{kind}_{value:g}"
            for pf in args.guidellm_prefetch:
                client = "guidellm" + (f" (prefetch {pf})" if pf else "")
                gtag = tag + (f"_pf{pf}" if pf else "")
                gjson = os.path.join(out, f"guidellm_{gtag}.json")
                cmd = guidellm_cmd(
                    args.guidellm,
                    url,
                    name,
                    path,
                    (kind, value),
                    n,
                    args.prompt_tokens,
                    args.output_tokens,
                    gjson,
                    pf,
                )
                commands.append(cmd)
                print(f"{client}  {label} ...", flush=True)
                run(cmd, genv, os.path.join(out, f"guidellm_{gtag}.log"))
                rows.append(dict(client=client, setting=label, **parse_guidellm(gjson)))
                loads.append(load_average())
            if kind == "sync":
                continue
            sjson = os.path.join(out, f"serve_{tag}.json")
            cmd = serve_cmd(
                url, name, (kind, value), n, args.prompt_tokens, args.output_tokens, sjson
            )
            commands.append(cmd)
            print(f"serve.py  {label} ...", flush=True)
            run(cmd, senv, os.path.join(out, f"serve_{tag}.log"))
            rows.append(dict(client="serve.py", setting=label, **parse_serve(sjson)))
            loads.append(load_average())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    loads.append(load_average())

    from benchmarks.models import machine, machine_line, write_json

    mach = machine(threads=1)  # the server's (OMP_NUM_THREADS=1)
    print("\n" + machine_line(mach) + " (the server)")
    print(
        f"SmolLM2-135M-Instruct, ringkv serve (OMP_NUM_THREADS=1), prompts {args.prompt_tokens} "
        f"tokens, outputs {args.output_tokens} tokens (ignore_eos, greedy), streamed "
        f"/v1/completions, {version}, load average (1/5/15 min) {loads[0]} at start, {loads[-1]} "
        f"at end; raw outputs in {out}"
    )
    print(
        "| client | setting | requests (errors) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | output "
        "tok/s | req/s |"
    )
    print("|---|---|---:|---|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['client']} | {r['setting']} | {r['requests']} ({r['errored']}) | "
            f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {1e3 * r['itl_p50']:.0f} / "
            f"{1e3 * r['itl_p99']:.0f} | {r['tok_s']:.1f} | {r['req_s']:.2f} |"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                guidellm_version=version,
                server_cmd=server_cmd,
                cores=mach["cores"],
                machine=mach,
                prompt_tokens=args.prompt_tokens,
                output_tokens=args.output_tokens,
                load_average=loads,
                commands=commands,
                raw_dir=out,
                rows=rows,
            ),
        )


if __name__ == "__main__":
    main()
