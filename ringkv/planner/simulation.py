"""The time model's pieces below the planner's options: one rank's forward ring attention
(``ring_attention_seconds``) and a message's cost (``message_seconds``); a whole engine run as
``benchmarks/engine.py`` measures it: the engine's own scheduler replays the requests
(``engine_workload``: a ``StepWork`` per step), each step's demands on a rank of each stage
(``_step_terms``: ``StepTerms``, ``RingTerms``) are priced with ``Rates`` (``_step_cost``), and an
event simulation of the driver and the stages gives the wall time (``engine_run_seconds``,
``_simulate``); ``EngineRun`` is a measured run with its modelled time (what ``fit_engine``
fits)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..model.config import ModelConfig
from ..parallel.tp import kv_heads_per_rank
from .hardware import Rates, with_threads
from .memory import DTYPES, layer_params, stage_sizes


# -- ring attention and messages
# ---------------------------------------------------------------------
def ring_attention_seconds(
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    act_bytes: int,
    r: Rates,
    link: str,
    causal: bool = True,
):
    """One rank's forward ring attention over ``ring`` ranks (balanced layout): ``(total s, compute
    s per step, transfer s per step, K/V bytes per step)``. Step 0 computes the local block; each
    of the ``ring - 1`` others takes ``max(compute, transfer)`` (the next hop is in flight while a
    block computes) plus the fp32 (out, lse) merge, which reads and writes the accumulator."""
    flops = (
        4 * head_dim * heads * seq * seq / ring * (0.5 if causal else 1.0)
    )  # this rank's pairs x 4 D
    step = flops / ring / r.attention
    nbytes = 2 * -(-seq // ring) * kv_heads * head_dim * act_bytes if ring > 1 else 0
    xfer = message_seconds(nbytes, link, r) if ring > 1 else 0.0
    merge = -(-seq // ring) * heads * (head_dim + 1) * (8 + act_bytes) / r.memory
    return step + (ring - 1) * (max(step, xfer) + merge), (step if ring > 1 else 0.0), xfer, nbytes


def message_seconds(nbytes: float, link: str, r: Rates, messages: int = 1) -> float:
    return messages * r.latency.get(link, 0.0) + nbytes / r.links[link]


Links = Union[str, Mapping[str, str]]  # one link for every axis, or {"tp": .., "sp": .., "pp": ..}


def shared_link(r: Rates, link: str, senders: int) -> Rates:
    """``r`` with ``link``'s bandwidth divided among ``senders`` ranks of a node sending over it
    at once, when it is one link per node (``Rates.shared``); else ``r``."""
    if senders <= 1 or not r.shared.get(link):
        return r
    return dataclasses.replace(r, links={**r.links, link: r.links[link] / senders})


def _axis_link(link: Links, axis: str) -> str:
    """The link ``axis`` ("tp", "sp", "pp") uses: ``link`` itself when it is one name."""
    return link if isinstance(link, str) else link[axis]


def ring_backward_seconds(
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    act_bytes: int,
    r: Rates,
    link: str,
    step_s: float,
    grad_bytes: int = 4,
) -> float:
    """One rank's backward of ring attention over ``ring`` ranks (``ring.py: _backward``), given
    the seconds ``step_s`` of one step's block backward: each of the ``ring - 1`` hops carries the
    K/V block (``act_bytes``) and, concurrently on the same link, the dK/dV travelling with the
    block before it (``grad_bytes``, float32 by default), while a block computes; after the last
    step the dK/dV go back to their owner in one more message, which nothing hides:
    ``step + (ring - 1) x max(step, kv + dkv transfer) + dkv transfer``."""
    if ring == 1:
        return step_s
    block = -(-seq // ring) * kv_heads * head_dim * 2
    kv = message_seconds(block * act_bytes, link, r)
    dkv = message_seconds(block * grad_bytes, link, r)
    both = kv + dkv - r.latency.get(link, 0.0)  # two messages in flight together
    return step_s + (ring - 1) * max(step_s, both) + dkv


def migration_seconds(
    kv_bytes: float,
    bandwidth: float,
    latency: float = 0.0,
    host_rate: Optional[float] = None,
    overlap: bool = True,
) -> float:
    """Seconds to move ``kv_bytes`` of K/V over one link of ``bandwidth`` bytes/s and
    ``latency`` s per message (``parallel.transfer.Link`` keeps several 4 MiB chunks in flight,
    so one latency). ``host_rate``: bytes/s the two ends process (copies and the SHA-256
    checksum; None: not limiting). ``overlap``: that work runs while the wire is busy, ``latency
    + max(bytes / bandwidth, bytes / host_rate)``, as it does on free cores; else it adds,
    ``latency + bytes / bandwidth + bytes / host_rate`` (CPUs busy with other work: measured on
    2 loaded cores, docs/plan.md)."""
    if kv_bytes < 0 or bandwidth <= 0 or latency < 0 or (host_rate is not None and host_rate <= 0):
        raise ValueError(
            f"migration_seconds needs bytes >= 0, bandwidth > 0, latency >= 0, host_rate > 0; "
            f"got {kv_bytes}, {bandwidth}, {latency}, {host_rate}"
        )
    wire, host = kv_bytes / bandwidth, kv_bytes / host_rate if host_rate else 0.0
    return latency + (max(wire, host) if overlap else wire + host)


# -- the engine's workload: what a benchmark run schedules, step by step
# ------------------------------
@dataclass(kw_only=True)
class StepWork:
    """One engine step as the scheduler built it (what its cost depends on)."""

    seqs: int  # sequences in the step
    tokens: int  # tokens computed (prompt chunks + one per decoding sequence)
    completing: int  # sequences whose last token is computed: LM head rows, sampled tokens
    pairs: int  # causal (query, key) pairs of attention: sum of n x (start + (n + 1) / 2)
    kv_tokens: int  # K/V token slots the batched paged attention reads: seqs x longest context
    longest: int  # the largest chunk (sp > 1: ring mode from sp_prefill_min_tokens on)


def engine_workload(
    prompts,
    max_tokens: int,
    num_blocks: int,
    *,
    pp: int = 1,
    sp: int = 1,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    prefix_caching: bool = True,
):
    """The steps ``LLM.generate`` runs for ``prompts`` (token-id lists, or lengths: distinct ids)
    with ``max_tokens`` output tokens each (EOS ignored) on a cache of ``num_blocks`` blocks:
    the engine's own ``StepPipeline`` over its ``Scheduler`` and ``BlockManager`` (``pp`` steps
    in flight, each with its share of the sequences; chunked prefill; preemption by recompute
    with prefix-cache hits), with ``_Timed`` in place of the model. Returns ``(steps,
    events)``: a ``StepWork`` per step and the driver's order of ``("submit", k)`` /
    ``("complete", k)``."""
    from ..cache.block_manager import BlockManager
    from ..engine.params import SamplingParams
    from ..engine.pipeline import StepPipeline
    from ..engine.scheduler import Scheduler
    from ..engine.sequence import Sequence

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    blocks = BlockManager(num_blocks, block_size * sp, enable_prefix_caching=prefix_caching)
    timed = _Timed(max_tokens)
    pipeline = StepPipeline(
        Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        timed,
        depth=pp,
    )
    for i, p in enumerate(prompts):
        ids = (
            list(range(10_000_000 * (i + 1), 10_000_000 * (i + 1) + p))
            if isinstance(p, int)
            else list(p)
        )
        pipeline.add([Sequence(seq_id=i, prompt=None, prompt_token_ids=ids, params=params)])
    while pipeline.busy:
        pipeline.advance()
    return timed.steps, timed.events


class _Timed:
    """``engine_workload``'s executor for the pipeline: it records what each step asks of the
    ranks (a ``StepWork``) instead of computing it, and gives each completing sequence a fresh
    token, finishing it after ``max_tokens``."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.fresh = max_tokens, 10**12
        self.steps: List[StepWork] = []
        self.events: List[tuple] = []
        self.inflight: "deque[int]" = deque()

    def submit(self, batch) -> None:
        ends = [s.start + s.n for s in batch]
        self.steps.append(
            StepWork(
                seqs=len(batch),
                tokens=sum(s.n for s in batch),
                completing=sum(s.completes for s in batch),
                pairs=sum(s.n * s.start + s.n * (s.n + 1) // 2 for s in batch),
                kv_tokens=len(batch) * max(ends),
                longest=max(s.n for s in batch),
            )
        )
        self.events.append(("submit", len(self.steps) - 1))
        self.inflight.append(len(self.steps) - 1)

    def result(self):
        self.events.append(("complete", self.inflight.popleft()))

    def tokens(self, batch, result) -> list:
        out = []
        for s in batch:
            if s.completes and not s.seq.finished:
                self.fresh += 1
                out.append((s.seq, self.fresh))
        return out

    def append(self, seq, token: int) -> None:
        seq.token_ids.append(token)
        if seq.num_tokens - len(seq.prompt_token_ids) >= self.max_tokens:
            seq.finish("length")

    def idle(self) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class RingTerms:
    """A step that runs the SP ring (its longest chunk has ``sp_prefill_min_tokens`` or more):
    per layer one ``ring_attention_seconds`` over the step's tokens, scaled to its causal pairs."""

    tokens: int  # tokens of the step: the ring's sequence length
    heads: int  # query heads on a TP rank
    kv_heads: int  # K/V heads on a TP rank (the ones that travel)
    head_dim: int  # elements per head
    ranks: int  # ranks in the ring (sp)
    act_bytes: int  # bytes per K/V element sent
    scale: float  # layers x the step's causal pairs / the pairs of one causal pass over ``tokens``


@dataclass(frozen=True, kw_only=True)
class StepTerms:
    """What one engine step asks of one rank of a stage, independent of the rates (``_step_terms``;
    priced by ``_step_cost``). Unpacks, like the tuple it replaced, as ``(layers, read_bytes,
    linear_flops, attention_flops, ring, messages, weight_bytes, rows)``."""

    layers: int  # decoder layers of the stage
    read_bytes: float  # bytes read from memory: the weights + the K/V the paged kernel reads
    linear_flops: float  # FLOPs of the linear layers (+ the LM head's rows on the last stage)
    attention_flops: float  # FLOPs of attention outside the ring (0 when ``ring`` is set)
    ring: Optional[RingTerms]  # the SP ring when the step runs it, else None (replicated)
    messages: Tuple[
        Tuple[float, int], ...
    ]  # (bytes sent, messages) of each collective and hand-off
    weight_bytes: (
        float  # the weights' share of ``read_bytes`` (read at ``Rates.gemm`` when measured)
    )
    # tokens a matmul multiplies on this rank (tokens / sp in ring mode): selects ``gemm``
    rows: float
    axes: Tuple[str, ...] = ()  # the axis ("tp", "sp", "pp") of each of ``messages``
    # ranks of the stage that send their PP / SP messages at once (its TP ranks: each sends
    # its own hidden states, its own heads' K/V); they share a per-node link (``shared_link``)
    senders: int = 1

    def __iter__(self):
        return iter(
            (
                self.layers,
                self.read_bytes,
                self.linear_flops,
                self.attention_flops,
                self.ring,
                self.messages,
                self.weight_bytes,
                self.rows,
            )
        )


def _step_terms(
    cfg: ModelConfig,
    w: StepWork,
    *,
    tp: int,
    pp: int,
    sp: int,
    stage: int,
    dtype: str,
    sp_prefill_min_tokens: int,
) -> StepTerms:
    """What step ``w`` asks of one rank of ``stage``, independent of the rates. ``ring``: the
    ``RingTerms`` when the step runs the SP ring, else None; ``messages``: ``(bytes sent, message
    count)`` of each of its collectives and hand-offs."""
    act = DTYPES[dtype][1] if dtype != "fp8" else 2
    n = stage_sizes(cfg, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    d, h = cfg.head_dim, cfg.hidden_size
    hq, hkv = cfg.num_heads // tp, kv_heads_per_rank(cfg, tp)
    lin = layer_params(cfg, tp)
    vocab = -(-cfg.vocab_size // tp)
    ring = (
        sp > 1 and w.longest >= sp_prefill_min_tokens
    )  # else replicated: every SP rank computes all tokens
    rows = w.tokens / sp if ring else w.tokens
    flops = 2 * n * lin["linear"] * rows + (2 * vocab * h * w.completing if last else 0)
    wbytes = (n * lin["total"] + (vocab * h if last and w.completing else 0)) * act
    nbytes = (
        wbytes + n * w.kv_tokens / sp * 2 * hkv * d * act
    )  # + the K/V a rank stores, read by the paged kernel
    msgs, axes = [], []
    if ring:
        ring_terms = RingTerms(
            tokens=w.tokens,
            heads=hq,
            kv_heads=hkv,
            head_dim=d,
            ranks=sp,
            act_bytes=act,
            scale=n * w.pairs / max(1, w.tokens * (w.tokens + 1) // 2),
        )
        attn = 0.0
    else:
        ring_terms, attn = None, n * 4 * hq * d * w.pairs / sp
        if sp > 1:  # (out, lse) partials merged over the SP group each layer
            msgs.append((n * w.tokens * hq * (d + 1) * 4, n * math.ceil(math.log2(sp))))
            axes.append("sp")
    if tp > 1:  # two all-reduces per layer (+ the vocab-parallel embedding), the vocabulary gather
        count = (
            2 * n + first
        )  # ring all-reduces: 2 (tp - 1) messages, 2 (tp - 1) / tp of the tensor sent
        msgs.append((count * 2 * (tp - 1) / tp * rows * h * act, count * 2 * (tp - 1)))
        axes.append("tp")
        if last and w.completing:
            msgs.append(((tp - 1) * vocab * w.completing * act, tp - 1))
            axes.append("tp")
    if pp > 1 and not last:
        msgs.append((rows * h * act, 1))
        axes.append("pp")
    return StepTerms(
        layers=n,
        read_bytes=nbytes,
        linear_flops=flops,
        attention_flops=attn,
        ring=ring_terms,
        messages=tuple(msgs),
        weight_bytes=wbytes,
        rows=rows,
        axes=tuple(axes),
        senders=tp,
    )


def _step_cost(terms: StepTerms, r: Rates, link: Links) -> float:
    """Seconds of one rank's share of a step: ``layers x host["layer"] + max(bytes / memory,
    linear FLOPs / matmul) + attention FLOPs / attention`` (or the ring), plus its messages; with
    a measured ``gemm`` rate the weights' share of ``bytes`` is read at it. ``link``: one link
    name for every message, or the link of each axis (``{"tp": .., "sp": .., "pp": ..}``; the
    SP ring uses "sp"); PP and SP messages of the stage's ``senders`` share a per-node link."""
    bw = r.weight_rate(terms.rows)
    read = (
        terms.read_bytes / r.memory
        if bw is None
        else (terms.read_bytes - terms.weight_bytes) / r.memory + terms.weight_bytes / bw
    )
    t = (
        terms.layers * r.host.get("layer", 0.0)
        + max(read, terms.linear_flops / r.matmul)
        + terms.attention_flops / r.attention
    )
    ring = terms.ring
    if ring is not None:  # one ring per layer over the step's tokens (scaled to its causal pairs)
        sp_link = _axis_link(link, "sp")
        t += (
            ring.scale
            * ring_attention_seconds(
                ring.tokens,
                ring.heads,
                ring.kv_heads,
                ring.head_dim,
                ring.ranks,
                ring.act_bytes,
                shared_link(r, sp_link, terms.senders),
                sp_link,
            )[0]
        )
    axes = terms.axes or ("tp",) * len(terms.messages)
    for (nb, count), axis in zip(terms.messages, axes):
        name = _axis_link(link, axis)
        t += message_seconds(
            nb, name, shared_link(r, name, 1 if axis == "tp" else terms.senders), count
        )
    return t


def engine_run_seconds(
    cfg: ModelConfig,
    steps,
    events,
    r: Rates,
    *,
    tp: int = 1,
    pp: int = 1,
    sp: int = 1,
    dtype: str = "float32",
    sp_prefill_min_tokens: int = 64,
    link: Optional[Links] = None,
) -> float:
    """Wall time of the steps of ``engine_workload`` run by a ``tp x pp x sp`` engine whose ranks
    have rates ``r``. The driver (rank 0, also stage 0) spends ``host["step"] + host["seq"] x
    seqs`` per step (schedule, step plan, publish, sample, append), then runs stage 0; stage ``i``
    starts a step once it is free and stage ``i - 1`` has handed it over (``_step_cost``); a
    step completes when its last stage is done; the driver plans the next steps after
    completing the oldest one in flight (``pp`` in flight). TP and SP ranks of a stage run in
    lockstep (their collectives are in the step cost). ``link``: the link name of every
    message, or one per axis (``{"tp": "loopback", "sp": "ib", "pp": "ib"}``); default the
    first of ``r.links``."""
    terms = _run_terms(cfg, steps, tp, pp, sp, dtype, sp_prefill_min_tokens)
    return _simulate(steps, events, terms, r, link or next(iter(r.links)))


def _run_terms(cfg, steps, tp, pp, sp, dtype="float32", sp_prefill_min_tokens=64) -> list:
    """``_step_terms`` of every step (rows) and stage (columns)."""
    return [
        [
            _step_terms(
                cfg,
                w,
                tp=tp,
                pp=pp,
                sp=sp,
                stage=i,
                dtype=dtype,
                sp_prefill_min_tokens=sp_prefill_min_tokens,
            )
            for i in range(pp)
        ]
        for w in steps
    ]


def _simulate(steps, events, terms, r: Rates, link: Links) -> float:
    """The event simulation of ``engine_run_seconds`` over precomputed ``_step_terms``."""
    step_s, seq_s = r.host.get("step", 0.0), r.host.get("seq", 0.0)
    pp = len(terms[0]) if terms else 1
    t0, free, end = 0.0, [0.0] * pp, {}
    for kind, k in events:
        if kind == "submit":
            t0 += step_s + seq_s * steps[k].seqs
            start = t0
            for i in range(pp):
                free[i] = max(start, free[i]) + _step_cost(terms[k][i], r, link)
                start = free[i]
            t0, end[k] = free[0], free[-1]
        else:
            t0 = max(t0, end[k])
    return t0


@dataclass(kw_only=True)
class EngineRun:
    """A measured engine run: its model, requests (token-id lists or prompt lengths), output
    tokens per request, cache blocks, wall seconds, mesh, torch threads per rank, scheduler
    limits and the link of each axis (``links``: ``{"tp": .., "sp": .., "pp": ..}``, default the
    first of the rates' links for all); ``seconds(r)`` is the model's time for it with one
    thread's rates ``r`` (the workload and step terms are computed once)."""

    cfg: ModelConfig
    prompts: list
    max_tokens: int
    num_blocks: int
    measured_s: float
    tp: int = 1
    pp: int = 1
    sp: int = 1
    threads: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    label: str = ""
    links: Optional[Dict[str, str]] = None
    sp_prefill_min_tokens: int = 64
    _cache: Any = field(default=None, repr=False)

    def seconds(self, r: Rates) -> float:
        if self._cache is None:
            steps, events = engine_workload(
                self.prompts,
                self.max_tokens,
                self.num_blocks,
                pp=self.pp,
                sp=self.sp,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            )
            terms = _run_terms(
                self.cfg,
                steps,
                self.tp,
                self.pp,
                self.sp,
                sp_prefill_min_tokens=self.sp_prefill_min_tokens,
            )
            self._cache = steps, events, terms
        steps, events, terms = self._cache
        link = self.links or next(iter(r.links))
        return _simulate(steps, events, terms, with_threads(r, self.threads), link)
