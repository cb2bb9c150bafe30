"""Long-context ring attention benchmark.

    torchrun --nproc-per-node 2 benchmarks/long_ctx.py --seq 131072          # CPU (gloo)
    torchrun --nproc-per-node 8 benchmarks/long_ctx.py --seq 1048576         # GPUs (NCCL)
    # one device, 8 virtual ranks
    python benchmarks/long_ctx.py --virtual 8 --seq 65536
    # the methods side by side
    torchrun --nproc-per-node 4 benchmarks/long_ctx.py --method ring,ulysses,usp,allgather \\
        --seq 16384 --heads 8 --kv-heads 8,2,1

For each layout x causal configuration it reports the median time per iteration, achieved
TFLOP/s per rank (unmasked work only), parallel efficiency against a single worker running
the same full-sequence attention (DESIGN.md: on CPU T(1 process, all cores) / T(ring); on GPUs
T(1 GPU) / (N * T(ring))), the time of the same loop with communication replaced by local
copies (overlap), bytes sent per rank per ring step, and peak memory per rank.

``--method`` compares the sequence-parallel methods on the same inputs: ``ring``
(``ring_attention``), ``ulysses`` (``ulysses_attention``), ``usp`` (``usp_attention`` on a
``--ulysses U`` x ``N/U`` ring mesh) and ``allgather`` (``allgather_attention``). For each it
reports the time, the efficiency, the time of its computation alone (``no-comm``: the ring with
local copies for ring and all-gather, which compute the same blocks; the single-device attention
of the gathered heads for Ulysses; the ring of the head shards for USP), their ratio
(``overlap``: 1.0 means communication is hidden) and the bytes each rank sent in one forward.
``--kv-heads 8,2,1`` repeats everything per KV head count: where each method wins as K/V shrink.

``--peer torch`` runs PyTorch's own ring (``_templated_ring_attention``, see ``torch_ring_peer.py``)
next to ringkv's ring on the same shards, in the same process group, interleaved round by round
(alternating which goes first); the table shows ringkv's time over the peer's (``vs peer``, < 1:
ringkv is faster) and, with ``--check``, the peer's error against the same reference. The load
average is printed and recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
import ringkv  # noqa: E402
from ringkv.sp import CommStats, LocalComm, RingStats  # noqa: E402
from ringkv.sp.ulysses import HeadSplit  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402  (benchmarks/: this folder)
from benchmarks import torch_ring_peer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_COMM = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": "auto"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=131072, help="global sequence length (tokens)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--heads", type=int, default=None, help="query heads (default: 1 on CPU, 32 on GPU)"
    )
    p.add_argument(
        "--kv-heads",
        default=None,
        help="KV heads, or a comma list to sweep (default: 1 on CPU, 8 on GPU)",
    )
    p.add_argument(
        "--method", default="ring", help="comma list of ring, ulysses, usp, allgather (or all)"
    )
    p.add_argument(
        "--ulysses",
        type=int,
        default=None,
        help="USP's Ulysses degree (default: the largest U with U*U <= N dividing N)",
    )
    p.add_argument("--chunks", type=int, default=2, help="allgather_attention's K/V pieces")
    p.add_argument("--head-dim", type=int, default=None, help="default: 64 on CPU, 128 on GPU")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on GPU"
    )
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="causal or not (default: causal on CPU, both on GPU)",
    )
    p.add_argument(
        "--layout",
        default=None,
        help="contiguous, zigzag, striped, a comma list or all "
        "(default: zigzag on CPU, all on GPU)",
    )
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    p.add_argument(
        "--grad-comm-dtype",
        default="fp32",
        help="the ring's dK/dV message dtype: fp32, bf16, auto, or a comma list timed in "
        "interleaved rounds (ring only; the table's time is the first's)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default: 2 on CPU, 10 on GPU)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default: 0 on CPU, 3 on GPU)"
    )
    p.add_argument("--backend", default="auto", help="kernel backend (see ringkv.kernels.BACKENDS)")
    p.add_argument(
        "--baseline-max-seq",
        type=int,
        default=None,
        help="measure the single-worker baseline up to this length, extrapolate above it "
        "(default: 131072 on CPU, 262144 on GPU)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the single-worker baseline")
    p.add_argument(
        "--baseline-impl",
        choices=["ringkv", "flash_attn"],
        default="ringkv",
        help="the single worker: ringkv.attention (--backend), or the flash-attn package's raw "
        "flash_attn_func",
    )
    p.add_argument("--no-overlap", action="store_true", help="skip the run without communication")
    p.add_argument(
        "--peer",
        choices=["torch"],
        default=None,
        help="time PyTorch's own ring next to ringkv's (interleaved rounds; ring only)",
    )
    p.add_argument(
        "--virtual",
        type=int,
        default=0,
        metavar="N",
        help="one process: run the ring schedule of N virtual ranks one after another",
    )
    p.add_argument(
        "--check", action="store_true", help="verify sampled output rows against a reference"
    )
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the results")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p.parse_args(argv)


class Env:
    """Process group, device and thread setup (torchrun or a single process)."""

    def __init__(self, virtual: int):
        self.distributed = "RANK" in os.environ and not virtual
        cuda = torch.cuda.is_available()
        if self.distributed:
            local = int(os.environ.get("LOCAL_RANK", 0))
            if cuda:
                torch.cuda.set_device(local)
            from ringkv.parallel.net import pick_interface

            pick_interface()  # a world across hosts: the interface that reaches the master
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, max(1, virtual)
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        self.cores = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        )
        local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if self.distributed else 1
        self.threads = max(1, self.cores // local_procs)
        torch.set_num_threads(self.threads)

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def max(self, x: float) -> float:
        if not self.distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def log(self, *a, **kw):
        if self.rank == 0:
            print(*a, **kw, flush=True)


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def inputs(args, env, seq, seed=0):
    """q ``(B, seq, H, D)``, k/v ``(B, seq, Hkv, D)`` drawn from ``seed`` on the device.

    Each rank draws only its own shard (``seq = S / N``, seeded by rank): nothing of size S is
    ever held by one rank, so per-rank memory is what the ring itself needs."""
    g = torch.Generator(device=env.device).manual_seed(seed)
    dt = DTYPES[args.dtype]
    return tuple(
        torch.randn(args.batch, seq, h, args.head_dim, generator=g, device=env.device).to(dt)
        for h in (args.heads, args.kv_heads, args.kv_heads)
    )


def timed(fn, env, iters, warmup, label, quiet):
    return timed_rounds([fn], env, iters, warmup, [label], quiet)[0]


def timed_rounds(fns, env, iters, warmup, labels, quiet):
    """Median seconds of each of ``fns``, run round by round (one call of each per round, the
    order alternating between rounds) so that a change of load falls on all of them alike."""
    times = [[] for _ in fns]
    for i in range(warmup + iters):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            env.barrier()
            env.sync()
            t0 = time.perf_counter()
            fns[j]()
            env.sync()
            dt = env.max(time.perf_counter() - t0)
            if i >= warmup:
                times[j].append(dt)
            if not quiet:
                env.log(
                    f"  {labels[j]}: iter {i + 1}/{warmup + iters} "
                    f"{'(warmup) ' if i < warmup else ''}{dt:8.3f}s"
                )
    return [statistics.median(t) for t in times]


def flops(pairs: int, args) -> float:
    """FLOPs of the visible (query, key) pairs: 2 matmuls x 2 FLOP per MAC; backward 2.5x."""
    f = 4.0 * pairs * args.batch * args.heads * args.head_dim
    return f * (3.5 if args.backward else 1.0)


METHODS = ("ring", "ulysses", "usp", "allgather")


def attend(method, args, layout, causal, comm=None, stats=None, grad_comm="fp32"):
    """``f(q, k, v) -> out``: one method's attention on this rank's shards. Every call fills
    ``stats`` (a ``RingStats`` for the ring, else a ``CommStats``) when given. ``grad_comm``: the
    ring's ``grad_comm_dtype`` (a ``GRAD_COMM`` name)."""
    kw = dict(causal=causal, layout=layout, backend=args.backend, stats=stats)
    if method == "ring":
        gcd = GRAD_COMM[grad_comm]
        return lambda q, k, v: ringkv.ring_attention(q, k, v, comm=comm, grad_comm_dtype=gcd, **kw)
    if method == "ulysses":
        return lambda q, k, v: ringkv.ulysses_attention(q, k, v, **kw)
    if method == "usp":
        ug, rg = ringkv.sp_groups(ulysses=args.ulysses, ring=dist.get_world_size() // args.ulysses)
        return lambda q, k, v: ringkv.usp_attention(q, k, v, ulysses_group=ug, ring_group=rg, **kw)
    return lambda q, k, v: ringkv.allgather_attention(q, k, v, chunks=args.chunks, **kw)


def run(fn, q, k, v, args):
    def step():
        if args.backward:
            out = fn(q, k, v)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                fn(q, k, v)

    return step


def run_ring(q, k, v, args, env, layout, causal, comm=None, stats=None):
    return run(attend("ring", args, layout, causal, comm, stats), q, k, v, args)


def compute_only(method, args, env, layout, causal):
    """The step of ``method``'s computation without its communication (see the module docstring)."""
    if method in ("ring", "allgather"):
        q, k, v = local_shards(args, env, layout, env.rank)
        return run_ring(q, k, v, args, env, layout, causal, comm=LocalComm(env.rank, env.world))
    u = env.world if method == "ulysses" else args.ulysses
    r = env.world // u
    split = HeadSplit(args.heads, args.kv_heads, u)  # this rank's heads, uneven ones too
    hq = len(split.q_heads(env.rank % u))
    hkv = hq // split.group(env.rank % u)  # the KV heads its kernel runs with
    g = torch.Generator(device=env.device).manual_seed(env.rank)
    q, k, v = (  # what one rank computes on: (B, S/R, heads, D)
        torch.randn(args.batch, args.seq // r, h, args.head_dim, generator=g, device=env.device)
        .to(DTYPES[args.dtype])
        .requires_grad_(args.backward)
        for h in (hq, hkv, hkv)
    )
    if method == "ulysses":
        return run(
            lambda q, k, v: ringkv.attention(q, k, v, causal=causal, backend=args.backend)[0],
            q,
            k,
            v,
            args,
        )
    return run(attend("ring", args, layout, causal, LocalComm(env.rank // u, r)), q, k, v, args)


def local_shards(args, env, layout, rank):
    q, k, v = inputs(args, env, args.seq // env.world, seed=1 + rank)  # (B, S/N, H|Hkv, D)
    if args.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def baseline(args, env, causal):
    """Single worker, whole sequence, all of this process's cores (or the one GPU): seconds, how."""
    limit = args.baseline_max_seq
    sizes = [args.seq] if args.seq <= limit else [limit // 2, limit]
    measured = {}
    if env.rank == 0:
        torch.set_num_threads(env.cores if env.device.type == "cpu" else env.threads)
        for s in sizes:
            q, k, v = inputs(args, env, s)
            if args.backward:
                q, k, v = (t.requires_grad_() for t in (q, k, v))

            def step():
                if args.baseline_impl == "flash_attn":
                    from flash_attn import flash_attn_func  # (B, S, H, D), GQA native

                    out = flash_attn_func(q, k, v, causal=causal)
                else:
                    out, _ = ringkv.attention(q, k, v, causal=causal, backend=args.backend)
                if args.backward:
                    out.backward(torch.ones_like(out))

            measured[s] = timed(
                step, _Solo(env), args.iters, args.warmup, f"baseline S={s}", args.quiet
            )
        torch.set_num_threads(env.threads)
    env.barrier()
    if args.seq in measured:
        t, how = measured[args.seq], "measured"
    elif measured:
        t, how = measured[limit] * (args.seq / limit) ** 2, f"extrapolated (S^2) from S={limit}"
    else:
        t, how = 0.0, ""
    t = env.max(t)
    return t, how


class _Solo:
    """Env view for rank 0 timing alone (no barriers, no reductions)."""

    def __init__(self, env):
        self.env = env
        self.barrier = lambda: None
        self.max = lambda x: x
        self.sync = env.sync
        self.log = env.log


def bench_config(args, env, method, layout, causal):
    label = f"{method:9s} {layout:10s} {'causal' if causal else 'full  '}"
    row = dict(method=method, layout=layout, causal=causal, kv_heads=args.kv_heads)
    if args.virtual:  # N virtual ranks in turn on one device: compute efficiency of the blocks
        shards = [local_shards(args, env, layout, r) for r in range(env.world)]
        stats = [RingStats() for _ in shards]  # each virtual rank's last forward
        steps = [
            run_ring(*s, args, env, layout, causal, LocalComm(r, env.world), stats[r])
            for r, s in enumerate(shards)
        ]

        def all_ranks():
            for f in steps:
                f()

        row["time_s"] = timed(
            all_ranks, env, args.iters, args.warmup, label + " virtual ring", args.quiet
        )
        pairs = [s.pairs for s in stats]
        row["pairs_per_rank"] = max(pairs)
        row["tflops_per_rank"] = flops(sum(pairs), args) / row["time_s"] / 1e12
    else:
        q, k, v = local_shards(args, env, layout, env.rank)
        stats = RingStats() if method == "ring" else CommStats()  # of this rank's last forward
        gcd = args.grad_comm[0]
        mine = run(attend(method, args, layout, causal, stats=stats, grad_comm=gcd), q, k, v, args)
        why = args.peer and (
            f"--peer runs next to the ring only, not {method}"
            if method != "ring"
            else torch_ring_peer.unavailable(layout, causal, args.heads, args.kv_heads, env.device)
        )
        if args.peer and not why:
            peer = torch_ring_peer.torch_ring(dist.group.WORLD, causal, layout, env.device)
            row["time_s"], row["peer_time_s"] = timed_rounds(
                [mine, run(peer, *peer_inputs(q, k, v, args), args)],
                env,
                args.iters,
                args.warmup,
                [label, label + " peer " + args.peer],
                args.quiet,
            )
            row["vs_peer"] = row["time_s"] / row["peer_time_s"]
        elif method == "ring" and (len(args.grad_comm) > 1 or not args.no_overlap):
            # the wire dtypes and the ring without communication, interleaved round by round (a
            # change of load, on a shared machine, falls on all of them alike)
            stats_of = {g: (stats if i == 0 else RingStats()) for i, g in enumerate(args.grad_comm)}
            fns = [
                run(
                    attend(method, args, layout, causal, stats=stats_of[g], grad_comm=g),
                    q,
                    k,
                    v,
                    args,
                )
                for g in args.grad_comm
            ]
            labels = [f"{label} {g}" for g in args.grad_comm]
            if not args.no_overlap:
                fns.append(compute_only(method, args, env, layout, causal))
                labels.append(label + " no comm")
            times = timed_rounds(fns, env, args.iters, args.warmup, labels, args.quiet)
            row["time_s"] = times[0]
            if not args.no_overlap:
                row["time_nocomm_s"] = times[-1]
            if args.backward:
                row["by_grad_comm"] = {g: dict(time_s=t) for g, t in zip(args.grad_comm, times)}
                for g in args.grad_comm:
                    row["by_grad_comm"][g].update(wire(stats_of[g], env))
        else:
            row["time_s"] = timed(mine, env, args.iters, args.warmup, label, args.quiet)
            if method == "ring" and args.backward:
                row["by_grad_comm"] = {args.grad_comm[0]: dict(time_s=row["time_s"])}
                row["by_grad_comm"][args.grad_comm[0]].update(wire(stats, env))
            if args.peer:
                row["peer_unavailable"] = why
                env.log(f"  peer {args.peer} not run: {why}")
        visible = args.seq * (args.seq + 1) // 2 if causal else args.seq**2
        row["pairs_per_rank"] = (
            int(env.max(stats.pairs)) if method == "ring" else visible // env.world
        )
        row["tflops_per_rank"] = flops(row["pairs_per_rank"], args) / row["time_s"] / 1e12
        row["bytes_sent"] = int(env.max(stats.bytes_sent))
        if not args.no_overlap and "time_nocomm_s" not in row:
            row["time_nocomm_s"] = timed(
                compute_only(method, args, env, layout, causal),
                env,
                args.iters,
                args.warmup,
                label + " no comm",
                args.quiet,
            )
        if "time_nocomm_s" in row:
            row["overlap_ratio"] = row["time_s"] / row["time_nocomm_s"]
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    row["bytes_per_step"] = (
        2 * args.batch * (args.seq // env.world) * args.kv_heads * args.head_dim * elem
    )
    if args.backward:  # K/V again plus their fp32 gradients
        row["bytes_per_step"] += (
            2 * args.batch * (args.seq // env.world) * args.kv_heads * args.head_dim * (elem + 4)
        )
    row["peak_mem_bytes"] = int(env.max(peak_memory_bytes(env.device)))
    if args.check and not args.virtual:
        row["check_max_err"] = check(args, env, method, layout, causal)
        if "peer_time_s" in row:
            row["peer_check_max_err"] = check(args, env, method, layout, causal, peer=True)
            if args.backward:
                row["peer_grad_max_diff"] = peer_grad_diff(args, env, layout, causal)
    return row


WIRE_CODES = {"None": 0, "torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2}


def wire(stats, env) -> dict:
    """What the ring's last backward put on the wire (``RingStats.backward``: the dK/dV dtype it
    used and, with ``"auto"``, the measured transfer / compute ratio that chose it), with whether
    every rank used the same (one all-gather of two numbers)."""
    b = stats.backward
    if b is None:
        return {}
    got = dict(dkv_dtype=str(b.grad_comm_dtype or torch.float32)[6:], ratio=b.comm_ratio)
    if env.distributed:
        mine = torch.tensor(
            [WIRE_CODES[str(b.grad_comm_dtype)], -1.0 if b.comm_ratio is None else b.comm_ratio],
            dtype=torch.float64,
            device=env.device,
        )
        every = [torch.empty_like(mine) for _ in range(env.world)]
        dist.all_gather(every, mine)
        got["same_on_every_rank"] = all(torch.equal(e, mine) for e in every)
    return got


def peer_inputs(q, k, v, args):
    """The same shards in the peer's ``(B, H, S_local, D)``, contiguous (made before timing)."""
    return tuple(
        t.detach().transpose(1, 2).contiguous().requires_grad_(args.backward) for t in (q, k, v)
    )


def check(args, env, method, layout, causal, rows=64, peer=False):
    """Max |method - reference| over sampled query rows of this rank (``peer``: of the peer's
    ring). The reference (chunked over keys) needs all K/V: they are all-gathered here, for
    --check only."""
    q, k, v = local_shards(args, env, layout, env.rank)
    groups = {}
    if method == "usp":
        groups = dict(
            zip(
                ("ulysses_group", "ring_group"),
                ringkv.sp_groups(ulysses=args.ulysses, ring=env.world // args.ulysses),
            )
        )
    where = groups or dict(rank=env.rank, world=env.world)
    pos = ringkv.positions(args.seq, layout, device=env.device, **where)
    pick = torch.randperm(pos.numel(), generator=torch.Generator().manual_seed(1))[:rows].to(
        env.device
    )
    with torch.no_grad():
        if peer:
            ring = torch_ring_peer.torch_ring(dist.group.WORLD, causal, layout, env.device)
            out = ring(*peer_inputs(q, k, v, args)).transpose(1, 2)
        else:
            out = attend(method, args, layout, causal)(q, k, v)
        k_all, v_all = (
            ringkv.unshard(t, 1, layout, **groups) for t in (k, v)
        )  # (B, S, Hkv, D), global order
        ref, _ = ringkv.attention(
            q[:, pick].float(),
            k_all.float(),
            v_all.float(),
            causal=causal,
            q_positions=pos[pick],
            k_positions=range(args.seq),
            backend="reference",
        )
    err = (out[:, pick].float() - ref).abs().max().item()
    return env.max(err)


def peer_grad_diff(args, env, layout, causal) -> float:
    """Max |dq, dk, dv of the peer's ring - ringkv's| on this rank's shards (ringkv's gradients are
    the ones the test suite checks against the reference), for dout = 1."""
    q, k, v = local_shards(args, env, layout, env.rank)
    theirs = peer_inputs(q, k, v, args)
    run(attend("ring", args, layout, causal), q, k, v, args)()
    run(torch_ring_peer.torch_ring(dist.group.WORLD, causal, layout, env.device), *theirs, args)()
    return env.max(
        max(
            (a.grad.float() - b.grad.transpose(1, 2).float()).abs().max().item()
            for a, b in zip((q, k, v), theirs)
        )
    )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    env = Env(args.virtual)
    gpu = env.device.type == "cuda"
    methods = list(METHODS) if args.method == "all" else args.method.split(",")
    head_split = any(m in ("ulysses", "usp") for m in methods)
    defaults = dict(
        heads=(env.world if head_split else 1) if not gpu else 32,
        kv_heads="8" if gpu else "1",
        head_dim=128 if gpu else 64,
        dtype="bf16" if gpu else "fp32",
        iters=10 if gpu else 2,
        warmup=3 if gpu else 0,
        layout="all" if gpu else "zigzag",
        baseline_max_seq=262144 if gpu else 131072,
        ulysses=max(
            u for u in range(1, env.world + 1) if env.world % u == 0 and u * u <= env.world
        ),
    )
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    kv_list = [int(x) for x in str(args.kv_heads).split(",")]
    args.grad_comm = args.grad_comm_dtype.split(",")
    if any(g not in GRAD_COMM for g in args.grad_comm):
        raise SystemExit(
            f"--grad-comm-dtype: choose from {sorted(GRAD_COMM)}, got {args.grad_comm_dtype}"
        )
    bad = [m for m in methods if m not in METHODS]
    if bad or (args.virtual and methods != ["ring"]):
        raise SystemExit(
            f"--method: choose from {METHODS} (--virtual runs the ring only), got {args.method}"
        )
    if args.peer and (args.virtual or not env.distributed):
        raise SystemExit("--peer needs torchrun and no --virtual")
    layouts = list(ringkv.LAYOUTS) if args.layout == "all" else args.layout.split(",")
    causals = ([True, False] if gpu else [True]) if args.causal is None else [args.causal]
    ringkv.sp.layout.check_seq_len(
        args.seq, "zigzag" if "zigzag" in layouts else layouts[0], env.world
    )
    env.log(
        f"ringkv long-context benchmark: {env.world} {'virtual ' if args.virtual else ''}rank(s) "
        f"on {env.device.type} "
        f"({'NCCL' if gpu and env.distributed else 'gloo' if env.distributed else 'no comm'}), "
        f"{env.threads} thread(s)/rank; seq={args.seq} batch={args.batch} heads={args.heads} "
        f"kv_heads={','.join(map(str, kv_list))} head_dim={args.head_dim} {args.dtype}"
        f"{' fwd+bwd' if args.backward else ' fwd'} backend={args.backend} "
        f"methods={','.join(methods)}"
        + (
            f" (usp: ulysses {args.ulysses} x ring {env.world // args.ulysses})"
            if "usp" in methods
            else ""
        )
    )
    if not gpu:
        env.log(
            "  (CPU defaults: 1 head of dim 64, zigzag, causal, 2 iterations, so 128K tokens "
            "finish in a few minutes; --heads, --layout all, --no-causal, --iters change that)"
        )
    load_start = load_average()
    env.log(f"  load average at the start: {load_start}")
    rows = []
    baselines = {}
    for kv in kv_list:
        args.kv_heads = kv
        for causal in causals:
            if not args.no_baseline:
                baselines[kv, causal] = baseline(args, env, causal)
            for method in methods:
                for layout in layouts:
                    row = bench_config(args, env, method, layout, causal)
                    if (kv, causal) in baselines and baselines[kv, causal][0] > 0:
                        t1, how = baselines[kv, causal]
                        row["baseline_s"], row["baseline"] = t1, f"{args.baseline_impl}, {how}"
                        # virtual ranks run one after another: their total time against the single
                        # worker
                        workers = 1 if env.device.type == "cpu" or args.virtual else env.world
                        row["efficiency"] = t1 / (workers * row["time_s"])
                    rows.append(row)
    env.log("")
    mach = machine(threads=env.threads)  # per rank (the single-worker baseline: all of them)
    env.log(machine_line(mach) + " per rank")
    # `+` before the peer columns: adjacent literals join first, and `* False` would blank them all
    header = (
        f"{'method':9s} {'kv':>3s} {'layout':10s} {'mask':6s} {'time/it':>9s} "
        f"{'TFLOP/s/rank':>12s} "
        f"{'efficiency':>10s} {'no-comm':>9s} {'overlap':>8s} {'sent/fwd':>10s} {'peak mem':>10s} "
        f"{'check':>8s}" + f"{'  peer':9s} {'vs peer':>8s} {'peer chk':>8s}" * bool(args.peer)
    )
    env.log(header)
    env.log("-" * len(header))
    for r in rows:
        env.log(
            f"{r['method']:9s} {r['kv_heads']:3d} {r['layout']:10s} "
            f"{'causal' if r['causal'] else 'full':6s} "
            f"{r['time_s']:8.3f}s "
            f"{r['tflops_per_rank']:12.4f} {r.get('efficiency', float('nan')):10.3f} "
            f"{r.get('time_nocomm_s', float('nan')):8.3f}s "
            f"{r.get('overlap_ratio', float('nan')):8.3f} "
            f"{fmt_bytes(r.get('bytes_sent', r['bytes_per_step'] * (env.world - 1))):>10s} "
            f"{fmt_bytes(r['peak_mem_bytes']):>10s} "
            f"{r['check_max_err'] if 'check_max_err' in r else float('nan'):8.1e}"
            + (
                f" {r.get('peer_time_s', float('nan')):7.3f}s "
                f"{r.get('vs_peer', float('nan')):8.3f} "
                f"{r.get('peer_check_max_err', float('nan')):8.1e}"
                if args.peer
                else ""
            )
        )
    for (kv, causal), (t1, how) in baselines.items():
        env.log(
            f"baseline (kv_heads {kv}, {'causal' if causal else 'full'}): single worker, whole "
            f"sequence: {t1:.3f}s ({how}); efficiency = T_single / "
            f"({'N x ' if gpu and not args.virtual else ''}T_ring"
            f"{', all virtual ranks in turn' if args.virtual else ''})"
        )
    load_end = load_average()
    env.log(
        f"load average at the end: {load_end}"
        + (
            f"; vs peer = ringkv time / {args.peer}'s ring time (median of interleaved rounds)"
            if args.peer
            else ""
        )
    )
    tol = 2e-3 if args.dtype == "fp32" else 5e-2
    failed = [
        r
        for r in rows
        if max(r.get(e, 0) for e in ("check_max_err", "peer_check_max_err", "peer_grad_max_diff"))
        > tol
    ]
    if args.check:
        env.log(
            "check: "
            + (
                "FAILED " + str([(r["method"], r["layout"], r["causal"]) for r in failed])
                if failed
                else "passed"
            )
        )
    result = dict(
        args=vars(args),
        rows=rows,
        environment=dict(
            torch=torch.__version__,
            ringkv=ringkv.__version__,
            python=platform.python_version(),
            device=torch.cuda.get_device_name() if gpu else mach["cpu"],
            world_size=env.world,
            virtual=bool(args.virtual),
            threads_per_rank=env.threads,
            cores=env.cores,
            backend=args.backend,
            comm="nccl" if gpu and env.distributed else "gloo" if env.distributed else "none",
            load_start=load_start,
            load_end=load_end,
        ),
        machine=mach,
    )
    if env.rank == 0 and args.json:
        write_json(args.json, result)
    if env.rank == 0 and args.plot:
        plot(rows, args.plot, result["environment"])
    if env.distributed:
        dist.barrier()  # rank 0 may still be writing: a peer tearing gloo down under it aborts it
    return 1 if failed else 0


def plot(rows, path, environment):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    labels = [
        f"{r['method']} kv{r['kv_heads']}\n{r['layout']} {'causal' if r['causal'] else 'full'}"
        for r in rows
    ]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    ax.bar([i - 0.27 for i in x], [r["time_s"] for r in rows], 0.27, label="method")
    ax.bar(list(x), [r.get("time_nocomm_s", 0) for r in rows], 0.27, label="its computation alone")
    ax.bar(
        [i + 0.27 for i in x], [r.get("baseline_s", 0) for r in rows], 0.27, label="single worker"
    )
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(
        f"ringkv ring attention, {environment['world_size']} ranks, {environment['device']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    code = main()
    # No gloo teardown at exit (as in ring_profile.py): across hosts a rank aborted in it
    # ("terminate called without an active exception") in most runs, after all its output was
    # written; the results are complete by now, so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
