"""DiskTier (ringkv/cache/disk_tier.py): real files in a temporary directory; a real tmpfs for the
full disk."""

import hashlib
import json
import os
import struct
import subprocess
import tempfile
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringkv.cache.disk_tier import DiskTier, storage_dtype

LAYERS, TPB, HKV, D = 2, 4, 2, 8
SHAPE = (LAYERS, HKV, D)


def key(i, salt="") -> bytes:
    return hashlib.sha256(f"block {i} {salt}".encode()).digest()


def entry(i, kv_cache_dtype="float32", tpb=TPB):
    """A deterministic entry for block ``i``: random values (random bytes for one-byte dtypes)."""
    g = torch.Generator().manual_seed(1000 + i)
    dt = storage_dtype(kv_cache_dtype)
    shape = (LAYERS, tpb, HKV, D)
    if dt.itemsize == 1:
        k, v = (torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dt) for _ in "kv")
        ks, vs = (torch.rand(shape[:3], generator=g).to(torch.float16) for _ in "kv")
        return k, v, ks, vs
    return (
        torch.randn(shape, generator=g).to(dt),
        torch.randn(shape, generator=g).to(dt),
        None,
        None,
    )


def same(a, b) -> bool:
    """Bit-exact equality of two entries (bytes compared, so NaN patterns count too)."""
    if a is None or b is None:
        return a is b
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None:
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            xb, yb = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            if not torch.equal(xb, yb):
                return False
    return True


def tier(path, capacity=1 << 20, *, model="m1", kv_cache_dtype="float32", tpb=TPB, shape=SHAPE):
    return DiskTier(
        str(path),
        capacity,
        model=model,
        kv_cache_dtype=kv_cache_dtype,
        tokens_per_block=tpb,
        shape=shape,
    )


def files(path):
    return sorted(n for n in os.listdir(path))


def entry_size(path, **kw) -> int:
    """The file size of one entry of this format (every entry of a format has the same)."""
    t = tier(os.path.join(path, "probe"), **kw)
    t.put(key(-1), entry(-1, kw.get("kv_cache_dtype", "float32")))
    return t.nbytes


@pytest.mark.parametrize(
    "dt", ["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8", "fp8_e5m2", "uint8"]
)
def test_round_trip_bit_exact(tmp_path, dt):
    t = tier(tmp_path, kv_cache_dtype=dt)
    kvs = {i: entry(i, dt) for i in range(3)}
    for i, kv in kvs.items():
        assert t.put(key(i), kv) == []
    assert len(t) == 3 and t.nbytes == sum(os.path.getsize(tmp_path / f) for f in files(tmp_path))
    for i, kv in kvs.items():
        got = t.get(key(i))
        assert same(got, kv), dt
        assert (got[2] is None) == (storage_dtype(dt).itemsize != 1)
    assert t.get(key(99)) is None
    assert files(tmp_path) == sorted(key(i).hex() + ".safetensors" for i in range(3))
    # never pickle: the files are safetensors with our JSON in the metadata
    raw = (tmp_path / files(tmp_path)[0]).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["ringkv_disk_tier"])
    assert meta["model"] == "m1" and meta["tokens_per_block"] == TPB and len(meta["sha256"]) == 64


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="storage dtype"):
        tier(tmp_path, kv_cache_dtype="auto")
    t = tier(tmp_path)
    k, v, _, _ = entry(0)
    with pytest.raises(ValueError, match="tokens_per_block"):
        t.put(key(0), (k[:, :2], v[:, :2], None, None))
    with pytest.raises(ValueError, match="float32"):
        t.put(key(0), (k.half(), v.half(), None, None))
    with pytest.raises(ValueError, match="32 bytes"):
        t.put(b"short", entry(0))
    q = tier(tmp_path / "q", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="scales"):
        q.put(key(0), entry(0, "int8")[:2] + (None, None))
    assert len(t) == 0 and len(q) == 0


