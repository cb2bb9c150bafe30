"""The per-step control plane of a multi-rank engine: the driver's ``Publisher`` sends each
step as a delta of the ranks' ``Mirror`` of the running sequences.

- A hypothesis state machine drives the engine's own scheduler and block manager (chunked
  prefill, decode, preemption, prefix hits, aborts, dropped KV) and checks that every step's
  plan rebuilt from the delta equals the plan read straight from the driver's sequences, and
  that a step's words never exceed O(scheduled sequences + new tokens + new blocks).
- A corrupted mirror fails the next step with an ``EngineError`` naming it, in the unit and on
  a spawned engine (a follower's mirror and the driver's own).
- A real tp=2 engine's control bytes per decode step do not grow with the context.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ringkv.cache.block_manager import BlockManager
from ringkv.cache.state_pool import StateSlots
from ringkv.engine.params import SamplingParams
from ringkv.engine.scheduler import Scheduler
from ringkv.engine.sequence import Sequence
from ringkv.parallel import EngineError
from ringkv.parallel.control import ControlPlane
from ringkv.parallel.plan import ENTRY, HEADER, NEW, Mirror, Publisher, local_plan
from ringkv.sp.comm import RingTimeoutError


class Deltas(RuleBasedStateMachine):
    """The driver's scheduler, a publisher and two mirrors (one fed every step)."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(24, 4)
        self.sched = Scheduler(self.blocks, max_num_seqs=4, max_num_batched_tokens=12)
        self.pub, self.mirror = Publisher(), Mirror()
        self.ids = 0

    @rule(
        length=st.integers(1, 30), logprobs=st.sampled_from([None, 0, 2, 20]), shared=st.booleans()
    )
    def add(self, length, logprobs, shared):
        tokens = (
            [7] * 8 + [self.ids] * length if shared else [self.ids % 50 + i for i in range(length)]
        )
        params = SamplingParams(
            prompt_logprobs=logprobs
        )  # k > 0: the plan's top travels in its header
        self.sched.add(
            Sequence(seq_id=self.ids, prompt=None, prompt_token_ids=tokens, params=params)
        )
        self.ids += 1

    @rule(tokens=st.integers(1, 3))
    def step(self, tokens):
        batch = self.sched.schedule()
        if not batch:
            return
        for s in batch:
            s.seq.num_computed = s.start + s.n
        want = "tokens" if len(batch) % 2 else "logits"
        words = self.pub.encode(batch, want)
        for s, (flags, ntok, nblk) in zip(batch, _entries(words)):
            # once: its tokens from the first position it computes (a cached prefix: none), all
            # blocks
            if flags & NEW:
                assert (ntok, nblk) == (s.seq.num_tokens - s.start, len(s.seq.block_table))
            else:  # the token sampled since, the blocks these n tokens need: not the context
                assert ntok <= 1 and nblk <= s.n // self.blocks.block_size + 1, (ntok, nblk, s.n)
        plan = self.mirror.apply(words)
        want_plan = local_plan(batch, want)
        assert plan == want_plan
        for s in batch:
            self.blocks.register(
                s.seq.block_table, s.seq.token_ids, s.start + s.n, None, s.seq.prefix_cursor
            )
            for p, slot in s.saves:  # as the pipeline indexes a hybrid's snapshots
                k = p // self.blocks.block_size
                key = self.blocks.checkpoint_key(s.seq.block_table, k, s.seq.token_ids)
                self.blocks.states.put(*key, slot)
                s.seq.saving.discard(p)
            if s.completes:
                s.seq.token_ids.append(1000 + s.seq.num_tokens)
                if s.seq.num_tokens >= len(s.seq.prompt_token_ids) + tokens:
                    s.seq.finish("length")
                    self.sched.finish(s.seq)

    @rule(data=st.data())
    def abort(self, data):
        live = self.sched.running + list(self.sched.waiting)
        if live:
            seq = data.draw(st.sampled_from(live))
            self.sched.finish(seq)
            seq.finish("abort")

    @rule(data=st.data())
    def drop_kv(self, data):
        """What a reclaim does to a held request, here to a running one: its blocks go, it is
        recomputed (the mirrors must learn it anew)."""
        if self.sched.running:
            seq = data.draw(st.sampled_from(self.sched.running))
            self.sched.running.remove(seq)
            seq.free_kv(self.blocks)
            self.sched.waiting.appendleft(seq)

    @invariant()
    def mirror_holds_what_the_publisher_sent(self):
        assert set(self.mirror.seqs) == set(self.pub.sent)
        for sid, e in self.pub.sent.items():
            m = self.mirror.seqs[sid]
            assert (
                m.offset == e.offset and m.tokens == e.seq.token_ids[e.offset : e.offset + e.tokens]
            )
            if e.seq.kv_epoch == e.epoch and not e.seq.finished:  # else dropped at the next step
                assert m.table == e.seq.block_table[: e.blocks]


