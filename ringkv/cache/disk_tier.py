"""``DiskTier``: a bounded, least-recently-used store of prefix-cache blocks in files.

The last tier of the prefix cache (device pool -> host memory -> disk): blocks evicted from the
host tier are written here and read back on a prefix hit. One entry is one logical block of a
prefix (``tokens_per_block`` tokens) with its K/V over all layers and KV heads, token-major, as
``ringkv.parallel.kvmove.KV`` = ``(k, v, k_scale, v_scale)``:

- ``k``, ``v``: ``(layers, tokens_per_block, Hkv, D)`` in the cache's storage dtype;
- ``k_scale``, ``v_scale``: ``(layers, tokens_per_block, Hkv)`` float16 for a quantized (one byte
  per element) cache, else None;
- a hybrid model's block may carry a fifth element, ``state``: the state snapshot after the block
  (``(state_elems,)`` float32, ``cache.state_pool.flatten``), stored in the same file.

Its ``key`` is the block's 32-byte chained SHA-256 (parent key, token ids, salt): the key alone
says what the block holds and for which tenant.

One file per entry, ``<key hex>.safetensors`` (never pickle): tensors ``k``, ``v`` (+ ``k_scale``,
``v_scale``) and, as JSON in the safetensors metadata, the format version, the model digest,
``kv_cache_dtype``, ``tokens_per_block``, ``(layers, Hkv, D)``, the key and each tensor's real
dtype (a dtype safetensors cannot store travels as its bytes, uint8), with a SHA-256 over that
metadata, the tensors' names, dtypes and shapes and their bytes (``checksum``).
A file is written to a temporary name and renamed, so a crash never leaves half a file under a
real name; a file that is truncated, damaged, edited or renamed is refused by ``get``. Files of
another model or format in the same directory are never read as ours, nor deleted.

Least recently used order is the files' modification times (``put`` and ``get`` set them), so a
restarted tier continues it. A full disk (or a read-only one) turns the tier off
(``enabled=False``, ``error`` says why); serving goes on without it. Thread safety: ``put``,
``get`` and ``drop`` run on the caller's thread, ``prefetch`` reads on a background thread; a
lock guards the index and the prefetched entries.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import Dict, List, Optional, Tuple

import torch

from ..kernels import quant

FORMAT = 1  # version of the file layout below
META = "ringkv_disk_tier"  # the safetensors metadata entry holding the JSON
SUFFIX = ".safetensors"
KEY_BYTES = 32
MAX_HEADER = 1 << 20  # a header longer than this is not one of ours
TMP_AGE_S = 600.0  # our temporary files older than this are leftovers of a crash

KVEntry = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


@functools.cache
def _safetensors_has(dtype: torch.dtype) -> bool:
    """Whether this safetensors stores ``dtype`` (asked once per dtype; ``cache_info`` and
    ``cache_clear`` inspect and reset the answers)."""
    from safetensors.torch import save

    try:
        save({"x": torch.empty(0, dtype=dtype)})
        return True
    except Exception:  # noqa: BLE001 - any refusal means "store the bytes"
        return False


def checksum(meta: dict, tensors: Dict[str, torch.Tensor], data: bytes) -> str:
    """SHA-256 of the metadata (canonical JSON, without the checksum), each tensor's name, dtype
    and shape, and the data section of the safetensors buffer ``data`` (the same with or
    without metadata in the header): what a disk-tier file and a KV snapshot carry."""
    (n,) = struct.unpack("<Q", data[:8])
    layout = {k: [str(t.dtype), list(t.shape)] for k, t in tensors.items()}
    h = hashlib.sha256(json.dumps([meta, layout], sort_keys=True).encode())
    h.update(memoryview(data)[8 + n :])
    return h.hexdigest()


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The dtype of ``k``/``v`` for a cache's storage format: a quantized format's
    (``"int8"``, ``"fp8_e4m3"``/``"fp8"``, ``"fp8_e5m2"``) or a torch dtype's name
    (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"uint8"``, ...)."""
    if isinstance(kv_cache_dtype, str):
        name = quant.ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        if name in quant.FORMATS:
            return quant.FORMATS[name].dtype
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            return dt
    raise ValueError(
        f"DiskTier needs the cache's storage dtype, got kv_cache_dtype={kv_cache_dtype!r}; pass "
        f"a quantized format ({', '.join(quant.FORMATS)}) or a torch dtype name such as "
        f"'float32' or 'bfloat16' (EngineCore.kv_storage), not 'auto'"
    )


