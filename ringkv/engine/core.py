"""``EngineCore``: what runs requests, under the ``LLM`` facade.

It owns the model's ranks (``parallel.Cluster``), the block manager, the scheduler and the step
pipeline (``pipeline.py``, whose book says where each request is), with the executor that sends
each step to the ranks and samples on the driver; its ``OutputProcessor`` (``output.py``) turns
the sampled tokens into text, stop decisions and ``RequestOutput`` objects; its ``Migration``
(``migrate.py``) exports and imports running requests. The core checks requests (``encode``,
``make_request``), admits them (``add_request``) and advances the pipeline one step
(``advance``). Calls that every torchrun rank makes together (``generate``, ``stream``, the
migration calls) are the facade's.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Callable, List, Optional, Sequence as Seq, Union

import torch

from ..cache.block_manager import STORED, BlockManager, KVEvents, block_hash
from ..cache.disk_tier import DiskTier
from ..cache.state_pool import StateSlots, snapshot_slots, state_bytes
from ..cache.tiers import EntryLayout, TierStore, default_host_bytes
from ..kernels import quant
from ..model.loader import open_model
from ..parallel.autocompile import SWITCH
from ..parallel.compiled import decode_buckets
from ..parallel.launch import DEFAULT_KV_MEMORY, CacheBudget, Cluster, deferred_interrupt
from ..parallel.tp import check_tp
from ..parallel.worker import EngineShape
from .flags import GIB, knob
from .hybrid import check_hybrid
from .migrate import Migration
from .output import OutputProcessor
from .params import SamplingParams, is_int
from .pipeline import StepPipeline
from .sampling import needs_logits, observe, sample
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence
from .snapshot import model_digest

DEFAULT_KV_DISK_SIZE = 16 << 30  # bytes of the disk tier when kv_disk is given alone
SP_PREFILL_MIN_TOKENS = 64  # a sequence computing at least this many tokens in a step uses the
# ring (sp > 1); measured: docs/performance.md


def with_settings(cls, config, settings: dict, caller: str):
    """``config`` (an instance of the dataclass ``cls``; None: its defaults) with ``settings``
    (keywords naming its fields) applied: how ``LLM(model, config, **settings)`` reads its
    arguments. ``TypeError`` for a config of another type or an unknown keyword (the message
    lists the settings)."""
    if config is not None and not isinstance(config, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"config must be {article} {cls.__name__}, got {type(config).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword argument(s) {unknown}; the settings are "
            f"{sorted(names)}"
        )
    return replace(config or cls(), **settings)


def _check_tiers(c: "EngineConfig") -> None:
    for name, v in (("kv_host_memory", c.kv_host_memory), ("kv_disk_size", c.kv_disk_size)):
        least = 0 if name == "kv_host_memory" else 1
        if v is not None and (not is_int(v) or v < least):
            raise ValueError(f"{name} must be an int number of bytes >= {least}, got {v!r}")
    if c.kv_disk is not None and (not isinstance(c.kv_disk, str) or not c.kv_disk):
        raise ValueError(f"kv_disk must be a directory path, got {c.kv_disk!r}")
    if c.kv_disk_size is not None and c.kv_disk is None:
        raise ValueError("kv_disk_size needs kv_disk (the directory of the disk tier)")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_config(c: "EngineConfig") -> None:
    """The checks of a config that need no model: counts, tiers, one KV cache size."""
    for name in ("tp", "pp", "sp", "block_size", "sp_prefill_min_tokens", "max_num_seqs"):
        _positive_int(name, getattr(c, name))
    _check_tiers(c)
    sizes = (c.kv_cache_memory, c.num_blocks, c.gpu_memory_utilization)
    if sum(x is not None for x in sizes) > 1:
        raise ValueError(
            "give one of kv_cache_memory (bytes per rank), gpu_memory_utilization or num_blocks"
        )
    g = c.gpu_memory_utilization
    if g is not None and not 0 < g <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")


def _model_dtype(dtype, device: torch.device) -> torch.dtype:
    """``dtype`` (a torch.dtype, its name, or None: float32 on CPU, bfloat16 elsewhere)."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        return getattr(torch, dtype)
    return dtype


