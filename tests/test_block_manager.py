"""Block manager: reference counts, prefix caching with confirmation, LRU eviction."""

import random

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringkv.cache import BlockManager
from ringkv.cache.block_manager import STORED, KVEvents, PrefixCursor

BS = 4


def alloc_prompt(bm, tokens, salt=None):
    """What the scheduler does: prefix match, then grow to the whole prompt."""
    table = bm.match_prefix(tokens, salt)
    assert bm.grow(table, len(tokens))
    return table


def test_prefix_hit_shares_blocks_and_keeps_last_token():
    bm = BlockManager(16, BS)
    a = alloc_prompt(bm, list(range(10)))
    bm.register(a, list(range(10)), 10)  # two full blocks registered
    b = bm.match_prefix(list(range(10)))
    assert b == a[:2] and bm.ref[a[0]] == 2
    # exactly two full blocks: the last token must be recomputed, so only one block is reused
    assert bm.match_prefix(list(range(8))) == a[:1]
    bm.check()


def test_salt_separates_caches():
    bm = BlockManager(16, BS)
    a = alloc_prompt(bm, list(range(9)), salt="alice")
    bm.register(a, list(range(9)), 9, salt="alice")
    assert bm.match_prefix(list(range(9)), salt="bob") == []
    assert bm.match_prefix(list(range(9)), salt="alice") == a[:2]


def test_forced_collision_never_reuses_wrong_blocks():
    bm = BlockManager(16, BS, hash_fn=lambda key: 0)  # every block hashes alike
    a_tokens, b_tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 0, 0, 9]
    a = alloc_prompt(bm, a_tokens)
    bm.register(a, a_tokens, 9)
    assert bm.match_prefix(b_tokens) == a[:1]  # first block really equal; the second is not
    assert bm.match_prefix([9, 9, 9, 9, 9]) == []


def test_lru_eviction_and_evicted_never_served():
    bm = BlockManager(4, BS)
    a = alloc_prompt(bm, list(range(9)))  # 3 blocks
    bm.register(a, list(range(9)), 9)
    bm.free(list(a))
    assert bm.num_free == 4
    fresh = bm.allocate(3)  # the 2 empty blocks, then the LRU cached one: the tail a[1]
    assert bm.evictions == 1 and a[1] in fresh
    hit = bm.match_prefix(list(range(9)))
    assert hit == [a[0]]  # the surviving head still serves; the evicted tail never does
    bm.free(fresh + hit)
    fresh = bm.allocate(4)
    assert bm.evictions == 2 and bm.match_prefix(list(range(9))) == []
    bm.free(fresh)
    bm.check()


def test_chain_breaks_when_parent_evicted_and_reused():
    bm = BlockManager(3, BS)
    toks = list(range(9))
    a = alloc_prompt(bm, toks)
    bm.register(a, toks, 9)
    bm.free(list(a))  # a[2] (never registered) -> empty; evictable LRU order: a[1], a[0]
    bm.evictable.move_to_end(a[1])  # make the parent a[0] the least recently used
    assert bm.allocate(1) == [a[2]]  # empty blocks go first
    x = bm.allocate(1)[0]  # then the LRU cached block: the parent
    assert x == a[0]
    other = [7, 7, 7, 7, 4, 5, 6, 7, 0]
    bm.register([x], other, 4)
    # the child block is still registered, but its parent registration is gone: no hit
    assert bm.match_prefix(toks) == []
    bm.check()


