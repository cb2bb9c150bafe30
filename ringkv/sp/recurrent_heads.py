"""Head-parallel ("Ulysses", all-to-all) form of the recurrent layers: gated delta rule, KDA,
Mamba2 SSD scan and Mamba selective scan, exact and differentiable over a sharded sequence.

Each ``heads_*`` function has the signature and return contract of its state-passing twin in
``ringkv.sp.delta`` / ``ringkv.sp.recurrent`` (same ``pieces``, ``group``, ``timeout``,
``return_final_state`` -> ``{doc: final state}`` with every head, the same on every rank). It:

1. sends, by one differentiable all-to-all (``collectives.all_to_all``), this rank's rows of
   ``H/N`` heads to each rank: every rank then holds every row of the sequence for its heads
   (rank ``j``: heads ``[j H/N, (j+1) H/N)``; the selective scan splits its channels). Tensors
   without a head dimension (the selective scan's ``B``/``C``; Mamba2's ``B``/``C`` when the
   groups ``G`` do not split over the ranks) go to every rank whole (an all-gather, made of the
   same all-to-all);
2. puts the rows back in sequence order, document by document, by an index built from
   ``pieces.by_rank`` (``_plan``), and runs each document from a zero state through the torch
   references (``kernels.delta_ref``, ``kernels.scan_ref``; one call per document);
3. scatters the outputs back to their rows (pad rows: zeros) and returns them by the inverse
   all-to-all. Final states are all-gathered over the heads (``pieces.gather_slots``).

Bytes per rank and layer: ``(N-1)/N`` of the local inputs and outputs, growing with ``S/N``;
state passing sends every piece's state and transition, constant in ``S`` (``layer_bytes``).
``choose_form`` is the rule ``method="auto"`` uses between the two (measured, see there).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..kernels.delta_ref import gated_delta_ref, kda_ref
from ..kernels.scan_ref import process_dt, selective_scan_ref, ssd_scan_ref
from .collectives import all_to_all, rank_world
from .delta import delta_shapes
from .pieces import Pieces, agree_call, check_pieces, gather_slots, tie
from .recurrent import selective_shapes, ssd_shapes

__all__ = [
    "heads_gated_delta_rule",
    "heads_kda",
    "heads_mamba2_scan",
    "heads_selective_scan",
    "heads_divide",
    "layer_bytes",
    "choose_form",
    "KINDS",
]

KINDS = ("gdn", "kda", "mamba2", "selective")


# ---------------------------------------------------------------------------------------------
# checks (local, before any collective: the same verdict on every rank for the same call)


def _check_group(what: str, pieces, group, t_local: int, heads: int, label: str):
    """The pieces fit the group and the local rows, and ``heads`` split over the group."""
    rank, world = check_pieces(pieces, group, t_local, what)
    rows = [sum(len(p.rows) for p in ps) for ps in pieces.by_rank]
    if len(set(rows)) != 1:
        raise ValueError(f"{what}: the all-to-all needs the same rows on every rank, got {rows}")
    if heads % world:
        raise ValueError(
            f"{what}: the head-parallel form splits the {heads} {label} over the group of "
            f"{world} ranks, and {heads} is not divisible by {world}; use the state-passing "
            f"form ({what[len('heads_') :]})"
        )
    return rank, world


# ---------------------------------------------------------------------------------------------
# the all-to-alls and the row plan


@functools.lru_cache(maxsize=256)
def _plan(pieces: Pieces) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor, int]:
    """Rows of the rank-major gathered sequence (rank ``r``'s local row ``i`` at ``r T + i``):
    each document's rows in sequence order, the inverse of ``[every document's rows | pad
    rows]`` (puts results computed in that order back in rank-major order) and the pad count."""
    t = sum(len(p.rows) for p in pieces.by_rank[0])
    docs = []
    for d in sorted(pieces.order):
        docs.append([p.rank * t + i for p in pieces.order[d] for i in p.rows])
    real = [i for idx in docs for i in idx]
    seen = set(real)
    order = real + [i for i in range(pieces.world * t) if i not in seen]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    docs_t = tuple(torch.tensor(idx, dtype=torch.long) for idx in docs)
    return docs_t, inverse, len(order) - len(real)


def _split(x: torch.Tensor, world: int) -> torch.Tensor:
    """``(B, T, H, ...)`` -> ``(N, B, T, H/N, ...)``: row ``j`` (heads of rank ``j``) to rank j."""
    b, t, h = x.shape[:3]
    return x.reshape(b, t, world, h // world, *x.shape[3:]).movedim(2, 0)


def _whole(x: torch.Tensor, world: int) -> torch.Tensor:
    """``(B, T, ...)`` -> ``(N, B, T, ...)``: all of it to every rank (an all-gather)."""
    return x.unsqueeze(0).expand(world, *x.shape)


def _exchange(parts: List[torch.Tensor], group, timeout, what) -> List[torch.Tensor]:
    """``(N, B, T, ...)`` each, row ``j`` to rank ``j`` -> ``(B, N T, ...)``: every rank's rows
    in rank order (one all-to-all per tensor, all posted before any is waited for)."""
    if rank_world(group)[1] > 1:
        parts = list(all_to_all(*parts, group=group, timeout=timeout, what=what))
    return [p.movedim(0, 1).flatten(1, 2) for p in parts]


def _back(y: torch.Tensor, world: int, group, timeout, what) -> torch.Tensor:
    """``(B, N T, H/N, ...)`` rank-major -> this rank's rows of every head ``(B, T, H, ...)``."""
    b, s = y.shape[:2]
    send = y.unflatten(1, (world, s // world)).movedim(1, 0)  # (N, B, T, H/N, ...)
    if world > 1:
        (send,) = all_to_all(send, group=group, timeout=timeout, what=what + " (back)")
    return send.movedim(0, 2).flatten(2, 3)  # (B, T, N, H/N, ...) -> (B, T, H, ...)


def _per_doc(fn, tensors: List[Optional[torch.Tensor]], plan, device):
    """``fn(*doc_tensors) -> (y, final)`` for each document (rows along dim 1) -> the outputs
    in rank-major row order (pad rows zeros) and the documents' final states."""
    docs, inverse, pad = plan
    ys, finals = [], []
    for idx in docs:
        idx = idx.to(device)
        y, final = fn(*(None if t is None else t.index_select(1, idx) for t in tensors))
        ys.append(y)
        finals.append(final)
    ref = ys[0] if ys else tensors[0]
    ys.append(ref.new_zeros((ref.shape[0], pad, *ref.shape[2:])))
    return torch.cat(ys, 1).index_select(1, inverse.to(device)), finals


def _finish(y, finals, world, group, timeout, what, return_final_state):
    """Outputs back to their ranks; the final states gathered over heads (dim 1 of each)."""
    if not return_final_state:
        return _back(y, world, group, timeout, what)
    stacked = torch.stack(finals)  # (docs, B, H/N, ...)
    g = gather_slots(stacked, group, timeout, what + " final states")  # (N, docs, B, H/N, ...)
    full = g.movedim(0, 2).flatten(2, 3)  # (docs, B, H, ...)
    if world > 1:  # every rank's backward must reach the gather's (a collective), used or not
        y = tie(y, [g])
    return _back(y, world, group, timeout, what), {d: full[d] for d in range(len(finals))}


# ---------------------------------------------------------------------------------------------
# gated delta rule and KDA


def _delta(ref, what, q, k, v, g, beta, opts, pieces, group, timeout, return_final_state):
    b, t, hk, hv, dk = delta_shapes(what, q, k, v, g, beta, opts["chunk_size"], ref is kda_ref)
    rank, world = _check_group(what, pieces, group, t, hv, "value heads")
    dims = dict(batch=b, k_heads=hk, v_heads=hv, d_k=dk, d_v=v.shape[3])
    agree_call(what, dims, pieces, group, timeout, q.device)
    dtype = q.dtype
    if hk % world:  # q/k heads do not split: each v head's q/k head, float32 (grads sum there)
        rep = torch.arange(hv, device=q.device) // (hv // hk)
        q, k = (x.float().index_select(2, rep) for x in (q, k))
    parts = [_split(x, world) for x in (q, k, v, g, beta)]
    q, k, v, g, beta = _exchange(parts, group, timeout, what)  # (B, S, H/N, ...)

    def run(q, k, v, g, beta):
        o, final = ref(q, k, v, g, beta, opts["scale"], None, opts["chunk_size"], opts["l2"])
        return o.to(dtype), final

    y, finals = _per_doc(run, [q, k, v, g, beta], _plan(pieces), q.device)
    return _finish(y, finals, world, group, timeout, what, return_final_state)


def heads_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    return_final_state: bool = False,
):
    """``gated_delta_rule`` by heads: q/k ``(B, T_local, H_k, D_k)``, v ``(B, T_local, H_v,
    D_v)``, g/beta ``(B, T_local, H_v)`` -> o ``(B, T_local, H_v, D_v)`` in q's dtype; with
    ``return_final_state``: ``(o, {doc: (B, H_v, D_k, D_v) float32})``, the same on every rank.
    ``H_v`` must divide by the group size (``ValueError`` otherwise); q/k heads are split too
    when ``H_k`` divides, else each rank gets its v heads' q/k heads (float32)."""
    opts = dict(scale=scale, l2=use_qk_l2norm, chunk_size=chunk_size)
    args = (q, k, v, g, beta, opts, pieces, group, timeout, return_final_state)
    return _delta(gated_delta_ref, "heads_gated_delta_rule", *args)


def heads_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    return_final_state: bool = False,
):
    """``kda`` by heads: q/k/g ``(B, T_local, H, D_k)``, v ``(B, T_local, H, D_v)``, beta
    ``(B, T_local, H)`` -> o ``(B, T_local, H, D_v)`` in q's dtype; with
    ``return_final_state``: ``(o, {doc: (B, H, D_k, D_v) float32})``. ``H`` must divide by the
    group size."""
    opts = dict(scale=scale, l2=use_qk_l2norm, chunk_size=chunk_size)
    args = (q, k, v, g, beta, opts, pieces, group, timeout, return_final_state)
    return _delta(kda_ref, "heads_kda", *args)


