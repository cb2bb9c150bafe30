"""Engine cases run on every rank of a gloo world of exactly ``tp * pp * sp`` ranks: the
torchrun launch mode (the default process group is initialised; every rank builds the same
``LLM`` and makes the same calls)."""

from __future__ import annotations

import time

import torch

from ringkv.engine import LLM, SamplingParams
from tests.models import tiny_model


def model_from(spec):
    """``("tiny", arch, seed, overrides)`` or ``("hybrid", family, seed, overrides)``
    (``tests.hybrid_cases.engine_model``) -> the same random model on every rank; a str -> a
    path."""
    if isinstance(spec, str):
        return spec
    kind, arch, seed, overrides = spec
    if kind == "hybrid":
        from tests.hybrid_cases import engine_model

        return engine_model(arch, seed, **overrides)
    return tiny_model(arch, seed, **overrides)


def written_slots(llm) -> int:
    """Cache slots of layer 0 on this rank holding a key (a new cache is all zeros)."""
    k = llm.core.kv.k(0)
    return int((k.abs().flatten(2).sum(-1) != 0).sum())


def generate(ctx, spec, llm_kwargs, prompts, params, rounds=1):
    """Generate ``rounds`` times on one engine; return what this rank saw."""
    with LLM(model_from(spec), **llm_kwargs) as llm:
        tokens, cached = [], []
        for _ in range(rounds):
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([o.token_ids for o in outs])
            cached.append([o.num_cached_tokens for o in outs])
            if llm.rank == 0:
                llm.core.blocks.check()
        return dict(
            tokens=tokens,
            cached=cached,
            info=llm.kv_cache_info(),
            hits=llm.prefix_cache_hits,
            preemptions=llm.num_preemptions,
            peak_in_flight=llm.peak_in_flight,
            written=written_slots(llm),
            free=llm.core.blocks.num_free,
            stats=llm.rank_stats(),
        )


def stream(ctx, spec, llm_kwargs, prompt, params):
    with LLM(model_from(spec), **llm_kwargs) as llm:
        return [(d.token_id, d.text, d.finish_reason) for d in llm.stream(prompt, params)]


def construct(ctx, spec, per_rank_kwargs):
    """Build an engine with this rank's kwargs; return the error type and message, or "ok"."""
    kw = per_rank_kwargs[ctx.rank] if isinstance(per_rank_kwargs, list) else per_rank_kwargs
    t = time.perf_counter()
    try:
        LLM(model_from(spec), timeout=10, **kw).close()
        return "ok", "", time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - the test compares ranks' errors
        return type(e).__name__, str(e), time.perf_counter() - t


def disagree_call(ctx, spec, llm_kwargs, prompts):
    """Every rank builds the same engine but rank 1 asks for other prompts."""
    with LLM(model_from(spec), timeout=10, **llm_kwargs) as llm:
        try:
            llm.generate(
                prompts[ctx.rank], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
            )
            return "ok"
        except ValueError as e:
            return str(e)


def read_slices(ctx, path, llm_kwargs):
    """Which checkpoint slices this rank reads while it builds its shard (``seen``), and apart
    from them the rows the driver samples for the model digest of KV snapshots (``digest``)."""
    from ringkv.engine import llm as llm_module
    from ringkv.model import loader

    seen, digest, sampling = [], [], []
    real, real_digest = loader.SafetensorsSource.get, llm_module.model_digest

    def recording(self, name, dim=None, start=0, stop=0):
        t = real(self, name, dim, start, stop)
        (digest if sampling else seen).append(
            (name, dim, start, stop, t.numel() * t.element_size())
        )
        return t

    def digesting(*args):
        sampling.append(True)
        try:
            return real_digest(*args)
        finally:
            sampling.pop()

    loader.SafetensorsSource.get, llm_module.model_digest = recording, digesting
    try:
        with LLM(path, **llm_kwargs) as llm:
            return dict(
                seen=[(n, d, b) for n, d, _, _, b in seen],
                digest=digest,
                weight_bytes=llm.kv_cache_info()["per_rank"][ctx.rank]["weight_bytes"],
            )
    finally:
        loader.SafetensorsSource.get, llm_module.model_digest = real, real_digest


