"""The prefix cache's tiers in one engine (host memory, disk) and prefixes moved between engines:
every promoted or imported block gives the tokens of a cold run, the events say where each block
is, and bad tier files or bad prefixes are refused without changing the engine."""

import glob
import os
import threading
from datetime import timedelta

import pytest
import torch

from ringkv.cache.block_manager import DISK, HOST, REMOVED, STORED
from ringkv.engine import LLM, SamplingParams
from ringkv.engine.remote import recv_prefix, send_prefix
from ringkv.engine.snapshot import PrefixKV
from ringkv.parallel.transfer import Link
from tests.test_engine import V, tiny_engine_model, uncached_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=4)
# six 40-token prefixes (10 blocks of 4): one request needs 12 blocks, so a 24-block pool holds
# two and every new prefix evicts an older one
PREFIXES = [[(i * 7 + j) % V for i in range(40)] for j in range(6)]


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


def first_pass_then_again(llm, suffix=(3,)):
    """Every prefix once (evicting the older ones), then again: the second pass's outputs."""
    for p in PREFIXES:
        llm.generate([p + [1, 2]], GREEDY, use_tqdm=False)
    return [llm.generate([p + list(suffix)], GREEDY, use_tqdm=False)[0] for p in PREFIXES]


def test_host_tier_gives_evicted_prefixes_back_exactly(model):
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=2, kv_host_memory=1 << 20)
    events = llm.publish_kv_events()
    again = first_pass_then_again(llm)
    for p, o in zip(PREFIXES, again):
        assert o.outputs[0].token_ids == uncached_greedy(model, p + [3], 4)
        assert o.num_cached_tokens == 40  # all 10 blocks: from the device or promoted from host
    tiers = llm.kv_cache_info()["tiers"]
    assert tiers["device"]["promotions"] >= 40 and tiers["host"]["blocks"] > 0
    llm.core.blocks.check()
    # the events tell a router where each block is: a block that went to host and came back
    _, log = events.since(0)
    kinds = {}
    for _, kind, h in log:
        kinds.setdefault(h, []).append(kind)
    assert any(k[:3] == [STORED, HOST, STORED] for k in kinds.values())
    assert not any(k == REMOVED for ks in kinds.values() for k in ks)  # the host tier kept all
    # the whole index: each hash once, at its best tier
    index = dict(llm.cached_blocks())
    assert len(index) == len(llm.cached_blocks())
    assert {STORED, HOST} <= set(index.values())


def test_without_tiers_the_same_prompts_miss(model):
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=2, kv_host_memory=0)
    assert llm.core.tiers is None and llm.kv_cache_info()["tiers"]["host"] is None
    again = first_pass_then_again(llm)
    assert [o.num_cached_tokens for o in again] == [0] * len(PREFIXES)
    for p, o in zip(PREFIXES, again):
        assert o.outputs[0].token_ids == uncached_greedy(model, p + [3], 4)


def test_host_tier_default_is_as_large_as_the_device_pool(model):
    llm = LLM(model, block_size=4, num_blocks=24)
    host = llm.kv_cache_info()["tiers"]["host"]
    assert host["capacity_blocks"] == 24 and host["blocks"] == 0


def test_disk_tier_behind_a_small_host_tier(model, tmp_path):
    per_block = llm_entry_bytes(model)
    llm = LLM(
        model,
        block_size=4,
        num_blocks=24,
        max_num_seqs=2,
        kv_host_memory=4 * per_block,  # 4 blocks: the rest spill to disk
        kv_disk=str(tmp_path),
    )
    events = llm.publish_kv_events()
    again = first_pass_then_again(llm)
    for p, o in zip(PREFIXES, again):
        assert o.outputs[0].token_ids == uncached_greedy(model, p + [3], 4)
        assert o.num_cached_tokens == 40
    tiers = llm.kv_cache_info()["tiers"]
    assert tiers["host"]["blocks"] <= 4 and tiers["disk"]["blocks"] > 0 and tiers["disk"]["enabled"]
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) == tiers["disk"]["blocks"]
    _, log = events.since(0)
    assert any(kind == DISK for _, kind, _ in log)
    llm.core.blocks.check()


