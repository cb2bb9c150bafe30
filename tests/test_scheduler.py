"""Scheduler without a model: a hypothesis state machine drives add/step/abort with fake
tokens and checks the batch limits, block ownership and that every request finishes."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ringkv.cache import BlockManager
from ringkv.engine.params import SamplingParams
from ringkv.engine.scheduler import Scheduler
from ringkv.engine.sequence import Sequence, Status


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_seqs=st.integers(1, 5),
        max_tokens=st.integers(1, 24),
        collide=st.booleans(),
    )
    def setup(self, num_blocks, block_size, max_seqs, max_tokens, collide):
        self.bm = BlockManager(num_blocks, block_size, hash_fn=(lambda k: 7) if collide else hash)
        self.s = Scheduler(self.bm, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens)
        self.cap = num_blocks * block_size
        self.seqs, self.ids = [], 0
        self.store = {}  # block -> the token prefix whose K/V it holds (what "computing" wrote)

    @rule(length=st.integers(1, 20), out=st.integers(1, 6), vocab=st.integers(1, 3))
    def add(self, length, out, vocab):
        if length + out > self.cap:  # what LLM enforces through max_model_len
            return
        tokens = [(i * 5 + self.ids) % vocab for i in range(length)]
        seq = Sequence(
            seq_id=self.ids,
            prompt=None,
            prompt_token_ids=tokens,
            params=SamplingParams(max_tokens=out),
        )
        self.ids += 1
        self.seqs.append(seq)
        self.s.add(seq)

    @rule()
    def step(self):
        if not self.s.has_work():
            return
        batch = self.s.schedule()
        assert batch, "no progress with work pending"
        assert sum(b.n for b in batch) <= self.s.max_num_batched_tokens
        assert len(self.s.running) <= self.s.max_num_seqs
        assert len({id(b.seq) for b in batch}) == len(batch)
        bs = self.bm.block_size
        for b in batch:
            assert b.n >= 1 and b.start == b.seq.num_computed
            assert len(b.seq.block_table) * bs >= b.start + b.n
            for i in range(
                b.start // bs
            ):  # blocks before the new tokens (prefix hits too) hold their KV
                assert self.store.get(b.seq.block_table[i]) == tuple(
                    b.seq.token_ids[: (i + 1) * bs]
                ), "a sequence reads a block holding other K/V"
        for b in batch:
            seq = b.seq
            seq.num_computed = b.start + b.n
            for i in range(b.start // bs, -(-seq.num_computed // bs)):
                self.store[seq.block_table[i]] = tuple(
                    seq.token_ids[: min(seq.num_computed, (i + 1) * bs)]
                )
            self.bm.register(seq.block_table, seq.token_ids, seq.num_computed, seq.cache_salt)
            if b.completes:
                seq.token_ids.append((seq.num_tokens * 3) % 5)  # a fake, deterministic "sample"
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish("length")
                    self.s.finish(seq)

    @rule(i=st.integers(0, 50))
    def abort(self, i):
        live = [s for s in self.seqs if not s.finished]
        if live:
            seq = live[i % len(live)]
            self.s.finish(seq)
            seq.finish("error", "aborted")

    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check()
        owners = {}
        for seq in self.s.running + list(self.s.waiting):
            for blk in seq.block_table:
                owners.setdefault(blk, []).append(seq)
        for blk, seqs in owners.items():
            assert self.bm.ref[blk] == len(seqs), (
                f"block {blk}: ref {self.bm.ref[blk]}, owners {len(seqs)}"
            )
            if len(seqs) > 1:
                assert blk in self.bm.hash_of, "an unregistered block is shared"
        assert sum(self.bm.ref) == sum(len(v) for v in owners.values())
        for seq in self.s.running:
            assert seq.status is Status.RUNNING

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for _ in range(2000):  # everything still pending finishes: nothing lost, nothing stuck
            if not self.s.has_work():
                break
            self.step()
        assert not self.s.has_work()
        assert all(s.finished for s in self.seqs)
        assert sum(self.bm.ref) == 0


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
