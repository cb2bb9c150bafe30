"""Peak memory per rank, and time, of one training step (forward + backward) of a causal LM patched
by ``ringkv.patch_model``, per configuration, against the tokens per rank (S/N).

    # memory: every configuration at S/N = 2K..32K (points that would not fit are skipped and said
    # so)
    torchrun --standalone --nproc-per-node 2 benchmarks/train_memory.py --model smollm2-shape-2l \\
        --per-rank 2048 4096 8192 16384 32768 --json results/train_memory_2l.json
    # throughput: patched at sp=N (N ranks x 1 thread) against the unpatched model in one process
    # with N threads, at S = 8K and 16K tokens in all
    torchrun --standalone --nproc-per-node 2 benchmarks/train_memory.py --model smollm2-shape-2l \\
        --throughput --seq 8192 16384 --json results/train_tput_2l.json
    # the goals, across runs (vocabulary, depth, 8 GiB, speed): no torchrun
    python benchmarks/train_memory.py \\
        --summarize results/train_memory_*.json results/train_tput_*.json

Configurations (``--configs``; each builds a fresh model, the same random weights on every rank):

- ``unpatched``: the plain HF model in one process (rank 0 alone, the other ranks wait) with the
  whole S/N tokens: ``model(ids, labels=ids, use_cache=False).loss.backward()``.
- ``unpatched+ckpt``: the same with HF's activation checkpointing (the fair partner of
  ``chunked+ckpt`` for time).
- ``logits``: ``patch_model(model, keep_logits=True)``: every rank builds its shard's full fp32
  logits and the loss from them (ringkv before the chunked loss).
- ``chunked``: ``patch_model(model)`` in training mode with labels: the loss is computed from the
  hidden states in chunks of ``loss_chunk`` tokens; the logits are never built (``out.logits``
  is None, checked at the warm-up step).
- ``chunked+ckpt``: that with ``model.activation_checkpointing_enable()`` (HF's; transformers 5,
  ``gradient_checkpointing_enable`` before).
- ``chunked+ckpt+tiled``: that with ``patch_model(..., tile_mlp=True)`` (the MLP in sequence tiles).

A configuration whose option this ringkv lacks (``keep_logits``, ``tile_mlp``) is reported as
not available. Patched runs shard the whole sequence over the world (zigzag, ``inputs="full"``).

Memory (per rank, per step, default mode):

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

Before its points each configuration runs a warm-up step and two small profiled calibration
steps (``--calib`` and twice that tokens per rank). A point is **skipped** (and listed with its
reason) when the line through the two largest points measured so far puts the processes'
resident memory together (every rank's current RSS plus the active ranks' estimated step peak)
above ``--mem-limit`` GiB or above 90% of the machine's available memory, or when the step's
time, extrapolated from the last two points as ``p x + q x^2``, exceeds ``--max-step-seconds``.
The first point's estimate comes from the calibration steps alone and can be several times
low (at a few hundred tokens a constant part dominates the peak: 351 MiB estimated, 1341 MiB
measured for the 2-layer SmolLM2 shape at 2K tokens): make the first point small, or pass
``--memory-json`` with an earlier memory run of the model (``--throughput`` runs should).

The table gives ``alloc`` and ``rss`` per rank (the maximum over ranks) per point, and a
least-squares fit ``alloc = a + b * S/N`` per configuration with its worst relative residual:
``b`` is the bytes per token per rank, ``a`` the constant (gradients, one loss chunk). From
the fit: the longest S/N whose weights + step peak fit in ``--fit-budget`` GiB per rank
(also with AdamW's two moment tensors held: 3 x weights).

``--throughput``: each configuration runs one warm-up step at each S and then ``--iters`` timed
steps (no profiler); tokens/s = S / median step time. Patched ranks run 1 thread each;
``unpatched*`` runs in rank 0 alone with ``--baseline-threads`` threads (default: the world
size, the cores the N ranks use; memory runs use them too, which changes only their time). The time
is forward + backward only (no optimizer step: its cost is per parameter, the same in every
configuration).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import inspect
import json
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import describe, load_average, machine, machine_line, model_path, write_json  # noqa: E402

MIB = 2**20
GIB = 2**30
CONFIGS = ("unpatched", "unpatched+ckpt", "logits", "chunked", "chunked+ckpt", "chunked+ckpt+tiled")
MEMORY_CONFIGS = ("unpatched", "logits", "chunked", "chunked+ckpt", "chunked+ckpt+tiled")
THROUGHPUT_CONFIGS = ("unpatched", "unpatched+ckpt", "logits", "chunked+ckpt", "chunked+ckpt+tiled")


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _fix_malloc() -> bool:
    """Large frees go back to the OS at once (a fixed mmap threshold stops glibc from raising
    it)."""
    from ringkv.parallel.worker import M_MMAP_THRESHOLD, mallopt

    return mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def _trim() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _profiled_peak(prof) -> int:
    """Peak CPU bytes allocated through torch during a profile, above what was allocated when it
    began."""
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


def _step(model, ids) -> bool:
    """One forward + backward; whether the forward built logits. The output (and its logits) is
    dropped before the backward, as ``model(...).loss.backward()`` and HF's Trainer drop it."""
    out = model(ids, labels=ids, use_cache=False)
    built, loss = out.logits is not None, out.loss
    del out
    loss.backward()
    return built


