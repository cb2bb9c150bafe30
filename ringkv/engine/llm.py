"""``LLM``: load a model, size a paged KV cache, generate with continuous batching, on one
process or on a ``(pp, sp, tp)`` mesh of them.

    llm = LLM("path/to/hf_dir" | "model.gguf" | transformers_model, block_size=16)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    for delta in llm.stream("Hello", SamplingParams(max_tokens=8)): print(delta.text, end="")

    with LLM(path, tp=2, pp=2) as llm: ...    # starts 3 worker processes, stops them on exit
    # or, under torchrun --nproc-per-node 4, every rank runs LLM(path, tp=2, pp=2) and generate(...)

One scheduler and one block manager (on rank 0, the driver) plan every step; each rank runs
its share (``ringkv.parallel``); sampling happens on the driver. The engine state (KV cache,
prefix cache) persists across calls.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from dataclasses import asdict
from typing import Iterator, List, Optional, Sequence as Seq, Union

from ..parallel.launch import ClusterMode
from .core import SP_PREFILL_MIN_TOKENS, EngineConfig, EngineCore, with_settings
from .output import output_from_json
from .params import RequestOutput, SamplingParams, TokenDelta
from .pipeline import RequestState, Staged
from .sequence import Sequence
from .snapshot import KVSnapshot, model_digest

Prompt = Union[str, List[int]]
__all__ = ["LLM", "EngineConfig", "Prompt", "SP_PREFILL_MIN_TOKENS"]


def _core(name: str) -> property:
    """An ``LLM`` attribute that is its core's (the same object; its docstring)."""
    return property(
        lambda self: getattr(self.core, name),
        doc=getattr(getattr(EngineCore, name, None), "__doc__", None),
    )