def _entries(words):
    """``(flags, tokens, blocks)`` of each entry of a step's words."""
    w = words.tolist()
    i = HEADER + w[2]
    for _ in range(w[3]):
        flags, ntok, nblk, nsave = w[i + 1], w[i + 5], w[i + 6], w[i + 9]
        yield flags, ntok, nblk
        i += ENTRY + ntok + nblk + 2 * nsave


TestDeltas = Deltas.TestCase
TestDeltas.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class HybridDeltas(Deltas):
    """The same with a hybrid model's state slots: every running sequence holds its own slot,
    restores and saves travel to the mirrors, and snapshots stay with registered blocks."""

    def __init__(self):
        super().__init__()
        self.blocks.attach_states(StateSlots(running=4, snapshots=3, checkpoint_blocks=2))

    @invariant()
    def slots_are_held_once(self):
        states = self.blocks.states
        held = [s.state_slot for s in self.sched.running]
        assert None not in held and len(set(held)) == len(held)
        assert len(held) + len(states.free_running) == states.running
        assert not states.pending  # every step here completes before the next
        snaps = [slot for slot, _ in states.index.values()]
        assert len(snaps) + len(states.free_snapshots) == states.snapshots
        for h, (_, cid) in states.index.items():  # a snapshot's block is registered, same content
            assert self.blocks.cid_of[self.blocks.by_hash[h]] == cid


TestHybridDeltas = HybridDeltas.TestCase
TestHybridDeltas.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def _decode_words(context: int, batch: int, block_size: int = 16) -> int:
    """Words of one decode step of ``batch`` sequences at ``context`` tokens (after their
    prefill)."""
    blocks = BlockManager(batch * (context // block_size + 2), block_size)
    sched = Scheduler(blocks, max_num_seqs=batch, max_num_batched_tokens=batch * context)
    pub, mirror = Publisher(), Mirror()
    for i in range(batch):
        sched.add(
            Sequence(
                seq_id=i,
                prompt=None,
                prompt_token_ids=list(range(i, i + context)),
                params=SamplingParams(),
            )
        )
    sizes = []
    for _ in range(3):
        step = sched.schedule()
        for s in step:
            s.seq.num_computed = s.start + s.n
        words = pub.encode(step, "tokens")
        mirror.apply(words)
        sizes.append(words.numel())
        for s in step:
            s.seq.token_ids.append(5)
    return sizes[-1]


def test_decode_step_words_do_not_grow_with_context():
    """The old plan carried every block table: words ~ batch x context / block_size."""
    for batch in (1, 16):
        short, long = _decode_words(64, batch), _decode_words(4096, batch)
        assert long <= 1.2 * short, (batch, short, long)
        assert short <= HEADER + batch * (ENTRY + 2)  # one token, at most one new block


def test_a_corrupted_mirror_fails_the_next_step():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_batched_tokens=64)
    pub, mirror = Publisher(), Mirror(rank=3)
    sched.add(
        Sequence(seq_id=0, prompt=None, prompt_token_ids=list(range(10)), params=SamplingParams())
    )
    for step in range(4):
        batch = sched.schedule()
        for s in batch:
            s.seq.num_computed = s.start + s.n
        words = pub.encode(batch, "tokens")
        if step == 2:
            mirror.seqs[0].tokens.pop()  # what a lost or misapplied delta leaves behind
            with pytest.raises(
                EngineError, match=r"rank 3: the step mirror drifted from the driver's at step 2"
            ):
                mirror.apply(words)
            return
        mirror.apply(words)
        batch[0].seq.token_ids.append(1)
    raise AssertionError("unreachable")


def test_a_skipped_step_is_detected():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks)
    pub, mirror = Publisher(), Mirror()
    sched.add(Sequence(seq_id=0, prompt=None, prompt_token_ids=[1, 2, 3], params=SamplingParams()))
    batch = sched.schedule()
    pub.encode(batch, "tokens")  # never reaches the mirror
    batch[0].seq.num_computed = 3
    batch[0].seq.token_ids.append(4)
    with pytest.raises(EngineError, match="at step 1: expected step 0"):
        mirror.apply(pub.encode(sched.schedule(), "tokens"))


