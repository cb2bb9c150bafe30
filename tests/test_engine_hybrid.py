"""The engine serves hybrid models (attention beside short convolutions, Mamba2 or gated DeltaNet
layers): greedy tokens and prompt log-probs equal transformers' on every mesh it runs (one
process, pp=2, sp=2, pp=2 x sp=2, real gloo ranks), with chunked prefill carrying the state from
chunk to chunk, continuous batching of rows whose states live in different slots, preemption, and
exact prefix caching from state snapshots: a hit gives an uncached run's tokens and log-probs, and
reads the snapshot (spoiling it changes the output). What the engine cannot run for a hybrid is
refused up front, naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("transformers")

from ringkv.engine import LLM, SamplingParams  # noqa: E402
from ringkv.engine.snapshot import KVSnapshot  # noqa: E402
from tests.engine_cases import model_from  # noqa: E402
from tests.models import hf_greedy  # noqa: E402
from tests.test_tiers import over_link  # noqa: E402

# conv, GDN, GDN + MoE, Mamba2, Mamba2 + MLP blocks, Mamba2 + MoE with Granite's multipliers
FAMILIES = ["lfm2", "qwen3_5", "qwen3_next", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1"]
N_OUT = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT)
_refs = {}


def spec(family, seed=0):
    return ("hybrid", family, seed, {})


def prompts_for(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 29)]
    return ps + [ps[2][:36] + [9, 11], ps[4][:24] + [5]]  # shared prefixes: snapshot hits


def reference(s, prompts):
    """transformers' greedy tokens and its first prompt's log-probs (cached per spec)."""
    key = (repr(s), repr(prompts))
    if key not in _refs:
        model = model_from(s)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompts[2]])).logits[0].float(), -1)
        lp = logp[:-1].gather(1, torch.tensor(prompts[2][1:])[:, None])[:, 0]
        _refs[key] = hf_greedy(model, prompts, N_OUT), lp
    return _refs[key]


ENGINE = dict(block_size=4, num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pp,sp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_greedy_and_prompt_logprobs_equal_transformers_on_a_mesh(worlds, family, pp, sp):
    """Every family on every mesh: 16-token chunks (a 40-token prompt's state crosses three steps),
    up to 4 sequences batched, a second round that resumes from snapshots; the prompt log-probs
    against transformers' forward."""
    s, prompts = spec(family), prompts_for(1)
    want, want_lp = reference(s, prompts)
    # sp=2: chunks of 4+ tokens are spread (ring attention, state passing), shorter replicated
    kw = dict(ENGINE, pp=pp, sp=sp, state_checkpoint_blocks=2, sp_prefill_min_tokens=4)
    res = worlds(pp * sp).check(
        "tests.engine_cases:hybrid_rounds", pp * sp, s, kw, prompts, GREEDY, prompts[2], timeout=300
    )
    for r in res:
        assert r["tokens"] == [want, want]
    driver = res[0]
    tpb = 4 * sp  # every prompt resumes from the snapshot at its own last whole block
    assert driver["cached"][1] == [(len(p) - 1) // tpb * tpb for p in prompts]
    assert driver["info"]["state"]["restored"] > 0
    assert driver["free_slots"] == ENGINE["max_num_seqs"]  # every slot back
    got = torch.tensor([x for x in driver["logprobs"] if x is not None])
    torch.testing.assert_close(got, want_lp, atol=2e-4, rtol=1e-4)


def _llm(family, **kw):
    return LLM(model_from(spec(family)), **dict(ENGINE, **kw))


def _run(llm, prompts, params):
    """Tokens, their log-probs and the cached tokens of each prompt."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    lps = [[x.logprob for x in o.logprobs] if o.logprobs else None for o in outs]
    return [o.token_ids for o in outs], lps, [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_is_exact_and_reads_the_snapshot(family):
    """A prompt resuming from a snapshot gives the tokens and sampled log-probs of an uncached
    engine; with the snapshot spoiled (noise written on the rank) the same hit gives other
    log-probs: the
    state really comes from it, not from a recomputation behind a reported hit."""
    base = prompts_for(2)[2]  # 40 tokens
    first, later = base[:30] + [7, 8], base + [3, 4, 5]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    with _llm(family, enable_prefix_caching=False) as cold:
        want = _run(cold, [later], params)
    with _llm(family, state_checkpoint_blocks=2) as llm:
        _run(llm, [first], params)  # snapshots at 8, 16, 24, 32 and its prompt's end, 28
        assert llm.core.cached_tokens(later) == 28  # what a router asks
        got = _run(llm, [later], params)
        assert got[2] == [28] and got[0] == want[0]
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-5, rtol=0)
        pool = llm.core.cluster.worker.states
        snapshots = range(pool.slots - llm.core.blocks.states.snapshots, pool.slots)
        for tensors in pool.layers.values():
            for t in tensors:
                t[snapshots.start :].normal_(0, 3)
        spoiled = _run(llm, [later], params)
        assert spoiled[2] == [40]  # from the snapshot the second run saved at 40, now noise
        assert (torch.tensor(spoiled[1]) - torch.tensor(got[1])).abs().max() > 1e-3


def test_requests_arriving_together_share_one_snapshot_of_their_common_prefix():
    """A prompt computed once, then three arriving together that share its first 24 tokens and no
    snapshot there (no periodic checkpoint within reach): the first of them computes the shared
    part and snapshots it where the match ended; the other two wait a step and resume from it,
    with transformers' tokens."""
    base = prompts_for(10)[2][:24]
    prompts = [base + [5, 6, 7, 8, 9, 10]] + [base + [11 + i] * 5 for i in range(3)]
    want, _ = reference(spec("lfm2"), prompts)
    with _llm("lfm2", state_checkpoint_blocks=50) as llm:
        _run(llm, prompts[:1], GREEDY)
        got, _, cached = _run(llm, prompts[1:], GREEDY)
    assert got == [hf_greedy(model_from(spec("lfm2")), [p], N_OUT)[0] for p in prompts[1:]]
    assert cached == [0, 24, 24]


@pytest.mark.parametrize("family", ["lfm2", "bamba"])
def test_preemption_and_aborts_give_every_slot_back(family):
    """A cache too small for every sequence at once preempts (states dropped, recomputed or resumed
    from snapshots) and still gives transformers' tokens; aborted requests give their slots back."""
    prompts = prompts_for(3)
    want, _ = reference(spec(family), prompts)
    with _llm(family, num_blocks=16, state_checkpoint_blocks=1) as llm:
        got = _run(llm, prompts, GREEDY)[0]
        assert got == want and llm.num_preemptions > 0
        for p in prompts[:3]:
            llm.add_request(p, SamplingParams(max_tokens=50, temperature=0))
        llm.step()
        llm.step()
        for rid in list(llm.core.pipeline.active):
            llm.abort_request(rid)
        states = llm.core.blocks.states
        assert len(states.free_running) == states.running and not states.pending
        llm.core.blocks.check()


def router_index(llm):
    """A router's ``Instance`` of ``llm`` fed its whole KV event log, the blocks' and the
    snapshots' apart (as ``GET /internal/state`` carries them); checked equal to the whole index
    a router re-reads (``cached_blocks``, ``cached_snapshots``) and to where the engine holds each
    snapshot."""
    from ringkv.cache.block_manager import SNAPSHOT
    from ringkv.serve.policy import Instance, index

    _, log = llm.kv_events.since(0)
    assert all(e[3] == SNAPSHOT for e in log if len(e) == 4)
    inst = Instance("x", "", tokens_per_block=llm.core.blocks.block_size, snapshots={})
    index(inst.blocks, [[e[1], e[2].hex()] for e in log if len(e) == 3])
    index(inst.snapshots, [[e[1], e[2].hex()] for e in log if len(e) == 4])
    assert inst.blocks == {h.hex(): t for h, t in llm.cached_blocks()}
    held = {h.hex(): t for h, t in llm.core.blocks.snapshots()}
    assert inst.snapshots == {h.hex(): t for h, t in llm.cached_snapshots()} == held
    return inst


@pytest.mark.parametrize("tier", ["host", "disk", "spill"])
def test_snapshots_leave_the_device_with_their_blocks_and_come_back(tier, tmp_path):
    """A device pool too small to keep a prompt's blocks: they go to the host tier (or, with no
    host tier, to checksummed disk files; or through a host tier of two blocks on to disk) with
    the snapshots they end, and a later prompt sharing the prefix is promoted from there,
    resuming from a snapshot with the uncached tokens. The KV events follow each snapshot there
    and back, and a router's index of them scores the prompt by the tokens it resumes from, as
    ``cached_tokens`` counts them."""
    from ringkv.cache.block_manager import DISK, HOST, STORED
    from ringkv.serve.policy import RoutingPolicy

    base = prompts_for(7)[2]  # 40 tokens
    later = base + [3, 4]
    params = SamplingParams(temperature=0, max_tokens=4)
    with _llm("qwen3_5", enable_prefix_caching=False) as cold:
        want = _run(cold, [later], params)[0]
    host = {"host": 1 << 20, "disk": 0, "spill": 2 * 1024}[tier]  # a block's K/V: 1 KiB
    kw = dict(kv_host_memory=host, kv_disk=None if tier == "host" else str(tmp_path))
    with _llm("qwen3_5", num_blocks=16, state_checkpoint_blocks=2, **kw) as llm:
        llm.publish_kv_events()
        _run(llm, [base], params)
        others = [[(7 * i + j) % 120 + 3 for j in range(40)] for i in range(1, 4)]
        _run(llm, others, params)  # evicts base's blocks, snapshots with them
        usage = llm.kv_cache_info()["tiers"]
        assert usage["host"]["snapshots"] > 0 if tier == "host" else usage["disk"]["blocks"] > 0
        inst, router = router_index(llm), RoutingPolicy()
        last = router.chain(inst, later, None, {})[9]  # the block ending at token 40
        assert inst.snapshots[last] == {"host": HOST, "disk": DISK}.get(tier, inst.blocks[last])
        assert router.cached_tokens(inst, later, None, {}) == llm.cached_tokens(later) == 40
        prefix = llm.export_prefix(base)  # what a peer pulls: its snapshot comes from the tier
        with _llm("qwen3_5") as dst:
            assert dst.import_prefix(prefix) == 40
            got, _, cached = _run(dst, [later], params)
        assert got == want and cached == [40]
        got, _, cached = _run(llm, [later], params)
        assert got == want and cached == [40] and llm.core.blocks.promotions > 0
        inst = router_index(llm)
        assert inst.snapshots[last] == STORED
        assert router.cached_tokens(inst, later, None, {}) == llm.cached_tokens(later) == 40
        llm.core.blocks.check()


def test_paused_requests_holding_every_slot_give_one_back_to_a_new_request():
    """Every running slot held by requests stopped by an export: a new request takes one back
    (the oldest paused request loses its blocks and slot, and is recomputed when resumed), so
    nothing hangs and every request ends with transformers' tokens."""
    prompts = prompts_for(8)
    want, _ = reference(spec("lfm2"), prompts)
    params = SamplingParams(temperature=0, max_tokens=N_OUT)
    with _llm("lfm2", max_num_seqs=2) as llm:
        held = [llm.add_request(p, params) for p in prompts[:2]]
        llm.step()
        for rid in held:
            llm.export_request(rid)
        fresh = llm.add_request(prompts[2], params)
        assert _finish(llm, fresh) == want[2]
        for rid, w in zip(held, want):
            llm.resume_request(rid)
            assert _finish(llm, rid) == w


_greedy_refs: dict = {}


def _greedy(family: str, prompt: list) -> list:
    key = (family, tuple(prompt))
    if key not in _greedy_refs:
        _greedy_refs[key] = hf_greedy(_models(family), [prompt], 6)[0]
    return _greedy_refs[key]


_built: dict = {}


def _models(family: str):
    if family not in _built:
        _built[family] = model_from(spec(family))
    return _built[family]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["lfm2", "qwen3_5", "bamba"]),
    block_size=st.integers(1, 4),
    budget=st.sampled_from([3, 8, 16, 64]),
    every=st.integers(1, 3),
    seqs=st.sampled_from([1, 2, 4]),
    tight=st.booleans(),
    data=st.data(),
)
def test_any_schedule_gives_transformers_tokens(
    family, block_size, budget, every, seqs, tight, data
):
    """Over drawn block sizes, chunk budgets, checkpoint intervals, batch sizes and cache sizes
    (tight ones preempt), prompts sharing drawn prefixes of one base prompt, run twice (the second
    time from snapshots): every output equals transformers' greedy tokens, the block manager's
    invariants hold and every state slot is back."""
    base = data.draw(st.lists(st.integers(3, 127), min_size=8, max_size=40))
    cuts = data.draw(st.lists(st.integers(1, len(base)), min_size=1, max_size=3))
    prompts = [base] + [base[:c] + [c % 120 + 3] for c in cuts]
    longest = max(map(len, prompts)) + 6
    blocks = -(-longest // block_size) * (1 if tight else 4) + 1
    params = SamplingParams(temperature=0, max_tokens=6)
    kw = dict(block_size=block_size, num_blocks=blocks, max_num_batched_tokens=budget)
    kw.update(max_num_seqs=seqs, state_checkpoint_blocks=every, max_model_len=longest + 1)
    with LLM(_models(family), **kw) as llm:
        for _ in range(2):
            got = _run(llm, prompts, params)[0]
            assert got == [_greedy(family, p) for p in prompts]
        llm.core.blocks.check()
        states = llm.core.blocks.states
        assert len(states.free_running) == states.running and not states.pending


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["lfm2", "qwen3_5", "bamba"]),
    sp=st.sampled_from([2, 3]),
    block_size=st.integers(1, 3),
    budget=st.sampled_from([5, 8, 16, 64]),
    spread=st.sampled_from([2, 3, 6]),
    every=st.integers(1, 3),
    data=st.data(),
)
def test_spread_prefill_gives_transformers_tokens_on_any_schedule(
    worlds, family, sp, block_size, budget, spread, every, data
):
    """SP prefill of a hybrid over drawn SP sizes, chunk budgets, spread thresholds (chunks this
    long split over the ranks: zigzag rows, ring attention, state passing; shorter ones
    replicated), block sizes and checkpoint intervals (snapshots saved inside spread chunks),
    prompts sharing prefixes, run twice (the second from snapshots): greedy tokens equal
    transformers' on every rank and every state slot comes back."""
    base = data.draw(st.lists(st.integers(3, 127), min_size=8, max_size=40))
    cuts = data.draw(st.lists(st.integers(1, len(base)), min_size=1, max_size=2))
    prompts = [base] + [base[:c] + [c % 120 + 3] for c in cuts]
    kw = dict(block_size=block_size, num_blocks=160, max_num_batched_tokens=budget, sp=sp)
    kw.update(max_num_seqs=3, state_checkpoint_blocks=every, sp_prefill_min_tokens=spread)
    params = SamplingParams(temperature=0, max_tokens=6)
    res = worlds(sp).check(
        "tests.engine_cases:hybrid_rounds", sp, spec(family), kw, prompts, params, base[:8]
    )
    want = [_greedy(family, p) for p in prompts]
    for r in res:
        assert r["tokens"] == [want, want]
    assert res[0]["free_slots"] == 3


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_holds_the_attention_layers_and_the_state_stays_float32(name):
    """``kv_cache_dtype`` applies to the attention layers' K/V (a byte per value and the scales);
    the recurrent state stays float32, the same bytes as unquantized. Prompt log-probs stay
    within the format's error of the float32 engine's, and snapshot hits repeat the first
    round's tokens."""
    prompts = prompts_for(9)
    lp_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with _llm("qwen3_5") as plain:
        want = torch.tensor(
            plain.generate([prompts[2]], lp_params, use_tqdm=False)[0].prompt_logprobs[1:]
        )
        full = plain.kv_cache_info()
    with _llm("qwen3_5", kv_cache_dtype=name, state_checkpoint_blocks=2) as llm:
        info = llm.kv_cache_info()
        assert info["bytes_per_token"] < full["bytes_per_token"] // 3
        assert info["state"]["bytes_per_sequence"] == full["state"]["bytes_per_sequence"]
        assert llm.core.cluster.worker.states.layers[0][1].dtype == torch.float32
        got = llm.generate([prompts[2]], lp_params, use_tqdm=False)[0].prompt_logprobs[1:]
        torch.testing.assert_close(torch.tensor(got), want, atol=0.1, rtol=0.05)
        first = _run(llm, prompts, GREEDY)
        again = _run(llm, prompts, GREEDY)
        assert again[0] == first[0] and max(again[2]) > 0


