"""Where the sequence's pieces live, and the state passing that recurrent layers share.

A recurrent layer (short convolution, Mamba2 SSD, Mamba selective scan, gated delta rule, KDA)
needs, at each token, what every earlier token of its document left behind. With the sequence
sharded by a ``layout``, a rank holds one or more *pieces*: runs of consecutive tokens of one
document (contiguous: one; zigzag: two per document, chunks ``r`` and ``2N-1-r``; packed
documents: each document is split by the layout on its own, see ``layout.varlen_chunks``).

Every rank computes every piece of its own from a zero state: its final state ``F`` and its
transition ``T`` (the map from the state entering the piece to the state leaving it, with the
piece's own contribution left out). ``carry`` gathers all ``(T, F)`` of the group (a few states
per rank: constant in the sequence length) and folds, for each local piece, the pieces of the
same document that come before it **in sequence order** (not rank order):
``h <- compose(T_q, h) + F_q``. The fold runs in float32 and is differentiable (the gather's
backward sums every rank's gradient), so the state gradient flows back in reverse order.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .collectives import agree_once, all_reduce_, rank_world, start_all_gather
from .layout import chunks, granule, varlen_chunks

RECURRENT_LAYOUTS = ("contiguous", "zigzag")  # striped would make every token its own piece


@dataclass(frozen=True)
class Piece:
    """A run of consecutive tokens of one document held by one rank.

    ``rows``: the rows of that rank's local shard; ``doc``: the document (0 for an unpacked
    sequence; -1 for pad rows, which carry no state); ``start``: the position of its first token
    within the document."""

    rank: int
    rows: range
    doc: int
    start: int


@dataclass(frozen=True)
class Pieces:
    """Every rank's pieces of one sharded sequence (the same on every rank)."""

    world: int
    by_rank: Tuple[Tuple[Piece, ...], ...]  # each rank's pieces, in local row order
    doc_lens: Tuple[int, ...]  # real tokens of each document

    def mine(self, rank: int) -> Tuple[Piece, ...]:
        return self.by_rank[rank]

    @functools.cached_property
    def order(self) -> Dict[int, List[Piece]]:
        """document -> its pieces in sequence order (pad pieces left out)."""
        docs: Dict[int, List[Piece]] = {}
        for p in (p for ps in self.by_rank for p in ps if p.doc >= 0):
            docs.setdefault(p.doc, []).append(p)
        return {d: sorted(ps, key=lambda p: p.start) for d, ps in docs.items()}

    def before(self, piece: Piece) -> List[Piece]:
        """The pieces of ``piece``'s document that precede it, in sequence order."""
        if piece.doc < 0:
            return []
        return [p for p in self.order[piece.doc] if p.start < piece.start]

    def last(self, doc: int) -> Piece:
        """The piece holding ``doc``'s last token."""
        return self.order[doc][-1]

    def index(self, piece: Piece) -> int:
        """``piece``'s slot in its rank's list (the row of the gathered states)."""
        return self.by_rank[piece.rank].index(piece)

    @functools.cached_property
    def fingerprint(self) -> int:
        """The same number on every process for the same pieces (``hash()`` of a tuple holding
        None is not, before Python 3.12): what ranks compare before their collectives."""
        return zlib.crc32(repr((self.world, self.by_rank, self.doc_lens)).encode())

    @property
    def slots(self) -> int:
        """The most pieces any rank holds (the gathered tensors' second dimension)."""
        return max(len(ps) for ps in self.by_rank)


def check_recurrent_layout(layout: str) -> None:
    if layout not in RECURRENT_LAYOUTS:
        raise ValueError(
            f"recurrent layers (convolution, state-space, linear attention) run on layouts "
            f"{RECURRENT_LAYOUTS}, not {layout!r}: striped makes every token its own piece"
        )


def check_pieces(pieces, group, n_rows: int, what: str) -> Tuple[int, int]:
    """``(rank, world)`` after checking that ``pieces`` describe this group and a local sequence
    of ``n_rows`` rows (a local check: the same verdict on every rank for the same call)."""
    if not isinstance(pieces, Pieces):
        raise TypeError(
            f"{what}: pieces must be a ringkv.sp.pieces.Pieces (seq_pieces), got "
            f"{type(pieces).__name__}"
        )
    rank, world = rank_world(group)
    if pieces.world != world:
        raise ValueError(
            f"{what}: pieces were built for {pieces.world} ranks, the group has {world}"
        )
    rows = sum(len(p.rows) for p in pieces.mine(rank))
    if n_rows != rows:
        raise ValueError(
            f"{what}: the local sequence has T_local={n_rows} rows, pieces give rank {rank} "
            f"{rows} (pad rows included)"
        )
    return rank, world


