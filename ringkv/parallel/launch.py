"""The ranks of one engine, seen from this process (``Cluster``), and how they start.

Three ways to run, chosen by ``Cluster.mode_for(world)`` and kept in ``Cluster.mode``
(a ``ClusterMode``; a ``str`` enum, so ``mode == "spawn"`` holds too):

- ``LOCAL`` (``"local"``): one rank (world 1); no process group is touched.
- ``TORCHRUN`` (``"torchrun"``): this process is one rank of a ``torch.distributed`` world of
  exactly ``tp * pp * sp`` processes (torchrun, or any launcher that initialised the default
  group). Every rank builds the same engine; rank 0 drives, the others follow its messages
  while they are inside the same call.
- ``SPAWN`` (``"spawn"``): a plain process asks for several ranks: it stays the driver
  (scheduler, block manager, sampling; it holds no model shard) and starts every model rank as
  a worker process (``torch.multiprocessing`` spawn, a TCP store of this engine's own, and the
  workers' gloo/NCCL group on loopback); ``close()`` (or the exit of the program) stops them.
  The driver joins no default process group (its link to the workers is a gloo group built
  from the engine's store: ``control.ControlPlane.open_channel``), so one process can hold
  several engines and close them in any order.
- ``CLOSED`` (``"closed"``): a spawn-mode driver after ``close()``: its workers are stopped
  and its control plane dropped, so nothing of spawn mode runs again (a second ``close()``
  does nothing). ``LOCAL`` and ``TORCHRUN`` clusters keep their mode when closed (they own
  no processes).

Rank 0 sends every step to the other ranks as a delta of their mirrors of the running
sequences (``plan.Publisher`` -> ``control.ControlPlane.publish_step`` -> ``plan.Mirror`` on
each rank), runs its own part, and collects the sampler rank's result; pipeline stages
overlap because the driver submits up to ``pp`` steps before it waits for the oldest result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Deque, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..cache.state_pool import flatten, unflatten
from ..model.config import ModelConfig, RecurrentConfig
from ..sp.comm import DEFAULT_TIMEOUT
from .control import ControlPlane, EngineError, parent_alive
from .mesh import MeshShape, build_mesh
from .plan import Publisher, StepPlan, local_plan
from . import faults, kvmove, net
from .worker import RESULT_TAG, EngineShape, StepResult, Worker, WorkerStats

DEFAULT_KV_MEMORY = 1 << 30  # bytes per rank when neither kv_cache_memory nor num_blocks is given
START_TIMEOUT = timedelta(seconds=120)  # spawned workers start within max(timeout, this)
# ranks wait for each other's compile_decode votes (a cold compile and its check) this long
COMPILE_TIMEOUT = timedelta(minutes=15)
_ENGINE_IDS = itertools.count()  # torchrun ranks create engines in the same order: same ids


@dataclass(frozen=True)
class CacheBudget:
    """How many KV blocks a rank may allocate: ``num_blocks``, or ``kv_cache_memory`` bytes per
    rank (default 1 GiB), or on CUDA a ``gpu_memory_utilization`` fraction of the device
    measured after the weights and one profiling forward of ``profile_tokens`` tokens."""

    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    profile_tokens: int = 2048

    def blocks(self, worker: Worker) -> Optional[int]:
        """The blocks ``worker`` may allocate (None: any number, a stage that holds neither K/V
        nor snapshots)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.gpu_memory_utilization is not None:
            memory = worker.free_kv_bytes(self.gpu_memory_utilization, self.profile_tokens)
        else:
            memory = int(self.kv_cache_memory or DEFAULT_KV_MEMORY)
        return worker.blocks_within(memory)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        )
    return device


class ClusterMode(str, Enum):
    """How the ranks of a ``Cluster`` run: see the module docstring. Its values are the strings
    the mode was before it was an enum, and it compares equal to them."""

    LOCAL = "local"
    TORCHRUN = "torchrun"
    SPAWN = "spawn"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


