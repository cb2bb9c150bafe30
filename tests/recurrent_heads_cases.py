"""Cases of tests/test_sp_recurrent_heads.py, run on every rank of a gloo world (tests/dist.py):
each runs a layer's head-parallel form (ringkv.sp.recurrent_heads) and its state-passing twin
on the same local rows (pad rows random: they must reach nothing), forward and backward of
``sum(out * dout)`` plus, on rank 0 alone, ``sum(final * dfinal)`` over the documents' final
states (their gradient must reach every rank's inputs)."""

from __future__ import annotations

from datetime import timedelta

import torch

from ringkv.sp.delta import gated_delta_rule, kda
from ringkv.sp.pieces import seq_pieces
from ringkv.sp.recurrent import mamba2_scan, selective_scan
from ringkv.sp.recurrent_heads import (
    heads_gated_delta_rule,
    heads_kda,
    heads_mamba2_scan,
    heads_selective_scan,
)
from tests.recurrent_cases import local_index, take

TIMEOUT = timedelta(seconds=60)
FNS = {
    ("state", "gdn"): gated_delta_rule,
    ("state", "kda"): kda,
    ("state", "mamba2"): mamba2_scan,
    ("state", "selective"): selective_scan,
    ("heads", "gdn"): heads_gated_delta_rule,
    ("heads", "kda"): heads_kda,
    ("heads", "mamba2"): heads_mamba2_scan,
    ("heads", "selective"): heads_selective_scan,
}
# the sharded tensors of each kind, in call order, and the dimension of their rows
SEQ = {
    "gdn": dict(q=1, k=1, v=1, g=1, beta=1),
    "kda": dict(q=1, k=1, v=1, g=1, beta=1),
    "mamba2": dict(x=1, dt=1, B=1, C=1),
    "selective": dict(x=-1, dt=-1, B=-1, C=-1, z=-1),
}
OUT_DIM = {"gdn": 1, "kda": 1, "mamba2": 1, "selective": -1}


def call(fn, kind, loc, par, opts, **kw):
    """``fn`` (either form of ``kind``) on local tensors ``loc`` and parameters ``par``."""
    if kind in ("gdn", "kda"):
        return fn(*(loc[k] for k in SEQ[kind]), **opts, **kw)
    if kind == "mamba2":
        x, dt, B, C = (loc[k] for k in SEQ[kind])
        return fn(x, dt, par["A"], B, C, D=par["D"], dt_bias=par["dt_bias"], **opts, **kw)
    x, dt, B, C, z = (loc[k] for k in SEQ[kind])
    return fn(x, dt, par["A"], B, C, par["D"], z, par["delta_bias"], opts["softplus"], **kw)


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _one(ctx, form, case, t, pieces, index):
    kind = case["kind"]
    loc = {
        k: _leaf(take(t[k], dim, index, ctx.rank + i)) if t[k] is not None else None
        for i, (k, dim) in enumerate(SEQ[kind].items())
    }
    par = {k: _leaf(v) for k, v in t.get("params", {}).items()}
    res = call(
        FNS[(form, kind)],
        kind,
        loc,
        par,
        case["opts"],
        pieces=pieces,
        group=ctx.group,
        timeout=TIMEOUT,
        return_final_state=case["state"],
    )
    out, finals = res if case["state"] else (res, None)
    if not torch.isfinite(out).all():
        raise AssertionError(f"rank {ctx.rank}: {form} output not finite")
    loss = (out.float() * take(t["dout"], OUT_DIM[kind], index, 99).float()).sum()
    if finals is not None and ctx.rank == 0:
        loss = loss + sum((finals[d].float() * t["dfinal"][d]).sum() for d in finals)
    loss.backward()
    grads = {k: None if v is None else v.grad for k, v in {**loc, **par}.items()}
    return dict(
        out=out.detach(),
        finals=finals and {d: f.detach() for d, f in finals.items()},
        grads=grads,
    )


def both(ctx, case, t):
    """Both forms on this rank's rows: ``{"heads": ..., "state": ...}``, each with ``out`` (local
    rows), ``finals`` ({doc: state} or None) and ``grads`` (local rows / parameters)."""
    pieces = seq_pieces(case["seq"], case["layout"], ctx.world, cu_seqlens=case["cu"])
    index = local_index(pieces, ctx.rank, case["cu"])
    return {form: _one(ctx, form, case, t, pieces, index) for form in ("heads", "state")}


def bad_heads(ctx, kind, hv):
    """``kind``'s head-parallel form with ``hv`` heads that do not divide the group: the error
    each rank raises (before any collective: no rank waits)."""
    pieces = seq_pieces(8 * ctx.world, "zigzag", ctx.world)
    t = 8
    try:
        if kind == "gdn":
            q = torch.randn(1, t, 1, 4)
            heads_gated_delta_rule(
                q, q, torch.randn(1, t, hv, 3), -torch.rand(1, t, hv), torch.rand(1, t, hv),
                pieces=pieces, group=ctx.group, timeout=TIMEOUT,
            )  # fmt: skip
        elif kind == "mamba2":
            heads_mamba2_scan(
                torch.randn(1, t, hv, 2), torch.rand(1, t, hv), -torch.rand(hv),
                torch.randn(1, t, 1, 3), torch.randn(1, t, 1, 3), chunk_size=4,
                pieces=pieces, group=ctx.group, timeout=TIMEOUT,
            )  # fmt: skip
        else:
            heads_selective_scan(
                torch.randn(1, hv, t), torch.rand(1, hv, t), -torch.rand(hv, 3),
                torch.randn(1, 3, t), torch.randn(1, 3, t),
                pieces=pieces, group=ctx.group, timeout=TIMEOUT,
            )  # fmt: skip
    except ValueError as e:
        return str(e)
    return None


def sent_bytes(ctx, case, t):
    """Bytes this rank sends in one forward (no_grad) of each form, counted at
    ``torch.distributed``'s all-to-all and all-gather (after a first call, whose shape agreement
    is remembered): ``{"state": ..., "heads": ...}``."""
    import torch.distributed as dist

    pieces = seq_pieces(case["seq"], case["layout"], ctx.world, cu_seqlens=case["cu"])
    index = local_index(pieces, ctx.rank, case["cu"])
    kind = case["kind"]
    loc = {k: None if t[k] is None else take(t[k], d, index, 0) for k, d in SEQ[kind].items()}
    kw = dict(pieces=pieces, group=ctx.group, timeout=TIMEOUT)
    count, a2a, gather = [0], dist.all_to_all_single, dist.all_gather

    def counted_a2a(out, x, *a, **k):
        count[0] += x.numel() * x.element_size() * (ctx.world - 1) // ctx.world
        return a2a(out, x, *a, **k)

    def counted_gather(outs, x, *a, **k):
        count[0] += x.numel() * x.element_size() * (ctx.world - 1)
        return gather(outs, x, *a, **k)

    res = {}
    for form in ("state", "heads"):
        with torch.no_grad():
            call(FNS[(form, kind)], kind, loc, t["params"], case["opts"], **kw)
            count[0] = 0
            dist.all_to_all_single, dist.all_gather = counted_a2a, counted_gather
            try:
                call(FNS[(form, kind)], kind, loc, t["params"], case["opts"], **kw)
            finally:
                dist.all_to_all_single, dist.all_gather = a2a, gather
        res[form] = count[0]
    return res
