"""Fine-tune a HuggingFace causal LM on packed documents, data x sequence parallel (ringkv.patch_model).

    torchrun --standalone --nproc-per-node 4 examples/train_long_context.py --dp 2 --sp 2 --seq 512 --steps 5 \
        --reference
    python examples/train_long_context.py --single --dp 2 --seq 512 --steps 5   # the reference alone, one process
    (default model: SmolLM2-135M-Instruct from ringkv.model.smollm2.smollm2_path(); --model DIR for another)

Data. The text (default examples/data/coriolanus.txt, public domain; lines starting with '#'
at its top are a header) is cut at blank lines into documents (one speech each), each tokenized
and ended with the EOS token. The documents are packed, in order and cycling over the text
when it runs out, into rows of exactly --seq tokens: a document that does not fit in what is
left of a row is split, its head ends the row and its tail starts the next row as a document
of its own. Each row's pieces go through transformers' DataCollatorWithFlattening (input_ids,
labels with -100 at each document's first token, position_ids restarting at 0 per document),
and --batch rows stack into a (batch, seq) batch. Replica d of step s takes rows
(s * dp + d) * batch ... + batch - 1: every replica has its own batches, and the SP ranks of a
replica all pass the same one (inputs="full"; ringkv keeps each rank's shard of every document).

Layout. init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp")): the ranks of one
replica are a row of the mesh, mesh["sp"].get_group() is that replica's SP group, and the model
is patched with ringkv.patch_model(model, group=sp_group).

Gradients. The SP ranks of a replica hold shares of one loss (the replica's mean over its
counted labels): their gradients SUM to the replica's gradient. The replicas hold different
batches: their gradients AVERAGE. Both are sums over the (dp, sp) grid, so after backward()
one all-reduce (SUM) of each gradient over the whole world, divided by dp, gives on every
rank the gradient of mean_d(loss_d), the mean of the replicas' mean losses. (DDP over the dp
group alone would average over replicas and still need the SP sum; DDP over the whole world
averages over dp * sp and needs the loss multiplied by sp; tests/test_hf_dp.py checks both.
The explicit all-reduce needs neither a wrapper nor a scaled loss.) AdamW then steps with the
same gradients on every rank, so the weights stay identical.

Why not transformers' Trainer. Given the patched model, a DataCollatorWithFlattening and the
mesh's groups, Trainer (through accelerate) treats every process as a data-parallel worker of
its own: its DataLoader hands the 4 ranks 4 different batches, and the first forward fails on
every rank with
    ValueError: ringkv.patch_model: rank 0 disagrees with rank 1 on sequence length, input
    tokens, packed documents; every rank of the SP group must make the same call (same batch,
    sequence length, phase and tokens)
(checked with transformers 5.24, accelerate 1.15, torchrun 4 ranks, dp=2 x sp=2). It also wraps
the model in DDP over the whole world, averaging gradients over dp * sp ranks. accelerate's own
ParallelismConfig does not take ringkv's group: cp_size needs FSDP2 and SDPA attention and
shards the inputs itself, sp_size means DeepSpeed Ulysses. Trainer can be bent to it with a
subclass (get_train_dataloader returning each replica's batches, compute_loss returning
loss * sp for its world-wide DDP; that ran), but then it logs sp times the loss and the
reference would have to mirror its optimizer, scheduler and clipping. So this is a plain loop.

Reference (--reference on rank 0 after the distributed run, or --single alone): the unpatched
model, freshly loaded, in one process, steps over the same batches: for each step, each
replica's batch forward, loss / dp backward (the gradient of the mean of the replica means:
exactly what the distributed run optimizes), one AdamW step. transformers' own attention keeps
packed documents apart from the position_ids. Both runs' per-step losses and gradient norms
(after the reduction, before the step: Adam's update hides a wrong gradient scale, the norm does
not) are printed side by side with the maximum differences; the exit code is 1 when a step
differs by more than --tol (relative). fp32. Gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "coriolanus.txt")


# ---- data: documents, packed rows, batches ----

class ByteTokenizer:
    """UTF-8 bytes as token ids (byte + 3; 0 pad, 1 bos, 2 eos) for models without a tokenizer."""
    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [b + 3 for b in text.encode("utf-8")]}


def tokenizer_for(args):
    from transformers import AutoConfig, AutoTokenizer

    if args.tokenizer == "bytes":
        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        if vocab < 259:
            raise SystemExit(f"--tokenizer bytes needs a model with vocab_size >= 259 (ids = byte + 3); "
                             f"{args.model} has {vocab}")
        return ByteTokenizer()

    path = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"no tokenizer in {path} ({e}); pass --tokenizer DIR, or --tokenizer bytes "
                         f"(UTF-8 bytes, for a model with vocab_size >= 259)")


def documents(path, tok):
    """The text's paragraphs (split at blank lines), each tokenized and ended with EOS."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    while lines and lines[0].startswith("#"):  # the header
        lines.pop(0)
    paragraphs = [p.strip() for p in "\n".join(lines).split("\n\n") if p.strip()]
    if not paragraphs:
        raise SystemExit(f"{path} has no text (documents are separated by blank lines)")
    eos = tok.eos_token_id
    return [tok(p)["input_ids"] + ([] if eos is None else [eos]) for p in paragraphs]


