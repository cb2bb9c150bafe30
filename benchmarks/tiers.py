"""TTFT of a request whose prompt prefix is recomputed, promoted from the host tier, promoted from
the disk tier, or pulled from another engine (issue #44: pulled or promoted <= 0.5x recompute).

    python benchmarks/tiers.py --prefix-tokens 2048 8128 --reps 3 --json results/tiers.json

Two engines of the same model (``--model``: SmolLM2-135M by default) in this process, each with a
device pool of one request (the longest prompt plus its output and a spare block):

- ``E``: the host tier on (its default size: as large as the device pool);
- ``D``: no host tier (``kv_host_memory=0``), the disk tier in ``--disk-dir`` (a temporary folder
  by default): what the device evicts goes straight to disk.

Each repetition takes a fresh random prompt (``prefix + suffix`` token ids, never seen before) and
measures, in this order (so the paths alternate across repetitions), one request each with 1
output token (TTFT = the whole ``generate`` call: admission, promotion or prefill, the first
token):

1. ``recompute``: the prompt on ``E``, cold: every token computed.
2. ``pull``: ``E.export_prefix`` (its device blocks pinned and gathered) -> ``send_prefix`` over a
   ``ringkv.parallel.transfer.Link`` on loopback (sent by a second thread) -> ``recv_prefix`` ->
   ``D.import_prefix`` -> the prompt on ``D``. The link is connected first (untimed: a peer keeps
   its link); timed from the export to the first token.
3. ``host``: ``E``'s device cache flushed to its tiers (untimed; the flush takes every free block
   as a burst of other requests would, so each cached block is evicted to the host tier), then
   the prompt on ``E``: its blocks promoted from host memory.
4. ``disk``: ``D``'s device cache flushed (to disk), its files synced and dropped from the page
   cache (``posix_fadvise(DONTNEED)``: read from the disk, not from memory), then the prompt on
   ``D``: its blocks promoted from disk.

The warm requests repeat the cold request's prompt, so their first token must equal the cold
one's (``same token``) and their cached tokens must equal the prompt's whole blocks but the last
token (``cached``): the cold run computed every token, the warm ones compute only the tail of the
last block. p50 over the repetitions; ``vs recompute`` = p50 / recompute's p50, in the same run.
The pull cost model's inputs are measured too: bytes per token (the exported K/V), the link's
bytes/s and the prefill's tokens/s (prompt tokens / recompute p50): a pull pays when
``bytes / link rate < tokens / prefill rate``. Load averages are printed with every size: other
processes on the cores change every timing.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import describe, machine, machine_line, model_path, write_json  # noqa: E402

PATHS = ("recompute", "pull", "host", "disk")
GOAL = 0.5  # pulled or promoted TTFT p50 / recompute's


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


def flush(llm) -> float:
    """Evict every cached device block of ``llm`` (to its tiers, if it has any) by taking all free
    blocks and giving them back, as a burst of other requests would; returns the seconds it took
    (the tiers' copies). Only between requests: the engine is idle."""
    t0 = time.perf_counter()
    taken = llm.core.blocks.allocate(llm.core.blocks.num_free)
    llm.core.blocks.free(taken)
    return time.perf_counter() - t0


def drop_page_cache(folder: str) -> int:
    """Sync the files under ``folder`` and drop them from the page cache, so the next read comes
    from the disk; returns the bytes they hold."""
    total = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def request(llm, ids, params) -> dict:
    """One request (the whole ``generate`` call, 1 output token): seconds, first token, cached
    prompt tokens."""
    t0 = time.perf_counter()
    (out,) = llm.generate([ids], params, use_tqdm=False)
    return dict(
        seconds=time.perf_counter() - t0,
        token=out.outputs[0].token_ids[0],
        cached=out.num_cached_tokens,
    )


class Peer:
    """A loopback ``Link`` whose far end (a thread) sends each ``PrefixKV`` it is given: the
    holder's side of a pull."""

    def __init__(self, timeout_s: float):
        from datetime import timedelta

        from ringkv.engine.remote import send_prefix
        from ringkv.parallel.transfer import Link

        self.timeout = timedelta(seconds=timeout_s)
        self.todo, self.done, self.error = threading.Semaphore(0), threading.Semaphore(0), None
        self.prefix, self.sent, self._send, self.closed = None, 0, send_prefix, False
        self.link = Link.listen("127.0.0.1", 0, timeout=self.timeout)
        self.thread = threading.Thread(target=self._serve, args=(self.link.port,), daemon=True)
        self.thread.start()
        self.link.accept()

    def _serve(self, port: int) -> None:
        from ringkv.parallel.transfer import Link

        with Link.connect("127.0.0.1", port, timeout=self.timeout) as link:
            while not self.closed:
                if not self.todo.acquire(timeout=1.0):
                    continue  # idle between pulls (a cold prefill may take minutes)
                if self.closed:
                    return
                try:
                    self.sent = self._send(link, self.prefix)
                except Exception as e:  # noqa: BLE001 - reported by pull()
                    self.error = e
                self.done.release()

    def pull(self, holder, receiver, ids) -> dict:
        """``holder``'s cached prefix of ``ids`` into ``receiver``: export, send, receive,
        import; seconds of each, bytes moved, tokens imported."""
        from ringkv.engine.remote import recv_prefix

        t0 = time.perf_counter()
        self.prefix = holder.export_prefix(ids)
        if self.prefix is None:
            raise RuntimeError("the holder holds no prefix of the prompt")
        t1 = time.perf_counter()
        self.todo.release()
        got = recv_prefix(self.link)
        if not self.done.acquire(timeout=self.timeout.total_seconds()) or self.error:
            raise RuntimeError(f"sending the prefix failed: {self.error}")
        t2 = time.perf_counter()
        imported = receiver.import_prefix(got)
        t3 = time.perf_counter()
        return dict(
            export_s=t1 - t0,
            transfer_s=t2 - t1,
            import_s=t3 - t2,
            bytes=self.sent,
            prefix_bytes=got.nbytes,
            prefix_tokens=len(got.token_ids),
            imported=imported,
        )

    def close(self) -> None:
        self.closed = True
        self.todo.release()
        self.thread.join(timeout=self.timeout.total_seconds())
        self.link.close()


def summary(samples: list, key: str = "seconds") -> dict:
    xs = [s[key] for s in samples]
    return dict(p50=statistics.median(xs), min=min(xs), max=max(xs))


def measure(E, D, peer, P: int, args, rng: random.Random, vocab: int, params) -> dict:
    """``args.reps`` repetitions of the four paths at a prefix of ``P`` tokens (see the module
    docstring)."""
    samples = {p: [] for p in PATHS}
    load_before = load()
    for _ in range(args.reps):
        ids = [rng.randrange(3, vocab) for _ in range(P + args.suffix_tokens)]
        cold = request(E, ids, params)
        samples["recompute"].append(cold)
        pulled = peer.pull(E, D, ids)
        req = request(D, ids, params)
        pulled.update(req, request_s=req["seconds"])
        pulled["seconds"] += pulled["export_s"] + pulled["transfer_s"] + pulled["import_s"]
        samples["pull"].append(pulled)
        evict = flush(E)
        samples["host"].append(dict(request(E, ids, params), evict_s=evict))
        evict = flush(D)
        on_disk = drop_page_cache(args.disk_dir)
        samples["disk"].append(dict(request(D, ids, params), evict_s=evict, disk_bytes=on_disk))
        flush(D)  # the next pull imports into an empty pool
        for p in PATHS[1:]:
            s = samples[p][-1]
            s["same_token"] = s["token"] == cold["token"]
    expected = (len(ids) - 1) // args.block_size * args.block_size
    base = statistics.median(s["seconds"] for s in samples["recompute"])
    rows = {}
    bytes_per_token = E.kv_cache_info()["bytes_per_token"]
    for p in PATHS:
        ss = samples[p]
        row = dict(summary(ss), ratio=statistics.median(s["seconds"] for s in ss) / base)
        row.update(
            cached_tokens=[s["cached"] for s in ss],
            expected_cached=0 if p == "recompute" else expected,
            same_token=None if p == "recompute" else all(s["same_token"] for s in ss),
            samples=ss,
        )
        if p != "recompute":
            moved = statistics.median(s["cached"] for s in ss) * bytes_per_token
            row["bytes_moved"] = moved
            if p == "pull":
                row["bytes_moved"] = statistics.median(s["bytes"] for s in ss)
                row["link_bytes_s"] = statistics.median(s["bytes"] / s["transfer_s"] for s in ss)
                for k in ("export_s", "transfer_s", "import_s", "request_s"):
                    row[k] = statistics.median(s[k] for s in ss)
            else:
                row["evict_s"] = statistics.median(s["evict_s"] for s in ss)
        rows[p] = row
    pull = rows["pull"]
    per_token = statistics.median(s["prefix_bytes"] / s["prefix_tokens"] for s in samples["pull"])
    prefill = len(ids) / base
    cost = dict(
        bytes_per_token=per_token,
        link_bytes_s=pull["link_bytes_s"],
        prefill_tokens_s=prefill,
        pull_s_predicted=expected * per_token / pull["link_bytes_s"],
        recompute_s_predicted=expected / prefill,
    )
    return dict(
        prefix_tokens=P,
        prompt_tokens=len(ids),
        expected_cached=expected,
        rows=rows,
        cost_model=cost,
        load_before=load_before,
        load_after=load(),
    )


def report(results: dict, args) -> None:
    print(machine_line(results["machine"]))
    print(
        f"{describe(args.model)}; block size {args.block_size}; suffix {args.suffix_tokens} tokens,"
        f" 1 output token; {args.reps} repetitions per path (p50, min-max); E: host tier, D: disk "
        "tier (page cache dropped), pull E -> D over a loopback Link (a second thread)"
    )
    print(
        "| prefix tokens | path | TTFT p50 (s) | min - max (s) | vs recompute | cached tokens "
        "(expected) | same token | MB moved | MB/s (pull: link; host, disk: moved / TTFT) | "
        "load 1/5/15 min |"
    )
    print("|---:|---|---:|---|---:|---|---|---:|---:|---|")
    for size in results["sizes"]:
        for p in PATHS:
            r = size["rows"][p]
            mb = r.get("bytes_moved")
            warm_s = r.get("request_s") if p == "pull" else None
            rate = (
                r["link_bytes_s"]
                if p == "pull"
                else (mb / (r["p50"] - (warm_s or 0)) if mb else None)
            )
            cached = sorted(set(r["cached_tokens"]))
            print(
                f"| {size['prefix_tokens']} | {p} | {r['p50']:.3f} | {r['min']:.3f} - "
                f"{r['max']:.3f} | {r['ratio']:.2f}x | {'/'.join(map(str, cached))} "
                f"({r['expected_cached']}) | {'-' if r['same_token'] is None else r['same_token']}"
                f" | {'-' if mb is None else f'{mb / 1e6:.1f}'} | "
                f"{'-' if rate is None else f'{rate / 1e6:.0f}'} | "
                f"{' '.join(map(str, size['load_after']))} |"
            )
    print()
    for size in results["sizes"]:
        pr, c = size["rows"]["pull"], size["cost_model"]
        print(
            f"{size['prefix_tokens']} tokens: pull = export {pr['export_s']:.3f} + transfer "
            f"{pr['transfer_s']:.3f} + import {pr['import_s']:.3f} + request {pr['request_s']:.3f}"
            f" s; evict to host {size['rows']['host']['evict_s']:.3f} s, to disk "
            f"{size['rows']['disk']['evict_s']:.3f} s (untimed); cost model: "
            f"{c['bytes_per_token']:.0f} B/token, link {c['link_bytes_s'] / 1e6:.0f} MB/s, "
            f"prefill {c['prefill_tokens_s']:.0f} tokens/s -> pull {c['pull_s_predicted']:.3f} s"
            f" vs recompute {c['recompute_s_predicted']:.3f} s; load before "
            f"{' '.join(map(str, size['load_before']))}"
        )
    for name, g in results["goals"].items():
        print(f"goal: {name}: {g['value']:.2f} -> {'met' if g['met'] else 'NOT met'}")
    print(f"load averages (1, 5, 15 min) at the end: {' '.join(map(str, load()))}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2", help="smollm2, a preset or a directory")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[2048, 8128])
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per path and size")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--disk-dir", default=None, help="the disk tier (default: a temporary folder)")
    ap.add_argument("--link-timeout", type=float, default=120.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.suffix_tokens < 1 or min(args.prefix_tokens) < 1:
        ap.error("--reps, --suffix-tokens and --prefix-tokens must be >= 1")
    import torch

    from ringkv.engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    longest = max(args.prefix_tokens) + args.suffix_tokens + 1
    num_blocks = -(-longest // args.block_size) + 1
    own_dir = args.disk_dir is None
    args.disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="ringkv-tiers-bench-")
    load0 = load()
    common = dict(block_size=args.block_size, num_blocks=num_blocks)
    E = D = peer = None
    try:
        E = LLM(path, **common)
        # the disk holds 2 prompts: the one measured and the one before
        disk_size = 2 * num_blocks * args.block_size * E.kv_cache_info()["bytes_per_token"]
        D = LLM(path, **common, kv_host_memory=0, kv_disk=args.disk_dir, kv_disk_size=disk_size)
        if D.max_model_len < longest:
            ap.error(
                f"the model holds {D.max_model_len} tokens; the longest prompt needs {longest}"
            )
        peer = Peer(args.link_timeout)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        vocab = E.config.vocab_size
        rng = random.Random(args.seed)
        warm = 2 * args.block_size + 3  # every path once, untimed (first calls, page faults)
        measure(
            E, D, peer, warm, argparse.Namespace(**{**vars(args), "reps": 1}), rng, vocab, params
        )
        sizes = [measure(E, D, peer, P, args, rng, vocab, params) for P in args.prefix_tokens]
    finally:
        for x in (peer, E, D):
            if x is not None:
                x.close()
        if own_dir:
            shutil.rmtree(args.disk_dir, ignore_errors=True)
    worst = max(s["rows"][p]["ratio"] for s in sizes for p in PATHS[1:])
    results = dict(
        model=describe(args.model),
        args=vars(args),
        machine=machine(),
        load_start=load0,
        load_end=load(),
        sizes=sizes,
        goals={
            "worst pulled/promoted TTFT p50 / recompute's (<= 0.5)": dict(
                value=worst, met=worst <= GOAL
            )
        },
    )
    report(results, args)
    print(f"load averages (1, 5, 15 min) at the start: {' '.join(map(str, load0))}")
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
