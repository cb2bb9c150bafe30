"""Prefix-cache blocks off the device: a bounded host-memory tier and an optional disk tier.

When the device pool evicts a registered block (``BlockManager.allocate``), its K/V are copied
here before the block is reused; when a later prompt's chain reaches a block the device lost
but a tier holds, ``BlockManager.match_prefix`` allocates a device block and copies them back
(a *promotion*): a hit costs a copy, a miss costs a prefill.

An entry is one *logical block* (``tokens_per_block = block_size * sp`` tokens) over all layers
and KV heads, token-major as a KV snapshot holds them: ``k``/``v`` ``(layers, tokens_per_block,
Hkv, D)`` in the cache's storage dtype, ``k_scale``/``v_scale`` ``(layers, tokens_per_block,
Hkv)`` on a quantized cache. The driver gathers them from every rank and scatters them back
(the cluster's ``read_kv``/``write_kv``), so the tiers work on every mesh.
An entry's ``key`` is the block's chained SHA-256 (``block_hash`` of parent key, tokens, salt):
it names the content, the tenant's salt included, so a tier never serves another's K/V.

- **Host**: ``host_bytes`` of memory, as whole entries (``host_blocks`` slots) in one byte pool.
  On a CPU engine the pool is a memory-mapped anonymous file of its own (a memfd: pages are
  taken when written, so an unused tier costs nothing); on CUDA it is pinned host memory. Least
  recently used first out: to the disk tier if there is one.
- **Disk** (``disk_tier.DiskTier``): safetensors files with checksums, bounded, least recently
  used first out; a file that fails its checks is refused and the block recomputed; a full disk
  turns the tier off and serving goes on.

The host tier is *exclusive* of the device: a block promoted from it leaves it (device and host
then hold twice the device pool's blocks; its next eviction copies it again). The disk tier is
*inclusive*: a promoted block keeps its file (a disk holds much more, and a write costs more),
so its next eviction costs no write.

A hybrid model's block that ends at a state snapshot carries it (``state``: flat float32, read
from the ranks by ``read_state(slot)``) as a fifth element of its entry: the host tier keeps it
beside its slot (``states``), the disk tier in the same file, and a promotion hands it back for a
snapshot slot (``BlockManager.match_prefix``): a snapshot leaves the device with its block and
returns with it.

``on_change(hash, tier, state)`` reports where an entry is best held off the device (``HOST``,
``DISK``, or ``REMOVED`` once no tier holds it) and whether the entry there carries a state
snapshot: the block manager turns it into the ``KVEvents`` (of the block and of its snapshot) a
router indexes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from .block_manager import DISK, HOST, REMOVED


KV = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


class EntryLayout:
    """Where each tensor of an entry sits in its slot of bytes."""

    def __init__(self, shape: Tuple[int, int, int], tokens_per_block: int, dtype, scale_dtype):
        layers, hkv, d = shape
        self.shapes = [(layers, tokens_per_block, hkv, d)] * 2
        self.dtypes = [dtype, dtype]
        if scale_dtype is not None:
            self.shapes += [(layers, tokens_per_block, hkv)] * 2
            self.dtypes += [scale_dtype, scale_dtype]
        self.sizes = [torch.Size(s).numel() * t.itemsize for s, t in zip(self.shapes, self.dtypes)]
        self.nbytes = sum(self.sizes)

    def pack(self, slot: torch.Tensor, kv: KV) -> None:
        """``kv`` (one entry) into ``slot`` (``nbytes`` uint8)."""
        at = 0
        for t, n in zip(kv, self.sizes):
            slot[at : at + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            at += n

    def unpack(self, slot: torch.Tensor) -> KV:
        """A copy of the entry in ``slot``."""
        out, at = [], 0
        for shape, dtype, n in zip(self.shapes, self.dtypes, self.sizes):
            out.append(slot[at : at + n].clone().view(dtype).view(shape))
            at += n
        return (*out, *(None,) * (4 - len(out)))


def default_host_bytes(pool_bytes: int) -> int:
    """The host tier's default size: as large as the device pool (``pool_bytes``), but at most
    half the host memory available now, so that a large accelerator's pool (or a CPU engine's
    own cache, which is host memory too) never makes the tier take what the host needs."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return pool_bytes
    return min(pool_bytes, kib * 1024 // 2)


def _pool(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of uint8: pinned memory, or a memory-mapped anonymous file of its own (memfd:
    RAM, never written back to a disk; pages are taken when first written)."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    fd = os.memfd_create("ringkv-host-kv")
    try:
        os.ftruncate(fd, nbytes)
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


class TierStore:
    """The host tier (and the disk tier behind it) of one engine's prefix cache.

    ``host_bytes``: the host tier's size (whole entries of ``layout.nbytes``: ``host_blocks``
    slots; 0: off). ``read_kv(blocks, start, end) -> KV`` gathers tokens ``[start, end)`` of
    device blocks and ``write_kv(blocks, start, kv)`` scatters K/V into them from token
    ``start`` on (the cluster's methods of those names); ``disk``: a ``DiskTier`` or None;
    ``on_change(hash, tier)``: see the module docstring."""

    def __init__(
        self,
        *,
        host_bytes: int,
        layout: EntryLayout,
        read_kv: Callable[[List[int], int, int], KV],
        write_kv: Callable[[List[int], int, KV], None],
        disk=None,
        pinned: bool = False,
        on_change: Callable[[Hashable, int, bool], None] = lambda h, tier, state: None,
        read_state: Optional[Callable[[int], torch.Tensor]] = None,
        write_state: Optional[Callable[[int, torch.Tensor], None]] = None,
    ):
        if host_bytes < 0:
            raise ValueError(f"host_bytes must be >= 0, got {host_bytes}")
        self.host_blocks, self.layout, self.disk = host_bytes // layout.nbytes, layout, disk
        self.read_kv, self.write_kv, self.on_change = read_kv, write_kv, on_change
        self.read_state, self.write_state = read_state, write_state  # a hybrid's snapshots
        self.states: Dict[bytes, torch.Tensor] = {}  # host entries' state snapshots
        self.pinned = pinned
        self.pool: Optional[torch.Tensor] = None  # host_blocks * nbytes uint8, made when first used
        self.slot_of: "OrderedDict[bytes, int]" = OrderedDict()  # key -> host slot, LRU first
        self.free_slots: List[int] = []  # slots given back; never-used ones from ``fresh`` on
        self.fresh = 0
        self.hash_of: Dict[bytes, Hashable] = {}  # key -> the prefix cache's hash of the block
        self.saves = self.loads = self.load_failures = 0  # counters, in blocks
        self.host_error: Optional[str] = None  # why the host tier turned itself off

    # -- lookups ---------------------------------------------------------------------------
    def where(self, key: bytes) -> Optional[int]:
        """``HOST`` or ``DISK`` if a tier holds the entry, else None."""
        if key in self.slot_of:
            return HOST
        if self.disk is not None and key in self.disk:
            return DISK
        return None

    def has_state(self, key: bytes) -> bool:
        """Whether the entry's best tier (``where``) holds it with a state snapshot."""
        if key in self.slot_of:
            return key in self.states
        return self.disk is not None and self.disk.has_state(key)

    def snapshots(self) -> List[Tuple[Hashable, int]]:
        """``(hash, tier)`` of every entry whose best tier holds a state snapshot with it."""
        return self._entries(self.has_state)

    def keys(self) -> List[Tuple[Hashable, int]]:
        """``(hash, tier)`` of every entry, each once (its best tier)."""
        return self._entries(lambda key: True)

    def _entries(self, which: Callable[[bytes], bool]) -> List[Tuple[Hashable, int]]:
        out = [(self.hash_of.get(k, k), HOST) for k in self.slot_of if which(k)]
        if self.disk is not None:
            on_disk = [k for k in self.disk.keys() if k not in self.slot_of and which(k)]
            out += [(self.hash_of.get(k, k), DISK) for k in on_disk]
        return out

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start reading the disk entries among ``keys`` (a queued request's chain) off the
        engine's thread, so its promotion finds them in memory."""
        if self.disk is not None:
            wanted = [k for k in keys if k not in self.slot_of and k in self.disk]
            if wanted:
                self.disk.prefetch(wanted)

    def get(self, key: bytes) -> Optional[KV]:
        """The entry's K/V (a copy, on the CPU), or None if no tier holds it (or its disk file
        failed its checks: then it is gone)."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
            kv = self.layout.unpack(self._slot(slot))
            state = self.states.get(key)
            return kv if state is None else (*kv, state)
        if self.disk is None or key not in self.disk:
            return None
        kv = self.disk.get(key)
        if kv is None:  # refused (corrupt, truncated, another model's): recomputed instead
            self._forget(key)
        return kv

    # -- the device's evictions and promotions ---------------------------------------------
    def save(
        self,
        evicted: Sequence[Tuple[int, bytes, Hashable]],
        snapshots: Optional[Dict[bytes, int]] = None,
    ) -> None:
        """Device blocks ``(block, key, hash)`` about to be reused: copy the K/V of those no tier
        holds yet into the host tier (one gather for all), with a hybrid's state snapshot where
        ``snapshots`` names its slot (key -> slot), and report each one's tier."""
        new = [(b, k, h) for b, k, h in evicted if self.where(k) is None]
        snapshots = snapshots or {}
        for _, k, h in evicted:
            self.hash_of[k] = h
        if new and (self.host_blocks or self.disk is not None):
            tpb = self.layout.shapes[0][1]
            kv = self.read_kv([b for b, _, _ in new], 0, len(new) * tpb)
            put = self._put_host if self.host_blocks else self._put_disk  # no host tier: to disk
            for i, (_, key, _) in enumerate(new):
                entry = tuple(None if t is None else t[:, i * tpb : (i + 1) * tpb] for t in kv)
                if key in snapshots:
                    entry += (self.read_state(snapshots[key]),)
                put(key, entry)
            self.saves += len(new)
        for _, k, h in evicted:
            tier = self.where(k)
            if tier is None:
                self.hash_of.pop(k, None)
            self.on_change(h, tier or REMOVED, self.has_state(k))

    def take(self, keys: Sequence[bytes]) -> List[KV]:
        """Copies of the entries ``keys`` (a prompt's chain, in order) for a promotion, read
        before any device block is allocated for them (an allocation may evict into a full tier
        and push the chain's own entries out); stops at the first entry no tier can give (a disk
        file refused). Those taken from the host tier leave it (exclusive: the caller registers
        them on the device, whose events say so)."""
        out = []
        for key in keys:
            kv = self.get(key)
            if kv is None:
                self.load_failures += 1
                break
            out.append(kv)
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self.free_slots.append(slot)
                self.states.pop(key, None)
                if self.where(key) is None:
                    self.hash_of.pop(key, None)
        return out

    def promote(self, blocks: Sequence[int], kvs: Sequence[KV]) -> None:
        """Write entries (``take``'s) into device ``blocks``, in order, with one scatter."""
        if blocks:
            kv = tuple(
                None if kvs[0][i] is None else torch.cat([p[i] for p in kvs], 1) for i in range(4)
            )
            self.write_kv(list(blocks), 0, kv)
            self.loads += len(blocks)

    # -- the tiers' own bounds -------------------------------------------------------------
    def _slot(self, slot: int) -> torch.Tensor:
        n = self.layout.nbytes
        return self.pool[slot * n : (slot + 1) * n]

    def _put_host(self, key: bytes, kv: KV) -> None:
        if self.pool is None and self.host_blocks:
            try:
                self.pool = _pool(self.host_blocks * self.layout.nbytes, self.pinned)
            except (RuntimeError, OSError) as e:  # no memory for it: the engine goes on without
                self.host_blocks, self.free_slots, self.host_error = 0, [], f"{e}"[:300]
        if not self.host_blocks:
            if self.disk is not None:
                self._put_disk(key, kv)
            return
        if not self.free_slots and self.fresh < self.host_blocks:
            self.free_slots.append(self.fresh)
            self.fresh += 1
        if not self.free_slots:  # the least recently used entry goes to disk, or is dropped
            old, slot = self.slot_of.popitem(last=False)
            state = self.states.pop(old, None)
            if self.disk is not None and old not in self.disk:
                gone = self.layout.unpack(self._slot(slot))
                self._put_disk(old, gone if state is None else (*gone, state))
            self.free_slots.append(slot)
            tier = self.where(old)
            if tier is None:
                self._forget(old)
            elif tier == DISK:
                self.on_change(self.hash_of.get(old, old), DISK, self.disk.has_state(old))
        slot = self.free_slots.pop()
        self.layout.pack(self._slot(slot), kv[:4])
        self.slot_of[key] = slot
        if len(kv) == 5:
            self.states[key] = kv[4]

    def _put_disk(self, key: bytes, kv: KV) -> None:
        for gone in self.disk.put(key, kv):
            if gone not in self.slot_of:
                self._forget(gone)

    def _forget(self, key: bytes) -> None:
        """No tier holds ``key`` any more."""
        self.on_change(self.hash_of.pop(key, key), REMOVED, False)

    # -- what it holds ---------------------------------------------------------------------
    def usage(self) -> dict:
        """``{"host": {...}, "disk": {...}}``: blocks and bytes each tier holds (None: off)."""
        n = self.layout.nbytes
        host = (
            dict(
                blocks=len(self.slot_of),
                bytes=len(self.slot_of) * n,
                capacity_blocks=self.host_blocks,
                capacity_bytes=self.host_blocks * n,
                error=self.host_error,
                snapshots=len(self.states),
            )
            if self.host_blocks or self.host_error
            else None
        )
        return dict(host=host, disk=None if self.disk is None else self.disk.usage())

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.pool = None