# -- real engines ----------------------------------------------------------------------------
pytest.importorskip("transformers")
from ringkv.engine import LLM  # noqa: E402
from tests.models import tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0, num_hidden_layers=2, max_position_embeddings=1024)


def _bytes_per_decode_step(llm, prompt_len: int) -> float:
    g = torch.Generator().manual_seed(prompt_len)
    rids = [
        llm.add_request(torch.randint(3, 128, (prompt_len,), generator=g).tolist(), GREEDY)
        for _ in range(4)
    ]
    while not all(
        llm.sequences(r)[0].output_token_ids for r in rids
    ):  # prefill done: every prompt has a token
        llm.step()
    before = llm.rank_stats()
    for _ in range(6):
        llm.step()
    after = llm.rank_stats()
    while llm.has_unfinished_requests():
        llm.step()
    steps = after[0]["steps"] - before[0]["steps"]
    return [
        (a["control_bytes_total"] - b["control_bytes_total"]) / steps for a, b in zip(after, before)
    ]


@pytest.mark.slow
def test_control_bytes_per_decode_step_do_not_grow_with_context(model):
    """tp=2, spawned: 4 sequences of 24 vs 480 tokens (block size 4: 6 vs 120 blocks each). The
    old JSON plan grew with every block table; the delta does not."""
    with LLM(
        model, tp=2, block_size=4, num_blocks=1024, max_num_batched_tokens=512, timeout=60
    ) as llm:
        short = _bytes_per_decode_step(llm, 24)
        long = _bytes_per_decode_step(llm, 480)
        stats = llm.rank_stats()
    assert all(
        s["control_bytes"] > 0 and s["control_s"] > 0 for s in stats
    )  # received and applied by each rank
    assert (
        stats[0]["driver_control_bytes"] > 0 and stats[0]["driver_control_s"] > 0
    )  # sent by the driver
    for a, b in zip(short, long):
        assert 0 < b <= 1.2 * a, (short, long)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_drifted_mirror_is_an_engine_error_naming_the_step(model, rank):
    """Rank 1's mirror corrupted, or the driver's record of what it sent: the ranks find out at
    the next step (the driver then reports the first dead worker's error)."""
    os.environ["RINGKV_FAULT"] = json.dumps(dict(rank=rank, step=3, kind="drift"))
    try:
        llm = LLM(model, tp=2, block_size=4, num_blocks=64, timeout=30)
    finally:
        os.environ.pop("RINGKV_FAULT")
    with llm:
        with pytest.raises(
            EngineError, match=r"rank \d: the step mirror drifted from the driver.s at step 4"
        ):
            llm.generate([[5, 6, 7, 8, 9]], GREEDY, use_tqdm=False)
        with pytest.raises(EngineError, match="broken"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


_STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
print(s.port, flush=True)
time.sleep(120)
"""


def test_a_store_wait_gives_up_when_the_store_stops_answering():
    """A rank idle on the control store (no timeout: it waits as long as the driver lives): a
    store that answers keeps it waiting past the engine's timeout, even one shorter than the
    store's polling; a store that stops answering (its process stopped, as a host behind a link
    that went down) ends the wait within the timeout with an error naming the store. Before,
    the store's own wait blocked until the store answered again."""
    server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdout=subprocess.PIPE)
    try:
        port = int(server.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60))
        plane = ControlPlane(store, "t", 1, 2, timeout=timedelta(seconds=1))
        threading.Timer(2.5, lambda: store.clone().set("t/m0", json.dumps({"kind": "x"}))).start()
        t = time.monotonic()
        assert plane.receive() == {"kind": "x"}  # 2.5 s idle on a 1 s timeout: no error
        assert time.monotonic() - t > 2
        server.send_signal(signal.SIGSTOP)
        threading.Timer(15, server.kill).start()  # a wait that never gives up fails, not hangs
        t = time.monotonic()
        with pytest.raises(RingTimeoutError, match="control store .*did not answer"):
            plane.receive()
        assert 0.9 < time.monotonic() - t < 5
    finally:
        server.kill()
        server.wait()