# ---------------------------------------------------------------------------------------------
# Mamba2 SSD


def heads_mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    return_final_state: bool = False,
):
    """``mamba2_scan`` by heads: ``x`` ``(B, T_local, H, P)``, ``dt`` ``(B, T_local, H)`` raw,
    ``A``/``D``/``dt_bias`` ``(H,)``, ``B``/``C`` ``(B, T_local, G, N)`` -> ``y`` ``(B,
    T_local, H, P)`` float32; with ``return_final_state``: ``(y, {doc: (B, H, P, N) float32})``.
    ``H`` must divide by the group size; ``B``/``C`` are split with the heads when ``G`` does,
    else sent whole to every rank. Parameter gradients: each rank's for its own heads (their
    sum over the group is the whole gradient, as with state passing)."""
    what = "heads_mamba2_scan"
    b, t, h, p = ssd_shapes(what, x, dt, A, B, C, chunk_size, D, dt_bias)
    groups = B.shape[2]
    rank, world = _check_group(what, pieces, group, t, h, "heads")
    dims = dict(batch=b, heads=h, head_dim=p, groups=groups, state=B.shape[3])
    agree_call(what, dims, pieces, group, timeout, x.device)
    split = groups % world == 0
    bc = [(_split if split else _whole)(m, world) for m in (B, C)]
    x, dt, B, C = _exchange([_split(x, world), _split(dt, world), *bc], group, timeout, what)
    hl = h // world
    mine = slice(rank * hl, (rank + 1) * hl)
    A, D, bias = (None if a is None else a[mine] for a in (A, D, dt_bias))
    dt = process_dt(dt, bias, dt_softplus, dt_limit).float()  # (B, S, H/N)
    heads = torch.arange(rank * hl, (rank + 1) * hl, device=x.device) // (h // groups)
    heads = heads - rank * (groups // world) if split else heads  # local group of each head
    B, C = (m.float().index_select(2, heads) for m in (B, C))  # (B, S, H/N, N)

    def run(x, dt, B, C):
        y, final = ssd_scan_ref(x, dt, A.float(), B, C, chunk_size)
        return (y if D is None else y + D[..., None] * x.float()), final

    y, finals = _per_doc(run, [x, dt, B, C], _plan(pieces), x.device)
    return _finish(y, finals, world, group, timeout, what, return_final_state)


# ---------------------------------------------------------------------------------------------
# Mamba selective scan (channels first: the sequence is the last dimension)


def heads_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    *,
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    return_final_state: bool = False,
):
    """``selective_scan`` by channels: ``x``/``dt``/``z`` ``(B, D, T_local)``, ``A`` ``(D,
    N)``, ``B``/``C`` ``(B, N, T_local)`` (sent whole to every rank), ``D``/``delta_bias``
    ``(D,)`` -> ``y`` ``(B, D, T_local)`` (x's dtype promoted with D's and z's); with
    ``return_final_state``: ``(y, {doc: (B, D, N) float32})``. ``D`` (channels) must divide by
    the group size."""
    what = "heads_selective_scan"
    b, d, t = selective_shapes(what, x, dt, A, B, C, D, z, delta_bias)
    rank, world = _check_group(what, pieces, group, t, d, "channels")
    agree_call(what, dict(batch=b, channels=d, state=A.shape[1]), pieces, group, timeout, x.device)
    out_dtype = x.dtype
    for extra in (D, z):
        out_dtype = out_dtype if extra is None else torch.promote_types(out_dtype, extra.dtype)
    seq = [m.transpose(1, 2) for m in (x, dt, z) if m is not None]  # (B, T, D)
    parts = [_split(m, world) for m in seq] + [_whole(m.transpose(1, 2), world) for m in (B, C)]
    got = _exchange(parts, group, timeout, what)  # (B, S, D/N) and (B, S, N)
    x, dt, z, B, C = got if z is not None else got[:2] + [None] + got[2:]
    dl = d // world
    mine = slice(rank * dl, (rank + 1) * dl)
    A, D, bias = (None if a is None else a[mine] for a in (A, D, delta_bias))
    dt = process_dt(dt, bias, delta_softplus).float()  # (B, S, D/N)

    def run(x, dt, B, C, z):  # (B, L, .) each; the reference is channels first
        x, dt, B, C, z = (None if m is None else m.transpose(1, 2) for m in (x, dt, B, C, z))
        y, final = selective_scan_ref(x, dt, A.float(), B, C.float())  # (B, D/N, L)
        y = y if D is None else y + x.float() * D.float()[:, None]
        y = y if z is None else y * F.silu(z.float())
        return y.to(out_dtype).transpose(1, 2), final

    y, finals = _per_doc(run, [x, dt, B, C, z], _plan(pieces), x.device)  # (B, S, D/N)
    res = _finish(y, finals, world, group, timeout, what, return_final_state)
    y = (res[0] if return_final_state else res).transpose(1, 2).contiguous()  # (B, D, T)
    return (y, res[1]) if return_final_state else y