def step_memory(model, ids, device) -> dict:
    """One forward + backward with labels; ``alloc`` and (CPU) ``rss`` peaks in bytes, seconds."""
    import torch

    model.zero_grad(set_to_none=True)
    _trim()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        _step(model, ids)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
        return dict(alloc=torch.cuda.max_memory_allocated(device) - base, rss=None, seconds=seconds)
    from torch.profiler import ProfilerActivity, profile

    rss0 = _status_kib("VmRSS")
    hwm = _reset_hwm()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, ids)
    seconds = time.perf_counter() - t
    rss = (_status_kib("VmHWM") - rss0) * 1024 if hwm else None
    peak = _profiled_peak(prof)
    del prof
    return dict(alloc=peak, rss=rss, seconds=seconds)


def step_time(model, ids, device) -> float:
    import torch

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    _step(model, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def fit(xs, ys):
    """Least squares ``y = a + b x``; returns a, b and the worst |residual| / y."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return dict(a=a, b=b, worst=max(abs(a + b * x - y) / y for x, y in zip(xs, ys)), points=n)


def longest(f: dict, weights: int, budget: float, pts) -> dict:
    """The longest S/N whose weights + step peak fit in ``budget`` bytes (also with AdamW's state, 3
    x weights): on the fit ``a + b x``, and on the line through the two largest points (``b_last``:
    the marginal bytes per token there, which a step whose constant part is amortised over S/N has
    above the fit's ``b``)."""

    def x(held):
        return max(0, int((budget - held - f["a"]) / f["b"])) if f["b"] > 0 else None

    out = dict(per_rank=x(weights), per_rank_adamw=x(3 * weights))
    (x0, m0), (x1, m1) = sorted(pts)[-2:]
    b = (m1 - m0) / (x1 - x0)
    out.update(b_last=b, last_two=[x0, x1])
    for key, held in (("per_rank_last", weights), ("per_rank_adamw_last", 3 * weights)):
        out[key] = max(0, int(x1 + (budget - held - m1) / b)) if b > 0 else None
    return out


def _two(points):
    pts = sorted(points)[-2:]
    return pts if len(pts) == 2 and pts[0][0] != pts[1][0] else None


def estimate_alloc(points, x):
    """The step peak at ``x`` on the line through the two largest measured (x, alloc); None when
    unknown."""
    pts = _two(points)
    if pts is None:
        return None
    (x0, m0), (x1, m1) = pts
    return max(m1, m1 + (m1 - m0) / (x1 - x0) * (x - x1))


def estimate_seconds(points, x):
    """The step time at ``x`` from the two largest measured (x, seconds) as ``p x + q x^2`` (p, q >=
    0)."""
    pts = _two(points)
    if pts is None:
        return None
    (x0, t0), (x1, t1) = pts
    q = max(0.0, (t1 / x1 - t0 / x0) / (x1 - x0))
    p = max(0.0, t1 / x1 - q * x1)
    return p * x + q * x * x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="tiny-long", help="a preset of benchmarks/models.py or an HF directory"
    )
    ap.add_argument(
        "--per-rank",
        type=int,
        nargs="+",
        default=[2048, 4096, 8192, 16384, 32768],
        help="memory: the tokens per rank (S/N) of the points; patched runs get S = N x S/N "
        "tokens, unpatched ones S/N tokens in one process",
    )
    ap.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[8192, 16384],
        help="--throughput: the total tokens S of a step (patched: S/N per rank; unpatched: all S)",
    )
    ap.add_argument(
        "--throughput", action="store_true", help="time steps instead of measuring memory"
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        choices=CONFIGS,
        help=f"default: {' '.join(MEMORY_CONFIGS)} (memory), {' '.join(THROUGHPUT_CONFIGS)} "
        "(throughput)",
    )
    ap.add_argument(
        "--limit",
        nargs="+",
        default=[],
        metavar="CONFIG=S_PER_RANK",
        help="run CONFIG only up to this many tokens per rank (a time budget)",
    )
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument(
        "--loss-chunk", type=int, default=None, help="patch_model's loss_chunk (default: ringkv's)"
    )
    ap.add_argument(
        "--mem-limit",
        type=float,
        default=10.0,
        help="GiB: skip a point whose estimated resident memory of all processes together exceeds "
        "it",
    )
    ap.add_argument(
        "--max-step-seconds",
        type=float,
        default=None,
        help="skip a point whose step is estimated to take longer than this",
    )
    ap.add_argument(
        "--fit-budget", type=float, default=8.0, help="GiB per rank for the longest-S/N column"
    )
    ap.add_argument("--warmup", type=int, default=256, help="tokens per rank of the warm-up step")
    ap.add_argument(
        "--calib",
        type=int,
        default=256,
        help="tokens per rank of the first of the two calibration steps (estimates only)",
    )
    ap.add_argument("--iters", type=int, default=2, help="--throughput: timed steps per point")
    ap.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="threads of the unpatched runs (default N)",
    )
    ap.add_argument(
        "--memory-json",
        nargs="+",
        default=[],
        metavar="JSON",
        help="memory runs of this model whose points also estimate each step's peak (the "
        "calibration steps alone underestimate it: at a few hundred tokens a constant dominates "
        "the peak)",
    )
    ap.add_argument(
        "--summarize",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the goals' numbers from earlier runs' JSON files (no torchrun)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    configs = args.configs or (THROUGHPUT_CONFIGS if args.throughput else MEMORY_CONFIGS)
    limits = {}
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in CONFIGS or not value.isdigit():
            ap.error(f"--limit takes CONFIG=S_PER_RANK with CONFIG one of {CONFIGS}, got {item!r}")
        limits[name] = int(value)

    malloc_fixed = _fix_malloc()
    import torch
    import torch.distributed as dist
    import transformers

    import ringkv.hf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    from ringkv.parallel.net import pick_interface

    pick_interface()  # a world across hosts: the interface that reaches the master
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    rank_threads = 1
    base_threads = args.baseline_threads or world
    torch.set_num_threads(rank_threads)
    load = load_average()
    if rank == 0:
        model_path(args.model)  # a preset's directory is written once, by rank 0
    dist.barrier()
    path = model_path(args.model)
    params = inspect.signature(ringkv.hf.patch_model).parameters

    def missing(cfg):
        """Why this ringkv cannot run ``cfg`` (None: it can). Without ``keep_logits`` patch_model
        always builds the logits: ``logits`` is its only patched configuration."""
        if cfg.startswith("chunked") and "keep_logits" not in params:
            return "patch_model has no chunked loss (no keep_logits option) in this ringkv"
        if cfg.endswith("+tiled") and "tile_mlp" not in params:
            return "patch_model has no tile_mlp option in this ringkv"
        return None

    def build(cfg):
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m = m.to(device).train()
        with (
            torch.no_grad()
        ):  # touch every weight (safetensors may be memory-mapped) before measuring
            for p in m.parameters():
                p.add_(0)
        if not cfg.startswith("unpatched"):
            kw = dict(sp=world, layout=args.layout)
            if "keep_logits" in params:
                kw["keep_logits"] = True if cfg == "logits" else None
            if cfg.endswith("+tiled"):
                kw["tile_mlp"] = True
            if args.loss_chunk is not None and cfg.startswith("chunked") and "loss_chunk" in params:
                kw["loss_chunk"] = args.loss_chunk
            ringkv.hf.patch_model(m, **kw)
        on = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        off = (
            getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable
        )
        (on if "+ckpt" in cfg else off)()  # transformers 5 names; gradient_checkpointing_* before
        return m

    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size

    def ids_of(
        s,
    ):  # the same tokens on every rank whatever ran before (rank 0 alone runs the baselines)
        return torch.randint(3, vocab, (1, s), generator=torch.Generator().manual_seed(s)).to(
            device
        )

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    mem_limit = args.mem_limit * GIB
    known = {}  # (config, S/N) -> row; a later file's point replaces an earlier one's
    for p in args.memory_json:
        with open(p) as f:
            known.update({(r["config"], r["tokens_per_rank"]): r for r in json.load(f)["rows"]})
    known_rows = list(known.values())
    rows, skipped, calib, notes, logits_built = [], [], [], {}, {}
    weights = None
    # torch, transformers and ringkv's imports leave ~400k long-lived objects that every full
    # collection of _trim (before each step and configuration) walked again: 0.2-0.4 s each,
    # ~13 of a rank's 28 s in the test's tiny run. Frozen, a collection walks only what the
    # runs create; unfrozen after the runs, or at exit after an error (objects still frozen at
    # exit: nanobind reports leaks).
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    targets = args.seq if args.throughput else args.per_rank
    for cfg in configs:
        why = missing(cfg)
        if why:
            notes[cfg] = why
            if rank == 0:
                print(f"[{cfg}] not run: {why}", flush=True)
            continue
        alone = cfg.startswith("unpatched")
        n = 1 if alone else world
        active = rank == 0 or not alone
        _trim()
        dist.barrier()
        model = build(cfg) if active else None
        if weights is None and active:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
        torch.set_num_threads(base_threads if alone else rank_threads)  # rank 0 alone has the cores
        points = []  # (x per rank, alloc, seconds) of the calibration steps
        if active:
            logits_built[cfg] = _step(
                model, ids_of(args.warmup * n)
            )  # warm-up: one-time buffers and probes
            for c in (args.calib, 2 * args.calib):
                r = step_memory(model, ids_of(c * n), device)
                points.append((c, r["alloc"], r["seconds"]))
        points = [
            tuple(max(p[i] for p in pts) if i else pts[0][0] for i in range(3))
            for pts in zip(*[g for g in gather(points) if g])
        ]  # per point: the largest rank
        calib += [dict(config=cfg, tokens_per_rank=x, alloc=a, seconds=t) for x, a, t in points]
        mem_pts = [
            (x, a) for x, a, _ in points
        ]  # for the estimates: calibration, then the measured points
        known = [(r["tokens_per_rank"], r["alloc"]) for r in known_rows if r["config"] == cfg]
        time_pts = [(x, t) for x, _, t in points]
        for value in targets:
            x = value // n if args.throughput else value
            s = value if args.throughput else value * n
            if cfg in limits and x > limits[cfg]:
                skipped.append(
                    dict(
                        config=cfg, tokens_per_rank=x, seq=s, reason=f"--limit {cfg}={limits[cfg]}"
                    )
                )
                continue
            est, est_s = estimate_alloc(mem_pts, x), estimate_seconds(time_pts, x)
            if known and est is not None:  # the larger of the two lines
                est = max(est, estimate_alloc(known, x) or 0)
            state = gather(dict(rss=_status_kib("VmRSS") * 1024, avail=_available_bytes()))
            resident = sum(g["rss"] for g in state)
            need = None if est is None else resident + (1.05 * est) * (1 if alone else world)
            reason = None
            if need is not None and need > mem_limit:
                reason = (
                    f"estimated {need / GIB:.1f} GiB in all processes (step peak {est / GIB:.2f} "
                    f"GiB per active rank) > --mem-limit {args.mem_limit:g} GiB"
                )
            elif need is not None and need - resident > 0.9 * min(g["avail"] for g in state):
                reason = (
                    f"estimated step peak {est / GIB:.2f} GiB > 90% of the machine's available "
                    "memory"
                )
            elif args.max_step_seconds and est_s is not None and est_s > args.max_step_seconds:
                reason = (
                    f"estimated step {est_s:.0f} s > --max-step-seconds {args.max_step_seconds:g}"
                )
            if reason:
                skipped.append(
                    dict(
                        config=cfg,
                        tokens_per_rank=x,
                        seq=s,
                        reason=reason,
                        estimate=est,
                        estimate_seconds=est_s,
                    )
                )
                if rank == 0:
                    print(f"[{cfg}] S/N {x}: skipped: {reason}", flush=True)
                continue
            if args.throughput:
                res = None
                if active:
                    ids = ids_of(s)
                    if not alone:
                        dist.barrier()
                    warm = step_time(model, ids, device)
                    times = []
                    for _ in range(args.iters):
                        if not alone:
                            dist.barrier()
                        times.append(step_time(model, ids, device))
                    res = dict(warmup_seconds=warm, times=times)
                got = [g for g in gather(res) if g]
                times = [
                    max(ts) for ts in zip(*[g["times"] for g in got])
                ]  # per step: the slowest rank
                med = statistics.median(times)
                row = dict(
                    config=cfg,
                    ranks=n,
                    threads=base_threads if alone else rank_threads,
                    seq=s,
                    tokens_per_rank=x,
                    seconds=med,
                    times=times,
                    tokens_per_s=s / med,
                    warmup_seconds=max(g["warmup_seconds"] for g in got),
                    estimate=est,
                )
                time_pts = [p for p in time_pts if p[0] != x] + [(x, med)]
            else:
                res = step_memory(model, ids_of(s), device) if active else None
                got = [g for g in gather(res) if g]
                row = dict(
                    config=cfg,
                    ranks=n,
                    seq=s,
                    tokens_per_rank=x,
                    alloc=max(g["alloc"] for g in got),
                    rss=None if got[0]["rss"] is None else max(g["rss"] for g in got),
                    seconds=max(g["seconds"] for g in got),
                    alloc_per_rank=[g["alloc"] for g in got],
                    rss_per_rank=[g["rss"] for g in got],
                    estimate=est,
                )
                mem_pts.append((x, row["alloc"]))
                time_pts.append((x, row["seconds"]))
            rows.append(row)
            if rank == 0:
                extra = (
                    f"{row['tokens_per_s']:.0f} tokens/s ({row['seconds']:.1f} s)"
                    if args.throughput
                    else f"alloc {row['alloc'] / MIB:.1f} MiB (estimate "
                    f"{'-' if est is None else f'{est / MIB:.0f}'}), {row['seconds']:.1f} s"
                )
                print(f"[{cfg}] S/N {x}: {extra}", flush=True)
        del model
        _trim()
    gc.unfreeze()
    weights = max(w or 0 for w in gather(weights))
    load_end = load_average()
    dist.barrier()

    if rank == 0:
        threads = sorted({rank_threads, base_threads}) if args.throughput else rank_threads
        mach = machine(threads=threads)
        print(
            machine_line(mach)
            + (" (patched: 1 per rank; unpatched: one process)" if args.throughput else " per rank")
        )
        dev = torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"
        head = (
            f"{'train-step time' if args.throughput else 'train-step memory'}: "
            f"{describe(args.model)}, fp32, layout {args.layout}, N={world} ranks on {dev}; load "
            f"{load} at the start, {load_end} at the end; weights {weights / MIB:.1f} MiB per rank "
            "(held before the step)"
        )
        if not args.throughput:
            head += "; alloc = torch allocator peak above the step's start" + (
                ""
                if cuda
                else f" (profiler memory events); rss = VmHWM rise (mmap threshold fixed: "
                f"{malloc_fixed})"
            )
        print(head)
        report = dict(
            mode="throughput" if args.throughput else "memory",
            args=vars(args),
            model=args.model,
            model_desc=describe(args.model),
            vocab=vocab,
            world=world,
            device=dev,
            load=load,
            load_end=load_end,
            weight_bytes=weights,
            malloc_fixed=malloc_fixed,
            configs=list(configs),
            rows=rows,
            skipped=skipped,
            calibration=calib,
            not_available=notes,
            logits_built=logits_built,
            loss_chunk=args.loss_chunk,
            patch_model_options=sorted(params),
            machine=mach,
        )
        if args.throughput:
            print_throughput(rows)
        else:
            report["fits"] = print_memory(
                rows, configs, weights, args.fit_budget * GIB, args.fit_budget
            )
        print(
            "logits built by the warm-up step (out.logits is not None): "
            + ", ".join(f"{c} {'yes' if b else 'no'}" for c, b in logits_built.items())
        )
        for s in skipped:
            print(
                f"skipped: {s['config']} at S/N {s['tokens_per_rank']} (S {s['seq']}): "
                f"{s['reason']}"
            )
        for cfg, why in notes.items():
            print(f"not available: {cfg}: {why}")
        if args.json:
            write_json(args.json, report)
    dist.destroy_process_group()
    return 0


def print_memory(rows, configs, weights, budget, budget_gib):
    print(
        "| config | N | S | S/N | alloc per rank (MiB) | rss per rank (MiB) | KiB per token | step "
        "s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rss = "-" if r["rss"] is None else f"{r['rss'] / MIB:.0f}"
        print(
            f"| {r['config']} | {r['ranks']} | {r['seq']} | {r['tokens_per_rank']} | "
            f"{r['alloc'] / MIB:.1f} | "
            f"{rss} | {r['alloc'] / r['tokens_per_rank'] / 1024:.1f} | {r['seconds']:.1f} |"
        )
    fits = {}
    print(
        f"\nlinear fit alloc = a + b * (S/N) per configuration; longest S/N with weights + peak <= "
        f"{budget_gib:g} GiB per rank (and with AdamW state, 3 x weights):"
    )
    print(
        "| config | points | a (MiB) | b (KiB per token per rank) | worst residual | longest S/N "
        f"in {budget_gib:g} GiB | with AdamW | b of the two largest points (KiB) | longest S/N on "
        "their line | with AdamW |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg in configs:
        pts = [r for r in rows if r["config"] == cfg]
        f = fit([r["tokens_per_rank"] for r in pts], [r["alloc"] for r in pts])
        if not f:
            continue
        f.update(longest(f, weights, budget, [(r["tokens_per_rank"], r["alloc"]) for r in pts]))
        fits[cfg] = f
        print(
            f"| {cfg} | {f['points']} | {f['a'] / MIB:.1f} | {f['b'] / 1024:.2f} | "
            f"{100 * f['worst']:.1f}% | "
            f"{f['per_rank']} | {f['per_rank_adamw']} | {f['b_last'] / 1024:.2f} | "
            f"{f['per_rank_last']} | "
            f"{f['per_rank_adamw_last']} |"
        )
    return fits


def print_throughput(rows):
    print(
        "| config | ranks x threads | S | S/N | step s (median) | tokens/s | time per token vs "
        "unpatched |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = [b for b in rows if b["config"] == "unpatched" and b["seq"] == r["seq"]]
        ratio = f"{r['seconds'] / base[0]['seconds']:.3f}" if base else "-"
        print(
            f"| {r['config']} | {r['ranks']} x {r['threads']} | {r['seq']} | "
            f"{r['tokens_per_rank']} | "
            f"{r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {ratio} |"
        )


def summarize(paths) -> int:
    """The issue's goals from earlier runs' JSON: vocabulary and depth in the slopes, the 2-layer
    peak ratio at S/N 8K, the full depth's longest S/N in the fit budget, time per token."""
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        d["path"] = p
        runs.append(d)
    mem = []
    for d in (
        d for d in runs if d.get("mode") == "memory"
    ):  # runs of one model and N: points merged, later wins
        same = [m for m in mem if m["model"] == d["model"] and m["world"] == d["world"]]
        if not same:
            mem.append(dict(d, rows=list(d["rows"])))
            continue
        m, new = same[0], {(r["config"], r["tokens_per_rank"]) for r in d["rows"]}
        m["rows"] = [r for r in m["rows"] if (r["config"], r["tokens_per_rank"]) not in new] + d[
            "rows"
        ]
        m["load"] += f"; {d['load']}"
    for m in mem:  # the fits of the merged points
        m["fits"] = {}
        for c in CONFIGS:
            pts = sorted((r["tokens_per_rank"], r["alloc"]) for r in m["rows"] if r["config"] == c)
            f = fit([x for x, _ in pts], [a for _, a in pts])
            if f:
                f.update(longest(f, m["weight_bytes"], m["args"]["fit_budget"] * GIB, pts))
                m["fits"][c] = f
    tput = [d for d in runs if d.get("mode") == "throughput"]
    for d in runs:
        m = d.get("machine", {})
        print(
            f"{d['path']}: {d.get('mode')} {d['model']} (vocab {d.get('vocab')}), N={d['world']}, "
            f"load {d['load']} -> {d.get('load_end')}, {m.get('cpu')} {m.get('isa')}"
        )

    def fit_of(d, cfg):
        return (d.get("fits") or {}).get(cfg)

    def layers(d):
        return (
            json.loads(d["model_desc"].split(" ", 2)[2].strip("()"))["num_hidden_layers"]
            if d["model_desc"].startswith("random ")
            else None
        )

    print(
        "\nfits of every model's merged points: a (MiB) + b (KiB per token per rank) x, worst "
        "residual; longest S/N "
        "in the fit budget on the fit and on the two largest points' line:"
    )
    for d in mem:
        for c, f in d["fits"].items():
            print(
                f"  {d['model']} N={d['world']} {c}: points "
                f"{sorted(r['tokens_per_rank'] for r in d['rows'] if r['config'] == c)}, a "
                f"{f['a'] / MIB:.1f}, b {f['b'] / 1024:.2f}, worst {100 * f['worst']:.1f}%, "
                f"longest {f['per_rank']} (AdamW {f['per_rank_adamw']}); b of the two largest "
                f"{f['b_last'] / 1024:.2f}, longest {f['per_rank_last']} (AdamW "
                f"{f['per_rank_adamw_last']})"
            )
    print("\nslope b (KiB per token per rank) per configuration and model:")
    cfgs = [c for c in CONFIGS if any(fit_of(d, c) for d in mem)]
    print("| model | layers | vocab | " + " | ".join(cfgs) + " |")
    print("|---|---:|---:|" + "---:|" * len(cfgs))
    for d in mem:
        print(
            f"| {d['model']} | {layers(d)} | {d['vocab']} | "
            + " | ".join(f"{fit_of(d, c)['b'] / 1024:.2f}" if fit_of(d, c) else "-" for c in cfgs)
            + " |"
        )
    out = {}
    # the part of b that does not scale with depth: b(L) = b0 + L * per_layer, from two depths at
    # one vocabulary
    by_vocab = {}
    for d in mem:
        by_vocab.setdefault(d["vocab"], []).append(d)
    for c in cfgs:
        per_layer = None
        for v, ds in by_vocab.items():
            ds = [d for d in ds if fit_of(d, c) and layers(d)]
            if len({layers(d) for d in ds}) >= 2:
                lo, hi = min(ds, key=layers), max(ds, key=layers)
                per_layer = (fit_of(hi, c)["b"] - fit_of(lo, c)["b"]) / (layers(hi) - layers(lo))
                b0 = fit_of(lo, c)["b"] - layers(lo) * per_layer
                out.setdefault(c, {})["per_layer"] = per_layer
                out[c].setdefault("b0", {})[v] = b0
                print(
                    f"{c}: per layer {per_layer / 1024:.2f} KiB per token; not scaling with depth "
                    f"(vocab {v}): {b0 / 1024:.2f} KiB per token"
                )
        if per_layer is not None:  # the other vocabularies' b0 with the same per-layer part
            for v, ds in by_vocab.items():
                for d in ds:
                    if fit_of(d, c) and layers(d) and v not in out[c]["b0"]:
                        b0 = fit_of(d, c)["b"] - layers(d) * per_layer
                        out[c]["b0"][v] = b0
                        print(
                            f"{c}: not scaling with depth (vocab {v}, from {d['model']}): "
                            f"{b0 / 1024:.2f} KiB per token"
                        )
        same = [
            (d, e)
            for v in by_vocab
            for w in by_vocab
            if v < w
            for d in by_vocab[v]
            for e in by_vocab[w]
            if layers(d) == layers(e) and fit_of(d, c) and fit_of(e, c)
        ]
        for d, e in same:
            diff = fit_of(e, c)["b"] - fit_of(d, c)["b"]
            print(
                f"{c}: {layers(d)} layers, vocab {d['vocab']} -> {e['vocab']}: b "
                f"{fit_of(d, c)['b'] / 1024:.2f} -> "
                f"{fit_of(e, c)['b'] / 1024:.2f} KiB per token ({diff / 1024:+.2f} KiB, "
                f"{4 * (e['vocab'] - d['vocab']) / 1024:.0f} KiB is one fp32 logits row's "
                "difference)"
            )
            out.setdefault(c, {}).setdefault("vocab_pairs", []).append(
                dict(
                    layers=layers(d),
                    vocabs=[d["vocab"], e["vocab"]],
                    b=[fit_of(d, c)["b"], fit_of(e, c)["b"]],
                )
            )

    def at(d, c, x):
        r = [r for r in d["rows"] if r["config"] == c and r["tokens_per_rank"] == x]
        if r:
            return r[0]["alloc"], "measured"
        f = fit_of(d, c)
        return (f["a"] + f["b"] * x, "from the fit") if f else (None, None)

    print()
    for d in mem:
        for base in ("logits", "unpatched"):
            for c in ("chunked+ckpt", "chunked+ckpt+tiled"):
                (num, how_n), (den, how_d) = at(d, c, 8192), at(d, base, 8192)
                if num and den:
                    print(
                        f"{d['model']}: peak at S/N 8192: {c} {num / MIB:.1f} MiB ({how_n}) / "
                        f"{base} {den / MIB:.1f} MiB ({how_d}) = {num / den:.3f}"
                    )
                    out.setdefault("ratio_8k", []).append(
                        dict(
                            model=d["model"],
                            config=c,
                            base=base,
                            ratio=num / den,
                            num=num,
                            den=den,
                            how=[how_n, how_d],
                        )
                    )
        fl = fit_of(d, "logits")
        for c in ("chunked+ckpt", "chunked+ckpt+tiled"):
            fc = fit_of(d, c)
            if fl and fc and fl.get("per_rank"):
                r = fc["per_rank"] / fl["per_rank"]
                last = fc.get("per_rank_last"), fl.get("per_rank_last")
                r_last = last[0] / last[1] if all(last) else None
                print(
                    f"{d['model']}: longest S/N in {d['args']['fit_budget']:g} GiB per rank: {c} "
                    f"{fc['per_rank']} / logits {fl['per_rank']} = {r:.1f}x on the fits (with "
                    f"AdamW: {fc['per_rank_adamw']} / {fl['per_rank_adamw']})"
                    + (
                        ""
                        if r_last is None
                        else f"; on the two largest points' lines {last[0]} / {last[1]} = "
                        f"{r_last:.1f}x"
                    )
                )
                out.setdefault("longest", []).append(
                    dict(model=d["model"], config=c, ratio=r, ratio_last=r_last)
                )
    for d in tput:
        for r in d["rows"]:
            base = [b for b in d["rows"] if b["config"] == "unpatched" and b["seq"] == r["seq"]]
            mbase = [
                b for b in d["rows"] if b["config"] == "unpatched+ckpt" and b["seq"] == r["seq"]
            ]
            if r["config"].startswith("unpatched"):
                continue
            parts = [f"{d['model']} S {r['seq']}: {r['config']} {r['tokens_per_s']:.0f} tokens/s"]
            if base:
                parts.append(f"time per token {r['seconds'] / base[0]['seconds']:.3f}x unpatched")
            if mbase and "ckpt" in r["config"]:
                parts.append(f"{r['seconds'] / mbase[0]['seconds']:.3f}x unpatched+ckpt")
            print(", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
