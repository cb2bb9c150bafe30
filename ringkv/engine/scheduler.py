"""Continuous batching with chunked prefill and preemption by recompute.

Every step each scheduled sequence computes ``n`` of its tokens that have no KV yet
(``num_tokens - num_computed``): a whole or partial prompt (chunked prefill), one token
(decode), or a whole prefix again after a preemption. Per step at most
``max_num_batched_tokens`` tokens and ``max_num_seqs`` running sequences.

Order: running sequences first (oldest first), then waiting ones (FIFO). When the cache has
no block for a running sequence, the youngest running sequence not in a step still in flight
is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed later (its full
blocks usually come back from the prefix cache). ``max_model_len`` never exceeds the cache's
capacity, so a sequence alone always fits and nothing is ever dropped. Blocks held outside the
scheduler (requests stopped by an export, staged imports) are taken back through ``reclaim``
before a running sequence is preempted, and when nothing else could run; so are a hybrid model's
state slots when such requests hold every one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Set, Tuple

from ..cache.block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # first token computed this step (== seq.num_computed before the step)
    n: int  # tokens computed this step
    # a hybrid model's states: the snapshot slot copied into the sequence's slot before the step
    # (a prefix hit), and the ``(position, snapshot slot)`` checkpoints this step saves
    restore: Optional[int] = None
    saves: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """After this step every token has KV: the last one's logits give the next token."""
        return self.start + self.n == self.seq.num_tokens

    @property
    def targets(self) -> int:
        """Prompt log-probs this step computes: positions ``start..`` predict prompt tokens
        ``start + 1..`` (a request that asks for them)."""
        if self.seq.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + self.n, len(self.seq.prompt_token_ids) - 1) - self.start)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        reclaim: Callable[[], bool] = lambda: False,
    ):
        """``reclaim()``: free the blocks of one request held outside the scheduler; False when
        none holds any."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks, self.reclaim = blocks, reclaim
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: "deque[Sequence]" = deque()
        self.running: List[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.free_kv(self.blocks)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(
        self, busy: Set[Sequence] = frozenset(), max_seqs: Optional[int] = None
    ) -> List[Scheduled]:
        """The next step's work. ``busy``: sequences in steps still in flight (pipeline
        parallelism): they are never preempted, and one whose every token is already being
        computed waits for its sampled token. ``max_seqs``: at most this many sequences in the
        step (a pipeline splits its sequences over the steps in flight)."""
        budget = self.max_num_batched_tokens
        max_seqs = max_seqs or self.max_num_seqs
        out: List[Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(out) < max_seqs:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n == 0:  # its last step is in flight
                i += 1
                continue
            while not self._grow(seq.block_table, seq.num_computed + n):
                scheduled = {s.seq for s in out}  # older than seq: never victims
                victim = next(
                    (v for v in reversed(self.running) if v not in busy and v not in scheduled),
                    None,
                )
                if (
                    victim is None
                ):  # memory is short and only in-flight work could free it: wait for it
                    return out
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(self._entry(seq, n))
                budget -= n
                i += 1
                continue
            break
        # admit waiting sequences (not in a step that had to preempt: memory is short)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(out) < max_seqs
            and not preempted
        ):
            seq = self.waiting[0]
            if not self._take_slot(seq):
                break
            restore, matched = self._match(seq)
            if self._awaits_snapshot(seq, matched):  # a running sequence is about to save it
                seq.free_kv(self.blocks)
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            idle = not (
                out or busy or self.running
            )  # nothing else runs: held blocks must make room
            if not (
                self.blocks.grow(seq.block_table, seq.num_computed + n)
                or idle
                and self._grow(seq.block_table, seq.num_computed + n)
            ):
                seq.free_kv(self.blocks)  # give the prefix back; retry next step
                break
            if seq.num_cached_tokens is None:  # a request's hits count once, at its first admission
                seq.num_cached_tokens = seq.num_computed
                self.blocks.count(seq.token_ids, seq.num_computed // self.blocks.block_size)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(self._entry(seq, n, restore))
            budget -= n
            if restore is not None:
                self.blocks.states.restored += 1
        return out

    def _take_slot(self, seq: Sequence) -> bool:
        """A hybrid model: a state slot for ``seq`` (one held by a request stopped by an export is
        reclaimed if none is free); False if none can be had. Always True for a dense model."""
        states = self.blocks.states
        if states is None or seq.state_slot is not None:
            return True
        seq.state_slot = states.take()
        while seq.state_slot is None and self.reclaim():
            seq.state_slot = states.take()
        return seq.state_slot is not None

    def _match(self, seq: Sequence) -> Tuple[Optional[int], int]:
        """A new (or recomputed) sequence's cached prefix, taken: ``(snapshot slot to restore or
        None, tokens the match reached)``; a hybrid keeps the blocks up to its deepest snapshot
        and plans its own snapshots (``_snapshot_points``)."""
        restore, matched = None, 0
        if seq.num_computed == 0 and not seq.block_table and seq.params.prompt_logprobs is None:
            table = self.blocks.match_prefix(seq.token_ids, seq.cache_salt)
            matched = len(table) * self.blocks.block_size
            seq.block_table, restore = self.blocks.match_states(table)
            seq.num_computed = len(seq.block_table) * self.blocks.block_size
        if self.blocks.states is not None:
            seq.snapshot_at = self._snapshot_points(seq, matched)
        return restore, matched

    def _awaits_snapshot(self, seq: Sequence, matched: int) -> bool:
        """Whether a running sequence of the same prefix will save a snapshot (one pending, or one
        of its ``snapshot_at`` it has not reached) between where ``seq`` resumes and where its
        match reached (requests arriving together with a shared prompt: the first computes the
        shared part, the others wait for its snapshot rather than computing it too)."""
        if self.blocks.states is None or matched <= seq.num_computed:
            return False
        for r in self.running:
            planned = r.saving.union(p for p in r.snapshot_at if p > r.num_computed)
            for p in planned:
                if (
                    seq.num_computed < p <= matched
                    and r.cache_salt == seq.cache_salt
                    and r.token_ids[:p] == seq.token_ids[:p]
                ):
                    return True
        return False

    def _entry(self, seq: Sequence, n: int, restore: Optional[int] = None) -> Scheduled:
        """The step's entry for ``seq``; a hybrid model's saves: a snapshot slot for each
        checkpoint the step reaches (the end of every ``checkpoint_blocks``-th block, and the
        sequence's own ``snapshot_at``), while a slot is free."""
        entry = Scheduled(seq, seq.num_computed, n, restore)
        states = self.blocks.states
        if states is None or not self.blocks.prefix_caching:
            return entry
        every = states.checkpoint_blocks * self.blocks.block_size
        start, end = entry.start, entry.start + n
        points = set(range(start // every * every + every, end + 1, every))
        points.update(p for p in seq.snapshot_at if start < p <= end)
        for p in sorted(points):
            slot = states.reserve()
            if slot is None:
                break
            entry.saves.append((p, slot))
            seq.saving.add(p)
        return entry

    def _snapshot_points(self, seq: Sequence, matched: int) -> tuple:
        """Where a hybrid's sequence saves a snapshot besides the periodic checkpoints: where its
        prefix match ended, past the snapshot it resumes from (another prompt's prefix branches
        off there: the next prompt sharing it resumes there), and at its prompt's last whole
        block (the same prompt, or a conversation continuing it, resumes there)."""
        bs = self.blocks.block_size
        prompt_end = (len(seq.prompt_token_ids) - 1) // bs * bs
        return tuple(p for p in sorted({matched, prompt_end}) if p > seq.num_computed)

    def _grow(self, table: List[int], num_tokens: int) -> bool:
        """``blocks.grow``, reclaiming held blocks while it is short."""
        while not self.blocks.grow(table, num_tokens):
            if not self.reclaim():
                return False
        return True

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or failed) sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.free_kv(self.blocks)
