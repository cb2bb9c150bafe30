"""What one step asks of a rank (``StepPlan``), and how it reaches every rank in a size that
does not grow with the context (``Publisher`` on the driver, ``Mirror`` on every rank).

A ``StepPlan`` holds, for each scheduled sequence, the first position computed this step
(``start``), how many tokens (``n``), their token ids, the sequence's block table (logical
block ids, the same on every rank) and whether the step completes it (its last token's
logits are sampled); ``targets``: for a request that wants prompt log-probs, the prompt
tokens that the step's first ``len(targets)`` positions predict (their log-probs are
returned too). ``want``: what the sampler rank returns to the driver, ``"tokens"`` (greedy
argmax, when every completing row is greedy) or ``"logits"``.

**Mirrors and deltas.** Every rank keeps a ``Mirror``: for each running sequence its token
ids so far and its block table. Each step the driver's ``Publisher`` sends only what changed
since the step before, as int64 words (``control.Channel``)::

    [step, want, drops, entries, sequences, summed tokens, summed blocks,
     drop seq ids...,
     per scheduled sequence: seq id, flags (NEW, COMPLETES), start, n, targets, tokens, blocks,
                             state slot, restore, saves,
                             appended token ids..., appended block ids...,
                             (position, snapshot slot) per save...]

A hybrid model's state (``cache/state_pool.py``) rides along: the sequence's state slot (-1: a
model without recurrent layers), the snapshot slot copied into it before the step (-1: none) and
the checkpoints the step saves.

A sequence new to the mirrors (first scheduled, or again after its blocks were dropped by a
preemption or a reclaim) carries its block table once and its token ids from the step's first
position on (no rank reads a token below it: a cached prefix or an imported request's K/V
cost no words); later steps carry the tokens sampled since (decode: one) and the blocks
appended. Finished sequences and those
whose KV was dropped are dropped from the mirrors. So a step's words are O(scheduled
sequences + new tokens + new blocks), whatever the context length. The three counts after
the drops are a checksum: a rank whose mirror disagrees raises ``EngineError`` naming the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .control import EngineError

HEADER = 7  # step, want, drops, entries, sequences, summed tokens, summed blocks
ENTRY = 10  # seq id, flags, start, n, targets, tokens, blocks, slot, restore, saves
NEW, COMPLETES = 1, 2  # entry flags
WANT = ("tokens", "logits")


@dataclass
class SeqStep:
    start: int
    n: int
    tokens: List[int]  # token ids of positions [start, start + n)
    block_table: List[int]
    completes: bool
    targets: Optional[List[int]] = None
    slot: int = -1  # a hybrid model's state slot (-1: none)
    saves: List[Tuple[int, int]] = field(default_factory=list)  # (position, snapshot slot)


@dataclass
class StepPlan:
    seqs: List[SeqStep] = field(default_factory=list)
    want: str = "logits"
    # prompt log-probs: the top alternatives each target row returns too (the step's largest ask)
    top: int = 0
    copies: List[Tuple[int, int]] = field(default_factory=list)  # (snapshot, slot) restores

    @staticmethod
    def restores(batch) -> List[Tuple[int, int]]:
        """The ``(snapshot slot, state slot)`` copies ``batch``'s prefix hits need first."""
        return [(s.restore, s.seq.state_slot) for s in batch if s.restore is not None]

    @property
    def num_completing(self) -> int:
        return sum(s.completes for s in self.seqs)

    @property
    def num_targets(self) -> int:
        return sum(len(s.targets or ()) for s in self.seqs)


def prompt_top(batch) -> int:
    """The most prompt log-prob alternatives a sequence of ``batch`` computing targets asks for."""
    return max((s.seq.params.prompt_logprobs or 0 for s in batch if s.targets), default=0)


def local_plan(batch, want: str) -> StepPlan:
    """The ``StepPlan`` of ``batch`` read straight from the driver's sequences (one process: no
    mirror). ``batch``: the scheduler's entries, each with ``seq`` (``seq_id``, ``token_ids``,
    ``block_table``, ``kv_epoch``, ``finished``), ``start``, ``n``, ``completes`` and
    ``targets`` (how many prompt log-probs the step computes)."""
    return StepPlan(
        [
            SeqStep(
                s.start,
                s.n,
                s.seq.token_ids[s.start : s.start + s.n],
                s.seq.block_table,
                s.completes,
                s.seq.token_ids[s.start + 1 : s.start + 1 + s.targets] if s.targets else None,
                _slot(s.seq),
                list(s.saves),
            )
            for s in batch
        ],
        want,
        prompt_top(batch),
        StepPlan.restores(batch),
    )


def _slot(seq) -> int:
    slot = getattr(seq, "state_slot", None)
    return -1 if slot is None else slot


@dataclass
class _Sent:
    """What the mirrors hold of one sequence (driver side)."""

    seq: object
    epoch: int
    offset: int  # the first token the mirrors hold (the sequence's first scheduled position)
    tokens: int  # tokens held: [offset, offset + tokens)
    blocks: int


