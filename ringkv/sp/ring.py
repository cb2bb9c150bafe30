"""Ring attention: exact attention over a sequence sharded across an SP process group.

Each rank holds ``q, k, v`` for its shard (in ``layout``). K and V travel around the ring as
one message per hop; the hop for step ``i+1`` is posted before step ``i``'s block is computed
and waited for after it. Each step's block is computed by a kernel (``ringkv.kernels``) with
the mask of the two shards' *global* positions, and merged into a float32 accumulator by LSE.
Blocks whose mask is empty are skipped. Backward: dQ accumulates locally; dK/dV (float32)
travel the ring with their K/V and go back to their owner after the last step, in float32,
in ``grad_comm_dtype``, or with ``"auto"`` in bf16 where the first call of a configuration
measured that float32 would not hide behind the backward's compute (``AutoWire``).

Sliding windows (``window=(left, right)``) and packed documents (``cu_seqlens``) make many
blocks empty: the ring stops after the last step at which any rank's queries see the keys
arriving (a function of the shards that every rank computes alike), so K/V make only the hops
they need, and the dK/dV of the last step take one direct message back to their owner.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels
from ..kernels.mask import EMPTY, FULL, NO_WINDOW, OFFSET, Mask, check_window, make_mask
from .collectives import GroupMemory, agree_once, wait as _bounded_wait
from .comm import LocalComm, RingComm
from .layout import (
    LAYOUTS,
    CuSeqlens,
    check_cu_seqlens,
    check_layout,
    chunks,
    granule,
    varlen_chunks,
    varlen_local_len,
)
from ..kernels.merge import empty_partial
from .spans import Spans, check_spans, span_calls

__all__ = [
    "ring_attention",
    "ring_attention_shards",
    "Shards",
    "RingAttention",
    "RingStats",
    "AutoWire",
    "auto_decisions",
    "forget_auto",
]

log = logging.getLogger(__name__)


@dataclass
class RingStats:
    """What this rank computed in one ring forward (for tests and benchmarks): pass a
    ``RingStats()`` as ``stats=`` and the forward fills it; the backward of that call then fills
    ``backward`` (a ``RingStats`` of its own)."""

    steps: int = 0
    calls: int = 0  # kernel calls
    skipped: int = 0  # chunk pairs skipped because their mask is empty
    pairs: int = 0  # visible (query, key) pairs computed: the real work
    per_step: List[int] = field(default_factory=list)
    hops: int = 0  # messages this rank sent (K and V together are one)
    bytes_sent: int = 0  # K/V bytes sent to the next rank: bytes per hop x hops
    backward: Optional["RingStats"] = None  # of the backward (dK/dV travel too), once it ran
    # the backward's: the dK/dV message dtype it used (None: float32), and with
    # grad_comm_dtype="auto" the measured transfer / compute ratio that chose it (None while the
    # first call of the configuration measures it; that call sends float32)
    grad_comm_dtype: Optional[torch.dtype] = None
    comm_ratio: Optional[float] = None


def _slices(ranges: List[range]) -> List[slice]:
    out, start = [], 0
    for r in ranges:
        out.append(slice(start, start + len(r)))
        start += len(r)
    return out


def plan(
    q_ranges: List[range],
    k_ranges: List[range],
    causal: bool,
    window: Tuple[int, int] = NO_WINDOW,
    q_docs: Optional[Tuple[int, ...]] = None,
    k_docs: Optional[Tuple[int, ...]] = None,
) -> List[Tuple[slice, slice, Mask]]:
    """Kernel calls for one ring step: ``(q rows, k rows, mask)``, empty pairs dropped.

    Pairs of chunks get their mask from global positions (and ``window``); a query chunk that
    sees all keys, or a key chunk seen fully by all queries, becomes one call. A shard against
    itself is one causal call (every layout keeps a shard's positions increasing). With
    ``q_docs``/``k_docs`` (the document of each range, ``-1`` = padding) only pairs of ranges of
    one document are computed, on positions within that document.
    """
    qs, ks = _slices(q_ranges), _slices(k_ranges)
    sq, sk = qs[-1].stop, ks[-1].stop
    if q_docs is not None:
        by_doc = defaultdict(list)  # document -> its key ranges
        for j, doc in enumerate(k_docs):
            by_doc[doc].append(j)
        calls = []
        for i, doc in enumerate(q_docs):
            for j in by_doc[doc] if doc >= 0 else ():
                mask = make_mask(
                    causal,
                    q_ranges[i],
                    k_ranges[j],
                    len(q_ranges[i]),
                    len(k_ranges[j]),
                    window=window,
                )
                calls += [(qs[i], ks[j], mask)] if mask.kind != EMPTY else []
        return calls
    if (
        causal and window == NO_WINDOW and q_ranges == k_ranges
    ):  # a shard against itself: local causal
        return [(slice(0, sq), slice(0, sk), Mask(OFFSET, offset=0))]
    m = [
        [make_mask(causal, a, b, len(a), len(b), window=window) for b in k_ranges] for a in q_ranges
    ]
    if all(x.kind == FULL for row in m for x in row):
        return [(slice(0, sq), slice(0, sk), Mask(FULL))]
    calls, rest = [], []
    for i, row in enumerate(m):
        if all(x.kind == FULL for x in row):
            calls.append((qs[i], slice(0, sk), Mask(FULL)))
        else:
            rest.append(i)
    for j in range(len(ks)):
        if len(rest) == len(qs) and all(m[i][j].kind == FULL for i in rest):
            calls.append((slice(0, sq), ks[j], Mask(FULL)))
            continue
        calls += [(qs[i], ks[j], m[i][j]) for i in rest if m[i][j].kind != EMPTY]
    return calls


def _bits(x: Optional[float]) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def call_values(
    q,
    k,
    causal,
    layout,
    scale,
    backend,
    window=NO_WINDOW,
    cu=None,
    v=None,
    softcap=None,
    sinks=None,
    spans=None,
) -> Tuple[List[str], List[int]]:
    """Names and integer values of the shapes and settings every rank must agree on (for
    ``agree``)."""
    names = [
        "batch",
        "seq_local",
        "heads",
        "head_dim",
        "kv_heads",
        "dtype",
        "layout",
        "causal",
        "scale",
        "backend",
        "window",
        "window",
        "cu_seqlens",
        "v_head_dim",
        "softcap",
        "sinks",
        "spans",
    ]
    values = [
        *q.shape,
        k.shape[2],
        zlib.crc32(str(q.dtype).encode()),
        LAYOUTS.index(layout),
        int(causal),
        _bits(scale),
        zlib.crc32(backend.encode()),
        *window,
        -1 if cu is None else zlib.crc32(repr(cu).encode()),
        (k if v is None else v).shape[-1],
        _bits(softcap),
        int(sinks is not None),
        -1 if spans is None else zlib.crc32(repr(spans).encode()),
    ]
    return names, values


def _check_across_ranks(
    comm: RingComm,
    q,
    k,
    causal,
    layout,
    scale,
    backend,
    window,
    cu,
    grad_comm_dtype,
    v=None,
    softcap=None,
    sinks=None,
    spans=None,
) -> None:
    """All ranks must call with the same shapes and settings: one tiny bounded all-gather the first
    time a configuration is seen on this group, nothing on later calls (``agree_once``)."""
    names, values = call_values(
        q, k, causal, layout, scale, backend, window, cu, v, softcap, sinks, spans
    )
    values.append(zlib.crc32(str(grad_comm_dtype).encode()))
    agree_once(
        values, names + ["grad_comm_dtype"], comm.group, comm.timeout, "ring_attention", q.device
    )


GRAD_COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, "auto")


def check_grad_comm_dtype(grad_comm_dtype):
    if isinstance(grad_comm_dtype, str) and grad_comm_dtype == "auto":
        return "auto"
    if isinstance(grad_comm_dtype, str) or grad_comm_dtype not in GRAD_COMM_DTYPES:
        raise ValueError(
            f"grad_comm_dtype must be None (float32), torch.float32, torch.bfloat16, "
            f"torch.float16 or 'auto', got {grad_comm_dtype!r}"
        )
    return None if grad_comm_dtype == torch.float32 else grad_comm_dtype


AUTO_RATIO = 1.0  # "auto" sends bf16 dK/dV when transfer / compute per backward step exceeds it


@dataclass(frozen=True)
class AutoWire:
    """What ``grad_comm_dtype="auto"`` chose for one configuration on one group, the same on
    every rank (``auto_decisions()``).

    ``transfer_s``: seconds of one K/V hop alone (measured in the first call's forward: its first
    hop is waited for before any compute), max over the group; ``step_transfer_s``: that scaled
    to one backward step's float32 traffic (K/V plus dK/dV); ``compute_s``: the first call's
    backward compute per ring step (steps >= 1), max over the group; ``ratio`` =
    ``step_transfer_s / compute_s``; ``threshold``: the ``AUTO_RATIO`` (or
    ``RINGKV_GRAD_COMM_AUTO_RATIO``) in force, max over the group; ``dtype``: ``torch.bfloat16``
    when ``ratio > threshold`` (float32 dK/dV would not hide behind the compute), else None
    (float32, exact)."""

    transfer_s: float
    step_transfer_s: float
    compute_s: float
    ratio: float
    threshold: float
    dtype: Optional[torch.dtype]


AUTO = GroupMemory()  # group -> configuration -> AutoWire
AUTO_PER_GROUP = 64  # decisions kept per group (the oldest dropped first: the same on every rank)


def auto_decisions() -> dict:
    """This rank's ``grad_comm_dtype="auto"`` decisions: ``{(group, configuration): AutoWire}``
    (the configuration: ``call_values`` of the call, packed or not in place of the documents'
    boundaries, so packed batches of one shape share a decision). Every rank of a group holds the
    same; at most ``AUTO_PER_GROUP`` per group, the oldest dropped first."""
    return AUTO.snapshot()


def forget_auto(group=None) -> None:
    """Drop the ``"auto"`` decisions on ``group`` (default: the world) on this rank: the next call
    measures again. Every rank of the group must call it (one that remembers and one that does not
    make different collectives)."""
    AUTO.forget(dist.group.WORLD if group is None else group)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Auto:
    """One ``"auto"`` call: its ``(group, configuration)`` key, the decision when there is one
    (``decision()``), else what its forward (``transfer_s``) and backward measure."""

    def __init__(self, key, comm: RingComm):
        (self.group, self.config), self.comm = key, comm
        self.probe = self.decision() is None  # the first call of a configuration measures
        self.transfer_s: Optional[float] = None

    def decision(self) -> Optional[AutoWire]:
        return AUTO.get(self.group, self.config)

    def decide(self, step_transfer_s: float, compute_s: float, device) -> AutoWire:
        """The decision from this rank's measurements, agreed over the group (max of each, one
        bounded all-reduce): every rank gets the same floats, so the same dtype."""
        threshold = float(os.environ.get("RINGKV_GRAD_COMM_AUTO_RATIO", AUTO_RATIO))
        x = torch.tensor(
            [self.transfer_s, step_transfer_s, compute_s, threshold],
            dtype=torch.float64,
            device=device,
        )
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.comm.group, async_op=True)
        _bounded_wait(work, x, self.comm.timeout, "ring_attention grad_comm_dtype='auto'")
        t, st, c, thr = x.tolist()
        ratio = st / c if c > 0 else math.inf
        wire = AutoWire(t, st, c, ratio, thr, torch.bfloat16 if ratio > thr else None)
        AUTO.put(self.group, self.config, wire, AUTO_PER_GROUP)
        log.info(
            "ring_attention grad_comm_dtype='auto' on rank %d/%d: transfer %.4fs/step vs backward "
            "compute %.4fs/step (ratio %.3f, threshold %.3f): dK/dV in %s",
            self.comm.rank,
            self.comm.world,
            st,
            c,
            ratio,
            thr,
            "bfloat16" if wire.dtype else "float32",
        )
        return wire


@dataclass(frozen=True)
class Shards:
    """Global positions of every rank's queries and keys: ``q[r]`` / ``k[r]`` are lists of
    increasing ``range``s in local order (``layout.chunks`` for the standard layouts).

    Packed documents: ``q_docs[r][i]`` is the document of range ``q[r][i]`` (whose positions
    are then within that document), ``-1`` for pad rows (never computed); likewise ``k_docs``.
    ``spans``: bidirectional spans of each batch row in causal attention (``ringkv.sp.spans``)."""

    q: Tuple[Tuple[range, ...], ...]
    k: Tuple[Tuple[range, ...], ...]
    q_docs: Optional[Tuple[Tuple[int, ...], ...]] = None
    k_docs: Optional[Tuple[Tuple[int, ...], ...]] = None
    spans: Optional[Spans] = None

    @classmethod
    @functools.lru_cache(maxsize=64)
    def of_layout(cls, seq_len: int, layout: str, world: int) -> "Shards":
        ranges = tuple(tuple(chunks(seq_len, layout, r, world)) for r in range(world))
        return cls(ranges, ranges)

    @classmethod
    def of_varlen(cls, cu_seqlens: CuSeqlens, layout: str, world: int) -> "Shards":
        return cls._of_varlen(check_cu_seqlens(cu_seqlens), layout, world)

    @classmethod
    @functools.lru_cache(maxsize=64)
    def _of_varlen(cls, cu_seqlens: Tuple[int, ...], layout: str, world: int) -> "Shards":
        pieces = [varlen_chunks(cu_seqlens, layout, r, world) for r in range(world)]
        ranges = tuple(tuple(r for _, r in p) for p in pieces)
        docs = tuple(tuple(d for d, _ in p) for p in pieces)
        return cls(ranges, ranges, docs, docs)

    def plan(self, rank: int, src: int, causal: bool, window: Tuple[int, int]):
        """``plan`` of rank ``rank``'s queries against rank ``src``'s keys."""
        docs = (self.q_docs[rank], self.k_docs[src]) if self.q_docs is not None else (None, None)
        return plan(list(self.q[rank]), list(self.k[src]), causal, window, *docs)

    def calls(self, rank: int, src: int, causal: bool, window: Tuple[int, int]):
        """``plan`` as ``(batch rows, q rows, k rows, mask)`` (every row: ``slice(None)``), then
        the ``spans``' extra calls (``span_calls``: a span's keys after each of its queries)."""
        calls = [(slice(None), *c) for c in self.plan(rank, src, causal, window)]
        if self.spans is not None:
            calls += span_calls(self.q[rank], self.k[src], self.spans)
        return calls


def _heads_first(device: torch.device) -> bool:
    """Whether K and V travel in ``(B, Hkv, S, D)`` memory: on CPU, where torch's flash op runs
    4-8% faster (forward and backward) with K/V heads-first than with rows strided by ``Hkv * D``;
    the layout of q, out, dout and the gradients makes no difference there (measured,
    ``docs/performance.md``). The kernels see ``(B, S, Hkv, D)`` views either way."""
    return device.type == "cpu"


def _unpack(buf: torch.Tensor, k_shape, v_shape, hf: bool = False):
    """A flat message's K ``(B, S, Hkv, D)`` and V ``(B, S, Hkv, Dv)`` views: K's elements then V's,
    each in ``(B, Hkv, S, .)`` memory when ``hf``. V may have its own head size (MLA)."""

    def view(flat, shape):
        b, s, h, d = shape
        return flat.view(b, h, s, d).transpose(1, 2) if hf else flat.view(shape)

    nk = math.prod(k_shape)
    return view(buf[:nk], k_shape), view(buf[nk:], v_shape)


def _pack(k, v, hf: bool) -> torch.Tensor:
    """K and V as one flat message (``_unpack`` gives them back)."""
    buf = torch.empty(k.numel() + v.numel(), dtype=k.dtype, device=k.device)
    for dst, src in zip(_unpack(buf, k.shape, v.shape, hf), (k, v)):
        dst.copy_(src)
    return buf


@functools.lru_cache(maxsize=64)
def _last_step(shards: Shards, causal: bool, window: Tuple[int, int]) -> int:
    """The last ring step at which some rank's queries see the arriving keys (every rank agrees)."""
    n = len(shards.q)
    if window == NO_WINDOW and shards.q_docs is None:
        return n - 1  # without windows or documents the whole ring runs, as it always did
    return next(
        (
            t
            for t in range(n - 1, 0, -1)
            if any(shards.calls(r, (r - t) % n, causal, window) for r in range(n))
        ),
        0,
    )