def test_cache_info_counts_attention_kv_and_the_state():
    """``kv_cache_info``: K/V bytes per token of the attention layers only, the state of a sequence
    (every recurrent layer, float32), one running slot per ``max_num_seqs`` and snapshots (one
    per running sequence and one per ``state_checkpoint_blocks`` blocks), all within
    ``kv_cache_memory``."""
    memory = 4 << 20
    with LLM(model_from(spec("qwen3_5")), kv_cache_memory=memory, block_size=4) as llm:
        info = llm.kv_cache_info()
        cfg = llm.core.config
        assert info["bytes_per_token"] == 2 * len(cfg.kv_layers()) * 2 * 16 * 4  # 2 KV heads of 16
        st = info["state"]
        # two GDN layers: conv (2 x 2 x 16 + 4 x 16 channels, 3 taps) + delta state (4, 16, 16)
        assert st["bytes_per_sequence"] == 2 * (128 * 3 + 4 * 16 * 16) * 4
        assert (
            st["running"] == 64
            and st["snapshots"] == 64 + info["num_blocks"] // st["checkpoint_blocks"]
        )
        assert st["checkpoint_blocks"] == -(
            -st["bytes_per_sequence"] // (info["bytes_per_token"] * 4)
        )
        rank = info["per_rank"][0]
        assert rank["kv_cache_bytes"] + rank["state_cache_bytes"] <= memory