def test_grow_failure_leaves_table_unchanged():
    bm = BlockManager(2, BS)
    t = []
    assert not bm.grow(t, 3 * BS)
    assert t == [] and bm.num_free == 2


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / compute-in-steps / register / free with tiny vocab and forced
    collisions now and then: sequences register their blocks as they get computed (cursors),
    so twins, evictions and chains continued across steps all happen."""

    def __init__(self):
        super().__init__()
        self.bm = None
        self.live = []  # [tokens, table, salt, cursor, tokens computed]
        self.store = {}  # block id -> (salt, the whole token prefix its KV was computed for)

    @initialize(collide=st.booleans(), limit=st.sampled_from([2, 5, 1000]))
    def setup(self, collide, limit):
        self.bm = BlockManager(12, BS, hash_fn=(lambda k: hash(k) % 3) if collide else hash)
        self.bm.events = KVEvents(
            limit
        )  # a reader that falls behind a short log re-reads the index
        self.after, self.index = 0, set()  # what a router knows of the prefix cache

    def _compute(self, entry, upto):
        tokens, table, salt, cursor, done = entry
        for i, b in enumerate(table):  # "compute" KV into the blocks' new slots
            if min(upto, (i + 1) * BS) > max(done, i * BS):
                self.store[b] = (salt, tuple(tokens[: min(upto, (i + 1) * BS)]))
        entry[4] = upto
        self.bm.register(table, tokens, upto, salt, cursor)

    @rule(
        n=st.integers(1, 14),
        vocab=st.integers(1, 3),
        seed=st.integers(0, 3),
        salt=st.sampled_from([None, "s"]),
        first=st.integers(0, 14),
    )
    def add(self, n, vocab, seed, salt, first):
        rng = random.Random(seed)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        table = self.bm.match_prefix(tokens, salt)
        for i, b in enumerate(table):  # a hit must hold exactly this prefix
            assert self.store[b] == (salt, tuple(tokens[: (i + 1) * BS])), "served wrong KV"
        hit = len(table) * BS
        if not self.bm.grow(table, n):
            self.bm.free(table)
            return
        entry = [tokens, table, salt, PrefixCursor(), hit]
        self._compute(entry, max(entry[4], min(n, first)))
        self.live.append(entry)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), more=st.integers(1, 8))
    def compute_more(self, i, more):
        entry = self.live[i % len(self.live)]
        self._compute(entry, min(len(entry[0]), entry[4] + more))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        table = self.live.pop(i % len(self.live))[1]
        self.bm.free(table)

    @precondition(lambda self: self.bm is not None)
    @rule()
    def evict_all(self):
        taken = self.bm.allocate(self.bm.num_free)  # every cached block that nobody holds goes
        self.bm.free(taken)

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        self.bm.check()
        last, events = self.bm.events.since(self.after)
        if events is None:
            self.index = set(self.bm.by_hash)
        for _, kind, h in events or []:
            (self.index.add if kind == STORED else self.index.remove)(h)
        self.after = last
        assert self.index == set(self.bm.by_hash), "the events lost track of the prefix cache"
        used = [b for e in self.live for b in e[1]]
        assert all(self.bm.ref[b] > 0 for b in used)
        assert sum(self.bm.ref) == len(used)


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_twin_blocks_computed_concurrently_keep_the_chain_going():
    bm = BlockManager(16, BS)
    a_tok = [1, 1, 1, 1, 2, 2, 2, 2, 0]
    b_tok = [1, 1, 1, 1, 3, 3, 3, 3, 0]  # same first block, computed at the same time (no hit)
    a, b = alloc_prompt(bm, a_tok), alloc_prompt(bm, b_tok)
    assert set(a).isdisjoint(b)
    bm.register(a, a_tok, 9)
    bm.register(b, b_tok, 9)  # b[0] is a twin of a[0]; b[1] is still cached, chained through a[0]
    assert bm.match_prefix(b_tok) == [a[0], b[1]]
    bm.check()


def test_chain_whose_parent_was_evicted_is_reached_again():
    """Only the parent block of a cached chain is evicted; once the same prefix is computed
    again, its cached child is found again (the chain is not orphaned)."""
    bm = BlockManager(4, BS)
    toks = list(range(9))
    a = alloc_prompt(bm, toks)
    bm.register(a, toks, 9)
    bm.free(list(a))
    bm.evictable.move_to_end(a[1])  # the parent a[0] is now the least recently used
    taken = bm.allocate(3)  # the two empty blocks, then a[0]
    assert a[0] in taken and a[1] not in taken and bm.match_prefix(toks) == []
    bm.free(taken)
    again = alloc_prompt(
        bm, toks
    )  # computes the parent block anew (and a second copy of the child)
    bm.register(again, toks, 9)
    assert bm.match_prefix(toks) == [again[0], a[1]]
    bm.check()


def test_hits_count_once_per_request_not_per_admission_attempt():
    from ringkv.engine.params import SamplingParams
    from ringkv.engine.scheduler import Scheduler
    from ringkv.engine.sequence import Sequence

    bm = BlockManager(5, BS)
    pre = list(range(9))
    t = alloc_prompt(bm, pre)
    bm.register(t, pre, 9)
    bm.free(t)  # 2 cached blocks, 3 empty
    sched = Scheduler(bm, max_num_batched_tokens=100)
    hog = Sequence(
        seq_id=0, prompt=None, prompt_token_ids=list(range(100, 112)), params=SamplingParams()
    )  # takes the 3 empty blocks
    sched.add(hog)
    assert [s.seq for s in sched.schedule()] == [hog]
    seq = Sequence(
        seq_id=1, prompt=None, prompt_token_ids=pre[:8] + [50] * 9, params=SamplingParams()
    )  # 2 cached blocks + 3 more: no room yet
    sched.add(seq)
    for _ in range(3):
        assert seq not in [s.seq for s in sched.schedule()]
    assert bm.hits == 0 and seq.num_cached_tokens is None
    sched.finish(hog)
    assert [s.seq for s in sched.schedule()] == [seq]
    assert (
        bm.hits == 2 and bm.queries == 2 + 4 and seq.num_cached_tokens == 8
    )  # hog: 2 blocks looked up


def test_a_chain_continued_through_a_twin_survives_the_twins_eviction():
    """B computed the same first block as A at the same time (a twin) and chains its later
    blocks through A's; A is freed and evicted before B registers more: B's chain goes on,
    and B's copy of the first block takes over the cache entry."""
    bm = BlockManager(6, BS)
    toks = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    a = alloc_prompt(bm, toks)
    b = bm.match_prefix(toks)
    assert bm.grow(b, 9) and set(a).isdisjoint(b)
    cur = PrefixCursor()
    bm.register(a, toks, 9)
    bm.register(b, toks, 4, cursor=cur)  # b[0] is a twin of a[0]
    bm.free(list(a))
    taken = bm.allocate(bm.num_free)  # evicts a[0] and a[1]
    assert a[0] in taken and a[1] in taken
    bm.register(b, toks, 9, cursor=cur)
    assert bm.match_prefix(toks) == b[:2]
    bm.check()


def test_block_hashes_agree_across_processes():
    """The default block hash (SHA-256 over parent, tokens and salt) is the same in every
    process, unlike Python's hash() of a salt string (randomised per process)."""
    import subprocess
    import sys

    code = (
        "from ringkv.cache.block_manager import block_hash as h; a = h((None, (1, 2, 3, 4), "
        "'tenant-a')); print(h((a, (5, 6, 7, 8), 'tenant-a')).hex(), hash('tenant-a'))"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert outs[0][0] == outs[1][0] and outs[0][1] != outs[1][1]
