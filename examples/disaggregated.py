"""Disaggregated prefill: one engine prefills, another decodes, the KV moves between them.

    torchrun --standalone --nproc-per-node 2 examples/disaggregated.py \\
        [--model PATH] [--requests 16]

Rank 0 (prefill) admits every prompt and, as soon as a request has its first token, exports
it (``LLM.export_request``: tokens, sampler state, the prompt's K/V) and sends the snapshot
to rank 1 over the process group (``KVSnapshot.send``), then frees its copy. Rank 1 (decode)
imports each snapshot as it arrives and generates the rest, stepping between arrivals. At the
end rank 0 runs the same requests on one engine and rank 1 checks that every output is
identical and prints both runs' output tokens/s. Exit status 0 iff identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

import torch.distributed as dist  # noqa: E402

from ringkv.engine import LLM, KVSnapshot, SamplingParams  # noqa: E402
from ringkv.parallel.transfer import recv_bytes, send_bytes  # noqa: E402

TEXT = (
    "The history of the river valley begins with small farming villages that grew along its banks. "
    "Traders arrived from the coast with salt and cloth, the villages became towns, the towns "
    "built walls, and the walls became the borders of the first kingdoms. "
)


def prompts_for(llm, n):
    if llm.tokenizer is None:  # token ids of the model's vocabulary
        v = llm.config.vocab_size - 3
        return [[(7 * i + 3 * j) % v + 3 for j in range(20 + 13 * i)] for i in range(n)]
    ids = llm.tokenizer.encode(TEXT * 6)
    return [ids[(17 * i) % 40 : (17 * i) % 40 + 24 + 11 * i] for i in range(n)]


def prefill(llm, prompts, params):
    """Rank 0: prefill, then ship every request to rank 1 with its first token."""
    rids = [llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    sent = set()
    while len(sent) < len(rids):
        for out in llm.step():
            if out.request_id in sent:
                continue
            sent.add(out.request_id)
            if out.finished:  # done at its first token: nothing to decode
                send_bytes(
                    json.dumps({"done": out.request_id, "token_ids": out.token_ids}).encode(), 1
                )
                continue
            send_bytes(json.dumps({"snapshot": out.request_id}).encode(), 1)
            llm.export_request(out.request_id).send(1)
            llm.abort_request(out.request_id)


def decode(llm, n):
    """Rank 1: import snapshots as they come, decode in between."""
    outs = {}
    for _ in range(n):
        head = json.loads(recv_bytes(0))
        if "done" in head:
            outs[head["done"]] = head["token_ids"]
        else:
            llm.import_request(KVSnapshot.recv(0))
        if llm.has_unfinished_requests():
            outs.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    return [outs[f"r{i}"] for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
    if args.model is None:
        from ringkv.model.smollm2 import smollm2_path

        args.model = smollm2_path()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(args.model, block_size=16, num_blocks=1024, max_num_batched_tokens=512)
    prompts = prompts_for(llm, args.requests)
    dist.barrier()
    t = time.perf_counter()
    if rank == 0:
        prefill(llm, prompts, params)
    else:
        got = decode(llm, len(prompts))
    dist.barrier()
    split_s = time.perf_counter() - t
    if rank == 0:  # the same requests on one engine, for the comparison
        t = time.perf_counter()
        one = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        one_s = time.perf_counter() - t
        send_bytes(json.dumps({"tokens": one, "seconds": one_s}).encode(), 1)
        dist.destroy_process_group()
        return 0
    ref = json.loads(recv_bytes(0))
    same = got == ref["tokens"]
    tokens = sum(map(len, got))
    print(
        f"disaggregated (prefill rank 0 -> decode rank 1): {tokens / split_s:.1f} output tok/s "
        f"over {split_s:.2f} s"
    )
    print(
        f"one engine:                                      {tokens / ref['seconds']:.1f} output "
        f"tok/s over {ref['seconds']:.2f} s"
    )
    print(f"outputs identical to one engine: {same} ({len(got)} requests, {tokens} tokens)")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