# ---------------------------------------------------------------------------------------------
# bytes and the choice between the two forms


def _dim(dims: dict, *names: str) -> int:
    for n in names:
        if n in dims:
            return int(dims[n])
    raise ValueError(f"dims needs {' or '.join(names)}, got {sorted(dims)}")


def heads_divide(kind: str, dims: dict, world: int) -> bool:
    """Whether the head-parallel form can run ``kind`` (one of ``KINDS``) over ``world`` ranks:
    its heads (``gdn``: ``v_heads``; ``kda``, ``mamba2``: ``heads``; ``selective``:
    ``channels``) divide by ``world``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    name = {"gdn": ("v_heads", "heads"), "selective": ("channels",)}.get(kind, ("heads",))
    return _dim(dims, *name) % int(world) == 0


def _state_elems(kind: str, dims: dict) -> int:
    """float32 elements of one piece's final state plus its transition (batch 1)."""
    if kind in ("gdn", "kda"):
        h, dk, dv = _dim(dims, "v_heads", "heads"), _dim(dims, "d_k"), _dim(dims, "d_v")
        return h * dk * (dv + dk)
    if kind == "mamba2":
        h = _dim(dims, "heads")
        return h * _dim(dims, "head_dim") * _dim(dims, "state") + h
    return 2 * _dim(dims, "channels") * _dim(dims, "state")


