"""Peak memory per rank of one DPO step (policy forward + backward, reference forward) with the
patched model's chunked per-token log-probs, against TRL's unpatched logits path (issue #59).

    torchrun --standalone --nproc-per-node 2 benchmarks/dpo_memory.py --per-rank 8192 \\
        --json results/dpo_memory.json

Each rank holds ``--per-rank`` tokens of a chosen and of a rejected sequence (``2 x per-rank``
tokens in all), SmolLM2-shaped (``--model``, default its 2-layer shape: vocabulary 49152):

- ``trl``: the unpatched policy and reference in one process (rank 0; the others wait) on the
  whole ``2 x per-rank`` tokens of a rank: the batch ``[chosen; rejected]`` through the model, its
  ``(2, S, V)`` logits to TRL's ``selective_log_softmax`` (``trl.trainer.utils``, what
  ``DPOTrainer`` calls on logits), the reference the same under ``no_grad``, DPO's sigmoid loss,
  backward.
- ``chunked``: both models ``patch_model``-ed over the group, sequences of ``N x per-rank`` tokens
  sharded (zigzag): ``per_token=True`` log-probs (never the logits) summed per sequence across the
  group (``ringkv.sequence_sums``), the same loss and backward.

Memory: ``benchmarks/train_memory.py``'s ``alloc`` (the step's peak of torch CPU allocations above
what it held before: the profiler's memory events) and ``rss`` (the rise of the resident-set
high-water mark); the maximum over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import load_average, machine, model_path, write_json  # noqa: E402
from benchmarks.train_memory import (  # noqa: E402
    _fix_malloc,
    _profiled_peak,
    _reset_hwm,
    _status_kib,
    _trim,
)

BETA = 0.1


def _models(name: str):
    """The policy and the reference: one random model's weights (benchmarks/models.py's preset,
    written by rank 0), the same on every rank."""
    import torch.distributed as dist
    import transformers

    if dist.get_rank() == 0:
        model_path(name)
    dist.barrier()
    out = [transformers.AutoModelForCausalLM.from_pretrained(model_path(name)) for _ in range(2)]
    out[1].eval().requires_grad_(False)
    return out


def _loss(pol, ref):
    # pol/ref (2,): log-probs of [chosen, rejected] -> DPO's sigmoid loss
    import torch.nn.functional as F

    return -F.logsigmoid(BETA * ((pol[0] - ref[0]) - (pol[1] - ref[1])))


def trl_step(policy, reference, ids) -> None:
    """TRL's path: logits, then ``selective_log_softmax`` on them (ids (2, S))."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    def logps(model):
        logits = model(ids, use_cache=False).logits[:, :-1]  # (2, S-1, V)
        return selective_log_softmax(logits, ids[:, 1:]).sum(-1)  # (2,)

    with torch.no_grad():
        ref = logps(reference)
    _loss(logps(policy), ref).backward()


def chunked_step(policy, reference, ids, group) -> None:
    """The patched path: ``per_token`` log-probs summed over the group (ids (2, S) whole)."""
    import torch

    import ringkv

    def logps(model):
        out = model(input_ids=ids, labels=ids, per_token=True, use_cache=False)
        assert out.logits is None
        return ringkv.sequence_sums(out.log_probs, group)  # (2,)

    with torch.no_grad():
        ref = logps(reference)
    _loss(logps(policy), ref).backward()


def measure(step) -> dict:
    from torch.profiler import ProfilerActivity, profile

    _trim()
    rss0, hwm = _status_kib("VmRSS"), _reset_hwm()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    seconds = time.perf_counter() - t
    rss = (_status_kib("VmHWM") - rss0) * 1024 if hwm else None
    return dict(alloc=_profiled_peak(prof), rss=rss, seconds=seconds)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    import ringkv

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-shape-2l")
    ap.add_argument("--per-rank", type=int, default=8192, help="tokens per sequence per rank")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    _fix_malloc()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    load_before = load_average()
    g = torch.Generator().manual_seed(1)
    results = {}
    policy, reference = _models(a.model)
    vocab = policy.config.vocab_size
    if rank == 0:  # TRL's path on one rank's tokens
        ids = torch.randint(3, vocab, (2, a.per_rank), generator=g)
        trl_step(policy, reference, ids[:, :256])  # warm-up
        policy.zero_grad(set_to_none=True)
        results["trl"] = measure(lambda: trl_step(policy, reference, ids))
    dist.barrier()
    policy.zero_grad(set_to_none=True)
    for m in (policy, reference):
        ringkv.patch_model(m)
    policy.train()
    g = torch.Generator().manual_seed(2)  # the same tokens on every rank
    ids = torch.randint(3, vocab, (2, a.per_rank * world), generator=g)
    chunked_step(policy, reference, ids[:, : 256 * world], None)  # warm-up
    policy.zero_grad(set_to_none=True)
    mine = measure(lambda: chunked_step(policy, reference, ids, None))
    got = [None] * world
    dist.all_gather_object(got, mine)
    results["chunked"] = {k: max(r[k] or 0 for r in got) for k in ("alloc", "rss", "seconds")}
    if rank == 0:
        r = dict(
            args=vars(a),
            machine=machine(),
            world=world,
            results=results,
            ratio=dict(
                alloc=results["chunked"]["alloc"] / results["trl"]["alloc"],
                rss=results["chunked"]["rss"] / results["trl"]["rss"],
            ),
            load=[load_before, load_average()],
        )
        print(json.dumps(r, indent=1))
        if a.json:
            write_json(a.json, r)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
