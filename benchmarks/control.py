"""The control plane of a multi-rank engine, per decode step: bytes the driver sends and the
seconds it costs, at contexts, batches and world sizes, for this tree and an earlier commit
(``--before``), measured in one run, alternating round by round.

    # 1K/8K/64K x 1/16/64 x worlds 2, 4
    python benchmarks/control.py --json results/control.json
    python benchmarks/control.py --contexts 8192 --batches 64 --worlds 4 --steps 40

What runs: a gloo world of N processes (one thread each) on loopback, the engine's own control
code and nothing else (no model): rank 0 holds ``batch`` sequences of ``context`` tokens whose
prompts were already sent (untimed), then publishes ``--steps`` decode steps back to back
(each sequence gains one token, and a block every ``block_size`` tokens); every other rank
receives each step and rebuilds its ``StepPlan``. Per step:

- ``bytes``: what the driver sends to each rank (this tree: the broadcast words; before: the
  JSON of the ``StepPlan`` written to the store);
- ``control_ms``: wall time from the first publish until every rank has rebuilt the last
  plan, divided by the steps (the control plane's cost per step at full speed, transport
  latency included);
- ``driver_ms`` / ``rank_ms``: host time per step encoding and publishing on the driver
  (this tree: posting the asynchronous broadcast, never waiting for it) / decoding the step on
  the slowest other rank (the wait for the message excluded).

``--engine``: real engines instead (a random ``tiny-long`` model, spawned ranks, this tree
only): ``batch`` requests of ``context`` tokens are prefilled, then ``--steps`` decode steps
run; per decode step, ``rank_stats()``'s ``control_bytes`` and ``control_s`` on the driver and
the largest of the other ranks, for each mesh of ``--meshes``.

Control traffic does not depend on how the ranks split the model (tp, pp or sp): every rank
gets the same step. ``--before`` is a checkout of the commit to compare with (default: a
temporary ``git worktree`` of ``--before-commit``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# benchmarks/ never (its modules would shadow installed packages); the ringkv measured comes from
# PYTHONPATH
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
BEFORE_COMMIT = (
    "b68c5a5"  # the commit issue #25 started from: the whole StepPlan as JSON on the store
)


# -- one rank of the measuring world (imports whichever ringkv is on the path) -------------------
def _rank(rank: int, world: int, port: int, cases, steps: int, block_size: int, out) -> None:
    import torch
    import torch.distributed as dist

    from ringkv.parallel import control as ctl

    torch.set_num_threads(1)
    timeout = timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timeout
    )
    control = ctl.ControlPlane(store, "bench", rank, world, timeout)
    new = hasattr(ctl, "Channel")
    if new:  # deep enough that the driver never waits on its own broadcasts inside the loop
        control.open_channel(depth=steps + 4)
    results = []
    for context, batch in cases:
        if rank == 0:
            results.append(_drive(control, new, context, batch, steps, block_size))
        else:
            _follow(control, new)
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _drive(control, new: bool, context: int, batch: int, steps: int, block_size: int) -> dict:
    import torch  # noqa: F401

    from ringkv.parallel import plan as pl

    per = -(-(context + steps) // block_size)
    seqs = [
        SimpleNamespace(
            seq_id=i,
            token_ids=list(range(i, i + context)),
            finished=False,
            kv_epoch=0,
            block_table=list(range(i * per, i * per + -(-context // block_size))),
        )
        for i in range(batch)
    ]

    def step():  # each sequence computes its newest token
        return [
            SimpleNamespace(seq=s, start=len(s.token_ids) - 1, n=1, completes=True, targets=0)
            for s in seqs
        ]

    pub = pl.Publisher() if new else None

    def send(entries) -> int:
        if new:
            return control.publish_step(pub.encode(entries, "tokens"))
        plan = pl.StepPlan(
            [
                pl.SeqStep(
                    e.start,
                    e.n,
                    e.seq.token_ids[e.start : e.start + e.n],
                    e.seq.block_table,
                    e.completes,
                    None,
                )
                for e in entries
            ],
            "tokens",
        )
        msg = {"kind": "step", **plan.to_json()}
        control.publish(msg)
        return len(json.dumps(msg))

    send(step())  # the prompts (once, untimed)
    control.exchange("ready", 0.0)
    sizes, host = [], 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        for s in seqs:
            s.token_ids.append(7)
            if len(s.token_ids) > len(s.block_table) * block_size:
                s.block_table.append(s.block_table[-1] + 1)
        h = time.perf_counter()
        sizes.append(send(step()))
        host += time.perf_counter() - h
    control.publish({"kind": "done"})
    ranks = control.exchange("done", 0.0)  # every rank has rebuilt the last plan
    wall = time.perf_counter() - t0
    return dict(
        context=context,
        batch=batch,
        steps=steps,
        bytes=statistics.median(sizes),
        control_ms=1e3 * wall / steps,
        driver_ms=1e3 * host / steps,
        rank_ms=1e3 * max(ranks[1:]) / steps,
    )


def _follow(control, new: bool) -> None:
    from ringkv.parallel import plan as pl

    mirror = pl.Mirror() if new else None
    control.exchange("ready", 0.0) if not new else None
    busy, started = 0.0, False
    while True:
        msg = control.receive(timedelta(seconds=600))
        got = time.perf_counter()
        if msg["kind"] == "done":
            break
        if new:
            mirror.apply(msg["words"])
            if not started:  # the prompts' step: then join the "ready" exchange
                control.exchange("ready", 0.0)
                started = True
                continue
        else:
            pl.StepPlan.from_json(msg)
            if not started:
                started = True
                continue
        busy += time.perf_counter() - got
    control.exchange("done", busy)


def _engine_rows(args) -> list:
    """Per decode step of real engines: the driver's and the other ranks' control bytes and
    seconds."""
    import torch

    from benchmarks.models import model_path
    from ringkv.engine import LLM, SamplingParams

    path, rows = model_path(args.engine_model), []
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    for mesh in args.meshes.split(";"):
        kw = {k: int(v) for k, v in (x.split("=") for x in mesh.split(","))}
        sp = kw.get("sp", 1)
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                per_seq = -(-(context + args.steps + 8) // (args.block_size * sp))
                g = torch.Generator().manual_seed(context + batch)
                with LLM(
                    path,
                    **kw,
                    block_size=args.block_size,
                    num_blocks=batch * per_seq + 8,
                    max_num_seqs=batch,
                    max_num_batched_tokens=8192,
                    timeout=600,
                ) as llm:
                    rids = [
                        llm.add_request(
                            torch.randint(3, 1000, (context,), generator=g).tolist(), params
                        )
                        for _ in range(batch)
                    ]
                    started = set()
                    while len(started) < len(
                        rids
                    ):  # every prompt computed: each request has a token
                        for o in llm.step():
                            if o.finish_reason == "error":
                                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                            if o.token_ids:
                                started.add(o.request_id)
                    before = llm.rank_stats()
                    for _ in range(args.steps):
                        llm.step()
                    after = llm.rank_stats()
                steps = after[0]["steps"] - before[0]["steps"]
                per = [
                    (
                        (a["control_bytes_total"] - b["control_bytes_total"]) / steps,
                        1e3 * (a["control_s_total"] - b["control_s_total"]) / steps,
                    )
                    for a, b in zip(after, before)
                ]
                rows.append(
                    dict(
                        mesh=mesh,
                        world=len(after),
                        context=context,
                        batch=batch,
                        steps=steps,
                        driver_bytes=per[0][0],
                        driver_ms=per[0][1],
                        rank_bytes=max(p[0] for p in per[1:]),
                        rank_ms=max(p[1] for p in per[1:]),
                    )
                )
                r = rows[-1]
                print(
                    f"{mesh:>10} {context:>8} {batch:>5} | {r['driver_bytes']:>12.0f} "
                    f"{r['driver_ms']:>9.3f} | "
                    f"{r['rank_bytes']:>10.0f} {r['rank_ms']:>7.3f}",
                    flush=True,
                )
    return rows


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(args) -> None:
    """``--run-world N``: measure every case in one world of this interpreter's ringkv; JSON to
    stdout."""
    import torch.multiprocessing as mp

    cases = json.loads(args.cases)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _port()
    procs = [
        ctx.Process(
            target=_rank, args=(r, args.run_world, port, cases, args.steps, args.block_size, out)
        )
        for r in range(args.run_world)
    ]
    for p in procs:
        p.start()
    results = out.get()
    for p in procs:
        p.join()
    print("RESULT " + json.dumps(results))


def _measure(tree: str, world: int, cases, steps: int, block_size: int) -> list:
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--run-world",
            str(world),
            "--cases",
            json.dumps(cases),
            "--steps",
            str(steps),
            "--block-size",
            str(block_size),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=tempfile.gettempdir(),
    )
    line = next(
        (out_line for out_line in r.stdout.splitlines() if out_line.startswith("RESULT ")), None
    )
    if r.returncode or line is None:
        raise RuntimeError(
            f"measuring {tree} (world {world}) failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )
    return json.loads(line[len("RESULT ") :])


def _before_tree(args):
    if args.before:
        return args.before, None
    path = tempfile.mkdtemp(prefix="ringkv-before-")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", path, args.before_commit],
        check=True,
        capture_output=True,
    )
    return path, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--contexts", default="1024,8192,65536", help="tokens per sequence (comma list)"
    )
    ap.add_argument("--batches", default="1,16,64", help="sequences per step (comma list)")
    ap.add_argument("--worlds", default="2,4", help="ranks (comma list)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per case")
    ap.add_argument(
        "--rounds", type=int, default=2, help="before/after alternations; the median is reported"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--before", help="a checkout of the commit to compare with")
    ap.add_argument("--before-commit", default=BEFORE_COMMIT)
    ap.add_argument("--no-before", action="store_true", help="measure this tree only")
    ap.add_argument("--engine", action="store_true", help="real engines (see the module docstring)")
    ap.add_argument(
        "--meshes", default="tp=2;pp=2;sp=2;tp=2,pp=2;pp=2,sp=2", help="--engine: meshes (';' list)"
    )
    ap.add_argument(
        "--engine-model",
        default="tiny-long",
        help="--engine: a benchmarks/models.py preset or a path",
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--run-world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_world:
        return _worker_main(args)
    sys.path.insert(0, ROOT)
    from benchmarks.models import load_average, machine, machine_line, write_json

    if args.engine:
        load, mach = load_average(), machine()
        print(machine_line(mach) + " in the driver; each rank of a mesh of N: cores / N threads")
        print(
            f"{'mesh':>10} {'context':>8} {'batch':>5} | {'driver bytes':>12} {'driver ms':>9} | "
            f"{'rank bytes':>10} {'rank ms':>7}   (per decode step; load {load})"
        )
        rows = _engine_rows(args)
        if args.json:
            write_json(
                args.json,
                dict(
                    rows=rows,
                    steps=args.steps,
                    block_size=args.block_size,
                    model=args.engine_model,
                    load=[load, load_average()],
                    machine=mach,
                ),
            )
        return
    cases = [
        [c, b]
        for c in map(int, args.contexts.split(","))
        for b in map(int, args.batches.split(","))
    ]
    trees = {"after": ROOT}
    cleanup = None
    if not args.no_before:
        trees["before"], cleanup = _before_tree(args)
    loads = [load_average()]
    runs = {}  # (version, world) -> [rounds of case rows]
    try:
        for world in map(int, args.worlds.split(",")):
            for rnd in range(args.rounds):
                order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
                for version in order:
                    runs.setdefault((version, world), []).append(
                        _measure(trees[version], world, cases, args.steps, args.block_size)
                    )
                    loads.append(load_average())
    finally:
        if cleanup:
            subprocess.run(
                ["git", "-C", ROOT, "worktree", "remove", "--force", cleanup], capture_output=True
            )
    rows = []
    for (version, world), rounds in runs.items():
        for i, (context, batch) in enumerate(cases):
            got = [r[i] for r in rounds]
            rows.append(
                dict(
                    version=version,
                    world=world,
                    context=context,
                    batch=batch,
                    **{
                        k: statistics.median(g[k] for g in got)
                        for k in ("bytes", "control_ms", "driver_ms", "rank_ms")
                    },
                )
            )
    mach = machine(threads=1)  # every rank: torch.set_num_threads(1)
    print(
        f"\ncontrol plane per decode step ({args.steps} steps, median of {args.rounds} rounds; "
        f"load {loads[0]} .. {loads[-1]})"
    )
    print(machine_line(mach) + " per rank")
    print(
        f"{'world':>5} {'context':>8} {'batch':>5} | {'bytes before':>12} {'bytes after':>11} | "
        f"{'ms before':>9} {'ms after':>8} | {'driver ms':>9} {'rank ms':>7}"
    )
    get = {(r["version"], r["world"], r["context"], r["batch"]): r for r in rows}
    for world in map(int, args.worlds.split(",")):
        for context, batch in cases:
            a, b = get[("after", world, context, batch)], get.get(("before", world, context, batch))
            print(
                f"{world:>5} {context:>8} {batch:>5} | {b['bytes'] if b else float('nan'):>12.0f} "
                f"{a['bytes']:>11.0f} | "
                f"{b['control_ms'] if b else float('nan'):>9.3f} {a['control_ms']:>8.3f} | "
                f"{a['driver_ms']:>9.3f} {a['rank_ms']:>7.3f}"
            )
    if args.json:
        write_json(
            args.json,
            dict(
                rows=rows,
                steps=args.steps,
                rounds=args.rounds,
                block_size=args.block_size,
                load=loads,
                before=args.before or args.before_commit,
                machine=mach,
            ),
        )


if __name__ == "__main__":
    main()