def pack_rows(docs, seq, n_rows):
    """``n_rows`` rows of exactly ``seq`` tokens, each a list of document pieces (a document that
    does not fit is split: its tail starts the next row); cycles over ``docs`` as needed."""
    rows, row, room, i, tail = [], [], seq, 0, None
    while len(rows) < n_rows:
        doc = tail if tail is not None else docs[i % len(docs)]
        if tail is None:
            i += 1
        take = min(room, len(doc))
        row.append(doc[:take])
        tail = doc[take:] or None
        room -= take
        if room == 0:
            rows.append(row)
            row, room = [], seq
    return rows


def collate(rows):
    """``DataCollatorWithFlattening`` over each row's pieces; rows stacked to ``(len(rows), seq)``."""
    from transformers import DataCollatorWithFlattening

    flatten = DataCollatorWithFlattening()  # input_ids, labels, position_ids: (1, seq) per row
    parts = [flatten([{"input_ids": piece} for piece in row]) for row in rows]
    return {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "position_ids")}


def replica_batch(rows, step, replica, dp, batch, device):
    first = (step * dp + replica) * batch
    return {k: v.to(device) for k, v in collate(rows[first:first + batch]).items()}


# ---- model and training ----

def load_model(args, device):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    return model.to(device).train()


def optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


def grad_norm(model) -> float:
    """The L2 norm of all gradients (Adam would hide a wrong gradient scale; this shows it)."""
    return torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                 if p.grad is not None])).item()


def reduce_gradients(model, dp):
    """SUM over the SP ranks of a replica, MEAN over the replicas: one world all-reduce (SUM) / dp."""
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters() if p.grad is not None]
    for w in works:
        w.wait()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(dp)


