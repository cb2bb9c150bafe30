"""Quantized KV cache: bytes, capacity, quality and speed per ``kv_cache_dtype``.

    python benchmarks/kv_quant.py --json results/kv_quant.json

Per dtype (``auto`` first, as the baseline), on SmolLM2-135M-Instruct (fp32 model):

- ``bytes_per_token`` (``kv_cache_info``, scales included) and its ratio to an fp32 and a bf16
  cache, and the tokens a fixed ``--kv-gib`` budget holds;
- perplexity of the first ``--tokens`` tokens of ``benchmarks/data/kv_quant_text.txt``
  (English and code, shipped in the repo) from ``SamplingParams(prompt_logprobs=0)``, prefilled
  in chunks of ``--chunk`` tokens: the first chunk attends its own K/V as computed, every later
  token reads its keys back from the (quantized) cache, so nearly every position sees
  quantized K/V; its delta to ``auto``, and the mean |delta log-prob| per token;
- greedy agreement: the fraction of ``--greedy-tokens`` greedy tokens after each of
  ``--greedy-prompts`` prompts (cut from the text) that equal ``auto``'s, up to the first
  difference;
- decode tokens/s: ``--decode-requests`` requests of ``--decode-tokens`` greedy tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

from ringkv.engine import LLM, SamplingParams  # noqa: E402

TEXT = os.path.join(HERE, "data", "kv_quant_text.txt")


def measure(path, dtype, ids, args):
    llm = LLM(
        path,
        kv_cache_dtype=dtype,
        max_num_batched_tokens=args.chunk,
        block_size=16,
        kv_cache_memory=int(args.kv_gib * (1 << 30)),
        max_num_seqs=max(args.decode_requests, 8),
    )
    info = llm.kv_cache_info()
    out = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    lps = out.prompt_logprobs
    starts = [i * len(ids) // (args.greedy_prompts + 1) for i in range(1, args.greedy_prompts + 1)]
    prompts = [ids[max(0, s - 64) : s] for s in starts]
    greedy = [
        o.token_ids
        for o in llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    dec = [ids[i * 7 : i * 7 + 32] for i in range(args.decode_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate(dec[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(dec, params, use_tqdm=False)
    dt = time.perf_counter() - t
    cfg = llm.config
    return dict(
        dtype=dtype,
        bytes_per_token=info["bytes_per_token"],
        capacity_tokens=info["capacity_tokens"],
        fp32_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
        ppl=math.exp(-sum(lps) / len(lps)),
        logprobs=lps,
        greedy=greedy,
        decode_tok_s=args.decode_requests * args.decode_tokens / dt,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2", help="smollm2 or an HF directory")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8_e4m3", "fp8_e5m2", "int8"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument(
        "--chunk", type=int, default=32, help="max_num_batched_tokens while scoring the text"
    )
    ap.add_argument(
        "--kv-gib", type=float, default=0.25, help="KV cache budget for the capacity column"
    )
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--decode-requests", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.models import describe, machine, machine_line, model_path, write_json

    path = model_path(args.model)
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path).encode(open(TEXT).read())[: args.tokens]
    except (OSError, ValueError):  # a random model without a tokenizer: seeded token ids
        import random

        rng = random.Random(0)
        ids = [rng.randrange(3, 1000) for _ in range(args.tokens)]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    rows = [
        measure(path, d, ids, args) for d in (["auto"] + [d for d in args.dtypes if d != "auto"])
    ]
    base = rows[0]
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["ppl"] / base["ppl"] - 1)
        r["mean_abs_dlogprob"] = sum(
            abs(a - b) for a, b in zip(r["logprobs"], base["logprobs"])
        ) / len(r["logprobs"])
        agree = []
        for a, b in zip(r["greedy"], base["greedy"]):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            agree.append(k / len(a))
        r["greedy_agreement"] = sum(agree) / len(agree)
        r["vs_fp32"] = r["bytes_per_token"] / r["fp32_bytes_per_token"]
        r["vs_bf16"] = r["bytes_per_token"] / (r["fp32_bytes_per_token"] / 2)
    mach = machine()
    print(machine_line(mach))
    print(
        f"{describe(args.model)} (fp32 model), {args.tokens} tokens of {os.path.relpath(TEXT)} in "
        f"chunks of {args.chunk}, {args.kv_gib} GiB KV budget"
    )
    print(
        "| kv_cache_dtype | bytes/token | vs fp32 | vs bf16 | capacity (tokens) | perplexity | "
        "delta | mean abs d-logprob | greedy agreement | decode tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['bytes_per_token']} | {r['vs_fp32']:.3f} | {r['vs_bf16']:.3f} | "
            f"{r['capacity_tokens']} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.3f}% | "
            f"{r['mean_abs_dlogprob']:.5f} | "
            f"{r['greedy_agreement']:.3f} | {r['decode_tok_s']:.1f} |"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                tokens=args.tokens,
                chunk=args.chunk,
                rows=[
                    {k: v for k, v in r.items() if k not in ("logprobs", "greedy")} for r in rows
                ],
                machine=mach,
            ),
        )


if __name__ == "__main__":
    main()
