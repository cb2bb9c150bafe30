"""Sequence-parallel short convolution, Mamba2 SSD scan and Mamba selective scan: exact and
differentiable over a sharded sequence (layouts contiguous and zigzag, packed documents).

The local tensors hold this rank's rows in ``pieces.mine(rank)`` order (``seq_pieces`` builds
``pieces``; pad rows included). Each piece (a run of one document's tokens) is computed from a
zero state by the references of ``ringkv.kernels.scan_ref``; ``pieces.carry`` then gives the
state entering it (every piece's transition and final state gathered, folded in sequence order,
float32) and the output is corrected in closed form:

- SSD: ``y_t += exp(G_t) (C_t . h_in)`` per head, ``G`` the inclusive cumsum of ``dt A``
  within the piece; transition ``exp(G_last)`` per ``(B, H)``;
- selective scan: ``y_t += sum_n C_t[n] exp(G_t[d, n]) h_in[d, n]`` (the reference with no
  input from ``h_in``, chunk by chunk: no ``(B, D, L, N)`` decay kept); transition
  ``exp(A sum dt)`` per ``(B, D, N)``;
- convolution: every piece's last ``K`` inputs are all-gathered (posted first, overlapped with
  the interior of the local convolution, whose outputs need no earlier input); each piece's
  first ``K-1`` outputs are then computed from the ``K-1`` inputs before it in its document
  (from several earlier pieces when they are short; zeros before the document's start).

Gradients reach the inputs on the rank that owns them: the gathers' backward sums every rank's
gradient. Every rank's output depends on the gathered tensor (``pieces.tie``), so every rank takes
part in the backward's collective even where no piece of it needed another rank's state. Pad
pieces (doc -1) output zeros and carry nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..kernels.scan_ref import ACTIVATIONS, process_dt, selective_scan_ref, ssd_scan_ref
from .collectives import start_all_gather
from .pieces import (
    Piece,
    Pieces,
    agree_call,
    arrived,
    carry,
    check_pieces,
    check_shape,
    ends_wanted,
    tie,
)

__all__ = ["causal_conv1d", "mamba2_scan", "selective_scan"]


# ---------------------------------------------------------------------------------------------
# checks (local, before any collective: the same verdict on every rank for the same call)


def _tie(out: torch.Tensor, deps: List[torch.Tensor], world: int, mine, params) -> torch.Tensor:
    """``out`` tied to the gathered ``deps`` (world > 1) and, on a rank holding only pad rows, to
    the ``params``: the layer's inputs and parameters (a zero gradient rather than none, as on
    the other ranks; and that rank's backward reaches the layers before, e.g. the convolution
    whose halo all-gather waits in its backward for every rank)."""
    deps = deps if world > 1 else []
    deps += [] if any(p.doc >= 0 for p in mine) else [t for t in params if t is not None]
    return tie(out, deps)


def _stack_slots(xs: List[torch.Tensor], slots: int) -> torch.Tensor:
    x = torch.stack(xs)
    if len(xs) < slots:
        x = torch.cat([x, x.new_zeros((slots - len(xs), *x.shape[1:]))])
    return x


# ---------------------------------------------------------------------------------------------
# short convolution


def _last(x: torch.Tensor, k: int) -> torch.Tensor:
    """The last ``k`` steps of ``x`` ``(..., L)``, zeros in front when ``L < k``."""
    tail = x[..., -k:] if k else x[..., :0]
    return F.pad(tail, (k - tail.shape[-1], 0))


def _before(
    tails: torch.Tensor, pieces: Pieces, earlier: List[Piece], m: int, front=None
) -> torch.Tensor:
    """The last ``m`` inputs of the pieces ``earlier`` (one document, in sequence order) from the
    gathered tails ``(world, slots, B, C, K)`` -> ``(B, C, m)``; before the document's start the
    inputs ``front`` ``(B, C, K-1)`` (a continued document's), else zeros."""
    parts, got = [], 0
    for q in reversed(earlier):
        if got >= m:
            break
        n = min(len(q.rows), tails.shape[-1])
        parts.insert(0, tails[q.rank, pieces.index(q), ..., tails.shape[-1] - n :])
        got += n
    if got < m and front is not None:
        parts.insert(0, front.to(tails.dtype))
    ctx = torch.cat(parts, -1) if parts else tails[0, 0, ..., :0]
    return _last(ctx, m)


def _conv(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    # x (B, C, L) -> the max(L-K+1, 0) outputs that need no input before x (pre-activation)
    if x.shape[-1] < weight.shape[-1]:
        return x.new_zeros((*x.shape[:2], 0), dtype=weight.dtype)
    return F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, groups=x.shape[1])


def halo_bytes(channels: int, taps: int, pieces: Pieces, world: int, batch: int = 1) -> int:
    """Bytes one rank sends in ``causal_conv1d``'s halo exchange: every piece's last ``taps``
    inputs, float32, all-gathered to the ``world - 1`` others."""
    return pieces.slots * batch * channels * taps * 4 * (world - 1)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    initial_state: Optional[Dict[int, torch.Tensor]] = None,
    return_tail: Union[bool, str] = False,
):
    """Depthwise causal convolution of a sharded sequence (transformers' ``causal_conv1d_fn``
    per document): ``x`` ``(B, C, T_local)``, ``weight`` ``(C, K)``, ``bias`` ``(C,)`` or None,
    ``activation`` None, ``"silu"`` or ``"swish"`` -> ``out`` ``(B, C, T_local)`` in
    ``x.dtype``; with ``return_tail``: ``(out, {doc: tail (B, C, K)})``, the last ``K`` inputs
    of each document (zeros before its start), the same on every rank (the conv state a cache
    keeps). ``initial_state``: ``{doc: (B, C, K-1)}``, the inputs before a (continued) document's
    start; ``return_tail="pieces"``: ``{(doc, end): tail}`` at every piece's end."""
    what = "causal_conv1d"
    ends = ends_wanted(return_tail)
    initial_state = initial_state or {}
    check_shape(what, "x", x, (None, None, None))
    b, c, _ = x.shape
    check_shape(what, "weight", weight, (c, None))
    check_shape(what, "bias", bias, (c,))
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{what}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}"
        )
    rank, world = check_pieces(pieces, group, x.shape[-1], what)
    k = weight.shape[-1]
    dims = dict(batch=b, channels=c, kernel=k, float64=x.dtype == torch.float64)
    agree_call(what, dims, pieces, group, timeout, x.device)
    mine = pieces.mine(rank)
    wide = torch.promote_types(x.dtype, torch.float32)  # gathered exactly, summed in float32+
    local = [x[..., p.rows.start : p.rows.stop] for p in mine]  # (B, C, L) each
    tails = _stack_slots([_last(xp, k).to(wide) for xp in local], pieces.slots)  # (P, B, C, K)
    pending = start_all_gather(tails.detach(), group, timeout, what + " halo")
    # the outputs that need no earlier input, while the gather is in flight (pad pieces: none)
    interior = [_conv(xp, weight, bias) if p.doc >= 0 else None for p, xp in zip(mine, local)]
    if world == 1:
        gathered = tails.unsqueeze(0)
    else:
        gathered = arrived(tails, pending, group, timeout, what + " halo")
    outs = []
    for p, xp, inner in zip(mine, local, interior):
        if p.doc < 0:
            outs.append(torch.zeros_like(xp, dtype=weight.dtype))
            continue
        front = initial_state.get(p.doc)
        halo = _before(gathered, pieces, pieces.before(p), k - 1, front).to(x.dtype)  # (B, C, K-1)
        head = _conv(torch.cat([halo, xp[..., : k - 1]], -1), weight, bias)  # first min(K-1, L)
        outs.append(torch.cat([head, inner], -1))
    out = torch.cat(outs, -1)  # (B, C, T_local)
    if activation is not None:
        out = ACTIVATIONS[activation](out)
    out = _tie(out.to(x.dtype), [gathered], world, mine, [x, weight, bias])
    if not return_tail:
        return out
    ps = pieces.order
    if ends:  # the tail at every piece's end
        cuts = {(d, p.start + len(p.rows)): ps[d][: i + 1] for d in ps for i, p in enumerate(ps[d])}
    else:
        cuts = {d: ps[d] for d in ps}
    tails_out = {
        key: _before(gathered, pieces, upto, k, initial_state.get(upto[0].doc)).to(x.dtype)
        for key, upto in cuts.items()
    }
    return out, tails_out


