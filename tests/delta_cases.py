"""Cases for tests/test_sp_delta.py, run on every rank of a gloo world (see tests/dist.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringkv.sp.delta import gated_delta_rule, kda
from ringkv.sp.layout import granule, shard, unshard
from ringkv.sp.pieces import seq_pieces

FNS = {"gdn": gated_delta_rule, "kda": kda}


def _sharder(ctx, layout, seq_len, cu):
    """This rank's rows of a global ``(B, S, ...)`` tensor (unpacked: zero-padded at the end to
    the layout's granule first, as patch_model pads)."""
    if cu is not None:
        return lambda x: shard(x, 1, layout, rank=ctx.rank, world=ctx.world, cu_seqlens=cu)
    pad = -seq_len % granule(layout, ctx.world)

    def sh(x):
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
        return shard(x, 1, layout, rank=ctx.rank, world=ctx.world)

    return sh


def _junk_pad_rows(x, pieces, rank, seed, sign=1.0):
    """``x`` with its pad rows (pieces of doc -1) replaced by large random values (``sign=-1``:
    negative, as log-decays are): they must not reach a real token."""
    gen = torch.Generator().manual_seed(seed + 7 * rank)
    x = x.clone()
    for p in pieces.mine(rank):
        if p.doc < 0:
            rows = x[:, p.rows.start : p.rows.stop]
            junk = torch.randn(rows.shape, generator=gen) * 30
            rows.copy_(junk if sign > 0 else -junk.abs())
    return x


def forward_backward(ctx, kind, tensors, layout, seq_len, cu, opts, junk=False):
    """The SP rule on this rank's shard, forward and backward of ``sum(o * dout)``; ``junk``:
    the pad rows of q, k, v, g and beta hold large random values instead of zeros.

    Returns, on rank 0, ``(o, grads of q k v g beta, doc finals)`` in global order (pad rows
    dropped); on the other ranks only the doc finals (every rank must hold the same). Raises if
    an output row (pad rows included) is not finite."""
    q, k, v, g, beta, dout = tensors
    pieces = seq_pieces(seq_len, layout, ctx.world, cu_seqlens=cu)
    sh = _sharder(ctx, layout, seq_len, cu)
    local = [sh(x) for x in (q, k, v, g, beta)]
    if junk:
        signs = (1.0, 1.0, 1.0, -1.0, 1.0)  # g: log-decays
        local = [
            _junk_pad_rows(x, pieces, ctx.rank, i, s) for i, (x, s) in enumerate(zip(local, signs))
        ]
    local = [x.clone().requires_grad_() for x in local]
    o, finals = FNS[kind](*local, pieces=pieces, group=ctx.group, return_final_state=True, **opts)
    if not torch.isfinite(o).all():
        raise AssertionError(f"rank {ctx.rank}: output not finite (pad rows included)")
    (o.float() * sh(dout)).sum().backward()

    def un(x):
        return unshard(x.detach(), 1, layout, ctx.group, cu_seqlens=cu)[:, :seq_len]

    full = [un(o)] + [un(t.grad) for t in local]
    finals = {d: f.detach() for d, f in finals.items()}
    return (full, finals) if ctx.rank == 0 else (None, finals)


def forward_only(ctx, kind, tensors, layout, seq_len, cu, opts):
    """Inputs that need no gradient, grad mode on (a frozen model's inference): the output in
    global order (on rank 0) and, on every rank, whether it recorded a graph."""
    q, k, v, g, beta, _ = tensors
    pieces = seq_pieces(seq_len, layout, ctx.world, cu_seqlens=cu)
    sh = _sharder(ctx, layout, seq_len, cu)
    o = FNS[kind](*(sh(x) for x in (q, k, v, g, beta)), pieces=pieces, group=ctx.group, **opts)
    full = unshard(o, 1, layout, ctx.group, cu_seqlens=cu)[:, :seq_len]
    return (full if ctx.rank == 0 else None), o.requires_grad


def bad_input(ctx, kind, shapes, seq_len, layout, kwargs):
    """Call with local tensors of ``shapes`` (the same on every rank) and ``kwargs``; return the
    error's type and message, or 'ok'. A bad call must raise on every rank before any
    collective (a rank that went on would wait for the others)."""
    pieces = seq_pieces(seq_len, layout, ctx.world)
    xs = [torch.zeros(s) for s in shapes]
    try:
        FNS[kind](*xs, pieces=pieces, group=ctx.group, **kwargs)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return "ok"