class Cluster:
    """``submit(plan)`` / ``result()`` on the driver, ``follow()`` on torchrun followers."""

    def __init__(
        self,
        shape: EngineShape,
        cfg: ModelConfig,
        weights,
        *,
        model_arg,
        dtype: torch.dtype,
        device: torch.device,
        budget: CacheBudget,
        timeout: Optional[timedelta] = None,
    ):
        self.shape, self.cfg, self.dtype = shape, cfg, dtype
        self.timeout = timeout or DEFAULT_TIMEOUT
        mesh_shape = MeshShape(shape.pp, shape.sp, shape.tp)
        self.world = mesh_shape.world
        self.mode = self.mode_for(self.world)
        self.procs: List = []
        self.tmpdir: Optional[str] = None
        self.control: Optional[ControlPlane] = None
        self.broken: Optional[str] = None
        self.pending: Deque[Tuple[StepPlan, Optional[torch.Tensor]]] = deque()
        self.publisher = Publisher()  # the driver: what every other rank's step mirror holds
        self.stats = WorkerStats()  # the driver's steps and control-plane counters
        self.fault = None  # tests only (faults.install_driver): called after each submit
        # this process's model rank (none on a spawn-mode driver)
        self.worker: Optional[Worker] = None
        # the control rank of model rank r is r + offset
        self.offset = 1 if self.mode is ClusterMode.SPAWN else 0
        # the model rank that returns step results
        self.sampler = mesh_shape.rank_of(shape.pp - 1, 0, 0)
        self._reports = itertools.count()
        if self.mode is ClusterMode.LOCAL:
            self.rank, self.device = 0, device
        elif self.mode is ClusterMode.TORCHRUN:
            self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
            self.device = _rank_device(device, self.rank)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL communicators use the current device
            if not dist.is_initialized():
                net.pick_interface()  # a world across hosts: the interface to the master
                dist.init_process_group(_backend(device), timeout=self.timeout)
            self.control = ControlPlane(
                dist.distributed_c10d._get_default_store(),
                f"ringkv/engine{next(_ENGINE_IDS)}",
                self.rank,
                self.world,
                self.timeout,
            )
            self._agree(cfg, dtype)
        else:
            self.rank, self.device = 0, device
        try:
            if self.mode is ClusterMode.SPAWN:
                self._spawn(model_arg, cfg, weights, dtype, device, budget)
            else:
                self.worker, self.num_blocks, self.infos = setup_rank(
                    mesh_shape,
                    self.shape,
                    cfg,
                    weights,
                    dtype,
                    self.device,
                    self.control,
                    budget,
                    self.timeout,
                )
        except BaseException:
            self.close()
            raise
        self.mover = (
            kvmove.Mover(self) if self.is_driver else None
        )  # one request's K/V, from and to every rank
        faults.install_driver(self)  # tests only: RINGKV_FAULT

    @staticmethod
    def mode_for(world: int) -> ClusterMode:
        if world == 1:
            return ClusterMode.LOCAL
        if dist.is_initialized():
            if dist.get_world_size() != world:
                raise ValueError(
                    f"tp * pp * sp = {world} but the torch.distributed world has "
                    f"{dist.get_world_size()} ranks; run under torchrun --nproc-per-node {world} "
                    f"(one process per rank)"
                )
            return ClusterMode.TORCHRUN
        env = os.environ.get("WORLD_SIZE")
        if env is not None and int(env) > 1:
            if int(env) != world:
                raise ValueError(
                    f"tp * pp * sp = {world} but torchrun started {env} processes; "
                    f"use --nproc-per-node {world}"
                )
            return ClusterMode.TORCHRUN
        return ClusterMode.SPAWN

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def _agree(self, cfg: ModelConfig, dtype) -> None:
        """Every rank must build the same engine (checked before any weight is loaded)."""
        mine = json.dumps(
            [vars(self.shape), {k: v for k, v in vars(cfg).items() if k != "extra"}, str(dtype)],
            sort_keys=True,
            default=str,
        )
        for r, theirs in enumerate(self.control.exchange("engine", mine)):
            if theirs != mine:
                raise ValueError(
                    f"rank {r} builds a different engine than rank {self.rank} (model config, "
                    f"dtype, tp/pp/sp or cache settings differ); every rank must call LLM(...) "
                    f"alike"
                )

    # -- spawn mode ----------------------------------------------------------------------
    def _spawn(
        self, model_arg, cfg: ModelConfig, weights, dtype, device, budget: CacheBudget
    ) -> None:
        import torch.multiprocessing as mp

        path = (
            model_arg
            if isinstance(model_arg, (str, os.PathLike)) and os.path.isdir(model_arg)
            else None
        )
        if (
            path is None
        ):  # in-memory weights (or GGUF): one safetensors copy the workers read slices of
            self.tmpdir = path = tempfile.mkdtemp(prefix="ringkv-weights-")
            _save_weights(cfg, weights, path)
        store = dist.TCPStore(
            "127.0.0.1", 0, self.world + 1, True, timeout=self.timeout, wait_for_workers=False
        )
        self.store = store
        spec = dict(
            world=self.world,
            port=store.port,
            path=os.fspath(path),
            config=_config_dict(cfg),
            shape=vars(self.shape),
            budget=vars(budget),
            dtype=str(dtype).replace("torch.", ""),
            device=str(device),
            timeout=self.timeout.total_seconds(),
            threads=max(1, (os.cpu_count() or 1) // self.world),
        )
        ctx = mp.get_context("spawn")
        with _plain_child():
            for r in range(self.world):
                p = ctx.Process(
                    target=_worker_main,
                    args=(r, json.dumps(spec), os.getpid()),
                    daemon=True,
                    name=f"ringkv-rank{r}",
                )
                p.start()
                self.procs.append(p)
        self.control = ControlPlane(store, "ringkv/engine", 0, self.world + 1, self.timeout)
        # start-up (spawn, imports, weights) is bounded by at least START_TIMEOUT: a short
        # ``timeout`` is for faults, and a loaded machine starts processes slowly; a worker that
        # dies meanwhile is noticed at once
        start = max(self.timeout, START_TIMEOUT)
        deadline = time.monotonic() + start.total_seconds()
        for r in range(self.world):  # every worker started (imports done) or died
            while self.control.poll("hello", r + 1) is None:
                self._check_procs("starting")
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"worker rank {r} did not start within {start.total_seconds():.0f}s"
                    )
                time.sleep(0.05)
        self._while_alive(
            "connecting", lambda: self.control.open_channel(depth=_depth(self.shape), direct=True)
        )
        self._while_alive(
            "loading", lambda: self.control.exchange("compile", None, max(start, COMPILE_TIMEOUT))
        )  # the workers' compile_decode votes (setup_rank)
        blocks = self._while_alive(
            "loading", lambda: self.control.exchange("num_blocks", None, start)
        )
        self.num_blocks = min(b for b in blocks if b is not None)
        infos = self._while_alive("loading", lambda: self.control.exchange("info", None, start))
        self.infos = [i for i in infos if i is not None]

    def _while_alive(self, doing: str, fn):
        """``fn()`` (which waits for every worker) in a thread, while the workers are checked: a
        worker that dies meanwhile is an ``EngineError`` now, not a wait as long as the timeout."""
        box: list = []
        t = threading.Thread(target=lambda: box.append(_call(fn)), daemon=True, name="ringkv-setup")
        t.start()
        while t.is_alive():
            t.join(0.05)
            self._check_procs(doing)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _check_procs(self, doing: str) -> None:
        """``EngineError`` if a worker died: the one whose own error is the cause first (a peer
        of a dead rank dies too, of a closed connection), the others named after it."""
        dead = [
            (r, p.exitcode, self.control.poll("error", r + 1) if self.control else None)
            for r, p in enumerate(self.procs)
            if not p.is_alive()
        ]
        if dead:
            dead.sort(
                key=lambda d: any(x in (d[2] or "") for x in ("transport/tcp", "got no answer"))
            )  # a peer's error
            r, code, err = dead[0]
            also = (
                f"\n(also exited: worker ranks {', '.join(str(d[0]) for d in dead[1:])})"
                if dead[1:]
                else ""
            )
            raise EngineError(
                f"worker rank {r} exited (code {code}) while {doing}"
                + (f":\n{err}" if err else "")
                + also
            )

    # -- driver --------------------------------------------------------------------------
    def submit(self, batch, want: str) -> None:
        """Send the step of ``batch`` (the scheduler's entries, see ``plan.local_plan``) to every
        rank as a delta of their mirrors and run rank 0's part of it. Anything that stops it
        half-way (an error, or an interrupt raised inside the step) breaks the engine: the other
        ranks may be inside the step's collectives, and a later step must never pair with them."""
        self.ensure_usable()
        try:
            plan = local_plan(batch, want)  # what every rank's mirror rebuilds from the delta
            if self.world > 1:
                self.control.reap()  # back-pressure from a lagging rank: not control work
                t = time.perf_counter()
                self.stats.control_bytes += self.control.publish_step(
                    self.publisher.encode(batch, want)
                )
                self.stats.control_s += time.perf_counter() - t
            self.stats.steps += 1
            self.pending.append((plan, self.worker.execute(plan) if self.worker else None))
            if self.fault is not None:
                self.fault(self)
        except BaseException as e:
            self._fail(e)

    def park(self) -> None:
        """The engine is idle: the other ranks go back to waiting on the store (where a wait can
        last as long as the driver lives) until the next step."""
        if self.world > 1 and self.is_driver and not self.broken:
            try:
                self.control.park()
            except BaseException as e:
                self._fail(e)

    def result(self):
        """The sampler rank's ``StepResult`` for the oldest submitted plan (None if it has no
        completing row and no prompt log-prob)."""
        self.ensure_usable()
        plan, res = self.pending.popleft()
        if res is None and (plan.num_completing or plan.num_targets):
            try:
                res = self._receive_result(plan)
            except BaseException as e:
                self._fail(e)
        return res

    def _receive_result(self, plan: StepPlan) -> StepResult:
        """The sampler rank's answer to ``plan`` (in submission order), over the control plane."""
        src, what = self.sampler + self.offset, f"results from the sampler rank {self.sampler}"
        k = plan.num_completing
        tokens = plan.want == "tokens"
        main = self.control.recv_from(
            src,
            torch.empty(
                (k,) if tokens else (k, self.cfg.vocab_size),
                dtype=torch.long if tokens else torch.float32,
            ),
            RESULT_TAG,
            what,
        )
        shape = (plan.num_targets, 1 + 2 * plan.top) if plan.top else (plan.num_targets,)
        lp = (
            self.control.recv_from(src, torch.empty(shape), RESULT_TAG, what)
            if plan.num_targets
            else None
        )
        return StepResult(main, lp)

    def read_kv(self, table: List[int], start: int, end: int) -> kvmove.KV:
        """The driver: K/V of tokens ``[start, end)`` of the sequence with block table ``table``,
        gathered from every rank (``kvmove.Mover.gather``). A rank that fails breaks the engine."""
        return self._on_ranks(self.mover.gather, table, start, end)

    def write_kv(self, table: List[int], start: int, kv: kvmove.KV) -> None:
        """The driver: store ``kv`` (``read_kv``'s layout) from token ``start`` on, on every
        rank."""
        self._on_ranks(self.mover.scatter, table, start, kv)

    def read_state(self, slot: int) -> torch.Tensor:
        """The driver: a hybrid model's recurrent state in ``slot``, every layer, from the ranks
        that hold it (``kvmove.Mover.gather_state``), flat float32 (``state_pool.flatten``:
        what snapshots and tiers carry)."""
        return flatten(self._on_ranks(self.mover.gather_state, slot))

    def write_state(self, slot: int, state: torch.Tensor) -> None:
        """The driver: store ``state`` (``read_state``'s flat layout) in ``slot`` on every
        rank."""
        states = unflatten(state, self.mover.state_shapes)
        self._on_ranks(self.mover.scatter_state, slot, states)

    def _on_ranks(self, fn, *args):
        """``fn(*args)``, which the other ranks take part in: its failure breaks the engine (they
        may be half-way through it); on one rank it is an ordinary error."""
        self.ensure_usable()
        if self.world == 1:
            return fn(*args)
        try:
            self._receive_pending()
            return fn(*args)
        except BaseException as e:
            self._fail(e)

    def _receive_pending(self) -> None:
        """Receive now the results of the steps still in flight (``result`` returns them later):
        the sampler rank waits for its result sends to complete before it sends or takes K/V,
        so a K/V move between steps (a tier's copy with pipeline parallelism) would otherwise
        wait on the driver while the driver waits on it."""
        for i, (plan, res) in enumerate(self.pending):
            if res is None and (plan.num_completing or plan.num_targets):
                self.pending[i] = (plan, self._receive_result(plan))

    def exchange(self, key: str, value) -> list:
        """Torchrun: every rank's ``value`` for ``key`` (``LLM``'s per-call handshake). A rank that
        does not answer within the timeout (dead, hung, or in another call) breaks the engine, as
        a failed step does: the ranks are out of step for good."""
        try:
            return self.control.exchange(key, value)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def end(self, payload: dict) -> None:
        """Torchrun: let the followers return ``payload`` from the call they are in."""
        if self.mode is ClusterMode.TORCHRUN and self.is_driver:
            self.control.publish({"kind": "end", **payload})

    def shutdown_followers(self) -> None:
        """Torchrun: release ranks > 0 from ``follow(idle=True)`` loops (a server stopping)."""
        if self.mode is ClusterMode.TORCHRUN and self.is_driver and not self.broken:
            self.control.publish({"kind": "shutdown"})

    def abort(self, message: str) -> None:
        if self.mode is ClusterMode.TORCHRUN and self.is_driver and not self.broken:
            self.control.publish({"kind": "error", "message": message})

    def follow(self, idle: bool = False) -> dict:
        """Torchrun ranks > 0: run the driver's steps until it ends the call; returns its payload.
        ``idle``: no bound on the wait for the next message (a server's ranks wait for requests)."""
        self.ensure_usable()
        with (
            deferred_interrupt()
        ):  # Ctrl-C reaches every torchrun rank: rank 0 decides, the call ends alike
            while True:
                try:
                    msg = self.control.receive(None if idle else self.timeout)
                    if msg["kind"] == "step":
                        self.worker.run(msg["words"], msg["bytes"])
                        continue
                    if msg["kind"] in kvmove.KINDS:
                        kvmove.serve(self.worker, self.control, msg)
                        continue
                except BaseException as e:
                    self._fail(e)
                if msg["kind"] == "error":
                    raise EngineError(f"rank 0 failed: {msg['message']}")
                return msg

    def report(self) -> List[dict]:
        """Every model rank's worker info and timing counters (all ranks call it under
        torchrun); the driver's control plane counters are rank 0's."""
        mine = self.worker.report() if self.worker else None
        if self.world == 1:
            return [self._with_control(mine)]
        n = next(self._reports)
        if self.mode is ClusterMode.SPAWN:
            self.control.publish({"kind": "report", "n": n})
        reports = [r for r in self.control.exchange(f"report{n}", mine) if r is not None]
        if self.is_driver:
            reports[0] = self._with_control(reports[0])
        return reports

    def _with_control(self, report: dict) -> dict:
        """Rank 0's report plus the driver's control-plane counters: bytes of step deltas it
        sent and seconds encoding and posting them, per step and in total."""
        st, steps = self.stats, max(1, self.stats.steps)
        return dict(
            report,
            driver_control_bytes=st.control_bytes / steps,
            driver_control_s=st.control_s / steps,
            driver_control_bytes_total=st.control_bytes,
            driver_control_s_total=st.control_s,
        )

    def ensure_usable(self) -> None:
        """Raise ``EngineError`` once the engine is broken."""
        if self.broken:
            raise EngineError(f"the engine is broken ({self.broken}); create a new LLM")

    def _fail(self, e: BaseException):
        """A step failed on this rank: name why (spawn mode: which worker died and why), break
        the engine and stop its spawned workers (they may wait inside the step's collectives).
        An interrupt (``KeyboardInterrupt``, ``SystemExit``) is raised again as itself."""
        msg = f"{type(e).__name__}: {e}"
        if not isinstance(e, Exception):
            msg = f"{type(e).__name__} inside a step, which the other ranks may still be running"
        elif self.mode is ClusterMode.SPAWN:
            time.sleep(0.2)  # a dying worker posts its error first
            try:
                self._check_procs("running a step")
            except EngineError as dead:
                msg = str(dead)
        self.broken = msg
        self._kill_workers()
        if not isinstance(e, Exception):
            raise e
        raise EngineError(msg) from e

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        if self.mode is ClusterMode.SPAWN and self.procs:
            try:
                if self.control is not None and not self.broken:
                    # the results of steps still in flight taken first: the sampler rank waits
                    # for its result sends to complete before it exits (else close waited out the
                    # join's 10 s, measured: a pp=2 engine closed with requests running); no
                    # longer than that join for a rank that hangs
                    self.control.timeout = min(self.control.timeout, timedelta(seconds=10))
                    self._receive_pending()
                    self.control.publish({"kind": "shutdown"})
                    self.control.channel.reap(0)
            except Exception:
                pass
            for p in self.procs:
                p.join(timeout=0 if self.broken else 10)
            self._kill_workers()
            self.procs = []
        if self.mode is ClusterMode.SPAWN:
            self.control = None  # its gloo group and the store go with it
            self.mode = ClusterMode.CLOSED
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