def seeded(ctx, spec, llm_kwargs, prompts, params):
    with LLM(model_from(spec), **llm_kwargs) as llm:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def cache_contents(ctx, spec, llm_kwargs, prompt, max_tokens):
    """One long prompt on a fresh engine: how many of its tokens' K/V this rank stores."""
    with LLM(model_from(spec), **llm_kwargs) as llm:
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
        )[0]
        return dict(tokens=out.token_ids, written=written_slots(llm), info=llm.kv_cache_info())


def torch_threads(ctx):
    return torch.get_num_threads()


def prompt_logprobs(ctx, spec, llm_kwargs, prompt, k: int = 0):
    """The prompt's log-probs (k = 0), or them and the top k alternatives at each position."""
    with LLM(model_from(spec), **llm_kwargs) as llm:
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), use_tqdm=False
        )[0]
        return (
            out.prompt_logprobs
            if k == 0
            else (out.prompt_logprobs, [list(map(list, x)) for x in out.prompt_top_logprobs])
        )


def migrate_pair(ctx, spec, prompts, params):
    """Rank 0 starts the requests and moves each to rank 1 (pre-copy, one more round, then the
    final snapshot), over the process group; rank 1 finishes them."""
    from ringkv.engine import KVSnapshot

    llm = LLM(
        model_from(spec),
        block_size=4 if ctx.rank == 0 else 8,
        num_blocks=128,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(**params)
    if ctx.rank == 0:
        rids = [llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        for _ in range(3):
            llm.step()
        for rid in rids:
            first = llm.export_request(rid, stop=False)
            first.send(1)
            llm.step()
            llm.export_request(rid, since=first).send(1)
            llm.abort_request(rid)
        return "sent"
    for _ in prompts:
        for _ in range(2):
            llm.import_request(KVSnapshot.recv(0))
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o.token_ids
    return [outs[f"r{i}"] for i in range(len(prompts))]


def fault_run(ctx, spec, llm_kwargs, fault, close_after, prompts, params):
    """Torchrun mode under ``RINGKV_FAULT=fault`` (None: none): a stream of ``prompts[0]``
    (closed after ``close_after`` tokens unless None), then ``generate(prompts[1:])``, then one
    more ``generate`` of the same; what this rank saw, errors as ``"Type: message"``."""
    import json
    import os

    import torch.distributed as dist

    if fault:
        os.environ["RINGKV_FAULT"] = json.dumps(fault)
    out = dict(errors=[])
    try:
        with LLM(model_from(spec), **llm_kwargs) as llm:
            from tests.dist import settled_keys

            store = dist.distributed_c10d._get_default_store()
            keys = settled_keys(store)
            t = time.monotonic()
            for call in ("stream", "generate", "again"):
                try:
                    if call == "stream":
                        it, got = llm.stream(prompts[0], params), []
                        for d in it:
                            got.append(d.token_id)
                            if close_after is not None and len(got) == close_after:
                                it.close()
                                break
                        out[call] = got
                    else:
                        out[call] = [
                            o.token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)
                        ]
                except BaseException as e:  # noqa: BLE001 - the test reads every rank's outcome
                    out["errors"].append(f"{call}: {type(e).__name__}: {e}")
                out[f"{call}_s"] = time.monotonic() - t
                t = time.monotonic()
            out["broken"] = llm.core.cluster.broken
            if not llm.core.cluster.broken:
                out["key_growth"] = settled_keys(store) - keys
                if llm.rank == 0:
                    llm.core.blocks.check()
                    out["free"], out["num_blocks"] = llm.core.blocks.num_free, llm.num_blocks
    finally:
        os.environ.pop("RINGKV_FAULT", None)
    return out


def migrate_mesh_torchrun(ctx, spec, prompts, params):
    """A torchrun tp=2 engine (both ranks) and a one-rank engine on rank 0. Rank 0 starts the
    requests on the tp=2 engine, moves the even ones to the one-rank engine (every rank calls
    ``export_request``; rank 1 gets None) and the odd ones there and back (the tp=2 engine
    imports them while rank 1 follows in a server-like loop); returns the outputs by prompt."""
    model = model_from(spec)
    a = LLM(model, tp=2, block_size=4, num_blocks=128, max_num_batched_tokens=16)
    params = SamplingParams(**params)
    if ctx.rank == 1:
        assert a.export_request("r0") is None  # the call-style: rank 0 exports r0 meanwhile
        while a.follow(idle=True)["kind"] != "shutdown":
            pass
        return "followed"
    b = LLM(model, block_size=8, num_blocks=128)
    rids = [a.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    outs = {}

    def steps(e, n=1):
        for _ in range(n):
            for o in e.step():
                outs[o.request_id] = o.token_ids

    steps(a, 3)
    b.import_request(a.export_request("r0"))
    a.abort_request("r0")
    for rid in rids[1:]:
        if rid not in a.core.pipeline.active:
            continue
        first = a.export_request(rid, stop=False)
        b.import_request(first)
        steps(a)
        if rid not in a.core.pipeline.active:
            b.abort_request(rid)
            continue
        b.import_request(a.export_request(rid, since=first))
        a.abort_request(rid)
        if int(rid[1:]) % 2:  # and back, after a step there
            steps(b)
            if rid in b.core.pipeline.active:
                a.import_request(b.export_request(rid))
                b.abort_request(rid)
    for e in (a, b):
        while e.has_unfinished_requests():
            steps(e)
    assert (
        a.core.blocks.num_free == a.core.blocks.num_blocks
        and b.core.blocks.num_free == b.core.blocks.num_blocks
    )
    a.shutdown_followers()
    a.close()
    b.close()
    return [outs[rid] for rid in rids]


def kv_size_mismatch(ctx, spec, prompt, move, timeout):
    """Torchrun sp=2 with rank 1's K/V slot computation planted one token short (a layout the
    two sides disagree on), then rank 0 exports (``move="export"``) or imports a request:
    every rank's error (None if none) and the seconds its call took."""
    from ringkv.parallel import EngineError, kvmove

    if ctx.rank == 1:
        real = kvmove._slots
        kvmove._slots = lambda *a: real(*a)[:-1]
    a = LLM(
        model_from(spec),
        sp=2,
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=16,
        timeout=timeout,
    )
    params = SamplingParams(temperature=0, max_tokens=8)
    t = time.monotonic()
    try:
        if ctx.rank == 1:
            if move == "export":
                a.export_request("r0")
            else:
                while a.follow(idle=True)["kind"] != "shutdown":
                    pass
        elif move == "export":
            a.add_request(prompt, params, request_id="r0")
            a.step()
            t = time.monotonic()
            a.export_request("r0")
        else:
            b = LLM(model_from(spec), block_size=8, num_blocks=64)
            b.add_request(prompt, params, request_id="r0")
            b.step()
            snap = b.export_request("r0")
            b.close()
            t = time.monotonic()
            a.import_request(snap)
        return dict(error=None, s=time.monotonic() - t)
    except EngineError as e:
        return dict(error=str(e), s=time.monotonic() - t)
    finally:
        a.close()


def hybrid_rounds(ctx, spec, llm_kwargs, prompts, params, logprob_prompt):
    """Two rounds of ``prompts`` (the second hits the prefix cache), then ``logprob_prompt``'s
    prompt log-probs, on one engine; what this rank saw, the driver's state slots included."""
    with LLM(model_from(spec), **llm_kwargs) as llm:
        rounds = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        lp = llm.generate(
            [logprob_prompt],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0].prompt_logprobs
        states = llm.core.blocks.states
        return dict(
            tokens=[[o.token_ids for o in outs] for outs in rounds],
            cached=[[o.num_cached_tokens for o in outs] for outs in rounds],
            logprobs=lp,
            info=llm.kv_cache_info(),
            free_slots=None if llm.rank else len(states.free_running),
        )
