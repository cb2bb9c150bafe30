"""One rank of a torchrun world across hosts that a fault ends (tests/test_hosts_faults.py).

``python tests/hosts_fault_worker.py OUT MODE MODEL TIMEOUT``. Every rank writes
``OUT/running<R>`` once the work the fault must hit is under way, then
``OUT/rank<R>.json``: what it saw (``tokens``, ``error``: ``"Type: message"`` of the first
exception, ``error_at``: its ``time.monotonic()``, the clock of every host of one machine).
MODE is

- ``engine``: ``LLM(MODEL, tp=2, pp=2, timeout=TIMEOUT)`` (tp inside a host, pp across): the
  greedy tokens of ``tests.hosts_worker.PROMPTS``, then one call of thousands of steps that
  the fault ends;
- ``ring``: ring attention forward and backward at world 4 (``ring_attention(...,
  timeout=TIMEOUT)``) in a loop until something fails;
- ``idle``: that engine served as ``ringkv serve`` serves it, idle: ranks > 0 in
  ``follow_forever`` (they wait for the driver's next request), rank 0 idle until the file
  ``OUT/go`` appears, then it shuts the followers it reaches down.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringkv
from ringkv.parallel import net


def report(out: str, rank: int, seen: dict) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(path + ".tmp", path)


def running(out: str, rank: int) -> None:
    open(os.path.join(out, f"running{rank}"), "w").close()


def engine(out: str, model: str, timeout: float, seen: dict) -> None:
    from ringkv.engine import LLM, SamplingParams
    from tests.hosts_worker import MAX_TOKENS, PROMPTS

    kw = dict(tp=2, pp=2, block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=4)
    with LLM(model, timeout=timeout, **kw) as llm:
        seen["rank"] = rank = dist.get_rank()
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        seen["tokens"] = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        running(out, rank)
        # one call of thousands of steps (64 requests of 200 tokens, 4 at a time): the fault
        # comes in the middle of a step, not in the handshake between two calls
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        llm.generate(PROMPTS * 16, long, use_tqdm=False)
        seen.update(error="the long call ended before the fault", error_at=time.monotonic())


def idle(out: str, model: str, timeout: float, seen: dict) -> None:
    from ringkv.engine import LLM
    from ringkv.serve import follow_forever

    kw = dict(tp=2, pp=2, block_size=4, num_blocks=64, max_num_seqs=4)
    with LLM(model, timeout=timeout, **kw) as llm:
        seen["rank"] = rank = dist.get_rank()
        running(out, rank)
        if rank:
            follow_forever(llm)
        else:
            end = time.monotonic() + 600  # bounded: the test writes ``go`` long before
            while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < end:
                time.sleep(0.1)
            llm.shutdown_followers()
        seen["idle_until"] = time.monotonic()


def ring(out: str, timeout: float, seen: dict) -> None:
    net.pick_interface()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    seen["rank"] = rank = dist.get_rank()
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 256, 4, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 256, 2, 32, generator=g, requires_grad=True) for _ in range(2))
    for i in range(100000):  # far more hops than the test waits: the fault comes first
        out_ = ringkv.ring_attention(q, k, v, causal=True, timeout=timedelta(seconds=timeout))
        out_.sum().backward()
        if i == 0:
            running(out, rank)
    seen["world"] = world


def main(out: str, mode: str, model: str, timeout: str) -> None:
    seen = dict(rank=int(os.environ["RANK"]), mode=mode, error=None, pid=os.getpid())
    try:
        if mode == "engine":
            engine(out, model, float(timeout), seen)
        elif mode == "ring":
            ring(out, float(timeout), seen)
        elif mode == "idle":
            idle(out, model, float(timeout), seen)
        else:
            raise ValueError(f"mode {mode!r}: engine, ring or idle")
    except Exception as e:  # the fault's error, as the user sees it
        seen["error_at"] = time.monotonic()
        seen["error"] = f"{type(e).__name__}: {e}"
    report(out, seen["rank"], seen)
    if seen["error"]:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
