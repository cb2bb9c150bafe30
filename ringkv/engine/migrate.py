"""Moving a running request between engines: ``export_request`` / ``import_request`` (the
``LLM`` methods of the same names call these).

Flow (full): ``snap = src.export_request(rid)`` stops the request on ``src`` but keeps its
blocks; ``dst.import_request(snap)`` continues it; then ``src.abort_request(rid)`` frees the
source's copy, or ``src.resume_request(rid)`` runs it there again if the import failed:
nothing is lost in between. Incremental (pre-copy): ``a = src.export_request(rid, stop=False)``
while it runs, ``dst.import_request(a)`` stages it, ..., ``b = src.export_request(rid, since=a)``
holds only what was computed since ``a``; ``dst.import_request(b)`` appends it and starts the
request. Imported full blocks enter the receiver's prefix cache. Single-rank engines only.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import List, Optional

import torch

from ..kernels.quant import as_bytes
from .detok import IncrementalDetokenizer
from .params import Logprob, SamplingParams
from .sequence import Sequence, Status
from .snapshot import KVSnapshot, model_digest


def _single_rank(llm) -> None:
    if llm.cluster.world > 1:
        raise ValueError(f"migrating a request needs a single-rank engine (tp = pp = sp = 1); this one has "
                         f"tp={llm.shape.tp}, pp={llm.shape.pp}, sp={llm.shape.sp}")


def _storage(llm) -> str:
    return llm.shape.kv_cache_dtype if llm.shape.quant else str(llm.dtype).replace("torch.", "")


def _slots(llm, table: List[int], start: int, end: int) -> torch.Tensor:
    bs = llm.blocks.block_size
    pos = torch.arange(start, end)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs


def _read(llm, seq: Sequence, start: int, end: int):
    """K, V ``(layers, T, Hkv, D)`` and their scales of tokens ``[start, end)``."""
    kv = llm.cluster.worker.kv
    slots = _slots(llm, seq.block_table, start, end).to(kv.data.device)
    layers, _, _, _, hkv, d = kv.data.shape
    data = as_bytes(kv.data).view(layers, 2, -1, hkv, d).index_select(2, slots).view(kv.data.dtype).cpu()
    scale = None if kv.scale is None else kv.scale.view(layers, 2, -1, hkv).index_select(2, slots).cpu()
    return data[:, 0], data[:, 1], (None if scale is None else scale[:, 0]), (None if scale is None else scale[:, 1])


def _write(llm, table: List[int], start: int, snap: KVSnapshot) -> None:
    kv = llm.cluster.worker.kv
    slots = _slots(llm, table, start, start + snap.k.shape[1]).to(kv.data.device)
    layers, _, _, _, hkv, d = kv.data.shape
    data = as_bytes(kv.data).view(layers, 2, -1, hkv, d)
    for i, x in enumerate((snap.k, snap.v)):
        data[:, i].index_copy_(1, slots, as_bytes(x.to(kv.data.device)))
    if kv.scale is not None:
        scale = kv.scale.view(layers, 2, -1, hkv)
        for i, x in enumerate((snap.k_scale, snap.v_scale)):
            scale[:, i].index_copy_(1, slots, x.to(kv.scale.device))


def export_request(llm, rid, since: Optional[KVSnapshot] = None, stop: bool = True) -> KVSnapshot:
    _single_rank(llm)
    if llm._inflight:
        raise RuntimeError("a step is in flight; export between steps")
    seqs = llm._active.get(rid)
    if seqs is None:
        state = "stopped by an earlier export (resume or abort it)" if rid in llm._paused else "unknown or finished"
        raise ValueError(f"request {rid!r} is {state}; nothing to export")
    if len(seqs) != 1:
        raise ValueError(f"request {rid!r} has n={len(seqs)} samples; only requests with n = 1 can migrate")
    seq = seqs[0]
    if seq.finished:
        raise ValueError(f"request {rid!r} is finished; nothing to export")
    start = tokens_from = logprobs_from = 0
    if since is not None:
        if since.request_id != rid or since.tokens_from + len(since.token_ids) > seq.num_tokens:
            raise ValueError(f"the base snapshot is not an earlier snapshot of request {rid!r}")
        start, tokens_from = since.end, since.tokens_from + len(since.token_ids)
        logprobs_from = since.logprobs_from + len(since.logprobs)
    end = max(start, seq.num_computed)  # after a preemption the receiver keeps what it has
    k, v, ks, vs = _read(llm, seq, start, seq.num_computed) if seq.num_computed > start else _empty(llm)
    first = since is None
    snap = KVSnapshot(
        model=model_digest(llm.config), kv_cache_dtype=_storage(llm), request_id=rid,
        snapshot_id=uuid.uuid4().hex, base_id=None if first else since.snapshot_id, final=stop,
        prompt=seq.prompt if first else None, prompt_token_ids=list(seq.prompt_token_ids) if first else [],
        token_ids=seq.token_ids[tokens_from:], tokens_from=tokens_from, params=asdict(seq.params),
        cache_salt=seq.cache_salt, start=start, end=end, k=k, v=v, generator_state=seq.generator.get_state(),
        k_scale=ks, v_scale=vs, logprobs=[[lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                                          for lp in seq.logprobs[logprobs_from:]],
        logprobs_from=logprobs_from, prompt_logprobs=seq.prompt_logprobs, num_cached_tokens=seq.num_cached_tokens or 0)
    if stop:  # out of the scheduler, blocks kept: resume_request or abort_request decides
        sched = llm.scheduler
        (sched.running if seq in sched.running else sched.waiting).remove(seq)
        llm._paused[rid] = llm._active.pop(rid)
    return snap


def _empty(llm):
    kv = llm.cluster.worker.kv
    layers, _, _, _, hkv, d = kv.data.shape
    k = torch.empty(layers, 0, hkv, d, dtype=kv.data.dtype)
    s = None if kv.scale is None else torch.empty(layers, 0, hkv, dtype=kv.scale.dtype)
    return k, k.clone(), s, None if s is None else s.clone()


def resume_request(llm, rid) -> None:
    seqs = llm._paused.pop(rid, None)
    if seqs is None:
        raise ValueError(f"request {rid!r} is not stopped by an export")
    seqs[0].status = Status.WAITING
    llm.scheduler.waiting.appendleft(seqs[0])
    llm._active[rid] = seqs


def _check(llm, snap: KVSnapshot) -> None:
    if not isinstance(snap, KVSnapshot):
        raise TypeError(f"import_request takes a KVSnapshot, got {type(snap).__name__}")
    if snap.model != model_digest(llm.config):
        raise ValueError("the snapshot is of another model or model configuration; it cannot be imported here")
    if snap.kv_cache_dtype != _storage(llm):
        raise ValueError(f"the snapshot's KV are {snap.kv_cache_dtype}, this engine stores {_storage(llm)}; "
                         f"both engines need the same kv_cache_dtype (and model dtype)")
    kv, cfg = llm.cluster.worker.kv, llm.config
    want = (cfg.num_layers, snap.end - snap.start, cfg.num_kv_heads, cfg.head_dim)
    if tuple(snap.k.shape) != want or tuple(snap.v.shape) != want or snap.k.dtype != kv.data.dtype:
        raise ValueError(f"the snapshot's K/V are {tuple(snap.k.shape)} {snap.k.dtype}, expected {want} {kv.data.dtype}")
    if (kv.scale is None) != (snap.k_scale is None):
        raise ValueError("the snapshot's quantization scales do not match this engine's cache")
    total = snap.tokens_from + len(snap.token_ids)
    if not 0 <= snap.start <= snap.end <= total or (snap.base_id is None and (
            snap.tokens_from or snap.token_ids[:len(snap.prompt_token_ids)] != snap.prompt_token_ids)):
        raise ValueError("the snapshot's token counts are inconsistent")
    if total >= llm.max_model_len:
        raise ValueError(f"the request has {total} tokens; this engine's max_model_len is {llm.max_model_len}")


def import_request(llm, snap: KVSnapshot):
    _single_rank(llm)
    _check(llm, snap)
    rid = snap.request_id
    staged = llm._staged.get(rid)
    if snap.base_id is None:
        if staged is not None or rid in llm._active or rid in llm._paused:
            raise ValueError(f"request {rid!r} already exists in this engine")
        if snap.start != 0:
            raise ValueError("a first snapshot must hold the K/V from the first token")
        params = SamplingParams(**snap.params)
        seq = Sequence(next(llm._ids), snap.prompt, snap.prompt_token_ids, params, snap.cache_salt, 0, rid)
        last_id = None
    else:
        if staged is None or staged[1] != snap.base_id:
            raise ValueError(f"the snapshot extends {snap.base_id!r}, but this engine holds "
                             f"{staged[1] if staged else None!r} for request {rid!r}: import the snapshots in order")
        seq, last_id = staged
        if (snap.start, snap.tokens_from, snap.logprobs_from) != (seq.num_computed, seq.num_tokens, len(seq.logprobs)):
            raise ValueError("the snapshot does not continue the imported request (tokens or K/V positions differ)")
    if not llm.blocks.grow(seq.block_table, snap.end):
        raise ValueError(f"not enough free KV blocks to import {snap.end} tokens; nothing was imported")
    _write(llm, seq.block_table, snap.start, snap)
    seq.token_ids = (seq.token_ids if last_id is not None else []) + list(snap.token_ids)
    seq.num_computed = snap.end
    seq.generator.set_state(snap.generator_state)
    seq.logprobs += [Logprob(t, lp, [tuple(x) for x in top]) for t, lp, top in snap.logprobs]
    seq.prompt_logprobs = snap.prompt_logprobs
    seq.num_cached_tokens = snap.num_cached_tokens
    llm.blocks.register(seq.block_table, seq.token_ids, seq.num_computed, seq.cache_salt, seq.prefix_cursor)
    if not snap.final:
        llm._staged[rid] = (seq, snap.snapshot_id)
        return rid
    llm._staged.pop(rid, None)
    out = seq.output_token_ids  # text so far, and the detokenizer past it
    if llm.tokenizer is not None:
        seq.text = llm.tokenizer.decode(out, skip_special_tokens=True)
        seq.detok = IncrementalDetokenizer(llm.tokenizer)
        seq.detok.prefix = seq.detok.read = len(out)
    seq.deltas, seq.emitted, seq.reported = [""] * len(out), len(seq.text), len(out)
    seq.status = Status.WAITING
    llm.scheduler.waiting.appendleft(seq)
    llm._active[rid] = [seq]
    return rid
