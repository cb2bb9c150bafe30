"""Train an embedding model with a contrastive (InfoNCE) loss over pooled outputs of query/passage
pairs at long length, data x sequence parallel (ringkv.patch_model on a bidirectional model).

    torchrun --standalone --nproc-per-node 4 examples/train_embedding.py --dp 2 --sp 2 \\
        --seq 4096 --steps 5 --reference
    # a real encoder (local files only), e.g. ModernBERT or a sentence-embedding Llama/Qwen2
    torchrun --standalone --nproc-per-node 2 examples/train_embedding.py --sp 2 \\
        --model /path/to/ModernBERT-base --seq 8192 --pooling mean

Model. By default a tiny random ModernBERT (hidden 64, 2 layers, a local window of 16 tokens on
every other layer, vocab 1000), the same on every rank (seeded); --model DIR loads a local
checkpoint's base model (AutoModel: ModernBERT, BERT, RoBERTa, XLM-R, or a decoder run
bidirectionally with --bidirectional: is_causal=False in its config and attention layers). fp32.

Data. Synthetic pairs, the same on every run for a seed: a query of random tokens and its
passage (the query's tokens in another order, three quarters of them replaced), each right-padded
to --seq tokens with random lengths in [--seq / 2, --seq]. Replica d of --dp draws its own batch
of every step (seeded by step and d); the SP ranks of a replica get the same batch
(inputs="full": ringkv keeps each rank's shard, and the pads become documents of their own that
no real token sees).

Step. model(ids, attention_mask=mask, pooling=--pooling).pooled is the (B, H) pooled embedding of
the whole rows on every rank of the SP group (a masked sum all-reduced over the group); the loss is
InfoNCE over the replica's batch: cross-entropy of cos(query_i, passage_j) / --temperature against
j = i. Every SP rank computes it alike; the gradient each rank gets is its tokens' share, so the
gradients are SUMMED over the SP group and AVERAGED over the dp replicas (one all-reduce over the
world, divided by dp). AdamW, constant --lr.

Reference (--reference): rank 0 then trains the unpatched model in one process on the same pairs
(each replica's batch in turn, their gradients averaged), and the per-step losses are printed
side by side; the exit code is 1 when a step differs by more than --tol (relative). Gloo on CPU,
NCCL on GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a local checkpoint (default: tiny random)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", type=int, default=None, help="default: the world / dp")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="pairs per replica and step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--pooling", default="mean", choices=("mean", "cls", "last"))
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bidirectional",
        action="store_true",
        help="--model is a decoder: run it bidirectionally (is_causal=False in its config and "
        "attention layers, as sentence-embedding decoders do)",
    )
    p.add_argument("--reference", action="store_true")
    p.add_argument("--tol", type=float, default=1e-4)
    return p.parse_args(argv)


def build(args):
    import transformers

    torch.manual_seed(args.seed)
    if args.model:
        model = transformers.AutoModel.from_pretrained(args.model, dtype=torch.float32)
        if args.bidirectional:
            model.config.is_causal = False
            for m in model.modules():
                if hasattr(m, "is_causal"):
                    m.is_causal = False
        return model
    config = transformers.ModernBertConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        local_attention=16,
        global_attn_every_n_layers=2,
        max_position_embeddings=max(args.seq, 128),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        attention_dropout=0.0,
        embedding_dropout=0.0,
        mlp_dropout=0.0,
    )
    return transformers.AutoModel.from_config(config, dtype=torch.float32)


def pairs(args, step: int, replica: int, vocab: int, pad: int):
    """One replica's batch of a step: query and passage ``(ids, mask)``, each ``(batch, seq)``."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step * 1009 + replica)
    b, s = args.batch, args.seq

    def row(tokens):
        n = tokens.numel()
        return F.pad(tokens, (0, s - n), value=pad), F.pad(
            torch.ones(n, dtype=torch.long), (0, s - n)
        )

    q, p = [], []
    for _ in range(b):
        n = int(torch.randint(s // 2, s + 1, (1,), generator=g))
        query = torch.randint(3, vocab, (n,), generator=g)
        passage = query[torch.randperm(n, generator=g)]
        noise = torch.rand(n, generator=g) < 0.75
        passage = torch.where(noise, torch.randint(3, vocab, (n,), generator=g), passage)
        q.append(row(query))
        p.append(row(passage))
    stack = lambda rows: tuple(torch.stack(x) for x in zip(*rows))  # noqa: E731
    return stack(q), stack(p)


def info_nce(model, query, passage, args, patched: bool):
    """InfoNCE of a batch: cross-entropy of the cosine similarities / temperature, pair i the
    positive of query i."""

    def embed(ids, mask):
        if patched:
            return model(ids, attention_mask=mask, pooling=args.pooling).pooled  # (B, H)
        h = model(ids, attention_mask=mask).last_hidden_state  # (B, S, H): the reference
        m = mask.to(h.dtype)
        if args.pooling == "mean":
            return (h * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        if args.pooling == "cls":
            return h[:, 0]
        return h[torch.arange(h.shape[0]), mask.sum(1) - 1]

    q = F.normalize(embed(*query), dim=-1)
    p = F.normalize(embed(*passage), dim=-1)
    logits = q @ p.T / args.temperature  # (B, B)
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device))


def train(args, rank: int, dp: int, sp: int):
    """The patched run: per-step losses of replica 0."""
    from torch.distributed.device_mesh import init_device_mesh

    from ringkv import hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))
    model = build(args).to(device)
    hf.patch_model(model, group=mesh, mesh_dim="sp", layout=args.layout).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    replica = mesh.get_local_rank("dp")
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    losses = []
    for step in range(args.steps):
        query, passage = pairs(args, step, replica, vocab, pad)
        query, passage = [tuple(t.to(device) for t in x) for x in (query, passage)]
        loss = info_nce(model, query, passage, args, patched=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for prm in model.parameters():  # SP shares summed, dp replicas averaged
            if prm.grad is not None:
                dist.all_reduce(prm.grad)
                prm.grad /= dp
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a replica has its loss: the mean over replicas
        losses.append(mean.item() / (dp * sp))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    return losses


def reference(args, dp: int):
    """The unpatched model in one process on the same pairs: per-step losses (the replicas'
    mean)."""
    model = build(args).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for replica in range(dp):
            query, passage = pairs(args, step, replica, vocab, pad)
            loss = info_nce(model, query, passage, args, patched=False)
            (loss / dp).backward()
            total += loss.item() / dp
        opt.step()
        losses.append(total)
    return losses


def main(argv=None) -> int:
    args = parse(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = args.sp or world // args.dp
    if args.dp * sp != world:
        raise ValueError(f"--dp {args.dp} x --sp {sp} must be the world size {world}")
    losses = train(args, rank, args.dp, sp)
    code = 0
    if args.reference and rank == 0:
        want = reference(args, args.dp)
        print(f"{'step':>6} {'ringkv':>12} {'reference':>12} {'rel':>10}")
        for i, (a, b) in enumerate(zip(losses, want)):
            rel = abs(a - b) / max(abs(b), 1e-12)
            print(f"{i:>6} {a:>12.6f} {b:>12.6f} {rel:>10.2e}")
            code |= int(rel > args.tol)
        print("MATCH" if code == 0 else "MISMATCH", flush=True)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
