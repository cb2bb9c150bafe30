"""Peak memory per rank of one training step (forward + backward) of a model patched by
``ringkv.patch_model``, against the sequence length, with and without activation checkpointing.

    torchrun --nproc-per-node 2 benchmarks/train_memory.py --model tiny-long \\
        --seq 2048 4096 8192 16384 32768 --json results/train_memory.json

Every rank loads the same model (a preset of ``benchmarks/models.py``, or an HF directory) and
patches it over the whole world (zigzag, ``inputs="full"``); each point is one
``model(ids, labels=ids, use_cache=False).loss.backward()`` after a warm-up step, with the
gradients freed before it. Then rank 0 alone measures the same model **unpatched** (the
baseline, one process, the whole sequence) at the lengths up to ``--baseline-max``, while the
other ranks wait.

What is measured (per rank, per step):

- ``alloc``: the peak of the bytes the step holds through torch's allocator above what was
  held when it began: on CUDA ``max_memory_allocated`` after ``reset_peak_memory_stats``; on
  CPU, where torch keeps no allocator statistics, the profiler's memory events
  (``torch.profiler.profile(profile_memory=True)``: every CPU allocation and free, with the
  running total, kernels' internal buffers included) give the same number. Weights, inputs and
  anything held before the step are excluded; the gradients the step creates are included.
- ``rss``: (CPU, Linux) the rise of the process's resident-set high-water mark during the step
  (``VmHWM`` after resetting it with ``/proc/self/clear_refs``), with glibc's mmap threshold
  fixed at 128 KiB (``mallopt``) so that freed tensors return to the OS. It counts everything
  the process touched (gloo buffers, the profiler's own records, allocator slack), so it
  corroborates ``alloc`` from above.

The table gives both per rank (the maximum over ranks), ``S/N`` (tokens per rank), and a
least-squares fit ``alloc = a + b * S/N`` per configuration with its worst relative residual:
activation memory grows linearly in ``S/N``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # the checkout first, benchmarks/ never: its modules would shadow installed packages (HF's `kernels`)

from benchmarks.models import describe, load_average, machine, machine_line, model_path, write_json  # noqa: E402

MIB = 2 ** 20


def _fix_malloc() -> bool:
    """Large frees go back to the OS at once (a fixed mmap threshold stops glibc from raising it)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except OSError:
        return False


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _profiled_peak(prof) -> int:
    """Peak CPU bytes allocated through torch during a profile, above what was allocated when it began."""
    from torch._C._profiler import _EventType

    start, peak, first = 0, 0, True

    def walk(nodes):
        nonlocal start, peak, first
        for n in nodes:
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                total = n.extra_fields.total_allocated
                if first:  # the running total before the first event
                    start, peak, first = total - n.extra_fields.alloc_size, total, False
                peak = max(peak, total)
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return peak - start


