"""Output tokens/s: ringkv.LLM vs transformers ``generate`` on SmolLM2-135M-Instruct (greedy; fp32
on CPU, ``--device cuda --dtype bf16`` on a GPU), or (``--tp/--pp/--sp``) a parallel engine
against ``tp = pp = sp = 1`` in the same run.

Same prompts (mixed lengths), same greedy settings, the same number of output tokens per
request (EOS ignored on both sides), measured in the same process one after the other:

- ringkv: ``LLM.generate`` (continuous batching, paged KV cache, chunked prefill) as ``LLM(path)``
  builds it: ``compile_decode="auto"`` (the default since issue #60: compiled or eager as its
  cached first-use check decided; stderr says which), or eager with ``--ringkv-compile false``;
- HF batched: one ``generate`` call over all requests with left padding (the fair baseline);
- HF one by one: a ``generate`` call per request (runs of <= ``--hf-single-max`` requests);
- ``--compile-decode``: a second ringkv engine with ``compile_decode=True`` (decode steps' dense
  parts compiled), timed interleaved with the others; its compile time (at engine
  start) is reported apart (``compile_s``) and is not in its tok/s;
- ``--peer vllm``: vLLM's ``LLM.generate`` on the same token ids, in its own virtual environment
  (``--peer-python``; its setup: benchmarks/vllm_peer.py), with as many cores as ringkv's torch
  threads: built once at the start, then timed right beside ringkv's default engine on every
  repeat (before it on every other one), so both see the machine of the same minute; the output
  gives the speedup fastest over fastest and per repeat. When it cannot run, the table says why
  and the other rows stand.

    python benchmarks/engine.py --requests 16 64 --max-tokens 64 --json results/engine.json
    python benchmarks/engine.py --device cuda --dtype bf16 --requests 16 64 \\
        --json results/engine_gpu.json
    python benchmarks/engine.py --requests 16 --peer vllm --json results/engine_vllm.json
    python benchmarks/engine.py --requests 16 64 --max-tokens 64 --compile-decode \\
        --json results/engine_compile.json
    python benchmarks/engine.py --pp 2 --model llama-120m --requests 16 64 \\
        --json results/engine_pp2.json

Parallel mode: both engines get the same ``--kv-cache-memory`` per rank and the same
requests; the table gives output tokens/s, KV capacity in tokens, per-rank memory (weights,
KV cache, peak RSS) and, per rank, the fraction of the run it was not computing (for
pipeline stages: the bubble). The single-rank engine uses all cores (``--threads``: that
many); each of N ranks gets cores / N threads.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402
from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.model.smollm2 import smollm2_path  # noqa: E402
from benchmarks.vllm_peer import Peer  # noqa: E402

TEXT = (
    "The history of the river valley begins with small farming villages that grew along its banks. "
    "Over centuries, traders arrived from the coast, bringing salt, cloth and new ideas about "
    "writing and numbers. The villages became towns, the towns built walls, and the walls became "
    "the borders of the first small kingdoms. Scholars still argue about which of these kingdoms "
    "was the oldest, because the records they left were written on clay that has mostly crumbled. "
)


def make_prompts(tok, n: int, lo: int, hi: int, seed: int = 0):
    corpus = tok.encode(TEXT * 8)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length, start = rng.randint(lo, hi), rng.randrange(0, 200)
        prompts.append(corpus[start : start + length])
    return prompts


def bench_ringkv(llm, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return [o.token_ids for o in outs], dt


@torch.inference_mode()
def bench_hf_batched(hf, tok, prompts, lengths):
    max_tokens = max(lengths)  # one batch runs until its longest request is done
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    t = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=pad,
    )
    dt = time.perf_counter() - t
    return [row[:n] for row, n in zip(out[:, width:].tolist(), lengths)], dt


@torch.inference_mode()
def bench_hf_single(hf, tok, prompts, lengths):
    outs = []
    t = time.perf_counter()
    for p, max_tokens in zip(prompts, lengths):
        out = hf.generate(
            torch.tensor([p], device=hf.device),
            attention_mask=torch.ones(1, len(p), dtype=torch.long, device=hf.device),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=tok.pad_token_id,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs, time.perf_counter() - t


def agreement(a, b) -> float:
    """Fraction of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def prefix_agreement(a, b) -> float:
    """Mean over requests of the fraction of ``a``'s tokens before the first difference from
    ``b``."""

    def common(x, y):
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))

    return sum(common(x, y) / max(1, len(x)) for x, y in zip(a, b)) / len(a)


