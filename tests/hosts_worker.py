"""One rank of a torchrun world across hosts (tests/test_hosts.py).

``python tests/hosts_worker.py OUT CHECKS [MODEL]``: CHECKS is a comma list of ``pp`` or ``sp``
(``LLM(MODEL, tp=2, pp=2)`` or ``LLM(MODEL, tp=2, sp=2)`` greedy tokens, the sp one ringing
prompts of 16 tokens or more; the engine makes the process group, choosing the socket interface
itself), ``ring`` (ring attention forward and backward against single-device
attention, every layout) and ``train`` (a tiny HF Llama patched with ``ringkv.patch_model`` over
the world: loss and every parameter's gradient against the unpatched model in this process).
Writes what this rank saw to ``OUT/rank<R>.json``. An interface that cannot be chosen ends the
process with ringkv's error before any group is made.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist

import ringkv
from ringkv.kernels import attention
from ringkv.parallel import net
from tests.ring_cases import forward_backward

PROMPTS = [[5, 9, 17, 3, 44, 90, 7], [11, 12, 13], list(range(20, 60)), [100, 4, 4, 4, 8, 1]]
MAX_TOKENS = 8


def engine(model: str, across: str) -> list:
    """Greedy tokens of ``PROMPTS`` on ``LLM(model, tp=2, <across>=2)``."""
    from ringkv.engine import LLM, SamplingParams

    kw = dict(tp=2, block_size=4, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=4)
    if across == "sp":
        kw.update(max_num_batched_tokens=64, sp_prefill_min_tokens=16)
    with LLM(model, timeout=60, **{across: 2}, **kw) as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
        )
        return [o.token_ids for o in outs]


def ring(rank: int, world: int) -> list:
    """Each layout, causal and not: this rank's out, lse, dq, dk, dv against its shard of the
    single-device result. Returns the mismatches (empty: exact to fp32 rounding)."""
    ctx = types.SimpleNamespace(rank=rank, world=world, group=None)
    bad = []
    for layout in ringkv.LAYOUTS:
        for causal in (True, False):
            g = torch.Generator().manual_seed(7)
            q = torch.randn(2, 8 * world, 4, 16, generator=g)
            k, v = (torch.randn(2, 8 * world, 2, 16, generator=g) for _ in range(2))
            dout = torch.randn(q.shape, generator=g)
            got = forward_backward(ctx, q, k, v, dout, None, causal, layout, None, "auto")[:5]
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            out, lse = attention(qr, kr, vr, causal=causal, backend="reference")
            (out.float() * dout).sum().backward()
            want = [out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad]
            for name, a, full, dim in zip(
                ["out", "lse", "dq", "dk", "dv"], got, want, [1, 2, 1, 1, 1]
            ):
                b = ringkv.shard(full, dim, layout, rank=rank, world=world)
                err = (a.float() - b.float()).abs().max().item()
                if not err <= 2e-5 * max(1.0, b.abs().max().item()) + 2e-4 * b.abs().max().item():
                    bad.append(f"{layout} causal={causal} {name}: max error {err:.3g}")
    return bad


def train(rank: int, world: int) -> dict:
    """A forward with labels and a backward of one 32-token sequence through a tiny HF Llama
    patched over the world (``patch_model(model, sp=world)``, zigzag, every rank passing the
    whole sequence), the gradients summed over the world as a data-parallel all-reduce would;
    against the unpatched model in this process. Returns the loss and the mismatches (empty:
    equal to fp32 rounding)."""
    from tests.hf_cases import build, train_step

    ctx = types.SimpleNamespace(rank=rank, world=world, group=None)
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(11))
    got = train_step(ctx, "llama", 0, ids, "zigzag", "full")
    model = build("llama", 0).train()
    want = model(ids, labels=ids, use_cache=False)
    want.loss.backward()
    bad = []
    if abs(got["loss"] - want.loss.item()) > 1e-5 * max(1.0, abs(want.loss.item())):
        bad.append(f"loss {got['loss']} != {want.loss.item()}")
    for name, p in model.named_parameters():
        g = got["grads"][name].contiguous()
        dist.all_reduce(g)  # the patched model's gradient: the sum of the ranks' parts
        scale = max(1.0, p.grad.abs().max().item())
        err = (g - p.grad).abs().max().item()
        if not err <= 2e-5 * scale + 1e-4 * p.grad.abs().max().item():
            bad.append(f"grad {name}: max error {err:.3g}")
    return dict(loss=got["loss"], bad=bad, params=len(got["grads"]))


def main(out: str, checks: str, model: str = "") -> None:
    t0 = time.monotonic()
    checks = checks.split(",")
    seen = dict(local_rank=int(os.environ["LOCAL_RANK"]), master=os.environ.get("MASTER_ADDR"))
    across = [c for c in checks if c in ("pp", "sp")]
    if across:  # the engine picks the interface and makes the group
        seen["tokens"] = engine(model, across[0])
    else:
        net.pick_interface()
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    seen.update(rank=rank, world=world, gloo=os.environ.get("GLOO_SOCKET_IFNAME"))
    seen["nccl"] = os.environ.get("NCCL_SOCKET_IFNAME")
    if "ring" in checks:
        seen["ring"] = ring(rank, world)
    if "train" in checks:
        seen["train"] = train(rank, world)
    dist.barrier()
    seen["seconds"] = time.monotonic() - t0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
