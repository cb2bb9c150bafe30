"""PyTorch's own ring attention as a peer for ``long_ctx.py --peer torch``.

``torch.distributed.tensor.experimental`` ships ``context_parallel``, which rewrites SDPA calls
on DTensors; on CPU it has no sharding rule for
``aten._scaled_dot_product_flash_attention_for_cpu``.
Its ring itself, the private ``_templated_ring_attention`` (and ``..._backward``), takes the
attention op as an argument, so here it is given the CPU flash op (or, on CUDA, the flash op)
and wrapped in an autograd function. torch's options are left at their defaults
(``_cp_options``: float32 merges, K/V rotated by an all-gather, dK/dV by all-to-all), except
``enable_load_balance``, which must match the layout:

- causal + ``zigzag``: torch's head-tail load balancing (rank r holds chunks r and 2N-1-r, the
  same split as ringkv's zigzag);
- causal + ``contiguous``: load balancing off;
- full attention: any layout (load balancing off, which torch requires without a causal mask);
- causal + ``striped`` and GQA (``kv_heads != heads``) have no torch counterpart: ``unavailable``
  says why.

Tensors are in torch's own ``(B, H, S_local, D)``; ``peer(q, k, v) -> out`` is differentiable.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout first, benchmarks/ never: its modules would shadow installed packages (HF `kernels`)
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # torch >= 2.9
    "torch.distributed.tensor.experimental._attention",
)  # torch 2.4 - 2.8


def _module():
    """torch's ring module, or an error string saying what is missing."""
    errors = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        missing = [
            a
            for a in (
                "_templated_ring_attention",
                "_templated_ring_attention_backward",
                "_cp_options",
            )
            if not hasattr(mod, a)
        ]
        if not missing:
            return mod
        errors.append(f"{name} lacks {', '.join(missing)}")
    return "; ".join(errors)


def unavailable(
    layout: str, causal: bool, heads: int, kv_heads: int, device: torch.device
) -> Optional[str]:
    """Why torch's ring cannot run this configuration, or None when it can."""
    mod = _module()
    if isinstance(mod, str):
        return f"torch {torch.__version__} has no usable _templated_ring_attention ({mod})"
    if heads != kv_heads:
        return "torch's ring has no GQA (its SDPA ops need kv_heads == heads)"
    if causal and layout not in ("zigzag", "contiguous"):
        return (
            "torch's ring balances causal work head-tail (zigzag) or not at all (contiguous), not "
            f"{layout}"
        )
    if device.type == "cuda" and not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"):
        return "this torch has no CUDA flash SDPA op"
    return None


def torch_ring(
    group: dist.ProcessGroup, causal: bool, layout: str, device: torch.device
) -> Callable:
    """``peer(q, k, v) -> out`` over ``(B, H, S_local, D)`` shards of ``layout`` (see
    ``unavailable``)."""
    mod, aten = _module(), torch.ops.aten
    balance = causal and layout == "zigzag"
    if device.type == "cpu":  # (out, lse)
        fwd_op, bwd_op = (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    else:  # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
        fwd_op, bwd_op = (
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_backward,
        )

    class _Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            mod._cp_options.enable_load_balance = balance
            res = mod._templated_ring_attention(
                group,
                2,
                fwd_op,
                q,
                k,
                v,
                is_causal=causal,
                dropout_p=0.0,
                scale=q.shape[-1] ** -0.5,
            )
            out, lse = res[0], res[1]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.rest = dict(
                zip(
                    ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"),
                    res[2:8],
                )
            )
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            mod._cp_options.enable_load_balance = balance
            dq, dk, dv = mod._templated_ring_attention_backward(
                group,
                2,
                bwd_op,
                dout.contiguous(),
                "grad_out",
                q,
                k,
                v,
                out,
                lse,
                is_causal=causal,
                dropout_p=0.0,
                scale=q.shape[-1] ** -0.5,
                **ctx.rest,
            )[:3]
            return dq, dk, dv

    return _Ring.apply
