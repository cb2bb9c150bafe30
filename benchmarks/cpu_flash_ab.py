"""ringkv's CPU flash kernel against torch's fused CPU op, one call at a time, interleaved.

    python benchmarks/cpu_flash_ab.py [--threads 1] [--rounds 7] [--shapes S,H,HKV,D ...] \\
        [--json out.json]

Both backends get the same inputs: q and K/V as (B, S, H, D) views of heads-first memory (what
the ring hands the kernels on CPU), float32; ``sdpa`` repeats K/V heads for GQA as it does in the
ring. Shapes: 4,096 tokens x 8 heads x 64, 4,096 x 4 x 128 and SmolLM2's prefill (2,048 tokens,
9 query heads over 3 K/V heads, 64); causal and full; the forward, and the backward from the
rows' out/lse. Rounds alternate the order of the four calls; the table has the medians and
ours / torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
from benchmarks.models import machine, machine_line, write_json  # noqa: E402
from ringkv.kernels import cpu_flash, sdpa  # noqa: E402
from ringkv.kernels.mask import FULL, OFFSET, Mask  # noqa: E402

SHAPES = [(4096, 8, 8, 64), (4096, 4, 4, 128), (2048, 9, 3, 64)]  # (S, H, Hkv, D)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--shapes", nargs="+", default=None, metavar="S,H,HKV,D", help="instead of the defaults"
    )
    a = p.parse_args(argv)
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in a.shapes] if a.shapes else SHAPES
    if cpu_flash.library() is None:
        print(f"cpu_flash: {cpu_flash.unavailable}")
        return 1
    torch.set_num_threads(a.threads)
    rows, load0, mach = [], os.getloadavg()[0], machine()
    print(machine_line(mach))
    print(
        f"{'S':>6} {'H/Hkv':>6} {'D':>4} {'mask':6} {'pass':4} {'torch':>9} {'ours':>9} "
        f"{'ours/torch':>10}"
    )
    for s, h, hkv, d in shapes:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, h, s, d, generator=g).transpose(
            1, 2
        )  # (B, S, H, D) view, heads-first memory
        k, v = (torch.randn(1, hkv, s, d, generator=g).transpose(1, 2) for _ in range(2))
        for causal in (True, False):
            mask, scale = (Mask(OFFSET, offset=0) if causal else Mask(FULL)), d**-0.5
            out, lse = sdpa.forward(q, k, v, scale, mask)
            dout = torch.randn(out.shape, generator=g)
            calls = {
                ("torch", "fwd"): lambda: sdpa.forward(q, k, v, scale, mask),
                ("ours", "fwd"): lambda: cpu_flash.forward(q, k, v, scale, mask),
                ("torch", "bwd"): lambda: sdpa.backward(dout, q, k, v, out, lse, scale, mask),
                ("ours", "bwd"): lambda: cpu_flash.backward(dout, q, k, v, out, lse, scale, mask),
            }
            for f in calls.values():
                f()  # warm-up (and the kernel's build)
            times = {key: [] for key in calls}
            for r in range(a.rounds):
                for key in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                    t = time.perf_counter()
                    calls[key]()
                    times[key].append(time.perf_counter() - t)
            for pass_ in ("fwd", "bwd"):
                t_torch, t_ours = (
                    sorted(times[(who, pass_)])[a.rounds // 2] for who in ("torch", "ours")
                )
                rows.append(
                    dict(
                        seq=s,
                        heads=h,
                        kv_heads=hkv,
                        head_dim=d,
                        mask="causal" if causal else "full",
                        pass_=pass_,
                        torch_s=t_torch,
                        ours_s=t_ours,
                        ratio=t_ours / t_torch,
                    )
                )
                print(
                    f"{s:>6} {f'{h}/{hkv}':>6} {d:>4} {rows[-1]['mask']:6} {pass_:4} "
                    f"{t_torch:8.3f}s {t_ours:8.3f}s "
                    f"{t_ours / t_torch:10.3f}",
                    flush=True,
                )
    load = f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    print(f"median of {a.rounds} interleaved rounds; {load}")
    if a.json:
        write_json(
            a.json,
            dict(
                threads=mach["threads"],
                rounds=a.rounds,
                load=load,
                torch=torch.__version__,
                rows=rows,
                machine=mach,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