def check_shape(what: str, name: str, t: Optional[torch.Tensor], shape: Sequence) -> None:
    """``t`` a tensor of ``shape`` (ints, None for any size); None passes."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{what}: {name} must have shape {want}, got {tuple(t.shape)}")


def agree_call(what: str, dims: dict, pieces: Pieces, group, timeout, device) -> None:
    """Every rank of the group makes the same call: the sizes ``dims`` of what it exchanges and
    the same pieces (one small all-gather the first time per configuration, then remembered), so
    a rank calling differently raises on every rank instead of a mismatched collective."""
    values = [int(v) for v in dims.values()] + [pieces.fingerprint]
    agree_once(values, [*dims, "pieces"], group, timeout, what, device)


@functools.lru_cache(maxsize=256)
def _pieces(seq_len: int, layout: str, world: int, cu: Optional[Tuple[int, ...]]) -> Pieces:
    by_rank = []
    for rank in range(world):
        if cu is None:
            g = granule(layout, world)
            padded = -(-seq_len // g) * g
            ranges = [(0, r) for r in chunks(padded, layout, rank, world)]
            ranges = _split_pad(ranges, seq_len)
        else:
            ranges = varlen_chunks(cu, layout, rank, world)
        ps, row = [], 0
        for doc, r in ranges:
            if len(r):
                ps.append(Piece(rank, range(row, row + len(r)), doc, r.start))
            row += len(r)
        by_rank.append(tuple(ps))
    lens = (seq_len,) if cu is None else tuple(b - a for a, b in zip(cu, cu[1:]))
    return Pieces(world, tuple(by_rank), lens)


def _split_pad(ranges, seq_len: int):
    out = []
    for doc, r in ranges:
        real = range(r.start, min(r.stop, max(seq_len, r.start)))
        out += [(doc, real)] if len(real) else []
        out += [(-1, r[len(real) :])] if len(real) < len(r) else []
    return out


def seq_pieces(
    seq_len: int, layout: str, world: int, cu_seqlens: Optional[Sequence[int]] = None
) -> Pieces:
    """The pieces of a sequence of ``seq_len`` real tokens (padded at the end to the layout's
    granule, as ``patch_model`` pads), or of packed documents ``cu_seqlens`` (``seq_len`` is then
    ignored), sharded by ``layout`` over ``world`` ranks."""
    check_recurrent_layout(layout)
    cu = None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
    return _pieces(int(seq_len), layout, int(world), cu)


# ---------------------------------------------------------------------------------------------
# the gather and the fold


class _Arrived(torch.autograd.Function):
    """The result of an all-gather of ``x`` ``(P, *s)`` posted earlier -> ``(world, P, *s)``;
    backward: the sum over ranks of the gradient of this rank's slot (an all-reduce: gloo has no
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, pending, group, timeout, what):
        ctx.args, ctx.rank = (group, timeout, what), rank_world(group)[0]
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        group, timeout, what = ctx.args
        grad = all_reduce_(grad.contiguous().clone(), group, timeout, what + " (backward)")
        return grad[ctx.rank], None, None, None, None


def arrived(x: torch.Tensor, pending, group=None, timeout=None, what="state passing"):
    """``pending`` (``start_all_gather(x, ...)``, posted earlier so that local work overlaps it)
    waited for: every rank's ``x`` ``(P, *s)`` as ``(world, P, *s)``, differentiable."""
    return _Arrived.apply(x, pending, group, timeout, what)


def gather_slots(
    x: torch.Tensor, group=None, timeout: Optional[timedelta] = None, what: str = "state passing"
) -> torch.Tensor:
    """Every rank's ``x`` ``(P, *s)`` as ``(world, P, *s)``, differentiable."""
    if rank_world(group)[1] == 1:
        return x.unsqueeze(0)
    return arrived(x, start_all_gather(x, group, timeout, what), group, timeout, what)


Compose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (T, h) -> the state after T