def start_peer(args, path, dtype) -> Peer:
    """vLLM (``--peer-python``) built once for every run of this benchmark: the largest run's
    requests at once, its longest prompt and output."""
    return Peer(
        args.peer_python,
        dict(
            model=path,
            max_model_len=args.max_prompt + args.max_tokens + 16,
            max_num_seqs=max(args.requests),
            dtype=dtype,
            threads=torch.get_num_threads(),
        ),
        args.peer_timeout,
    )


def peer_row(peer: Peer, runs: list, r_out, r_dts: list, lengths) -> dict:
    """vLLM's ``runs`` (one per repeat, each timed right beside ringkv's, ``r_dts``): its
    fastest tok/s, ringkv's speedup fastest over fastest and per repeat, and the greedy
    agreement with ringkv, or ``vllm_error``: why it did not run."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return dict(vllm_error=errors[0])
    v_dt = min(r["seconds"] for r in runs)
    v_out = runs[0]["tokens"]
    return dict(
        vllm_version=peer.version,
        vllm_s=v_dt,
        vllm_tok_s=sum(lengths) / v_dt,
        speedup_vs_vllm=v_dt / min(r_dts),
        speedup_vs_vllm_each=[round(r["seconds"] / dt, 3) for r, dt in zip(runs, r_dts)],
        greedy_agreement_vs_vllm=agreement(r_out, v_out),
        prefix_agreement_vs_vllm=prefix_agreement(r_out, v_out),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--mixed-output",
        action="store_true",
        help="also run with per-request max_tokens drawn from [max_tokens/4, max_tokens]: "
        "the HF batch runs to its longest request, only requested tokens count",
    )
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's default; parallel mode: of the tp = pp = sp = 1 "
        "engine, default all cores)",
    )
    ap.add_argument(
        "--hf-single-max",
        type=int,
        default=16,
        help="also time HF one request at a time for runs of at most this many requests (0: never)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each side this many times, interleaved, and keep the fastest (a shared CPU is "
        "noisy)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cpu", help="single mode: cpu or cuda (both engines)")
    ap.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="single mode: model dtype"
    )
    ap.add_argument("--tp", type=int, default=1, help="parallel mode: tensor-parallel ranks")
    ap.add_argument("--pp", type=int, default=1, help="parallel mode: pipeline stages")
    ap.add_argument("--sp", type=int, default=1, help="parallel mode: sequence-parallel ranks")
    ap.add_argument(
        "--model",
        default="smollm2",
        help="parallel mode: smollm2, a preset of benchmarks/models.py "
        "(llama-120m: 12 heads, 4 KV heads) or a directory",
    )
    ap.add_argument(
        "--kv-cache-memory",
        type=float,
        default=0.25,
        help="parallel mode: GiB of KV cache per rank",
    )
    ap.add_argument(
        "--ringkv-compile",
        choices=["auto", "false"],
        default="auto",
        help="single mode: compile_decode of the first ringkv engine (row 'ringkv'): auto (the "
        "default engine since issue #60: eager or compiled by its cached check; the run prints "
        "which) or false (the eager engine)",
    )
    ap.add_argument(
        "--compile-decode",
        action="store_true",
        help="single mode: also time a ringkv engine with compile_decode=True (row 'ringkv "
        "compiled')",
    )
    ap.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="single mode: also time this engine (its own venv)",
    )
    ap.add_argument(
        "--peer-python",
        default=os.environ.get("RINGKV_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"),
        help="the python of the venv with vLLM (default: $RINGKV_VLLM_PYTHON or "
        "/tmp/vllm-venv/bin/python)",
    )
    ap.add_argument(
        "--peer-timeout", type=float, default=1800, help="seconds the peer may take per run"
    )
    ap.add_argument("--one-engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_engine:  # a job of main_parallel, in its own process
        with open(args.one_engine) as f:
            job = json.load(f)
        with open(args.one_engine + ".out", "w") as f:
            json.dump(
                run_engine(job["path"], job["prompts"], job["lengths"], job["kw"], job["threads"]),
                f,
            )
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tp * args.pp * args.sp > 1:
        return main_parallel(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dtype_name = str(dtype).replace("torch.", "")
    # vLLM first (its engine's start would disturb ringkv's "auto" check), idle until timed
    peer = start_peer(args, path, dtype_name) if args.peer else None
    if peer is not None:
        atexit.register(peer.close)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    hf.generation_config.eos_token_id = None  # the same number of tokens on both sides
    need = max(args.requests) * (args.max_prompt + args.max_tokens + 16)
    llm = LLM(
        path,
        block_size=16,
        num_blocks=need // 16 + 1,
        max_num_seqs=max(args.requests),
        dtype=dtype,
        device=args.device,
        compile_decode="auto" if args.ringkv_compile == "auto" else False,
    )
    decision = llm.kv_cache_info()["compile"]
    print(
        f"ringkv (compile_decode={args.ringkv_compile}): compiled={decision['on']} "
        f"({decision['by']}{'; ' + decision['why'] if decision['why'] else ''})",
        file=sys.stderr,
    )
    # first-call overheads out of the timings: a prefill as large as the runs' (vLLM's engine
    # runs its own at start), so no side pays the process's first large GEMMs in its timed run
    warm = make_prompts(tok, 2, args.max_prompt, args.max_prompt, seed=99)
    bench_ringkv(llm, warm, [2, 2])
    bench_hf_batched(hf, tok, warm, [2, 2])
    compiled, compile_info = None, {}
    if (
        args.compile_decode
    ):  # compiled at construction (warm-up), so the timed runs hold no compiling
        t = time.perf_counter()
        compiled = LLM(
            path,
            block_size=16,
            num_blocks=need // 16 + 1,
            max_num_seqs=max(args.requests),
            dtype=dtype,
            device=args.device,
            compile_decode=True,
        )
        compile_info = dict(
            compiled_build_s=time.perf_counter() - t,
            compile_s=compiled.rank_stats()[0]["compile_s"],
        )
        bench_ringkv(compiled, warm, [2, 2])
        print(json.dumps(compile_info), file=sys.stderr)

    rows = []
    runs = [(n, False) for n in args.requests] + (
        [(n, True) for n in args.requests] if args.mixed_output else []
    )
    for n, mixed in runs:
        prompts = make_prompts(tok, n, args.min_prompt, args.max_prompt, seed=n)
        rng = random.Random(n + 1)
        lengths = [
            rng.randint(max(1, args.max_tokens // 4), args.max_tokens) if mixed else args.max_tokens
            for _ in prompts
        ]
        r_dts, v_runs, h_dt, c_dt = [], [], float("inf"), float("inf")
        for i in range(args.repeats):
            # vLLM right beside ringkv's default engine, first on every other repeat
            if peer is not None and i % 2:
                v_runs.append(peer.generate(prompts, lengths))
            llm.core.blocks.__init__(
                llm.core.blocks.num_blocks, llm.core.blocks.block_size
            )  # no prefix hits from earlier runs
            r_out, dt = bench_ringkv(llm, prompts, lengths)
            r_dts.append(dt)
            if peer is not None and not i % 2:
                v_runs.append(peer.generate(prompts, lengths))
            if compiled is not None:
                compiled.core.blocks.__init__(
                    compiled.core.blocks.num_blocks, compiled.core.blocks.block_size
                )
                before = compiled.rank_stats()[0]
                c_out, dt = bench_ringkv(compiled, prompts, lengths)
                after = compiled.rank_stats()[0]
                c_dt = min(c_dt, dt)
            h_out, dt = bench_hf_batched(hf, tok, prompts, lengths)
            h_dt = min(h_dt, dt)
        tokens, r_dt = sum(lengths), min(r_dts)
        row = dict(
            requests=n,
            output_lengths="mixed" if mixed else "fixed",
            prompt_tokens=sum(map(len, prompts)),
            output_tokens=tokens,
            ringkv_s=r_dt,
            ringkv_tok_s=tokens / r_dt,
            hf_batched_s=h_dt,
            hf_batched_tok_s=tokens / h_dt,
            speedup_vs_hf_batched=h_dt / r_dt,
            greedy_agreement_vs_hf_batched=agreement(r_out, h_out),
        )
        if n <= args.hf_single_max:
            s_out, s_dt = bench_hf_single(hf, tok, prompts, lengths)
            row.update(
                hf_single_s=s_dt,
                hf_single_tok_s=tokens / s_dt,
                speedup_vs_hf_single=s_dt / r_dt,
                greedy_agreement_vs_hf_single=agreement(r_out, s_out),
            )
        if compiled is not None:
            row.update(
                compile_info,
                compiled_s=c_dt,
                compiled_tok_s=tokens / c_dt,
                compiled_vs_eager=r_dt / c_dt,
                compiled_vs_hf_batched=h_dt / c_dt,
                greedy_agreement_compiled_vs_eager=agreement(c_out, r_out),
                prefix_agreement_compiled_vs_eager=prefix_agreement(c_out, r_out),
                compiled_steps=after["compiled_steps"] - before["compiled_steps"],
                steps=after["steps"] - before["steps"],
                load=load_average(),
            )
        if peer is not None:
            row.update(peer_row(peer, v_runs, r_out, r_dts, lengths))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    cols = [
        "requests",
        "output_lengths",
        "prompt_tokens",
        "output_tokens",
        "ringkv_tok_s",
        "hf_batched_tok_s",
        "speedup_vs_hf_batched",
        "hf_single_tok_s",
        "speedup_vs_hf_single",
    ]
    if compiled is not None:
        cols += [
            "compiled_tok_s",
            "compiled_vs_eager",
            "compiled_vs_hf_batched",
            "greedy_agreement_compiled_vs_eager",
        ]
    if args.peer:
        cols += [
            "vllm_tok_s",
            "speedup_vs_vllm",
            "greedy_agreement_vs_vllm",
            "prefix_agreement_vs_vllm",
        ]
    mach = machine()
    print(machine_line(mach))
    print(
        f"SmolLM2-135M-Instruct {args.dtype} on {args.device}, greedy, {args.max_tokens} output "
        f"tokens/request, prompts {args.min_prompt}-{args.max_prompt} tokens"
    )
    widths = [max(22, len(c)) for c in cols]
    print(" | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in rows:
        print(
            " | ".join(
                f"{r.get(c, '-'):>{w}.2f}"
                if isinstance(r.get(c), float)
                else f"{r.get(c, '-'):>{w}}"
                for c, w in zip(cols, widths)
            )
        )
    for error in dict.fromkeys(r["vllm_error"] for r in rows if "vllm_error" in r):
        print(f"vllm: not run: {error}")
    for r in rows:
        if "speedup_vs_vllm_each" in r:
            print(f"{r['requests']} requests: ringkv / vLLM per repeat {r['speedup_vs_vllm_each']}")
    if compiled is not None:
        print(
            "ringkv compiled: compile (at engine start, not in tok/s) "
            f"{compile_info['compile_s']:.1f} s, "
            f"engine built in {compile_info['compiled_build_s']:.1f} s"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                model="SmolLM2-135M-Instruct",
                dtype=dtype_name,
                max_tokens=args.max_tokens,
                threads=mach["threads"],
                device=args.device,
                rows=rows,
                machine=mach,
            ),
        )


def run_engine(path, prompts, lengths, kw, threads):
    """One engine, built, timed on the prompts, closed: tokens, seconds, cache info, rank stats."""
    torch.set_num_threads(threads)
    with LLM(path, **kw) as llm:
        bench_ringkv(llm, [p[:8] for p in prompts[:2]], [2, 2])  # warm up (first-call overheads)
        llm.core.blocks.__init__(llm.core.blocks.num_blocks, llm.core.blocks.block_size)
        before = llm.rank_stats()
        out, dt = bench_ringkv(llm, prompts, lengths)
        after = llm.rank_stats()
        ranks = [
            dict(
                a,
                busy_s=a["busy_s"] - b["busy_s"],
                idle_fraction=1 - (a["busy_s"] - b["busy_s"]) / dt,
            )
            for a, b in zip(after, before)
        ]
        return out, dt, llm.kv_cache_info(), ranks, llm.peak_in_flight


def run_engine_in_subprocess(path, prompts, lengths, kw, threads):
    """``run_engine`` in a fresh process: each rank's peak memory is its own engine's."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        job = os.path.join(d, "job.json")
        with open(job, "w") as f:
            json.dump(dict(path=path, prompts=prompts, lengths=lengths, kw=kw, threads=threads), f)
        res = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one-engine", job],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise RuntimeError(res.stderr[-3000:])
        with open(job + ".out") as f:
            return json.load(f)