def _key_of(name: str) -> Optional[bytes]:
    """The key a file name claims (``<64 hex>.safetensors``), or None."""
    if not name.endswith(SUFFIX) or len(name) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: 2 * KEY_BYTES])
    except ValueError:
        return None


def _read_meta(data: bytes) -> dict:
    """The JSON metadata of a safetensors buffer (or its first bytes); ValueError if there is
    none of ours."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or len(data) < 8 + n:
        raise ValueError("truncated or not a safetensors file")
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"][META])
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a JSON object")
    return meta


class DiskTier:
    """A directory of prefix-cache blocks, bounded to ``capacity_bytes`` of files, evicting the
    least recently used. ``shape`` is ``(layers, Hkv, D)``; an entry is
    ``(k, v, k_scale, v_scale)`` with ``k``/``v`` ``(layers, tokens_per_block, Hkv, D)`` in
    ``storage_dtype(kv_cache_dtype)`` and the scales ``(layers, tokens_per_block, Hkv)`` float16
    for a one-byte (quantized) dtype, else None. ``prefetch_blocks`` bounds the entries read
    ahead by ``prefetch`` and held in memory until ``get`` takes them."""

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        model: str,
        kv_cache_dtype: str,
        tokens_per_block: int,
        shape: tuple,
        prefetch_blocks: int = 32,
        state_elems: int = 0,
        state_dtype: str = "float32",
    ):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"DiskTier path must be a directory name, got {path!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be the model digest (a non-empty str), got {model!r}")
        if not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be an int > 0, got {tokens_per_block!r}")
        if (
            not isinstance(shape, (tuple, list))
            or len(shape) != 3
            or not all(isinstance(s, int) and s > 0 for s in shape)
        ):
            raise ValueError(f"shape must be (layers, Hkv, D), three ints > 0, got {shape!r}")
        if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0, got {prefetch_blocks!r}")
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.dtype = storage_dtype(kv_cache_dtype)
        self.quantized = self.dtype.itemsize == 1
        layers, hkv, d = shape
        self._kv_shape = [layers, tokens_per_block, hkv, d]
        self._identity = {
            "format": FORMAT,
            "model": model,
            "kv_cache_dtype": quant.ALIASES.get(kv_cache_dtype, kv_cache_dtype),
            "tokens_per_block": tokens_per_block,
            "shape": [layers, hkv, d],
        }
        if state_elems:  # a hybrid model's blocks may carry a state snapshot of this size
            self._identity["state_elems"] = state_elems
        if state_dtype != "float32":  # ... whose values are of this dtype (float32 carries them)
            self._identity["state_dtype"] = state_dtype
        # the suffix of our temporary files: which model and format they are for
        ident = json.dumps(self._identity, sort_keys=True).encode()
        self._tmp_tag = "." + hashlib.sha256(ident).hexdigest()[:12] + ".tmp"
        self.enabled = True
        self.error: Optional[str] = None
        self.nbytes = 0
        self._index: "OrderedDict[bytes, int]" = OrderedDict()  # key -> file size, LRU first
        self._stateful: set = set()  # keys whose file carries a state snapshot
        self._lock = threading.Lock()
        self._clock = 0  # last mtime set, in ns (strictly increasing: a stable LRU order)
        # prefetch: queued (key, generation), entries read ahead {key: (kv, generation)}
        self._limit = prefetch_blocks
        self._queue: deque = deque()
        self._ready: "OrderedDict[bytes, tuple]" = OrderedDict()
        self._generation = 0
        self._wake = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        try:
            os.makedirs(self.path, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(e, "opening")

    # -- the index ------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def has_state(self, key: bytes) -> bool:
        """Whether ``key``'s file carries a state snapshot (a hybrid's block)."""
        with self._lock:
            return key in self._stateful

    def keys(self) -> list:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._index)

    def usage(self) -> dict:
        with self._lock:
            return {
                "blocks": len(self._index),
                "bytes": self.nbytes,
                "capacity_bytes": self.capacity_bytes,
                "enabled": self.enabled,
                "error": self.error,
            }

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    def _ours(self, meta: dict) -> bool:
        return all(meta.get(k) == v for k, v in self._identity.items())

    def _scan(self) -> None:
        """Index the files written for this model and format, oldest first; delete the oldest
        beyond the capacity, and our own files that are broken or crash leftovers."""
        found = []
        now = time.time()
        with os.scandir(self.path) as entries:
            entries = list(entries)
        for entry in entries:
            key = _key_of(entry.name)
            if key is None:
                if entry.name.startswith(".") and entry.name.endswith(self._tmp_tag):
                    try:  # a temporary file of ours that a crash left behind
                        if now - entry.stat().st_mtime > TMP_AGE_S:
                            os.unlink(entry.path)
                    except OSError:
                        pass
                continue
            try:
                st = entry.stat()
                with open(entry.path, "rb") as f:
                    head = f.read(8)
                    if len(head) == 8:
                        head += f.read(min(struct.unpack("<Q", head)[0], MAX_HEADER))
                meta = _read_meta(head)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a file of ours: left alone
            if not self._ours(meta):
                continue
            if meta.get("key") != key.hex():  # ours, but under another key's name
                self._unlink(entry.path)
                continue
            state = isinstance(meta.get("dtypes"), dict) and "state" in meta["dtypes"]
            found.append((st.st_mtime_ns, entry.name, key, st.st_size, state))
        found.sort()
        for mtime, _, key, size, state in found:
            self._index[key] = size
            if state:
                self._stateful.add(key)
            self.nbytes += size
            self._clock = max(self._clock, mtime)
        while self.nbytes > self.capacity_bytes and self._index:
            key = next(iter(self._index))
            self._forget(key)
            self._unlink(self._file(key))

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used, in the index and in its file's mtime (restarts)."""
        with self._lock:
            if key not in self._index:
                return
            self._index.move_to_end(key)
            self._clock = max(time.time_ns(), self._clock + 1)
            ns = self._clock
        try:
            os.utime(self._file(key), ns=(ns, ns))
        except OSError:
            pass

    def _forget(self, key: bytes) -> Optional[int]:
        """Drop ``key`` from the index and the read-ahead entries (lock held); its size or None."""
        self._ready.pop(key, None)
        self._stateful.discard(key)
        size = self._index.pop(key, None)
        if size is not None:
            self.nbytes -= size
        return size

    def _disable(self, e: OSError, doing: str) -> None:
        code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
        with self._lock:
            self.enabled = False
            self.error = (
                f"disk tier {self.path!r} turned off: {doing} failed with {code} "
                f"({e.strerror or e}); serving goes on without it"
            )

    # -- entries --------------------------------------------------------------------------------
    def _check_kv(self, kv) -> KVEntry:
        if not isinstance(kv, (tuple, list)) or len(kv) not in (4, 5):
            raise TypeError("a DiskTier entry is (k, v, k_scale, v_scale[, state])")
        k, v, ks, vs = kv[:4]
        state = kv[4] if len(kv) == 5 else None
        elems = self._identity.get("state_elems", 0)
        if state is not None and (
            not isinstance(state, torch.Tensor)
            or state.dtype != torch.float32
            or tuple(state.shape) != (elems,)
        ):
            raise ValueError(f"a block's state snapshot must be ({elems},) float32")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if list(t.shape) != self._kv_shape or t.dtype != self.dtype:
                raise ValueError(
                    f"{name} is {tuple(t.shape)} {t.dtype}; this disk tier stores "
                    f"(layers, tokens_per_block, Hkv, D) = {tuple(self._kv_shape)} {self.dtype}"
                )
        scales = (ks, vs)
        if not self.quantized:
            if any(s is not None for s in scales):
                raise ValueError(f"a {self.dtype} cache has no scales: pass None")
        else:
            want = self._kv_shape[:3]
            for name, s in (("k_scale", ks), ("v_scale", vs)):
                if not isinstance(s, torch.Tensor) or list(s.shape) != want:
                    got = tuple(s.shape) if isinstance(s, torch.Tensor) else s
                    raise ValueError(
                        f"a {self.dtype} cache moves with its scales: {name} must be "
                        f"{tuple(want)} {quant.SCALE_DTYPE}, got {got}"
                    )
                if s.dtype != quant.SCALE_DTYPE:
                    raise ValueError(f"{name} must be {quant.SCALE_DTYPE}, got {s.dtype}")
        return (k, v, ks, vs) if state is None else (k, v, ks, vs, state)

    def _encode(self, key: bytes, kv: KVEntry) -> bytes:
        from safetensors.torch import save

        tensors, dtypes = {}, {}
        for name, t in zip(("k", "v", "k_scale", "v_scale", "state"), kv):
            if t is None:
                continue
            t = t.detach().to("cpu").contiguous()
            dtypes[name] = str(t.dtype).replace("torch.", "")
            tensors[name] = t if _safetensors_has(t.dtype) else t.view(torch.uint8)
        meta = dict(self._identity, key=key.hex(), dtypes=dtypes)
        meta["sha256"] = checksum(meta, tensors, save(tensors))
        return save(tensors, metadata={META: json.dumps(meta)})

    def _decode(self, key: bytes, data: bytes) -> Tuple[Optional[KVEntry], bool]:
        """``(entry, ours)``: the verified entry or None, and whether the file claims to be ours
        (this model and format), so a refused file of ours is deleted."""
        from safetensors.torch import load

        try:
            meta = _read_meta(data)
        except (ValueError, KeyError, TypeError, struct.error):
            return None, False
        if not self._ours(meta):
            return None, False
        try:
            tensors = load(data)
        except Exception:  # noqa: BLE001 - truncated or damaged: refused like any other
            return None, True
        want = meta.pop("sha256", None)
        if meta.get("key") != key.hex() or want != checksum(meta, tensors, data):
            return None, True
        names = ["k", "v", "k_scale", "v_scale"] if self.quantized else ["k", "v"]
        dtypes = meta.get("dtypes")
        if sorted(set(tensors) - {"state"}) != sorted(names) or not isinstance(dtypes, dict):
            return None, True
        state = tensors.get("state")
        elems = self._identity.get("state_elems", 0)
        if state is not None and (state.dtype != torch.float32 or list(state.shape) != [elems]):
            return None, True
        out = []
        for name in names:
            real = quant.SCALE_DTYPE if name.endswith("scale") else self.dtype
            shape = self._kv_shape if name in ("k", "v") else self._kv_shape[:3]
            t = tensors[name]
            if dtypes.get(name) != str(real).replace("torch.", ""):
                return None, True
            if t.dtype != real:  # stored as its bytes
                if t.dtype != torch.uint8 or t.dim() == 0 or t.shape[-1] % real.itemsize:
                    return None, True
                t = t.view(real)
            if list(t.shape) != shape:
                return None, True
            out.append(t)
        if not self.quantized:
            out += [None, None]
        return tuple(out) + ((state,) if state is not None else ()), True

    def _read(self, key: bytes) -> Tuple[Optional[KVEntry], bool]:
        try:
            with open(self._file(key), "rb") as f:
                data = f.read()
        except OSError:
            return None, False
        return self._decode(key, data)

    def put(self, key: bytes, kv) -> List[bytes]:
        """Store ``kv`` under ``key`` (``(k, v, k_scale, v_scale)`` as in the class docstring;
        any device, copied to the CPU). Returns the keys evicted (least recently used first;
        their files deleted) to make room. An entry already held is touched, not rewritten; one
        bigger than the capacity is not stored. A failed write (disk full, read-only,
        permissions) removes its partial file and turns the tier off (``enabled``, ``error``);
        it never raises on I/O. A wrong key or entry shape/dtype is a ``ValueError``."""
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r:.80}")
        kv = self._check_kv(kv)
        if not self.enabled:
            return []
        if key in self:
            self._touch(key)
            return []
        data = self._encode(key, kv)
        if len(data) > self.capacity_bytes:
            return []
        final = self._file(key)
        tmp = os.path.join(self.path, f".{key.hex()}.{uuid.uuid4().hex[:8]}{self._tmp_tag}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError as e:
            self._unlink(tmp)
            self._disable(e, f"writing {len(data)} bytes")
            return []
        evicted = []
        with self._lock:
            while self.nbytes + len(data) > self.capacity_bytes and self._index:
                old = next(iter(self._index))
                self._forget(old)
                evicted.append(old)
            self._clock = max(time.time_ns(), self._clock + 1)
            ns = self._clock
        for old in evicted:
            self._unlink(self._file(old))
        try:
            os.utime(tmp, ns=(ns, ns))
            os.replace(tmp, final)
        except OSError as e:
            self._unlink(tmp)
            self._disable(e, "renaming a written entry")
            return evicted
        with self._lock:
            self._index[key] = len(data)
            self.nbytes += len(data)
            if len(kv) == 5:
                self._stateful.add(key)
        return evicted

    def get(self, key: bytes) -> Optional[KVEntry]:
        """The entry under ``key`` on the CPU (prefetched or read now, verified), or None. A file
        missing, truncated, damaged, edited, renamed or of another model is refused: forgotten,
        deleted if it claims to be ours. Touches the entry (most recently used)."""
        with self._lock:
            if key not in self._index:
                return None
            ready = self._ready.pop(key, None)
        if ready is not None:
            kv = ready[0]
        else:
            kv, ours = self._read(key)
            if kv is None:
                with self._lock:
                    self._forget(key)
                if ours:
                    self._unlink(self._file(key))
                return None
        self._touch(key)
        return kv

    def drop(self, key: bytes) -> None:
        """Delete ``key``'s file and forget it (nothing happens if it is not held)."""
        with self._lock:
            held = self._forget(key) is not None
        if held:
            self._unlink(self._file(key))

    # -- read-ahead -----------------------------------------------------------------------------
    def prefetch(self, keys) -> None:
        """Read (and verify) these entries on a background thread so that a later ``get`` finds
        them in memory. Returns at once. At most ``prefetch_blocks`` entries wait for their
        ``get``: a newer ``prefetch`` pushes out the entries of older ones, and the keys of one
        call beyond the bound are left for ``get`` to read. A failed read just leaves the key to
        ``get`` (which refuses it)."""
        keys = list(keys)
        if not keys or self._limit == 0:
            return
        with self._lock:
            if self._stop:
                return
            self._generation += 1
            self._queue.extend((k, self._generation) for k in keys)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._prefetcher, name="ringkv-disk-prefetch", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()

    def _prefetcher(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    return
                key, gen = self._queue.popleft()
                if key not in self._index or key in self._ready:
                    continue
            kv, _ = self._read(key)
            if kv is None:
                continue
            with self._lock:
                if key not in self._index:  # dropped or evicted meanwhile
                    continue
                if len(self._ready) >= self._limit:
                    older = next((k for k, (_, g) in self._ready.items() if g < gen), None)
                    if older is None:
                        continue  # full of this call's entries: get() reads the rest
                    del self._ready[older]
                self._ready[key] = (kv, gen)

    def close(self) -> None:
        """Stop the read-ahead thread (within a few seconds) and drop what it read."""
        with self._lock:
            self._stop = True
            self._queue.clear()
            self._ready.clear()
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    def __repr__(self) -> str:
        return (
            f"DiskTier({self.path!r}, {len(self)} blocks, {self.nbytes}/{self.capacity_bytes} "
            f"bytes, enabled={self.enabled})"
        )
