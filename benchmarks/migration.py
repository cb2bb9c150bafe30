"""KV migration: bytes moved and the time a request is stopped, full vs incremental, between
engines of any two meshes.

    python benchmarks/migration.py --pairs 1:1 tp2:pp2 sp2:1 --contexts 1024 8192 32768 \\
        --json results/migration.json

For each mesh pair ``SRC:DST`` (``1``, ``tp2``, ``pp2``, ``sp2``, ``tp2pp2``, ... : the product of
``tpN``/``ppN``/``spN``) and each context length, a request with that many prompt tokens runs
on engine A (mesh SRC) until it has ``--decoded`` tokens, then moves to engine B (mesh DST, in
the same process; its ranks are spawned). The snapshot goes through ``to_bytes``/``from_bytes``,
the serialisation a file or a process group carries:

- **full**: ``export_request`` (stop) -> bytes -> ``import_request``;
- **incremental** (pre-copy, as in Llumnix): a snapshot is exported while the request keeps
  running and imported into B (not downtime); A computes ``--decoded`` more tokens; then the
  request stops and only what is new since the pre-copy moves.

``--transport link`` puts B in another process, and the request moves over a loopback ``Link``
(``engine/remote.py``: chunked, a snapshot never held twice; what two hosts use).

Downtime runs from the stop (the final export) to the request's first token on B; it holds
one decode step of B, whose attention reads the whole context (a request pays that step on B
anyway: "B's decode step" is the median of its later steps there). "stop -> imported" is the
migration's own part (export, transfer, import). Both migrated requests then finish on B and must
produce A's unmigrated tokens (checked). Medians of ``--repeats``. Goal: incremental downtime at the
longest context <= 1.2x the shortest, on every pair; the last column gives the ratio of
"stop -> imported" and of the whole downtime.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

from benchmarks.models import describe, machine, machine_line, model_path, write_json  # noqa: E402
from ringkv.engine import LLM, KVSnapshot, SamplingParams  # noqa: E402
from ringkv.engine.remote import receive_request, send_request  # noqa: E402
from ringkv.parallel.transfer import Link  # noqa: E402


def mesh(name: str) -> dict:
    """``"tp2pp2"`` -> ``dict(tp=2, pp=2)``; ``"1"`` -> one rank."""
    return {} if name == "1" else {k: int(v) for k, v in re.findall(r"(tp|pp|sp)(\d+)", name)}


def move(a, b, rid, since=None, stop=True):
    """Export from ``a``, through bytes, import into ``b``; (snapshot, bytes, seconds)."""
    t = time.perf_counter()
    snap = a.export_request(rid, since=since, stop=stop)
    data = snap.to_bytes()
    b.import_request(KVSnapshot.from_bytes(data))
    return snap, len(data), time.perf_counter() - t


def first_token(b, rid, outs):
    """Step ``b`` until ``rid`` gets a token there."""
    while True:
        for o in b.step():
            outs[o.request_id] = o
            if o.request_id == rid:
                return


def finish(engine, outs):
    """Run ``engine`` dry; returns the median seconds of its steps (its inter-token time)."""
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for o in engine.step():
            outs[o.request_id] = o
        steps.append(time.perf_counter() - t)
    return statistics.median(steps) if steps else 0.0


class Here:
    """Engine B in this process; the snapshot goes through ``to_bytes``/``from_bytes``."""

    def __init__(self, b):
        self.b = b

    def move(self, a, rid, mode, decoded):
        """Move ``rid`` from ``a``; returns (pre-copy bytes, final bytes, seconds from the stop to
        the import done, downtime s, B's decode step s, B's token ids)."""
        outs, pre, pre_bytes = {}, None, 0
        if mode == "incremental":
            pre, pre_bytes, _ = move(a, self.b, rid, stop=False)
            for _ in range(decoded):
                a.step()
        t0 = time.perf_counter()
        _, nbytes, moved = move(a, self.b, rid, since=pre)
        first_token(self.b, rid, outs)
        down = time.perf_counter() - t0
        a.abort_request(rid)
        return pre_bytes, nbytes, moved, down, finish(self.b, outs), outs[rid].token_ids


class There:
    """Engine B in another process (``--target``), over a ``Link`` on loopback: a request is
    moved by ``remote.send_request`` / ``receive_request``, chunked, never held twice."""

    def __init__(self, args, dst, top, requests):
        self.link = Link.listen(timeout=timedelta(seconds=600))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--target",
                str(self.link.port),
                "--model",
                args.model,
                "--target-mesh",
                dst,
                "--top",
                str(top),
            ]
            + (["--threads", str(args.threads)] if args.threads else [])
        )
        self.link.accept(timedelta(seconds=600))
        self.link.send_json({"requests": requests})

    def move(self, a, rid, mode, decoded):
        st = send_request(
            a,
            rid,
            self.link,
            incremental=mode == "incremental",
            between=lambda: [a.step() for _ in range(decoded)],
        )
        got = self.link.recv_json()
        return (
            st["bytes"] - st["final_bytes"],
            st["final_bytes"],
            st["downtime_s"],
            got["first"] - st["stopped_at"],
            got["step"],
            got["tokens"],
        )

    def close(self):
        assert self.proc.wait(600) == 0
        self.link.close()


def target(args):
    """``--target PORT``: engine B of ``There``; for each request: import it, step to its first
    token (its time reported), finish it, send back its tokens."""
    b = engine_b(model_path(args.model), args.target_mesh, args.top)
    serve_moves(b, Link.connect("127.0.0.1", args.target, timedelta(seconds=600)))


def serve_moves(b, link):
    """Engine ``b``'s side of ``There`` over ``link`` (closed, and ``b`` with it, at the end)."""
    for _ in range(link.recv_json()["requests"]):
        rid = receive_request(b, link)
        outs = {}
        first_token(b, rid, outs)
        first = time.time()
        step = finish(b, outs)
        link.send_json({"first": first, "step": step, "tokens": outs[rid].token_ids})
    link.close()
    b.close()