# ---------------------------------------------------------------------------------------------
# the scans


def _pass_states(ys, finals, transitions, compose, correct, inputs, **passing):
    """Each piece's output from zero ``ys``, corrected by the state entering it:
    ``correct(i, h_in)``; returns the corrected outputs and ``{doc: final state}`` (``ends``:
    ``{(doc, end): state}`` after every piece, ``carry``'s ``after``). ``inputs``: the layer's
    tensors (whether any needs a gradient: the same on every rank); ``passing``: ``carry``'s
    ``pieces``, ``group``, ``timeout``, ``initial`` (``{doc: state}`` entering each document)
    and ``ends``."""
    inputs = [*inputs, *(passing.get("initial") or {}).values()]
    grad = any(t is not None and t.requires_grad for t in inputs) and torch.is_grad_enabled()
    incoming, *states = carry(finals, transitions, compose, needs_grad=grad, **passing)
    ys = [y if h is None else y + correct(i, h) for i, (y, h) in enumerate(zip(ys, incoming))]
    return ys, states[-1]


def ssd_shapes(what: str, x, dt, A, B, C, chunk_size, D, dt_bias) -> Tuple[int, int, int, int]:
    """The shapes of a Mamba2 scan's inputs (both forms): ``(b, t, h, p)`` of ``x``, or a
    ``ValueError`` naming ``what`` and the input."""
    check_shape(what, "x", x, (None,) * 4)
    b, t, h, p = x.shape
    check_shape(what, "dt", dt, (b, t, h))
    check_shape(what, "A", A, (h,))
    check_shape(what, "B", B, (b, t, None, None))
    check_shape(what, "C", C, tuple(B.shape))
    check_shape(what, "D", D, (h,))
    check_shape(what, "dt_bias", dt_bias, (h,))
    if h % B.shape[2]:
        raise ValueError(f"{what}: {h} heads do not split into {B.shape[2]} groups of B and C")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{what}: chunk_size must be a positive int, got {chunk_size!r}")
    return b, t, h, p