def test_lru_bound_and_touch(tmp_path):
    size = entry_size(tmp_path)
    d = tmp_path / "tier"
    t = tier(d, 3 * size + size // 2)
    assert [t.put(key(i), entry(i)) for i in range(5)] == [[], [], [], [key(0)], [key(1)]]
    assert t.keys() == [key(2), key(3), key(4)]
    assert t.nbytes == 3 * size <= t.capacity_bytes
    assert files(d) == sorted(key(i).hex() + ".safetensors" for i in (2, 3, 4))
    assert key(0) not in t and t.get(key(0)) is None
    # get() touches: 2 survives the next eviction, 3 goes
    assert same(t.get(key(2)), entry(2))
    assert t.put(key(5), entry(5)) == [key(3)]
    assert t.keys() == [key(4), key(2), key(5)]
    # putting a held key touches it, writes nothing, evicts nothing
    assert t.put(key(4), entry(4)) == []
    assert t.keys() == [key(2), key(5), key(4)]
    # an entry bigger than the capacity is not stored
    small = tier(tmp_path / "small", size - 1)
    assert small.put(key(0), entry(0)) == [] and len(small) == 0 and small.nbytes == 0
    assert t.usage() == {
        "blocks": 3,
        "bytes": 3 * size,
        "capacity_bytes": 3 * size + size // 2,
        "enabled": True,
        "error": None,
    }


def test_restart_indexes_own_files_only(tmp_path):
    size = entry_size(tmp_path)
    d = tmp_path / "tier"
    t = tier(d, 10 * size)
    for i in range(4):
        t.put(key(i), entry(i))
    t.get(key(0))  # most recently used now
    t.close()
    again = tier(d, 10 * size)
    assert again.keys() == [key(1), key(2), key(3), key(0)]
    assert again.nbytes == 4 * size
    assert all(same(again.get(key(i)), entry(i)) for i in range(4))
    assert again.keys() == [key(i) for i in range(4)]  # touched by those gets
    before = files(d)
    # another model digest, dtype, block size or shape: indexes none, deletes none, even when it
    # is over its capacity and evicting its own entries
    for kw in (
        {"model": "m2"},
        {"kv_cache_dtype": "bfloat16"},
        {"tpb": 8},
        {"shape": (LAYERS, HKV, 2 * D)},
    ):
        other = tier(d, 0, **kw)
        assert len(other) == 0 and other.nbytes == 0 and files(d) == before, kw
    m2 = tier(d, size, model="m2")
    m2.put(key(10), entry(10))
    assert m2.put(key(11), entry(11)) == [key(10)]
    assert m2.keys() == [key(11)]
    assert files(d) == sorted(before + [key(11).hex() + ".safetensors"])
    mine = tier(d, 10 * size)
    assert mine.keys() == [key(i) for i in range(4)] and key(11) not in mine
    # over capacity at restart: the oldest are deleted
    two = tier(d, 2 * size)
    assert two.keys() == [key(2), key(3)]
    assert not (d / (key(0).hex() + ".safetensors")).exists()
    assert (d / (key(11).hex() + ".safetensors")).exists()  # m2's


def test_restart_removes_own_crash_leftovers_only(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), entry(0))
    ours = tmp_path / f".{key(1).hex()}.deadbeef{t._tmp_tag}"
    theirs = tmp_path / f".{key(1).hex()}.deadbeef.0123456789ab.tmp"
    fresh = tmp_path / f".{key(2).hex()}.deadbeef{t._tmp_tag}"
    for p in (ours, theirs, fresh):
        p.write_bytes(b"half a file")
    old = time.time() - 3600
    os.utime(ours, (old, old))
    os.utime(theirs, (old, old))
    tier(tmp_path)
    assert not ours.exists() and theirs.exists() and fresh.exists()


def _flip_data(p):
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x40
    p.write_bytes(bytes(raw))


def _truncate(p):
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) - 100])


def _edit_meta(p):
    """Rewrite the header with one more metadata field, everything else unchanged."""
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["ringkv_disk_tier"])
    meta["tokens_per_block"] = TPB  # unchanged identity ...
    meta["note"] = "edited"  # ... but the metadata differs from what the checksum covers
    header["__metadata__"]["ringkv_disk_tier"] = json.dumps(meta)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    p.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


