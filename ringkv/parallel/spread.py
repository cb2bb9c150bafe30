"""A hybrid model's long prompt chunk split over the SP group: ring attention on its attention
layers, state passing on its recurrent layers (``ringkv.sp``'s, as ``patch_model`` runs them).

**Where its tokens are computed.** A *spread* chunk of ``n`` tokens from position ``start`` is
padded to ``P = 2 sp * ceil(n / (2 sp))`` rows and cut into ``2 sp`` runs of ``c = P / (2 sp)``;
SP rank ``j`` computes runs ``j`` and ``2 sp - 1 - j`` (the *zigzag* layout: every rank has as
much causal attention work). A recurrent layer needs runs of consecutive tokens: the pieces of
``ringkv.sp.pieces`` are these runs, each chunk one document, also cut where a state checkpoint
is saved (the state after a piece is known on every rank) and where the padding starts.

**Where its K/V are stored.** The cache stripes tokens (``p % sp``, ``parallel.context``), so each
attention layer sends each computed row's K/V to the rank that stores it: one all-to-all of the
sizes each pair of ranks exchanges (``sp.collectives.all_to_all_sizes``). Attention is then
``ring_attention_shards`` with zigzag queries over the chunk's own K/V (a chunk from position 0)
or over every key the ranks store (a later chunk: the cached prefix included).

**Its state.** A recurrent layer starts each chunk from the sequence's state slot (zeros at
position 0); every rank ends with the same state after the chunk and at each checkpoint (the
carry gathers every piece's), so each writes its own replica, as decode needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from ..sp.collectives import all_to_all_sizes
from ..sp.delta import gated_delta_rule
from ..sp.layout import chunks
from ..sp.pieces import Piece, Pieces
from ..sp.recurrent import causal_conv1d, mamba2_scan


@dataclass(frozen=True)
class SpreadSeq:
    """One spread chunk in a step: ``n`` tokens from ``start``, this rank's rows from ``row``
    (``2 c`` of them), its state ``slot`` and the ``(position, snapshot slot)`` to save."""

    row: int
    start: int
    n: int
    slot: int
    saves: tuple
    block_table: tuple


def run_len(n: int, sp: int) -> int:
    """``c``: the rows of each of a spread chunk's ``2 sp`` runs."""
    return -(-n // (2 * sp))


def offsets(n: int, sp: int, rank: int) -> List[range]:
    """The chunk offsets ``rank`` computes, in its local row order (pad offsets ``>= n``)."""
    return chunks(2 * sp * run_len(n, sp), "zigzag", rank, sp)


def local_row(s: SpreadSeq, sp: int, rank: int, p: int) -> int:
    """Position ``p``'s row on ``rank``, or -1 if another rank computes it."""
    c, o = run_len(s.n, sp), p - s.start
    run = o // c
    owner, second = (run, 0) if run < sp else (2 * sp - 1 - run, 1)
    return s.row + second * c + o % c if owner == rank else -1


def query_shards(s: SpreadSeq, sp: int) -> Tuple[Tuple[range, ...], ...]:
    """Every rank's query positions."""
    return tuple(
        tuple(range(s.start + r.start, s.start + r.stop) for r in offsets(s.n, sp, j))
        for j in range(sp)
    )


def _pieces(seqs: List[SpreadSeq], sp: int) -> Pieces:
    """Each rank's pieces: every chunk (one document each) cut at its checkpoints and its pad."""
    by_rank = []
    for j in range(sp):
        ps, row = [], 0
        for d, s in enumerate(seqs):
            cuts = sorted({p - s.start for p, _ in s.saves if 0 < p - s.start < s.n} | {s.n})
            for r in offsets(s.n, sp, j):
                at = r.start
                for c in [c for c in cuts if r.start < c < r.stop] + [r.stop]:
                    doc = d if at < s.n else -1
                    ps.append(Piece(j, range(row, row + c - at), doc, at))
                    row, at = row + c - at, c
        by_rank.append(tuple(ps))
    return Pieces(sp, tuple(by_rank), tuple(s.n for s in seqs))


@dataclass(frozen=True)
class Exchange:
    """Where each computed row's K/V is stored: this rank's rows ``send`` ``(S,)`` in destination
    order, ``send_rows[j]`` of them to rank ``j``; ``recv_rows[i]`` rows come from rank ``i`` (in
    rank order) and go to the cache ``slots`` ``(R,)``."""

    send: torch.Tensor
    send_rows: Tuple[int, ...]
    recv_rows: Tuple[int, ...]
    slots: torch.Tensor


def _exchange(seqs: List[SpreadSeq], sp: int, rank: int, bs: int, device) -> Exchange:
    send: List[list] = [[] for _ in range(sp)]  # destination -> rows here
    recv: List[list] = [[] for _ in range(sp)]  # source -> slots here
    counts = torch.zeros(sp, sp, dtype=torch.long)  # (source, destination) -> rows
    for s in seqs:
        table, lb = torch.tensor(s.block_table, dtype=torch.long), bs * sp
        for i in range(sp):
            off = torch.cat([torch.arange(r.start, r.stop) for r in offsets(s.n, sp, i)])
            pos = s.start + off  # (2c,) in rank i's row order
            for j in range(sp):
                sel = (off < s.n) & (pos % sp == j)
                counts[i, j] += sel.sum()
                if i == rank:
                    send[j].append(s.row + torch.nonzero(sel)[:, 0])
                if j == rank:
                    p = pos[sel]
                    recv[i].append(table[p // lb] * bs + p % lb // sp)
    rows = torch.cat([torch.cat(x) for x in send])
    slots = torch.cat([torch.cat(x) for x in recv])
    sizes = tuple(counts[rank].tolist()), tuple(counts[:, rank].tolist())
    return Exchange(rows.to(device), *sizes, slots.to(device))


def write_kv(kv, layer: int, k, v, ex: Exchange, group, timeout) -> None:
    """Each computed row's K/V ``k``/``v`` ``(T, Hkv, D)`` into the cache of the rank storing it:
    one all-to-all of each row's K and V side by side, of the sizes each pair of ranks sends."""
    rows = torch.cat([k.flatten(1), v.flatten(1)], 1).index_select(0, ex.send)  # (S, W)
    w, kw = rows.shape[1], k[0].numel()
    got = all_to_all_sizes(
        rows.reshape(-1), [n * w for n in ex.send_rows], [n * w for n in ex.recv_rows],
        group, timeout, "spread prefill K/V",
    ).view(-1, w)  # (R, W)  # fmt: skip
    k_got, v_got = got[:, :kw].reshape(-1, *k.shape[1:]), got[:, kw:].reshape(-1, *v.shape[1:])
    kv.write(layer, k_got, v_got, ex.slots)


class SpreadOps:
    """A mixer's sequential cores (``model.mixers.Reference``'s) over the spread chunks' pieces,
    ``ringkv.sp``'s state passing. A state is ``{doc: (1, *shape)}`` entering the chunks that
    continue a sequence; what comes back is ``{(doc, end): (1, *shape)}`` after every piece."""

    def __init__(self, pieces: Pieces, group, timeout):
        self.sp = dict(pieces=pieces, group=group, timeout=timeout)

    def conv(self, conv, u, state, activation):
        # u (1, T, C), state {doc: (1, C, K-1)} -> (1, T, C), {(doc, end): (1, C, K-1)}
        y, tails = causal_conv1d(
            u.transpose(1, 2), conv.weight[:, 0], conv.bias, activation,
            initial_state=state, return_tail="pieces", **self.sp,
        )  # fmt: skip
        return y.transpose(1, 2), {e: t[..., 1:].float() for e, t in tails.items()}

    def ssd(self, x, dt, A, B, C, *, D, dt_bias, dt_limit, chunk_size, state):
        return mamba2_scan(
            x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=dt_limit, initial_state=state, return_final_state="pieces", **self.sp,
        )  # fmt: skip

    def delta(self, q, k, v, g, beta, *, chunk_size, state):
        return gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=chunk_size,
            initial_state=state, return_final_state="pieces", **self.sp,
        )  # fmt: skip


class Spread:
    """A step's spread chunks on this rank: their ``rows`` ``(T_s,)`` of the step, ``pieces``,
    the K/V ``exchange``; ``resume``: ``(doc, slot)`` of the chunks past position 0; ``stores``:
    ``((doc, end), slot)``, the states to keep (each chunk's last, its checkpoints)."""

    def __init__(self, seqs: List[SpreadSeq], sp: int, rank: int, bs: int, device):
        c2 = [2 * run_len(s.n, sp) for s in seqs]
        self.rows = torch.cat([torch.arange(s.row, s.row + m) for s, m in zip(seqs, c2)]).to(device)
        self.pieces = _pieces(seqs, sp)
        self.exchange = _exchange(seqs, sp, rank, bs, device)
        self.resume = tuple((d, s.slot) for d, s in enumerate(seqs) if s.start > 0)
        self.stores: Tuple[Tuple[Tuple[int, int], int], ...] = tuple(
            ((d, p - s.start), dst)
            for d, s in enumerate(seqs)
            for p, dst in (*s.saves, (s.start + s.n, s.slot))
            if s.start < p <= s.start + s.n
        )

    def recur(self, pool: List[torch.Tensor], fn, u: torch.Tensor, group, timeout):
        """A recurrent layer (``fn``: its ``scan``) over the chunks' rows of ``u`` ``(T, F)``
        -> ``(T_s, F')``, from and into the state ``pool`` (a snapshot slot gets the state at its
        checkpoint, the sequence's slot the state after the chunk; every rank the same)."""
        init: List[Dict[int, torch.Tensor]] = [
            {d: t[slot : slot + 1].to(torch.float32, copy=True) for d, slot in self.resume}
            for t in pool
        ]
        ops = SpreadOps(self.pieces, group, timeout)
        y, after = fn(u.index_select(0, self.rows)[None], init, ops)  # (1, T_s, F')
        for t, states in zip(pool, after):
            for key, slot in self.stores:
                t[slot] = states[key][0]
        return y[0]