def _ssd_check(x, dt, A, B, C, chunk_size, D, dt_bias, pieces, group, timeout):
    what = "mamba2_scan"
    b, t, h, p = ssd_shapes(what, x, dt, A, B, C, chunk_size, D, dt_bias)
    rank_world_ = check_pieces(pieces, group, t, what)
    dims = dict(batch=b, heads=h, head_dim=p, state=B.shape[3])
    agree_call(what, dims, pieces, group, timeout, x.device)
    return rank_world_


def _ssd_pieces(x, dt, A, B, C, chunk_size: int, mine):
    """Each local piece from a zero state: outputs ``(B, L, H, P)``, final states ``(B, H, P,
    N)``, transitions ``exp(sum dt A)`` ``(B, H)`` and log-decays from its start ``(B, L, H)``
    (None for pad pieces, whose outputs and states are zeros)."""
    b, _, h, p = x.shape
    ys, finals, transitions, logs = [], [], [], []
    for piece in mine:
        rows = slice(piece.rows.start, piece.rows.stop)
        if piece.doc < 0:
            ys.append(x.new_zeros(x[:, rows].shape, dtype=torch.float32))
            finals.append(x.new_zeros((b, h, p, B.shape[3]), dtype=torch.float32))
            transitions.append(x.new_zeros((b, h), dtype=torch.float32))
            logs.append(None)
            continue
        y, final = ssd_scan_ref(x[:, rows], dt[:, rows], A, B[:, rows], C[:, rows], chunk_size)
        g = (dt[:, rows] * A).cumsum(1)  # (B, L, H)
        ys, finals, logs = ys + [y], finals + [final], logs + [g]
        transitions.append(torch.exp(g[:, -1]))  # (B, H)
    return ys, finals, transitions, logs