def _header_garbage(p):
    raw = bytearray(p.read_bytes())
    raw[10] = ord("}")
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_flip_data, _truncate, _edit_meta, _header_garbage])
def test_corrupt_file_is_refused(tmp_path, damage):
    t = tier(tmp_path)
    for i in range(3):
        t.put(key(i), entry(i))
    p = tmp_path / (key(1).hex() + ".safetensors")
    damage(p)
    assert t.get(key(1)) is None
    assert key(1) not in t and t.keys() == [key(0), key(2)]
    assert t.nbytes == sum(
        os.path.getsize(tmp_path / (key(i).hex() + ".safetensors")) for i in (0, 2)
    )
    # a file that still claims to be ours is deleted; one whose header is garbage is left alone
    assert p.exists() == (damage is _header_garbage)
    assert same(t.get(key(0)), entry(0)) and same(t.get(key(2)), entry(2))
    # a restarted tier does not index the damaged file
    assert key(1) not in tier(tmp_path)


def test_renamed_and_foreign_files_are_refused(tmp_path):
    t = tier(tmp_path)
    for i in range(3):
        t.put(key(i), entry(i))
    a, b = (tmp_path / (key(i).hex() + ".safetensors") for i in (0, 1))
    os.replace(a, b)  # block 0's file under block 1's name
    assert t.get(key(1)) is None and key(1) not in t and not b.exists()
    assert t.get(key(0)) is None and key(0) not in t  # its file is gone
    # another model's file under one of our names: refused, forgotten, not deleted
    other = tier(tmp_path / "other", model="m2")
    other.put(key(2), entry(2))
    c = tmp_path / (key(2).hex() + ".safetensors")
    os.replace(tmp_path / "other" / c.name, c)
    assert t.get(key(2)) is None and len(t) == 0 and t.nbytes == 0 and c.exists()


def _can_mount(d) -> str:
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True, text=True
    )
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def test_full_disk_turns_the_tier_off(tmp_path):
    d = tmp_path / "mnt"
    d.mkdir()
    why = _can_mount(d)
    if why:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {why}")
    try:
        shape, tpb = (4, 2, 64), 32  # 64 KiB of k and v a block: four fit in 256 KiB
        t = tier(d, 1 << 30, tpb=tpb, shape=shape)

        def kv(i):
            g = torch.Generator().manual_seed(i)
            return tuple(torch.randn(4, tpb, 2, 64, generator=g) for _ in "kv") + (None, None)

        written = []
        for i in range(20):
            assert t.put(key(i), kv(i)) == []
            if not t.enabled:
                break
            written.append(i)
        assert not t.enabled and 1 <= len(written) < 20
        assert "ENOSPC" in t.error and str(d) in t.error
        assert t.usage()["enabled"] is False and t.usage()["error"] == t.error
        assert t.put(key(50), kv(50)) == [] and key(50) not in t
        # no partial file left; what was written before is still served
        assert files(d) == sorted(key(i).hex() + ".safetensors" for i in written)
        assert t.keys() == [key(i) for i in written]
        assert all(same(t.get(key(i)), kv(i)) for i in written)
    finally:
        subprocess.run(["umount", str(d)], check=True)


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_prefetch(tmp_path):
    t = tier(tmp_path, kv_cache_dtype="int8")
    for i in range(6):
        t.put(key(i), entry(i, "int8"))
    t.close()
    _flip_data(tmp_path / (key(5).hex() + ".safetensors"))
    fresh = tier(tmp_path, kv_cache_dtype="int8")
    fresh.prefetch([key(i) for i in range(6)] + [key(99)])
    _wait(lambda: len(fresh._ready) == 5)
    assert sorted(fresh._ready) == sorted(key(i) for i in range(5))
    # served from memory: their files may go now
    for i in range(5):
        os.unlink(tmp_path / (key(i).hex() + ".safetensors"))
    assert all(same(fresh.get(key(i)), entry(i, "int8")) for i in range(5))
    assert fresh.keys()[-5:] == [key(i) for i in range(5)]  # touched
    assert fresh.get(key(5)) is None and key(5) not in fresh  # the damaged one: refused by get
    # a dropped key's read-ahead is forgotten
    fresh.put(key(7), entry(7, "int8"))
    fresh.prefetch([key(7)])
    _wait(lambda: key(7) in fresh._ready)
    fresh.drop(key(7))
    assert fresh.get(key(7)) is None and not fresh._ready
    fresh.close()
    assert fresh._thread is not None and not fresh._thread.is_alive()


