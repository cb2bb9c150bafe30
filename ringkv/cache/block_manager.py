"""Block bookkeeping for the paged KV cache: pure Python, no tensors.

A sequence owns a list of block ids (its block table). Blocks are reference counted: a
block shared by several sequences (a common prompt prefix) is freed only when the last one
lets go.

Prefix caching: once a block is FULL of computed tokens it is registered under the chained
hash ``hash_fn((parent_hash, tokens, cache_salt))``. A later prompt walks its own full blocks
from the start and reuses every block whose hash is registered AND whose stored content
matches exactly: the same tokens, the same salt and the same parent *registration* (each
registration gets a fresh id, so a child of an evicted-and-reused parent never matches). A
hash collision therefore costs a miss, never wrong KV. Unreferenced registered blocks stay
cached and are evicted least-recently-used first, after the never-used blocks.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class _Content:
    """What a registered block holds; two blocks with equal content hold the same KV."""
    parent: Optional[int]  # registration id of the previous block (None for the first block)
    tokens: Tuple[int, ...]
    salt: Optional[str]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[tuple], Hashable] = hash):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching, self.hash_fn = enable_prefix_caching, hash_fn
        self.ref = [0] * num_blocks
        self.empty = deque(range(num_blocks))  # ref 0, holds nothing reusable
        self.evictable: "OrderedDict[int, None]" = OrderedDict()  # ref 0, registered; LRU first
        self.by_hash: Dict[Hashable, int] = {}  # hash -> registered block
        self.hash_of: Dict[int, Hashable] = {}  # registered block -> its hash
        self.content: Dict[int, _Content] = {}
        self.reg_id: Dict[int, int] = {}  # registered block -> registration id
        self._next_reg = itertools.count()
        self.hits = self.queries = self.evictions = 0  # counters, in blocks

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
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self.hash_fn((parent, tokens, salt))
            yield i, h, tokens
            parent = h

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None) -> List[int]:
        """Registered blocks holding a prefix of ``token_ids``; never covers the last token
        (its logits are needed, so it is always recomputed). Takes a reference on each."""
        if not self.prefix_caching:
            return []
        full = (len(token_ids) - 1) // self.block_size
        blocks: List[int] = []
        parent_reg = None
        for _, h, tokens in self._chain(token_ids, full, salt):
            self.queries += 1
            b = self.by_hash.get(h)
            if b is None or self.content.get(b) != _Content(parent_reg, tokens, salt):
                break  # miss, or a hash collision: stop, never reuse unconfirmed KV
            blocks.append(b)
            parent_reg = self.reg_id[b]
        for b in blocks:
            self._take(b)
        self.hits += len(blocks)
        return blocks

    # -- allocation ----------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            self.evictable.pop(b, None)
        self.ref[b] += 1

    def _evict(self, b: int) -> None:
        h = self.hash_of.pop(b)
        if self.by_hash.get(h) == b:
            del self.by_hash[h]
        del self.content[b], self.reg_id[b]
        self.evictions += 1

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
                else:
                    self.empty.append(b)
        table.clear()

    # -- registration --------------------------------------------------------------------
    def register(self, table: List[int], token_ids: Sequence[int], num_computed: int,
                 salt: Optional[str] = None) -> None:
        """Register every full block of ``table`` whose ``num_computed`` tokens are in the cache."""
        if not self.prefix_caching:
            return
        full = min(num_computed // self.block_size, len(table))
        parent_reg = None
        for i, h, tokens in self._chain(token_ids, full, salt):
            b = table[i]
            content = _Content(parent_reg, tokens, salt)
            if b in self.content:
                pass  # registered earlier; its parent may be a since-evicted twin: keep its own id
            elif h not in self.by_hash:
                self.by_hash[h], self.hash_of[b] = b, h
                self.content[b], self.reg_id[b] = content, next(self._next_reg)
            else:
                twin = self.by_hash[h]
                if self.content[twin] != content:
                    return  # a hash collision: leave the rest of this chain uncached
                b = twin  # a twin holds the same KV (computed concurrently): chain on through it
            parent_reg = self.reg_id[b]

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
