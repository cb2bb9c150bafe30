"""A long prompt through a HuggingFace model patched with ringkv, against the unpatched model.

    # tiny random Llama
    torchrun --nproc-per-node 2 examples/hf_long_context.py
    torchrun --nproc-per-node 4 examples/hf_long_context.py --model DIR --seq 16384
    (DIR: an HF-format directory, e.g. SmolLM2:
     python -c "from tests.models import smollm2_path; print(smollm2_path())")

Every rank loads the model and passes the whole prompt; ringkv shards it (zigzag), runs ring
attention for the prefill and keeps the KV cache sharded for the generated tokens. Each rank
reports its peak memory (RSS on CPU, CUDA max allocated on GPU) and time; rank 0 then runs the
unpatched model alone on the same prompt and compares the next-token logits and tokens.
Gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(args, device, dtype):
    import transformers

    if args.model:
        return (
            transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
            .to(device)
            .eval()
        )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(4096, args.seq + args.new_tokens),
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device, dtype).eval()


def peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(model, ids, new_tokens, device):
    start = 0.0 if device.type == "cuda" else rss_mib()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = peak_mib(
        device
    )  # CUDA: max allocated during the run; CPU: process peak RSS, and its rise in the run
    return (
        out.sequences[:, ids.shape[1] :],
        out.scores[0].float(),
        time.perf_counter() - t0,
        (peak, peak - start),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-format model directory (default: a tiny random Llama)")
    p.add_argument("--seq", type=int, default=4096, help="prompt length in tokens")
    p.add_argument(
        "--new-tokens", type=int, default=4, help="greedy tokens to generate after the prompt"
    )
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--no-baseline", action="store_true", help="skip the unpatched run on rank 0")
    args = p.parse_args()

    import ringkv.hf

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32

    model = build(args, device, dtype)
    with (
        torch.no_grad()
    ):  # touch every weight once (safetensors may be memory-mapped) before measuring
        sum(float(p.float().sum()) for p in model.parameters())
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(
        device
    )

    ringkv.hf.patch_model(model, sp=world, layout=args.layout)
    tokens, first, seconds, peak = run(model, ids, args.new_tokens, device)
    report = [None] * world
    dist.all_gather_object(report, (rank, seconds, peak))
    if rank == 0:
        mem = "cuda max allocated" if cuda else "peak RSS"
        print(
            f"ringkv sp={world} layout={args.layout} prompt={args.seq} tokens, {args.new_tokens} "
            f"new, model={args.model or 'tiny random Llama'}, {dtype}"
        )
        for r, s, (m, rise) in report:
            print(
                f"  rank {r}: {s:8.3f} s  {mem} {m:9.1f} MiB"
                + ("" if cuda else f" (+{rise:.1f} MiB in the run)")
            )
    if rank == 0 and not args.no_baseline:
        ringkv.hf.unpatch_model(model)
        ref_tokens, ref_first, ref_seconds, ref_peak = run(model, ids, args.new_tokens, device)
        print(
            f"  unpatched (rank 0 alone): {ref_seconds:8.3f} s  {mem} {ref_peak[0]:9.1f} MiB"
            + (
                ""
                if cuda
                else f" (+{ref_peak[1]:.1f} MiB in the run; the peak includes the patched run "
                "before it)"
            )
        )
        print(
            "  max |logits - unpatched| (first new token) = "
            f"{(first - ref_first).abs().max().item():.3e}; "
            f"tokens {'identical' if torch.equal(tokens, ref_tokens) else 'DIFFER'}: "
            f"{tokens[0].tolist()}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