def test_prefetch_is_bounded(tmp_path):
    t = DiskTier(
        str(tmp_path),
        1 << 20,
        model="m1",
        kv_cache_dtype="float32",
        tokens_per_block=TPB,
        shape=SHAPE,
        prefetch_blocks=3,
    )
    for i in range(8):
        t.put(key(i), entry(i))
    t.prefetch([key(i) for i in range(5)])
    _wait(lambda: not t._queue and len(t._ready) == 3)
    time.sleep(0.05)
    assert list(t._ready) == [key(0), key(1), key(2)]  # the first of one call are kept
    t.prefetch([key(6), key(7)])  # a newer call pushes out the oldest
    _wait(lambda: key(7) in t._ready)
    assert list(t._ready) == [key(2), key(6), key(7)]
    assert all(same(t.get(key(i)), entry(i)) for i in range(8))  # the rest read by get()
    t.close()


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "put", "get", "drop"]), st.integers(0, 5)), max_size=25
)


@settings(max_examples=20, deadline=None)
@given(ops=OPS, blocks=st.integers(0, 4), extra=st.floats(0, 0.99))
def test_matches_a_dict_model(ops, blocks, extra):
    with tempfile.TemporaryDirectory() as d:
        size = entry_size(d)
        capacity = int((blocks + extra) * size)
        path = os.path.join(d, "tier")
        t = tier(path, capacity)
        model = OrderedDict()  # key -> None, least recently used first
        for op, i in ops:
            k = key(i)
            if op == "put":
                want = []
                if k in model:
                    model.move_to_end(k)
                elif size <= capacity:
                    while (len(model) + 1) * size > capacity:
                        want.append(model.popitem(last=False)[0])
                    model[k] = None
                assert t.put(k, entry(i)) == want
            elif op == "get":
                got = t.get(k)
                if k in model:
                    model.move_to_end(k)
                    assert same(got, entry(i))
                else:
                    assert got is None
            else:
                t.drop(k)
                model.pop(k, None)
            assert t.keys() == list(model)
            assert t.nbytes == len(model) * size <= capacity
            assert files(path) == sorted(x.hex() + ".safetensors" for x in model)
        assert tier(path, capacity).keys() == list(model)  # the order survives a restart


def test_reads_a_dtype_stored_as_bytes(tmp_path):
    """A dtype this safetensors could not store travels as uint8 with its real dtype in the
    metadata: a file written that way (by hand here) reads back as the real dtype."""
    from safetensors.torch import save

    from ringkv.cache.disk_tier import checksum

    t = tier(tmp_path, kv_cache_dtype="fp8_e4m3")
    kv = entry(3, "fp8_e4m3")
    tensors = {"k": kv[0].view(torch.uint8), "v": kv[1].view(torch.uint8)}
    tensors.update(k_scale=kv[2], v_scale=kv[3])
    meta = dict(t._identity, key=key(3).hex())
    meta["dtypes"] = dict(
        k="float8_e4m3fn", v="float8_e4m3fn", k_scale="float16", v_scale="float16"
    )
    meta["sha256"] = checksum(meta, tensors, save(tensors))
    data = save(tensors, metadata={"ringkv_disk_tier": json.dumps(meta)})
    (tmp_path / (key(3).hex() + ".safetensors")).write_bytes(data)
    again = tier(tmp_path, kv_cache_dtype="fp8_e4m3")
    assert again.keys() == [key(3)]
    got = again.get(key(3))
    assert got[0].dtype == torch.float8_e4m3fn and same(got, kv)
