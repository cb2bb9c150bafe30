"""``Worker``: one rank of an engine. It holds this rank's slice of the model (the layers of
its pipeline stage x the heads of its TP rank), its paged KV cache (those layers, its KV
heads, the tokens its SP rank stores) and runs step plans; the sampler rank (last stage,
SP rank 0, TP rank 0) returns the step's tokens or logits: to its caller when it is the
driver, else over the control plane (``control``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch

from ..cache.kv_cache import KVCache, bytes_per_block
from ..cache.state_pool import STATE_DTYPES, StatePool, snapshot_slots, state_bytes
from ..kernels import linear_cpu, paged, quant
from ..model.config import ModelConfig
from ..model import new_model, state_layers
from ..model.llama import DenseContext
from ..model.loader import check_checkpoint, materialize, on_meta
from ..sp.collectives import all_sum
from ..sp.comm import RingComm, RingTimeoutError
from . import faults
from . import autocompile
from .compiled import CPU_MIN_ROWS, CompiledDecode, linear_kind
from .context import LocalStep, StepContext
from .mesh import Mesh
from .plan import Mirror, StepPlan
from .pp import StageLink, apply_pp, stage_forward, stage_range, stage_sizes
from .tp import apply_tp, gather_vocab, kv_heads_per_rank

RESULT_TAG = 11
log = logging.getLogger(__name__)


def with_peer(what: str, fn, *args):
    """``fn(*args)``, a message to or from a peer rank; gloo's own error when the peer's
    connection is closed (posting to a dead peer fails at once: "Connection closed by peer
    [ADDRESS]") becomes one that names ``what`` (which rank) and the causes."""
    try:
        return fn(*args)
    except RingTimeoutError:
        raise
    except RuntimeError as e:
        raise RingTimeoutError(
            f"{what} failed: the peer closed its connection (it died, or failed: its own error "
            f"names the cause) or the link to its host is down: {e}"
        ) from e


@dataclass(frozen=True)
class EngineShape:
    """The settings every rank shares (a JSON dict travels to spawned workers)."""

    pp: int = 1
    sp: int = 1
    tp: int = 1
    pp_layers: Optional[tuple] = None
    block_size: int = 16
    sp_prefill_min_tokens: int = 64
    paged_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    compile_buckets: Optional[tuple] = (
        None  # compile_decode: decode batch sizes (CUDA graphs; CPU: the largest)
    )
    # a hybrid model's state slots (cache/state_pool.py): one per running sequence, and a
    # snapshot per ``checkpoint_blocks`` KV blocks (0: no snapshots, prefix caching off)
    state_slots: int = 0
    checkpoint_blocks: int = 0
    state_dtype: str = "float32"  # the pool's (state_pool.STATE_DTYPES)
    # compile_decode: "on" (True), "off" (False) or "auto" (each rank checks, all agree:
    # parallel/autocompile.py); compile_why: why "auto" runs eager before any check (tp > 1, ...)
    compile_mode: str = "off"
    compile_why: str = ""

    @property
    def quant(self):
        return quant.resolve(self.kv_cache_dtype)

    def stage_sizes(self, cfg: ModelConfig) -> List[int]:
        layer = (
            (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )  # weights a token multiplies in a layer
        return stage_sizes(
            cfg.num_layers, self.pp, self.pp_layers, cfg.vocab_size * cfg.hidden_size / layer
        )

    def bytes_per_token(self, cfg: ModelConfig, stage: int, dtype: torch.dtype) -> int:
        """K and V of one token on a rank of ``stage`` (the seed's formula):
        ``2 x attention_layers_on_stage x kv_heads_on_rank x head_dim x bytes`` (a quantized
        cache: one byte per value plus its scales' share)."""
        return bytes_per_block(
            len(kv_layers(cfg, stage_range(self.stage_sizes(cfg), stage))),
            1,
            kv_heads_per_rank(cfg, self.tp),
            cfg.head_dim,
            dtype,
            self.quant,
        )


def kv_layers(cfg: ModelConfig, layers: range) -> List[int]:
    """The layers of ``layers`` that hold K/V (a hybrid model's attention layers)."""
    held = set(cfg.kv_layers())
    return [i for i in layers if i in held]


def peak_rss() -> int:
    """This process's peak resident memory in bytes (``VmHWM``: unlike ``ru_maxrss`` it does not
    carry the parent's peak into a spawned child)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(text.split()[1]) * 1024 for text in f if text.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """This process's resident memory now, in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_SWITCH = "RINGKV_KEEP_HEAP"


def keep_heap() -> bool:
    """glibc: keep the memory a step frees for the next step's tensors (a CPU engine's steps).

    By default glibc serves large blocks with fresh ``mmap`` s (past a threshold that grows to at
    most 32 MiB) and gives a heap top of more than twice that back to the OS, so each step's large
    activations fault their pages in (zeroed by the kernel) afresh: measured ~230,000 minor faults
    (~0.9 GiB of pages) in one 16-request SmolLM2 run, about 0 after this. Blocks under 256 MiB
    then come from the heap, and up to 1 GiB of freed heap is kept. Process-wide; a no-op off
    glibc and with ``RINGKV_KEEP_HEAP=0``. Returns whether it is on."""
    if os.environ.get(HEAP_SWITCH) == "0":
        return False
    # the threshold first: setting the trim alone would stop glibc's adjustment of the threshold
    # where it stands (128 KiB in a fresh process: every large block mmapped)
    threshold = mallopt(M_MMAP_THRESHOLD, 256 << 20) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    return threshold and mallopt(M_TRIM_THRESHOLD, 1 << 30)


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)`` in this process: whether it took it (False off glibc)."""
    try:
        fn = ctypes.CDLL(None).mallopt  # this process's C library
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(fn(param, value))


@dataclass
class WorkerStats:
    steps: int = 0
    busy_s: float = 0.0  # computing (waits for the previous stage excluded)
    wait_s: float = 0.0  # waiting for hidden states from the previous stage
    control_bytes: int = 0  # step deltas broadcast (driver) or received (others)
    control_s: float = 0.0  # encoding / decoding and applying them (not the wait for them)
    compile_s: float = 0.0  # compile_decode: compiling (CUDA: and recording) at start-up
    compiled_steps: int = 0  # compile_decode: steps that ran compiled


class Worker:
    def __init__(
        self,
        mesh: Mesh,
        cfg: ModelConfig,
        weights,
        shape: EngineShape,
        *,
        dtype: torch.dtype,
        device,
        timeout: Optional[timedelta] = None,
        driver: bool = True,
    ):
        self.mesh, self.cfg, self.shape, self.dtype = mesh, cfg, shape, dtype
        self.driver = driver  # this process drives the engine (one process, or torchrun rank 0)
        self.control = (
            None  # a rank that is not the driver: its ``ControlPlane`` (results go there)
        )
        self.device, self.timeout = torch.device(device), timeout
        sizes = shape.stage_sizes(cfg)
        self.layers = stage_range(sizes, mesh.pp_rank)
        check_checkpoint(cfg, weights)
        with on_meta():  # the TP shards' new linears too: all replaced by materialize
            model = new_model(cfg)
            apply_pp(model, self.layers, mesh.first_stage, mesh.last_stage)
            slices = apply_tp(model, cfg, mesh.tp_rank, mesh.tp, mesh.tp_group, timeout)
        self.model = materialize(model, weights, dtype, self.device, slices)
        self.heap_kept = False  # keep_heap: on a CPU rank, once its weights are in place
        if self.device.type == "cpu":  # float32 linears on the packed kernel, where it wins here
            linear_cpu.pack_linears(self.model)
            self.heap_kept = keep_heap()
        self.kv_heads = kv_heads_per_rank(cfg, mesh.tp)
        self.kv: Optional[KVCache] = None
        # the stage's attention layers (global index -> index in the KV cache) and a hybrid
        # model's recurrent layers (global index -> their state shapes) with their pool
        self.kv_index = {g: i for i, g in enumerate(kv_layers(cfg, self.layers))}
        self.state_layers = state_layers(self.model)
        self.states: Optional[StatePool] = None
        self.paged_backend = shape.paged_backend
        if (
            self.paged_backend == "auto"
        ):  # CUDA: the Triton decode + varlen prefill kernels; CPU: batched torch
            self.paged_backend = paged.auto_backend(self.device)
        self.ring = RingComm(mesh.sp_group, timeout) if mesh.sp > 1 else None
        self.link = StageLink(timeout, depth=shape.pp)
        self.stats = WorkerStats()
        self.compiled: Optional[CompiledDecode] = None
        self.compile_info = dict(
            mode=shape.compile_mode,
            on=False,
            by=dict(on="compile_decode=True", off="compile_decode=False").get(
                shape.compile_mode, "auto"
            ),
            why=shape.compile_why,
            vote=False,
        )
        if (
            shape.compile_buckets
        ):  # compile_decode: compiled now, not in the first steps that need it
            self._compile(dtype)
        self.mirror = Mirror(
            mesh.rank
        )  # not the driver: the running sequences, kept by the driver's step deltas
        faults.install(self)  # tests only: RINGKV_FAULT

    def _compile(self, dtype) -> None:
        """``compile_decode`` True or "auto": this rank's ``CompiledDecode``, compiled through the
        artifact cache, and (auto) its verdict: cached, or timed now (``autocompile``). The
        rank's vote is ``compile_info["vote"]``; ``settle_compile`` applies the mesh's decision."""
        mesh, auto = self.mesh, self.shape.compile_mode == "auto"
        # the artifacts' key, before anything compiles (a cached eager verdict: nothing does)
        cuda = self.device.type == "cuda"
        min_rows, largest = (1 if cuda else CPU_MIN_ROWS), max(self.shape.compile_buckets)
        linear = linear_kind(self.model, self.device)
        key, parts = autocompile.cache_key(
            self.cfg, dtype, self.device, self.layers, mesh.first_stage, mesh.last_stage, linear
        )
        cache = autocompile.ArtifactCache(key, parts)
        rows = autocompile.check_rows(largest, min_rows)
        info = self.compile_info
        info.update(key=key, dir=str(cache.dir), parts=parts, rows=list(rows))
        verdict, switch = None, os.environ.get(autocompile.SWITCH)
        if not auto:
            info["by"] = "compile_decode=True"
        elif switch in ("0", "1"):
            info["by"] = f"{autocompile.SWITCH}={switch}"
            if switch == "0":
                info["why"] = f"eager: {autocompile.SWITCH}=0"
                return
        elif largest < min_rows:
            info.update(by="auto", why=f"eager: no decode step reaches {min_rows} rows")
            return
        else:
            verdict = cache.verdict(rows)
            info["by"] = "auto (cached verdict)" if verdict else "auto (measured)"
            if verdict is not None and not verdict["compile"]:
                info.update(verdict=verdict, why=self._why_eager(verdict))
                return
        compiled = CompiledDecode(
            self.model, self.shape.compile_buckets, self.device, first_stage=mesh.first_stage
        )
        try:
            with cache.compiling(compiled.what):
                self.stats.compile_s = compiled.warm_up(dtype, self.cfg.hidden_size, cache.packages)
            if cache.state != "warm":
                log.warning("ringkv: compiled in %.1f s", self.stats.compile_s)
            info.update(artifacts=cache.state, compile_s=round(self.stats.compile_s, 2))
            if auto and verdict is None and switch != "1":
                compiled_step, eager_step = compiled.dummy_steps(dtype, self.cfg.hidden_size)
                verdict = autocompile.verdict_of(
                    autocompile.timings(compiled_step, eager_step, rows)
                )
                cache.store_verdict(verdict)
        except Exception as e:  # auto: a compile that fails here runs eager, reported
            if not auto:
                raise
            info["why"] = f"eager: compiling failed ({type(e).__name__}: {e})"[:500]
            return
        if verdict is not None:
            info["verdict"] = verdict
            if not verdict["compile"]:
                info["why"] = self._why_eager(verdict)
                return
        self.compiled, info["vote"] = compiled, True
        info["on"] = True

    @staticmethod
    def _why_eager(verdict: dict) -> str:
        return (
            f"eager: the compiled step was not faster here ({sum(verdict['compiled_ms']):.1f} ms "
            f"against {sum(verdict['eager_ms']):.1f} ms eager over decode steps of "
            f"{verdict['rows']} rows; compile_decode=True forces it)"
        )

    def settle_compile(self, votes: List[Optional[bool]]) -> None:
        """The mesh's decision, from every rank's ``compile_info["vote"]`` (None: a spawn-mode
        driver): "auto" compiles only where every rank voted to; True always does."""
        if self.shape.compile_mode != "auto" or self.compiled is None:
            return
        if not all(v for v in votes if v is not None):
            self.compiled = None
            self.compile_info.update(
                on=False, why="eager: another rank's check chose eager (all ranks agree)"
            )

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_block(
            len(self.kv_index), 1, self.kv_heads, self.cfg.head_dim, self.dtype, self.shape.quant
        )

    @property
    def state_bytes(self) -> int:
        """Bytes of one state slot here (0: no recurrent layer on this stage)."""
        return state_bytes(self.state_layers, STATE_DTYPES[self.shape.state_dtype])

    def state_slots(self, num_blocks: int) -> int:
        """State slots for a cache of ``num_blocks`` blocks: one per running sequence and the
        snapshots (``state_pool.snapshot_slots``); none for a dense model."""
        sh = self.shape
        snapshots = snapshot_slots(num_blocks, sh.state_slots, sh.checkpoint_blocks)
        return sh.state_slots + snapshots if sh.state_slots else 0

    def blocks_within(self, memory: int) -> Optional[int]:
        """KV blocks that ``memory`` bytes hold here beside a hybrid model's state slots (one per
        running sequence and a snapshot each, then a snapshot per ``checkpoint_blocks`` blocks);
        None: any number (a stage that holds neither)."""
        sh = self.shape
        per_block = self.bytes_per_token * sh.block_size
        slot = self.state_bytes if sh.state_slots else 0
        fixed = self.state_slots(0)  # the running slots and a snapshot each
        left = memory - fixed * slot
        if left < 0:
            raise ValueError(
                f"{memory} bytes of cache on rank {self.mesh.rank} cannot hold the recurrent "
                f"state of max_num_seqs={sh.state_slots} sequences and their snapshots ({fixed} "
                f"slots of {slot} bytes); give more kv_cache_memory or a smaller max_num_seqs"
            )
        every = sh.checkpoint_blocks if slot else 0
        per = per_block * every + slot if every else per_block  # ``every`` blocks + a snapshot
        return None if per == 0 else left * max(every, 1) // per

    def allocate(self, num_blocks: int) -> None:
        slots = self.state_slots(num_blocks)
        if slots:
            dtype = STATE_DTYPES[self.shape.state_dtype]
            self.states = StatePool(self.state_layers, slots, self.device, dtype)
        self.kv = KVCache(
            len(self.kv_index),
            self.kv_heads,
            self.cfg.head_dim,
            block_size=self.shape.block_size,
            quant=self.shape.quant,
            num_blocks=num_blocks,
            dtype=self.dtype,
            device=self.device,
        )

    def free_kv_bytes(self, utilization: float, tokens: int) -> int:
        """CUDA: bytes left for the KV cache within ``utilization`` of the device after the weights,
        other processes' memory and the activations of one ``tokens``-token forward (profiled)."""
        if self.device.type != "cuda":
            raise ValueError(
                "gpu_memory_utilization needs a CUDA device; on CPU give kv_cache_memory (bytes "
                "per rank)"
            )
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        positions = torch.arange(tokens, device=self.device)
        x = (
            positions
            if self.mesh.first_stage
            else torch.zeros(tokens, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        )
        with torch.inference_mode():
            stage_forward(self.model, x, positions, DenseContext(positions))
        torch.cuda.synchronize(self.device)
        return int(utilization * total - others - torch.cuda.max_memory_allocated(self.device))

    def info(self) -> dict:
        m = self.mesh
        first_kv = len(kv_layers(self.cfg, range(self.layers.start)))
        return dict(
            rank=m.rank,
            pp_rank=m.pp_rank,
            sp_rank=m.sp_rank,
            tp_rank=m.tp_rank,
            layers=[self.layers.start, self.layers.stop],
            kv_layers=[first_kv, first_kv + len(self.kv_index)],  # among the model's K/V layers
            kv_heads=self.kv_heads,
            bytes_per_token=self.bytes_per_token,
            kv_cache_bytes=self.kv.nbytes if self.kv else 0,
            state_bytes_per_slot=self.state_bytes,
            state_cache_bytes=self.states.nbytes if self.states else 0,
            weight_bytes=linear_cpu.weight_bytes(self.model),
            compile=self.compile_info,
        )

    def report(self) -> dict:
        """``info()`` plus counters: steps, seconds computing / waiting for the previous stage,
        this process's resident memory (peak and now) and the sends not yet complete; with
        which kernel runs the model's linears, eager and compiled (``linear``: ``"packed"``,
        ``"mkl"`` or ``"cuda"``), and whether freed memory stays in the heap (``heap_kept``:
        ``keep_heap``)."""
        st, steps = self.stats, max(1, self.stats.steps)
        return dict(
            self.info(),
            steps=st.steps,
            busy_s=st.busy_s,
            wait_s=st.wait_s,
            control_bytes=st.control_bytes / steps,
            control_s=st.control_s / steps,
            control_bytes_total=st.control_bytes,
            control_s_total=st.control_s,
            compile_s=st.compile_s,
            compiled_steps=st.compiled_steps,
            linear=linear_kind(self.model, self.device),
            heap_kept=self.heap_kept,
            peak_rss_bytes=peak_rss(),
            rss_bytes=rss(),
            pending_sends=len(self.link.pending),
        )

    def run(self, words: torch.Tensor, nbytes: int) -> None:
        """A rank other than the driver: apply a step's delta (``nbytes`` on the wire) to the
        mirror and run the step."""
        t = time.perf_counter()
        plan = self.mirror.apply(words)
        self.stats.control_s += time.perf_counter() - t
        self.stats.control_bytes += nbytes
        self.execute(plan)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Optional["StepResult"]:
        """Run this rank's part of a step. The sampler rank returns its ``StepResult`` when it
        is the driver, else sends it there; the others return None."""
        t0 = time.perf_counter()
        m, sh = self.mesh, self.shape
        step = LocalStep(
            plan,
            m.sp_rank,
            m.sp,
            sh.block_size,
            sh.sp_prefill_min_tokens,
            self.device,
            self.paged_backend,
        )
        if self.states is not None:
            self.states.copy(plan.copies)  # prefix hits: their snapshots into their slots
        ctx = StepContext(
            self.kv, step, self.kv_index, m.sp, self.ring, timeout=self.timeout, states=self.states
        )
        if m.first_stage:
            x = step.input_ids
        else:
            w = time.perf_counter()
            x = with_peer(
                f"rank {m.rank}: hidden states from pipeline rank {m.neighbour(-1)}",
                self.link.recv,
                (step.input_ids.numel(), self.cfg.hidden_size),
                self.dtype,
                self.device,
                m.neighbour(-1),
            )
            self.stats.wait_s += time.perf_counter() - w
            t0 += time.perf_counter() - w
        bucket = self._decode_bucket(plan, step)
        if bucket is not None:  # compile_decode: a decode step within the buckets
            x = self.compiled.forward(x, step.positions, ctx, bucket)
            self.stats.compiled_steps += 1
        elif (
            self.compiled is not None
            and not step.rings
            and self.compiled.other(step.positions.numel())
        ):
            x = self.compiled.forward_any(
                x, step.positions, ctx
            )  # CPU: any other step, the other steps' graph
            self.stats.compiled_steps += 1
        else:
            x = stage_forward(self.model, x, step.positions, ctx)  # (T, hidden)
        result = None
        if not m.last_stage:
            dst = m.neighbour(1)
            with_peer(
                f"rank {m.rank}: hidden states to pipeline rank {dst}", self.link.send, x, dst
            )
        elif plan.num_completing or plan.num_targets:
            result = self._sample_input(x, step, plan, compiled=bucket is not None)
        self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - t0
        return result

    def _decode_bucket(self, plan: StepPlan, step: LocalStep) -> Optional[int]:
        """compile_decode: the bucket of a step whose every sequence computes one token, else
        None."""
        if self.compiled is None or not plan.seqs or step.rings or any(s.n != 1 for s in plan.seqs):
            return None
        return self.compiled.bucket(step.positions.numel())

    def _sample_input(
        self, x, step: LocalStep, plan: StepPlan, compiled: bool = False
    ) -> Optional[StepResult]:
        m = self.mesh
        rows = torch.tensor(step.last_rows + step.target_rows, device=x.device)
        picked = x.index_select(0, rows.clamp_min(0)) * (rows >= 0)[:, None].to(
            x.dtype
        )  # (M + R, hidden)
        if m.sp > 1:  # each row lives on one SP rank: the sum gathers them
            picked = all_sum(picked, m.sp_group, self.timeout, "last hidden states")
        if m.sp_rank != 0:
            return None
        head = self.compiled.logits if compiled else self.model.logits
        logits = gather_vocab(head(picked), self.cfg, m.tp, m.tp_group, self.timeout)  # fp32
        if m.tp_rank != 0:
            return None
        k = len(step.last_rows)
        # max's indices are argmax's (the first maximum; NaN counts as the maximum) at ~half the
        # time on CPU (16 x 49152 fp32: ~1 ms a step for argmax, measured)
        main = logits[:k].max(dim=-1).indices if plan.want == "tokens" else logits[:k]
        prompt_lp = None
        if step.targets:  # log-probs of the prompt tokens these positions predict
            targets = torch.tensor(step.targets, device=logits.device)
            lsm = torch.log_softmax(logits[k:], dim=-1)  # (R, vocab)
            prompt_lp = lsm.gather(1, targets[:, None])[:, 0]  # (R,)
            if (
                plan.top
            ):  # (R, 1 + 2 top): the target's, then the top ids (exact in fp32) and their values
                values, ids = lsm.topk(plan.top, dim=-1)
                prompt_lp = torch.cat([prompt_lp[:, None], ids.float(), values], dim=1)
        if not self.driver:  # to the driver (CPU tensors over the control plane's gloo group)
            for t in (main, prompt_lp):
                if t is not None:
                    with_peer(
                        f"rank {m.rank}: the step's result to the driver (rank 0)",
                        self.control.send,
                        t.cpu(),
                        0,
                        RESULT_TAG,
                    )
            return None
        return StepResult(main, prompt_lp)


@dataclass
class StepResult:
    """What the sampler rank returns for a step: ``main`` is ``(M,)`` argmax tokens or
    ``(M, vocab)`` fp32 logits of the completing sequences; ``prompt_logprobs`` ``(R,)`` the
    log-probs of the plan's ``targets``, in plan order: ``(R,)``, or ``(R, 1 + 2 top)`` with the
    plan's ``top`` alternatives (each row: the target's, the top ids, their log-probs)."""

    main: torch.Tensor
    prompt_logprobs: Optional[torch.Tensor] = None