def _forward(
    q,
    k,
    v,
    scale,
    causal,
    window,
    shards: Shards,
    comm: RingComm,
    backend,
    softcap=None,
    into=None,
    auto: Optional[_Auto] = None,
):
    """``into``: a ``RingStats`` to fill with this forward's counts, or None. ``auto``: an
    ``"auto"`` call; when it measures, the first hop is timed alone (after a barrier, before any
    compute)."""
    b, s, h, d = q.shape
    n, r = comm.world, comm.rank
    last = _last_step(shards, causal, window)
    out = lse = None  # the float32 accumulator: the first partial over all rows, else empty_partial
    hf = _heads_first(q.device)
    bufs = [_pack(k, v, hf), None]  # K and V travel as one message
    bufs[1] = torch.empty_like(bufs[0])
    stats = RingStats(steps=last + 1)
    probe = auto is not None and auto.probe and last > 0
    if probe:  # every rank at the start line: the hop's time is the link's, not a late peer's
        x = torch.zeros(1, device=q.device)
        work = dist.all_reduce(x, group=comm.group, async_op=True)
        _bounded_wait(work, x, comm.timeout, "ring_attention grad_comm_dtype='auto'")
        _sync(q.device)
    for step in range(last + 1):
        if step < last:
            t0 = time.perf_counter()
            comm.send_recv([bufs[step % 2]], [bufs[(step + 1) % 2]])
            stats.hops += 1
            stats.bytes_sent += bufs[0].numel() * bufs[0].element_size()
            if probe and step == 0:
                comm.wait()
                _sync(q.device)
                auto.transfer_s = time.perf_counter() - t0
        cur = _unpack(bufs[step % 2], k.shape, v.shape, hf)  # K (B, S, Hkv, D), V (B, S, Hkv, Dv)
        src = (r - step) % n
        calls = shards.calls(r, src, causal, window)  # (batch rows, q rows, k rows, mask)
        work = 0
        for bs, qs, ks, mask in calls:
            args = (q[bs, qs], cur[0][bs, ks], cur[1][bs, ks])
            if out is None and bs == slice(None) and (qs.start, qs.stop) == (0, s):
                # nothing to merge with yet: take it as it is
                o, lse = kernels.block_forward(
                    *args, scale=scale, mask=mask, backend=backend, softcap=softcap
                )
                out = o.float()
            else:
                if out is None:
                    out, lse = empty_partial(b, s, h, v.shape[-1], q.device)
                kernels.block_forward_into(
                    out[bs, qs],
                    lse[bs, :, qs],
                    *args,
                    scale=scale,
                    mask=mask,
                    backend=backend,
                    softcap=softcap,
                )
            work += mask.pairs(qs.stop - qs.start, ks.stop - ks.start)
        stats.calls += len(calls)
        base = sum(bs == slice(None) for bs, *_ in calls)  # the causal calls (not the spans')
        stats.skipped += len(shards.q[r]) * len(shards.k[src]) - base
        stats.pairs += work
        stats.per_step.append(work)
        if step < last and not (probe and step == 0):
            comm.wait()
    if out is None:  # no query of this rank sees any key (e.g. only pad rows)
        out, lse = empty_partial(b, s, h, v.shape[-1], q.device)
    if into is not None:
        vars(into).update(vars(stats))  # backward: None until this call's backward runs
    return out.to(q.dtype), lse


