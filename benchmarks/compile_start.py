"""Engine start-up seconds on SmolLM2-135M-Instruct (CPU, fp32): eager against ``compile_decode``
cold (an empty compile cache), warm (the cache the cold start left) and ``"auto"`` with its
verdict cached, each start in a fresh process (``LLM(...)`` construction timed, imports not).

    python benchmarks/compile_start.py --threads 2 --json results/compile_start.json

``--cache DIR``: the ``RINGKV_CACHE`` the compiled starts use (default: a new temp directory, so
the first compiled start is cold). Prints one JSON line per start and a table; the load average
is printed with each (this is a timing of a whole compile: other jobs on the machine move it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

CHILD = r"""
import json, os, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from ringkv.engine import LLM
from ringkv.model.smollm2 import smollm2_path
path = smollm2_path()
mode = sys.argv[1]
value = {"eager": False, "compiled": True, "auto": "auto"}[mode]
t = time.perf_counter()
llm = LLM(path, block_size=16, num_blocks=256, max_num_seqs=16, compile_decode=value)
start = time.perf_counter() - t
info = llm.kv_cache_info()["compile"]
print(json.dumps(dict(mode=mode, start_s=round(start, 2), on=info.get("on"), by=info.get("by"),
                      artifacts=info.get("artifacts"), compile_s=info.get("compile_s"),
                      load=os.getloadavg()[0])))
os._exit(0)
"""


def run(mode: str, threads: int, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(threads)], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"the {mode} start failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="ringkv-compile-")
    env = dict(os.environ, RINGKV_CACHE=cache)
    env.pop("RINGKV_COMPILE_DECODE", None)
    t = time.time()
    rows = [
        run("eager", args.threads, env),
        run("compiled", args.threads, env),  # cold, when the cache is new
        run("compiled", args.threads, env),  # warm
        run("auto", args.threads, env),  # measures (compiling warm), caches the verdict
        run("auto", args.threads, env),  # the cached verdict
        run("eager", args.threads, env),
    ]
    eager = min(r["start_s"] for r in rows if r["mode"] == "eager")
    print(f"\n{'start':<28}{'seconds':>9}{'over eager':>12}  artifacts / by   load")
    names = ["eager", "compiled (1st)", "compiled (2nd)", "auto (1st)", "auto (2nd)", "eager"]
    for name, r in zip(names, rows):
        print(
            f"{name:<28}{r['start_s']:>9.1f}{r['start_s'] - eager:>+12.1f}  "
            f"{r['artifacts'] or ''} / {r['by']} (on={r['on']})  {r['load']:.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, threads=args.threads, cache=cache, began=t), f, indent=1)


if __name__ == "__main__":
    main()
