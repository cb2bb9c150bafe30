"""Where a decode step's time goes, and eager vs ``compile_decode`` (SmolLM2-135M-Instruct, CPU).

Both engines live in one process; for each batch size every prompt (16-256 tokens) is prefilled
first, then their decode steps (``llm.step()``) run interleaved, one of each in turn. Timers
wrapped around the library's functions from outside split each step into:

- ``forward``: the model stage (``stage_forward`` / ``CompiledDecode.forward``), of which
  ``attention`` (``StepContext.attend``: paged KV write + paged attention; eager in both) and
  ``dense`` (the rest: embedding, norms, projections, MLP);
- ``lm_head``: ``Worker._sample_input`` (the last hidden states, the LM head, argmax);
- ``host``: everything else in ``llm.step()``: the scheduler, the step plan, ``LocalStep``
  (``localstep``), sampling on the driver (``sample``: only with ``--sampled``), appending tokens
  and detokenizing (``append``), building the outputs (``output``).

    python benchmarks/decode_step.py --rows 1 4 16 64 --steps 12 --json results/decode_step.json
    # host share
    python benchmarks/decode_step.py --rows 16 64 --engines eager --sampled --agg mean
    python benchmarks/decode_step.py --rows 1 2 3 4 --all-rows-compiled    # why CPU_MIN_ROWS is 4
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402
import ringkv.engine.core as core_mod  # noqa: E402
import ringkv.engine.output as output_mod  # noqa: E402
import ringkv.engine.scheduler as scheduler_mod  # noqa: E402
import ringkv.parallel.compiled as compiled_mod  # noqa: E402
import ringkv.parallel.context as context_mod  # noqa: E402
import ringkv.parallel.worker as worker_mod  # noqa: E402
from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.model.smollm2 import smollm2_path  # noqa: E402

SPENT: dict = {}  # seconds per timer in the current step


def timed(owner, name: str, key: str) -> None:
    f = getattr(owner, name)
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[key] = SPENT.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def install_timers() -> None:
    timed(worker_mod, "stage_forward", "forward")
    timed(compiled_mod.CompiledDecode, "forward", "forward")
    timed(context_mod.StepContext, "attend", "attention")
    timed(worker_mod.Worker, "_sample_input", "lm_head")
    timed(worker_mod, "LocalStep", "localstep")
    timed(scheduler_mod.Scheduler, "schedule", "schedule")
    timed(core_mod, "sample", "sample")
    timed(core_mod._Steps, "append", "append")
    timed(output_mod.OutputProcessor, "request_output", "output")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="decode batch sizes"
    )
    ap.add_argument(
        "--steps", type=int, default=12, help="timed decode steps per batch size and engine"
    )
    ap.add_argument(
        "--engines", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"]
    )
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="temperature 0.8, top-p 0.9, top-k 50 (default greedy)",
    )
    ap.add_argument(
        "--agg",
        choices=["median", "mean"],
        default="median",
        help="per-step aggregate (mean: the parts add up to the step)",
    )
    ap.add_argument(
        "--all-rows-compiled",
        action="store_true",
        help="compile steps of every size (CPU_MIN_ROWS = 1) to time the small ones",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.all_rows_compiled:
        compiled_mod.CPU_MIN_ROWS = 1
    install_timers()
    path, most = smollm2_path(), max(args.rows)
    engines = {}
    for name in args.engines:
        t = time.perf_counter()
        engines[name] = LLM(
            path,
            block_size=16,
            num_blocks=most * 300 // 16 + 8,
            max_num_seqs=most,
            compile_decode=name == "compiled",
        )
        print(f"{name}: built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    rng = random.Random(0)
    corpus = [rng.randrange(100, 20000) for _ in range(4000)]
    agg = statistics.mean if args.agg == "mean" else statistics.median
    rows = []
    for n in args.rows:
        prompts = [corpus[i * 7 : i * 7 + rng.randint(16, 256)] for i in range(n)]
        params = (
            SamplingParams(
                temperature=0.8,
                top_p=0.9,
                top_k=50,
                seed=1,
                max_tokens=args.steps + 1,
                ignore_eos=True,
            )
            if args.sampled
            else SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        )
        for llm in engines.values():
            llm.core.blocks.__init__(
                llm.core.blocks.num_blocks, llm.core.blocks.block_size
            )  # no prefix hits across sizes
            for p in prompts:
                llm.add_request(p, params)
            while (
                len(llm.step()) < n
            ):  # prefill (chunked); from here on every step is a pure decode step
                pass
        parts = {name: {} for name in engines}
        for _ in range(args.steps):
            for name, llm in engines.items():
                SPENT.clear()
                t = time.perf_counter()
                llm.step()
                SPENT["step"] = time.perf_counter() - t
                for key, v in SPENT.items():
                    parts[name].setdefault(key, []).append(v)
        for name, llm in engines.items():
            while llm.has_unfinished_requests():
                llm.step()
            ms = {key: agg(v) * 1e3 for key, v in parts[name].items()}
            step, fwd, head, attn = (
                ms["step"],
                ms.get("forward", 0.0),
                ms.get("lm_head", 0.0),
                ms.get("attention", 0.0),
            )
            row = dict(
                engine=name,
                rows=n,
                sampled=args.sampled,
                step_ms=step,
                forward_ms=fwd,
                attention_ms=attn,
                dense_ms=fwd - attn,
                lm_head_ms=head,
                host_ms=step - fwd - head,
                host_share=(step - fwd - head) / step,
                tok_s=n / step * 1e3,
                **{
                    f"{k}_ms": ms.get(k, 0.0)
                    for k in ("localstep", "schedule", "sample", "append", "output")
                },
            )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    load, mach = load_average(), machine()
    print(machine_line(mach))
    print(
        f"SmolLM2-135M-Instruct fp32, {'sampled' if args.sampled else 'greedy'}, {args.agg} of "
        f"{args.steps} decode steps, load average {load}"
    )
    print(
        "| engine | rows | ms/step | dense ms | attention ms | LM head ms | host ms (share) | of "
        "which sample ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['rows']} | {r['step_ms']:.1f} | {r['dense_ms']:.1f} | "
            f"{r['attention_ms']:.1f} | "
            f"{r['lm_head_ms']:.1f} | {r['host_ms']:.1f} ({100 * r['host_share']:.1f}%) | "
            f"{r['sample_ms']:.1f} |"
        )
    if len(engines) == 2:
        for n in args.rows:
            e, c = (
                next(r for r in rows if r["rows"] == n and r["engine"] == k)
                for k in ("eager", "compiled")
            )
            print(f"{n} rows: compiled {e['step_ms'] / c['step_ms']:.2f}x eager per decode step")
    if args.json:
        write_json(
            args.json,
            dict(
                model="SmolLM2-135M-Instruct",
                threads=mach["threads"],
                load=load,
                agg=args.agg,
                steps=args.steps,
                rows=rows,
                machine=mach,
            ),
        )


if __name__ == "__main__":
    main()
