"""KV migration: bytes moved and the time a request is stopped, full vs incremental.

    python benchmarks/migration.py --contexts 1024 4096 16384 32768 --json results/migration.json

For each context length a request with that many prompt tokens runs on engine A until it
has ``--decoded`` tokens, then moves to engine B (same process; the snapshot goes through
``to_bytes``/``from_bytes``, the serialisation a file or a process group carries):

- **full**: ``export_request`` (stop) -> bytes -> ``import_request``; downtime is the whole of it;
- **incremental** (pre-copy, as in Llumnix): a snapshot is exported while the request keeps
  running and imported into B (not downtime); A computes ``--decoded`` more tokens; then the
  request stops and only what is new since the pre-copy moves: downtime is that last step.

Both migrated requests then finish on B and must produce A's unmigrated tokens (checked).
Downtime is the median of ``--repeats``. Goal: incremental downtime at the longest context
<= 1.2x the shortest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from ringkv.engine import LLM, KVSnapshot, SamplingParams  # noqa: E402


def move(a, b, rid, since=None, stop=True):
    t = time.perf_counter()
    snap = a.export_request(rid, since=since, stop=stop)
    data = snap.to_bytes()
    b.import_request(KVSnapshot.from_bytes(data))
    return snap, len(data), time.perf_counter() - t


def finish(engine):
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return out


def one_context(path, n, args, rep):
    kw = dict(block_size=16, num_blocks=-(-(n + 256) // 16) * 2 + 16, max_num_batched_tokens=8192)
    a, b = LLM(path, **kw), LLM(path, **kw)
    prompt = [(97 * i + 13 * rep) % 1000 + 3 for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=2 * args.decoded + 8, ignore_eos=True)
    want = a.generate([prompt], params, use_tqdm=False)[0].token_ids  # unmigrated (warms the kernels too)
    row = dict(context=n)
    for mode in ("full", "incremental"):
        rid = a.add_request(prompt, params, cache_salt=f"{mode}{rep}")  # no prefix hits from earlier runs
        while len(a._active[rid][0].output_token_ids) < args.decoded:
            a.step()
        if mode == "full":
            _, nbytes, down = move(a, b, rid)
            row.update(full_bytes=nbytes, full_downtime_s=down)
        else:
            pre, pre_bytes, pre_s = move(a, b, rid, stop=False)
            for _ in range(args.decoded):
                a.step()
            _, nbytes, down = move(a, b, rid, since=pre)
            row.update(pre_copy_bytes=pre_bytes, pre_copy_s=pre_s, final_bytes=nbytes, incremental_downtime_s=down)
        a.abort_request(rid)
        got = finish(b)[rid]
        assert got == want, (mode, n, got, want)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-long", help="a preset of benchmarks/models.py, smollm2, or a directory")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--decoded", type=int, default=4, help="tokens decoded before the move (and during the pre-copy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from models import describe, model_path, write_json

    path = model_path(args.model)
    rows = []
    for n in args.contexts:
        runs = [one_context(path, n, args, rep) for rep in range(args.repeats)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    base = rows[0]["incremental_downtime_s"]
    print(f"{describe(args.model)}, one process, snapshots through bytes, median of {args.repeats}")
    print("| context | full: bytes | full: downtime | incremental: pre-copy bytes | final bytes | downtime | "
          "downtime / shortest context's |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['full_bytes'] / 2**20:.2f} MiB | {1e3 * r['full_downtime_s']:.1f} ms | "
              f"{r['pre_copy_bytes'] / 2**20:.2f} MiB | {r['final_bytes'] / 2**10:.1f} KiB | "
              f"{1e3 * r['incremental_downtime_s']:.2f} ms | {r['incremental_downtime_s'] / base:.2f}x |")
    if args.json:
        write_json(args.json, dict(model=describe(args.model), decoded=args.decoded, rows=rows))


if __name__ == "__main__":
    main()
