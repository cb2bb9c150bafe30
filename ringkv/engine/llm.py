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
import weakref
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Sequence as Seq, Union

import torch

from ..cache.block_manager import BlockManager, KVEvents, block_hash
from ..kernels import quant
from ..model.loader import open_model
from ..parallel.compiled import decode_buckets
from ..parallel.launch import DEFAULT_KV_MEMORY, CacheBudget, Cluster, deferred_interrupt
from ..parallel.tp import check_tp
from ..parallel.worker import EngineShape
from . import migrate
from .detok import IncrementalDetokenizer
from .params import CompletionOutput, Logprob, RequestOutput, SamplingParams, TokenDelta, is_int
from .pipeline import StepPipeline
from .sampling import needs_logits, observe, sample
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence
from .snapshot import KVSnapshot, model_digest

Prompt = Union[str, List[int]]
SP_PREFILL_MIN_TOKENS = 64  # a sequence computing at least this many tokens in a step uses the ring (sp > 1); measured: docs/performance.md


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(kw_only=True)
class EngineConfig:
    """Everything ``LLM`` is built with besides the model. ``tp``/``pp``/``sp``: tensor-,
    pipeline- and sequence-parallel ranks (``tp * pp * sp`` processes); ``kv_cache_memory`` is
    bytes *per rank*, ``gpu_memory_utilization`` (CUDA) sizes the cache from the device
    instead, ``num_blocks`` sets it (give at most one of the three); the block count is the
    minimum over ranks. ``timeout``: seconds a rank waits for its peers before it fails.
    ``compile_decode``: decode steps (on CPU, every step of 4 rows or more but ring-mode
    prefills) run through ``torch.compile`` (compiled when the engine starts; tp=1;
    ``parallel/compiled.py``, docs/engine.md)."""

    tp: int = 1
    pp: int = 1
    sp: int = 1
    pp_layers: Optional[Seq[int]] = None  # layers per pipeline stage (default: balanced)
    sp_prefill_min_tokens: int = SP_PREFILL_MIN_TOKENS
    block_size: int = 16  # tokens per block on one rank (a block-table entry holds block_size * sp)
    max_model_len: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    num_blocks: Optional[int] = None
    dtype: Optional[torch.dtype] = None  # or its name; default float32 on CPU, bfloat16 on CUDA
    tokenizer: object = None  # default: the model's own
    device: object = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    hash_fn: object = block_hash
    paged_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    timeout: Optional[float] = None
    compile_decode: bool = (
        False  # decode (CPU: also prefill) steps' dense parts through torch.compile
    )


