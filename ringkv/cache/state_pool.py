"""Recurrent state beside the paged KV cache (hybrid models): slots, snapshots, the tensors.

A hybrid model's recurrent layers (short convolutions, Mamba2, gated DeltaNet) keep a fixed-size
state per sequence instead of K/V per token. Each rank holds, for each recurrent layer of its
stage, one float32 tensor per state shape ``(slots, *shape)`` (``StatePool``); a *slot* is an
index into all of them, the same on every rank.

The driver's ``StateSlots`` hands slots out:

- **running slots** ``0 .. running-1``: one per running sequence, taken at admission, given back
  at finish, abort and preemption (the sequence is recomputed, or resumed from a snapshot);
- **snapshot slots** ``running ..``: the states of a prompt prefix at a *checkpoint*, the end of
  every ``checkpoint_blocks``-th block of a sequence. A snapshot is keyed by the chained hash of
  the checkpoint's block (the prefix cache's key) and that block's content id, so it is only
  ever used with the exact prefix it was computed from. A later prompt whose cached blocks reach
  checkpoints resumes from the deepest one that has a snapshot (``BlockManager.match_states``):
  the snapshot is copied into its running slot and the tokens after it are computed.

Snapshots live as long as the block they end at stays registered on the device (the block
manager drops them when it loses the hash), and are evicted least-recently-used first when a new
one needs a slot. A slot taken for a save is *pending* until the step that writes it completes
(``put``): only then is it indexed, and only if the block it ends at was registered.
``on_change(hash)`` is told each snapshot indexed or evicted here (the block manager turns it into
a ``KVEvents`` entry; a ``drop`` it makes itself, and reports where the snapshot went).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

STATE_DTYPE = torch.float32  # what snapshots, tiers and migration carry
# the pool's own dtype (``EngineConfig.state_dtype``): float32 unless the user asks otherwise
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def state_bytes(layers: Dict[int, List[tuple]], dtype: torch.dtype = STATE_DTYPE) -> int:
    """Bytes of one slot over ``layers`` (global layer index -> its state shapes) in ``dtype``."""
    total = 0
    for shapes in layers.values():
        for shape in shapes:
            n = 1
            for d in shape:
                n *= int(d)
            total += n * dtype.itemsize
    return total


def snapshot_slots(num_blocks: int, running: int, every: int) -> int:
    """Snapshot slots beside ``num_blocks`` KV blocks: one per ``every`` blocks (a cache full of
    prefixes) plus one per running sequence (each may snapshot where its prefix branched off and
    at its prompt's end); none when ``every`` is 0 (prefix caching off)."""
    return running + num_blocks // every if every else 0


def flatten(states: Dict[int, List[torch.Tensor]]) -> torch.Tensor:
    """One slot's state, every layer in order, as one flat float32 tensor (what snapshots carry)."""
    parts = [t.reshape(-1).float().cpu() for i in sorted(states) for t in states[i]]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten(x: torch.Tensor, layers: Dict[int, List[tuple]]) -> Dict[int, List[torch.Tensor]]:
    """``flatten``'s inverse for ``layers`` (layer -> its state shapes); ``ValueError`` unless
    ``x`` is a flat float32 tensor of exactly their size."""
    want = state_bytes(layers) // STATE_DTYPE.itemsize
    if not isinstance(x, torch.Tensor) or x.dtype != STATE_DTYPE or tuple(x.shape) != (want,):
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"the recurrent state must be float32 of shape ({want},), got {got}")
    out, at = {}, 0
    for i in sorted(layers):
        out[i] = []
        for shape in layers[i]:
            n = torch.Size(shape).numel()
            out[i].append(x[at : at + n].view(shape))
            at += n
    return out