def distributed_run(args, rows, device):
    """The (dp x sp) run: returns [(mean loss, [replica losses], grad norm, seconds)] per step (every rank)."""
    import ringkv.hf
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (args.dp, args.sp), mesh_dim_names=("dp", "sp"))
    rank, dp_rank, sp_rank = dist.get_rank(), mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
    model = load_model(args, device)
    ringkv.hf.patch_model(model, group=mesh["sp"].get_group(), layout=args.layout)
    opt = optimizer(model, args)
    if rank == 0:
        print(f"ringkv: dp={args.dp} x sp={args.sp} ({args.layout}), rows of {args.seq} tokens, {args.batch} per "
              f"replica per step, lr {args.lr}, {device}, fp32, model {args.model}", flush=True)
    out = []
    for step in range(args.steps):
        batch = replica_batch(rows, step, dp_rank, args.dp, args.batch, device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss  # this replica's mean loss, the same on its SP ranks
        loss.backward()                               # collective over the SP group (ring attention)
        reduce_gradients(model, args.dp)
        norm = grad_norm(model)                       # the same on every rank now
        opt.step()
        losses = torch.zeros(args.dp, dtype=torch.float64, device=device)
        if sp_rank == 0:
            losses[dp_rank] = loss.detach().double()
        dist.all_reduce(losses)                       # every replica's loss, on every rank
        seconds = time.perf_counter() - t0
        replicas = losses.tolist()
        out.append((sum(replicas) / args.dp, replicas, norm, seconds))
        if rank == 0:
            print(f"  step {step + 1}/{args.steps}: loss {out[-1][0]:.6f} (replicas "
                  f"{', '.join(f'{x:.6f}' for x in replicas)}), grad norm {norm:.6f}  {seconds:.1f} s", flush=True)
    del model, opt
    gc.collect()
    return out


def reference_run(args, rows, device):
    """One process, the unpatched model, the same batches and optimizer: [(mean loss, [replica losses],
    grad norm, seconds)] per step."""
    model = load_model(args, device)
    opt = optimizer(model, args)
    print(f"reference: unpatched model in one process ({torch.get_num_threads()} threads), "
          f"{args.dp} replica batches per step", flush=True)
    out = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        replicas = []
        for d in range(args.dp):
            loss = model(**replica_batch(rows, step, d, args.dp, args.batch, device), use_cache=False).loss
            (loss / args.dp).backward()               # grad of the mean of the replicas' mean losses
            replicas.append(loss.item())
        norm = grad_norm(model)
        opt.step()
        seconds = time.perf_counter() - t0
        out.append((sum(replicas) / args.dp, replicas, norm, seconds))
        print(f"  step {step + 1}/{args.steps}: loss {out[-1][0]:.6f} (replicas "
              f"{', '.join(f'{x:.6f}' for x in replicas)}), grad norm {norm:.6f}  {seconds:.1f} s", flush=True)
    return out


def compare(ring, ref, tol) -> bool:
    """Print both runs' losses and gradient norms side by side; True when every step is within ``tol``."""
    print(f"{'step':>4}  {'ringkv loss':>12}  {'reference':>12}  {'|diff|':>9}  {'relative':>9}   "
          f"{'grad norm':>10}  {'reference':>10}  {'relative':>9}")
    worst_abs = worst_rel = worst_norm = 0.0
    for i, ((a, _, na, _), (b, _, nb, _)) in enumerate(zip(ring, ref)):
        diff = abs(a - b)
        rel, rel_norm = diff / max(abs(b), 1e-12), abs(na - nb) / max(abs(nb), 1e-12)
        worst_abs, worst_rel, worst_norm = max(worst_abs, diff), max(worst_rel, rel), max(worst_norm, rel_norm)
        print(f"{i + 1:>4}  {a:12.6f}  {b:12.6f}  {diff:9.2e}  {rel:9.2e}   {na:10.6f}  {nb:10.6f}  {rel_norm:9.2e}")
    ok = worst_rel <= tol and worst_norm <= tol
    print(f"max |loss difference| = {worst_abs:.3e} (relative {worst_rel:.3e}); max relative grad norm "
          f"difference = {worst_norm:.3e}; tolerance {tol:.0e} relative: {'OK' if ok else 'EXCEEDED'}", flush=True)
    return ok


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-format model directory (default: SmolLM2-135M-Instruct, smollm2_path())")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's), or 'bytes' (UTF-8 bytes + 3)")
    p.add_argument("--data", default=DATA, help="a text file; blank lines separate documents")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel ranks per replica (default world / dp)")
    p.add_argument("--seq", type=int, default=512, help="tokens per packed row")
    p.add_argument("--batch", type=int, default=1, help="packed rows per replica per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--reference", action="store_true",
                   help="after the run, rank 0 runs the unpatched model on the same batches and compares losses")
    p.add_argument("--single", action="store_true", help="run only the reference, in this one process (no torchrun)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference that passes")
    args = p.parse_args()
    for name in ("dp", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.model is None:
        from ringkv.model.smollm2 import smollm2_path

        args.model = smollm2_path()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tok = tokenizer_for(args)
    docs = documents(args.data, tok)
    rows = pack_rows(docs, args.seq, args.steps * args.dp * args.batch)

    if args.single:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            p.error("--single runs in one process: start it with python, not torchrun")
        print(f"{len(docs)} documents from {os.path.basename(args.data)}; {len(rows)} rows of {args.seq} tokens")
        t0 = time.perf_counter()
        reference_run(args, rows, device)
        print(f"reference: {time.perf_counter() - t0:.1f} s; load average {load_average()}")
        return 0

    if "WORLD_SIZE" not in os.environ:
        p.error("start the distributed run with torchrun --nproc-per-node DP*SP (or pass --single for the "
                "reference alone)")
    world = int(os.environ["WORLD_SIZE"])
    if args.sp is None and world % args.dp:
        p.error(f"--dp {args.dp} does not divide the world of {world} ranks")
    args.sp = args.sp or world // args.dp
    if args.sp < 1 or args.dp * args.sp != world:
        p.error(f"--dp {args.dp} x --sp {args.sp} = {args.dp * args.sp} ranks, but the world has {world} "
                f"(start torchrun --nproc-per-node {max(1, args.dp * args.sp)})")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_rank() == 0:
        print(f"{len(docs)} documents from {os.path.basename(args.data)}; {len(rows)} rows of {args.seq} tokens "
              f"({sum(len(r) for r in rows)} pieces); load average {load_average()}", flush=True)
    t0 = time.perf_counter()
    ring = distributed_run(args, rows, device)
    seconds = time.perf_counter() - t0
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"ringkv: {sum(r[-1] for r in ring):.1f} s in {args.steps} steps ({seconds:.1f} s with loading); "
          f"load average {load_average()}", flush=True)
    if not args.reference:
        return 0
    if not cuda:  # the other ranks are gone: the reference may use every core
        torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    ref = reference_run(args, rows, device)
    print(f"reference: {sum(r[-1] for r in ref):.1f} s in {args.steps} steps ({time.perf_counter() - t0:.1f} s "
          f"with loading); load average {load_average()}")
    return 0 if compare(ring, ref, args.tol) else 1


if __name__ == "__main__":
    sys.exit(main())