class LLM:
    """The inference engine: ``LLM(model, EngineConfig(...))``, or the config's fields as
    keywords (``LLM(model, tp=2, block_size=32)``; keywords override a given config). See
    ``EngineConfig`` and the module docstring (how ranks start).

    A facade: ``core`` (an ``EngineCore``) owns the ranks, the block manager, the scheduler,
    the step pipeline and the migration calls; its ``output`` (an ``OutputProcessor``) turns
    tokens into text and ``RequestOutput`` objects. ``LLM`` adds the calls (``generate``,
    ``stream``, ``step``; under torchrun every rank makes them together) and forwards what users
    read of the core (its parts, ``llm.core.scheduler`` and the like, are for tests and
    benchmarks)."""

    def __init__(self, model, config: Optional[EngineConfig] = None, **settings):
        config = with_settings(EngineConfig, config, settings, "LLM")
        self.core = EngineCore(model, config, digest=model_digest)
        self._calls = itertools.count()

    # what users read and call on the core, under the same names (its parts: ``llm.core``)
    engine_config = _core("engine_config")
    config = _core("config")  # the model's ModelConfig
    tokenizer = _core("tokenizer")
    device = _core("device")
    dtype = _core("dtype")
    rank = _core("rank")
    num_blocks = _core("num_blocks")
    max_model_len = _core("max_model_len")
    max_prompt_chars = _core("max_prompt_chars")
    digest = _core("digest")
    peak_in_flight = _core("peak_in_flight")
    prefix_cache_hits = _core("prefix_cache_hits")
    close = _core("close")
    kv_cache_info = _core("kv_cache_info")
    rank_stats = _core("rank_stats")
    publish_kv_events = _core("publish_kv_events")
    kv_events = _core("kv_events")
    cached_blocks = _core("cached_blocks")
    cached_snapshots = _core("cached_snapshots")
    cached_tokens = _core("cached_tokens")
    encode = _core("encode")
    add_request = _core("add_request")
    has_unfinished_requests = _core("has_unfinished_requests")
    abort_request = _core("abort_request")

    # the core's parts that LLM forwarded until 0.x; kept readable for a release, with a warning
    MOVED = frozenset(
        (
            "shape",
            "stage_layers",
            "cluster",
            "kv",
            "blocks",
            "scheduler",
            "pipeline",
            "output",
            "tiers",
        )
    )

    def __getattr__(self, name: str):
        """``llm.scheduler`` and the core's other parts: ``llm.core.<name>``, with a
        ``DeprecationWarning`` (only called for names the class does not define)."""
        if name in LLM.MOVED and "core" in self.__dict__:
            warnings.warn(
                f"llm.{name} is deprecated: use llm.core.{name} (LLM forwards what users read; "
                f"the core's parts are reached through llm.core)",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(self.core, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (freed and recomputed when the KV cache ran short)."""
        return self.core.scheduler.num_preemptions

    @property
    def eos_ids(self) -> set:
        """Token ids that end a sample unless it ignores EOS (the model's and the tokenizer's;
        settable)."""
        return self.core.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.core.output.eos_ids = set(ids)

    def load(self) -> dict:
        """The load now: ``running``, ``waiting``, ``kv_usage``, prefix ``hits``, ``queries``."""
        return self.core.pipeline.load()

    def follow(self, idle: bool = False) -> dict:
        """Torchrun ranks > 0: run rank 0's steps until it ends the call (``idle``: no bound)."""
        return self.core.cluster.follow(idle)

    def shutdown_followers(self) -> None:
        """Torchrun rank 0: release ranks > 0 from ``follow(idle=True)`` (a server stopping)."""
        self.core.cluster.shutdown_followers()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- where requests are ----------------------------------------------------------------
    def request_state(self, request_id) -> Optional[RequestState]:
        """Where a request is: ``ACTIVE`` (waiting, running, or finished and not yet returned by
        ``step``), ``PAUSED`` (stopped by ``export_request``), ``STAGED`` (imported without its
        final snapshot); None if unknown or done."""
        return self.core.pipeline.state(request_id)

    def request_ids(self, state: RequestState) -> list:
        """The ids of the requests in ``state``, oldest first."""
        return self.core.pipeline.ids(state)

    def sequences(self, request_id) -> List[Sequence]:
        """The samples of a request in any state (``KeyError`` if there is none)."""
        seqs = self.core.pipeline.samples(request_id)
        if seqs is None:
            raise KeyError(f"request {request_id!r} is not in this engine")
        return seqs

    def staged(self, request_id) -> Staged:
        """The record of a staged import (``KeyError`` if the request is not staged)."""
        return self.core.pipeline.staged[request_id]

    def request_output(self, request_id, *, delta: bool = False) -> RequestOutput:
        """The ``RequestOutput`` of a request in any state; ``delta``: only what is new since its
        previous delta output (e.g. what a drain computed before an export stopped it)."""
        return self.core.output.request_output(self.sequences(request_id), delta)

    # -- the step API (what generate, stream and the server use) -----------------------------
    def step(self, delta: bool = False) -> List[RequestOutput]:
        """Advance the engine by one finished step (``EngineCore.advance``); returns the requests
        that got a token (or finished), in the order of their sequences. A finished request is
        returned one last time and forgotten. ``delta=True``: each output holds only what is
        new since the request's previous output (token ids, text, log-probs): no per-step copy
        that grows with the output (what a serving loop wants)."""
        if self.core.pipeline.busy:
            self.core.advance()
        # also what other calls (generate, a stream) advanced
        out = self.core.output
        return [out.request_output(seqs, delta) for _, seqs in self.core.pipeline.reports()]

    # -- migration (engine/migrate.py) -------------------------------------------------------
    def export_request(
        self, request_id, *, since: Optional[KVSnapshot] = None, stop: bool = True
    ) -> KVSnapshot:
        """A ``KVSnapshot`` of a running request (tokens, sampler state, the K/V of its computed
        tokens gathered from every rank; ``since``: only what was computed after that earlier
        snapshot). ``stop=True`` takes it out of this engine's scheduler but keeps its blocks
        until ``abort_request`` (after a successful import elsewhere) or ``resume_request``.
        Any mesh; under torchrun every rank makes the call and ranks > 0 get None."""
        return self._migration(self.core.migration.export_request, request_id, since, stop)

    def import_request(self, snapshot: KVSnapshot, *, cache_prefix: bool = False):
        """Continue a request exported by another engine (same model and KV dtype; any mesh and
        block size): its K/V are scattered to this engine's ranks. A snapshot without ``final``
        (``stop=False``) is staged until the final one; incremental snapshots must come in
        order. Every field is checked first: a bad snapshot is a ``ValueError`` naming it, and
        nothing changes. The imported K/V (and what is computed on top of them) stay out of
        the prefix cache unless ``cache_prefix=True`` (you trust the sender). Returns the
        request id. Under torchrun every rank makes the call (ranks > 0 may pass None: only rank
        0's snapshot is read) and ranks > 0 get None."""
        return self._migration(self.core.migration.import_request, snapshot, cache_prefix)

    def _migration(self, fn, *args):
        """Torchrun: rank 0 runs ``fn`` (the other ranks store or send their K/V meanwhile) and
        then ends the call on every rank; a failure there is raised on every rank."""
        if not self.core.cluster.is_driver:
            end = self.core.cluster.follow()
            if end.get("error"):
                raise RuntimeError(f"rank 0 failed to migrate the request: {end['error']}")
            return None
        try:
            out = fn(*args)
        except BaseException as e:
            if not self.core.cluster.broken:
                self.core.cluster.end({"error": f"{type(e).__name__}: {e}"})
            raise
        self.core.cluster.end({})
        return out

    def export_prefix(self, token_ids, cache_salt: Optional[str] = None):
        """The ``PrefixKV`` of the longest prefix of ``token_ids`` this engine holds in any tier
        (whole blocks of ``block_size * sp`` tokens; the device blocks pinned while their K/V are
        gathered from every rank), or None if it holds none. For another engine's
        ``import_prefix`` (``remote.send_prefix`` carries it between processes)."""
        return self._migration(self.core.migration.export_prefix, token_ids, cache_salt)

    def import_prefix(self, prefix) -> int:
        """Put another engine's cached prefix (``export_prefix``; same model and KV dtype, any
        mesh and block size) into this engine's prefix cache, under the same salted hash chain:
        every field is checked first (a ``ValueError`` naming it, nothing allocated); then the
        whole blocks of this engine's size that the free blocks hold are written to every rank
        and registered. The K/V are trusted (only import from engines you trust, as with
        ``import_request(cache_prefix=True)``). Returns the prefix tokens now cached (0 if none
        fit); a request with that prefix then hits them."""
        return self._migration(self.core.migration.import_prefix, prefix)

    def resume_request(self, request_id) -> None:
        """Run a request stopped by ``export_request`` here again (its import failed)."""
        self.core.migration.resume_request(request_id)

    def _agree_call(self, *call) -> None:
        """Torchrun: every rank must make the same call (same prompts and parameters). A broken
        engine fails here at once, before any rank waits on it (``Cluster.exchange``)."""
        self.core.cluster.ensure_usable()
        if self.core.cluster.mode != ClusterMode.TORCHRUN:
            return
        mine = hashlib.sha256(json.dumps(call, sort_keys=True, default=repr).encode()).hexdigest()
        for r, theirs in enumerate(self.core.cluster.exchange(f"call{next(self._calls)}", mine)):
            if theirs != mine:
                raise ValueError(
                    f"rank {r} called the engine with other prompts or parameters than rank "
                    f"{self.rank}; under torchrun every rank must make the same call"
                )

    def _requests(self, prompts, params, apply_chat_template, cache_salt) -> List[List[Sequence]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # one prompt (a string or one list of token ids)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a str, a list of token ids or a list of those, "
                f"got {type(prompts).__name__}"
            )
        if params is None:
            params = SamplingParams()
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                    f"give one, or one per prompt"
                )
        else:
            params = [params] * len(prompts)
        if (
            isinstance(prompts, (list, tuple))
            and any(isinstance(p, str) for p in prompts)
            and self.tokenizer is None
        ):
            raise ValueError(
                "string prompts need a tokenizer: pass tokenizer=... to LLM or give token ids"
            )
        salts = (
            list(cache_salt)
            if isinstance(cache_salt, (list, tuple))
            else [cache_salt] * len(prompts)
        )
        if len(salts) != len(prompts):
            raise ValueError(
                f"got {len(salts)} cache salts for {len(prompts)} prompts; give one, or one per "
                f"prompt"
            )
        return [
            self.core.make_request(p, sp, apply_chat_template=apply_chat_template, cache_salt=salt)
            for p, sp, salt in zip(prompts, params, salts)
        ]

    def generate(
        self,
        prompts,
        params: Union[SamplingParams, Seq[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        apply_chat_template: bool = False,
        cache_salt: Union[str, Seq[Optional[str]], None] = None,
    ) -> List[RequestOutput]:
        """Generate for every prompt (batched); outputs in prompt order. An invalid request
        gets ``finish_reason="error"`` and an ``error`` message; the others still complete.
        ``cache_salt`` (one, or one per prompt): prefix-cache blocks are shared only between
        requests with the same salt. Under torchrun every rank makes the same call and gets
        the same outputs."""
        groups = self._requests(prompts, params, apply_chat_template, cache_salt)
        self._agree_call("generate", prompts, params, apply_chat_template, cache_salt)
        if not self.core.cluster.is_driver:
            return [output_from_json(o) for o in self.core.cluster.follow()["outputs"]]
        for g in groups:
            self.core.pipeline.add(g)
        live = [s for g in groups for s in g if not s.finished]
        bar = None
        if use_tqdm and live:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(groups), desc="generate", unit="req")
            except ImportError:
                pass
        try:
            while any(not s.finished for s in live):
                self.core.advance()
                if bar is not None:
                    bar.update(sum(all(s.finished for s in g) for g in groups) - bar.n)
        except BaseException as e:
            self._abort(live, e)
            raise
        finally:
            if bar is not None:
                bar.close()
            for g in groups:
                self.core.pipeline.forget(g[0].request_id)
        outs = [self.core.output.request_output(g) for g in groups]
        self.core.cluster.end({"outputs": [asdict(o) for o in outs]})
        return outs

    def _abort(self, live: List[Sequence], e: Optional[BaseException]) -> None:
        """Leave the engine clean for the next call after an interruption or failure: the call's
        own requests (``live``) are aborted, every other request goes on (``e``: torchrun
        followers are told, and raise too)."""
        self.core.pipeline.finish(live, "error", "aborted")
        self.core.drain()
        if e is not None:
            self.core.cluster.abort(f"{type(e).__name__}: {e}")

    def stream(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        apply_chat_template: bool = False,
        cache_salt: Optional[str] = None,
    ) -> Iterator[TokenDelta]:
        """Yield each generated token (id and the text it adds) as soon as it is sampled, one
        ``TokenDelta`` per token even when other calls drive the engine in between. An invalid
        request raises ``ValueError``. Under torchrun, ranks other than 0 yield the same deltas
        once the request is done. (``n`` > 1: the first sample.)"""
        ((seq, *_),) = group = self._requests(
            [prompt], params or SamplingParams(), apply_chat_template, cache_salt
        )
        if seq.finished:
            raise ValueError(seq.error)
        self._agree_call("stream", prompt, params, apply_chat_template, cache_salt)
        if not self.core.cluster.is_driver:
            end = self.core.cluster.follow()
            yield from (TokenDelta(*d) for d in end["deltas"])
            if end.get("error"):
                raise RuntimeError(end["error"])
            return
        self.core.pipeline.add(group[0])
        sent = []
        try:
            while True:
                # one delta per token, whoever advanced it
                for d in self.core.output.token_deltas(seq, len(sent)):
                    sent.append((d.token_id, d.text, d.finish_reason))
                    yield d
                if seq.finished:
                    break
                self.core.advance()
        except GeneratorExit:  # the consumer stopped early
            self._abort(group[0], None)
            self.core.cluster.end({"deltas": sent})
            raise
        except BaseException as e:
            self._abort(group[0], e)
            raise
        finally:
            self.core.pipeline.forget(seq.request_id)
        failed = seq.error if seq.finish_reason == "error" else None
        self.core.cluster.end({"deltas": sent, "error": failed})
        if failed:
            raise RuntimeError(failed)