@dataclass(kw_only=True)
class EngineConfig:
    """Everything ``LLM`` is built with besides the model. ``tp``/``pp``/``sp``: tensor-,
    pipeline- and sequence-parallel ranks (``tp * pp * sp`` processes); ``kv_cache_memory`` is
    bytes *per rank*, ``gpu_memory_utilization`` (CUDA) sizes the cache from the device
    instead, ``num_blocks`` sets it (give at most one of the three); the block count is the
    minimum over ranks. ``timeout``: seconds a rank waits for its peers before it fails.
    ``compile_decode``: decode steps (on CPU, every step of 4 rows or more but ring-mode
    prefills) run compiled (CPU: AOTInductor packages, CUDA: ``torch.compile``; built or loaded
    when the engine starts; tp=1; ``parallel/compiled.py``, docs/engine.md). ``"auto"``, the
    default since issue #60 (before: False), compiles where a first-use check on this machine,
    model and thread count finds the compiled step faster, its verdict and the compiled artifacts
    cached on disk (``parallel/autocompile.py``): the first start on a machine pays the build and
    the check, later ones load both; where it cannot compile (tp > 1, a GPU) it runs eager and
    ``kv_cache_info()["compile"]`` says why. True forces compiling, False never compiles.

    Each field carries its default, its help and its ``ringkv generate`` / ``ringkv serve``
    flag (``flags.knob``; ``cli=False``: a Python-only setting); sizes are bytes here, GiB on
    the command line. Fields are in the order of the flags in ``--help``."""

    # a torch.dtype or its name; default float32 on CPU, bfloat16 on CUDA
    dtype: Optional[torch.dtype] = knob(
        None, "float32 / bfloat16 / float16 (default: float32 on CPU)"
    )
    tokenizer: object = knob(None, "default: the model's own", cli=False)
    device: object = knob(None, "default: cuda if available, else cpu", cli=False)
    kv_cache_memory: Optional[int] = knob(None, "KV cache size in GiB per rank", unit=GIB)
    gpu_memory_utilization: Optional[float] = knob(
        None,
        "CUDA: the fraction of the device the process may use, measured after the weights and "
        "one profiling forward; sizes the KV cache",
        cli=False,
    )
    num_blocks: Optional[int] = knob(None, "KV cache blocks (instead of a size)", cli=False)
    # the prefix cache's tiers off the device (cache/tiers.py): host bytes (None: as large as the
    # device pool; 0: off), a disk directory (None: off) and its bound in bytes
    kv_host_memory: Optional[int] = knob(
        None,
        "GiB of host memory for prefix-cache blocks evicted from the KV cache (default: as "
        "large as the KV cache; 0: off)",
        unit=GIB,
    )
    kv_disk: Optional[str] = knob(
        None,
        "keep blocks evicted from the host tier in files under DIR (an instance with an "
        "--instance-id, as each replica of --replicas, uses DIR/<id>; default: off)",
        metavar="DIR",
    )
    kv_disk_size: Optional[int] = knob(None, "GiB bound of the disk tier (default 16)", unit=GIB)
    tp: int = knob(1, "tensor-parallel ranks (attention heads split)")
    pp: int = knob(1, "pipeline-parallel ranks (layers split)")
    sp: int = knob(1, "sequence-parallel ranks (ring prefill, KV striped)")
    pp_layers: Optional[Seq[int]] = knob(None, "layers per pipeline stage", nargs="+")  # balanced
    # a block-table entry holds block_size * sp tokens
    block_size: int = knob(16, "KV cache tokens per block on a rank")
    max_model_len: Optional[int] = knob(None, None)
    max_num_seqs: int = knob(64, "requests computed at once")
    max_num_batched_tokens: int = knob(2048, "tokens per step (chunked prefill)")
    enable_prefix_caching: bool = knob(True, "reuse the K/V of cached prompt prefixes", cli=False)
    hash_fn: object = knob(block_hash, "the prefix cache's block hash", cli=False)
    kv_cache_dtype: str = knob("auto", "auto (the model's), fp8 (= fp8_e4m3), fp8_e5m2 or int8")
    paged_backend: str = knob("auto", "the paged attention backend", cli=False)
    sp_prefill_min_tokens: int = knob(
        SP_PREFILL_MIN_TOKENS,
        "tokens a sequence computes in a step before the ring splits them over the SP ranks",
    )
    state_checkpoint_blocks: Optional[int] = knob(
        None,
        "hybrid models: snapshot the recurrent state for the prefix cache every N KV blocks "
        "(default: the fewest blocks whose K/V weigh as much as one snapshot)",
        metavar="N",
    )
    state_dtype: str = knob(
        "float32",
        "hybrid models: the recurrent state's dtype in the pool and its snapshots (float32, "
        "bfloat16 or float16; each step computes in float32 from it)",
    )
    compile_decode: Union[bool, str] = knob(
        "auto",
        "auto (the default), true or false (the flag alone: true): run decode steps' dense "
        "parts (on CPU, prefill steps' too) compiled, built at start-up, tp=1 only; auto compiles "
        "where a first-use check on this machine finds it faster (the build and the verdict are "
        "cached: a first start on a machine takes longer)",
        choices=("auto", "true", "false"),
        nargs="?",
        const="true",
    )
    timeout: Optional[float] = knob(
        None, "seconds a rank waits for its peers before it fails", cli=False
    )