def one_context(a, b, n, args, rep):
    prompt = [(97 * i + 13 * rep) % 1000 + 3 for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=2 * args.decoded + 8, ignore_eos=True)
    want = a.generate([prompt], params, use_tqdm=False)[
        0
    ].token_ids  # unmigrated (warms the kernels too)
    row = dict(context=n)
    for mode in ("full", "incremental"):
        rid = a.add_request(
            prompt, params
        )  # the prompt's full blocks come from the prefix cache (computed once)
        while len(a.core.pipeline.get(rid)[0].output_token_ids) < args.decoded:
            a.step()
        pre_bytes, nbytes, moved, down, step, got = b.move(a, rid, mode, args.decoded)
        if mode == "full":
            row.update(full_bytes=nbytes, full_move_s=moved, full_downtime_s=down)
        else:
            # step: B's decode step at this context, the inter-token time the request has there
            # anyway
            row.update(
                pre_copy_bytes=pre_bytes,
                final_bytes=nbytes,
                incremental_move_s=moved,
                incremental_downtime_s=down,
                step_s=step,
            )
        finish(a, {})
        assert got == want, (mode, n, got, want)
    return row


KW = dict(max_num_batched_tokens=8192, timeout=600)


def engine_b(path, dst, top):
    return LLM(path, block_size=32, num_blocks=-(-top // 32) * 2 + 16, **KW, **mesh(dst))


def one_pair(path, pair, args):
    src, dst = pair.split(":")
    top = max(args.contexts) + 4 * args.decoded + 64
    a = LLM(path, block_size=16, num_blocks=-(-top // 16) * 2 + 16, **KW, **mesh(src))
    b = (
        Here(engine_b(path, dst, top))
        if args.transport == "bytes"
        else There(args, dst, top, 2 * len(args.contexts) * args.repeats)
    )
    rows = []
    with a:
        for n in args.contexts:
            runs = [one_context(a, b, n, args, rep) for rep in range(args.repeats)]
            row = dict(
                pair=pair,
                transport=args.transport,
                **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
            )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    (b.b if isinstance(b, Here) else b).close()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="tiny-long",
        help="a preset of benchmarks/models.py, smollm2, or a directory",
    )
    ap.add_argument(
        "--pairs", nargs="+", default=["1:1", "tp2:pp2", "sp2:1"], help="SRC:DST meshes"
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument(
        "--decoded",
        type=int,
        default=4,
        help="tokens decoded before the move (and during the pre-copy)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--transport",
        choices=["bytes", "link"],
        default="bytes",
        help="bytes: B in this process; link: B in another process, over a loopback Link",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--target", type=int, default=None, help=argparse.SUPPRESS
    )  # the process of --transport link
    ap.add_argument("--target-mesh", default="1", help=argparse.SUPPRESS)
    ap.add_argument("--top", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is not None:
        return target(args)

    path = model_path(args.model)
    rows = [row for pair in args.pairs for row in one_pair(path, pair, args)]
    how = (
        "snapshots through bytes, one process"
        if args.transport == "bytes"
        else "target in another process, over a loopback Link"
    )
    mach = machine()
    print(machine_line(mach) + " in this process; each rank of a mesh of N > 1: cores / N threads")
    print(
        f"{describe(args.model)}; {how}; downtime: stop -> first token on the target; median of "
        f"{args.repeats}"
    )
    print(
        "| pair | context | B's decode step | full: bytes | full: downtime | incremental: pre-copy "
        "bytes | final bytes | stop -> imported | downtime | downtime - B's step | vs shortest "
        "context |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(x for x in rows if x["pair"] == r["pair"])
        added = r["incremental_downtime_s"] - r["step_s"]
        print(
            f"| {r['pair']} | {r['context']} | {1e3 * r['step_s']:.1f} ms | "
            f"{r['full_bytes'] / 2**20:.2f} MiB | "
            f"{1e3 * r['full_downtime_s']:.1f} ms | {r['pre_copy_bytes'] / 2**20:.2f} MiB | "
            f"{r['final_bytes'] / 2**10:.1f} KiB | {1e3 * r['incremental_move_s']:.2f} ms | "
            f"{1e3 * r['incremental_downtime_s']:.2f} ms | {1e3 * added:.2f} ms | "
            f"{r['incremental_move_s'] / base['incremental_move_s']:.2f}x / "
            f"{r['incremental_downtime_s'] / base['incremental_downtime_s']:.2f}x |"
        )
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                decoded=args.decoded,
                transport=args.transport,
                rows=rows,
                machine=mach,
            ),
        )


if __name__ == "__main__":
    main()