@contextlib.contextmanager
def deferred_interrupt():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends, then raise
    ``KeyboardInterrupt``: the engine's steps run to their end on every rank, so an interrupt
    leaves the ranks in step and the engine usable. A second Ctrl-C interrupts at once (and an
    interrupt inside a step breaks the engine). Only on the main thread, and only while Python's
    default handler is installed (a program's own handler is left alone)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _plain_child():
    """Start children that do not re-run the caller's ``__main__`` (so scripts need no
    ``if __name__ == "__main__"`` guard: workers only import ringkv) and that do not log a C++
    warning each time an idle worker's wait on the store times out."""
    main = sys.modules.get("__main__")
    saved = {
        k: main.__dict__[k]
        for k in ("__spec__", "__file__")
        if main is not None and k in main.__dict__
    }
    level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        if main is not None:
            main.__spec__ = None
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
        if level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL")
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = level


def _depth(shape: EngineShape) -> int:
    """Step broadcasts (and result sends) a rank keeps in flight before it waits on the oldest."""
    return 2 * shape.pp + 2


def _call(fn):
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
        return False, e


def setup_rank(
    mesh_shape: MeshShape,
    shape: EngineShape,
    cfg: ModelConfig,
    weights,
    dtype,
    device,
    control: Optional[ControlPlane],
    budget: CacheBudget,
    timeout,
    spawned: bool = False,
):
    """Build this rank's worker and its KV cache; the block count is the minimum over ranks.
    ``spawned``: a worker process of a spawn-mode driver (whose channel is already open)."""
    if (
        control is not None and not spawned
    ):  # every rank, in the same order (it creates a process group)
        control.open_channel(depth=_depth(shape))
    driver = control is None or (control.rank == 0 and not spawned)  # one rank, or torchrun rank 0
    worker = Worker(
        build_mesh(mesh_shape, device.type),
        cfg,
        weights,
        shape,
        dtype=dtype,
        device=device,
        timeout=timeout,
        driver=driver,
    )
    if not worker.driver:
        worker.control = control
    # compile_decode="auto": every rank's vote, one decision for all (parallel/autocompile.py)
    vote = worker.compile_info["vote"]
    wait = max(control.timeout, COMPILE_TIMEOUT) if control else None
    worker.settle_compile(control.exchange("compile", vote, wait) if control else [vote])
    mine = budget.blocks(worker)
    every = control.exchange("num_blocks", mine) if control else [mine]
    num_blocks = min((b for b in every if b is not None), default=0)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block of {shape.block_size} tokens on some rank; "
            f"give more kv_cache_memory / gpu_memory_utilization or a smaller block_size"
        )
    worker.allocate(num_blocks)
    infos = control.exchange("info", worker.info()) if control else [worker.info()]
    return worker, num_blocks, [i for i in infos if i is not None]