def _backward(
    dout,
    dlse,
    q,
    k,
    v,
    out,
    lse,
    scale,
    causal,
    window,
    shards: Shards,
    comm: RingComm,
    backend,
    grad_comm_dtype=None,
    softcap=None,
    into=None,
):
    """dK/dV of the block held at step ``t >= 1`` travel on with it (one ring hop per step); after
    the last step they go straight back to their owner (``last`` hops behind) in one message,
    where they join the owner's own share (step 0). They travel in ``grad_comm_dtype`` (default
    float32) and are summed in float32 at every hop. Every buffer is allocated once per call.
    ``into``: the forward's ``RingStats`` (or None), whose ``backward`` this fills.
    ``grad_comm_dtype`` may be an ``_Auto``: the dtype its configuration's decision chose, else
    float32 while this call measures its compute per step and then decides (``_Auto.decide``)."""
    kv_comm, dkv_comm = comm, comm.with_tag(1)
    n, r = kv_comm.world, kv_comm.rank
    last = _last_step(shards, causal, window)
    stats = RingStats(steps=last + 1)
    auto, measure = _auto_backward(grad_comm_dtype, stats, last)
    compute_s = 0.0
    wire = stats.grad_comm_dtype or torch.float32
    hf = _heads_first(q.device)
    dq, kv, mine, dkv, blk = _grad_buffers(q, k, v, hf, last, wire)
    for step in range(last + 1):
        if step < last:
            kv_comm.send_recv([kv[step % 2]], [kv[(step + 1) % 2]])
            stats.hops += 1
            stats.bytes_sent += kv[0].numel() * kv[0].element_size()
        cur = _unpack(kv[step % 2], k.shape, v.shape, hf)  # K (B, S, Hkv, D), V (B, S, Hkv, Dv)
        src = (r - step) % n
        acc = mine if step == 0 else dkv[1] if step == 1 and wire == torch.float32 else blk
        if step > 0:
            acc.zero_()  # a sum of the calls' shares (mine is zeros already)
        dk_acc, dv_acc = _unpack(acc, k.shape, v.shape)
        calls = shards.calls(r, src, causal, window)  # (batch rows, q rows, k rows, mask)
        if measure and step >= 1:
            _sync(q.device)
            t0 = time.perf_counter()
        for bs, qs, ks, mask in calls:
            kernels.block_backward_into(
                dq[bs, qs],
                dk_acc[bs, ks],
                dv_acc[bs, ks],
                dout[bs, qs],
                q[bs, qs],
                cur[0][bs, ks],
                cur[1][bs, ks],
                out[bs, qs],
                lse[bs, :, qs],
                scale=scale,
                mask=mask,
                dlse=None if dlse is None else dlse[bs, :, qs],
                backend=backend,
                softcap=softcap,
            )
        if measure and step >= 1:
            _sync(q.device)
            compute_s += time.perf_counter() - t0
        stats.calls += len(calls)
        if step >= 1:
            send = dkv[step % 2]
            if step >= 2:
                dkv_comm.wait()  # the dK/dV of block src from the ranks that held it before
                if wire == torch.float32:
                    send += blk
                else:  # sum in float32, round once for the wire
                    send.copy_(blk.add_(send))
            elif acc is not send:
                send.copy_(acc)
            # on to the next rank, or after the last step straight back to the owner
            dkv_comm.send_recv([send], [dkv[(step + 1) % 2]], offset=1 if step < last else -last)
            stats.hops += 1
            stats.bytes_sent += send.numel() * send.element_size()
        if step < last:
            kv_comm.wait()
    if last > 0:
        dkv_comm.wait()  # every rank's block came back from the rank that held it last
        mine += dkv[(last + 1) % 2]
    if measure:  # float32 dK/dV travel with their K/V at every step: scale the hop's time
        kv_bytes = kv[0].numel() * kv[0].element_size()
        step_transfer = auto.transfer_s * (kv_bytes + mine.numel() * 4) / kv_bytes
        stats.comm_ratio = auto.decide(step_transfer, compute_s / last, q.device).ratio
    if into is not None:
        into.backward = stats
    dk, dv = _unpack(mine, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _auto_backward(grad_comm_dtype, stats: RingStats, last: int):
    """``(auto, measure)`` of a backward: the ``_Auto`` (or None) and whether this call measures
    its compute per step; sets ``stats.grad_comm_dtype`` (the dK/dV dtype, None: float32) and,
    from a decision, ``stats.comm_ratio``."""
    auto, measure = None, False
    if isinstance(grad_comm_dtype, _Auto):
        auto, decided = grad_comm_dtype, grad_comm_dtype.decision()
        grad_comm_dtype = decided.dtype if decided else None
        stats.comm_ratio = decided.ratio if decided else None
        measure = decided is None and auto.transfer_s is not None and last > 0
    stats.grad_comm_dtype = grad_comm_dtype
    return auto, measure


def _grad_buffers(q, k, v, hf: bool, last: int, wire: torch.dtype):
    """Every buffer of a backward, allocated once: ``dq`` (float32), ``kv`` (the packed K/V and
    the buffer receiving the next), ``mine`` (own dK then dV, flat float32: ``_unpack``), ``dkv``
    (the travelling dK/dV in ``wire``) and ``blk`` (one step's share, float32, or None)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [_pack(k, v, hf), None]
    kv[1] = torch.empty_like(kv[0])
    mine = torch.zeros(kv[0].shape, dtype=torch.float32, device=q.device)
    # the travelling dK/dV, double-buffered: receive into one while the other is sent
    dkv = [torch.empty(mine.shape, dtype=wire, device=q.device) for _ in range(2)] if last else []
    # this step's share of the block held (float32); with a float32 wire step 1 computes into its
    # send buffer
    blk = torch.empty_like(mine) if last > 1 or (last and wire != torch.float32) else None
    return dq, kv, mine, dkv, blk


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    timeout: Optional[timedelta] = None,
    check: bool = True,
    comm: Optional[RingComm] = None,
    window: Tuple[int, int] = NO_WINDOW,
    cu_seqlens: Optional[CuSeqlens] = None,
    grad_comm_dtype: Optional[torch.dtype] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[RingStats] = None,
    spans=None,
):
    """Exact attention of this rank's query shard over the whole sharded sequence.

    Args:
        q: ``(B, S_local, H, D)``, this rank's shard in ``layout``.
        k, v: ``(B, S_local, Hkv, D)`` and ``(B, S_local, Hkv, Dv)`` with ``H % Hkv == 0``; only the
            ``Hkv`` heads travel; V may have its own head size (MLA: K and V of different widths
            travel as one message).
        causal: mask ``q_pos >= k_pos`` on global positions.
        window: ``(left, right)``: key visible iff ``q_pos - left <= k_pos <= q_pos + right``
            (``-1`` unbounded; causal means ``right = 0``). K/V make only the hops they need.
        cu_seqlens: packed documents ``[0, l0, l0+l1, ..., S]`` (int list or tensor, the same on
            every rank): q/k/v are ``(1, S_local, ., D)`` shards from ``ringkv.shard(x, 1, layout,
            cu_seqlens=...)``, each document split by ``layout`` and padded on its own. No token
            sees another document; pad rows give ``out = 0``, ``lse = -inf`` and are never seen.
            Prefer a list: a tensor is read to the host (a sync on CUDA) the first time it is
            passed, then remembered while it is the same, unmodified tensor.
        group: the SP process group (default: the world; no process group = one rank).
        layout: ``"zigzag"`` (default: balances causal work), ``"contiguous"`` or ``"striped"``
            (see ``ringkv.sp.layout``); shard with the same layout (``ringkv.shard``).
        softmax_scale: default ``1/sqrt(D)``.
        return_lse: also return the float32 LSE ``(B, H, S_local)``.
        backend: kernel backend name or ``"auto"``.
        timeout: bound on every wait (gloo); default ``RINGKV_TIMEOUT_S`` or 300 s.
        check: verify that every rank passes the same shapes and settings: one tiny all-gather
            the first time this configuration is used on the group, nothing afterwards.
        grad_comm_dtype: dtype of the dK/dV messages of the backward (default ``None``: float32,
            exact); ``torch.bfloat16`` halves their bytes. They are summed in float32 at every
            hop. ``"auto"`` (opt-in, lossy when it picks bf16): the first call of a configuration
            on the group sends float32 and measures one K/V hop alone and its backward's compute
            per step; where float32 dK/dV plus K/V would take longer per step than that compute
            (ratio > ``AUTO_RATIO``, env ``RINGKV_GRAD_COMM_AUTO_RATIO``), later calls send bf16.
            The measurements are agreed as the max over the group, so every rank picks the same
            (``auto_decisions()``, ``stats.backward.grad_comm_dtype``, a log line).
        comm: the ring to use instead of one over ``group`` (e.g. ``LocalComm`` to time the
            schedule without communication).
        softcap: scores ``softcap * tanh(s / softcap)`` in every block (Gemma 2).
        sinks: ``(H,)`` sink logits (gpt-oss), applied once to the merged result; the returned
            lse stays over the real keys. Their gradient covers this rank's rows: sum it over the
            group like any replicated weight's.
        stats: a ``RingStats`` this call fills with what this rank computed and sent (forward,
            and ``stats.backward`` once the backward ran); for tests and benchmarks.
        spans: with ``causal``, bidirectional spans (Gemma 3's images): one sequence of
            ``(start, stop)`` global positions per batch row, the same on every rank; a query in
            a span also sees the span's later keys (``ringkv.sp.spans``). Not with ``cu_seqlens``.

    Returns:
        ``out`` ``(B, S_local, H, Dv)`` in ``q.dtype`` (and ``lse``). Differentiable w.r.t. q, k, v
        (and sinks).
    """
    comm = comm or RingComm(group, timeout)
    out, lse = _attend(
        comm,
        q,
        k,
        v,
        causal,
        layout,
        softmax_scale,
        backend,
        check,
        window,
        cu_seqlens,
        grad_comm_dtype,
        softcap,
        sinks,
        stats,
        spans,
    )
    return (out, lse) if return_lse else out


def _attend(
    comm: RingComm,
    q,
    k,
    v,
    causal,
    layout,
    softmax_scale,
    backend,
    check,
    window,
    cu_seqlens,
    grad_comm_dtype,
    softcap,
    sinks,
    stats,
    spans=None,
):
    """``ring_attention`` on ``comm``: the checks, the shards and the ``"auto"`` wire, then the
    ring; ``(out, lse)``."""
    window = check_window(window)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens)
    scale, softcap = check_inputs(
        q,
        k,
        v,
        causal,
        layout,
        softmax_scale,
        backend,
        comm.world,
        cu=cu,
        softcap=softcap,
        sinks=sinks,
    )
    spans = with_spans(spans, causal, q.shape[0], q.shape[1] * comm.world, cu)
    grad_comm_dtype = check_grad_comm_dtype(grad_comm_dtype)
    if grad_comm_dtype == "auto" and (comm.world == 1 or isinstance(comm, LocalComm)):
        grad_comm_dtype = None  # no link to measure: float32
    if check and comm.world > 1 and not isinstance(comm, LocalComm):
        _check_across_ranks(
            comm,
            q,
            k,
            causal,
            layout,
            scale,
            backend,
            window,
            cu,
            grad_comm_dtype,
            v,
            softcap,
            sinks,
            spans,
        )
    shards = (
        Shards.of_layout(q.shape[1] * comm.world, layout, comm.world)
        if cu is None
        else Shards.of_varlen(cu, layout, comm.world)
    )
    shards = shards if spans is None else replace(shards, spans=spans)
    if grad_comm_dtype == "auto" and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    ):
        grad_comm_dtype = None  # no backward: nothing to choose (and nothing to measure)
    if grad_comm_dtype == "auto":  # one decision per shape: packed batches' boundaries share it
        names, values = call_values(q, k, causal, layout, scale, backend, window, cu, v, softcap)
        values[names.index("cu_seqlens")] = int(cu is not None)
        group = dist.group.WORLD if comm.group is None else comm.group
        grad_comm_dtype = _Auto((group, tuple(values)), comm)
    out, lse = _run(
        q,
        k,
        v,
        scale,
        causal,
        window,
        shards,
        comm,
        backend,
        grad_comm_dtype,
        softcap,
        sinks,
        stats,
    )
    return out, lse


def with_spans(spans, causal: bool, batch: int, seq_len: int, docs=None) -> Optional[Spans]:
    """``spans`` checked (``check_spans``) for a causal, unpacked call (``docs``: documents)."""
    if spans is not None and (not causal or docs is not None):
        raise ValueError(
            "spans (bidirectional spans in causal attention) need causal=True and no packed "
            f"documents (cu_seqlens); got causal={causal}"
            + ("" if docs is None else " with packed documents")
        )
    return check_spans(spans, batch, seq_len)


def check_inputs(
    q,
    k,
    v,
    causal,
    layout,
    softmax_scale,
    backend,
    world: int,
    parts: int = 1,
    cu=None,
    softcap=None,
    sinks=None,
) -> Tuple[float, Optional[float]]:
    """The checks every SP attention makes before it communicates; returns the softmax scale and
    the checked ``softcap`` (``sinks``: ``(H,)`` or None, checked too).

    The sequence is split over ``world`` ranks in ``layout`` and each shard into ``parts``
    equal pieces (USP's Ulysses parts), one per rank: ``q``/``k``/``v`` hold one piece.
    ``cu``: packed documents (checked ``cu_seqlens``): the local length is ``varlen_local_len``.
    """
    scale = kernels.validate(q, k, v, softmax_scale)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"q and k/v must be shards of one sequence with the same local length, "
            f"got {q.shape[1]} and {k.shape[1]}"
        )
    if cu is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"with cu_seqlens the documents are packed into one batch row: q must be "
                f"(1, S_local, H, D), got batch {q.shape[0]}"
            )
        want = varlen_local_len(cu, layout, world)
        if q.shape[1] != want:
            raise ValueError(
                f"cu_seqlens over {world} ranks in layout {layout!r} give {want} local rows "
                f"(pad rows included), got {q.shape[1]}; shard with ringkv.shard(x, 1, layout, "
                f"cu_seqlens=cu_seqlens)"
            )
    else:
        per_rank = granule(layout, world) // world
        unit = per_rank // math.gcd(
            per_rank, parts
        )  # the local length times parts must divide by per_rank
        if q.shape[1] == 0 or q.shape[1] % unit:
            raise ValueError(
                f"layout {layout!r} needs a positive local length divisible by {unit}, got "
                f"{q.shape[1]}; pad the global sequence to a multiple of "
                f"{granule(layout, world) * parts}"
            )
    softcap = kernels.check_softcap(softcap)
    kernels.check_sinks(sinks, q)
    # an unusable explicit backend fails here, on every rank
    kernels.pick(backend, q, Mask(FULL), softcap=softcap is not None, dv=q.shape[-1] != v.shape[-1])
    return scale, softcap


def _run(
    q,
    k,
    v,
    scale,
    causal,
    window,
    shards,
    comm,
    backend,
    grad_comm_dtype=None,
    softcap=None,
    sinks=None,
    stats=None,
):
    args = (scale, causal, window, shards, comm, backend)
    auto = grad_comm_dtype if isinstance(grad_comm_dtype, _Auto) else None
    return kernels.run_differentiable(
        _forward,
        _backward,
        q,
        k,
        v,
        args + (softcap, stats, auto),
        args + (grad_comm_dtype, softcap, stats),
        sinks=sinks,
    )


def ring_attention_shards(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shards: Shards,
    *,
    causal: bool,
    comm: RingComm,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    window: Tuple[int, int] = NO_WINDOW,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[RingStats] = None,
    spans=None,
):
    """Ring attention over shards of any positions (``Shards``: e.g. the engine's
    prompt chunks, where queries and keys differ in length). No cross-rank argument check: the
    caller guarantees that every rank passes the same ``shards``. Returns ``(out, lse)``.
    ``softcap``, ``sinks``, ``stats``: as in ``ring_attention``.

    ``q`` ``(B, Sq, H, D)`` with ``Sq = sum(len(r) for r in shards.q[rank])``; ``k``/``v``
    ``(B, Sk, Hkv, D)`` likewise for ``shards.k``; ``Sk`` is the same on every rank.
    ``window``, ``spans``: as in ``ring_attention``, on the shards' positions.
    """
    scale = kernels.validate(q, k, v, softmax_scale)
    softcap, sinks = kernels.check_softcap(softcap), kernels.check_sinks(sinks, q)
    total = max((r.stop for rs in shards.k for r in rs), default=0)
    spans = with_spans(spans, causal, q.shape[0], total, shards.q_docs)
    shards = shards if spans is None else replace(shards, spans=spans)
    return _run(
        q,
        k,
        v,
        scale,
        causal,
        check_window(window),
        shards,
        comm,
        backend,
        None,
        softcap,
        sinks,
        stats,
    )


class RingAttention(nn.Module):
    """``ring_attention`` as a module, with the same arguments and defaults:
    ``forward(q, k, v) -> out`` (and lse with ``return_lse``). ``stats``: the ``RingStats`` of
    the last call on this rank (its forward, and ``stats.backward`` once the backward ran)."""

    def __init__(
        self,
        *,
        causal: bool = False,
        group: Optional[dist.ProcessGroup] = None,
        layout: str = "zigzag",
        softmax_scale: Optional[float] = None,
        return_lse: bool = False,
        backend: str = "auto",
        timeout: Optional[timedelta] = None,
        check: bool = True,
        window: Tuple[int, int] = NO_WINDOW,
        grad_comm_dtype: Optional[torch.dtype] = None,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        check_layout(layout)
        self.kw = dict(
            causal=causal,
            group=group,
            layout=layout,
            softmax_scale=softmax_scale,
            return_lse=return_lse,
            backend=backend,
            timeout=timeout,
            check=check,
            window=check_window(window),
            grad_comm_dtype=check_grad_comm_dtype(grad_comm_dtype),
            softcap=kernels.check_softcap(softcap),
        )
        self.stats = RingStats()

    def forward(
        self, q, k, v, cu_seqlens: Optional[CuSeqlens] = None, sinks: Optional[torch.Tensor] = None
    ):
        return ring_attention(
            q, k, v, cu_seqlens=cu_seqlens, sinks=sinks, stats=self.stats, **self.kw
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={self.kw[n]!r}" for n in ("layout", "causal", "window", "backend"))