class LLM:
    """The inference engine: ``LLM(model, EngineConfig(...))``, or the config's fields as
    keywords (``LLM(model, tp=2, block_size=32)``; keywords override a given config). See
    ``EngineConfig`` and the module docstring (how ranks start)."""

    def __init__(self, model, config: Optional[EngineConfig] = None, **settings):
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {unknown}; the settings are {sorted(names)}"
            )
        c = self.engine_config = replace(config or EngineConfig(), **settings)
        tp, pp, sp, block_size = c.tp, c.pp, c.sp, c.block_size
        kv_cache_memory, num_blocks, gpu_memory_utilization = (
            c.kv_cache_memory,
            c.num_blocks,
            c.gpu_memory_utilization,
        )
        max_model_len, dtype = c.max_model_len, c.dtype
        for name in ("tp", "pp", "sp", "block_size", "sp_prefill_min_tokens", "max_num_seqs"):
            _positive_int(name, getattr(c, name))
        if sum(x is not None for x in (kv_cache_memory, num_blocks, gpu_memory_utilization)) > 1:
            raise ValueError(
                "give one of kv_cache_memory (bytes per rank), gpu_memory_utilization or num_blocks"
            )
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
            )
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
            dtype = getattr(torch, dtype)
        self.dtype = dtype
        cfg, weights, tok = open_model(model)
        self.config, self.tokenizer = cfg, c.tokenizer if c.tokenizer is not None else tok
        # -- everything that can be wrong with the configuration, before any weight or cache
        check_tp(cfg, tp)
        quant.resolve(c.kv_cache_dtype)  # an unsupported kv_cache_dtype names the supported ones
        if not isinstance(c.compile_decode, bool):
            raise ValueError(f"compile_decode must be True or False, got {c.compile_decode!r}")
        if c.compile_decode and tp > 1:
            raise ValueError(
                f"compile_decode does not support tp={tp} (the tensor-parallel all-reduces sit inside "
                f"the layers' dense parts it compiles); use tp=1 (any pp and sp) or compile_decode=False"
            )
        shape = EngineShape(
            pp,
            sp,
            tp,
            tuple(c.pp_layers) if c.pp_layers is not None else None,
            block_size,
            c.sp_prefill_min_tokens,
            c.paged_backend,
            c.kv_cache_dtype,
            decode_buckets(c.max_num_seqs) if c.compile_decode else None,
        )
        self.stage_layers = shape.stage_sizes(cfg)  # also validates pp and pp_layers
        Cluster.mode_for(tp * pp * sp)  # a torch.distributed world of the wrong size
        budget = CacheBudget(
            num_blocks, kv_cache_memory, gpu_memory_utilization, c.max_num_batched_tokens
        )
        if (
            gpu_memory_utilization is None
        ):  # the cache size is known now: check it before loading anything
            self._check_capacity(
                num_blocks
                if num_blocks is not None
                else min(
                    int(kv_cache_memory or DEFAULT_KV_MEMORY)
                    // (shape.bytes_per_token(cfg, s, dtype) * block_size)
                    for s in range(pp)
                ),
                shape,
                max_model_len,
                kv_cache_memory,
            )
        self.shape = shape
        self.cluster = Cluster(
            shape,
            cfg,
            weights,
            model_arg=model,
            dtype=dtype,
            device=self.device,
            budget=budget,
            timeout=None if c.timeout is None else timedelta(seconds=c.timeout),
        )
        self._finalizer = weakref.finalize(self, self.cluster.close)
        self.num_blocks = self.cluster.num_blocks
        try:
            capacity = self._check_capacity(self.num_blocks, shape, max_model_len, kv_cache_memory)
        except ValueError:
            self.close()
            raise
        self.max_model_len = max_model_len or int(min(cfg.max_position_embeddings, capacity))
        # this process's share of the cache (None on a spawn-mode driver: every model rank is a worker)
        self.kv = self.cluster.worker.kv if self.cluster.worker is not None else None
        # which model a KV snapshot belongs to (config and sampled weights); the driver makes and takes snapshots
        self.digest = model_digest(cfg, weights) if self.cluster.is_driver else None
        self.blocks = BlockManager(
            self.num_blocks,
            block_size * sp,
            enable_prefix_caching=c.enable_prefix_caching,
            hash_fn=c.hash_fn,
        )
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            reclaim=lambda: migrate.reclaim(self),
        )
        self.pipeline = StepPipeline(self.scheduler, _Steps(self), depth=pp)
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._calls = itertools.count()
        self._max_prompt_chars: Optional[int] = None

    # the pipeline's book, under the names tests and tools used before it existed
    _active = property(lambda self: self.pipeline.active)
    _paused = property(lambda self: self.pipeline.paused)
    _staged = property(lambda self: self.pipeline.staged)

    @property
    def peak_in_flight(self) -> int:
        """Most steps in flight at once (pipeline parallelism keeps up to ``pp``)."""
        return self.pipeline.peak_in_flight

    @staticmethod
    def _check_capacity(
        num_blocks: int, shape: EngineShape, max_model_len: Optional[int], memory
    ) -> int:
        capacity = num_blocks * shape.block_size * shape.sp
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache of {memory} bytes per rank holds no block of {shape.block_size} tokens; "
                f"give more kv_cache_memory or a smaller block_size"
            )
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} needs more KV cache than the {num_blocks} blocks "
                f"of {shape.block_size * shape.sp} tokens ({capacity} tokens); raise "
                f"kv_cache_memory/num_blocks{', or sp' if shape.sp > 1 else ''}"
            )
        return capacity

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker processes this engine started (spawn mode); idempotent."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rank(self) -> int:
        return self.cluster.rank

    def kv_cache_info(self) -> dict:
        """The paged KV cache: ``block_size`` (tokens per block on a rank), ``tokens_per_block``
        (a block-table entry: ``block_size * sp`` tokens, striped over the SP ranks),
        ``num_blocks``, ``bytes_per_token`` (K and V of one token on this rank:
        ``2 x layers_on_stage x kv_heads_on_rank x head_dim x bytes``), ``capacity_tokens``
        (tokens the whole engine holds) and ``per_rank`` (each rank's layers, KV heads,
        bytes per token and allocated cache bytes)."""
        sh = self.shape
        return dict(
            block_size=sh.block_size,
            tokens_per_block=sh.block_size * sh.sp,
            num_blocks=self.num_blocks,
            bytes_per_token=self.cluster.worker.bytes_per_token
            if self.cluster.worker
            else self.cluster.infos[0]["bytes_per_token"],  # a spawn-mode driver: model rank 0's
            capacity_tokens=self.num_blocks * sh.block_size * sh.sp,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).replace("torch.", ""),
            kv_cache_dtype=sh.kv_cache_dtype,
            tp=sh.tp,
            pp=sh.pp,
            sp=sh.sp,
            per_rank=self.cluster.infos,
        )

    def rank_stats(self) -> List[dict]:
        """Per rank: ``kv_cache_info``'s fields plus steps run, seconds computing (``busy_s``) and
        seconds waiting for the previous pipeline stage (``wait_s``). Under torchrun every rank calls it."""
        return self.cluster.report()

    # -- stats -----------------------------------------------------------------------------
    @property
    def prefix_cache_hits(self) -> int:
        """Blocks served from the prefix cache so far."""
        return self.blocks.hits

    def publish_kv_events(self) -> KVEvents:
        """Start numbering the prefix cache's changes (``kv_events``; a router's index of which
        engine holds which blocks); idempotent. Returns the log."""
        if self.blocks.events is None:
            self.blocks.events = KVEvents()
        return self.blocks.events

    @property
    def kv_events(self) -> Optional[KVEvents]:
        """The prefix cache's changes (``publish_kv_events``), or None if they are not published."""
        return self.blocks.events

    def cached_blocks(self) -> List[bytes]:
        """The hashes of every block in the prefix cache (read it on the engine's thread)."""
        return list(self.blocks.by_hash)

    # -- requests --------------------------------------------------------------------------
    def encode(self, prompt, apply_chat_template: bool = False) -> List[int]:
        """The validated token ids of a prompt (a string, token ids, or chat messages: a list of
        ``{"role", "content"}`` dicts, always through the chat template); ``ValueError`` names
        what is wrong. Reads no engine state, so a server may call it off the engine's thread.
        Text that cannot fit in ``max_model_len`` tokens (longer than ``max_prompt_chars``) is
        refused before it is tokenized."""
        ids = self._tokenize(prompt, apply_chat_template)
        problem = self._check_ids(ids)
        if problem is not None:
            raise ValueError(problem)
        return ids

    @property
    def max_prompt_chars(self) -> int:
        """Characters of text past which a prompt cannot fit in ``max_model_len`` tokens: no token
        covers more characters than the longest string in the vocabulary, so longer text is
        refused without running the tokenizer (a multi-megabyte prompt costs nothing)."""
        if self._max_prompt_chars is None:
            longest = 1
            if self.tokenizer is not None and hasattr(self.tokenizer, "get_vocab"):
                longest = max(map(len, self.tokenizer.get_vocab()), default=1)
            self._max_prompt_chars = longest * self.max_model_len
        return self._max_prompt_chars

    def _tokenize(self, prompt, apply_chat_template: bool) -> List[int]:
        if (
            isinstance(prompt, (str, list, tuple))
            and prompt
            and all(isinstance(m, dict) for m in prompt)
        ):
            apply_chat_template, messages = True, list(prompt)
        elif isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(
                "string prompts need a tokenizer: pass tokenizer=... to LLM or give token ids"
            )
        chars = (
            sum(
                len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
                for m in messages
            )
            if apply_chat_template
            else len(prompt)
        )
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"prompt of {chars} characters cannot fit in max_model_len={self.max_model_len} "
                f"tokens (at most {self.max_prompt_chars} characters); shorten it"
            )
        if apply_chat_template:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return list(self.tokenizer.encode(prompt))

    def _make(
        self,
        prompt,
        params: SamplingParams,
        apply_chat_template: bool,
        cache_salt=None,
        request_id=None,
    ) -> List[Sequence]:
        """The ``n`` samples of a request; one sequence finished with an error if it is invalid."""
        ids: List[int] = []
        problem = (
            params.problem()
            if isinstance(params, SamplingParams)
            else f"sampling params must be a SamplingParams, got {type(params).__name__}"
        )
        if problem is None:
            if not isinstance(prompt, (str, list, tuple)):
                problem = f"a prompt must be a str, a list of token ids or chat messages, got {type(prompt).__name__}"
            else:
                try:
                    ids = self.encode(prompt, apply_chat_template)
                except ValueError as e:
                    problem = str(e)
                except (TypeError, KeyError, AttributeError) as e:  # e.g. malformed chat messages
                    problem = f"invalid prompt: {e}"
        rid = self.pipeline.new_id() if request_id is None else request_id
        if problem is not None:
            seq = Sequence(
                seq_id=rid if isinstance(rid, int) else 0,
                prompt=prompt,
                prompt_token_ids=[],
                params=SamplingParams(),
                cache_salt=cache_salt,
                request_id=rid,
            )
            seq.prompt_token_ids = ids
            seq.finish("error", problem)
            return [seq]
        seqs = [
            Sequence(
                seq_id=self.pipeline.new_id(),
                prompt=prompt,
                prompt_token_ids=ids,
                params=params,
                cache_salt=cache_salt,
                index=i,
                request_id=rid,
            )
            for i in range(params.n)
        ]
        seqs[0].siblings = seqs[1:]
        return seqs

    def _check_ids(self, ids) -> Optional[str]:
        if not ids:
            return "empty prompt: give at least one token"
        if (
            len(ids) >= self.max_model_len
        ):  # before any per-token check: a huge prompt costs nothing more
            return (
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        if not all(map(is_int, ids)):
            return "prompt token ids must be ints"
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})"
        return None

    # -- the step API (what generate, stream and the server use) -----------------------------
    def add_request(
        self,
        prompt,
        params: Optional[SamplingParams] = None,
        *,
        request_id=None,
        cache_salt: Optional[str] = None,
        apply_chat_template: bool = False,
    ):
        """Queue a request (a string, token ids or chat messages); returns its id. An invalid
        request raises ``ValueError`` and changes nothing."""
        if request_id is not None and self.pipeline.known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = self._make(
            prompt,
            SamplingParams() if params is None else params,
            apply_chat_template,
            cache_salt,
            request_id,
        )
        if seqs[0].finished:
            raise ValueError(seqs[0].error)
        self.pipeline.add(seqs)
        return seqs[0].request_id

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has anything left to do or to report."""
        return self.pipeline.has_unreported or any(
            not s.finished for seqs in self._active.values() for s in seqs
        )

    def abort_request(self, request_id) -> bool:
        """Stop a request and free its blocks (also one stopped by an export, or staged by an
        import); False if it is unknown or already finished."""
        return self.pipeline.abort(request_id)

    def step(self, delta: bool = False) -> List[RequestOutput]:
        """Advance the engine by one finished step (see ``_advance``); returns the requests that
        got a token (or finished), in the order of their sequences. A finished request is
        returned one last time and forgotten. ``delta=True``: each output holds only what is
        new since the request's previous output (token ids, text, log-probs): no per-step copy
        that grows with the output (what a serving loop wants)."""
        if self.pipeline.busy:
            self._advance()
        # also what other calls (generate, a stream) advanced
        return [self._output(seqs, delta) for _, seqs in self.pipeline.reports()]

    # -- migration (engine/migrate.py) -------------------------------------------------------
    def export_request(
        self, request_id, *, since: Optional[KVSnapshot] = None, stop: bool = True
    ) -> KVSnapshot:
        """A ``KVSnapshot`` of a running request (tokens, sampler state, the K/V of its computed
        tokens gathered from every rank; ``since``: only what was computed after that earlier
        snapshot). ``stop=True`` takes it out of this engine's scheduler but keeps its blocks
        until ``abort_request`` (after a successful import elsewhere) or ``resume_request``.
        Any mesh; under torchrun every rank makes the call and ranks > 0 get None."""
        return self._migration(migrate.export_request, request_id, since, stop)

    def import_request(self, snapshot: KVSnapshot, *, cache_prefix: bool = False):
        """Continue a request exported by another engine (same model and KV dtype; any mesh and
        block size): its K/V are scattered to this engine's ranks. A snapshot without ``final``
        (``stop=False``) is staged until the final one; incremental snapshots must come in
        order. Every field is checked first: a bad snapshot is a ``ValueError`` naming it, and
        nothing changes. The imported K/V (and what is computed on top of them) stay out of
        the prefix cache unless ``cache_prefix=True`` (you trust the sender). Returns the
        request id. Under torchrun every rank makes the call (ranks > 0 may pass None: only rank
        0's snapshot is read) and ranks > 0 get None."""
        return self._migration(migrate.import_request, snapshot, cache_prefix)

    def _migration(self, fn, *args):
        """Torchrun: rank 0 runs ``fn`` (the other ranks store or send their K/V meanwhile) and
        then ends the call on every rank; a failure there is raised on every rank."""
        if not self.cluster.is_driver:
            end = self.cluster.follow()
            if end.get("error"):
                raise RuntimeError(f"rank 0 failed to migrate the request: {end['error']}")
            return None
        try:
            out = fn(self, *args)
        except BaseException as e:
            if not self.cluster.broken:
                self.cluster.end({"error": f"{type(e).__name__}: {e}"})
            raise
        self.cluster.end({})
        return out

    def resume_request(self, request_id) -> None:
        """Run a request stopped by ``export_request`` here again (its import failed)."""
        migrate.resume_request(self, request_id)

    # -- the loop --------------------------------------------------------------------------
    def _advance(self) -> List[Sequence]:
        """One step of the pipeline (``StepPipeline.advance``). Returns the sequences that got a token."""
        if not self.cluster.is_driver:
            raise RuntimeError(
                "only rank 0 drives the engine; other torchrun ranks call generate/stream like rank 0"
            )
        self.cluster.ensure_usable()
        with deferred_interrupt():  # a Ctrl-C takes effect between steps, never inside one
            return self.pipeline.advance()

    def _append(self, seq: Sequence, token: int, logprob=None) -> None:
        """Add a sampled token, its text, and decide whether the sequence is done."""
        p = seq.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        observe(seq, token)
        stops = p.stop_strings if self.tokenizer is not None else []
        if self.tokenizer is not None:
            seq.detok = seq.detok or IncrementalDetokenizer(self.tokenizer)
            piece = seq.detok.step(seq.output_token_ids)
            seq.text += piece
            if stops:  # only a stop string that overlaps the new text can be new
                start = max(0, len(seq.text) - len(piece) - max(map(len, stops)) + 1)
                hits = [i for i in (seq.text.find(x, start) for x in stops) if i >= 0]
                if hits:
                    seq.text = seq.text[: min(hits)]
                    seq.finish("stop")
        if not seq.finished:
            if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
                seq.finish("stop")
            elif (
                seq.num_tokens - len(seq.prompt_token_ids) >= p.max_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                seq.finish("length")
            if seq.finished and self.tokenizer is not None:  # a character the last tokens left open
                seq.text += seq.detok.flush(seq.output_token_ids)
        # release the new text, but hold back what could still turn out to start a stop string
        hold = 0 if seq.finished or not stops else max(map(len, stops)) - 1
        upto = max(seq.emitted, len(seq.text) - hold)
        seq.deltas.append(seq.text[seq.emitted : upto])
        seq.emitted = upto

    def _drain(self) -> None:
        """Finish the steps still in flight after an interruption: every request still running
        keeps its tokens (aborted ones are finished first, so theirs are dropped)."""
        with deferred_interrupt():
            self.pipeline.drain(lambda: not self.cluster.broken)

    def run(self, batch: List[Scheduled]) -> torch.Tensor:
        """Compute one scheduled batch now; fp32 logits ``(M, vocab)`` of its completing rows
        (for tests that drive the scheduler by hand)."""
        self.cluster.submit(batch, "logits")
        out = self.cluster.result()
        return out.main if out is not None else torch.zeros(0, self.config.vocab_size)

    @property
    def runner(self) -> "LLM":
        return self

    def _agree_call(self, *call) -> None:
        """Torchrun: every rank must make the same call (same prompts and parameters). A broken
        engine fails here at once, before any rank waits on it (``Cluster.exchange``)."""
        self.cluster.ensure_usable()
        if self.cluster.mode != "torchrun":
            return
        mine = hashlib.sha256(json.dumps(call, sort_keys=True, default=repr).encode()).hexdigest()
        for r, theirs in enumerate(self.cluster.exchange(f"call{next(self._calls)}", mine)):
            if theirs != mine:
                raise ValueError(
                    f"rank {r} called the engine with other prompts or parameters than rank "
                    f"{self.rank}; under torchrun every rank must make the same call"
                )

    def _output(self, seqs: List[Sequence], delta: bool = False) -> RequestOutput:
        outs = []
        for s in seqs:
            k = s.reported if delta else 0  # output tokens already reported
            start = len(s.prompt_token_ids) + k
            text = "".join(s.deltas[k:]) if delta else s.text
            lps = s.logprobs[k:] if s.params.logprobs is not None else None
            outs.append(
                CompletionOutput(
                    index=s.index,
                    token_ids=s.token_ids[start:],
                    text=text,
                    finish_reason=s.finish_reason,
                    logprobs=lps,
                )
            )
            if delta:
                s.reported = s.num_tokens - len(s.prompt_token_ids)
        first = seqs[0]
        plp = (
            None if delta and first.reported_prompt else first.prompt_logprobs
        )  # delta: in the first output
        ptop = None if plp is None else first.prompt_top
        first.reported_prompt = first.reported_prompt or delta
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            token_ids=outs[0].token_ids,
            text=outs[0].text,
            finish_reason=outs[0].finish_reason,
            error=first.error,
            num_cached_tokens=first.num_cached_tokens or 0,
            logprobs=outs[0].logprobs,
            outputs=outs,
            prompt_logprobs=plp,
            prompt_top_logprobs=ptop,
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
                f"got {len(salts)} cache salts for {len(prompts)} prompts; give one, or one per prompt"
            )
        return [
            self._make(p, sp, apply_chat_template, salt)
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
        if not self.cluster.is_driver:
            return [_output_from_json(o) for o in self.cluster.follow()["outputs"]]
        for g in groups:
            self.pipeline.add(g)
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
                self._advance()
                if bar is not None:
                    bar.update(sum(all(s.finished for s in g) for g in groups) - bar.n)
        except BaseException as e:
            self._abort(live, e)
            raise
        finally:
            if bar is not None:
                bar.close()
            for g in groups:
                self.pipeline.forget(g[0].request_id)
        outs = [self._output(g) for g in groups]
        self.cluster.end({"outputs": [asdict(o) for o in outs]})
        return outs

    def _abort(self, live: List[Sequence], e: Optional[BaseException]) -> None:
        """Leave the engine clean for the next call after an interruption or failure: the call's
        own requests (``live``) are aborted, every other request goes on (``e``: torchrun
        followers are told, and raise too)."""
        self.pipeline.finish(live, "error", "aborted")
        self._drain()
        if e is not None:
            self.cluster.abort(f"{type(e).__name__}: {e}")

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
        if not self.cluster.is_driver:
            end = self.cluster.follow()
            yield from (TokenDelta(*d) for d in end["deltas"])
            if end.get("error"):
                raise RuntimeError(end["error"])
            return
        self.pipeline.add(group[0])
        sent = []
        try:
            while True:
                while len(sent) < len(seq.deltas):  # one delta per token, whoever advanced it
                    i = len(sent)
                    last = seq.finished and i == len(seq.deltas) - 1
                    sent.append(
                        (
                            seq.output_token_ids[i],
                            seq.deltas[i],
                            seq.finish_reason if last else None,
                        )
                    )
                    yield TokenDelta(*sent[-1])
                if seq.finished:
                    break
                self._advance()
        except GeneratorExit:  # the consumer stopped early
            self._abort(group[0], None)
            self.cluster.end({"deltas": sent})
            raise
        except BaseException as e:
            self._abort(group[0], e)
            raise
        finally:
            self.pipeline.forget(seq.request_id)
        failed = seq.error if seq.finish_reason == "error" else None
        self.cluster.end({"deltas": sent, "error": failed})
        if failed:
            raise RuntimeError(failed)


class _Steps:
    """What a step computes for ``LLM`` (the pipeline's executor): the ranks run it
    (``parallel.Cluster``), the driver samples and appends the tokens."""

    def __init__(self, llm: LLM):
        self.llm, self.cluster = llm, llm.cluster

    def submit(self, batch: List[Scheduled]) -> None:
        want = (
            "logits" if any(needs_logits(s.seq.params) for s in batch if s.completes) else "tokens"
        )
        self.cluster.submit(batch, want)

    def result(self, batch: List[Scheduled]):
        return self.cluster.result()

    def tokens(self, batch: List[Scheduled], result) -> list:
        """The step's prompt log-probs written into their sequences, then ``(seq, (token,
        logprob) or the exception sampling it raised)`` per completing sequence."""
        if result is not None and result.prompt_logprobs is not None:
            rows = iter(
                result.prompt_logprobs.tolist()
            )  # floats, or [value, top ids..., top values...]
            for s in batch:
                k = s.seq.params.prompt_logprobs or 0
                for j in range(s.targets):
                    row = next(rows)
                    if isinstance(row, float):
                        s.seq.prompt_logprobs[s.start + j] = row  # of prompt token start + j + 1
                        continue
                    top = (len(row) - 1) // 2
                    s.seq.prompt_logprobs[s.start + j] = row[0]
                    if k:
                        s.seq.prompt_top[s.start + j] = [
                            (int(t), v) for t, v in zip(row[1 : 1 + k], row[1 + top : 1 + top + k])
                        ]
        done = [s.seq for s in batch if s.completes]
        return list(zip(done, self._sample(result, done)))

    @staticmethod
    def _sample(result, seqs: List[Sequence]) -> list:
        if result is None:
            return []
        if result.main.dtype == torch.long:
            return [(t, None) for t in result.main.tolist()]
        try:
            return list(zip(*sample(result.main, seqs)))
        except Exception:  # noqa: BLE001 - find the rows that fail; the others are sampled alone
            out = []
            for i, seq in enumerate(seqs):
                try:
                    out.append(next(zip(*sample(result.main[i : i + 1], [seq]))))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out

    def append(self, seq: Sequence, picked) -> None:
        self.llm._append(seq, *picked)

    def idle(self) -> None:
        self.cluster.park()


def _output_from_json(d: dict) -> RequestOutput:
    """A ``RequestOutput`` as ``asdict`` wrote it (torchrun followers get the driver's outputs)."""
    lp = lambda xs: (
        None
        if xs is None
        else [
            Logprob(x["token_id"], x["logprob"], [tuple(t) for t in x["top"]])  # noqa: E731
            for x in xs
        ]
    )
    outs = [
        CompletionOutput(**dict(o, logprobs=lp(o["logprobs"]))) for o in d.pop("outputs")
    ]  # prompt_logprobs: floats
    top = d.get("prompt_top_logprobs")
    top = None if top is None else [None if x is None else [tuple(t) for t in x] for x in top]
    return RequestOutput(
        **dict(d, logprobs=lp(d["logprobs"]), outputs=outs, prompt_top_logprobs=top)
    )