def _compile_mode(value) -> str:
    """``compile_decode`` as ``"on"``, ``"off"`` or ``"auto"`` (True, False, "auto", or the
    command line's "true"/"false")."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": "on", "false": "off"}[value.lower()]
    raise ValueError(f"compile_decode must be True, False or 'auto', got {value!r}")


class EngineCore:
    """The engine without its calling conventions (see the module docstring), built from a
    model and an ``EngineConfig`` (checked here). ``digest(config, weights)`` names the model
    in KV snapshots (``snapshot.model_digest``)."""

    def __init__(self, model, config: EngineConfig, *, digest: Callable = model_digest):
        c = self.engine_config = config
        _check_config(c)
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _model_dtype(c.dtype, self.device)
        cfg, weights, tok = open_model(model)
        self.config, self.tokenizer = cfg, c.tokenizer if c.tokenizer is not None else tok
        self.shape = self._make_shape(c)  # every check of the configuration, before any load
        self.stage_layers = self.shape.stage_sizes(cfg)
        self.cluster = self._make_cluster(model, c, weights)
        self._finalizer = weakref.finalize(self, self.cluster.close)
        self.num_blocks = self.cluster.num_blocks
        try:
            capacity = self._check_capacity(
                self.num_blocks, self.shape, c.max_model_len, c.kv_cache_memory
            )
        except ValueError:
            self.close()
            raise
        self.max_model_len = c.max_model_len or int(min(cfg.max_position_embeddings, capacity))
        # this process's share of the cache (None on a spawn-mode driver: every model rank is a
        # worker)
        self.kv = self.cluster.worker.kv if self.cluster.worker is not None else None
        # which model a KV snapshot belongs to (config and sampled weights); the driver makes and
        # takes snapshots
        self.digest = digest(cfg, weights) if self.cluster.is_driver else None
        # the K/V as a snapshot carries them: the quantized format, else the model dtype's name
        self.kv_storage = (
            self.shape.kv_cache_dtype if self.shape.quant else str(self.dtype).replace("torch.", "")
        )
        self.state_dtype = self.shape.state_dtype  # a hybrid's recurrent state (else unused)
        self.blocks = BlockManager(
            self.num_blocks,
            c.block_size * c.sp,
            enable_prefix_caching=c.enable_prefix_caching,
            hash_fn=c.hash_fn,
        )
        self.tiers = self._make_tiers(c)  # evicted prefix blocks kept in host memory / on disk
        if self.tiers is not None:
            self.blocks.attach_tiers(self.tiers)
        if self.shape.state_slots:  # a hybrid model: the recurrent states' slots and snapshots
            every = self.shape.checkpoint_blocks
            snapshots = snapshot_slots(self.num_blocks, c.max_num_seqs, every)
            self.blocks.attach_states(StateSlots(c.max_num_seqs, snapshots, every or 1))
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
        )
        self.output = self._make_output()
        self.pipeline = StepPipeline(self.scheduler, _Steps(self.cluster, self.output), depth=c.pp)
        self.migration = self._make_migration()  # export / import of requests and prefixes
        self.scheduler.reclaim = self.migration.reclaim  # held requests' blocks, when short
        self._max_prompt_chars: Optional[int] = None

    # -- the parts, built in order -----------------------------------------------------------
    def _make_shape(self, c: EngineConfig) -> EngineShape:
        """The mesh and cache layout of every rank, once everything that can be wrong with the
        configuration is checked against the model (tp, the KV dtype, compile_decode, the
        stages, the world size, the cache capacity when it is known before loading)."""
        cfg, tp = self.config, c.tp
        check_tp(cfg, tp)
        quant.resolve(c.kv_cache_dtype)  # an unsupported kv_cache_dtype names the supported ones
        mode = _compile_mode(c.compile_decode)
        if mode == "on" and tp > 1:
            raise ValueError(
                f"compile_decode does not support tp={tp} (the tensor-parallel all-reduces sit "
                f"inside the layers' dense parts it compiles); use tp=1 (any pp and sp) or "
                f"compile_decode=False"
            )
        why = ""  # "auto" where compiling cannot run: eager, and kv_cache_info() says why
        if mode == "auto" and os.environ.get(SWITCH) == "0":  # (the test suite's setting)
            why = f"eager: {SWITCH}=0"
        elif mode == "auto" and tp > 1:
            why = f"eager: tp={tp} (compile_decode supports tp=1 only)"
        elif mode == "auto" and self.device.type != "cpu":
            why = (
                f"eager: the compiled path is untested on {self.device.type} "
                f"(compile_decode=True forces it)"
            )
        hybrid = check_hybrid(cfg, c, self.dtype)
        shape = EngineShape(
            c.pp,
            c.sp,
            tp,
            tuple(c.pp_layers) if c.pp_layers is not None else None,
            c.block_size,
            c.sp_prefill_min_tokens,
            c.paged_backend,
            c.kv_cache_dtype,
            decode_buckets(c.max_num_seqs) if mode == "on" or mode == "auto" and not why else None,
            **hybrid,
            compile_mode=mode,
            compile_why=why or ("" if mode != "off" else "compile_decode=False"),
        )
        shape.stage_sizes(cfg)  # validates pp and pp_layers
        Cluster.mode_for(tp * c.pp * c.sp)  # a torch.distributed world of the wrong size
        if c.gpu_memory_utilization is None and not hybrid:  # the size is known: check it now
            self._check_capacity(
                c.num_blocks
                if c.num_blocks is not None
                else min(
                    int(c.kv_cache_memory or DEFAULT_KV_MEMORY)
                    // (shape.bytes_per_token(cfg, s, self.dtype) * c.block_size)
                    for s in range(c.pp)
                ),
                shape,
                c.max_model_len,
                c.kv_cache_memory,
            )
        return shape

    def _make_cluster(self, model, c: EngineConfig, weights) -> Cluster:
        """The model's ranks, loaded, with their KV caches."""
        return Cluster(
            self.shape,
            self.config,
            weights,
            model_arg=model,
            dtype=self.dtype,
            device=self.device,
            budget=CacheBudget(
                c.num_blocks, c.kv_cache_memory, c.gpu_memory_utilization, c.max_num_batched_tokens
            ),
            timeout=None if c.timeout is None else timedelta(seconds=c.timeout),
        )

    def _make_output(self) -> OutputProcessor:
        """The output processor, with the model's and the tokenizer's EOS ids."""
        eos_ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        return OutputProcessor(self.tokenizer, eos_ids, self.max_model_len)

    def _make_migration(self) -> Migration:
        """The migration calls, handed the parts they use."""
        return Migration(
            self.pipeline,
            self.cluster,
            self.output,
            self.tiers,
            drain=self.drain,
            digest=self.digest,
            kv_storage=self.kv_storage,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            state_dtype=self.state_dtype,
        )

    def _make_tiers(self, c: EngineConfig) -> Optional[TierStore]:
        """The host and disk tiers of the prefix cache (None if both are off): on the driver,
        whose block manager decides; every rank's K/V move through the cluster's
        ``read_kv``/``write_kv``."""
        host, disk = c.kv_host_memory, c.kv_disk
        if not c.enable_prefix_caching or not self.cluster.is_driver:
            return None
        mover, tpb = self.cluster.mover, self.shape.block_size * self.shape.sp
        layout = EntryLayout(mover.shape, tpb, mover.dtype, mover.scale_dtype)
        if host is None:  # as large as the device pool, within the host's memory
            host = default_host_bytes(self.num_blocks * layout.nbytes)
        if host < layout.nbytes and disk is None:  # not one entry
            return None
        return TierStore(
            host_bytes=host,
            layout=layout,
            read_kv=self.cluster.read_kv,
            write_kv=self.cluster.write_kv,
            disk=None
            if disk is None
            else DiskTier(
                disk,
                c.kv_disk_size or DEFAULT_KV_DISK_SIZE,
                model=self.digest,
                kv_cache_dtype=self.kv_storage,
                tokens_per_block=tpb,
                shape=mover.shape,
                state_elems=state_bytes(mover.state_shapes) // 4,
                state_dtype=self.state_dtype,
            ),
            pinned=self.device.type == "cuda",
            read_state=self.cluster.read_state,  # a hybrid's snapshots go along
            write_state=self.cluster.write_state,
        )

    @staticmethod
    def _check_capacity(
        num_blocks: int, shape: EngineShape, max_model_len: Optional[int], memory
    ) -> int:
        capacity = num_blocks * shape.block_size * shape.sp
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache of {memory} bytes per rank holds no block of {shape.block_size} "
                f"tokens; give more kv_cache_memory or a smaller block_size"
            )
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} needs more KV cache than the {num_blocks} blocks "
                f"of {shape.block_size * shape.sp} tokens ({capacity} tokens); raise "
                f"kv_cache_memory/num_blocks{', or sp' if shape.sp > 1 else ''}"
            )
        return capacity

    # -- lifecycle and stats ---------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker processes this engine started (spawn mode); idempotent."""
        if self.tiers is not None:
            self.tiers.close()
        self._finalizer()

    @property
    def rank(self) -> int:
        return self.cluster.rank

    def kv_cache_info(self) -> dict:
        """The paged KV cache: ``block_size`` (tokens per block on a rank), ``tokens_per_block``
        (a block-table entry: ``block_size * sp`` tokens, striped over the SP ranks),
        ``num_blocks``, ``bytes_per_token`` (K and V of one token on this rank:
        ``2 x layers_on_stage x kv_heads_on_rank x head_dim x bytes``), ``capacity_tokens``
        (tokens the whole engine holds), ``per_rank`` (each rank's layers, KV heads,
        bytes per token and allocated cache bytes) and ``tiers``: the prefix cache's blocks per
        tier, ``device`` (``blocks`` in use, ``cached`` registered, ``capacity``, ``promotions``
        from the tiers below), ``host`` and ``disk`` (``blocks``, ``bytes``,
        ``capacity_bytes``; the disk's ``enabled`` and ``error``), None where a tier is off;
        ``state``: a hybrid model's recurrent state (``_state_info``; None for a dense model);
        ``compile``: what ``compile_decode`` decided and why (``compile_info``).
        A hybrid's ``bytes_per_token`` counts its attention layers only."""
        b = self.blocks
        tiers = dict(
            device=dict(
                blocks=b.num_blocks - b.num_free,
                cached=len(b.by_hash),
                capacity=b.num_blocks,
                promotions=b.promotions,
            ),
            **(self.tiers.usage() if self.tiers is not None else dict(host=None, disk=None)),
        )
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
            tiers=tiers,
            state=self._state_info(),
            compile=self.compile_info(),
        )

    def compile_info(self) -> dict:
        """``compile_decode``'s outcome (the first model rank's; every rank took the same
        decision, each rank's is in ``per_rank``): ``mode`` (``"auto"``, ``"on"``, ``"off"``),
        ``on``, ``by`` (``"compile_decode=True"``, ``"auto (measured)"``, ``"auto (cached
        verdict)"``, ``"RINGKV_COMPILE_DECODE=0"``/``=1``), ``why`` it runs eager, ``verdict``
        (the check's ``rows``, ``compiled_ms``, ``eager_ms``, when and under what load), the
        cache ``key``, ``dir`` and ``parts``, ``artifacts`` (``cold``, ``warm`` or
        ``rebuilt (why)``) and ``compile_s`` (parallel/autocompile.py)."""
        infos = self.cluster.infos
        info = dict(infos[0].get("compile") or {}) if infos else {}
        info.pop("vote", None)
        return info

    def _state_info(self) -> Optional[dict]:
        """A hybrid model's recurrent state (None for a dense model): slots for running
        sequences and snapshots (``StateSlots.usage``), the bytes of one sequence's state and of
        the pools over the pipeline stages and TP ranks (each holds its heads' part; every SP rank
        holds the same as SP rank 0), and their ``dtype``."""
        states = self.blocks.states
        if states is None:
            return None
        stages = [i for i in self.cluster.infos if i["sp_rank"] == 0]
        return dict(
            states.usage(),
            bytes_per_sequence=sum(i["state_bytes_per_slot"] for i in stages),
            bytes=sum(i["state_cache_bytes"] for i in stages),
            dtype=self.shape.state_dtype,
        )

    def rank_stats(self) -> List[dict]:
        """Per rank: ``kv_cache_info``'s fields plus steps run, seconds computing (``busy_s``) and
        seconds waiting for the previous pipeline stage (``wait_s``). Under torchrun every rank
        calls it."""
        return self.cluster.report()

    @property
    def peak_in_flight(self) -> int:
        """Most steps in flight at once (pipeline parallelism keeps up to ``pp``)."""
        return self.pipeline.peak_in_flight

    @property
    def prefix_cache_hits(self) -> int:
        """Blocks served from the prefix cache so far."""
        return self.blocks.hits

    def publish_kv_events(self) -> KVEvents:
        """Start numbering the prefix cache's changes (``kv_events``; a router's index of which
        engine holds which blocks); idempotent. Returns the log."""
        if self.blocks.events is None:
            self.blocks.publish(KVEvents())
        return self.blocks.events

    @property
    def kv_events(self) -> Optional[KVEvents]:
        """The prefix cache's changes (``publish_kv_events``), or None if they are not
        published."""
        return self.blocks.events

    def cached_blocks(self) -> List[tuple]:
        """``(hash, tier)`` of every block in the prefix cache, each once at its best tier
        (``STORED``: the device, ``HOST``, ``DISK``); read it on the engine's thread."""
        out = [(h, STORED) for h in self.blocks.by_hash]
        if self.tiers is not None:
            out += [(h, t) for h, t in self.tiers.keys() if h not in self.blocks.by_hash]
        return out

    def cached_snapshots(self) -> Optional[List[tuple]]:
        """A hybrid model's state snapshots a prompt can resume from, ``(hash of the block each
        ends, tier)`` (``STORED``: a slot on the device; ``HOST``, ``DISK``: the tier holding
        that block), as its ``kv_events`` say when they are published (a reader of the whole
        index then follows the events); None for a dense model. Read it on the engine's
        thread."""
        blocks = self.blocks
        if blocks.states is None:
            return None
        published = blocks.events is not None
        return list(blocks.snapshot_tiers.items()) if published else blocks.snapshots()

    def cached_tokens(self, token_ids: Seq[int], cache_salt: Optional[str] = None) -> int:
        """Tokens of a prompt's prefix this engine holds in any tier (whole blocks, never the
        last token: what admitting it now would not compute; a hybrid model: up to its deepest
        state snapshot, on the device or in a tier)."""
        held = self.blocks.locate(token_ids[:-1], cache_salt)
        if self.blocks.states is not None:
            return self.blocks.resumable(held) * self.blocks.block_size
        return len(held) * self.blocks.block_size

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

    def make_request(
        self,
        prompt,
        params: SamplingParams,
        *,
        apply_chat_template: bool = False,
        cache_salt: Optional[str] = None,
        request_id=None,
    ) -> List[Sequence]:
        """The ``n`` samples of a request, not admitted yet (``pipeline.add``, or a test's
        scheduler); one sequence finished with an error if it is invalid."""
        ids: List[int] = []
        problem = (
            params.problem()
            if isinstance(params, SamplingParams)
            else f"sampling params must be a SamplingParams, got {type(params).__name__}"
        )
        if problem is None:
            if not isinstance(prompt, (str, list, tuple)):
                problem = (
                    "a prompt must be a str, a list of token ids or chat messages, "
                    f"got {type(prompt).__name__}"
                )
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
            return (
                f"prompt token ids {bad[:5]} are outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return None

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
        seqs = self.make_request(
            prompt,
            SamplingParams() if params is None else params,
            apply_chat_template=apply_chat_template,
            cache_salt=cache_salt,
            request_id=request_id,
        )
        if seqs[0].finished:
            raise ValueError(seqs[0].error)
        self.pipeline.add(seqs)
        self.blocks.prefetch(seqs[0].token_ids[:-1], cache_salt)  # disk-tier blocks, off-thread
        return seqs[0].request_id

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has anything left to do or to report."""
        return self.pipeline.has_unreported or any(
            not s.finished for seqs in self.pipeline.active.values() for s in seqs
        )

    def abort_request(self, request_id) -> bool:
        """Stop a request and free its blocks (also one stopped by an export, or staged by an
        import); False if it is unknown or already finished."""
        return self.pipeline.abort(request_id)

    # -- the loop --------------------------------------------------------------------------
    def advance(self) -> List[Sequence]:
        """One step of the pipeline (``StepPipeline.advance``). Returns the sequences that got a
        token."""
        if not self.cluster.is_driver:
            raise RuntimeError(
                "only rank 0 drives the engine; other torchrun ranks call generate/stream like "
                "rank 0"
            )
        self.cluster.ensure_usable()
        with deferred_interrupt():  # a Ctrl-C takes effect between steps, never inside one
            return self.pipeline.advance()

    def drain(self) -> None:
        """Finish the steps still in flight after an interruption: every request still running
        keeps its tokens (aborted ones are finished first, so theirs are dropped)."""
        with deferred_interrupt():
            self.pipeline.drain(lambda: not self.cluster.broken)

    def logits(self, batch: List[Scheduled]) -> torch.Tensor:
        """Compute one scheduled batch now; fp32 logits ``(M, vocab)`` of its completing rows
        (for tests that drive the scheduler by hand)."""
        self.cluster.submit(batch, "logits")
        out = self.cluster.result()
        return out.main if out is not None else torch.zeros(0, self.config.vocab_size)


class _Steps:
    """What a step computes for the core (the pipeline's executor): the ranks run it
    (``parallel.Cluster``), the driver samples, the output processor takes the tokens."""

    def __init__(self, cluster: Cluster, output: OutputProcessor):
        self.cluster, self.output = cluster, output

    def submit(self, batch: List[Scheduled]) -> None:
        want = (
            "logits" if any(needs_logits(s.seq.params) for s in batch if s.completes) else "tokens"
        )
        self.cluster.submit(batch, want)

    def result(self):
        return self.cluster.result()

    def tokens(self, batch: List[Scheduled], result) -> list:
        """The step's prompt log-probs written into their sequences, then ``(seq, (token,
        logprob) or the exception sampling it raised)`` per completing sequence."""
        if result is not None and result.prompt_logprobs is not None:
            self.output.prompt_logprobs(batch, result.prompt_logprobs.tolist())
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
        token, logprob = picked
        observe(seq, token)  # the penalties' counts
        self.output.append(seq, token, logprob)

    def idle(self) -> None:
        self.cluster.park()