def _heads_elems(kind: str, dims: dict, world: int) -> Tuple[float, float, int]:
    """Per local token: (elements split over the ranks in the input dtype, in float32;
    elements sent whole to every other rank). Outputs included."""
    if kind == "gdn":
        hk, hv = _dim(dims, "k_heads", "heads"), _dim(dims, "v_heads", "heads")
        dk, dv = _dim(dims, "d_k"), _dim(dims, "d_v")
        qk = (2 * hk * dk, 0) if hk % world == 0 else (0, 2 * hv * dk)
        return qk[0] + 2 * hv * dv + 2 * hv, qk[1], 0  # q k, v and o, g beta
    if kind == "kda":
        h, dk, dv = _dim(dims, "heads"), _dim(dims, "d_k"), _dim(dims, "d_v")
        return h * (3 * dk + 2 * dv + 1), 0, 0
    if kind == "mamba2":
        h, p, n = _dim(dims, "heads"), _dim(dims, "head_dim"), _dim(dims, "state")
        g = int(dims.get("groups", 1))
        bc = 2 * g * n
        return h * (p + 1) + (bc if g % world == 0 else 0), h * p, 0 if g % world == 0 else bc
    d, n = _dim(dims, "channels"), _dim(dims, "state")
    return d * (3 + bool(dims.get("z", True))), 0, 2 * n  # x, dt, z, y; B and C whole


