"""Moving a running request between engines: ``Migration``, owned by the ``EngineCore``
(``export_request`` / ``import_request`` / ``resume_request``, which ``LLM``'s methods of the same
names call), and ``reclaim`` of the blocks such requests hold.

Flow (full): ``snap = src.export_request(rid)`` stops the request on ``src`` but keeps its
blocks; ``dst.import_request(snap)`` continues it; then ``src.abort_request(rid)`` frees the
source's copy, or ``src.resume_request(rid)`` runs it there again if the import failed:
nothing is lost in between. Incremental (pre-copy): ``a = src.export_request(rid, stop=False)``
while it runs, ``dst.import_request(a)`` stages it, ..., ``b = src.export_request(rid, since=a)``
holds only what was computed since ``a``; ``dst.import_request(b)`` appends it and starts the
request. Any mesh: the driver gathers the K/V from the ranks that hold them and scatters them
to the target's own placement (``parallel/kvmove.py``), so the two engines may differ in
``tp``/``pp``/``sp``, block size and launch mode.

An import trusts nothing in the snapshot: every field is checked (types, token ids in the
vocabulary, tensor shapes and dtypes, sampling parameters, the generator state, log-probs,
counts) before anything changes; a bad one is a ``ValueError`` naming it and the engine is as
before. What the checks cannot see (K/V that are well-formed but wrong) can only give that
request wrong output: imported K/V, and everything computed on top of them, stay out of the
prefix cache unless the caller vouches for them (``cache_prefix=True``).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict
from typing import Callable, Optional, Tuple

import torch

from .params import Logprob, SamplingParams, is_int
from .pipeline import RequestState, Staged
from .sequence import Sequence
from ..cache.state_pool import unflatten
from .snapshot import VERSION, KVSnapshot, PrefixKV


# -- import: check everything, then change the engine ----------------------------------------
def _logprob(x) -> bool:
    """A log-probability: a finite number or -inf (compared, not converted: a huge int is fine)."""
    return (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and (x == -math.inf or -math.inf < x < math.inf)
    )


def _pair(x, vocab: int) -> bool:
    """``[token id, log-prob]``."""
    return (
        isinstance(x, (list, tuple))
        and len(x) == 2
        and is_int(x[0])
        and 0 <= x[0] < vocab
        and _logprob(x[1])
    )


def _bad(name: str, why: str) -> ValueError:
    return ValueError(f"snapshot field {name!r}: {why}; nothing was imported")


def _prefix_bad(name: str, why: str) -> ValueError:
    return ValueError(f"prefix field {name!r}: {why}; nothing was imported")


def _check_origin(engine, what: str, model: str, kv_cache_dtype: str) -> None:
    """The K/V of a ``what`` (snapshot, prefix) fit only an engine of its model and storage
    (``engine``'s ``digest`` and ``kv_storage``)."""
    if model != engine.digest:
        raise ValueError(
            f"the {what} is of another model (its config or weights differ from this "
            "engine's); it cannot be imported here"
        )
    if kv_cache_dtype != engine.kv_storage:
        raise ValueError(
            f"the {what}'s KV are {kv_cache_dtype}, this engine stores "
            f"{engine.kv_storage}; both engines need the same kv_cache_dtype (and model dtype)"
        )


def _check_ids(name: str, ids, vocab: int, bad=_bad) -> None:
    if not isinstance(ids, (list, tuple)):
        raise bad(name, f"must be a list of token ids, got {type(ids).__name__}")
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab:
            raise bad(name, f"holds {t!r}: token ids are ints in [0, {vocab})")


def _check_params(p) -> SamplingParams:
    if not isinstance(p, dict):
        raise _bad("params", f"must be a dict of SamplingParams fields, got {type(p).__name__}")
    try:
        params = SamplingParams(**p)
    except TypeError as e:  # an unknown (or non-string) key
        raise _bad("params", f"not SamplingParams fields ({e})") from None
    problem = params.problem() or (
        None if params.n == 1 else "only requests with n = 1 can migrate"
    )
    if problem is not None:
        raise _bad("params", problem)
    return params


def _check_logprobs(snap: KVSnapshot, vocab: int, want: int) -> None:
    """``want`` log-probs in all (one per generated token if the request asks for them, else
    none)."""
    lps = snap.logprobs
    if not isinstance(lps, (list, tuple)) or snap.logprobs_from + len(lps) != want:
        got = (
            f"{snap.logprobs_from} + {len(lps)}"
            if isinstance(lps, (list, tuple))
            else type(lps).__name__
        )
        raise _bad("logprobs", f"the request has {want} log-probs so far, the snapshot gives {got}")
    for e in lps:
        if not (
            isinstance(e, (list, tuple))
            and len(e) == 3
            and _pair(e[:2], vocab)
            and isinstance(e[2], (list, tuple))
            and all(_pair(x, vocab) for x in e[2])
        ):
            raise _bad(
                "logprobs",
                f"holds {e!r:.80}: entries are [token id, log-prob, [[token id, log-prob], ...]]",
            )


def _check_prompt_logprobs(plp, top, params: SamplingParams, prompt_len: int, vocab: int) -> None:
    if params.prompt_logprobs is None:
        if plp is not None:
            raise _bad("prompt_logprobs", "must be None: the request's params do not ask for them")
    elif (
        not isinstance(plp, (list, tuple))
        or len(plp) != prompt_len - 1
        or not all(x is None or _logprob(x) for x in plp)
    ):
        raise _bad(
            "prompt_logprobs",
            f"must be a list of {prompt_len - 1} log-probs (None: not computed yet)",
        )
    k = params.prompt_logprobs or 0
    if not k:
        if top is not None:
            raise _bad(
                "prompt_top_logprobs", "must be None: the request's params ask for no alternatives"
            )
    elif (
        not isinstance(top, (list, tuple))
        or len(top) != prompt_len - 1
        or not all(
            (x is None) == (p is None)
            and (
                x is None
                or isinstance(x, (list, tuple))
                and len(x) == k
                and all(_pair(t, vocab) for t in x)
            )
            for x, p in zip(top, plp)
        )
    ):
        raise _bad(
            "prompt_top_logprobs",
            f"must be a list of {prompt_len - 1} lists of {k} [token id, log-prob] "
            f"(None where the log-prob is)",
        )


def _check_kv(mover, n: int, x, bad=_bad) -> None:
    """K/V ``(layers, n, Hkv, D)`` in the cache's dtype, finite (they may land in blocks other
    requests reuse); scales ``(layers, n, Hkv)`` iff the cache is quantized. ``x``: what has
    ``k``, ``v``, ``k_scale``, ``v_scale``; ``mover``: the cluster's ``parallel.kvmove``
    placement (``shape``, ``dtype``, ``scale_dtype``)."""
    layers, hkv, d = mover.shape
    want = (layers, n, hkv, d)
    scale = mover.scale_dtype
    for name, shape, dtype in (
        ("k", want, mover.dtype),
        ("v", want, mover.dtype),
        ("k_scale", want[:3], scale),
        ("v_scale", want[:3], scale),
    ):
        t = getattr(x, name)
        if dtype is None:
            if t is not None:
                raise bad(name, "must be None: this engine's KV cache is not quantized")
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(name, f"must be a {shape} {dtype} tensor, got {got}")
        if t.is_floating_point() and not all(
            bool(torch.isfinite(layer.float()).all()) for layer in t
        ):  # per layer
            raise bad(name, "holds inf or NaN")


def _check_tensors(mover, snap: KVSnapshot) -> None:
    """``_check_kv`` of its ``end - start`` tokens, and a generator state a fresh
    ``torch.Generator`` accepts."""
    _check_kv(mover, snap.end - snap.start, snap)
    g = snap.generator_state
    if not isinstance(g, torch.Tensor) or g.dtype != torch.uint8:
        got = g.dtype if isinstance(g, torch.Tensor) else type(g).__name__
        raise _bad(
            "generator_state", f"must be a uint8 tensor (torch.Generator().get_state()), got {got}"
        )
    try:
        torch.Generator().set_state(
            g
        )  # a scratch generator: the request's is set once all is checked
    except (RuntimeError, TypeError, ValueError) as e:
        raise _bad("generator_state", f"not a CPU generator's state ({e})") from None


def _check_state(mover, x, needed: bool, bad=_bad) -> None:
    """A hybrid model's ``state``: float32 of exactly the model's state size and finite when
    ``needed`` (K/V computed past the last state), None or such a tensor otherwise; always None
    for a dense model."""
    t = x.state
    if not mover.state_shapes:
        if t is not None:
            raise bad("state", "must be None: this model has no recurrent layers")
        return
    if t is None:
        if needed:
            raise bad("state", "missing: a hybrid model's K/V are useless without the state")
        return
    try:
        unflatten(t, mover.state_shapes)
    except ValueError as e:
        raise bad("state", str(e)) from None
    if not bool(torch.isfinite(t).all()):
        raise bad("state", "holds inf or NaN")


def _check_fields(snap: KVSnapshot) -> None:
    """The types of a snapshot's ids, flags and counts."""
    rid = snap.request_id
    if not isinstance(rid, str) and not is_int(rid):
        raise _bad("request_id", f"must be a str or an int, got {rid!r}")
    for name, ok, want in (
        ("snapshot_id", isinstance(snap.snapshot_id, str), "a str"),
        ("base_id", snap.base_id is None or isinstance(snap.base_id, str), "None or a str"),
        ("final", isinstance(snap.final, bool), "a bool"),
        (
            "cache_salt",
            snap.cache_salt is None or isinstance(snap.cache_salt, str),
            "None or a str",
        ),
    ):
        if not ok:
            raise _bad(name, f"must be {want}, got {getattr(snap, name)!r}")
    for name in ("start", "end", "tokens_from", "logprobs_from", "num_cached_tokens"):
        if not is_int(getattr(snap, name)) or getattr(snap, name) < 0:
            raise _bad(name, f"must be an int >= 0, got {getattr(snap, name)!r}")


class Migration:
    """The migration calls of one ``EngineCore``, which hands it its parts: the ``pipeline``
    (the book of requests; its scheduler's block manager), the ``cluster`` whose ranks hold the
    K/V, the ``output`` processor, the prefix cache's ``tiers`` (or None), ``drain()`` (finish
    the steps in flight, before an export), and what an import must match: the model
    ``digest``, the ``kv_storage`` format, ``vocab_size``, ``max_model_len`` and a hybrid's
    ``state_dtype``."""

    def __init__(
        self,
        pipeline,
        cluster,
        output,
        tiers,
        *,
        drain: Callable[[], None],
        digest: Optional[str],
        kv_storage: str,
        vocab_size: int,
        max_model_len: int,
        state_dtype: str = "float32",
    ):
        self.pipeline, self.blocks, self.cluster = pipeline, pipeline.blocks, cluster
        self.output, self.tiers, self.drain = output, tiers, drain
        self.digest, self.kv_storage = digest, kv_storage
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.state_dtype = state_dtype

    # -- export ----------------------------------------------------------------------------
    def export_request(
        self, rid, since: Optional[KVSnapshot] = None, stop: bool = True
    ) -> KVSnapshot:
        """See ``LLM.export_request``."""
        book, cluster = self.pipeline, self.cluster
        if book.inflight:  # pipeline parallel keeps steps in flight: finish them (the next
            self.drain()  # step() reports them)
            cluster.ensure_usable()
        seqs = book.get(rid)
        if seqs is None:
            state = (
                "stopped by an earlier export (resume or abort it)"
                if book.state(rid) is RequestState.PAUSED
                else "unknown or finished"
            )
            raise ValueError(f"request {rid!r} is {state}; nothing to export")
        if len(seqs) != 1:
            raise ValueError(
                f"request {rid!r} has n={len(seqs)} samples; only requests with n = 1 can migrate"
            )
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
        # empty if nothing is new
        k, v, ks, vs = cluster.read_kv(seq.block_table, start, seq.num_computed)
        state = None  # a hybrid: the state after ``end``, when that is what its slot holds
        if seq.state_slot is not None and end == seq.num_computed > start:
            state = cluster.read_state(seq.state_slot)
        first = since is None
        snap = KVSnapshot(
            model=self.digest,
            kv_cache_dtype=self.kv_storage,
            request_id=rid,
            snapshot_id=uuid.uuid4().hex,
            base_id=None if first else since.snapshot_id,
            final=stop,
            prompt=seq.prompt if first else None,
            prompt_token_ids=list(seq.prompt_token_ids) if first else [],
            token_ids=seq.token_ids[tokens_from:],
            tokens_from=tokens_from,
            params=asdict(seq.params),
            cache_salt=seq.cache_salt,
            start=start,
            end=end,
            k=k,
            v=v,
            generator_state=seq.generator.get_state(),
            k_scale=ks,
            v_scale=vs,
            state=state,
            logprobs=[
                [lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                for lp in seq.logprobs[logprobs_from:]
            ],
            logprobs_from=logprobs_from,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens or 0,
            prompt_top_logprobs=None
            if seq.prompt_top is None
            else [None if x is None else [list(t) for t in x] for x in seq.prompt_top],
        )
        if stop:  # out of the scheduler, blocks kept: resume_request or abort_request decides
            book.pause(rid)
        return snap

    def resume_request(self, rid) -> None:
        """See ``LLM.resume_request``."""
        book = self.pipeline
        if book.state(rid) is not RequestState.PAUSED:
            raise ValueError(f"request {rid!r} is not stopped by an export")
        book.resume(rid)

    # -- import: check everything, then change the engine ----------------------------------
    def _validate(self, snap: KVSnapshot) -> Tuple[Optional[Staged], SamplingParams]:
        """Every check of an import, changing nothing. Returns the staged import the snapshot
        continues (None for a first snapshot) and its sampling parameters."""
        if not isinstance(snap, KVSnapshot):
            raise TypeError(f"import_request takes a KVSnapshot, got {type(snap).__name__}")
        if snap.version != VERSION:
            raise _bad(
                "version",
                f"snapshot format version {snap.version!r}, this ringkv reads {VERSION}",
            )
        _check_origin(self, "snapshot", snap.model, snap.kv_cache_dtype)
        _check_fields(snap)
        vocab = self.vocab_size
        _check_ids("token_ids", snap.token_ids, vocab)
        _check_ids("prompt_token_ids", snap.prompt_token_ids, vocab)
        params = _check_params(snap.params)
        staged = self.pipeline.staged.get(snap.request_id)
        prompt, req = self._continued(snap, staged, params)
        total = snap.tokens_from + len(snap.token_ids)
        if not snap.start <= snap.end < total:
            raise _bad(
                "end",
                f"K/V of tokens [{snap.start}, {snap.end}) must lie within the request's {total} "
                f"tokens and leave the last one to compute",
            )
        if total >= self.max_model_len:
            raise ValueError(
                f"the request has {total} tokens; this engine's max_model_len is "
                f"{self.max_model_len}"
            )
        generated = total - len(prompt)
        if generated >= req.max_tokens:
            raise _bad(
                "params",
                f"max_tokens={req.max_tokens}, but the request has {generated} generated tokens "
                f"already: it is done",
            )
        if snap.num_cached_tokens > len(prompt):
            raise _bad(
                "num_cached_tokens",
                f"{snap.num_cached_tokens} exceeds the prompt's {len(prompt)} tokens",
            )
        _check_logprobs(snap, vocab, 0 if req.logprobs is None else generated)
        _check_prompt_logprobs(
            snap.prompt_logprobs, snap.prompt_top_logprobs, req, len(prompt), vocab
        )
        _check_tensors(self.cluster.mover, snap)
        _check_state(self.cluster.mover, snap, snap.end > snap.start)
        return staged, params

    def _continued(self, snap: KVSnapshot, staged: Optional[Staged], params: SamplingParams):
        """``(prompt token ids, sampling params)`` of the request ``snap`` starts (a first
        snapshot: its own) or continues (the staged import's), once it is checked to start or
        continue it."""
        rid = snap.request_id
        if snap.base_id is None:
            if self.pipeline.known(rid):
                raise ValueError(f"request {rid!r} already exists in this engine")
            prompt = snap.prompt_token_ids
            if not prompt:
                raise _bad("prompt_token_ids", "empty: a first snapshot carries the prompt")
            if (snap.start, snap.tokens_from, snap.logprobs_from) != (0, 0, 0):
                raise ValueError(
                    "a first snapshot must hold everything from the first token "
                    "(start = tokens_from = logprobs_from = 0)"
                )
            if list(snap.token_ids[: len(prompt)]) != list(prompt):
                raise _bad("token_ids", "must start with prompt_token_ids")
            return prompt, params
        if staged is None or staged.last_id != snap.base_id:
            raise ValueError(
                f"the snapshot extends {snap.base_id!r}, but this engine holds "
                f"{staged.last_id if staged else None!r} for request {rid!r}: import the "
                f"snapshots in order"
            )
        seq = staged.seq
        if (snap.start, snap.tokens_from, snap.logprobs_from) != (
            staged.kv_end,
            seq.num_tokens,
            len(seq.logprobs),
        ):
            raise ValueError(
                "the snapshot does not continue the imported request (tokens or K/V "
                "positions differ)"
            )
        return seq.prompt_token_ids, seq.params  # the first snapshot's: the request's

    def import_request(self, snap: KVSnapshot, cache_prefix: bool = False):
        """Continue (or stage) an exported request. Everything is checked before anything
        changes; the blocks are allocated last and given back if writing the K/V fails.
        ``cache_prefix``: register the imported full blocks in the prefix cache (under the
        snapshot's salt); by default they, and every block computed on top of them, stay out
        of it."""
        blocks, book = self.blocks, self.pipeline
        staged, params = self._validate(snap)
        seq = None if staged is None else staged.seq
        with_kv = staged is None or not staged.dropped  # a reclaimed staged import ignores K/V
        table = [] if seq is None else list(seq.block_table)
        need = blocks.blocks_for(snap.end) - len(table) if with_kv else 0
        if need > blocks.num_free:
            raise ValueError(
                f"not enough free KV blocks to import {snap.end} tokens ({need} needed, "
                f"{blocks.num_free} free); nothing was imported"
            )
        tokens = ([] if seq is None else seq.token_ids) + list(snap.token_ids)
        prompt_len = len(snap.prompt_token_ids if seq is None else seq.prompt_token_ids)
        text = self.output.decode(tokens[prompt_len:]) if snap.final else None
        slot = self._state_slot(seq, snap) if with_kv else None
        if with_kv:  # all checked: allocate and write, and give the blocks back if that fails
            old = len(table)
            blocks.grow(table, snap.end)
            try:
                self.cluster.write_kv(
                    table, snap.start, (snap.k, snap.v, snap.k_scale, snap.v_scale)
                )
                if snap.state is not None:
                    self.cluster.write_state(slot, snap.state)
            except BaseException:
                blocks.free(table[old:])
                if slot is not None and (seq is None or seq.state_slot is None):
                    blocks.states.release(slot)
                raise
        if seq is None:
            seq = Sequence(
                seq_id=book.new_id(),
                prompt=snap.prompt,
                prompt_token_ids=snap.prompt_token_ids,
                params=params,
                cache_salt=snap.cache_salt,
                request_id=snap.request_id,
            )
        seq.token_ids, seq.block_table = tokens, table
        if with_kv:
            seq.num_computed, seq.state_slot = snap.end, slot
        seq.generator.set_state(snap.generator_state)
        seq.logprobs += [Logprob(t, lp, [tuple(x) for x in top]) for t, lp, top in snap.logprobs]
        seq.prompt_logprobs = None if snap.prompt_logprobs is None else list(snap.prompt_logprobs)
        seq.prompt_top = (
            None
            if snap.prompt_top_logprobs is None
            else [
                None if x is None else [(int(t), v) for t, v in x] for x in snap.prompt_top_logprobs
            ]
        )
        seq.num_cached_tokens = snap.num_cached_tokens
        if with_kv and snap.end > snap.start:  # K/V computed elsewhere: cached when vouched for
            if cache_prefix:
                blocks.register(
                    seq.block_table,
                    seq.token_ids,
                    seq.num_computed,
                    seq.cache_salt,
                    seq.prefix_cursor,
                )
            else:
                seq.prefix_cursor.stopped = True  # until a preemption recomputes it here
        if not snap.final:
            if staged is None:
                book.stage(snap.request_id, Staged(seq, snap.snapshot_id, snap.end))
            else:
                staged.last_id, staged.kv_end = snap.snapshot_id, snap.end
            return snap.request_id
        self.output.restore(seq, text)  # its text so far, the detokenizer past it
        book.start(snap.request_id, seq)
        return snap.request_id

    def _state_slot(self, seq: Optional[Sequence], snap: KVSnapshot) -> Optional[int]:
        """A hybrid model's import: the state slot its state goes to (the staged import's own,
        or a free one: ``ValueError`` when none is), None for a dense model."""
        states = self.blocks.states
        if states is None:
            return None
        if seq is not None and seq.state_slot is not None:
            return seq.state_slot
        slot = states.take()
        if slot is None:
            raise ValueError(
                f"no free state slot for request {snap.request_id!r}: every one of the "
                f"{states.running} is held; nothing was imported"
            )
        return slot

    # -- prefixes: cached K/V of a prompt's prefix, between engines ---------------------------
    def export_prefix(self, token_ids, cache_salt: Optional[str] = None) -> Optional[PrefixKV]:
        """See ``LLM.export_prefix``."""
        blocks, tpb = self.blocks, self.blocks.block_size
        _check_ids("token_ids", token_ids, self.vocab_size, _prefix_bad)
        chain = blocks.locate(token_ids, cache_salt, take=True)  # device blocks pinned meanwhile
        parts, run, n, state = [], [], 0, None
        try:
            if blocks.states is not None:  # a hybrid: up to its deepest snapshot (in any tier)
                k = blocks.resumable(chain)
                blocks.free([b for b, _ in chain[k:] if b is not None])
                chain = chain[:k]
                on_device, slot = blocks.deepest_snapshot([b for b, _ in chain])
                state = self.cluster.read_state(slot) if k and on_device == k else None
            for b, key in chain:  # device runs in one gather each, tier entries one by one
                if b is None:
                    if run:
                        parts.append(self.cluster.read_kv(run, 0, len(run) * tpb))
                        run = []
                    kv = self.tiers.get(key)
                    if kv is None:  # a disk file refused: the prefix ends before it
                        break
                    parts.append(kv)
                    if n + 1 == len(chain) and len(kv) == 5:  # the snapshot came with its block
                        state = kv[4]
                else:
                    run.append(b)
                n += 1
            if run:
                parts.append(self.cluster.read_kv(run, 0, len(run) * tpb))
        finally:
            blocks.free([b for b, _ in chain if b is not None])
        if not n or (blocks.states is not None and (n < len(chain) or state is None)):
            return None  # (a hybrid's prefix cut short no longer ends at its snapshot)
        k, v, ks, vs = (
            None if parts[0][i] is None else torch.cat([p[i] for p in parts], 1) for i in range(4)
        )
        ids = [int(t) for t in token_ids[: n * tpb]]
        return PrefixKV(
            self.digest, self.kv_storage, ids, cache_salt, k, v, ks, vs, state, self.state_dtype
        )

    def import_prefix(self, prefix: PrefixKV) -> int:
        """See ``LLM.import_prefix``."""
        blocks, tpb = self.blocks, self.blocks.block_size
        if not isinstance(prefix, PrefixKV):
            raise TypeError(f"import_prefix takes a PrefixKV, got {type(prefix).__name__}")
        _check_origin(self, "prefix", prefix.model, prefix.kv_cache_dtype)
        if blocks.states is not None and prefix.state_dtype != self.state_dtype:
            raise ValueError(
                f"the prefix's recurrent state was kept in {prefix.state_dtype!r}, this engine "
                f"keeps {self.state_dtype!r} (state_dtype): a hit would not equal its cold run"
            )
        if prefix.cache_salt is not None and not isinstance(prefix.cache_salt, str):
            raise _prefix_bad("cache_salt", f"must be None or a str, got {prefix.cache_salt!r}")
        _check_ids("token_ids", prefix.token_ids, self.vocab_size, _prefix_bad)
        _check_kv(self.cluster.mover, len(prefix.token_ids), prefix, _prefix_bad)
        _check_state(self.cluster.mover, prefix, len(prefix.token_ids) > 0, _prefix_bad)
        m = len(prefix.token_ids) // tpb  # whole blocks of this engine's size
        if not blocks.prefix_caching or not m:
            return 0
        if blocks.states is not None and m * tpb != len(prefix.token_ids):
            return 0  # a hybrid's state is after the last token: it must end a block here
        ids, salt = [int(t) for t in prefix.token_ids[: m * tpb]], prefix.cache_salt
        table = blocks.match_prefix(ids + [0], salt)  # what it holds already (tiers promoted)
        have = len(table)
        new = min(m - have, blocks.num_free)
        try:
            if new > 0:
                table += blocks.allocate(new)
                start, end = have * tpb, (have + new) * tpb
                kv = (prefix.k, prefix.v, prefix.k_scale, prefix.v_scale)
                self.cluster.write_kv(
                    table, start, tuple(None if t is None else t[:, start:end] for t in kv)
                )
                blocks.register(table, ids, end, salt)
            if blocks.states is not None:
                return self._index_state(table, prefix.state, m, ids, salt) * tpb
            return len(table) * tpb
        finally:
            blocks.free(table)  # cached (evictable) now: the request that follows takes them

    def _index_state(self, table, state: torch.Tensor, m: int, ids, salt) -> int:
        """A hybrid's imported prefix of ``m`` blocks: its state as the snapshot of the last one
        (if all ``m`` are held and it has none yet); the blocks a prompt may now resume from."""
        blocks = self.blocks
        key = blocks.checkpoint_key(table, m, ids, salt) if len(table) == m else (None, None)
        if key[0] is not None:
            slot = blocks.states.reserve()
            if slot is not None:
                self.cluster.write_state(slot, state)
                blocks.states.put(*key, slot)
        return blocks.deepest_snapshot(table)[0]

    # -- held blocks -----------------------------------------------------------------------
    def reclaim(self) -> bool:
        """Free the K/V blocks (and a hybrid's state slot) of ONE held request, oldest first, so
        they can serve admission: a
        request stopped by an export (``resume_request`` then recomputes it from its tokens)
        before a staged import (its later snapshots add their tokens and log-probs but not
        their K/V, and the final one starts it from scratch). Only compute is lost, never a
        token. True if it freed blocks, False if no held request holds any."""
        for seq, staged in self.pipeline.held():
            if seq.block_table or seq.state_slot is not None:
                seq.free_kv(self.blocks)
                if staged is not None:
                    staged.dropped = True
                return True
        return False