def mamba2_scan(
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
    initial_state: Optional[Dict[int, torch.Tensor]] = None,
    return_final_state: Union[bool, str] = False,
):
    """Mamba2's SSD scan of a sharded sequence, the math of transformers' ``mamba2_chunk_scan``
    (bamba) per document: ``x`` ``(B, T_local, H, P)``, ``dt`` ``(B, T_local, H)`` raw (then
    ``+ dt_bias``, softplus, clamped to ``dt_limit``), ``A`` ``(H,)``, ``B``/``C`` ``(B,
    T_local, G, N)``, ``D`` ``(H,)`` -> ``y`` ``(B, T_local, H, P)`` float32 (as transformers);
    with ``return_final_state``: ``(y, {doc: (B, H, P, N) float32})``, the same on every
    rank. ``initial_state``: ``{doc: (B, H, P, N)}`` entering a document (a continued one);
    ``return_final_state="pieces"``: ``{(doc, end): state}`` after every piece (``carry``)."""
    ends = ends_wanted(return_final_state)
    rank, world = _ssd_check(x, dt, A, B, C, chunk_size, D, dt_bias, pieces, group, timeout)
    h = x.shape[2]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).float()  # (B, T, H)
    A = A.float()
    B, C = (t.float().repeat_interleave(h // B.shape[2], dim=2) for t in (B, C))  # (B, T, H, N)
    ys, finals, transitions, logs = _ssd_pieces(x, dt, A, B, C, chunk_size, pieces.mine(rank))

    def correct(i, h_in):  # h_in (B, H, P, N) -> (B, L, H, P)
        rows = pieces.mine(rank)[i].rows
        c = C[:, rows.start : rows.stop]
        return torch.einsum("blhn,bhpn->blhp", c, h_in) * torch.exp(logs[i])[..., None]

    def compose(tr, state):  # tr (B, H), state (B, H, P, N)
        return tr[..., None, None] * state

    passing = dict(pieces=pieces, group=group, timeout=timeout, initial=initial_state, ends=ends)
    inputs = (x, dt, A, B, C)
    ys, doc_final = _pass_states(ys, finals, transitions, compose, correct, inputs, **passing)
    mine = pieces.mine(rank)
    if D is not None:  # the skip on real rows only (pad rows stay zeros, without gradient)
        ys = [
            y if p.doc < 0 else y + D[..., None] * x[:, p.rows.start : p.rows.stop].float()
            for p, y in zip(mine, ys)
        ]
    y = torch.cat(ys, 1)  # (B, T_local, H, P)
    y = _tie(y, list(doc_final.values()), world, mine, [x, dt, A, B, C, D, dt_bias])
    return (y, doc_final) if return_final_state else y


def _skip_gate(y, x, D, z, rows: range):
    """``(y + D x) * silu(z)`` on one piece's rows: y (B, D, L) float32."""
    r = slice(rows.start, rows.stop)
    if D is not None:
        y = y + x[..., r].float() * D.float()[:, None]
    return y if z is None else y * F.silu(z[..., r].float())


def selective_shapes(what: str, x, dt, A, B, C, D, z, delta_bias) -> Tuple[int, int, int]:
    """The shapes of a selective scan's inputs (both forms): ``(b, d, t)`` of ``x``, or a
    ``ValueError`` naming ``what`` and the input."""
    check_shape(what, "x", x, (None,) * 3)
    b, d, t = x.shape
    check_shape(what, "dt", dt, (b, d, t))
    check_shape(what, "A", A, (d, None))
    check_shape(what, "B", B, (b, A.shape[1], t))
    check_shape(what, "C", C, (b, A.shape[1], t))
    check_shape(what, "D", D, (d,))
    check_shape(what, "z", z, (b, d, t))
    check_shape(what, "delta_bias", delta_bias, (d,))
    return b, d, t


def _sel_check(x, dt, A, B, C, D, z, delta_bias, pieces, group, timeout):
    what = "selective_scan"
    b, d, t = selective_shapes(what, x, dt, A, B, C, D, z, delta_bias)
    rank_world_ = check_pieces(pieces, group, t, what)
    dims = dict(batch=b, channels=d, state=A.shape[1])
    agree_call(what, dims, pieces, group, timeout, x.device)
    return rank_world_


def selective_scan(
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
    initial_state: Optional[Dict[int, torch.Tensor]] = None,
    return_final_state: Union[bool, str] = False,
):
    """Mamba's selective scan of a sharded sequence, the math of transformers' jamba
    ``mamba_selective_scan`` per document: ``x`` ``(B, D, T_local)``, ``dt`` ``(B, D, T_local)``
    raw (then ``+ delta_bias``, softplus), ``A`` ``(D, N)``, ``B``/``C`` ``(B, N, T_local)``,
    ``D`` ``(D,)``, ``z`` ``(B, D, T_local)`` (gate ``* silu(z)``) -> ``y`` ``(B, D, T_local)``
    (dtype as transformers: ``x``'s promoted with ``D``'s and ``z``'s); with
    ``return_final_state``: ``(y, {doc: (B, D, N) float32})``, the same on every rank;
    ``initial_state`` and ``"pieces"`` as in ``mamba2_scan``."""
    ends = ends_wanted(return_final_state)
    rank, world = _sel_check(x, dt, A, B, C, D, z, delta_bias, pieces, group, timeout)
    out_dtype = x.dtype
    for t in (D, z):
        out_dtype = out_dtype if t is None else torch.promote_types(out_dtype, t.dtype)
    dt = process_dt(dt, None if delta_bias is None else delta_bias[..., None], delta_softplus)
    dt, A, Cf = dt.float(), A.float(), C.float()
    ys, finals, transitions = [], [], []
    for p in pieces.mine(rank):
        r = slice(p.rows.start, p.rows.stop)
        if p.doc < 0:  # pad rows: zeros, no state
            ys.append(x.new_zeros(x[..., r].shape, dtype=torch.float32))
            finals.append(x.new_zeros((x.shape[0], *A.shape), dtype=torch.float32))
            transitions.append(finals[-1])
            continue
        y, final = selective_scan_ref(x[..., r], dt[..., r], A, B[..., r], Cf[..., r])
        ys, finals = ys + [y], finals + [final]
        transitions.append(torch.exp(dt[..., r].sum(-1)[..., None] * A))  # (B, D, N)

    def correct(i, h_in):  # h_in (B, D, N) -> (B, D, L): what h_in alone gives, decayed
        rows = pieces.mine(rank)[i].rows
        r = slice(rows.start, rows.stop)
        return selective_scan_ref(None, dt[..., r], A, None, Cf[..., r], initial_state=h_in)[0]

    inputs = (x, dt, A, B, C)
    passing = dict(pieces=pieces, group=group, timeout=timeout, initial=initial_state, ends=ends)
    ys, doc_final = _pass_states(ys, finals, transitions, torch.mul, correct, inputs, **passing)
    mine = pieces.mine(rank)
    ys = [y if p.doc < 0 else _skip_gate(y, x, D, z, p.rows) for p, y in zip(mine, ys)]
    y = torch.cat(ys, -1)  # (B, D, T_local)
    y = _tie(
        y.to(out_dtype), list(doc_final.values()), world, mine, [x, dt, A, B, C, D, z, delta_bias]
    )
    return (y, doc_final) if return_final_state else y
