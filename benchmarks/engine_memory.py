"""Per-rank memory of a multi-rank engine over a long run of sampled decode steps.

    python benchmarks/engine_memory.py --pp 2 --steps 2000 --json results/engine_memory.json

Starts the engine (spawned ranks), keeps ``--seqs`` sampled requests decoding (a finished one
is replaced), and every ``--every`` steps records each rank's resident memory (now and peak)
and its sends not yet complete. Memory must stay flat: the table shows the growth after the
warm-up (the first record) and the JSON every record. Default model: a random Llama with
SmolLM2's vocabulary (49152), where a leaked step result (``seqs/pp x vocab x 4`` bytes of
logits) shows at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import load_average, machine, machine_line, shape, write_json  # noqa: E402

MIB = 1 << 20


def wide_vocab_model():
    """A tiny random Llama with a 49152-token vocabulary (as SmolLM2): the catalogue's
    ``tiny-wide-vocab``."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**shape("tiny-wide-vocab"), bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def measure(
    model, *, steps: int, seqs: int = 8, every: int = 100, max_tokens: int = 400, **engine
) -> list:
    """Run ``steps`` engine steps with ``seqs`` sampled requests in flight; a record per rank
    every ``every`` steps: ``step, rank, rss_mib, peak_rss_mib, pending_sends``."""
    from ringkv import LLM, SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)
    records = []

    def prompt(i):
        return [3 + (i * 7 + j) % 100 for j in range(8)]

    with LLM(model, block_size=16, num_blocks=seqs * (max_tokens // 16 + 4), **engine) as llm:
        live = {llm.add_request(prompt(i), params) for i in range(seqs)}
        added = seqs
        for step in range(1, steps + 1):
            for out in llm.step():
                if out.finished:
                    live.discard(out.request_id)
            while len(live) < seqs:
                live.add(llm.add_request(prompt(added), params))
                added += 1
            if step % every == 0:
                for r in llm.rank_stats():
                    records.append(
                        dict(
                            step=step,
                            rank=r["rank"],
                            rss_mib=r["rss_bytes"] / MIB,
                            peak_rss_mib=r["peak_rss_bytes"] / MIB,
                            pending_sends=r["pending_sends"],
                        )
                    )
        for rid in live:
            llm.abort_request(rid)
    return records


def growth(records: list) -> dict:
    """Per rank: resident memory growth (MiB) from the first record to the last, and the most
    sends pending at a record."""
    out = {}
    for rank in sorted({r["rank"] for r in records}):
        mine = [r for r in records if r["rank"] == rank]
        out[rank] = dict(
            rss_growth_mib=mine[-1]["rss_mib"] - mine[0]["rss_mib"],
            peak_growth_mib=mine[-1]["peak_rss_mib"] - mine[0]["peak_rss_mib"],
            max_pending_sends=max(r["pending_sends"] for r in mine),
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load = load_average()
    t = time.perf_counter()
    records = measure(
        wide_vocab_model(),
        steps=args.steps,
        seqs=args.seqs,
        every=args.every,
        pp=args.pp,
        tp=args.tp,
        sp=args.sp,
    )
    seconds = time.perf_counter() - t
    result = growth(records)
    world = (
        args.pp * args.tp * args.sp
    )  # spawned ranks get cores / world threads each (ringkv.parallel.launch)
    mach = machine(threads=max(1, (os.cpu_count() or 1) // world) if world > 1 else None)
    print(machine_line(mach) + (" per rank" if world > 1 else ""))
    print(
        f"{args.steps} sampled decode steps, {args.seqs} requests, pp={args.pp} tp={args.tp} "
        f"sp={args.sp}, vocab 49152, {seconds:.0f} s, load {load}"
    )
    print(
        f"{'rank':>4} {'RSS first':>10} {'RSS last':>9} {'growth':>8} {'peak growth':>12} "
        f"{'max pending':>12}"
    )
    for rank, g in result.items():
        mine = [r for r in records if r["rank"] == rank]
        print(
            f"{rank:>4} {mine[0]['rss_mib']:>8.1f}Mi {mine[-1]['rss_mib']:>7.1f}Mi "
            f"{g['rss_growth_mib']:>6.1f}Mi "
            f"{g['peak_growth_mib']:>10.1f}Mi {g['max_pending_sends']:>12}"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                args=vars(args),
                seconds=seconds,
                load=load,
                records=records,
                growth={str(k): v for k, v in result.items()},
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
