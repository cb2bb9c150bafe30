"""One rank's view of a step and the model's attention call site over its paged KV cache.

**Where a token's K/V lives.** With ``sp`` SP ranks, token ``t`` of a sequence is stored on
SP rank ``t % sp`` (the ``striped`` layout of ``ringkv.sp``, vLLM's decode-context-parallel
interleave of 1). A logical block of the block table holds ``block_size * sp`` consecutive
tokens; each SP rank keeps its ``block_size`` of them in its own physical block with the
same id. So rank ``r``'s tokens of a sequence, ``r, r + sp, r + 2 sp, ...``, form an
ordinary paged sequence (local token ``i`` at ``block_table[i // block_size]``, offset
``i % block_size``), one block table serves every rank, and each rank stores ``1/sp`` of
every sequence. With ``sp = 1`` this is the usual paged layout.

**What a rank computes.** A sequence's step of ``n`` tokens runs in one of two modes:

- *ring* (``sp > 1`` and ``n >= ring_min_tokens``): the tokens are split over the SP ranks
  by the same striping (padded with ``-n % sp`` tokens past the end, which no real query
  sees under the causal mask and which are never stored), so each rank computes exactly the
  tokens it stores. Attention is ``ring_attention_shards``: each rank's keys are all the
  tokens of the sequence it stores: a prompt from position 0 rings its own new K/V; a later
  chunk rings what its rank stores, cached prefix included.
- *spread* (a hybrid model's sequence where ring mode would be: ``parallel.spread``): the tokens
  are split in zigzag runs, whose K/V each attention layer sends to the ranks storing them before
  the ring; recurrent layers pass their state across the ranks.
- *replicated* (decode, short chunks, and everything when ``sp = 1``): every SP rank
  computes all ``n`` tokens; the owner of each token writes its K/V. A sequence starting at
  position 0 attends to its own new K/V with ``kernels.attention`` (every rank has all of
  it); the others attend the queries over the keys each rank stores and the partial
  ``(out, lse)`` are merged across the SP group (``sp.decode.merge_across``: one all-gather
  per layer for all such sequences).

Whatever the mesh, a prompt's first chunk attends to its own K/V as computed and everything
else reads the cache: with a quantized cache every mesh computes the same thing.

**Per-layer attention.** The model passes what a layer's attention needs beyond the defaults
(``model.llama``): ``scale`` (Gemma's ``query_pre_attn_scalar ** -0.5``), ``softcap`` (Gemma 2) and
``window`` (a sliding layer: a query at position ``p`` sees keys ``p - window .. p``). Every path
takes them: the fresh prompt's ``kernels.attention`` (``window=(W, 0)``), the paged backend's
``attend`` (masks on global positions, SP striping included) and the ring
(``ring_attention_shards``, on the shards' global positions). A window only masks: the blocks
of keys that left every sliding layer's window stay allocated (full-attention layers of the same
sequence still read them; a model whose every layer slides still keeps them), and a decode step
still visits them on the backends that do not skip masked blocks.

**Kernels.** The sequences read from the cache are described once per step as
``kernels.paged.PagedSeq``s; the paged backend (``paged_backend``, any of ``kernels.paged``'s)
builds its own metadata for them (``plan_step``) and answers each layer's ``attend`` with
``(rows, out, lse)`` parts. This module names no backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional

import torch

from ..cache.kv_cache import KVCache
from ..cache.state_pool import StatePool
from ..kernels import attention
from ..kernels.mask import NO_WINDOW
from ..kernels.paged import LayerCache, PagedSeq, RowsOut, StepAttention, plan_step
from ..sp.comm import RingComm
from ..sp.decode import merge_across
from ..sp.ring import Shards, ring_attention_shards
from .plan import StepPlan
from .spread import Spread, SpreadSeq, offsets, query_shards, write_kv
from .spread import local_row as spread_row


@dataclass(frozen=True)
class FreshSeq:
    """A prompt from position 0 that every SP rank computes whole: its ``n`` query rows from
    ``row`` attend to their own (unquantized) K/V."""

    row: int
    n: int

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.n)


@dataclass(frozen=True)
class RecurSeq:
    """A hybrid model's sequence in the step: its ``n`` rows from ``row`` (every SP rank computes
    them all), its first position ``start``, its state ``slot`` and the ``(position, snapshot
    slot)`` checkpoints to save."""

    row: int
    n: int
    start: int
    slot: int
    saves: tuple


@dataclass(frozen=True)
class RingSeq:
    """A long chunk split over the SP group (ring mode): this rank's ``m`` query rows from
    ``row``."""

    row: int
    m: int  # rows here: ceil(n / sp), padded past the end
    shards: Shards  # every rank's query and key positions
    key_slots: Optional[
        torch.Tensor
    ]  # (keys stored here,) flat cache slots; None: this step's own K/V
    keys: int  # keys per rank (rank 0 holds the most): the ring's key length

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.m)


class LocalStep:
    """Rank ``sp_rank``'s share of ``plan``: ``input_ids``/``positions`` ``(T,)`` of the tokens it
    computes, ``write_rows``/``write_slots`` of those it stores, the attention work (``fresh``,
    ``rings``, and ``cached``: the paged backend's metadata for the rows read from the cache, or
    None), and ``last_rows``: for each completing sequence, the local row of its last token (or -1
    when another SP rank holds it); ``target_rows`` likewise for the positions whose prompt
    log-probs are wanted (``SeqStep.targets``), and ``targets`` the tokens they predict."""

    def __init__(
        self,
        plan: StepPlan,
        sp_rank: int,
        sp: int,
        block_size: int,
        ring_min_tokens: int,
        device,
        paged_backend: str = "torch",
    ):
        r, bs, lb = sp_rank, block_size, block_size * sp  # lb: tokens per logical block
        ids, pos, rows, slots = [], [], [], []
        self.last_rows, self.target_rows, self.targets = [], [], []
        self.fresh: List[FreshSeq] = []
        self.rings: List[RingSeq] = []
        self.recur: List[RecurSeq] = []  # a hybrid model's replicated sequences
        cached: List[PagedSeq] = []  # attended over the cache
        spread: List[SpreadSeq] = []  # a hybrid's long chunks (parallel.spread)
        for s in plan.seqs:
            off, end = len(ids), s.start + s.n
            long = sp > 1 and s.n >= max(ring_min_tokens, 2)
            ring, sq = long and s.slot < 0, None
            if long and s.slot >= 0:
                sq = SpreadSeq(off, s.start, s.n, s.slot, tuple(s.saves), tuple(s.block_table))
                mine = [s.start + o for o_range in offsets(s.n, sp, r) for o in o_range]
            elif ring:
                m = -(-s.n // sp)
                mine = range(s.start + (r - s.start) % sp, s.start + m * sp, sp)
            else:
                mine = range(s.start, end)
            ids.extend(s.tokens[p - s.start] if p < end else 0 for p in mine)
            pos.extend(mine)
            for j, p in enumerate(mine if sq is None else ()):  # spread: stored by write_kv
                if p < end and p % sp == r:
                    rows.append(off + j)
                    slots.append(s.block_table[p // lb] * bs + p % lb // sp)

            def local_row(p: int) -> int:  # the row of position p here, -1 if another has it
                if sq is not None:
                    return spread_row(sq, sp, r, p)
                if ring:
                    return off + (p - mine.start) // sp if p % sp == r else -1
                return off + p - s.start if r == 0 else -1

            if s.completes:
                self.last_rows.append(local_row(end - 1))
            for j, t in enumerate(s.targets or ()):
                self.target_rows.append(local_row(s.start + j))
                self.targets.append(t)
            if sq is not None:
                spread.append(sq)
                self.rings.append(
                    _ring_seq(s, off, len(mine), sp, r, bs, device, query_shards(sq, sp))
                )
                continue
            if s.slot >= 0:
                self.recur.append(RecurSeq(off, s.n, s.start, s.slot, tuple(s.saves)))
            if ring:
                self.rings.append(_ring_seq(s, off, m, sp, r, bs, device))
            elif s.start == 0:  # every rank computes the whole prompt: it attends to it directly
                self.fresh.append(FreshSeq(off, s.n))
            else:
                cached.append(PagedSeq(off, s.start, s.n, s.block_table))
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (T,)
        self.positions = torch.tensor(pos, dtype=torch.long, device=device)  # (T,)
        self.all_written = len(rows) == len(ids)
        self.write_rows = torch.tensor(rows, dtype=torch.long, device=device)  # (W,)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)  # (W,)
        self.single = _single_rows(self.recur, device)
        self.spread = Spread(spread, sp, r, bs, device) if spread else None
        self.cached: Optional[StepAttention] = (
            plan_step(cached, block_size=bs, sp=sp, sp_rank=r, device=device, backend=paged_backend)
            if cached
            else None
        )


@dataclass(frozen=True)
class SingleRows:
    """A hybrid step's single-token rows, one call of each recurrent layer for all of them:
    their ``rows`` of the step, state ``slots`` and which start at position 0 (``fresh``), each
    ``(S,)``; ``saves``: ``(slot, saves)`` of those that reach a checkpoint."""

    rows: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    saves: tuple


def _single_rows(recur: List[RecurSeq], device) -> Optional[SingleRows]:
    single = [r for r in recur if r.n == 1]
    if not single:
        return None

    def column(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=device)

    return SingleRows(
        column([r.row for r in single]),
        column([r.slot for r in single]),
        column([r.start == 0 for r in single], torch.bool),
        tuple((r.slot, r.saves) for r in single if r.saves),
    )


def _ring_seq(s, off: int, m: int, sp: int, r: int, bs: int, device, queries=None) -> RingSeq:
    """The ring of sequence ``s`` whose ``m`` query rows per rank start at row ``off``: its shards
    (``queries``: every rank's query positions, by default striped like the keys; keys striped
    over the ``sp`` ranks, or a chunk from position 0's own where its queries are) and, past
    position 0, the cache slots of the keys this rank stores (cached prefix included)."""
    end = s.start + s.n
    if queries is None:
        queries = tuple(
            (range(s.start + (j - s.start) % sp, s.start + m * sp, sp),) for j in range(sp)
        )
    if s.start == 0:  # a prompt from position 0: the keys are this step's own (rows off..off+m)
        return RingSeq(off, m, Shards(queries, queries), None, m)
    keys = len(range(0, end, sp))  # keys per rank (rank 0 holds the most)
    shards = Shards(queries, tuple((range(j, j + keys * sp, sp),) for j in range(sp)))
    local = torch.arange(len(range(r, end, sp)), device=device)
    table = torch.tensor(s.block_table, dtype=torch.long, device=device)
    return RingSeq(off, m, shards, table[local // bs] * bs + local % bs, keys)


class StepContext:
    """The model's ``ctx``: ``attend(layer, q, k, v)`` writes the step's K/V into this rank's
    cache and returns the exact attention output of its query rows; a hybrid model's
    ``recur(layer, fn, u, shapes)`` runs a recurrent layer's sequential part from each sequence's
    state slot (``states``) and keeps the state after it. ``kv_index``: a layer's global index
    -> its index in ``kv`` (the stage's attention layers)."""

    def __init__(
        self,
        kv: KVCache,
        step: LocalStep,
        kv_index: Dict[int, int],
        sp: int,
        comm: Optional[RingComm] = None,
        attn_backend: str = "auto",
        timeout: Optional[timedelta] = None,
        states: Optional[StatePool] = None,
    ):
        self.kv, self.step, self.kv_index, self.sp, self.comm = kv, step, kv_index, sp, comm
        self.states = states
        self.attn_backend, self.timeout = attn_backend, timeout
        self._parts_whole: Optional[bool] = None  # see _whole

    def attend(
        self,
        layer: int,
        q,
        k,
        v,
        *,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ):
        # q (T, H, D), k/v (T, Hkv, D) -> out (T, H, D); scale None: D ** -0.5; softcap None: none;
        # window -1: unbounded, else a query at position p sees keys p - window .. p
        st, li, kv = self.step, self.kv_index[layer], self.kv
        if st.spread is not None:  # each spread row's K/V to the rank storing it
            write_kv(kv, li, k, v, st.spread.exchange, self.comm.group, self.timeout)
        if st.all_written:
            kv.write(li, k, v, st.write_slots)
        elif st.write_rows.numel():
            kv.write(
                li,
                k.index_select(0, st.write_rows),
                v.index_select(0, st.write_rows),
                st.write_slots,
            )
        out = torch.empty_like(q)
        dense = dict(
            window=(window, 0) if window >= 0 else NO_WINDOW, softcap=softcap
        )  # kernels.attention, ring
        paged = dict(
            scale=scale, softcap=softcap, window=window
        )  # every paged backend's attend takes them
        for f in st.fresh:  # a prompt from position 0 attends its own (unquantized) K/V
            o, _ = attention(
                q[None, f.rows],
                k[None, f.rows],
                v[None, f.rows],
                scale=scale,
                causal=True,
                backend=self.attn_backend,
                **dense,
            )
            out[f.rows] = o[0]
        cache = kv.layer(li)
        qc = self._rotate(q, kv.rot)  # cached keys live in the quantized format's rotated space
        if st.cached is not None:
            if self.sp == 1:  # this rank holds every key: no lse, no merge
                parts = st.cached.attend(qc, cache, lse=False, **paged)
                if self._whole(
                    parts, q.shape[0]
                ):  # one part, every row in order (decode): it is the output
                    return self._rotate(parts[0].out, kv.rot, back=True)
                for part in parts:
                    out[part.rows] = self._rotate(part.out, kv.rot, back=True)
            else:
                self._merged(st.cached.attend(qc, cache, lse=True, **paged), out)
        for ring in st.rings:
            if (
                ring.key_slots is None
            ):  # its own new K/V (unquantized, like a fresh prompt on one rank)
                o, _ = ring_attention_shards(
                    q[None, ring.rows],
                    k[None, ring.rows],
                    v[None, ring.rows],
                    ring.shards,
                    causal=True,
                    comm=self.comm,
                    softmax_scale=scale,
                    backend=self.attn_backend,
                    **dense,
                )
                out[ring.rows] = o[0]
            else:
                out[ring.rows] = self._rotate(
                    self._ring(qc[ring.rows], cache, ring, scale, dense), kv.rot, back=True
                )
        return out

    def _whole(self, parts: List[RowsOut], t: int) -> bool:
        """Whether ``parts`` is one part holding all ``t`` rows in order and the step has no other
        attention work (decided at the first layer; the same for every layer of the step)."""
        if self._parts_whole is None:
            st = self.step
            self._parts_whole = (
                not st.fresh
                and not st.rings
                and len(parts) == 1
                and parts[0].rows.numel() == t
                and torch.equal(parts[0].rows, torch.arange(t, device=parts[0].rows.device))
            )
        return self._parts_whole

    @staticmethod
    def _rotate(x, rot, back: bool = False):
        """``x (..., D)`` into (or ``back`` out of) the rotated space; identity without rotation."""
        if rot is None:
            return x
        return (x.float() @ (rot.T if back else rot)).to(x.dtype)

    def _merged(self, parts: List[RowsOut], out) -> None:
        """Every replicated row's partial over this rank's keys, merged across the SP group in one
        round."""
        rows = torch.cat([p.rows for p in parts])  # (R,)
        o = torch.cat([p.out for p in parts])[None]  # (1, R, H, D)
        lse = torch.cat([p.lse for p in parts], dim=1)[None]  # (1, H, R)
        merged, _ = merge_across(
            o, lse.contiguous(), self.comm.group, self.timeout, "SP attention merge"
        )
        out[rows] = self._rotate(merged[0].to(out.dtype), self.kv.rot, back=True)

    def _ring(self, q, cache: LayerCache, ring: RingSeq, scale: Optional[float], dense: dict):
        """A long chunk: ring attention over every key of the sequence this rank stores (``dense``:
        the window and soft-cap keywords)."""
        kv = torch.zeros(
            2, ring.keys, *cache.k.shape[2:], dtype=q.dtype, device=q.device
        )  # K, V; pad after
        for i, x in enumerate(cache.read(ring.key_slots, q.dtype)):
            kv[i, : ring.key_slots.numel()] = x  # (keys here, Hkv, D)
        out, _ = ring_attention_shards(
            q[None],
            kv[0][None],
            kv[1][None],
            ring.shards,
            causal=True,
            comm=self.comm,
            softmax_scale=scale,
            backend=self.attn_backend,
            **dense,
        )
        return out[0]

    # -- a hybrid model's recurrent layers --------------------------------------------------
    def recur(self, layer: int, fn, u: torch.Tensor, shapes) -> torch.Tensor:
        """A recurrent layer's sequential part over the step's sequences: ``u (T, F)`` -> ``(T,
        F')``. ``fn(u_b (B, L, F), states) -> (y_b (B, L, F'), states)`` with float32 states
        ``(B, *shape)`` for each of ``shapes``: the single-token rows of every sequence in one
        call (decode), each longer piece alone. A sequence starts from zeros at position 0, else
        from its slot (a prefix hit's snapshot was copied there first); its final state goes
        back to the slot, and each checkpoint it saves to its snapshot slot."""
        pool = self.states.layers[layer]
        parts = []  # (rows, y)
        one = self.step.single
        if one is not None:
            init = [
                t.index_select(0, one.slots).float().masked_fill(_expand(one.fresh, t), 0)
                for t in pool
            ]
            y, final = fn(u.index_select(0, one.rows)[:, None], init)  # (S, 1, F')
            for t, f in zip(pool, final):
                t.index_copy_(0, one.slots, f.to(t.dtype))
            parts.append((one.rows, y[:, 0]))
            for slot, saves in one.saves:  # checkpoints reached at the row's end
                for _, dst in saves:
                    _copy_slot(pool, slot, dst)
        for r in self.step.recur:
            if r.n > 1:
                parts.append((slice(r.row, r.row + r.n), self._pieces(pool, fn, u, r)))
        spread = self.step.spread
        if spread is not None:
            parts.append((spread.rows, spread.recur(pool, fn, u, self.comm.group, self.timeout)))
        out = u.new_empty(u.shape[0], parts[0][1].shape[-1]) if parts else u[:, :0]
        for rows, y in parts:
            out[rows] = y.to(out.dtype)
        return out

    @staticmethod
    def _pieces(pool: List[torch.Tensor], fn, u: torch.Tensor, r: RecurSeq) -> torch.Tensor:
        """One sequence's rows, cut at the checkpoints it saves before its end (each piece
        carries the state to the next): ``(n, F')``."""
        state = [
            t.new_zeros(1, *t.shape[1:], dtype=torch.float32)
            if r.start == 0
            else t[r.slot : r.slot + 1].to(torch.float32, copy=True)
            for t in pool
        ]
        ys, at = [], r.start
        cuts = sorted(p for p, _ in r.saves if r.start < p < r.start + r.n) + [r.start + r.n]
        for p in cuts:
            piece = u[r.row + at - r.start : r.row + p - r.start][None]  # (1, L, F)
            y, state = fn(piece, state)
            ys.append(y[0])
            for q, dst in r.saves:
                if q == p:
                    for t, x in zip(pool, state):
                        t[dst] = x[0]
            at = p
        for t, x in zip(pool, state):
            t[r.slot] = x[0]
        return torch.cat(ys)


def _copy_slot(pool: List[torch.Tensor], src: int, dst: int) -> None:
    """Every state tensor's slot ``src`` into slot ``dst`` (a checkpoint's snapshot)."""
    for t in pool:
        t[dst] = t[src]


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(B,)`` mask shaped to broadcast over ``like`` ``(B, ...)``."""
    return mask.view(-1, *([1] * (like.dim() - 1)))