def test_a_bad_checkpoint_interval_or_state_dtype_is_refused_up_front():
    with pytest.raises(ValueError, match="state_checkpoint_blocks"):
        _llm("lfm2", state_checkpoint_blocks=0)
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        _llm("lfm2", state_dtype="int8")


def test_compiled_decode_serves_a_hybrid():
    """``compile_decode=True``: the recurrent layers are an opaque op in the compiled graphs
    (their scans and state slots run eagerly inside it), and the greedy tokens are
    transformers'; most steps ran compiled (every step of 4 rows or more on CPU)."""
    prompts = prompts_for(1)
    want, _ = reference(spec("qwen3_5"), prompts)
    with _llm("qwen3_5", compile_decode=True) as llm:
        assert _run(llm, prompts * 2, GREEDY)[0] == want * 2
        stats = llm.rank_stats()[0]
        assert stats["compiled_steps"] > stats["steps"] // 2


def test_a_dense_model_takes_no_state_option():
    from tests.models import tiny_model

    with pytest.raises(ValueError, match="state_checkpoint_blocks"):
        LLM(tiny_model("llama", 0), state_checkpoint_blocks=2, num_blocks=8)
    with pytest.raises(ValueError, match="state_dtype applies to hybrid models"):
        LLM(tiny_model("llama", 0), state_dtype="bfloat16", num_blocks=8)


