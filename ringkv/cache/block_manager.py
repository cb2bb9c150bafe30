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

``KVEvents`` (``BlockManager.events``, off unless set): every hash entering the prefix cache
(``STORED``) and leaving it (``REMOVED``, an eviction), numbered in order, so a router can keep
an index of which engine holds which prefix blocks (``serve/router.py``).
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


STORED, REMOVED = 1, 0


class KVEvents:
    """The prefix cache's changes, numbered from 1: ``(number, STORED | REMOVED, hash)``. Written
    by the engine's thread, read by any (a lock). Only the last ``limit`` are kept; a reader that
    fell further behind (``since`` returns None) reads the whole index instead."""

    def __init__(self, limit: int = 1 << 16):
        self.limit, self.last = limit, 0
        self.log: deque = deque()
        self.lock = threading.Lock()

    def add(self, kind: int, h) -> None:
        with self.lock:
            self.last += 1
            self.log.append((self.last, kind, h))
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
        self.hits = self.queries = self.evictions = 0  # counters, in blocks
        self.events: Optional[KVEvents] = None  # set to publish the prefix cache's changes

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

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None) -> List[int]:
        """Registered blocks holding a prefix of ``token_ids``; never covers the last token
        (its logits are needed, so it is always recomputed). Takes a reference on each.
        Hits are not counted here (``count`` does, once a request is admitted)."""
        if not self.prefix_caching:
            return []
        full = (len(token_ids) - 1) // self.block_size
        blocks: List[int] = []
        parent = None
        for _, h, tokens in self._chain(token_ids, full, salt):
            b = self.by_hash.get(h)
            if b is None or self.contents[self.cid_of[b]] != _Content(parent, tokens, salt):
                break  # miss, or a hash collision: stop, never reuse unconfirmed KV
            blocks.append(b)
            parent = self.cid_of[b]
        for b in blocks:
            self._take(b)
        return blocks

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

    def _evict(self, b: int) -> None:
        h, cid = self.hash_of.pop(b), self.cid_of.pop(b)
        del self.by_hash[h]
        twins = self.twins.get(cid)
        if twins:  # a block in use holds the same KV: it takes over the cache entry
            d = twins.pop()
            self.by_hash[h], self.hash_of[d] = d, h
        elif self.events is not None:
            self.events.add(REMOVED, h)
        self._unref(cid)
        self.evictions += 1

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
        out = []
        for _ in range(n):
            if self.empty:
                b = self.empty.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._evict(b)
            self.ref[b] = 1
            out.append(b)
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
            content = _Content(cur.cid, tokens, salt)
            b = table[i]
            if b in self.hash_of:
                pass  # registered earlier (a prefix hit): it holds this content
            elif h not in self.by_hash:
                cid = self._intern(content)
                self.cid_refs[cid] += 1
                self.by_hash[h], self.hash_of[b], self.cid_of[b] = b, h, cid
                if self.events is not None:
                    self.events.add(STORED, h)
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
            cur.blocks, cur.hash, cur.cid = i + 1, h, self.cid_of[b]

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