class StateSlots:
    """The driver's book of state slots (see the module docstring); pure Python."""

    def __init__(self, running: int, snapshots: int, checkpoint_blocks: int):
        if running < 1 or snapshots < 0 or checkpoint_blocks < 1:
            raise ValueError(
                f"need running >= 1, snapshots >= 0 and checkpoint_blocks >= 1, got "
                f"{running}, {snapshots}, {checkpoint_blocks}"
            )
        self.running, self.snapshots, self.checkpoint_blocks = running, snapshots, checkpoint_blocks
        self.free_running: deque = deque(range(running))
        self.free_snapshots: deque = deque(range(running, running + snapshots))
        # hash -> (slot, content id), least recently used first
        self.index: "OrderedDict[Hashable, Tuple[int, int]]" = OrderedDict()
        self.pending: set = set()  # snapshot slots taken for a save not completed yet
        self.on_change: Callable[[Hashable], None] = lambda h: None  # indexed or evicted
        self.saved = self.restored = self.evicted = 0  # counters

    # -- running slots ---------------------------------------------------------------------
    def take(self) -> Optional[int]:
        """A free running slot, or None."""
        return self.free_running.popleft() if self.free_running else None

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.running or slot in self.free_running:
            raise RuntimeError(f"state slot {slot} released twice or never taken")
        self.free_running.append(slot)

    # -- snapshots -------------------------------------------------------------------------
    def reserve(self) -> Optional[int]:
        """A snapshot slot for a save (evicting the least recently used snapshot if none is
        free), pending until ``put``; None when every snapshot slot is pending or there are
        none."""
        if not self.free_snapshots and self.index:
            h, (slot, _) = self.index.popitem(last=False)
            self.free_snapshots.append(slot)
            self.evicted += 1
            self.on_change(h)
        if not self.free_snapshots:
            return None
        slot = self.free_snapshots.popleft()
        self.pending.add(slot)
        return slot

    def put(self, h: Optional[Hashable], cid: Optional[int], slot: int) -> None:
        """The save into ``slot`` completed: index it under the checkpoint block's hash and
        content id (``h`` None: the block was not registered, or a snapshot of it exists already:
        the slot is freed)."""
        self.pending.discard(slot)
        if h is None or h in self.index:
            self.free_snapshots.append(slot)
            return
        self.index[h] = (slot, cid)
        self.saved += 1
        self.on_change(h)

    def get(self, h: Hashable, cid: int) -> Optional[int]:
        """The snapshot slot of the checkpoint block ``h`` holding content ``cid`` (marked
        recently used), or None."""
        hit = self.index.get(h)
        if hit is None or hit[1] != cid:
            return None
        self.index.move_to_end(h)
        return hit[0]

    def slots_of(self, lost) -> Dict[bytes, int]:
        """Evicted blocks ``(block, key, hash)``: tier key -> snapshot slot of those that hold
        a snapshot (it goes to the tier with the block)."""
        return {key: self.index[h][0] for _, key, h in lost if h in self.index}

    def has(self, h: Hashable) -> bool:
        return h in self.index

    def drop(self, h: Hashable) -> None:
        """The device lost block ``h``: its snapshot goes with it (to the block's tier, or
        nowhere: the block manager reports which, not ``on_change``)."""
        hit = self.index.pop(h, None)
        if hit is not None:
            self.free_snapshots.append(hit[0])

    def usage(self) -> dict:
        return dict(
            running=self.running,
            running_free=len(self.free_running),
            snapshots=self.snapshots,
            snapshots_held=len(self.index),
            saved=self.saved,
            restored=self.restored,
            evicted=self.evicted,
            checkpoint_blocks=self.checkpoint_blocks,
        )


class StatePool:
    """One rank's state tensors: for each recurrent layer of its stage, one tensor ``(slots,
    *shape)`` per state shape (zeros at start), of ``dtype`` (float32 by default; the layers
    compute in float32 from it and round into it)."""

    def __init__(self, layers: Dict[int, List[tuple]], slots: int, device, dtype=STATE_DTYPE):
        self.slots = slots
        self.layers: Dict[int, List[torch.Tensor]] = {
            i: [torch.zeros(slots, *s, dtype=dtype, device=device) for s in shapes]
            for i, shapes in layers.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.layers.values() for t in ts)

    def copy(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """``(src, dst)`` slot pairs, every layer: a snapshot restored into a running slot."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for ts in self.layers.values():
            for t in ts:
                t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))
