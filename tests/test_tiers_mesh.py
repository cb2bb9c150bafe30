"""The prefix cache's host and disk tiers on spawned meshes (issue #44): blocks a tp=2, pp=2 or
sp=2 engine evicts come back from the host or disk tier (promotions, cached tokens, exact greedy
tokens); a cached prefix moves from a pp=2 engine, part of it out of the tiers, into an sp=2
engine of another block size, directly and over a ``Link``; a holder whose worker died refuses
the pull and the target recomputes; and a quantized cache (int8, fp8) goes through the host and
disk tiers with its scales: byte-equal K/V and the same tokens as the same engine without
tiers."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from ringkv.engine import LLM, SamplingParams
from ringkv.parallel.control import EngineError
from tests.test_engine import tiny_engine_model, uncached_greedy
from tests.test_tiers import over_link

V = 61
N = 4
ENTRY = 2 * 4 * 2 * 8 * 4 * 2  # bytes of a 4-token fp32 block: 2 layers, 2 KV heads of 8, K and V
# and of a 4-token block of a one-byte cache: K and V, and their float16 scales per head
QUANT_ENTRY = 2 * (2 * 4 * 2 * 8 * 1 + 2 * 4 * 2 * 2)  # tokens generated per request
GREEDY = SamplingParams(temperature=0, max_tokens=N)
MESHES = {
    "tp2": dict(tp=2, block_size=4),
    "pp2": dict(pp=2, block_size=4),
    "sp2": dict(sp=2, block_size=2),  # a block-table entry holds 4 tokens, 2 on each rank
}


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model()


def prompts(k=6, n=26, seed=0):
    """``k`` prompts of ``n`` tokens, no two sharing their first token."""
    g = torch.Generator().manual_seed(seed)
    return [[j] + torch.randint(0, V, (n - 1,), generator=g).tolist() for j in range(k)]


def one_by_one(llm, ps, params=GREEDY):
    """Each prompt in a call of its own: each one's blocks evict the previous ones'."""
    return [llm.generate([p], params, use_tqdm=False)[0] for p in ps]


@pytest.mark.parametrize(
    "mesh, tier", [("tp2", "host"), ("pp2", "disk"), ("sp2", "host")], ids=lambda x: x
)
def test_evicted_prefixes_come_back_from_the_tiers(model, mesh, tier, tmp_path):
    """A pool of 12 blocks and prompts of 8: every prompt evicts the previous one's blocks to the
    host tier (``disk``: a host tier of 2 blocks, the rest to disk). The same prompts again are
    promoted back, and every greedy token equals an uncached run."""
    kw = dict(kv_host_memory=1 << 20)
    if tier == "disk":
        kw = dict(kv_host_memory=2 * ENTRY, kv_disk=str(tmp_path / "kv"))
    ps = prompts()
    want = [uncached_greedy(model, p, N) for p in ps]
    with LLM(model, num_blocks=12, timeout=60, **MESHES[mesh], **kw) as llm:
        first = one_by_one(llm, ps)
        tiers = llm.kv_cache_info()["tiers"]
        assert tiers[tier]["blocks"] > 0 and tiers["device"]["promotions"] == 0, tiers
        assert llm.cached_tokens(ps[0] + [0]) >= 24  # held off the device now
        again = one_by_one(llm, ps)
        tiers = llm.kv_cache_info()["tiers"]
        assert tiers["device"]["promotions"] > 0, tiers
        assert all(o.num_cached_tokens >= 16 for o in again), [o.num_cached_tokens for o in again]
        assert [o.token_ids for o in first] == want
        assert [o.token_ids for o in again] == want
        llm.core.blocks.check()
        assert llm.core.blocks.num_free == llm.core.blocks.num_blocks


def test_prefix_moves_from_pp2_into_sp2_out_of_the_tiers(model):
    """A pp=2 engine (block size 4) whose small pool pushed most prompts to its host tier
    exports each prompt's prefix (tier entries and device blocks in one chain) into an sp=2
    engine (block size 4 on each of 2 ranks: 8 tokens a block), directly and over a ``Link``:
    greedy tokens there equal an uncached run, with the whole imported prefix cached."""
    ps = prompts(seed=1)
    want = [uncached_greedy(model, p, N) for p in ps]
    with (
        LLM(model, pp=2, block_size=4, num_blocks=12, kv_host_memory=1 << 20, timeout=60) as a,
        LLM(model, sp=2, block_size=4, num_blocks=48, timeout=60) as b,
    ):
        assert [o.token_ids for o in one_by_one(a, ps)] == want
        where = [a.core.blocks.locate(p[:-1]) for p in ps]
        assert all(blk is None for blk, _ in where[0]), "the first prompt should be in a tier"
        mixed = [{blk is None for blk, _ in w} == {True, False} for w in where]
        assert any(mixed), "some prompt's chain should be part device, part tier"
        moved = []
        for i, p in enumerate(ps):
            free = list(a.core.blocks.ref)
            pre = a.export_prefix(p)
            assert a.core.blocks.ref == free  # its pins released
            assert pre is not None and len(pre.token_ids) == 24, pre and len(pre.token_ids)
            if i % 2:
                pre = over_link(pre)
            moved.append(b.import_prefix(pre))
        assert moved == [24] * len(ps)  # whole blocks of 8 tokens
        b.core.blocks.check()
        outs = one_by_one(b, ps)
        assert [o.token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [24] * len(ps)
        assert a.kv_cache_info()["tiers"]["device"]["promotions"] == 0  # exports promote nothing


def test_a_dead_holder_fails_the_pull_and_the_target_recomputes(model):
    """The holder's worker dies (SIGKILL) before a pull: its export raises within the timeout,
    and the target, unchanged, computes the request itself."""
    p = prompts(seed=2)[0]
    with (
        LLM(model, pp=2, block_size=4, num_blocks=16, timeout=20) as a,
        LLM(model, block_size=8, num_blocks=16) as b,
    ):
        a.generate([p], GREEDY, use_tqdm=False)
        assert a.cached_tokens(p) >= 24
        os.kill(a.core.cluster.procs[0].pid, signal.SIGKILL)
        a.core.cluster.procs[0].join(timeout=10)
        before = (b.core.blocks.num_free, list(b.core.blocks.ref), dict(b.core.blocks.by_hash))
        pins = list(a.core.blocks.ref)
        t = time.monotonic()
        with pytest.raises(EngineError, match="exited"):
            a.export_prefix(p)  # its device blocks pinned, then the gather fails
        assert time.monotonic() - t < 20, "the failed pull waited for longer than the timeout"
        assert a.core.blocks.ref == pins, "a failed export left its blocks pinned"
        a.core.blocks.check()
        assert (
            b.core.blocks.num_free,
            list(b.core.blocks.ref),
            dict(b.core.blocks.by_hash),
        ) == before
        (o,) = b.generate([p], GREEDY, use_tqdm=False)
        assert o.token_ids == uncached_greedy(model, p, N) and o.num_cached_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "kv_cache_dtype, mesh", [("int8", "tp2"), ("fp8_e4m3", "pp2")], ids=lambda x: x
)
def test_quantized_blocks_go_through_the_tiers_with_their_scales(
    model, kv_cache_dtype, mesh, tmp_path
):
    """A quantized cache whose pool evicts every prompt to a host tier of 2 blocks and on to
    disk, against the same engine configuration without tiers (the cold quantized run: it
    recomputes what it evicted): the K/V exported out of the tiers, and again once promoted,
    equal byte for byte (values and scales) what the cold engine held right after computing
    them, and greedy tokens on both passes equal the cold engine's."""
    kw = dict(num_blocks=12, kv_cache_dtype=kv_cache_dtype, timeout=60, **MESHES[mesh])
    ps = prompts(k=5, seed=3)
    want, held = [], []
    with LLM(model, **dict(kw, kv_host_memory=0)) as cold:
        assert cold.core.tiers is None
        for p in ps:  # each prompt's K/V before the next prompt evicts them
            want.append(cold.generate([p], GREEDY, use_tqdm=False)[0].token_ids)
            held.append(cold.export_prefix(p))
        assert [o.token_ids for o in one_by_one(cold, ps)] == want
    with LLM(model, **dict(kw, kv_host_memory=2 * QUANT_ENTRY, kv_disk=str(tmp_path))) as llm:
        first = one_by_one(llm, ps)
        tiers = llm.kv_cache_info()["tiers"]
        assert tiers["disk"]["blocks"] > 0, tiers
        assert llm.core.tiers.layout.nbytes == QUANT_ENTRY
        assert all(blk is None for blk, _ in llm.core.blocks.locate(ps[0]))  # all off the device
        for stage in ("in the tiers", "promoted"):
            for p, ref in zip(ps, held):
                pre = llm.export_prefix(p)
                assert pre.kv_cache_dtype == kv_cache_dtype and pre.k_scale is not None
                assert len(pre.token_ids) == len(ref.token_ids) == 24
                for name in ("k", "v", "k_scale", "v_scale"):
                    got, exp = getattr(pre, name), getattr(ref, name)
                    assert got.dtype == exp.dtype and torch.equal(
                        got.view(torch.uint8), exp.view(torch.uint8)
                    ), f"{name} differs {stage}"
            if stage == "in the tiers":
                again = one_by_one(llm, ps)
        assert llm.kv_cache_info()["tiers"]["device"]["promotions"] > 0
        assert all(o.num_cached_tokens > 0 for o in again)
        assert [o.token_ids for o in first] == want
        assert [o.token_ids for o in again] == want