def test_a_bfloat16_state_when_asked():
    """``state_dtype="bfloat16"``: the pool and its snapshots hold half the float32 bytes (the
    K/V unchanged), prompt log-probs stay within bfloat16's rounding of the float32 engine's,
    snapshot hits resume; a prefix whose state was kept in float32 is refused (a hit would not
    equal this engine's cold run)."""
    prompt = prompts_for(9)[2]
    lp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with _llm("bamba", state_checkpoint_blocks=2) as plain:
        want = torch.tensor(plain.generate([prompt], lp, use_tqdm=False)[0].prompt_logprobs[1:])
        full = plain.kv_cache_info()
        prefix = plain.export_prefix(prompt)
    with _llm("bamba", state_checkpoint_blocks=2, state_dtype="bfloat16") as llm:
        info = llm.kv_cache_info()
        assert info["state"]["dtype"] == "bfloat16"
        assert info["state"]["bytes_per_sequence"] * 2 == full["state"]["bytes_per_sequence"]
        assert info["bytes_per_token"] == full["bytes_per_token"]
        assert llm.core.cluster.worker.states.layers[0][1].dtype == torch.bfloat16
        got = torch.tensor(llm.generate([prompt], lp, use_tqdm=False)[0].prompt_logprobs[1:])
        torch.testing.assert_close(got, want, atol=0.01, rtol=0)  # measured: 1e-3
        assert _run(llm, [prompt + [5, 6]], GREEDY)[2][0] > 0  # resumed from a snapshot
        with pytest.raises(ValueError, match="state_dtype"):
            llm.import_prefix(prefix)


