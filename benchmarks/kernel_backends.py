"""Kernel micro-benchmark: time and TFLOP/s of every attention backend usable on a device,
and GB/s of paged decode against the device's copy bandwidth.

    python benchmarks/kernel_backends.py                       # CPU: fp32, S in {1024, 4096}
    python benchmarks/kernel_backends.py --quick --json out.json
    # bf16, D in {64, 128}, S in {4096, 16384}
    python benchmarks/kernel_backends.py --device cuda

Backends come from the registry (``ringkv.kernels.BACKENDS``: every one whose ``supports()``
accepts the inputs) and run through ``block_forward``/``block_backward`` with a ``make_mask``
mask, so what is timed is what the ring calls. On CUDA, torch SDPA (flash / efficient /
cuDNN, forced with ``sdpa_kernel``) and the flash-attn package, when installed, are baselines.

FLOPs count only unmasked work: forward ``4 * B * H * D * visible_pairs`` (QK^T and PV),
backward 2.5x forward (flash-attn's convention), so causal is about half of full.
Times are medians over ``--iters`` runs after ``--warmup`` runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from benchmarks.models import machine, machine_line, write_json  # noqa: E402
from ringkv.kernels import BACKENDS, block_backward, block_forward, make_mask  # noqa: E402
from ringkv.kernels import paged  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULTS = {  # per device: dtype, batch, heads, head dims, sequence lengths, paged cache lengths
    "cpu": dict(
        dtype="fp32",
        batch=1,
        heads=8,
        head_dims=[64],
        seqlens=[1024, 4096],
        cache_lens=[1024, 8192],
        seqs=4,
        copy_mib=256,
        iters=5,
        warmup=1,
    ),
    "cuda": dict(
        dtype="bf16",
        batch=1,
        heads=16,
        head_dims=[64, 128],
        seqlens=[4096, 16384],
        cache_lens=[4096, 32768, 131072],
        seqs=16,
        copy_mib=2048,
        iters=20,
        warmup=5,
    ),
}
QUICK = {
    "cpu": dict(head_dims=[64], seqlens=[1024], cache_lens=[1024], copy_mib=64, iters=3, warmup=1),
    "cuda": dict(
        head_dims=[128], seqlens=[4096], cache_lens=[4096, 32768], copy_mib=1024, iters=5, warmup=2
    ),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, iters, warmup) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def visible_pairs(mask, sq, sk) -> int:
    """Number of (query, key) pairs the mask lets through."""
    if mask.kind == "full":
        return sq * sk
    if mask.kind == "empty":
        return 0
    if mask.kind == "offset":  # row i sees keys 0..i+offset
        return int((torch.arange(sq) + mask.offset + 1).clamp(0, sk).sum())
    return int(mask.dense.sum())


# ---------------------------------------------------------------------------- attention


def registry_impls(q, k, v, mask, scale):
    """(name, forward, forward+backward) for every registered backend that takes these inputs."""
    dout = torch.randn_like(q)
    for name, module in BACKENDS.items():
        if not module.supports(q, mask):
            continue

        def fwd(name=name):
            return block_forward(q, k, v, scale=scale, mask=mask, backend=name)

        def fwd_bwd(name=name):
            out, lse = fwd(name)
            return block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, backend=name)

        yield name, fwd, fwd_bwd


def baseline_impls(q, k, v, causal, scale):
    """torch SDPA backends and the flash-attn package on CUDA (Sq == Sk: causal conventions
    agree)."""
    if q.device.type != "cuda":
        return
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h = q.shape[2]
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))  # (B, H, S, D)
    dout = torch.randn_like(qt)
    gqa = dict(enable_gqa=True) if k.shape[2] != h else {}
    for label, kernel in [
        ("torch-sdpa-flash", SDPBackend.FLASH_ATTENTION),
        ("torch-sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("torch-sdpa-cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None)),
    ]:
        if kernel is None:
            continue

        def fwd(kernel=kernel):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, scale=scale, **gqa
                )

        def fwd_bwd(fwd=fwd):
            torch.autograd.grad(fwd(), (qt, kt, vt), dout)

        yield label, torch.no_grad()(fwd), fwd_bwd
    try:
        from flash_attn import flash_attn_func
    except Exception:
        return
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))  # (B, S, H, D), GQA native
    dout_f = torch.randn_like(qf)

    def fa_fwd():
        return flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal)

    def fa_fwd_bwd():
        torch.autograd.grad(fa_fwd(), (qf, kf, vf), dout_f)

    yield "flash_attn-package", torch.no_grad()(fa_fwd), fa_fwd_bwd


def bench_attention(args, device, dtype):
    rows = []
    b, h, hkv = args.batch, args.heads, args.kv_heads or args.heads
    for d in args.head_dims:
        for s in args.seqlens:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(b, s, h, d, generator=g).to(device, dtype)  # (B, S, H, D)
            k, v = (torch.randn(b, s, hkv, d, generator=g).to(device, dtype) for _ in range(2))
            scale = d**-0.5
            for causal in (False, True):
                mask = make_mask(causal, None, None, s, s, device)
                flops_fwd = 4 * b * h * d * visible_pairs(mask, s, s)
                impls = list(registry_impls(q, k, v, mask, scale)) + list(
                    baseline_impls(q, k, v, causal, scale)
                )
                for name, fwd, fwd_bwd in impls:
                    if args.impls and name not in args.impls:
                        continue
                    for mode, fn, flops in (
                        ("fwd", fwd, flops_fwd),
                        ("fwd+bwd", fwd_bwd, 3.5 * flops_fwd),
                    ):
                        row = dict(
                            impl=name,
                            batch=b,
                            seqlen=s,
                            heads=h,
                            kv_heads=hkv,
                            head_dim=d,
                            causal=causal,
                            mode=mode,
                            dtype=str(dtype).replace("torch.", ""),
                        )
                        try:
                            t = timeit(fn, device, args.iters, args.warmup)
                            row.update(ms=t * 1e3, tflops=flops / t / 1e12)
                        except (
                            Exception
                        ) as e:  # an unusable baseline (e.g. no cuDNN) is a row, not a crash
                            row.update(ms=None, tflops=None, error=f"{type(e).__name__}: {e}"[:200])
                        rows.append(row)
                        print_row(row)
    return rows


# ---------------------------------------------------------------------------- paged decode


def copy_bandwidth(device, mib, iters, warmup) -> float:
    """GB/s of one large device-to-device copy, counting bytes read + written."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, iters, warmup)
    return 2 * src.numel() * 4 / t / 1e9


