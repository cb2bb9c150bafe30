"""A Qwen3-Next-shaped hybrid stack (3 gated-DeltaNet layers to 1 attention layer) patched by
``ringkv.patch_model``, against the unpatched model in one process.

    torchrun --standalone --nproc-per-node 2 benchmarks/hybrid.py --seq 4096 8192 \\
        --json results/hybrid_2.json
    python benchmarks/hybrid.py --seq 4096 8192          # world 1: the patched model at sp=1

The layers have Qwen3-Next's head sizes (linear attention: d_k = d_v = 128, conv kernel 4;
attention: head_dim 256, 2 KV heads), fewer heads and a dense MLP so that a CPU can run 16K
tokens. For each sequence length S and mode (``fwd``: eval forward; ``fwdbwd``: training forward
with labels through the chunked loss, and backward) it reports:

- ``base``: one process (rank 0; the others wait) running the unpatched model on the whole
  sequence with N threads (the machine's cores, as DESIGN.md compares on CPU);
  (``--skip-base`` leaves it out: its training step holds ~0.75 GiB per 1K tokens);
- ``sp1``: the same process running the model patched on a group of its own (sp=1: ringkv's
  local kernels, no communication), N threads: the SP overhead without the kernel difference
  (transformers' CPU path and ringkv's torch references are different code);
- ``patched``: every rank with 1 thread, the sequence sharded (zigzag);
- ``ratio``: patched / base and patched / sp1 time per token (the issue's goal at 2 ranks:
  <= 1.15);
- ``peak``: the rise of each rank's resident-set high-water mark during the step (max over
  ranks), base and patched;
- bytes per linear-attention layer per rank and forward, from the shapes
  (``sp.recurrent_heads.layer_bytes``): ``state``: state passing (every piece's final state and
  transition, float32, all-gathered: constant in S), ``heads``: the head-parallel form's
  all-to-alls (its inputs there, its output back: grows with S/N), ``halo``: the convolution's
  tails. The patched rows run ``--method`` (default ``ring``: state passing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
import ringkv  # noqa: E402

from benchmarks.models import load_average, machine, machine_line, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--layers", type=int, default=4, help="3 linear : 1 attention, repeated")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--v-heads", type=int, default=4, help="linear attention value heads")
    p.add_argument("--k-heads", type=int, default=2, help="linear attention key heads")
    p.add_argument("--heads", type=int, default=4, help="attention query heads")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--method", default="ring", choices=["ring", "ulysses", "auto"])
    p.add_argument(
        "--skip-base",
        action="store_true",
        help="no 'base' row: transformers' CPU path holds ~0.65 GiB per 1K tokens in training",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build(a):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    types = (["linear_attention"] * 3 + ["full_attention"]) * (a.layers // 4 + 1)
    cfg = Qwen3NextConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        layer_types=types[: a.layers],
        num_attention_heads=a.heads,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=a.v_heads,
        linear_num_key_heads=a.k_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=0,
        mlp_only_layers=list(range(a.layers)),
        attention_dropout=0.0,
        max_position_embeddings=1 << 20,
    )
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).eval(), cfg


def step(model, ids, mode: str) -> float:
    t = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
    else:
        model.train()
        model(ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
    return time.perf_counter() - t


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def timed(model, ids, mode, iters) -> tuple:
    """(median seconds, peak rise in bytes) over ``iters`` steps after one warm-up."""
    step(model, ids, mode)
    _reset_hwm()
    base = _hwm_kib()
    times = [step(model, ids, mode) for _ in range(iters)]
    return statistics.median(times), (_hwm_kib() - base) * 1024


def layer_bytes(cfg, seq: int, world: int) -> dict:
    """Bytes one rank sends per linear-attention layer (batch 1, float32 activations), from the
    shapes: ringkv.sp.recurrent_heads.layer_bytes for the two forms (tested there against what
    each rank hands to torch.distributed), and the convolution's halo."""
    from ringkv.sp.pieces import seq_pieces
    from ringkv.sp.recurrent import halo_bytes
    from ringkv.sp.recurrent_heads import layer_bytes as forms

    if world == 1:
        return dict(state=0, heads=0, halo=0)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dims = dict(k_heads=cfg.linear_num_key_heads, v_heads=cfg.linear_num_value_heads, d_k=dk)
    dims.update(d_v=dv, itemsize=4)
    pieces = seq_pieces(seq, "zigzag", world)
    out = forms("gdn", dims, pieces, world)
    conv = 2 * cfg.linear_num_key_heads * dk + cfg.linear_num_value_heads * dv
    out["halo"] = halo_bytes(conv, cfg.linear_conv_kernel_dim, pieces, world)
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    solo = dist.new_group([0]) if world > 1 else None  # rank 0 alone: the sp=1 row
    cores = os.cpu_count() or 1
    rows = []
    for mode in a.modes:
        for seq in a.seq:
            ids = torch.randint(0, a.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
            base = sp1 = (None, None)
            if rank == 0:
                torch.set_num_threads(cores)
                model, cfg = build(a)
                if not a.skip_base:
                    base = timed(model, ids, mode, a.iters)
                ringkv.patch_model(model, layout="zigzag", group=solo)
                sp1 = timed(model, ids, mode, a.iters)
                del model
            if world > 1:
                dist.barrier()
            torch.set_num_threads(1 if world > 1 else cores)
            model, cfg = build(a)
            ringkv.patch_model(model, layout="zigzag", method=a.method)
            t, peak = timed(model, ids, mode, a.iters)
            peaks = [None] * world
            if world > 1:
                dist.all_gather_object(peaks, peak)
            else:
                peaks = [peak]
            del model
            if rank == 0:
                row = dict(mode=mode, seq=seq, world=world, method=a.method)
                row.update(base_s=base[0], sp1_s=sp1[0])
                ratio = None if base[0] is None else t / base[0]
                row.update(patched_s=t, ratio=ratio, ratio_sp1=t / sp1[0])
                row.update(base_peak=base[1], sp1_peak=sp1[1], patched_peak=max(peaks))
                row.update(layer_bytes(cfg, seq, world))
                rows.append(row)
                print(_line(row), flush=True)
    if rank == 0:
        print(machine_line(machine(threads=[cores, 1])), "| load", load_average())
        if a.json:
            write_json(a.json, dict(args=vars(a), rows=rows, load=load_average()))
    if world > 1:
        dist.destroy_process_group()
    return 0


def _line(r: dict) -> str:
    mib = 1 << 20
    skip = r["base_s"] is None
    base = "-" if skip else f"{r['base_s']:.2f}s"
    ratio = "-" if skip else f"{r['ratio']:.2f}"
    base_peak = "-" if skip else f"{r['base_peak'] / mib:.0f}"
    return (
        f"{r['mode']:6} S={r['seq']:6} N={r['world']}  base {base}  "
        f"sp1 {r['sp1_s']:.2f}s  patched {r['patched_s']:.2f}s  ratio {ratio} / "
        f"{r['ratio_sp1']:.2f}  peak {base_peak} / {r['sp1_peak'] / mib:.0f} -> "
        f"{r['patched_peak'] / mib:.0f} MiB  bytes/layer state {r['state']} heads {r['heads']} "
        f"halo {r['halo']}"
    )


if __name__ == "__main__":
    sys.exit(main())