def llm_entry_bytes(model) -> int:
    """Bytes of one 4-token block over all layers and KV heads (float32)."""
    cfg = model.config
    return 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4


def test_a_corrupt_disk_file_is_recomputed(model, tmp_path):
    llm = LLM(
        model,
        block_size=4,
        num_blocks=24,
        max_num_seqs=2,
        kv_host_memory=0,  # every evicted block goes straight to disk
        kv_disk=str(tmp_path),
    )
    for p in PREFIXES:
        llm.generate([p + [1, 2]], GREEDY, use_tqdm=False)
    files = sorted(glob.glob(str(tmp_path / "*.safetensors")))
    assert files
    for i, f in enumerate(files):  # damage every file: flip a byte, or cut it short
        with open(f, "r+b") as fh:
            if i % 2:
                fh.truncate(os.path.getsize(f) // 2)
            else:
                fh.seek(-3, os.SEEK_END)
                b = fh.read(1)
                fh.seek(-3, os.SEEK_END)
                fh.write(bytes([b[0] ^ 0xFF]))
    out = llm.generate([PREFIXES[0] + [3]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == uncached_greedy(model, PREFIXES[0] + [3], 4)
    assert out.num_cached_tokens == 0  # its first block's file was refused: all recomputed
    assert llm.core.tiers.load_failures >= 1
    llm.core.blocks.check()


def test_tier_settings_are_checked_before_anything_starts(model, tmp_path):
    for bad, match in (
        (dict(kv_host_memory=-1), "kv_host_memory"),
        (dict(kv_host_memory=1.5), "kv_host_memory"),
        (dict(kv_disk_size=1 << 20), "needs kv_disk"),
        (dict(kv_disk=""), "kv_disk"),
        (dict(kv_disk=str(tmp_path), kv_disk_size=0), "kv_disk_size"),
    ):
        with pytest.raises(ValueError, match=match):
            LLM(model, block_size=4, num_blocks=24, **bad)


def test_salted_prefixes_stay_apart_in_the_tiers(model):
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=2, kv_host_memory=1 << 20)
    p = PREFIXES[0]
    llm.generate([p + [1]], GREEDY, use_tqdm=False, cache_salt="tenant-a")
    for q in PREFIXES[1:]:  # push tenant a's blocks out to the host tier
        llm.generate([q + [1]], GREEDY, use_tqdm=False)
    assert llm.cached_tokens(p + [3], "tenant-a") == 40
    assert llm.cached_tokens(p + [3], "tenant-b") == llm.cached_tokens(p + [3]) == 0
    other = llm.generate([p + [3]], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    same = llm.generate([p + [3]], GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    assert same.num_cached_tokens == 40
    assert same.outputs[0].token_ids == uncached_greedy(model, p + [3], 4)


# -- prefixes between engines ------------------------------------------------------------------
def over_link(pre):
    """``pre`` sent over a real ``Link`` (a thread sends) and received."""
    timeout = timedelta(seconds=30)
    errors = []

    def send(port):
        try:
            with Link.connect("127.0.0.1", port, timeout=timeout) as link:
                send_prefix(link, pre)
        except Exception as e:  # noqa: BLE001 - the receiver's assertion reports it
            errors.append(e)

    with Link.listen("127.0.0.1", 0, timeout=timeout) as lst:
        t = threading.Thread(target=send, args=(lst.port,))
        t.start()
        try:
            lst.accept()
            got = recv_prefix(lst)
        finally:
            t.join(timeout=60)
    assert not errors and not t.is_alive(), errors
    return got


def test_a_prefix_moves_between_engines_of_other_block_sizes(model):
    src = LLM(model, block_size=4, num_blocks=64)
    dst = LLM(model, block_size=8, num_blocks=64)
    p = PREFIXES[0] + PREFIXES[1][:10]  # 50 tokens
    src.generate([p], GREEDY, use_tqdm=False, cache_salt="t")
    assert src.export_prefix(p, "other") is None  # another tenant's chain: nothing to give
    prefix = src.export_prefix(p + [5], "t")
    assert len(prefix.token_ids) == 48 and prefix.k.shape[1] == 48  # whole source blocks
    free = src.core.blocks.num_free
    assert dst.import_prefix(prefix) == 48  # 6 blocks of 8
    assert src.core.blocks.num_free == free  # the holder's pins were let go
    assert dst.cached_tokens(p + [5], "t") == 48 and dst.cached_tokens(p + [5]) == 0
    out = dst.generate([p + [5]], GREEDY, use_tqdm=False, cache_salt="t")[0]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == uncached_greedy(model, p + [5], 4)
    assert dst.import_prefix(prefix) == 48  # again: it holds them, nothing new is written
    dst.core.blocks.check()
    src.core.blocks.check()


def test_a_prefix_comes_from_the_holders_tiers_too(model):
    src = LLM(model, block_size=4, num_blocks=24, max_num_seqs=2, kv_host_memory=1 << 20)
    for p in PREFIXES:  # the first prefixes are in src's host tier now
        src.generate([p + [1]], GREEDY, use_tqdm=False)
    assert src.core.blocks.locate(PREFIXES[0])[0][0] is None  # not on its device
    prefix = src.export_prefix(PREFIXES[0] + [3])
    assert len(prefix.token_ids) == 40
    dst = LLM(model, block_size=4, num_blocks=64)
    assert dst.import_prefix(prefix) == 40
    out = dst.generate([PREFIXES[0] + [3]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == uncached_greedy(model, PREFIXES[0] + [3], 4)


def test_bad_prefixes_are_refused_before_any_block_is_taken(model):
    src = LLM(model, block_size=4, num_blocks=64)
    dst = LLM(model, block_size=4, num_blocks=64)
    src.generate([PREFIXES[0]], GREEDY, use_tqdm=False)
    good = src.export_prefix(PREFIXES[0])

    def edited(**kw):
        fields = dict(vars(good))
        fields.update(kw)
        return PrefixKV(**fields)

    nan = good.k.clone()
    nan[0, 0, 0, 0] = float("nan")
    for bad, match in (
        (edited(model="0" * 16), "another model"),
        (edited(kv_cache_dtype="int8"), "int8"),
        (edited(k=good.k[:, :-1]), "'k'"),
        (edited(v=good.v.to(torch.float16)), "'v'"),
        (edited(k=nan), "inf or NaN"),
        (edited(token_ids=good.token_ids[:-1] + [V]), "token_ids"),
        (edited(cache_salt=7), "cache_salt"),
        (edited(k_scale=torch.zeros(1)), "k_scale"),
    ):
        with pytest.raises(ValueError, match=match):
            dst.import_prefix(bad)
        assert dst.core.blocks.num_free == 64 and not dst.core.blocks.by_hash
    with pytest.raises(TypeError):
        dst.import_prefix({"k": good.k})
    dst.core.blocks.check()


def test_a_prefix_larger_than_the_free_blocks_is_imported_in_part(model):
    src = LLM(model, block_size=4, num_blocks=64)
    dst = LLM(model, block_size=4, num_blocks=24)
    p = PREFIXES[0] + PREFIXES[1]  # 80 tokens: 20 blocks
    src.generate([p], GREEDY, use_tqdm=False)
    held = dst.core.blocks.allocate(12)  # in use by others: 12 blocks free
    assert dst.import_prefix(src.export_prefix(p)) == 12 * 4
    dst.core.blocks.free(held)
    out = dst.generate([p], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 12 * 4
    assert out.outputs[0].token_ids == uncached_greedy(model, p, 4)
    dst.core.blocks.check()


def test_a_host_tier_the_host_cannot_hold_turns_itself_off(model):
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=2, kv_host_memory=1 << 62)
    again = first_pass_then_again(llm)  # the first eviction tries to map 4 EiB: refused
    for p, o in zip(PREFIXES, again):
        assert o.outputs[0].token_ids == uncached_greedy(model, p + [3], 4)
    host = llm.kv_cache_info()["tiers"]["host"]
    assert host["capacity_blocks"] == 0 and host["error"]
    llm.core.blocks.check()


def test_the_default_host_tier_leaves_the_host_half_its_memory():
    from ringkv.cache.tiers import default_host_bytes

    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:")) * 1024
    assert default_host_bytes(1 << 20) == 1 << 20
    assert avail // 4 <= default_host_bytes(1 << 60) <= avail // 2 + (1 << 30)