def _steps_until(llm, rid, tokens: int) -> None:
    while len(llm.core.pipeline.get(rid)[0].output_token_ids) < tokens:
        llm.step()


def _finish(llm, rid) -> list:
    """Step until the request finishes: its tokens."""
    while True:
        for out in llm.step():
            if out.request_id == rid and out.finished:
                return out.token_ids


# every family; two of them onto a pp=2 engine (the others' receivers are one process: cheaper)
MIGRATIONS = [("qwen3_5", 2), ("nemotron_h", 2)] + [
    (f, 1) for f in FAMILIES if f not in ("qwen3_5", "nemotron_h")
]


@pytest.mark.parametrize("family,pp", MIGRATIONS)
def test_requests_migrate_with_their_state_between_meshes(family, pp, tmp_path):
    """A request stopped mid-decode on one process continues on an engine loading the saved
    checkpoint (Nemotron-H saves its weights under other names: the model digest agrees), and a
    pre-copied one (through two incremental snapshots, the second through bytes) with
    transformers' tokens: its recurrent state travels with the K/V. A snapshot whose state is
    missing or of another size is refused, naming the field, and nothing is imported."""
    prompts = prompts_for(5)
    want, _ = reference(spec(family), prompts)
    params = SamplingParams(temperature=0, max_tokens=N_OUT)
    model_from(spec(family)).save_pretrained(tmp_path)
    with _llm(family) as src, LLM(str(tmp_path), **dict(ENGINE, pp=pp)) as dst:
        full = src.add_request(prompts[2], params)
        _steps_until(src, full, 3)
        snap = src.export_request(full)
        assert snap.state is not None and snap.end == len(prompts[2]) + 2
        for bad in (None, snap.state[:-1]):
            with pytest.raises(ValueError, match="state"):
                dst.import_request(dataclasses.replace(snap, state=bad))
        assert dst.import_request(snap) == full and _finish(dst, full) == want[2]
        src.abort_request(full)
        pre = src.add_request(prompts[4], params)
        _steps_until(src, pre, 2)
        first = src.export_request(pre, stop=False)
        dst.import_request(first)
        _steps_until(src, pre, 5)
        last = src.export_request(pre, since=first)
        dst.import_request(KVSnapshot.from_bytes(last.to_bytes()))
        assert _finish(dst, pre) == want[4]
        dst.import_request(dataclasses.replace(first, request_id="staged"))
        assert dst.abort_request("staged")  # a staged import gives its slot back too
        states = dst.core.blocks.states
        assert len(states.free_running) == states.running


