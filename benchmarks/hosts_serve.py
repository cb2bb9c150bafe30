"""A migrated request's downtime and the K/V bytes it moves, against the link rate, between
two real hosts (issue #45, part 3).

    # as root (network namespaces): SmolLM2-135M (float32: 46,080 K/V bytes a token)
    python benchmarks/hosts_serve.py --rates 100mbit,1gbit,10gbit,none \\
        --contexts 1024 4096 16384 --json out.json

Makes 2 hosts (``tests/hosts.py``: network namespaces on a bridge, each link shaped by tbf).
Engine A runs on host 0, engine B on host 1; requests move from A to B over a ``Link`` between
the hosts' addresses with ``engine/remote.py`` (``send_request`` / ``receive_request``, what
``ringkv serve`` instances run under ``ringkv router``). Per context length and per rate (the
rates inner, the link re-shaped in place between moves, so a change of load falls on all of
them), a request with that many prompt tokens decodes ``--decoded`` tokens on A, then moves,
as ``benchmarks/migration.py``'s ``one_context`` moves it (its functions, run over this link):

- **full**: stop, send the whole snapshot, import: the stream stalls for the whole transfer;
- **incremental**: a pre-copy while the request keeps decoding, then stop and send what is new.

Downtime runs from the stop to the request's first token on B (the time the request's token
stream stalls). Beside the full move's time (stop -> imported) stands the time its bytes take
at the shaped rate (``bytes * 8 / rate``). A (context, rate) whose two transfers would take
more than ``--max-transfer-s`` at that rate is skipped (listed as such). Both moved requests
finish on B with A's unmigrated tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import describe, load_average, machine, machine_line  # noqa: E402
from benchmarks.models import model_path, write_json  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}


def rate_bits(rate: str):
    """``"1gbit"`` -> 1e9; ``"none"`` (unshaped) -> None."""
    if rate == "none":
        return None
    from tests.hosts import _rate_bits

    return _rate_bits(rate)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="smollm2, a benchmarks/models.py preset")
    p.add_argument("--rates", default="100mbit,1gbit,10gbit,none", help="tc units; none: unshaped")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--decoded", type=int, default=4, help="tokens decoded before each move")
    p.add_argument("--max-transfer-s", type=float, default=40.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--port", type=int, default=29671)
    p.add_argument("--timeout", type=float, default=1200, help="seconds for the whole run")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="folder for the hosts' logs (default: temp)")
    p.add_argument("--role", choices=["source", "target"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # host:port of A's link
    p.add_argument("--top", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def plan(args, bytes_per_token: int) -> list:
    """(context, rate) pairs to measure, contexts outer; the rest are skipped."""
    out = []
    for n in args.contexts:
        for rate in args.rates.split(","):
            bits = rate_bits(rate)
            expected = 2 * n * bytes_per_token * 8 / bits if bits else 0.0
            out.append((n, rate, expected <= args.max_transfer_s))
    return out


def source(args) -> None:
    """Engine A on host 0: listens on its address; for each (context, rate) asks the
    orchestrator (stdout / stdin) to shape the link, then moves a request (full, incremental)
    with ``migration.one_context``. Prints each row as JSON."""
    import torch

    from benchmarks.migration import KW, There, one_context
    from ringkv.engine import LLM
    from ringkv.parallel.transfer import Link

    torch.set_num_threads(args.threads)
    host, port = args.peer.rsplit(":", 1)
    a = LLM(model_path(args.model), block_size=16, num_blocks=-(-args.top // 16) * 2 + 16, **KW)
    bpt = a.kv_cache_info()["bytes_per_token"]
    todo = plan(args, bpt)
    link = Link.listen(host, int(port), timeout=timedelta(seconds=args.timeout))
    link.accept(timedelta(seconds=args.timeout))
    link.send_json({"requests": 2 * sum(run for _, _, run in todo)})
    b = There.__new__(There)  # migration.py's mover, over this link (not its own process)
    b.link = link
    say({"bytes_per_token": bpt})
    for n, rate, run in todo:
        if not run:
            say({"row": dict(context=n, rate=rate, skipped=True)})
            continue
        say({"shape": rate})
        assert sys.stdin.readline().strip() == "ok"
        row = one_context(a, b, n, args, 0)  # asserts B's tokens are A's unmigrated ones
        say({"row": dict(row, rate=rate, load=load_average())})
    link.close()
    a.close()


def target(args) -> None:
    """Engine B on host 1: connects to A's link; imports each request, steps it to its first
    token there (the time sent back), finishes it and sends its tokens."""

    import torch

    from benchmarks.migration import engine_b, serve_moves
    from ringkv.parallel.transfer import Link

    torch.set_num_threads(args.threads)
    b = engine_b(model_path(args.model), "1", args.top)
    host, port = args.peer.rsplit(":", 1)
    serve_moves(b, Link.connect(host, int(port), timedelta(seconds=args.timeout)))


def say(obj) -> None:
    print(json.dumps(obj), flush=True)


def run_hosts(args) -> tuple:
    """Both engines on their hosts; returns (bytes per token, rows)."""
    from tests.hosts import Hosts, missing, wait_all

    why = missing()
    if why:
        raise SystemExit(f"hosts_serve.py makes network namespaces: {why}")
    out = args.out or tempfile.mkdtemp(prefix="hosts_serve-")
    os.makedirs(out, exist_ok=True)
    top = max(args.contexts) + 4 * args.decoded + 64
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    h = Hosts(2, rate=None)
    rows, bpt = [], None
    try:
        h.up()
        path = model_path(args.model)  # made here once (a preset), not by both hosts at once
        common = ["--model", path, "--decoded", str(args.decoded), "--top", str(top)]
        common += ["--threads", str(args.threads), "--timeout", str(args.timeout)]
        common += ["--rates", args.rates, "--max-transfer-s", str(args.max_transfer_s)]
        common += ["--contexts", *map(str, args.contexts), "--peer", f"{h.addr(0)}:{args.port}"]
        me = os.path.abspath(__file__)
        logs = [open(os.path.join(out, f"host{i}.log"), "w") for i in range(2)]
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        a = h.run(0, ["python", me, "--role", "source", *common], env=ENV, stderr=logs[0], **pipes)
        b = h.run(
            1,
            ["python", me, "--role", "target", *common],
            env=ENV,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
        )
        for line in a.stdout:
            msg = json.loads(line)
            if "shape" in msg:
                h.shape(None if msg["shape"] == "none" else msg["shape"])
                a.stdin.write("ok\n")
                a.stdin.flush()
            elif "row" in msg:
                rows.append(msg["row"])
                print(f"  {json.dumps(msg['row'])}", file=sys.stderr, flush=True)
            else:
                bpt = msg["bytes_per_token"]
        codes = wait_all([a, b], 60)
        if codes != [0, 0]:
            tails = [open(log.name).read()[-3000:] for log in logs]
            raise RuntimeError(
                f"exit codes {codes}\n--- host 0\n{tails[0]}\n--- host 1\n{tails[1]}"
            )
    finally:
        h.down()
    return bpt, rows


def ms(s: float) -> str:
    return f"{1e3 * s:.1f} ms"


def size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def table(rows: list, max_transfer_s: float) -> str:
    """The rows as a markdown table; adds each row's ``expected_s`` (the full snapshot's bytes
    at the shaped rate; None unshaped) and ``moved_bits_per_s`` (the full move's rate)."""
    out = [
        "| rate | context | K/V bytes | full: stop -> imported | bytes / rate | moved at | full: "
        "downtime | incremental: pre-copy | final | downtime | B's decode step | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            out.append(
                f"| {r['rate']} | {r['context']} | | skipped (> {max_transfer_s:g} s) ||||||||"
            )
            continue
        bits = rate_bits(r["rate"])
        r["expected_s"] = r["full_bytes"] * 8 / bits if bits else None
        r["moved_bits_per_s"] = r["full_bytes"] * 8 / r["full_move_s"]
        expected = ms(r["expected_s"]) if bits else "-"
        out.append(
            f"| {r['rate']} | {r['context']} | {size(r['full_bytes'])} | "
            f"{ms(r['full_move_s'])} | {expected} | {r['moved_bits_per_s'] / 1e6:,.0f} Mbit/s | "
            f"{ms(r['full_downtime_s'])} | {size(r['pre_copy_bytes'])} | "
            f"{size(r['final_bytes'])} | {ms(r['incremental_downtime_s'])} | {ms(r['step_s'])} | "
            f"{r['load']} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "source":
        return source(args)
    if args.role == "target":
        return target(args)
    bpt, rows = run_hosts(args)
    mach = machine(args.threads)
    print(machine_line(mach) + f"; each engine {args.threads} thread(s), one per host")
    print(
        f"{describe(args.model)}, {bpt:,} K/V bytes a token; A on host 0 -> B on host 1 over "
        f"a tbf-shaped veth pair; downtime: stop -> first token on B; {args.decoded} tokens "
        "decoded before the move"
    )
    print(table(rows, args.max_transfer_s))
    if args.json:
        write_json(
            args.json,
            dict(
                model=describe(args.model),
                bytes_per_token=bpt,
                decoded=args.decoded,
                rates=args.rates.split(","),
                rows=rows,
                machine=mach,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
