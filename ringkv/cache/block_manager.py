"""Block bookkeeping for the paged KV cache: pure Python, no tensors.

A sequence owns a list of block ids (its block table). Blocks are reference counted: a
block shared by several sequences (a common prompt prefix) is freed only when the last one
lets go.

Prefix caching: once a block is FULL of computed tokens it is registered under the chained
hash ``hash_fn((parent_hash, tokens, cache_salt))`` (default ``block_hash``: SHA-256, the same
in every process and run, unlike Python's ``hash`` of a string), once (a ``PrefixCursor`` per
sequence remembers how far its chain is registered, so a step costs no work that grows with the
context). A later prompt walks its own full blocks from the start and reuses every block
whose hash is registered AND whose content matches exactly: the same tokens, the same salt
and the same parent *content*. Contents are interned (``content id``): equal contents get
the same id for as long as a registered block holds or descends from it, so a chain whose
parent block was evicted is reached again once the parent is recomputed, while a hash
collision (different content, same hash) costs a miss, never wrong KV. Unreferenced
registered blocks stay cached and are evicted least-recently-used first, after the
never-used blocks.

Tiers (``attach_tiers``: a ``tiers.TierStore``): a registered block the pool evicts is copied to
the host tier (and from there to disk) before its block is reused, and a prompt's chain that
reaches a block the device lost but a tier holds gets it back (``match_prefix`` allocates a
block, the store copies the K/V in, the block is registered again: a *promotion*). Tier entries
are keyed by the block's chained SHA-256 (``block_hash``, whatever ``hash_fn`` is), so a tier
hit is exact even where ``hash_fn`` collides.

``KVEvents`` (``BlockManager.events``, off unless set): where each hash of the prefix cache is
best held, numbered in order: ``STORED`` (on the device), ``HOST`` or ``DISK`` (evicted from the
device, kept by that tier) and ``REMOVED`` (held nowhere), so a router can keep an index of which
engine holds which prefix blocks where (``serve/router.py``). A hybrid model's state snapshots
have events of their own (marked ``SNAPSHOT``, numbered with the blocks'), under the hash of the
block they end: where a prompt can resume from it (``STORED``: its slot on the device; ``HOST`` or
``DISK``: the tier holding its block, which the device lost; ``REMOVED``: nowhere). A tier's copy
of a block the device holds again is not read, so it is ``REMOVED`` unless the device has its own.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple


def block_hash(key: tuple) -> bytes:
    """SHA-256 of ``(parent hash, token ids, salt)``: a block's portable identity."""
    parent, tokens, salt = key
    h = hashlib.sha256(parent or b"")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if salt is not None:
        h.update(b"\x00salt" + str(salt).encode())
    return h.digest()


REMOVED, STORED, HOST, DISK = 0, 1, 2, 3  # KVEvents kinds: held nowhere, device, host, disk
SNAPSHOT = "snapshot"  # marks a KVEvents entry about a hybrid's state snapshot, not a block
_UNKNOWN = -1  # a parent content id no registered block holds (never equal to a real one)


class KVEvents:
    """The prefix cache's changes, numbered from 1: ``(number, kind, hash)`` for a block, kind one
    of ``STORED``, ``HOST``, ``DISK``, ``REMOVED``; ``(number, kind, hash, SNAPSHOT)`` for a
    hybrid's state snapshot of the block ``hash`` (a reader of blocks only that unpacks three
    fields fails on it, rather than take it for a block). Written
    by the engine's thread, read by any (a lock). Only the last ``limit`` are kept; a reader that
    fell further behind (``since`` returns None) reads the whole index instead."""

    def __init__(self, limit: int = 1 << 16):
        self.limit, self.last = limit, 0
        self.log: deque = deque()
        self.lock = threading.Lock()

    def add(self, kind: int, h, snapshot: bool = False) -> None:
        with self.lock:
            self.last += 1
            self.log.append((self.last, kind, h, SNAPSHOT) if snapshot else (self.last, kind, h))
            if len(self.log) > self.limit:
                self.log.popleft()

    def since(self, after: int) -> Tuple[int, Optional[List[tuple]]]:
        """``(last number, the events numbered after ``after``)``; None if some are gone."""
        with self.lock:
            if (
                after > self.last
                or (self.log and self.log[0][0] > after + 1)
                or (not self.log and after < self.last)
            ):
                return self.last, None
            return self.last, [e for e in self.log if e[0] > after]


@dataclass(frozen=True)
class _Content:
    """What a registered block holds; two blocks with equal content hold the same KV."""

    parent: Optional[int]  # content id of the previous block (None for the first block)
    tokens: Tuple[int, ...]
    salt: Optional[str]