def bench_paged(args, device, dtype, copy_gbps):
    rows = []
    n, h, hkv, d, bs = (
        args.seqs,
        args.heads,
        args.kv_heads or args.heads,
        max(args.head_dims),
        args.block_size,
    )
    for length in args.cache_lens:
        blocks = math.ceil(length / bs)
        g = torch.Generator().manual_seed(0)
        k_cache, v_cache = (
            torch.randn(n * blocks, bs, hkv, d, generator=g).to(device, dtype) for _ in range(2)
        )
        table = torch.randperm(n * blocks, generator=g).view(n, blocks).to(device, torch.int32)
        lens = torch.full((n,), length, dtype=torch.int32, device=device)
        q = torch.randn(n, 1, h, d, generator=g).to(
            device, dtype
        )  # (N, 1, H, D): one new token each
        moved = 2 * n * length * hkv * d * k_cache.element_size() + 2 * q.numel() * q.element_size()
        for name in paged._BACKENDS:
            if args.impls and name not in args.impls:
                continue
            if (
                name == "triton"
                and device.type == "cpu"
                and os.environ.get("TRITON_INTERPRET") != "1"
            ):
                continue  # Triton needs a GPU (or the interpreter, which is no benchmark)
            row = dict(
                impl=name,
                seqs=n,
                cache_len=length,
                heads=h,
                kv_heads=hkv,
                head_dim=d,
                block_size=bs,
                dtype=str(dtype).replace("torch.", ""),
            )
            try:
                t = timeit(
                    lambda: paged.paged_attention(q, k_cache, v_cache, table, lens, backend=name),
                    device,
                    args.iters,
                    args.warmup,
                )
                gbps = moved / t / 1e9
                row.update(ms=t * 1e3, gbps=gbps, fraction_of_copy=gbps / copy_gbps)
            except Exception as e:
                row.update(
                    ms=None,
                    gbps=None,
                    fraction_of_copy=None,
                    error=f"{type(e).__name__}: {e}"[:200],
                )
            rows.append(row)
            print_paged_row(row)
    return rows