def layer_bytes(kind: str, dims: dict, pieces: Pieces, world: int) -> Dict[str, int]:
    """Bytes one rank sends per layer and forward for each form (the backward sends the same
    again), from the shapes: ``{"state": ..., "heads": ...}``.

    ``dims``: the layer's sizes (``gdn``: ``k_heads, v_heads, d_k, d_v``; ``kda``: ``heads,
    d_k, d_v``; ``mamba2``: ``heads, head_dim, state, groups``; ``selective``: ``channels,
    state, z``), ``batch`` (default 1) and ``itemsize`` of the activations (default 2, bf16).
    ``state``: ``pieces.carry``'s all-gather of every piece's final state and transition,
    float32, to the ``N-1`` others (``pieces.slots`` per rank): constant in ``S``. ``heads``:
    the all-to-all of the inputs and of the output back, ``(N-1)/N`` of the local rows each
    (Mamba2's output and any float32 copies at 4 bytes), plus what goes whole to every rank."""
    world = int(world)
    if world == 1:
        return dict(state=0, heads=0)
    batch, item = int(dims.get("batch", 1)), int(dims.get("itemsize", 2))
    state = pieces.slots * _state_elems(kind, dims) * 4 * batch * (world - 1)
    t = sum(len(p.rows) for p in pieces.by_rank[0]) * batch
    split, split32, whole = _heads_elems(kind, dims, world)
    heads = t * (split * item + split32 * 4) * (world - 1) // world + t * whole * item * (world - 1)
    return dict(state=int(state), heads=int(heads))