def test_a_prefix_moves_between_engines_with_its_snapshot():
    """``export_prefix`` stops at the deepest snapshot and carries its state (over a real link, as
    a peer pull sends it); ``import_prefix`` on
    an engine of another block size and mesh whose blocks end where the prefix does makes it a hit
    there with the uncached tokens (one whose blocks do not cannot resume from it: 0 imported)."""
    base = prompts_for(6)[2]  # 40 tokens
    params = SamplingParams(temperature=0, max_tokens=6)
    with _llm("bamba", enable_prefix_caching=False) as cold:
        want = _run(cold, [base + [9]], params)[0]
    with _llm("bamba", state_checkpoint_blocks=2) as src:
        _run(src, [base], params)
        prefix = src.export_prefix(base)
    assert len(prefix.token_ids) == 40 and prefix.state is not None
    with _llm("bamba", block_size=8, sp=2) as other:  # blocks of 16 tokens: the state is at 40
        assert other.import_prefix(prefix) == 0
    with _llm("bamba", block_size=5, sp=2) as dst:  # blocks of 10 tokens
        assert dst.import_prefix(over_link(prefix)) == 40  # as a peer pull sends it
        got, _, cached = _run(dst, [base + [9]], params)
    assert got == want and cached == [40]


def test_the_router_scores_a_hybrid_instance_by_the_snapshot_it_resumes_from():
    """A router polling two real instance apps of a hybrid (``GET /internal/state``): A holds more
    of a prompt's blocks than B but no snapshot among them (its one is at its own prompt's end),
    B fewer, ending at a snapshot; the prompt goes to B, each instance scored by the tokens it
    resumes from, as its ``cached_tokens`` counts them (blocks alone chose A). Snapshots A's slots
    evict later leave the index while their blocks stay, and a router reading A's whole index
    afresh (a new epoch) finds what the events built."""
    import asyncio

    import httpx

    from ringkv.serve.router import Router
    from tests.test_cluster import instance_in_thread

    base = prompts_for(8)[2]  # 40 tokens
    prompt = base[:30] + [5, 6, 7, 9]  # 7 of A's blocks (28 tokens), 4 of B's (16)
    others = [[(11 * i + j) % 120 + 3 for j in range(12)] for i in range(8)]
    llms = [_llm("lfm2", state_checkpoint_blocks=cb) for cb in (50, 2)]  # A: 5 snapshot slots

    async def scenario(url_a, url_b):
        router = Router(migration=False)
        router.client = httpx.AsyncClient()

        async def complete(url, ids):
            body = dict(model="tiny", prompt=ids, max_tokens=1, temperature=0)
            r = await router.client.post(url + "/v1/completions", timeout=60, json=body)
            assert r.status_code == 200, r.text

        def both(ids, inst, llm):  # the index's tokens and the engine's
            return router.cached_tokens(inst, ids, None, {}), llm.cached_tokens(ids)

        a, b = router.add(url_a, "a"), router.add(url_b, "b")
        try:
            await complete(url_a, base)  # A snapshots at 36 only
            await complete(url_b, base[:16] + [4] * 4)  # B at 8 and 16
            for inst in (a, b):
                await router.poll(inst)
            assert both(prompt, a, llms[0]) == (0, 0) and both(prompt, b, llms[1]) == (16, 16)
            assert router.pick(prompt).id == "b"
            assert both(base + [3], a, llms[0]) == (36, 36)
            for ids in others:  # each snapshots its prompt's end: base's is evicted
                await complete(url_a, ids)
            await router.poll(a)
            assert set(router.chain(a, base, None, {})) <= a.blocks.keys()
            assert both(base + [3], a, llms[0]) == (0, 0)
            fresh = Router(migration=False)
            fresh.client = router.client
            f = fresh.add(url_a, "a")
            await fresh.poll(f)
            assert (f.blocks, f.snapshots) == (a.blocks, a.snapshots) and len(a.snapshots) == 5
        finally:
            await router.client.aclose()

    with instance_in_thread(llms[0], "a") as url_a, instance_in_thread(llms[1], "b") as url_b:
        asyncio.run(scenario(url_a, url_b))


