"""Sequence-parallel gated delta rule (Gated DeltaNet) and KDA, exact and differentiable.

Per head the state ``S`` ``(D_k, D_v)`` goes through a piece of tokens as an affine map,
``S_out = M S_in + S_local``, with ``M`` ``(D_k, D_k)``, and the columns of ``S`` evolve
independently. So one local pass per piece gives everything: the chunked rule runs with values
``[v | 0]`` and initial state ``[0 | I]`` (``D_v + D_k`` columns); its final state is
``[S_local | M]`` and its outputs are ``[o_local | a_t]`` with ``a_t = scale q_t^T M_{<=t}``
(the transition up to token ``t`` read by ``q_t``). ``pieces.carry`` gathers every piece's
``(M, S_local)`` and folds them in sequence order (float32, differentiable); the state entering a
piece, ``h``, then adds ``a_t h`` to each of its outputs. One pass, one all-gather of
``O(H D_k (D_k + D_v))`` per piece, the state gradient back through the same gather.

A rank's real pieces (of any documents) run in a few batches of similar lengths, each piece
padded at its end to its batch's longest (zero k, g and beta leave the state unchanged); pad rows
(doc -1) give zeros.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F

from ..kernels.delta_ref import chunk_delta_rule, prepare_gdn, prepare_kda
from .collectives import rank_world
from .pieces import Pieces, carry, check_pieces, ends_wanted, tie

__all__ = ["gated_delta_rule", "kda"]


def gated_delta_rule(
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
    initial_state: Optional[Dict[int, torch.Tensor]] = None,
    return_final_state: Union[bool, str] = False,
):
    """Same math and argument meaning as transformers' torch_chunk_gated_delta_rule
    (qwen3_next) over the whole sequence: q/k (B, T_local, H_k, D_k), v (B, T_local, H_v, D_v),
    g/beta (B, T_local, H_v) -> o (B, T_local, H_v, D_v) in the dtype transformers returns
    (q's); with return_final_state: (o, {doc: (B, H_v, D_k, D_v) float32}), the same on every
    rank.

    The local rows are this rank's rows in ``pieces.mine(rank)`` order (pad rows included);
    ``scale`` defaults to ``D_k ** -0.5`` (applied after the optional l2-normalisation).
    ``initial_state``: ``{doc: (B, H_v, D_k, D_v)}`` entering a (continued) document;
    ``return_final_state="pieces"``: ``{(doc, end): state}`` after every piece
    (``pieces.carry``)."""
    _check(q, k, v, g, beta, chunk_size, pieces, group, per_channel=False)
    prepared = prepare_gdn(q, k, v, g, beta, scale, use_qk_l2norm)  # (B, H_v, T, ...) f32
    states = (initial_state, return_final_state)
    return _sp(prepared, q.dtype, chunk_size, pieces, group, timeout, states)


def kda(
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
    initial_state: Optional[Dict[int, torch.Tensor]] = None,
    return_final_state: Union[bool, str] = False,
):
    """The same for transformers' chunk_kimi_delta_attention: q/k (B, T_local, H, D_k),
    v (B, T_local, H, D_v), g (B, T_local, H, D_k) (per-channel log-decay), beta
    (B, T_local, H) -> o (B, T_local, H, D_v) in q's dtype; with return_final_state:
    (o, {doc: (B, H, D_k, D_v) float32}); ``initial_state`` and ``"pieces"`` likewise."""
    _check(q, k, v, g, beta, chunk_size, pieces, group, per_channel=True)
    prepared = prepare_kda(q, k, v, g, beta, scale, use_qk_l2norm)  # (B, H, T, ...) f32
    states = (initial_state, return_final_state)
    return _sp(prepared, q.dtype, chunk_size, pieces, group, timeout, states)


# ---------------------------------------------------------------------------------------------
# checks


def _check(q, k, v, g, beta, chunk_size, pieces, group, per_channel: bool) -> None:
    name = "kda" if per_channel else "gated_delta_rule"
    t = delta_shapes(name, q, k, v, g, beta, chunk_size, per_channel)[1]
    check_pieces(pieces, group, t, name)


def delta_shapes(name: str, q, k, v, g, beta, chunk_size, per_channel: bool):
    """The shapes of a delta rule's inputs (both forms; ``per_channel``: KDA):
    ``(b, t, hk, hv, dk)``, or a ``ValueError`` naming ``name`` and the input."""
    for what, x, dims in (
        ("q", q, 4),
        ("k", k, 4),
        ("v", v, 4),
        ("g", g, 4 if per_channel else 3),
        ("beta", beta, 3),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: {what} must be a {dims}-D tensor, got {shape}")
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    want = {
        "k": (k.shape, (b, t, hk, dk)),
        "v": (v.shape[:2], (b, t)),
        "g": (g.shape, (b, t, hv, dk) if per_channel else (b, t, hv)),
        "beta": (beta.shape, (b, t, hv)),
    }
    for what, (got, exp) in want.items():
        if tuple(got) != tuple(exp):
            raise ValueError(
                f"{name}: {what} has shape {tuple(got)}, expected {tuple(exp)} from q "
                f"{tuple(q.shape)} and v {tuple(v.shape)}"
            )
    if (per_channel and hv != hk) or hv % hk:
        rule = "the same head count" if per_channel else "v heads a multiple of the q/k heads"
        raise ValueError(f"{name}: q/k have {hk} heads and v {hv}: {rule} is needed")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")
    return b, t, hk, hv, dk


# ---------------------------------------------------------------------------------------------
# the local pass, the state passing and the correction


def _stack_pieces(x: torch.Tensor, ps, length: int) -> torch.Tensor:
    """``x`` ``(B, H, T, ...)`` -> ``(P * B, H, length, ...)``: each piece's rows, zero-padded
    at the end."""
    parts = []
    for p in ps:
        part = x[:, :, p.rows.start : p.rows.stop]
        pad = [0, 0] * (x.dim() - 3) + [0, length - len(p.rows)]
        parts.append(F.pad(part, pad))
    return torch.cat(parts, 0)


def _buckets(ps) -> List[list]:
    """Pieces by length, longest first, cut where a piece is under half its bucket's longest:
    each bucket runs as one batch, padded to its longest (at most twice the work of its rows)."""
    out: List[list] = []
    for p in sorted(ps, key=lambda p: -len(p.rows)):
        if out and 2 * len(p.rows) >= len(out[-1][0].rows):
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _local_pass(prepared, ps, chunk_size: int):
    """Pieces ``ps`` (one bucket) from their own starts: each piece's outputs
    ``(B, H, L, D_v + D_k)`` (``[o_local | a]``, padded to the longest) and final state
    ``(B, H, D_k, D_v + D_k)`` (``[S_local | M]``)."""
    q, k, v, g, beta = prepared
    b, h, _, dk = k.shape
    length = len(ps[0].rows)
    q, k, v, g, beta = (_stack_pieces(x, ps, length) for x in (q, k, v, g, beta))
    v = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], -1)  # (P*B, H, L, D_v + D_k)
    eye = torch.eye(dk, dtype=v.dtype, device=v.device)
    s0 = torch.cat([v.new_zeros(dk, v.shape[-1] - dk), eye], -1)  # [0 | I]
    o, final = chunk_delta_rule(q, k, v, g, beta, s0.expand(v.shape[0], h, -1, -1), chunk_size)
    return zip(o.unflatten(0, (len(ps), b)), final.unflatten(0, (len(ps), b)))


def _sp(prepared, dtype, chunk_size, pieces, group, timeout, states):
    initial, return_final_state = states
    ends = ends_wanted(return_final_state)
    q, v = prepared[0], prepared[2]
    b, h, _, dk = q.shape
    dv = v.shape[-1]
    rank, _ = rank_world(group)
    mine = pieces.mine(rank)
    local = {}  # piece -> (its [o_local | a], its [S_local | M])
    for bucket in _buckets([p for p in mine if p.doc >= 0]):
        local.update(zip(bucket, _local_pass(prepared, bucket, chunk_size)))
    zero = q.new_zeros(b, h, dk, dv + dk)  # pad pieces: never read by carry
    finals = [local[p][1][..., :dv] if p in local else zero[..., :dv] for p in mine]
    trans = [local[p][1][..., dv:] if p in local else zero[..., dv:] for p in mine]
    inputs = [*prepared, *(initial or {}).values()]
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    incoming, *finals_out = carry(
        finals, trans, _compose, pieces, group, timeout, needs_grad, initial, ends
    )
    doc_final = finals_out[-1]
    outs = []
    for p, h_in in zip(mine, incoming):
        if p.doc < 0:
            outs.append(v.new_zeros(b, h, len(p.rows), dv))
        else:
            outs.append(_corrected(local[p][0][:, :, : len(p.rows)], h_in, dv))
    out = torch.cat(outs, 2).transpose(1, 2).contiguous()  # (B, T, H, D_v)
    out = tie(out, [*doc_final.values(), *prepared]).to(dtype)  # see pieces.tie
    return (out, doc_final) if return_final_state else out


def _compose(m: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return m @ h  # (B, H, D_k, D_k) @ (B, H, D_k, D_v), float32 (carry casts)


def _corrected(op: torch.Tensor, h: Optional[torch.Tensor], dv: int) -> torch.Tensor:
    """``o_local + a h`` for one piece: op ``(B, H, L, D_v + D_k)``, h ``(B, H, D_k, D_v)``
    float32 or None (the piece starts its document)."""
    if h is None:
        return op[..., :dv]
    return op[..., :dv] + op[..., dv:] @ h.float()
