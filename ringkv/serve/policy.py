"""The router's routing policy: its index of the instances' prefix caches and the score that
picks where a prompt goes.

- **Index.** Each ``Instance`` holds what its prefix cache holds, as its block events told
  (``GET /internal/state``: blocks stored and evicted, keyed by the portable block hash, salted
  per request's ``cache_salt``), and the blocks of prompts routed there that it will hold soon.
  A hybrid model's instance also tells its state snapshots (by the hash of the block each ends):
  a prompt resumes there only from the deepest block of its held prefix that has one.
- **Score** (``kv``). A prompt's chain of block hashes is computed for each instance's logical
  block (``block_size * sp`` tokens); it goes to the instance where its cached prefix is worth
  most, unless that instance holds ``balance`` more requests in flight than the least busy one:
  then to the best of the rest. Each prompt block an instance can get counts by where it comes
  from (``TIER_WEIGHT``): its device pool, its host-memory tier, its disk tier, a peer it can
  pull it from (with ``kv_pull``, ``PEER_WEIGHT``), or a recompute (0). ``round-robin`` and
  ``least-loaded`` are there to compare with.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Dict, Iterator, List, Optional

from ..cache.block_manager import DISK, HOST, REMOVED, STORED, block_hash

ROUTINGS = ("kv", "round-robin", "least-loaded")
POLL_S = 0.5  # how often each instance is asked for its state
DOWN_AFTER = 3  # failed polls in a row that mark an instance down
# seconds a routed prompt's blocks count as cached where it went, before its events arrive
PENDING_S = 30.0
# what one prompt token is worth where its K/V comes from (routing "kv"): an instance's device
# pool, its host-memory tier, its disk tier, a peer it pulls it from, or a recompute (0)
TIER_WEIGHT = {STORED: 1.0, HOST: 0.75, DISK: 0.5}
PEER_WEIGHT = 0.25
TIERS = {STORED: "device", HOST: "host", DISK: "disk"}  # their names in metrics and views


def index(held: Dict[str, int], events: List[list]) -> None:
    """Events ``[[kind, hex hash], ...]`` (``GET /internal/state``'s, of blocks or of snapshots)
    into an index, hex hash -> tier: ``REMOVED`` drops the hash, ``STORED``, ``HOST`` or ``DISK``
    say where it is best held now."""
    for kind, h in events:
        if kind == REMOVED:
            held.pop(h, None)
        else:
            held[h] = kind


class InstanceState(StrEnum):
    """Where an instance stands (its wire name in ``/admin/instances`` is the value)."""

    STARTING = "starting"  # added or (re)started; not answered yet
    UP = "up"  # answers its polls: requests go there
    DOWN = "down"  # unreachable, its process exited or its engine failed (polled again)
    DRAINING = "draining"  # takes no new requests; removed once its streams end
    FAILED = "failed"  # a replica that exited MAX_CRASHES times before it answered: not restarted


@dataclass
class Instance:
    id: str
    url: str
    proc: Optional[subprocess.Popen] = None  # a replica this front started
    argv: Optional[List[str]] = None  # how to start it again
    state: InstanceState = InstanceState.STARTING
    error: Optional[str] = None
    epoch: str = ""
    last: int = 0  # the last block event read
    # the blocks its prefix cache holds: hash (hex) -> tier (STORED: device, HOST, DISK)
    blocks: Dict[str, int] = field(default_factory=dict)
    # a hybrid model's state snapshots: hash (hex) of the block each ends -> tier; None: dense
    snapshots: Optional[Dict[str, int]] = None
    # hashes of the blocks of prompts routed there: until when they count as cached
    pending: Dict[str, float] = field(default_factory=dict)
    tokens_per_block: int = 0
    model: str = ""  # model digest: migration needs the same on both sides
    kv_cache_dtype: str = ""
    max_num_seqs: int = 64
    load: dict = field(default_factory=dict)  # its own gauges: running, waiting, kv_usage, ...
    inflight: int = 0  # sub-requests this front streams from it now
    failed_polls: int = 0  # polls in a row it did not answer
    last_ok: Optional[float] = None  # time.time() the last poll it answered was sent
    crashes: int = 0  # times in a row its process exited before it answered
    counters: Dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            "requests prompt_tokens cached_tokens migrations_in migrations_out failovers "
            "pull_hints".split(),
            0,
        )
    )

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def score(self) -> float:
        return max(float(self.load.get("kv_usage", 0.0)), self.inflight / max(self.max_num_seqs, 1))

    def tier_blocks(self) -> Dict[str, int]:
        """Blocks of its index per tier: ``{"device": n, "host": n, "disk": n}``."""
        out = dict.fromkeys(TIERS.values(), 0)
        for tier in self.blocks.values():
            out[TIERS.get(tier, "device")] += 1
        return out

    def view(self) -> dict:
        load = dict(self.load, inflight=self.inflight, score=round(self.score(), 4))
        return dict(
            id=self.id,
            url=self.url,
            pid=self.pid,
            state=self.state,
            error=self.error,
            load=load,
            cached_blocks=len(self.blocks),
            cached_snapshots=None if self.snapshots is None else len(self.snapshots),
            tier_blocks=self.tier_blocks(),
            tokens_per_block=self.tokens_per_block,
            counters=dict(self.counters),
            failed_polls=self.failed_polls,
            last_ok=self.last_ok,
        )


class NoInstance(RuntimeError):
    """No instance is up to take a request."""


class RoutingPolicy:
    """Where a prompt goes, over the instances ``up()`` returns (a ``Router``'s): its
    ``routing`` (``ROUTINGS``), ``balance``, ``kv_pull`` and round-robin counter ``rr``."""

    routing: str
    balance: int
    kv_pull: bool
    rr: Iterator[int]

    def up(self) -> List[Instance]:
        raise NotImplementedError

    @staticmethod
    def chain(inst: Instance, ids: List[int], salt, chains: dict) -> List[str]:
        """The prompt's chain of block hashes (hex) at ``inst``'s logical block size, computed
        once per size into ``chains``."""
        tpb = inst.tokens_per_block
        if tpb not in chains:
            out, parent = [], None
            for i in range(len(ids) // tpb):
                parent = block_hash((parent, tuple(ids[i * tpb : (i + 1) * tpb]), salt))
                out.append(parent.hex())
            chains[tpb] = out
        return chains[tpb]

    def held(
        self, inst: Instance, ids: List[int], salt, chains: dict, pending: bool = True
    ) -> List[int]:
        """The tier of each block of the longest prefix of the prompt ``inst`` holds (a block
        claimed by a prompt routed there counts as on its device while ``pending``), cut for a
        hybrid model after the deepest block with a state snapshot (or claimed): a prompt
        resumes from there and computes the rest."""
        if inst.tokens_per_block <= 0:
            return []
        out, now, usable = [], time.monotonic(), 0
        snapshots = inst.snapshots
        for h in self.chain(inst, ids, salt, chains):
            tier = inst.blocks.get(h)
            if tier is None:
                if not pending or inst.pending.get(h, 0.0) < now:
                    break
                tier = STORED
            out.append(tier)
            if snapshots is None or h in snapshots or h not in inst.blocks:
                usable = len(out)
        return out[:usable]

    def cached_tokens(self, inst: Instance, ids: List[int], salt, chains: dict) -> int:
        """Prompt tokens of the longest prefix ``inst`` holds, in any tier."""
        return len(self.held(inst, ids, salt, chains)) * inst.tokens_per_block

    def holder(
        self, inst: Instance, ids: List[int], salt, chains: dict
    ) -> tuple[Optional[Instance], int]:
        """The up instance ``inst`` could pull the longest prefix of the prompt from (same model
        and KV cache dtype; blocks its events reported, not claims; a hybrid's up to a snapshot),
        and that prefix's tokens."""
        best, most = None, 0
        for h in self.up():
            if h is inst or (h.model, h.kv_cache_dtype) != (inst.model, inst.kv_cache_dtype):
                continue
            if ("held", h.id) not in chains:  # (once per prompt routed)
                held = self.held(h, ids, salt, chains, pending=False)
                chains["held", h.id] = len(held) * h.tokens_per_block
            n = chains["held", h.id]
            if n > most:
                best, most = h, n
        return best, most

    def worth(self, inst: Instance, ids: List[int], salt, chains: dict) -> float:
        """What the prompt's cached K/V is worth on ``inst``: each token of its longest held
        prefix weighted by its tier, and (with ``kv_pull``) each further token a peer holds (in
        ``inst``'s whole blocks) by ``PEER_WEIGHT``."""
        tiers = self.held(inst, ids, salt, chains)
        tpb = inst.tokens_per_block
        value = sum(TIER_WEIGHT.get(t, 0.0) for t in tiers) * tpb
        if self.kv_pull and tpb > 0:
            _, most = self.holder(inst, ids, salt, chains)
            value += PEER_WEIGHT * max(0, most // tpb - len(tiers)) * tpb
        return value

    def claim(self, inst: Instance, chains: dict) -> None:
        """The prompt just routed to ``inst`` will be cached there: until its events say so (or
        ``PENDING_S`` pass), requests sharing its prefix go there too."""
        until = time.monotonic() + PENDING_S
        for h in chains.get(inst.tokens_per_block, ()):
            if h not in inst.blocks:
                inst.pending[h] = until

    def pick(self, ids: List[int], salt=None, exclude: frozenset = frozenset()) -> Instance:
        """The instance the prompt ``ids`` goes to (``route``)."""
        return self.route(ids, salt, exclude)[0]

    def route(
        self, ids: List[int], salt=None, exclude: frozenset = frozenset()
    ) -> tuple[Instance, Optional[tuple]]:
        """The instance the prompt goes to, and its ``pull_hint`` there (before the prompt is
        claimed there)."""
        up = [i for i in self.up() if i.id not in exclude]
        if not up:
            raise NoInstance("no instance is up to serve the request")
        if self.routing == "round-robin":
            best = up[next(self.rr) % len(up)]
            return best, self.pull_hint(best, ids, salt)
        if self.routing == "least-loaded":
            best = min(up, key=lambda i: (i.inflight, i.score()))
            return best, self.pull_hint(best, ids, salt)
        chains: dict = {}
        least = min(i.inflight for i in up)
        fair = [i for i in up if i.inflight <= least + self.balance] or up
        best = max(fair, key=lambda i: (self.worth(i, ids, salt, chains), -i.score(), -i.inflight))
        hint = self.pull_hint(best, ids, salt)
        self.claim(best, chains)
        return best, hint

    def pull_hint(self, inst: Instance, ids: List[int], salt=None) -> Optional[tuple]:
        """``(holder URL, tokens)`` when, with ``kv_pull``, another up instance holds at least
        one of ``inst``'s logical blocks more of the prompt's prefix (any tier) than ``inst``
        does (claims included: what it computes now it will hold); else None."""
        tpb = inst.tokens_per_block
        if not self.kv_pull or tpb <= 0:
            return None
        chains: dict = {}
        best, most = self.holder(inst, ids, salt, chains)
        if best is None or most < self.cached_tokens(inst, ids, salt, chains) + tpb:
            return None
        return best.url, most