# ---------------------------------------------------------------------------- output


def fmt(x, spec):
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0] or 0))


def print_row(r):
    print(
        f"{r['impl']:22s} {r['mode']:8s} {'causal' if r['causal'] else 'full':6s} B={r['batch']} "
        f"S={r['seqlen']:<6d} H={r['heads']}/{r['kv_heads']} D={r['head_dim']:<4d} "
        f"{fmt(r['ms'], '10.3f')} ms {fmt(r['tflops'], '8.3f')} TFLOP/s {r.get('error', '')}",
        flush=True,
    )


def print_paged_row(r):
    print(
        f"{r['impl']:22s} N={r['seqs']} L={r['cache_len']:<7d} H={r['heads']}/{r['kv_heads']} "
        f"D={r['head_dim']} bs={r['block_size']} {fmt(r['ms'], '10.3f')} ms "
        f"{fmt(r['gbps'], '8.2f')} GB/s "
        f"({fmt(r['fraction_of_copy'] and 100 * r['fraction_of_copy'], '.1f')}% of copy) "
        f"{r.get('error', '')}",
        flush=True,
    )


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument(
        "--iters", type=int, help="timed runs per case (median); default 5 on CPU, 20 on CUDA"
    )
    p.add_argument("--warmup", type=int, help="untimed runs first; default 1 on CPU, 5 on CUDA")
    p.add_argument("--quick", action="store_true", help="fewer shapes and runs (a minute on a CPU)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--impls", nargs="+", help="only these (registry backends, baselines, paged backends)"
    )
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="default: heads (MHA)")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--seqlens", type=int, nargs="+")
    p.add_argument("--cache-lens", type=int, nargs="+", help="paged decode: tokens per sequence")
    p.add_argument("--seqs", type=int, help="paged decode: sequences per batch")
    p.add_argument(
        "--block-size", type=int, default=16, help="paged decode: tokens per cache block"
    )
    p.add_argument("--copy-mib", type=int, help="size of the bandwidth baseline copy")
    args = p.parse_args(argv)
    kind = torch.device(args.device).type
    defaults = dict(DEFAULTS.get(kind, DEFAULTS["cpu"]))
    if args.quick:
        defaults.update(QUICK.get(kind, QUICK["cpu"]))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    mach = machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else mach["cpu"]
    print(
        f"# ringkv kernel benchmark on {device} ({name}), {args.dtype}, torch {torch.__version__}, "
        f"iters={args.iters} warmup={args.warmup}",
        flush=True,
    )
    print(f"# {machine_line(mach)}", flush=True)
    print("## attention (registry backends and baselines)", flush=True)
    attention_rows = bench_attention(args, device, dtype)
    copy_gbps = copy_bandwidth(device, args.copy_mib, args.iters, args.warmup)
    print(
        f"## paged decode (copy baseline: {copy_gbps:.1f} GB/s, {args.copy_mib} MiB read + "
        "written)",
        flush=True,
    )
    paged_rows = bench_paged(args, device, dtype, copy_gbps)
    result = dict(
        device=str(device),
        device_name=name,
        dtype=args.dtype,
        torch=torch.__version__,
        threads=mach["threads"],
        iters=args.iters,
        warmup=args.warmup,
        copy_gbps=copy_gbps,
        attention=attention_rows,
        paged=paged_rows,
        machine=mach,
    )
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