# Rates measured on the benchmark's machine (benchmarks/recurrent_forms.py, docs/performance.md
# "Hybrid models: the recurrent layers' two forms"): override with the target's.
LINK_BYTES_PER_S = 5.0e8  # gloo all-to-all over loopback, 2 ranks: 0.2-1.1 GB/s, median ~0.5
FLOPS_PER_S = 1.7e10  # the GDN torch reference, 1 thread: ~5.2 GFLOP in 0.30 s at S=4096
HEADS_MARGIN = 1.5  # the heads form's unmodelled costs: row reorders, one call per document


def _state_extra_flops(kind: str, dims: dict, chunk: int = 64) -> float:
    """Per local token: the work state passing does that the heads form does not. GDN/KDA,
    per head: the local pass carries ``D_k`` more value columns (the products with the state
    and the triangular solve: ``6 D_k^2 + 4 C D_k``) and the correction ``a_t h``
    (``2 D_k D_v``); the scans only their correction ``C_t h``."""
    if kind in ("gdn", "kda"):
        h, dk, dv = _dim(dims, "v_heads", "heads"), _dim(dims, "d_k"), _dim(dims, "d_v")
        return h * (6.0 * dk * dk + 2.0 * dk * dv + 4.0 * chunk * dk)
    if kind == "mamba2":
        return 2.0 * _dim(dims, "heads") * _dim(dims, "head_dim") * _dim(dims, "state")
    return 4.0 * _dim(dims, "channels") * _dim(dims, "state")


def choose_form(
    kind: str,
    dims: dict,
    pieces: Pieces,
    world: int,
    *,
    link_bytes_per_s: float = LINK_BYTES_PER_S,
    flops_per_s: float = FLOPS_PER_S,
    margin: float = HEADS_MARGIN,
) -> str:
    """``"state"`` or ``"heads"``: the form ``method="auto"`` runs layer ``kind`` in (``dims``
    as in ``layer_bytes``), the same on every rank (shapes only, no communication).

    ``"state"`` on one rank or when the heads do not divide the group. Otherwise each form's
    time beyond the local work both do (the references on ``S/N`` tokens' worth of heads):

    - heads: its all-to-alls, ``layer_bytes(...)["heads"] / link``, times ``margin``;
    - state passing: its extra local work, ``T_local * _state_extra_flops / flops``, plus its
      gather, ``layer_bytes(...)["state"] / link``.

    Both grow as ``S/N`` (the state's gather is constant), so the choice is about the ratio of
    the machine's compute to its link, not about ``S``; the backward doubles both sides.

    The data (benchmarks/recurrent_forms.py; docs/performance.md "Hybrid models: the
    recurrent layers' two forms"; 2 ranks x 1 thread, gloo, 2-core AMD EPYC VM shared with
    other jobs, load 2.5-3.3; float32, zigzag, S = 4K, 8K, 16K; the forms interleaved),
    heads time / state-passing time:

    - GDN (d_k = d_v = 128, 8 v heads, 4 k heads): forward 0.61-0.89, forward+backward
      0.48-0.70. The rule picks "heads".
    - Mamba2 (head_dim 64, state 128, 8 heads, 1 group): forward 1.11-1.23, forward+backward
      0.94-1.10: state passing sends 0.5 MiB whatever ``S`` and its extra work is a rank-1
      correction. The rule picks "state" (``margin`` tips it).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if int(world) == 1 or not heads_divide(kind, dims, world):
        return "state"
    b = layer_bytes(kind, dims, pieces, world)
    tokens = sum(len(p.rows) for p in pieces.by_rank[0]) * int(dims.get("batch", 1))
    t_state = tokens * _state_extra_flops(kind, dims) / flops_per_s
    t_state += b["state"] / link_bytes_per_s
    return "heads" if margin * b["heads"] / link_bytes_per_s < t_state else "state"