def carry(
    finals: List[torch.Tensor],
    transitions: List[torch.Tensor],
    compose: Compose,
    pieces: Pieces,
    group=None,
    timeout: Optional[timedelta] = None,
    needs_grad: Optional[bool] = None,
    initial: Optional[Dict[int, torch.Tensor]] = None,
    ends: bool = False,
):
    """The state entering each of this rank's pieces, and each document's final state.

    ``finals[i]`` / ``transitions[i]``: piece ``i`` of ``pieces.mine(rank)`` from a zero state
    (pad pieces: anything of the right shape, never read); shapes are the same for every piece
    and rank. Returns ``(incoming, doc_final)``: ``incoming[i]`` is None for a piece that starts
    its document without an ``initial`` state (nothing to add) and for pad pieces;
    ``doc_final[d]`` is the state after document ``d``'s last token, the same on every rank
    (float32).

    ``initial``: ``{doc: state}`` entering a document's first piece (a document that continues
    an earlier one, as an engine's later prompt chunk does); a document not in it starts from
    zeros. ``ends``: return ``(incoming, doc_final, after)`` with ``after[(doc, e)]`` the state
    after position ``e`` of the document for every piece's end ``e`` (the same on every rank:
    what a cache keeps at a checkpoint the pieces were cut at).

    ``needs_grad``: whether the layer's inputs need a gradient, the same on every rank (None:
    whenever grad mode is on). Then every rank records the gather, whose backward is a
    collective, also a rank of pad pieces alone (its zero states need no gradient of their own).
    The caller's output must depend on ``doc_final`` on every rank too (a rank whose pieces all
    start their documents reads no gathered state)."""
    rank, world = rank_world(group)
    mine = pieces.mine(rank)
    if len(mine) != len(finals) or len(mine) != len(transitions):
        raise ValueError(f"carry: {len(mine)} pieces on rank {rank}, got {len(finals)} states")
    slots = pieces.slots
    f = _slots([t.float() for t in finals], slots)  # (P, *state)
    t = _slots([t.float() for t in transitions], slots)  # (P, *transition)
    both = torch.cat([f.flatten(1), t.flatten(1)], 1)  # one message: (P, |F| + |T|)
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled()
    if needs_grad and torch.is_grad_enabled() and not both.requires_grad:
        both = both.detach().requires_grad_()  # else the others' backward would wait for it
    g = gather_slots(both, group, timeout)  # (world, P, |F| + |T|)
    nf = f[0].numel()
    g_f = g[..., :nf].reshape(world, slots, *f.shape[1:])
    g_t = g[..., nf:].reshape(world, slots, *t.shape[1:])

    def state_after(p: Piece, h: Optional[torch.Tensor]) -> torch.Tensor:
        i = pieces.index(p)
        own = g_f[p.rank, i]
        return own if h is None else compose(g_t[p.rank, i], h) + own

    initial = initial or {}
    after, entering = {}, {}  # (doc, end) -> the state after it; piece -> the state entering it
    for d, ps in pieces.order.items():  # in sequence order: h <- compose(T_q, h) + F_q
        h = None if initial.get(d) is None else initial[d].float()
        for p in ps:
            entering[p] = h
            h = after[(d, p.start + len(p.rows))] = state_after(p, h)
    incoming = [entering.get(p) for p in mine]  # pad pieces: None
    doc_final = {d: after[(d, ps[-1].start + len(ps[-1].rows))] for d, ps in pieces.order.items()}
    return (incoming, doc_final, after) if ends else (incoming, doc_final)


def ends_wanted(return_final_state) -> bool:
    """Whether a layer's ``return_final_state`` (a bool, or ``"pieces"``: the state after every
    piece, ``carry``'s ``ends``) asks for every piece's end."""
    if return_final_state not in (True, False, "pieces"):
        raise ValueError(
            f"return_final_state must be a bool or 'pieces', got {return_final_state!r}"
        )
    return return_final_state == "pieces"


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *deps):
        ctx.deps = [(d.shape, d.dtype, d.device) for d in deps]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.deps))


def tie(out: torch.Tensor, deps: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """``out`` unchanged, made to depend on ``deps`` (with a zero gradient). A gather's backward
    is a collective, so every rank's backward must reach it: also a rank whose pieces all start
    their documents (contiguous rank 0 reads no gathered state) or hold pad rows only (whose
    inputs then get zero gradients rather than none, as on the other ranks)."""
    deps = [d for d in deps if d is not None and d.requires_grad]
    if not deps or not torch.is_grad_enabled():
        return out
    return _Tie.apply(out, *deps)


def _slots(xs: List[torch.Tensor], slots: int) -> torch.Tensor:
    x = torch.stack(xs)
    if len(xs) < slots:
        x = torch.cat([x, x.new_zeros((slots - len(xs), *x.shape[1:]))])
    return x