def main_parallel(args):
    from benchmarks.models import describe, model_path

    path = model_path(args.model)
    cores = os.cpu_count() or 1
    world = args.tp * args.pp * args.sp
    base_threads, rank_threads = args.threads or cores, max(1, cores // world)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except Exception:  # a random model has no tokenizer: random token ids
        tok = None
    configs = [dict(tp=1, pp=1, sp=1), dict(tp=args.tp, pp=args.pp, sp=args.sp)]
    rows = []
    for n in args.requests:
        if tok is not None:
            prompts = make_prompts(tok, n, args.min_prompt, args.max_prompt, seed=n)
        else:
            rng = random.Random(n)
            prompts = [
                [
                    rng.randrange(3, 1000)
                    for _ in range(rng.randint(args.min_prompt, args.max_prompt))
                ]
                for _ in range(n)
            ]
        lengths = [args.max_tokens] * n
        best, times = [None, None], [[], []]
        for _ in range(args.repeats):
            for i, c in enumerate(configs):
                threads = rank_threads if i else base_threads
                kw = dict(c, kv_cache_memory=int(args.kv_cache_memory * (1 << 30)), max_num_seqs=n)
                res = run_engine_in_subprocess(path, prompts, lengths, kw, threads)
                times[i].append(res[1])
                if best[i] is None or res[1] < best[i][1]:
                    best[i] = res
                print(f"[{n} requests] {c}: {sum(lengths) / res[1]:.1f} tok/s", file=sys.stderr)
        (b_out, b_dt, b_info, b_ranks, _), (p_out, p_dt, p_info, p_ranks, depth) = best
        tokens = sum(lengths)
        row = dict(
            requests=n,
            output_tokens=tokens,
            prompt_tokens=sum(map(len, prompts)),
            config=f"tp={args.tp} pp={args.pp} sp={args.sp}",
            base_tok_s=tokens / b_dt,
            parallel_tok_s=tokens / p_dt,
            speedup=b_dt / p_dt,
            base_times_s=times[0],
            parallel_times_s=times[1],
            greedy_agreement=agreement(b_out, p_out),
            base_capacity_tokens=b_info["capacity_tokens"],
            parallel_capacity_tokens=p_info["capacity_tokens"],
            base_rank=_mem(b_ranks[0]),
            parallel_ranks=[_mem(r) for r in p_ranks],
            idle_fraction=[round(r["idle_fraction"], 3) for r in p_ranks],
            pp_bubble=sum(r["idle_fraction"] for r in p_ranks) / len(p_ranks),
            peak_in_flight=depth,
            base_threads=base_threads,
            load=load_average(),
        )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    mach = machine(
        threads=base_threads
    )  # the tp=pp=sp=1 engine's; each of the N ranks gets cores / N
    print(machine_line(mach) + f" (tp=pp=sp=1; {rows[0]['config']}: {rank_threads} per rank)")
    print(
        f"{describe(args.model)} fp32, greedy, {args.max_tokens} output tokens/request, prompts "
        f"{args.min_prompt}-{args.max_prompt} tokens, {args.kv_cache_memory} GiB KV cache per rank"
    )
    print(
        "| requests | tp=pp=sp=1 tok/s | "
        + rows[0]["config"]
        + " tok/s | speedup | KV capacity (tokens) 1 -> N | "
        "weights+KV per rank MiB 1 -> N | peak RSS per rank MiB | idle fraction per rank (bubble) |"
    )
    print("|---:|---:|---:|---:|---|---|---|---|")

    def mib(b):
        return f"{b / 2**20:.0f}"

    for r in rows:
        print(
            f"| {r['requests']} | {r['base_tok_s']:.1f} | {r['parallel_tok_s']:.1f} | "
            f"{r['speedup']:.2f}x | "
            f"{r['base_capacity_tokens']} -> {r['parallel_capacity_tokens']} | "
            f"{mib(r['base_rank']['weights'] + r['base_rank']['kv'])} -> "
            f"{', '.join(mib(x['weights'] + x['kv']) for x in r['parallel_ranks'])} | "
            f"{mib(r['base_rank']['peak_rss'])} -> "
            f"{', '.join(mib(x['peak_rss']) for x in r['parallel_ranks'])} | "
            f"{', '.join(f'{x:.2f}' for x in r['idle_fraction'])} |"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                dtype="float32",
                max_tokens=args.max_tokens,
                cores=mach["cores"],
                rows=rows,
                machine=mach,
            ),
        )


def _mem(rank: dict) -> dict:
    return dict(
        weights=rank["weight_bytes"], kv=rank["kv_cache_bytes"], peak_rss=rank["peak_rss_bytes"]
    )


if __name__ == "__main__":
    main()