def step_memory(model, ids, device) -> dict:
    """One forward + backward with labels; ``alloc`` and (CPU) ``rss`` peaks in bytes, seconds."""
    import torch

    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        model(ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
        return dict(alloc=torch.cuda.max_memory_allocated(device) - base, rss=None, seconds=seconds)
    from torch.profiler import ProfilerActivity, profile

    rss0 = _status_kib("VmRSS")
    hwm = _reset_hwm()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(ids, labels=ids, use_cache=False).loss.backward()
    seconds = time.perf_counter() - t
    rss = (_status_kib("VmHWM") - rss0) * 1024 if hwm else None
    return dict(alloc=_profiled_peak(prof), rss=rss, seconds=seconds)


def fit(xs, ys):
    """Least squares ``y = a + b x``; returns a, b and the worst |residual| / y."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return dict(a=a, b=b, worst=max(abs(a + b * x - y) / y for x, y in zip(xs, ys)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-long", help="a preset of benchmarks/models.py or an HF directory")
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--checkpointing", default="both", choices=["off", "on", "both"])
    ap.add_argument("--baseline-max", type=int, default=None,
                    help="longest sequence of the unpatched one-process baseline (default: all; 0: none)")
    ap.add_argument("--warmup", type=int, default=256, help="tokens of the warm-up step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    malloc_fixed = _fix_malloc()
    import torch
    import torch.distributed as dist
    import transformers

    import ringkv.hf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    load = load_average()
    if rank == 0:
        model_path(args.model)  # a preset's directory is written once, by rank 0
    dist.barrier()
    path = model_path(args.model)

    def load_model():
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m = m.to(device).train()
        with torch.no_grad():  # touch every weight (safetensors may be memory-mapped) before measuring
            for p in m.parameters():
                p.add_(0)
        return m

    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids_of(s):
        return torch.randint(3, vocab, (1, s), generator=gen).to(device)

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]

    def run_points(model, label, seqs, n):
        rows = []
        for ckpt in modes:
            on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            (on if ckpt else off)()  # transformers 5 names; gradient_checkpointing_* before
            step_memory(model, ids_of(args.warmup), device)  # warm-up: one-time buffers and probes
            for s in seqs:
                r = step_memory(model, ids_of(s), device)
                rows.append(dict(run=label, ranks=n, checkpointing=ckpt, seq=s, tokens_per_rank=-(-s // n), **r))
        return rows

    model = ringkv.hf.patch_model(load_model(), sp=world, layout=args.layout)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # per rank, outside `alloc`
    mine = run_points(model, "patched", args.seq, world)
    ringkv.hf.unpatch_model(model)
    del model
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    rows = []
    for i, r in enumerate(gathered[0]):  # per point: the largest rank
        per_rank = [g[i] for g in gathered]
        rows.append(dict(r, alloc=max(p["alloc"] for p in per_rank),
                         rss=None if r["rss"] is None else max(p["rss"] for p in per_rank),
                         seconds=max(p["seconds"] for p in per_rank),
                         alloc_per_rank=[p["alloc"] for p in per_rank],
                         rss_per_rank=[p["rss"] for p in per_rank]))
    limit = max(args.seq) if args.baseline_max is None else args.baseline_max
    base_seqs = [s for s in args.seq if s <= limit]
    if rank == 0 and base_seqs:
        gc.collect()
        rows += [dict(r, alloc_per_rank=[r["alloc"]], rss_per_rank=[r["rss"]])
                 for r in run_points(load_model(), "unpatched", base_seqs, 1)]
    dist.barrier()

    if rank == 0:
        mach = machine()  # rank 0's threads (torchrun's default: OMP_NUM_THREADS=1 per rank)
        print(machine_line(mach) + " per rank")
        dev = torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"
        print(f"train-step memory: {describe(args.model)}, fp32, layout {args.layout}, N={world} ranks on {dev}; "
              f"load {load}; weights {weights / MIB:.1f} MiB per rank (held before the step); "
              f"alloc = torch allocator peak above the step's start"
              + ("" if cuda else f" (profiler memory events); rss = VmHWM rise (mmap threshold fixed: "
                                 f"{malloc_fixed})"))
        print("| run | N | checkpointing | S | S/N | alloc per rank (MiB) | rss per rank (MiB) | step s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            rss = "-" if r["rss"] is None else f"{r['rss'] / MIB:.0f}"
            print(f"| {r['run']} | {r['ranks']} | {'on' if r['checkpointing'] else 'off'} | {r['seq']} | "
                  f"{r['tokens_per_rank']} | {r['alloc'] / MIB:.1f} | {rss} | {r['seconds']:.1f} |")
        fits = {}
        print("\nlinear fit alloc = a + b * (S/N), per run and checkpointing:")
        for run in ("patched", "unpatched"):
            for ckpt in modes:
                pts = [r for r in rows if r["run"] == run and r["checkpointing"] == ckpt]
                f = fit([r["tokens_per_rank"] for r in pts], [r["alloc"] for r in pts])
                if f:
                    key = f"{run}/{'ckpt' if ckpt else 'no-ckpt'}"
                    fits[key] = f
                    print(f"  {key}: a = {f['a'] / MIB:.1f} MiB, b = {f['b'] / 1024:.2f} KiB per token per rank, "
                          f"worst residual {100 * f['worst']:.1f}%")
        if args.json:
            write_json(args.json, dict(args=vars(args), world=world, device=dev, load=load, weight_bytes=weights,
                                       malloc_fixed=malloc_fixed, rows=rows, fits=fits, machine=mach))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