class Publisher:
    """The driver's record of what every mirror holds; ``encode`` turns a step into its delta."""

    def __init__(self):
        self.sent: Dict[int, _Sent] = {}
        self.tokens = self.blocks = 0  # summed over ``sent``
        self.steps = 0

    def encode(self, batch, want: str) -> torch.Tensor:
        """The words of the next step (1-D int64) for ``batch`` (as in ``local_plan``), updating
        the record."""
        drops = [sid for sid, e in self.sent.items() if e.seq.finished or e.seq.kv_epoch != e.epoch]
        for sid in drops:
            e = self.sent.pop(sid)
            self.tokens -= e.tokens
            self.blocks -= e.blocks
        words: List[int] = []
        sent = self.sent
        for s in batch:
            seq = s.seq
            e = sent.get(seq.seq_id)
            flags = COMPLETES if s.completes else 0
            if e is None:
                e = sent[seq.seq_id] = _Sent(seq, seq.kv_epoch, s.start, 0, 0)
                flags |= NEW
            toks, blks = seq.token_ids, seq.block_table
            nt, nb = len(toks) - e.offset - e.tokens, len(blks) - e.blocks
            restore = -1 if s.restore is None else s.restore
            words += (seq.seq_id, flags, s.start, s.n, s.targets, nt, nb, _slot(seq), restore)
            words.append(len(s.saves))
            if nt:
                words += toks[e.offset + e.tokens :]
                e.tokens += nt
                self.tokens += nt
            if nb:
                words += blks[e.blocks :]
                e.blocks += nb
                self.blocks += nb
            for save in s.saves:
                words += save
        want_word = WANT.index(want) + len(WANT) * prompt_top(batch)  # both in one word
        head = [
            self.steps,
            want_word,
            len(drops),
            len(batch),
            len(self.sent),
            self.tokens,
            self.blocks,
        ]
        self.steps += 1
        return torch.tensor(head + drops + words, dtype=torch.int64)


@dataclass
class _Mirrored:
    tokens: List[int]  # token ids from position ``offset`` on
    table: List[int]
    offset: int


class Mirror:
    """A rank's copy of the running sequences (token ids, block table), kept by the deltas."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.seqs: Dict[int, _Mirrored] = {}
        self.steps = 0

    def apply(self, words: torch.Tensor) -> StepPlan:
        """Apply one step's delta; returns its ``StepPlan``. Raises ``EngineError`` when the
        delta does not fit this mirror (it drifted from the driver's record)."""
        w = words.tolist()
        step, want, ndrop, nentry, count, tokens, blocks = w[:HEADER]
        if step != self.steps:
            self._drift(step, f"expected step {self.steps}")
        i = HEADER
        for sid in w[i : i + ndrop]:
            if self.seqs.pop(sid, None) is None:
                self._drift(step, f"dropping sequence {sid}, which it does not hold")
        i += ndrop
        seqs, copies = [], []
        for _ in range(nentry):
            sid, flags, start, n, targets, ntok, nblk, slot, restore, nsave = w[i : i + ENTRY]
            i += ENTRY
            toks, blks = w[i : i + ntok], w[i + ntok : i + ntok + nblk]
            i += ntok + nblk
            saves = [(w[j], w[j + 1]) for j in range(i, i + 2 * nsave, 2)]
            i += 2 * nsave
            if restore >= 0:
                copies.append((restore, slot))
            m = self.seqs.get(sid)
            if flags & NEW:
                if m is not None:
                    self._drift(step, f"sequence {sid} is new to the driver but already held")
                m = self.seqs[sid] = _Mirrored(toks, blks, start)
            elif m is None:
                self._drift(step, f"sequence {sid} is not held")
            else:
                m.tokens += toks
                m.table += blks
            lo, o = start - m.offset, m.offset  # lo: the step's first token in m.tokens
            if lo < 0 or lo + n > len(m.tokens) or lo + 1 + targets > len(m.tokens):
                self._drift(
                    step,
                    f"sequence {sid} computes tokens [{start}, {start + n}) of the held "
                    f"[{o}, {o + len(m.tokens)})",
                )
            seqs.append(
                SeqStep(
                    start,
                    n,
                    m.tokens[lo : lo + n],
                    m.table,
                    bool(flags & COMPLETES),
                    m.tokens[lo + 1 : lo + 1 + targets] if targets else None,
                    slot,
                    saves,
                )
            )
        if i != len(w):
            self._drift(step, f"{len(w) - i} words left over")
        held = (
            len(self.seqs),
            sum(len(m.tokens) for m in self.seqs.values()),
            sum(len(m.table) for m in self.seqs.values()),
        )
        if held != (count, tokens, blocks):
            self._drift(
                step,
                f"it holds (sequences, tokens, blocks) = {held}, the driver sent "
                f"{(count, tokens, blocks)}",
            )
        self.steps += 1
        return StepPlan(seqs, WANT[want % len(WANT)], want // len(WANT), copies)

    def _drift(self, step: int, why: str):
        raise EngineError(
            f"rank {self.rank}: the step mirror drifted from the driver's at step {step}: {why}"
        )
