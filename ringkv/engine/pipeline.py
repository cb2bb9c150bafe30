"""``StepPipeline``: the life of every step of one engine, the same for one process and for
every mesh, and the book of the requests it serves.

    schedule -> submit (up to ``depth`` steps in flight, so pipeline stages stay busy; each
                step in flight takes its share of the sequences)
             -> complete the oldest: register the full blocks it computed in the prefix cache,
                take its tokens, release a request's other samples once its prompt is
                computed, finish what is done (the scheduler frees its blocks)

A sequence's ``num_computed`` moves when its step is submitted (its K/V will exist before any
later step runs, so a later chunk may follow at once). Preemption (free and recompute, back to
the front of the waiting queue) happens inside ``Scheduler.schedule``; sequences in flight are
never its victims.

What a step *computes* belongs to the executor: the engine core's ``_Steps`` sends it to the
ranks and samples, ``planner.engine_workload`` prices it with a timing model. An executor provides
``submit(batch)``, ``result()`` (wait for the oldest step's result),
``tokens(batch, result)`` (``(sequence, (token, logprob) or the exception taking it raised)``
per completing sequence), ``append(seq, picked)`` (add the token, decide whether the
sequence is done) and ``idle()`` (nothing is in flight or waiting).

The book: ``active`` requests (id -> their samples), those ``paused`` by an export (out of the
scheduler, blocks kept), imports ``staged`` until their final snapshot (a ``Staged`` record), and
which requests got tokens since ``step()`` last reported them. ``state(rid)`` says which of the
three (a ``RequestState``) a request is in.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from .scheduler import Scheduled, Scheduler
from .sequence import Sequence, Status


class RequestState(enum.Enum):
    """Where a request is in an engine's book (an unknown or forgotten one is in none)."""

    ACTIVE = "active"  # admitted: waiting, running, or finished and not reported by step() yet
    PAUSED = "paused"  # stopped by an export: out of the scheduler, its blocks kept
    STAGED = "staged"  # imported without its final snapshot: blocks held, not scheduled


@dataclass
class Staged:
    """An import waiting for its final snapshot (``RequestState.STAGED``)."""

    seq: Sequence
    last_id: str  # the snapshot the next one must extend
    kv_end: int  # the K/V the snapshots reached: the next one starts there
    dropped: bool = False  # its blocks were reclaimed: later K/V are ignored, it is recomputed