def _config_dict(cfg: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _config_from(d: dict) -> ModelConfig:
    """``_config_dict`` read back (a hybrid's mixer sizes are a dataclass of their own)."""
    if isinstance(d.get("recurrent"), dict):
        d = dict(d, recurrent=RecurrentConfig(**d["recurrent"]))
    return ModelConfig(**d)


def _save_weights(cfg: ModelConfig, weights, path: str) -> None:
    from safetensors.torch import save_file

    from ..model.loader import IGNORED_SUFFIXES

    names = [
        n
        for n in sorted(weights.names())
        if not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    ]
    save_file(
        {n: weights.get(n).detach().contiguous() for n in names},
        os.path.join(path, "model.safetensors"),
    )


def _worker_main(rank: int, spec_json: str, parent_pid: int) -> None:
    """A spawned rank: join the world, build its worker, run the driver's messages."""
    spec = json.loads(spec_json)
    control = None
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a terminal's Ctrl-C is the driver's to handle; rank 0 stops us
    try:
        torch.set_num_threads(spec["threads"])
        from ..model.loader import SafetensorsSource

        timeout = timedelta(seconds=spec["timeout"])
        store = dist.TCPStore("127.0.0.1", spec["port"], spec["world"] + 1, False, timeout=timeout)
        control = ControlPlane(
            store, "ringkv/engine", rank + 1, spec["world"] + 1, timeout
        )  # the driver is 0
        control.post("hello", os.getpid())
        cfg = _config_from(spec["config"])
        shape = EngineShape(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in spec["shape"].items()}
        )
        control.open_channel(
            depth=_depth(shape), direct=True
        )  # with the driver, before anything slow
        device = _rank_device(torch.device(spec["device"]), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            _backend(device),
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=spec["world"],
            timeout=timeout,
        )
        worker, _, _ = setup_rank(
            MeshShape(shape.pp, shape.sp, shape.tp),
            shape,
            cfg,
            SafetensorsSource(spec["path"]),
            getattr(torch, spec["dtype"]),
            device,
            control,
            CacheBudget(**spec["budget"]),
            timeout,
            spawned=True,
        )
        alive = parent_alive(parent_pid)
        while True:
            msg = control.receive(None, alive)
            kind = msg["kind"]
            if kind == "step":
                worker.run(msg["words"], msg["bytes"])
            elif kind in kvmove.KINDS:
                kvmove.serve(worker, control, msg)
            elif kind == "report":
                control.exchange(f"report{msg['n']}", worker.report())
            elif kind == "shutdown":
                break
        worker.link.flush()
        control.channel.reap(0)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - tell the driver why, then die so peers fail fast
        if control is not None:
            try:
                control.post("error", f"rank {rank}: {traceback.format_exc()}")
            except Exception:
                pass
        os._exit(1)
    # Everything is released above: end now. The interpreter's own teardown (torch's and gloo's
    # C++ destructors) took ~2.5 s per worker after its last line ran, and close() waited for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