@dataclass
class PrefixCursor:
    """How far a sequence's chain of full blocks is registered (reset when its table is freed)."""

    blocks: int = 0  # full blocks already processed
    hash: Hashable = None  # chained hash of the last processed block
    cid: Optional[int] = None  # content id of the last processed block
    key: Optional[bytes] = None  # tier key (chained SHA-256) of the last processed block
    stopped: bool = False  # a hash collision cut the chain: register nothing further


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: Callable[[tuple], Hashable] = block_hash,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching, self.hash_fn = enable_prefix_caching, hash_fn
        self.ref = [0] * num_blocks
        self.empty = deque(range(num_blocks))  # ref 0, holds nothing reusable
        self.evictable: "OrderedDict[int, None]" = OrderedDict()  # ref 0, registered; LRU first
        self.by_hash: Dict[Hashable, int] = {}  # hash -> registered block
        self.hash_of: Dict[int, Hashable] = {}  # registered block -> its hash
        self.cid_of: Dict[int, int] = {}  # registered block (or twin in use) -> its content id
        self.twins: Dict[int, set] = {}  # content id -> blocks in use that hold it, not registered
        self.cids: Dict[_Content, int] = {}  # interned contents
        self.contents: Dict[int, _Content] = {}
        self.cid_refs: Dict[
            int, int
        ] = {}  # registered blocks holding it + contents whose parent it is
        self._next_cid = itertools.count()
        self.hits = self.queries = self.evictions = self.promotions = 0  # counters, in blocks
        self.events: Optional[KVEvents] = None  # set to publish the prefix cache's changes
        self.tiers = None  # a TierStore (attach_tiers): evicted blocks kept off the device
        self.key_of: Dict[int, bytes] = {}  # registered block -> its tier key (with tiers)
        self.states = None  # a hybrid model's state slots (attach_states)
        # with events: the snapshots they say are held, checkpoint block hash -> tier
        self.snapshot_tiers: Dict[Hashable, int] = {}

    def attach_tiers(self, tiers) -> None:
        """Keep evicted blocks in ``tiers`` (a ``tiers.TierStore``) and promote them back."""
        self.tiers = tiers
        tiers.on_change = self._tier_changed

    def attach_states(self, states) -> None:
        """A hybrid model: its recurrent-state slots and prefix snapshots (a
        ``state_pool.StateSlots``), whose snapshots live and die with their blocks."""
        self.states = states
        states.on_change = self._snapshot_changed

    def publish(self, events: KVEvents) -> None:
        """Number the prefix cache's changes in ``events`` from now on; a hybrid's snapshots held
        now are where its snapshot events start from (``snapshot_tiers``)."""
        self.events = events
        if self.states is not None:
            self.snapshot_tiers = dict(self.snapshots())

    def snapshots(self) -> List[Tuple[Hashable, int]]:
        """``(hash, tier)`` of each snapshot a prompt can resume from: on the device, or in the
        tier that holds the block it ends (one the device lost; a promotion brings it back)."""
        out = [(h, STORED) for h in self.states.index]
        if self.tiers is not None:
            out += [(h, t) for h, t in self.tiers.snapshots() if h not in self.by_hash]
        return out

    def match_states(self, blocks: List[int]) -> Tuple[List[int], Optional[int]]:
        """A hybrid model's usable part of a prefix match: the blocks up to the deepest one
        with a snapshot and that snapshot's slot (the rest are freed), or no blocks and None.
        Without states: ``blocks`` as they are."""
        if self.states is None:
            return blocks, None
        k, slot = self.deepest_snapshot(blocks)
        self.free(blocks[k:])
        return blocks[:k], slot

    def deepest_snapshot(self, blocks: List[int]) -> Tuple[int, Optional[int]]:
        """``(k, slot)``: the first ``k`` of ``blocks`` (a registered prefix) reach the deepest
        snapshot, held in ``slot``; ``(0, None)`` if none does. Any block may hold one (an
        imported prefix's ends where its tokens do), so every one is looked at."""
        for k in range(len(blocks), 0, -1):
            b = blocks[k - 1]
            h = self.hash_of.get(b)
            slot = None if h is None else self.states.get(h, self.cid_of[b])
            if slot is not None:
                return k, slot
        return 0, None

    def resumable(self, chain: List[Tuple[Optional[int], Optional[bytes]]]) -> int:
        """Blocks of ``locate``'s ``chain`` a hybrid resumes from: up to the deepest snapshot on
        the device, or carried by the tier entry of a block the device lost (its promotion puts
        the snapshot back into a slot)."""
        tiered = [
            k + 1 for k, (b, key) in enumerate(chain) if b is None and self.tiers.has_state(key)
        ]
        return max(tiered + [self.deepest_snapshot([b for b, _ in chain])[0]])

    def checkpoint_key(
        self, table: List[int], k: int, token_ids: Sequence[int], salt: Optional[str] = None
    ) -> Tuple[Optional[Hashable], Optional[int]]:
        """``(hash, content id)`` of block ``k - 1`` of ``table`` (a sequence of ``token_ids``)
        if it is registered, or a twin of a registered block (the same content computed beside
        it: the hash is the chain's), and no snapshot of it is held yet: what a completed save
        is indexed under; else ``(None, None)``."""
        b = table[k - 1] if k <= len(table) else None
        if b not in self.cid_of:
            return None, None
        h = self.hash_of.get(b)
        if h is None:  # a twin: hash the chain up to it, and find the block it twins
            *_, (_, h, _) = self._chain(token_ids, k, salt)
            if self.cid_of.get(self.by_hash.get(h)) != self.cid_of[b]:
                return None, None
        if self.states.has(h):
            return None, None
        return h, self.cid_of[b]

    def _tier_changed(self, h, tier: int, state: bool = False) -> None:
        """A tier took or lost ``h`` (``state``: its entry carries a snapshot): an event unless
        the device holds it (its best tier)."""
        if self.events is not None and h not in self.by_hash:
            self.events.add(tier, h)
        self._snapshot_changed(h, tier if state else REMOVED)

    def _snapshot_changed(self, h, tier: int = REMOVED) -> None:
        """``h``'s snapshot may have moved (``tier``: the tier holding it, if the device lost the
        block): an event if where a prompt resumes from it is not what the events said last."""
        if self.events is None or self.states is None:
            return
        if h in self.by_hash:  # a tier's copy is not read while the device holds the block
            tier = STORED if self.states.has(h) else REMOVED
        if self.snapshot_tiers.get(h, REMOVED) == tier:
            return
        if tier == REMOVED:
            del self.snapshot_tiers[h]
        else:
            self.snapshot_tiers[h] = tier
        self.events.add(tier, h, snapshot=True)

    def _key(self, parent: Optional[bytes], tokens: tuple, salt, h) -> Optional[bytes]:
        """A block's tier key: its chained SHA-256 (``h`` itself with the default hash)."""
        if self.tiers is None:
            return None
        return h if self.hash_fn is block_hash else block_hash((parent, tokens, salt))

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-used + evictable cached ones)."""
        return len(self.empty) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix matching -----------------------------------------------------------------
    def _chain(self, token_ids: Sequence[int], num_blocks: int, salt):
        """Yield (index, hash, tokens) for the first ``num_blocks`` full blocks, parent-chained."""
        parent = None
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = self.hash_fn((parent, tokens, salt))
            yield i, h, tokens
            parent = h

    def _walk(self, token_ids: Sequence[int], num_blocks: int, salt):
        """Yield ``(device block or None, tier key)`` for the first ``num_blocks`` full blocks of
        ``token_ids`` while some tier holds each: the device (the same tokens, salt and parent
        *content*: a hash collision is a miss) or else the host or disk tier (by the exact
        key). The consumer takes a device block before asking for the next one."""
        parent, pkey = None, None  # content id and tier key of the previous block
        for _, h, tokens in self._chain(token_ids, num_blocks, salt):
            key = self._key(pkey, tokens, salt, h)
            b = self.by_hash.get(h)
            if (
                b is not None
                and parent != _UNKNOWN
                and self.contents[self.cid_of[b]] == _Content(parent, tokens, salt)
            ):
                parent = self.cid_of[b]
            elif key is not None and self.tiers.where(key) is not None:
                b = None
                cid = None if parent == _UNKNOWN else self.cids.get(_Content(parent, tokens, salt))
                parent = _UNKNOWN if cid is None else cid
            else:
                return  # miss, or a hash collision: stop, never reuse unconfirmed KV
            pkey = key
            yield b, key

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None) -> List[int]:
        """Registered blocks holding a prefix of ``token_ids``; never covers the last token
        (its logits are needed, so it is always recomputed). Takes a reference on each. Blocks
        a tier holds are promoted: their K/V read from the tier first, then a fresh block each
        (while any is free: an eviction then may push tier entries out, never these), the K/V
        written, the blocks registered again. Hits are not counted here (``count`` does, once a
        request is admitted)."""
        if not self.prefix_caching:
            return []
        chain = []  # (device block or None, tier key)
        for b, key in self._walk(token_ids, (len(token_ids) - 1) // self.block_size, salt):
            if b is not None:
                self._take(b)  # before the next allocation could evict it
            chain.append((b, key))
        wanted = [key for b, key in chain if b is None][: self.num_free]
        kvs = self.tiers.take(wanted) if wanted else []
        cut = len(chain)  # the chain ends before the first tier block not taken
        tiered = [i for i, (b, _) in enumerate(chain) if b is None]
        if len(kvs) < len(tiered):
            cut = tiered[len(kvs)]
            self.free([b for b, _ in chain[cut:] if b is not None])
        fresh = self.allocate(len(kvs))  # evictions may fill the tiers now: the K/V are read
        blocks, it = [], iter(fresh)
        for b, _ in chain[:cut]:
            blocks.append(next(it) if b is None else b)
        if kvs:
            self.tiers.promote(fresh, kvs)
            self.promotions += len(kvs)
            self.register(blocks, token_ids, len(blocks) * self.block_size, salt)
            self._promote_states(blocks, tiered[: len(kvs)], kvs, token_ids, salt)
        return blocks

    def _promote_states(self, blocks: List[int], at: List[int], kvs: list, token_ids, salt) -> None:
        """A hybrid's promoted blocks (``blocks[at[i]]`` from ``kvs[i]``) that carry their state
        snapshot: back into a snapshot slot, indexed under the block again."""
        for i, kv in zip(at, kvs):
            if len(kv) == 5 and self.states is not None:
                h, cid = self.checkpoint_key(blocks, i + 1, token_ids, salt)
                slot = self.states.reserve() if h is not None else None
                if slot is not None:
                    self.tiers.write_state(slot, kv[4])
                    self.states.put(h, cid, slot)

    def locate(
        self, token_ids: Sequence[int], salt: Optional[str] = None, take: bool = False
    ) -> List[Tuple[Optional[int], Optional[bytes]]]:
        """The longest prefix of whole blocks of ``token_ids`` held in any tier, per block
        ``(device block, key)`` or ``(None, key)`` (a tier holds it). ``take``: a reference
        on each device block (pinned: ``free`` them when done)."""
        if not self.prefix_caching:
            return []
        out = []
        for b, key in self._walk(token_ids, len(token_ids) // self.block_size, salt):
            if b is not None and take:
                self._take(b)
            out.append((b, key))
        return out

    def prefetch(self, token_ids: Sequence[int], salt: Optional[str] = None) -> None:
        """Start reading the disk-tier blocks of a queued prompt's prefix (``TierStore.prefetch``)
        off the engine's thread."""
        if self.tiers is not None and self.tiers.disk is not None:
            self.tiers.prefetch([k for b, k in self.locate(token_ids, salt) if b is None])

    def count(self, token_ids: Sequence[int], hits: int) -> None:
        """Record one admitted request: ``hits`` of its full prompt blocks came from the cache."""
        if self.prefix_caching:
            self.queries += (len(token_ids) - 1) // self.block_size
            self.hits += hits

    # -- allocation ----------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            self.evictable.pop(b, None)
        self.ref[b] += 1

    def _evict(self, b: int) -> Optional[Tuple[int, Optional[bytes], Hashable]]:
        """Unregister ``b``; ``(b, tier key, hash)`` if the device cache lost the hash."""
        h, cid, key = self.hash_of.pop(b), self.cid_of.pop(b), self.key_of.pop(b, None)
        del self.by_hash[h]
        twins = self.twins.get(cid)
        lost = None
        if twins:  # a block in use holds the same KV: it takes over the cache entry
            d = twins.pop()
            self.by_hash[h], self.hash_of[d] = d, h
            if key is not None:
                self.key_of[d] = key
        else:
            lost = (b, key, h)
        self._unref(cid)
        self.evictions += 1
        return lost

    def _intern(self, content: _Content) -> int:
        cid = self.cids.get(content)
        if cid is None:
            cid = self.cids[content] = next(self._next_cid)
            self.contents[cid], self.cid_refs[cid] = content, 0
            if content.parent is not None:
                self.cid_refs[content.parent] += 1
        return cid

    def _unref(self, cid: int) -> None:
        while cid is not None:
            self.cid_refs[cid] -= 1
            if self.cid_refs[cid]:
                return
            content = self.contents.pop(cid)  # nothing holds or descends from it any more
            del self.cids[content], self.cid_refs[cid]
            self.twins.pop(cid, None)
            cid = content.parent

    def allocate(self, n: int) -> List[int]:
        """``n`` fresh blocks (ref 1 each), evicting LRU cached blocks if needed."""
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, only {self.num_free} free")
        out, lost = [], []
        for _ in range(n):
            if self.empty:
                b = self.empty.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                gone = self._evict(b)
                if gone is not None:
                    lost.append(gone)
            self.ref[b] = 1
            out.append(b)
        if lost and self.tiers is not None:  # their K/V to a tier before anyone writes the blocks
            snaps = {} if self.states is None else self.states.slots_of(lost)
            self.tiers.save(lost, snaps)  # (its events through _tier_changed)
        elif self.events is not None:
            for _, _, h in lost:
                self.events.add(REMOVED, h)
                self._snapshot_changed(h)
        if self.states is not None:  # a snapshot leaves the device with its block
            for _, _, h in lost:
                self.states.drop(h)
        return out

    def grow(self, table: List[int], num_tokens: int) -> bool:
        """Extend ``table`` in place to hold ``num_tokens`` tokens; False (unchanged) if short."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        table.extend(self.allocate(need))
        return True

    def free(self, table: List[int]) -> None:
        """Drop one reference on each block; tail blocks are queued for eviction first."""
        for b in reversed(table):
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                    continue
                if b in self.cid_of:  # a twin of a registered block: its KV is not kept
                    cid = self.cid_of.pop(b)
                    self.twins[cid].discard(b)
                    self._unref(cid)
                self.empty.append(b)
        table.clear()

    # -- registration --------------------------------------------------------------------
    def register(
        self,
        table: List[int],
        token_ids: Sequence[int],
        num_computed: int,
        salt: Optional[str] = None,
        cursor: Optional[PrefixCursor] = None,
    ) -> None:
        """Register every full block of ``table`` whose ``num_computed`` tokens are in the cache.
        With the sequence's ``cursor``, blocks processed by earlier calls are not hashed again."""
        if not self.prefix_caching:
            return
        cur = cursor if cursor is not None else PrefixCursor()
        full = min(num_computed // self.block_size, len(table))
        while cur.blocks < full and not cur.stopped:
            i = cur.blocks
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = self.hash_fn((cur.hash, tokens, salt))
            key = self._key(cur.key, tokens, salt, h)
            content = _Content(cur.cid, tokens, salt)
            b = table[i]
            if b in self.hash_of:
                pass  # registered earlier (a prefix hit): it holds this content
            elif h not in self.by_hash:
                cid = self._intern(content)
                self.cid_refs[cid] += 1
                self.by_hash[h], self.hash_of[b], self.cid_of[b] = b, h, cid
                if key is not None:
                    self.key_of[b] = key
                if self.events is not None:
                    self.events.add(STORED, h)
                    self._snapshot_changed(h)  # a tier's copy of it is not read now
            else:
                twin = self.by_hash[h]
                if self.contents[self.cid_of[twin]] != content:
                    cur.stopped = True  # a hash collision: leave the rest of this chain uncached
                    return
                own = table[i]
                if (
                    own not in self.cid_of
                ):  # it holds the twin's content alive (its chain goes on from
                    self.cid_of[own] = self.cid_of[
                        twin
                    ]  # there) and takes over if the twin is evicted
                    self.cid_refs[self.cid_of[own]] += 1
                    self.twins.setdefault(self.cid_of[own], set()).add(own)
                b = twin  # a twin holds the same KV (computed concurrently): chain on through it
            cur.blocks, cur.hash, cur.cid, cur.key = i + 1, h, self.cid_of[b], key

    def check(self) -> None:
        """Invariants (for tests): no negative refs, every block in exactly one state."""
        assert all(r >= 0 for r in self.ref), "negative reference count"
        empty, evict = set(self.empty), set(self.evictable)
        assert len(empty) == len(self.empty) and not (empty & evict)
        for b in range(self.num_blocks):
            free = b in empty or b in evict
            assert free == (self.ref[b] == 0), f"block {b}: ref {self.ref[b]} but free={free}"
            assert (b in evict) <= (b in self.hash_of), f"evictable block {b} is not registered"
            assert (b in empty) <= (b not in self.hash_of), f"empty block {b} is still registered"
        for h, b in self.by_hash.items():
            assert self.hash_of[b] == h
        assert set(self.key_of) <= set(self.hash_of), "a tier key of an unregistered block"
        for cid, blocks in self.twins.items():
            assert all(
                self.cid_of.get(b) == cid and b not in self.hash_of and self.ref[b] > 0
                for b in blocks
            )
        held = {}
        for cid in list(self.cid_of.values()) + [
            c.parent for c in self.contents.values() if c.parent is not None
        ]:
            held[cid] = held.get(cid, 0) + 1
        assert held == self.cid_refs, "content reference counts"