class StepPipeline:
    def __init__(self, scheduler: Scheduler, executor, depth: int = 1):
        self.scheduler, self.blocks, self.executor, self.depth = (
            scheduler,
            scheduler.blocks,
            executor,
            depth,
        )
        self.inflight: "deque[List[Scheduled]]" = deque()
        self.peak_in_flight = 0  # most steps in flight at once
        self.active: Dict[object, List[Sequence]] = {}  # request id -> its samples
        self.paused: Dict[object, List[Sequence]] = {}  # RequestState.PAUSED
        self.staged: Dict[object, Staged] = {}  # RequestState.STAGED
        self._unreported: Dict = {}  # request ids that got tokens since ``reports()`` (ordered)
        self._ids = itertools.count()

    # -- steps -----------------------------------------------------------------------------
    def new_id(self) -> int:
        """A fresh sequence id (also a request's default id)."""
        return next(self._ids)

    @property
    def busy(self) -> bool:
        """Work is scheduled, waiting or in flight."""
        return bool(self.inflight) or self.scheduler.has_work()

    def advance(self) -> List[Sequence]:
        """Submit steps until ``depth`` are in flight or nothing more can run, then complete the
        oldest one. Returns the sequences that got a token."""
        sched = self.scheduler
        share = -(
            -(len(sched.running) + len(sched.waiting)) // self.depth
        )  # each step in flight takes its share
        while len(self.inflight) < self.depth:
            busy = {s.seq for batch in self.inflight for s in batch}
            batch = sched.schedule(busy, max_seqs=share if self.depth > 1 else None)
            if not batch:
                break
            for s in batch:
                s.seq.num_computed = s.start + s.n
            self.inflight.append(
                batch
            )  # before it is submitted: an interrupt cannot land between the two
            self.executor.submit(batch)
            self.peak_in_flight = max(self.peak_in_flight, len(self.inflight))
        if not self.inflight:
            raise RuntimeError(
                "the scheduler made no progress with requests pending (a sequence larger than the "
                "KV cache, or a bug)"
            )
        batch = self.inflight.popleft()
        return self.complete(batch, self.executor.result())

    def complete(self, batch: List[Scheduled], result) -> List[Sequence]:
        """Apply a finished step: register the blocks it filled, append each completing
        sequence's token. A request whose part of this fails (sampling, detokenizing, a stop
        check) fails alone, with ``finish_reason="error"``; the others keep their tokens."""
        for s in batch:
            self.blocks.register(
                s.seq.block_table,
                s.seq.token_ids,
                s.start + s.n,
                s.seq.cache_salt,
                s.seq.prefix_cursor,
            )
            for p, slot in s.saves:  # a hybrid's snapshots, indexed under their blocks
                seq, k = s.seq, p // self.blocks.block_size
                key = self.blocks.checkpoint_key(seq.block_table, k, seq.token_ids, seq.cache_salt)
                self.blocks.states.put(*key, slot)
                s.seq.saving.discard(p)
        advanced = []
        for seq, picked in self.executor.tokens(batch, result):
            if seq.finished:  # aborted while its step was in flight
                continue
            try:
                if isinstance(picked, Exception):
                    raise picked
                if seq.num_tokens == len(
                    seq.prompt_token_ids
                ):  # its first token: the prompt is computed
                    self._release_siblings(seq)
                self.executor.append(seq, picked)
            except Exception as e:  # noqa: BLE001 - this request fails, the step's others go on
                self.fail(seq, e)
            advanced.append(seq)
            self._unreported[seq.request_id] = None
            if seq.finished:
                self.scheduler.finish(seq)
        if not self.busy:
            self.executor.idle()
        return advanced

    def drain(self, usable=lambda: True) -> None:
        """Complete the steps still in flight (after an interruption) while ``usable()``: every
        request still running keeps its tokens (aborted ones are finished first, so theirs are
        dropped). Stops at the first failure (the executor is broken then)."""
        while self.inflight and usable():
            batch = self.inflight.popleft()
            try:
                self.complete(batch, self.executor.result())
            except Exception:  # noqa: BLE001 - the caller reports the failure
                break
        if not usable():
            self.inflight.clear()

    def _release_siblings(self, seq: Sequence) -> None:
        """The prompt of a request with ``n > 1`` is computed (and cached): its other samples
        start now, reusing the prompt's blocks."""
        for s in reversed(seq.siblings):
            self.scheduler.waiting.appendleft(s)
        seq.siblings = []

    @staticmethod
    def fail(seq: Sequence, e: Exception) -> None:
        """Finish ``seq`` (and its samples not started yet) with an error naming ``e``."""
        message = f"the request failed while its token was finished: {type(e).__name__}: {e}"
        for s in [seq] + seq.siblings:
            s.finish("error", message)
        seq.siblings = []

    # -- requests --------------------------------------------------------------------------
    def add(self, seqs: List[Sequence]) -> None:
        """Admit a request's samples (its first; the others follow once the prompt is computed)."""
        self.active[seqs[0].request_id] = seqs
        if not seqs[0].finished:
            self.scheduler.add(seqs[0])

    def get(self, rid) -> Optional[List[Sequence]]:
        """The samples of an active request, or None."""
        return self.active.get(rid)

    def known(self, rid) -> bool:
        """The id is in use: active, paused by an export or staged by an import."""
        return self.state(rid) is not None

    def state(self, rid) -> Optional[RequestState]:
        """Which part of the book the request is in; None if unknown (or reported finished)."""
        return next((state for state, book in self._books().items() if rid in book), None)

    def ids(self, state: RequestState) -> list:
        """The ids of the requests in ``state``, oldest first."""
        return list(self._books()[state])

    def samples(self, rid) -> Optional[List[Sequence]]:
        """The samples of a request in any state (a staged import has one), or None."""
        seqs = self.active.get(rid) or self.paused.get(rid)
        staged = self.staged.get(rid) if seqs is None else None
        return [staged.seq] if staged is not None else seqs

    def _books(self) -> Dict[RequestState, dict]:
        return {
            RequestState.ACTIVE: self.active,
            RequestState.PAUSED: self.paused,
            RequestState.STAGED: self.staged,
        }

    def finish(
        self, seqs: List[Sequence], reason: str, error: Optional[str] = None
    ) -> List[Sequence]:
        """Stop these sequences now and free their blocks (a step in flight for them completes
        and is discarded); returns those that were still running."""
        live = [s for s in seqs if not s.finished]
        for s in live:
            self.scheduler.finish(s)
            s.finish(reason, error)
        return live

    def abort(self, rid) -> bool:
        """Stop a request (active, paused or staged) and free its blocks; False if unknown or
        already finished."""
        staged = self.staged.pop(rid, None)
        if staged is not None:
            staged.seq.free_kv(self.blocks)  # (a hybrid's state slot too)
            return True
        seqs = self.active.pop(rid, None) or self.paused.pop(rid, None)
        self._unreported.pop(rid, None)
        return seqs is not None and bool(self.finish(seqs, "abort"))

    def forget(self, rid) -> None:
        """A call is done with its request: drop it from the book."""
        self.active.pop(rid, None)
        self._unreported.pop(rid, None)

    def reports(self) -> List[Tuple[object, List[Sequence]]]:
        """``(request id, samples)`` of the active requests that got tokens (or finished) since
        the last call, in the order they advanced; finished ones leave the book."""
        out = []
        for rid in list(self._unreported):
            del self._unreported[rid]
            seqs = self.active.get(rid)
            if seqs is None:
                continue
            out.append((rid, seqs))
            if all(s.finished for s in seqs):
                del self.active[rid]
        return out

    @property
    def has_unreported(self) -> bool:
        return bool(self._unreported)

    # -- migration (engine/migrate.py) -------------------------------------------------------
    def stage(self, rid, staged: Staged) -> None:
        """Hold an import until its final snapshot."""
        self.staged[rid] = staged

    def pause(self, rid) -> None:
        """Take an active request out of the scheduler, keeping its blocks (an export)."""
        seq = self.active[rid][0]
        sched = self.scheduler
        (sched.running if seq in sched.running else sched.waiting).remove(seq)
        self.paused[rid] = self.active.pop(rid)

    def resume(self, rid) -> None:
        """Run a paused request again (first in line)."""
        seqs = self.paused.pop(rid)
        seqs[0].status = Status.WAITING
        self.scheduler.waiting.appendleft(seqs[0])
        self.active[rid] = seqs

    def start(self, rid, seq: Sequence) -> None:
        """Run an imported request (first in line); it leaves the staged book."""
        self.staged.pop(rid, None)
        seq.status = Status.WAITING
        self.scheduler.waiting.appendleft(seq)
        self.active[rid] = [seq]

    def held(self) -> Iterator[Tuple[Sequence, object]]:
        """Sequences holding blocks outside the scheduler, oldest first: paused requests, then
        staged imports (with their ``Staged`` record)."""
        for seqs in self.paused.values():
            yield seqs[0], None
        for staged in self.staged.values():
            yield staged.seq, staged

    # -- load ------------------------------------------------------------------------------
    def load(self) -> dict:
        """``running`` and ``waiting`` sequences, ``kv_usage`` (fraction of blocks in use), prefix
        cache ``hits`` and ``queries`` (in blocks)."""
        s, b = self.scheduler, self.blocks
        return dict(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage=1 - b.num_free / b.num_blocks,
            hits=b.hits,
            queries=b.queries,
        )
