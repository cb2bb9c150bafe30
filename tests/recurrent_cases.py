"""Cases of the sequence-parallel recurrent layers (ringkv.sp.recurrent) run on every rank of a
gloo world (see tests/dist.py), and the row bookkeeping the test shares with them.

A case gets the whole (unsharded) tensors, takes this rank's rows by its pieces (pad rows get
random values: they must not reach real tokens), runs forward and backward of
``sum(out * dout)`` (plus, on rank 0 alone, ``sum(final * dfinal)`` over the documents' final
states: their gradient must reach every rank's inputs) and returns its local outputs and
gradients; the test puts the rows back in sequence order."""

from __future__ import annotations

from datetime import timedelta

import torch

from ringkv.sp.collectives import forget_agreed
from ringkv.sp.pieces import seq_pieces
from ringkv.sp.recurrent import causal_conv1d, mamba2_scan, selective_scan

TIMEOUT = timedelta(seconds=30)


def pieces_of(case, world):
    return seq_pieces(case["seq"], case["layout"], world, cu_seqlens=case["cu"])


def local_index(pieces, rank, cu):
    """``(T_local,)`` int64: each local row's position in the whole sequence, -1 for pad rows."""
    rows = []
    for p in pieces.mine(rank):
        base = (cu[p.doc] if cu is not None else 0) + p.start
        rows += [-1] * len(p.rows) if p.doc < 0 else list(range(base, base + len(p.rows)))
    return torch.tensor(rows, dtype=torch.long)


def take(x, dim, index, seed):
    """The rows ``index`` of ``x`` along ``dim``; pad rows (-1) random (seeded)."""
    dim %= x.dim()
    shape = list(x.shape)
    shape[dim] = 1
    g = torch.Generator().manual_seed(seed)
    junk = (torch.randn(shape, generator=g) * 3).to(x.dtype)
    return torch.cat([x, junk], dim).index_select(dim, torch.where(index < 0, x.shape[dim], index))


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _grads(named):
    return {k: (None if v is None else v.grad) for k, v in named.items()}


def _finish(ctx, out, finals, dout, dfinal):
    """Backward of ``sum(out * dout)`` + (rank 0) ``sum(final * dfinal)``."""
    loss = (out.float() * dout.float()).sum()
    if finals is not None and ctx.rank == 0:
        loss = loss + sum((finals[d].float() * dfinal[d]).sum() for d in finals)
    loss.backward()


def conv(ctx, case, t):
    """``t``: x (B, C, S), weight (C, K), bias, dout (B, C, S), dfinal {doc: (B, C, K)}."""
    pieces = pieces_of(case, ctx.world)
    index = local_index(pieces, ctx.rank, case["cu"])
    x = _leaf(take(t["x"], -1, index, ctx.rank))
    w, b = _leaf(t["weight"]), _leaf(t["bias"])
    res = causal_conv1d(
        x,
        w,
        b,
        case["activation"],
        pieces=pieces,
        group=ctx.group,
        timeout=TIMEOUT,
        return_tail=case["state"],
    )
    out, finals = res if case["state"] else (res, None)
    _finish(ctx, out, finals, take(t["dout"], -1, index, 99), t["dfinal"])
    return dict(
        out=out.detach(),
        finals=finals and {d: f.detach() for d, f in finals.items()},
        grads=_grads(dict(x=x, weight=w, bias=b)),
    )


def ssd(ctx, case, t):
    """``t``: x (B, S, H, P), dt (B, S, H), A, B/C (B, S, G, N), D, dt_bias, dout, dfinal."""
    pieces = pieces_of(case, ctx.world)
    index = local_index(pieces, ctx.rank, case["cu"])
    loc = {k: _leaf(take(t[k], 1, index, ctx.rank + i)) for i, k in enumerate("x dt B C".split())}
    par = {k: _leaf(t[k]) for k in ("A", "D", "dt_bias")}
    res = mamba2_scan(
        loc["x"],
        loc["dt"],
        par["A"],
        loc["B"],
        loc["C"],
        chunk_size=case["chunk"],
        D=par["D"],
        dt_bias=par["dt_bias"],
        dt_softplus=case["softplus"],
        dt_limit=case["limit"],
        pieces=pieces,
        group=ctx.group,
        timeout=TIMEOUT,
        return_final_state=case["state"],
    )
    out, finals = res if case["state"] else (res, None)
    _finish(ctx, out, finals, take(t["dout"], 1, index, 99), t["dfinal"])
    return dict(
        out=out.detach(),
        finals=finals and {d: f.detach() for d, f in finals.items()},
        grads=_grads({**loc, **par}),
    )


def selective(ctx, case, t):
    """``t``: x/dt/z (B, D, S), A (D, N), B/C (B, N, S), D, delta_bias, dout, dfinal."""
    pieces = pieces_of(case, ctx.world)
    index = local_index(pieces, ctx.rank, case["cu"])
    names = [k for k in "x dt B C z".split() if t[k] is not None]
    loc = {k: _leaf(take(t[k], -1, index, ctx.rank + i)) for i, k in enumerate(names)}
    par = {k: _leaf(t[k]) for k in ("A", "D", "delta_bias")}
    res = selective_scan(
        loc["x"],
        loc["dt"],
        par["A"],
        loc["B"],
        loc["C"],
        par["D"],
        loc.get("z"),
        par["delta_bias"],
        case["softplus"],
        pieces=pieces,
        group=ctx.group,
        timeout=TIMEOUT,
        return_final_state=case["state"],
    )
    out, finals = res if case["state"] else (res, None)
    _finish(ctx, out, finals, take(t["dout"], -1, index, 99), t["dfinal"])
    return dict(
        out=out.detach(),
        finals=finals and {d: f.detach() for d, f in finals.items()},
        grads=_grads({**loc, **par}),
    )


def bad_call(ctx, what):
    """A call with mismatched shapes: the error (raised before any collective)."""
    pieces = seq_pieces(8, "zigzag", ctx.world)
    n = 8 // ctx.world
    try:
        if what == "conv":
            causal_conv1d(torch.randn(1, 3, n), torch.randn(4, 3), pieces=pieces, group=ctx.group)
        elif what == "rows":
            mamba2_scan(
                torch.randn(1, n + 1, 2, 3),
                torch.randn(1, n + 1, 2),
                torch.randn(2),
                torch.randn(1, n + 1, 1, 4),
                torch.randn(1, n + 1, 1, 4),
                chunk_size=4,
                pieces=pieces,
                group=ctx.group,
            )
        else:
            selective_scan(
                torch.randn(1, 3, n),
                torch.randn(1, 3, n),
                torch.randn(3, 2),
                torch.randn(1, 5, n),
                torch.randn(1, 2, n),
                pieces=pieces,
                group=ctx.group,
            )
    except ValueError as e:
        return str(e)
    return None


def disagree(ctx):
    """Ranks calling with different batch sizes: the error every rank raises (agree)."""
    forget_agreed(ctx.group)
    b = 1 + ctx.rank
    pieces = seq_pieces(8, "contiguous", ctx.world)
    n = 8 // ctx.world
    try:
        selective_scan(
            torch.randn(b, 3, n),
            torch.rand(b, 3, n),
            -torch.rand(3, 2),
            torch.randn(b, 2, n),
            torch.randn(b, 2, n),
            pieces=pieces,
            group=ctx.group,
            timeout=TIMEOUT,
        )
    except ValueError as e:
        return str(e)
    return None