@pytest.mark.slow
def test_serve_and_router_serve_a_hybrid_through_the_openai_client(tmp_path):
    """``ringkv serve`` (with ``--state-checkpoint-blocks``) behind ``ringkv router``: the openai
    client's completions equal ``LLM.generate``, and a prompt sharing a prefix reports the cached
    tokens its snapshot served."""
    from tests.test_cluster import Proc

    model_from(spec("bamba")).save_pretrained(tmp_path)
    key = "hybrid-test-key"
    args = ("--served-model-name", "hy", "--block-size", "4", "--state-checkpoint-blocks", "2")
    serve = Proc("serve", "--model", str(tmp_path), *args, "--admin-key", key, key=key, wait=False)
    router = None
    try:
        base = prompts_for(4)[2]  # 40 tokens
        prompts = [base[:30] + [7], base + [3]]
        with LLM(str(tmp_path), block_size=4, num_blocks=64) as llm:
            want = [_run(llm, [p], GREEDY)[0][0] for p in prompts]
        serve.wait_up()
        router = Proc(
            "router", "--upstream", serve.url, "--admin-key", key, "--no-migration", key=key
        )
        got = []
        for p in prompts:  # one at a time: the second resumes from the first's snapshot
            r = router.client.completions.create(
                model="hy", prompt=[p], max_tokens=N_OUT, temperature=0, logprobs=0
            )
            got.append([int(t) for t in r.choices[0].logprobs.tokens])
        assert got == want
        assert r.usage.prompt_tokens_details.cached_tokens == 28  # the first prompt's end
    finally:
        for p in (router, serve):
            if p is not None:
                p.close()
