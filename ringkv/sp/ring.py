"""Ring attention: exact attention over a sequence sharded across an SP process group.

Each rank holds ``q, k, v`` for its shard (in ``layout``). K and V travel around the ring as
one message per hop; the hop for step ``i+1`` is posted before step ``i``'s block is computed
and waited for after it. Each step's block is computed by a kernel (``ringkv.kernels``) with
the mask of the two shards' *global* positions, and merged into a float32 accumulator by LSE.
Blocks whose mask is empty are skipped. Backward: dQ accumulates locally; dK/dV (float32)
travel the ring with their K/V and arrive back at their owner after ``N`` hops.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels
from ..kernels.mask import EMPTY, FULL, OFFSET, Mask, make_mask
from .collectives import agree
from .comm import LocalComm, RingComm
from .layout import LAYOUTS, check_layout, chunks, granule
from .merge import empty_partial, merge_

__all__ = ["ring_attention", "ring_attention_shards", "Shards", "RingAttention", "RingStats", "last_stats"]


@dataclass
class RingStats:
    """What this rank computed in its last ring forward (for balance tests and benchmarks)."""
    steps: int = 0
    calls: int = 0        # kernel calls
    skipped: int = 0      # chunk pairs skipped because their mask is empty
    pairs: int = 0        # visible (query, key) pairs computed: the real work
    per_step: List[int] = field(default_factory=list)
    bytes_sent: int = 0   # K/V bytes sent to the next rank: bytes per hop x (N - 1) hops


last_stats = RingStats()


def _slices(ranges: List[range]) -> List[slice]:
    out, start = [], 0
    for r in ranges:
        out.append(slice(start, start + len(r)))
        start += len(r)
    return out


def _visible(mask: Mask, sq: int, sk: int) -> int:
    if mask.kind == FULL:
        return sq * sk
    if mask.kind == EMPTY:
        return 0
    # offset diagonal: row i sees min(sk, max(0, i + offset + 1)) keys
    return int((torch.arange(sq) + mask.offset + 1).clamp(0, sk).sum())


def plan(q_ranges: List[range], k_ranges: List[range], causal: bool) -> List[Tuple[slice, slice, Mask]]:
    """Kernel calls for one ring step: ``(q rows, k rows, mask)``, empty pairs dropped.

    Pairs of chunks get their mask from global positions; a query chunk that sees all keys,
    or a key chunk seen fully by all queries, becomes one call. A shard against itself is one
    causal call (every layout keeps a shard's positions increasing).
    """
    qs, ks = _slices(q_ranges), _slices(k_ranges)
    sq, sk = qs[-1].stop, ks[-1].stop
    if causal and q_ranges == k_ranges:  # a shard against itself: positions increase, so local causal
        return [(slice(0, sq), slice(0, sk), Mask(OFFSET, offset=0))]
    m = [[make_mask(causal, a, b, len(a), len(b)) for b in k_ranges] for a in q_ranges]
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


def call_values(q, k, causal, layout, scale, backend) -> Tuple[List[str], List[int]]:
    """Names and integer values of the shapes and settings every rank must agree on (for ``agree``)."""
    names = ["batch", "seq_local", "heads", "head_dim", "kv_heads", "dtype", "layout", "causal", "scale", "backend"]
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    values = [*q.shape, k.shape[2], zlib.crc32(str(q.dtype).encode()), LAYOUTS.index(layout), int(causal),
              scale_bits, zlib.crc32(backend.encode())]
    return names, values


def _check_across_ranks(comm: RingComm, q, k, causal, layout, scale, backend) -> None:
    """All ranks must call with the same shapes and settings: one tiny bounded all-gather."""
    names, values = call_values(q, k, causal, layout, scale, backend)
    agree(values, names, comm.group, comm.timeout, "ring_attention", q.device)


@dataclass(frozen=True)
class Shards:
    """Global positions of every rank's queries and keys: ``q[r]`` / ``k[r]`` are lists of
    increasing ``range``s in local order (``layout.chunks`` for the standard layouts)."""
    q: Tuple[Tuple[range, ...], ...]
    k: Tuple[Tuple[range, ...], ...]

    @classmethod
    def of_layout(cls, seq_len: int, layout: str, world: int) -> "Shards":
        ranges = tuple(tuple(chunks(seq_len, layout, r, world)) for r in range(world))
        return cls(ranges, ranges)


def _forward(q, k, v, scale, causal, shards: Shards, comm: RingComm, backend):
    b, s, h, d = q.shape
    n, r = comm.world, comm.rank
    q_ranges = list(shards.q[r])
    out, lse = empty_partial(b, s, h, v.shape[-1], q.device)
    bufs = [torch.stack([k, v]), None]  # (2, B, S, Hkv, D): K and V travel as one message
    bufs[1] = torch.empty_like(bufs[0])
    stats = RingStats(steps=n, bytes_sent=(n - 1) * bufs[0].numel() * bufs[0].element_size())
    for step in range(n):
        cur = bufs[step % 2]
        if step < n - 1:
            comm.send_recv([cur], [bufs[(step + 1) % 2]])
        src = (r - step) % n
        k_ranges = list(shards.k[src])
        calls = plan(q_ranges, k_ranges, causal)
        work = 0
        for qs, ks, mask in calls:
            o, l = kernels.block_forward(q[:, qs], cur[0][:, ks], cur[1][:, ks], scale=scale, mask=mask, backend=backend)
            merge_(out[:, qs], lse[:, :, qs], o, l)
            work += _visible(mask, qs.stop - qs.start, ks.stop - ks.start)
        stats.calls += len(calls)
        stats.skipped += len(q_ranges) * len(k_ranges) - len(calls)
        stats.pairs += work
        stats.per_step.append(work)
        if step < n - 1:
            comm.wait()
    global last_stats
    last_stats = stats
    return out.to(q.dtype), lse


def _backward(dout, dlse, q, k, v, out, lse, scale, causal, shards: Shards, comm: RingComm, backend):
    kv_comm, dkv_comm = comm, comm.with_tag(1)
    n, r = kv_comm.world, kv_comm.rank
    q_ranges = list(shards.q[r])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [torch.stack([k, v]), None]
    kv[1] = torch.empty_like(kv[0])
    dkv = [torch.zeros(kv[0].shape, dtype=torch.float32, device=q.device), None]  # travels with its K/V
    dkv[1] = torch.empty_like(dkv[0])
    blk = torch.empty_like(dkv[0])
    for step in range(n):
        cur = kv[step % 2]
        if step < n - 1:
            kv_comm.send_recv([cur], [kv[(step + 1) % 2]])
        src = (r - step) % n
        blk.zero_()
        for qs, ks, mask in plan(q_ranges, list(shards.k[src]), causal):
            gq, gk, gv = kernels.block_backward(
                dout[:, qs], q[:, qs], cur[0][:, ks], cur[1][:, ks], out[:, qs], lse[:, :, qs], scale=scale,
                mask=mask, dlse=None if dlse is None else dlse[:, :, qs], backend=backend)
            dq[:, qs] += gq
            blk[0][:, ks] += gk
            blk[1][:, ks] += gv
        if step > 0:
            dkv_comm.wait()  # the accumulated dK/dV of block src arrived
        dkv[step % 2] += blk
        dkv_comm.send_recv([dkv[step % 2]], [dkv[(step + 1) % 2]])
        if step < n - 1:
            kv_comm.wait()
    dkv_comm.wait()  # after n hops every rank holds its own block's dK/dV
    done = dkv[n % 2]
    return dq.to(q.dtype), done[0].to(k.dtype), done[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, shards, comm, backend):
        ctx.set_materialize_grads(False)
        out, lse = _forward(q, k, v, scale, causal, shards, comm, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, shards, comm, backend)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = _backward(dout.contiguous(), dlse, q, k, v, out, lse, *ctx.args)
        return (*grads, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                   softmax_scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto",
                   timeout: Optional[timedelta] = None, check: bool = True, comm: Optional[RingComm] = None):
    """Exact attention of this rank's query shard over the whole sharded sequence.

    Args:
        q: ``(B, S_local, H, D)``, this rank's shard in ``layout``.
        k, v: ``(B, S_local, Hkv, D)`` with ``H % Hkv == 0``; only the ``Hkv`` heads travel.
        causal: mask ``q_pos >= k_pos`` on global positions.
        group: the SP process group (default: the world; no process group = one rank).
        layout: ``"zigzag"`` (default: balances causal work), ``"contiguous"`` or ``"striped"``
            (see ``ringkv.sp.layout``); shard with the same layout (``ringkv.shard``).
        softmax_scale: default ``1/sqrt(D)``.
        return_lse: also return the float32 LSE ``(B, H, S_local)``.
        backend: kernel backend name or ``"auto"``.
        timeout: bound on every wait (gloo); default ``RINGKV_TIMEOUT_S`` or 300 s.
        check: verify (one tiny all-gather) that every rank passes the same shapes and settings.
        comm: the ring to use instead of one over ``group`` (e.g. ``LocalComm`` to time the
            schedule without communication).

    Returns:
        ``out`` ``(B, S_local, H, D)`` in ``q.dtype`` (and ``lse``). Differentiable w.r.t. q, k, v.
    """
    comm = comm or RingComm(group, timeout)
    scale = check_inputs(q, k, v, causal, layout, softmax_scale, backend, comm.world)
    if check and comm.world > 1 and not isinstance(comm, LocalComm):
        _check_across_ranks(comm, q, k, causal, layout, scale, backend)
    shards = Shards.of_layout(q.shape[1] * comm.world, layout, comm.world)
    out, lse = _run(q, k, v, scale, causal, shards, comm, backend)
    return (out, lse) if return_lse else out


def check_inputs(q, k, v, causal, layout, softmax_scale, backend, world: int, parts: int = 1) -> float:
    """The checks every SP attention makes before it communicates; returns the softmax scale.

    The sequence is split over ``world`` ranks in ``layout`` and each shard into ``parts``
    equal pieces (USP's Ulysses parts), one per rank: ``q``/``k``/``v`` hold one piece.
    """
    scale = kernels.validate(q, k, v, softmax_scale)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k/v must be shards of one sequence with the same local length, "
                         f"got {q.shape[1]} and {k.shape[1]}")
    per_rank = granule(layout, world) // world
    unit = per_rank // math.gcd(per_rank, parts)  # the local length times parts must divide by per_rank
    if q.shape[1] == 0 or q.shape[1] % unit:
        raise ValueError(f"layout {layout!r} needs a positive local length divisible by {unit}, got "
                         f"{q.shape[1]}; pad the global sequence to a multiple of {granule(layout, world) * parts}")
    kernels.pick(backend, q, Mask(FULL))  # an unusable explicit backend fails here, on every rank
    return scale


def _run(q, k, v, scale, causal, shards, comm, backend):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _RingAttention.apply(q, k, v, scale, causal, shards, comm, backend)
    return _forward(q, k, v, scale, causal, shards, comm, backend)


def ring_attention_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: Shards, *, causal: bool,
                          comm: RingComm, softmax_scale: Optional[float] = None, backend: str = "auto"):
    """Ring attention over shards of any positions (``Shards``: e.g. the engine's
    prompt chunks, where queries and keys differ in length). No cross-rank argument check: the
    caller guarantees that every rank passes the same ``shards``. Returns ``(out, lse)``.

    ``q`` ``(B, Sq, H, D)`` with ``Sq = sum(len(r) for r in shards.q[rank])``; ``k``/``v``
    ``(B, Sk, Hkv, D)`` likewise for ``shards.k``; ``Sk`` is the same on every rank.
    """
    scale = kernels.validate(q, k, v, softmax_scale)
    return _run(q, k, v, scale, causal, shards, comm, backend)


class RingAttention(nn.Module):
    """``ring_attention`` as a module, with the same arguments and defaults:
    ``forward(q, k, v) -> out`` (and lse with ``return_lse``)."""

    def __init__(self, *, causal: bool = False, group: Optional[dist.ProcessGroup] = None,
                 layout: str = "zigzag", softmax_scale: Optional[float] = None, return_lse: bool = False,
                 backend: str = "auto", timeout: Optional[timedelta] = None, check: bool = True):
        super().__init__()
        check_layout(layout)
        self.kw = dict(causal=causal, group=group, layout=layout, softmax_scale=softmax_scale,
                       return_lse=return_lse, backend=backend, timeout=timeout, check=check)

    def forward(self, q, k, v):
        return ring_attention(q, k, v, **self.kw)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={self.kw[n]!r}" for n in ("layout", "causal", "backend"))
