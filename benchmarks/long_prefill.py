"""Time to first token of one long prompt on the engine with sequence parallelism.

    python benchmarks/long_prefill.py --model tiny-long --seq 32768 --sp 1 2 \\
        --json results/prefill_32k.json
    python benchmarks/long_prefill.py --model smollm2 --seq 8192 --sp 1 2 \\
        --json results/prefill_8k.json
    python benchmarks/long_prefill.py --model smollm2 --sweep 64 256 1024 4096 \\
        --json results/threshold.json

Each configuration runs in a fresh process (peak memory per rank is that process's own):
``LLM(model, sp=N)`` prefills a warm-up prompt, then the timed prompt with ``max_tokens=1``
(TTFT = that ``generate`` call); each rank gets ``cores / sp`` torch threads unless
``--threads`` says otherwise (``--sp 1 --threads 1``: one thread's rates, for the planner's
thread scaling; ``cpu_s``, the process's CPU seconds per prompt, is then the time it ran on
a core, which on a loaded machine estimates the unloaded TTFT). ``--chunk`` is
``max_num_batched_tokens`` (default: the whole prompt in one step). Efficiency as in
``long_ctx.py`` on a CPU: T(sp = 1, all cores) / T(sp = N, cores / N threads per rank);
ideal 1.

``--sweep`` measures, at ``sp = 2``, each prompt length with the ring (the prompt split over
the ranks) and replicated (every rank computes every token; partial attention merged), to
place ``sp_prefill_min_tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def one(args) -> dict:
    """In a fresh process: build the engine, time the prompt, report."""
    import torch

    from benchmarks.models import model_path
    from ringkv.engine import LLM, SamplingParams

    path = model_path(args.model)
    cores = os.cpu_count() or 1
    torch.set_num_threads(args.threads or max(1, cores // args.sp[0]))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(args.seq)]
    kw = dict(
        sp=args.sp[0],
        max_num_batched_tokens=args.chunk or args.seq,
        max_model_len=args.seq + 64,
        num_blocks=-(-(args.seq + 1024) // (16 * args.sp[0])),
        block_size=16,
    )  # the prompt + warm-up
    if args.min_ring is not None:
        kw["sp_prefill_min_tokens"] = args.min_ring
    first = SamplingParams(temperature=0, max_tokens=1)
    with LLM(path, **kw) as llm:
        llm.generate(
            [[rng.randrange(3, 1000) for _ in range(min(args.seq, 512))]], first, use_tqdm=False
        )  # warm-up
        times, cpu = [], []
        for i in range(args.repeats):
            p = [7 + i] + prompt[1:]  # a new first token: no prefix-cache hit
            t, c = time.perf_counter(), time.process_time()
            out = llm.generate([p], first, use_tqdm=False)[0]
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        ranks = llm.rank_stats()
    return dict(
        model=args.model,
        seq=args.seq,
        sp=args.sp[0],
        chunk=kw["max_num_batched_tokens"],
        min_ring=args.min_ring,
        ttft_s=min(times),
        times=times,
        cpu_s=cpu,
        token=out.token_ids,
        peak_rss_mib=[r["peak_rss_bytes"] / 2**20 for r in ranks],
        kv_cache_mib=[r["kv_cache_bytes"] / 2**20 for r in ranks],
        threads=torch.get_num_threads(),
    )


def spawn(args, **over) -> dict:
    cmd = [sys.executable, __file__, "--one", "--model", args.model, "--repeats", str(args.repeats)]
    for k, v in over.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(row), file=sys.stderr)
    return row


def main(argv=None):
    from benchmarks.models import load_average, machine, machine_line, write_json

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="tiny-long",
        help="tiny-long, llama-120m, smollm2 (benchmarks/models.py) or a path",
    )
    ap.add_argument("--seq", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--chunk", type=int, default=None, help="max_num_batched_tokens (default: the whole prompt)"
    )
    ap.add_argument(
        "--min-ring", type=int, default=None, help="sp_prefill_min_tokens (default: the engine's)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: cores / sp)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed prompts per configuration (the fastest counts)",
    )
    ap.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=None,
        metavar="LEN",
        help="sp=2: ring vs replicated at these prompt lengths",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return
    if args.sweep:
        rows = []
        for n in args.sweep:
            base = spawn(args, seq=n, sp=1)
            ring = spawn(args, seq=n, sp=2, min_ring=1)
            rep = spawn(args, seq=n, sp=2, min_ring=10**9)
            rows.append(
                dict(
                    seq=n,
                    sp1_s=base["ttft_s"],
                    ring_s=ring["ttft_s"],
                    replicated_s=rep["ttft_s"],
                    faster="ring" if ring["ttft_s"] < rep["ttft_s"] else "replicated",
                    sp1_threads=base["threads"],
                    sp2_threads=ring["threads"],
                )
            )
        mach = machine(
            threads=sorted(
                {t for r in rows for t in (r["sp1_threads"], r["sp2_threads"])}, reverse=True
            )
        )
        print(machine_line(mach))
        print(
            f"{args.model}: TTFT at sp=2, ring vs replicated (threads per rank: sp=1 "
            f"{rows[0]['sp1_threads']}, "
            f"sp=2 {rows[0]['sp2_threads']})"
        )
        print("| prompt tokens | sp=1 | sp=2 ring | sp=2 replicated | faster at sp=2 |")
        print("|---:|---:|---:|---:|---|")
        for r in rows:
            print(
                f"| {r['seq']} | {r['sp1_s']:.3f} s | {r['ring_s']:.3f} s | "
                f"{r['replicated_s']:.3f} s | {r['faster']} |"
            )
        out = dict(kind="sweep", model=args.model, cores=mach["cores"], rows=rows, machine=mach)
    else:
        rows = [
            spawn(
                args,
                seq=args.seq,
                sp=n,
                chunk=args.chunk,
                min_ring=args.min_ring,
                threads=args.threads,
            )
            for n in args.sp
        ]
        base = next((r for r in rows if r["sp"] == 1), None)
        for r in rows:
            r["efficiency"] = base["ttft_s"] / r["ttft_s"] if base else None
            r["same_token_as_sp1"] = base["token"] == r["token"] if base else None
        mach = machine(threads=sorted({r["threads"] for r in rows}, reverse=True))
        print(machine_line(mach))
        print(f"{args.model}: TTFT of a {args.seq}-token prompt (chunk {rows[0]['chunk']} tokens)")
        print(
            "| sp | threads per rank | TTFT | efficiency | peak RSS per rank (MiB) | KV cache per "
            "rank (MiB) | same first token |"
        )
        print("|---:|---:|---:|---:|---|---|---|")
        for r in rows:
            eff = f"{r['efficiency']:.3f}" if r["efficiency"] is not None else "-"
            print(
                f"| {r['sp']} | {r['threads']} | {r['ttft_s']:.2f} s | {eff} | "
                f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} | "
                f"{', '.join(f'{m:.0f}' for m in r['kv_cache_mib'])} | {r['same_token_as_sp1']} |"
            )
        out = dict(
            kind="prefill",
            model=args.model,
            seq=args.seq,
            cores=mach["cores"],
            rows=rows,
            load=load_average(),
            machine=mach,
        )
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
