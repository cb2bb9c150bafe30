"""Fine-tune a HuggingFace causal LM on packed documents with transformers' Trainer, data x sequence
parallel (ringkv.patch_model + ringkv.trainer.sp_trainer).

    torchrun --standalone --nproc-per-node 4 examples/train_long_context.py --dp 2 --sp 2 \\
        --seq 512 --steps 5 --reference
    # the reference alone, one process
    python examples/train_long_context.py --single --dp 2 --seq 512 --steps 5
    (default model: SmolLM2-135M-Instruct from ringkv.model.smollm2.smollm2_path(); --model DIR
    for another)

Data. The text (default examples/data/coriolanus.txt, public domain; lines starting with '#'
at its top are a header) is cut at blank lines into documents (one speech each), each tokenized
and ended with the EOS token. The documents are packed, in order and cycling over the text
when it runs out, into rows of exactly --seq tokens: a document that does not fit in what is
left of a row is split, its head ends the row and its tail starts the next row as a document
of its own. The rows are the Trainer's dataset (one item per row, its document pieces); the data
collator runs transformers' DataCollatorWithFlattening over each row's pieces (input_ids, labels
with -100 at each document's first token, position_ids restarting at 0 per document) and stacks
--batch rows into a (batch, seq) batch. The sampler is sequential, so replica d's micro-batch k
is rows (k * dp + d) * batch ... + batch - 1 (accelerate hands the d-th of every dp consecutive
batches to replica d); the SP ranks of a replica all get the same batch (inputs="full"; ringkv
keeps each rank's shard of every document).

Layout. init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp")), then
ringkv.hf.patch_model(model, group=mesh, mesh_dim="sp"): the ranks of one replica are a row of the
mesh and the model is patched over that row's SP group.

Training. sp_trainer(Trainer)(model=..., args=TrainingArguments(...), sp_mesh=mesh) is a stock
Trainer with ringkv.trainer.SPTrainerMixin in front: its dataloader is sharded over the dp replicas,
not the world; its step, epoch and batch accounting counts dp; and because accelerate wraps the
model in DDP over all dp * sp processes (a MEAN over the world, where ringkv's SP ranks hold shares
of one replica's gradient that must be SUMMED), the loss that backward sees is sp times the one
Trainer computed, while Trainer logs its own. Trainer passes num_items_in_batch (the label tokens of
all replicas' micro-batches of the optimizer step), so the step's gradient is that of the token
mean over everything the step saw, with --ga micro-batches per step as well. AdamW (Trainer's
default optimizer, no weight decay), constant --lr, gradients clipped at --max-grad-norm.

Reference (--reference: rank 0, after the distributed run, starts this script with --single in a
fresh process; or --single alone): the unpatched model, freshly loaded, trained by a plain Trainer
in one process on the same rows with dp * batch rows per micro-batch (the union of the replicas'
micro-batches) and the same --ga: the same optimizer steps. transformers' own attention keeps packed
documents apart from the position_ids. Both runs' logged per-step losses and gradient norms (before
clipping: Adam's update hides a wrong gradient scale, the norm does not) are printed side by side
with the largest differences; the exit code is 1 when a step differs by more than --tol (relative).
fp32.
Gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
            raise SystemExit(
                f"--tokenizer bytes needs a model with vocab_size >= 259 (ids = byte + 3); "
                f"{args.model} has {vocab}"
            )
        return ByteTokenizer()

    path = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"no tokenizer in {path} ({e}); pass --tokenizer DIR, or --tokenizer bytes "
            f"(UTF-8 bytes, for a model with vocab_size >= 259)"
        )


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
    """``DataCollatorWithFlattening`` over each row's pieces; rows stacked to
    ``(len(rows), seq)``."""
    from transformers import DataCollatorWithFlattening

    flatten = DataCollatorWithFlattening()  # input_ids, labels, position_ids: (1, seq) per row
    parts = [flatten([{"input_ids": piece} for piece in row]) for row in rows]
    return {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "position_ids")}


def replica_batch(rows, step, replica, dp, batch, device):
    first = (step * dp + replica) * batch
    return {k: v.to(device) for k, v in collate(rows[first : first + batch]).items()}


# ---- model and training ----


def rows_dataset(rows):
    """The Trainer's dataset: one item per packed row, its document pieces (collate() flattens
    them)."""
    return [{"pieces": row} for row in rows]


def collate_rows(items):
    return collate([item["pieces"] for item in items])


def load_model(args, device):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    return model.to(device).train()


def training_args(args, out_dir, per_device, cuda):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=args.ga,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=args.max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        seed=0,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        ddp_backend="gloo" if dist.is_initialized() and not cuda else None,
    )


def steps_of(trainer):
    """[(loss, grad norm)] of every optimizer step, as Trainer logged them."""
    return [
        (h["loss"], h["grad_norm"])
        for h in trainer.state.log_history
        if "loss" in h and "grad_norm" in h
    ]


def distributed_run(args, rows, device, out_dir):
    """The (dp x sp) run with sp_trainer(Trainer): [(loss, grad norm)] per step (every rank)."""
    import ringkv.hf
    from ringkv.trainer import sp_trainer
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer

    mesh = init_device_mesh(device.type, (args.dp, args.sp), mesh_dim_names=("dp", "sp"))
    model = load_model(args, device)
    ringkv.hf.patch_model(model, group=mesh, mesh_dim="sp", layout=args.layout)
    trainer = sp_trainer(Trainer)(
        model=model,
        args=training_args(args, out_dir, args.batch, device.type == "cuda"),
        train_dataset=rows_dataset(rows),
        data_collator=collate_rows,
        sp_mesh=mesh,
    )
    if dist.get_rank() == 0:
        print(
            f"ringkv: dp={args.dp} x sp={args.sp} ({args.layout}), rows of {args.seq} tokens, "
            f"{args.batch} per replica per micro-batch, {args.ga} micro-batch(es) per step, lr "
            f"{args.lr}, {device}, fp32, model {args.model}",
            flush=True,
        )
    trainer.train()
    return steps_of(trainer)


def reference_run(args, rows, device, out_dir):
    """One process, the unpatched model, a plain Trainer on the same rows (dp * batch per
    micro-batch)."""
    from transformers import Trainer

    model = load_model(args, device)
    print(
        f"reference: unpatched model in one process ({torch.get_num_threads()} threads), "
        f"{args.dp} x {args.batch} rows per micro-batch",
        flush=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args(args, out_dir, args.dp * args.batch, device.type == "cuda"),
        train_dataset=rows_dataset(rows),
        data_collator=collate_rows,
    )
    trainer.train()
    return steps_of(trainer)


def reference_subprocess(args):
    """Run this script with --single in a fresh process (accelerate's state of the distributed run
    is per process): its steps, read back from a JSON file."""
    out = os.path.join(args.output_dir, "reference.json")
    argv = [sys.executable, os.path.abspath(__file__), "--single", "--json", out]
    for name in (
        "model",
        "tokenizer",
        "data",
        "dp",
        "seq",
        "batch",
        "ga",
        "steps",
        "lr",
        "max_grad_norm",
    ):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    env = {
        k: v
        for k, v in os.environ.items()  # not a torchrun worker: accelerate reads these
        if k not in launcher and not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "MASTER_"))
    }
    subprocess.run(argv, env=env, check=True)
    with open(out) as f:
        return [tuple(x) for x in json.load(f)]


def compare(ring, ref, tol) -> bool:
    """Print both runs' losses and gradient norms side by side; True when every step is within
    ``tol``."""
    print(
        f"{'step':>4}  {'ringkv loss':>12}  {'reference':>12}  {'|diff|':>9}  {'relative':>9}   "
        f"{'grad norm':>10}  {'reference':>10}  {'relative':>9}"
    )
    worst_abs = worst_rel = worst_norm = 0.0
    for i, ((a, na), (b, nb)) in enumerate(zip(ring, ref)):
        diff = abs(a - b)
        rel, rel_norm = diff / max(abs(b), 1e-12), abs(na - nb) / max(abs(nb), 1e-12)
        worst_abs, worst_rel, worst_norm = (
            max(worst_abs, diff),
            max(worst_rel, rel),
            max(worst_norm, rel_norm),
        )
        print(
            f"{i + 1:>4}  {a:12.6f}  {b:12.6f}  {diff:9.2e}  {rel:9.2e}   {na:10.6f}  {nb:10.6f}  "
            f"{rel_norm:9.2e}"
        )
    ok = len(ring) == len(ref) and worst_rel <= tol and worst_norm <= tol
    print(
        f"max |loss difference| = {worst_abs:.3e} (relative {worst_rel:.3e}); max relative grad "
        f"norm difference = {worst_norm:.3e}; tolerance {tol:.0e} relative: "
        f"{'OK' if ok else 'EXCEEDED'}",
        flush=True,
    )
    return ok


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", help="HF-format model directory (default: SmolLM2-135M-Instruct, smollm2_path())"
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer directory (default: the model's), or 'bytes' (UTF-8 bytes + 3)",
    )
    p.add_argument("--data", default=DATA, help="a text file; blank lines separate documents")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument(
        "--sp",
        type=int,
        default=None,
        help="sequence-parallel ranks per replica (default world / dp)",
    )
    p.add_argument("--seq", type=int, default=512, help="tokens per packed row")
    p.add_argument("--batch", type=int, default=1, help="packed rows per replica per micro-batch")
    p.add_argument(
        "--ga",
        type=int,
        default=1,
        help="gradient_accumulation_steps: micro-batches per optimizer step",
    )
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (Trainer's max_steps)")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (constant)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument(
        "--reference",
        action="store_true",
        help="after the run, rank 0 runs the unpatched model on the same batches and compares "
        "losses",
    )
    p.add_argument(
        "--single",
        action="store_true",
        help="run only the reference, in this one process (no torchrun)",
    )
    p.add_argument(
        "--json", help="with --single: write the reference's [(loss, grad norm)] per step here"
    )
    p.add_argument(
        "--output-dir",
        default=None,
        help="Trainer's output_dir (nothing is saved; default a temp dir)",
    )
    p.add_argument(
        "--tol", type=float, default=1e-4, help="largest relative loss difference that passes"
    )
    args = p.parse_args()
    for name in ("dp", "seq", "batch", "ga", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.model is None:
        from ringkv.model.smollm2 import smollm2_path

        args.model = smollm2_path()
    if args.output_dir is None:
        import tempfile

        args.output_dir = tempfile.mkdtemp(prefix="train_long_context_")
    import transformers

    transformers.utils.logging.set_verbosity_error()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tok = tokenizer_for(args)
    docs = documents(args.data, tok)
    rows = pack_rows(docs, args.seq, args.steps * args.ga * args.dp * args.batch)

    if args.single:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            p.error("--single runs in one process: start it with python, not torchrun")
        print(
            f"{len(docs)} documents from {os.path.basename(args.data)}; {len(rows)} rows of "
            f"{args.seq} tokens"
        )
        t0 = time.perf_counter()
        ref = reference_run(args, rows, device, os.path.join(args.output_dir, "reference"))
        print(
            f"reference: {time.perf_counter() - t0:.1f} s; load average {load_average()}",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ref, f)
        return 0

    if "WORLD_SIZE" not in os.environ:
        p.error(
            "start the distributed run with torchrun --nproc-per-node DP*SP (or pass --single for "
            "the reference alone)"
        )
    world = int(os.environ["WORLD_SIZE"])
    if args.sp is None and world % args.dp:
        p.error(f"--dp {args.dp} does not divide the world of {world} ranks")
    args.sp = args.sp or world // args.dp
    if args.sp < 1 or args.dp * args.sp != world:
        p.error(
            f"--dp {args.dp} x --sp {args.sp} = {args.dp * args.sp} ranks, but the world has "
            f"{world} (start torchrun --nproc-per-node {max(1, args.dp * args.sp)})"
        )
    if (
        not dist.is_initialized()
    ):  # before patch_model (it needs the groups); accelerate then uses this group
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(
            f"{len(docs)} documents from {os.path.basename(args.data)}; {len(rows)} rows of "
            f"{args.seq} tokens ({sum(len(r) for r in rows)} pieces); load average "
            f"{load_average()}",
            flush=True,
        )
    t0 = time.perf_counter()
    ring = distributed_run(args, rows, device, os.path.join(args.output_dir, "ringkv"))
    seconds = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(
        f"ringkv: {seconds:.1f} s for {args.steps} steps with loading; load average "
        f"{load_average()}",
        flush=True,
    )
    if not args.reference:
        return 0
    t0 = time.perf_counter()
    ref = reference_subprocess(args)
    print(
        f"reference: {time.perf_counter() - t0:.1f} s with loading; load average {load_average()}",
        flush=True,
    )
    return 0 if compare(ring, ref, args.tol) else 1


if __name__ == "__main__":
    sys.exit(main())
