"""Output tokens/s: ringkv.LLM vs transformers ``generate`` on SmolLM2-135M-Instruct (fp32, greedy).

Same prompts (mixed lengths), same greedy settings, the same number of output tokens per
request (EOS ignored on both sides), measured in the same process one after the other:

- ringkv: ``LLM.generate`` (continuous batching, paged KV cache, chunked prefill);
- HF batched: one ``generate`` call over all requests with left padding (the fair baseline);
- HF one by one: a ``generate`` call per request (runs of <= ``--hf-single-max`` requests).

    python benchmarks/engine.py --requests 16 64 --max-tokens 64 --json results/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.model.smollm2 import smollm2_path  # noqa: E402

TEXT = ("The history of the river valley begins with small farming villages that grew along its banks. "
        "Over centuries, traders arrived from the coast, bringing salt, cloth and new ideas about "
        "writing and numbers. The villages became towns, the towns built walls, and the walls became "
        "the borders of the first small kingdoms. Scholars still argue about which of these kingdoms "
        "was the oldest, because the records they left were written on clay that has mostly crumbled. ")


def make_prompts(tok, n: int, lo: int, hi: int, seed: int = 0):
    corpus = tok.encode(TEXT * 8)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length, start = rng.randint(lo, hi), rng.randrange(0, 200)
        prompts.append(corpus[start:start + length])
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
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, pad_token_id=pad)
    dt = time.perf_counter() - t
    return [row[:n] for row, n in zip(out[:, width:].tolist(), lengths)], dt


@torch.inference_mode()
def bench_hf_single(hf, tok, prompts, lengths):
    outs = []
    t = time.perf_counter()
    for p, max_tokens in zip(prompts, lengths):
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          pad_token_id=tok.pad_token_id)
        outs.append(out[0, len(p):].tolist())
    return outs, time.perf_counter() - t


def agreement(a, b) -> float:
    """Fraction of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mixed-output", action="store_true",
                    help="also run with per-request max_tokens drawn from [max_tokens/4, max_tokens]: "
                         "the HF batch runs to its longest request, only requested tokens count")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--hf-single-max", type=int, default=16,
                    help="also time HF one request at a time for runs of at most this many requests (0: never)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each side this many times, interleaved, and keep the fastest (a shared CPU is noisy)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the same number of tokens on both sides
    need = max(args.requests) * (args.max_prompt + args.max_tokens + 16)
    llm = LLM(path, block_size=16, num_blocks=need // 16 + 1, max_num_seqs=max(args.requests))
    warm = make_prompts(tok, 2, 8, 16, seed=99)  # first-call overheads out of the timings
    bench_ringkv(llm, warm, [2, 2])
    bench_hf_batched(hf, tok, warm, [2, 2])

    rows = []
    runs = [(n, False) for n in args.requests] + ([(n, True) for n in args.requests] if args.mixed_output else [])
    for n, mixed in runs:
        prompts = make_prompts(tok, n, args.min_prompt, args.max_prompt, seed=n)
        rng = random.Random(n + 1)
        lengths = [rng.randint(max(1, args.max_tokens // 4), args.max_tokens) if mixed else args.max_tokens
                   for _ in prompts]
        r_dt = h_dt = float("inf")
        for _ in range(args.repeats):
            llm.blocks.__init__(llm.blocks.num_blocks, llm.blocks.block_size)  # no prefix hits from earlier runs
            r_out, dt = bench_ringkv(llm, prompts, lengths)
            r_dt = min(r_dt, dt)
            h_out, dt = bench_hf_batched(hf, tok, prompts, lengths)
            h_dt = min(h_dt, dt)
        tokens = sum(lengths)
        row = dict(requests=n, output_lengths="mixed" if mixed else "fixed",
                   prompt_tokens=sum(map(len, prompts)), output_tokens=tokens,
                   ringkv_s=r_dt, ringkv_tok_s=tokens / r_dt, hf_batched_s=h_dt, hf_batched_tok_s=tokens / h_dt,
                   speedup_vs_hf_batched=h_dt / r_dt, greedy_agreement_vs_hf_batched=agreement(r_out, h_out))
        if n <= args.hf_single_max:
            s_out, s_dt = bench_hf_single(hf, tok, prompts, lengths)
            row.update(hf_single_s=s_dt, hf_single_tok_s=tokens / s_dt, speedup_vs_hf_single=s_dt / r_dt,
                       greedy_agreement_vs_hf_single=agreement(r_out, s_out))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    cols = ["requests", "output_lengths", "prompt_tokens", "output_tokens", "ringkv_tok_s", "hf_batched_tok_s",
            "speedup_vs_hf_batched", "hf_single_tok_s", "speedup_vs_hf_single"]
    print(f"SmolLM2-135M-Instruct fp32, greedy, {args.max_tokens} output tokens/request, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens, torch threads={torch.get_num_threads()}")
    print(" | ".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r.get(c, '-'):>22.2f}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>22}"
                         for c in cols))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(model="SmolLM2-135M-Instruct", dtype="float32", max_tokens=args.max_tokens,
                           threads=torch.get_num_threads(), device="cpu", rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
