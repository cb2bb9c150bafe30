"""USP (2D sequence parallelism): Ulysses all-to-all inside a group, ring attention across groups.

The ranks form a ``(ring, ulysses)`` mesh (``sp_groups``; Ulysses innermost, its all-to-alls
are the most frequent). The global sequence is split over the R ring ranks in ``layout`` and
each ring shard is cut contiguously into U parts, one per Ulysses rank (``layout.usp_chunks``;
``ringkv.shard(x, dim, layout, ulysses_group=, ring_group=)`` gives this rank's part). The
all-to-all in the Ulysses group hands every rank its ring shard's tokens (in local order) for
``H/U`` heads; ``ring_attention`` runs on them over the ring group; the all-to-all back returns
``out`` (and ``lse``) to sequence parts. Bytes per rank: the two all-to-alls plus the ring's.

Any head count: the Ulysses group splits the heads as ``ulysses_attention`` does (``HeadSplit``:
``ceil(H/U)`` or ``floor(H/U)`` query heads per Ulysses rank, ``U <= H``); the ranks of one ring
group have the same Ulysses rank, so the same heads, and the ring carries the KV heads their
kernel runs with (``HeadSplit.local_kv``: where a rank's query heads are not aligned on their KV
groups, the repeated ones). Which ``U x R`` to run: ``ringkv.planner.choose_sp``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..kernels.mask import NO_WINDOW, check_window
from .collectives import CommStats, Memo, agree_once, rank_world
from .comm import RingComm
from .ring import (
    RingStats,
    Shards,
    call_values,
    check_inputs,
    ring_attention_shards,
    with_spans,
)
from .ulysses import gather_heads, head_split, scatter_heads

__all__ = ["sp_groups", "usp_attention"]

GROUPS = Memo()  # (world, ulysses, ring) -> (ulysses_group, ring_group)


def sp_groups(
    ulysses: int, ring: int
) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(ulysses_group, ring_group)`` of this rank in a ``(ring, ulysses)`` mesh over the default
    world.

    Global rank ``= ring_rank * ulysses + ulysses_rank``: a Ulysses group is ``ulysses``
    consecutive ranks. ``ulysses * ring`` must be the world size. Built once per
    ``(ulysses, ring)`` with ``torch.distributed.device_mesh.init_device_mesh`` (a collective:
    every rank calls it). Without a process group (one process): ``(None, None)``.
    """
    for name, n in (("ulysses", ulysses), ("ring", ring)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sp_groups: {name} must be a positive int, got {n!r}")
    rank, world = rank_world()
    if ulysses * ring != world:
        raise ValueError(
            f"sp_groups(ulysses={ulysses}, ring={ring}) needs ulysses * ring == the world size "
            f"{world}, got {ulysses * ring}"
        )
    if not dist.is_initialized():
        return None, None
    return GROUPS.get((id(dist.group.WORLD), ulysses, ring), lambda: _build_groups(ulysses, ring))


def _build_groups(ulysses: int, ring: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    return mesh.get_group("ulysses"), mesh.get_group("ring")


def _agree(names, values, worlds, groups, timeout, device) -> None:
    """Every rank of both groups (``worlds``: their sizes) makes the same call (checked once per
    configuration)."""
    agree_once(
        values + list(worlds),
        names + ["ulysses_world", "ring_world"],
        list(groups),
        timeout,
        "usp_attention",
        device,
    )


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    ulysses_group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup],
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    timeout: Optional[timedelta] = None,
    check: bool = True,
    window=NO_WINDOW,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[CommStats] = None,
    spans=None,
):
    """Exact attention over a sequence sharded on a ``(ring, ulysses)`` mesh (``sp_groups``).

    Args:
        q: ``(B, S_local, H, D)``, this rank's part
            (``ringkv.shard(..., ulysses_group=, ring_group=)``);
            ``S = S_local * U * R``; any ``H >= U``.
        k, v: ``(B, S_local, Hkv, D)``, ``(B, S_local, Hkv, Dv)``; any ``Hkv`` dividing ``H``.
        ulysses_group, ring_group: from ``ringkv.sp_groups(ulysses=U, ring=R)``.
        causal, layout, softmax_scale, return_lse, backend, timeout, check, window, softcap: as in
            ``ring_attention`` (``layout`` is the ring's; ``check`` compares arguments over both
            groups).
        sinks: ``(H,)``, applied by the ring of each Ulysses rank's heads (as in
            ``ulysses_attention``).
        stats: a ``CommStats`` this call fills with the bytes this rank sent in the forward (both
            all-to-alls and the ring's K/V).
        spans: bidirectional spans in causal attention, as in ``ring_attention``.

    Returns:
        ``out`` ``(B, S_local, H, D)`` in ``q.dtype`` (and float32 ``lse`` ``(B, H, S_local)``).
        Differentiable w.r.t. q, k, v.
    """
    if rank_world()[1] > 1 and (ulysses_group is None or ring_group is None):
        raise ValueError(
            "usp_attention needs ulysses_group and ring_group: build them with "
            "ringkv.sp_groups(ulysses=U, ring=R)"
        )
    (u_rank, n_u), (_, n_r) = rank_world(ulysses_group), rank_world(ring_group)
    scale, softcap = check_inputs(
        q,
        k,
        v,
        causal,
        layout,
        softmax_scale,
        backend,
        n_r,
        parts=n_u,
        softcap=softcap,
        sinks=sinks,
    )
    split = head_split(q.shape[2], k.shape[2], n_u, "usp_attention")
    window = check_window(window)
    spans = with_spans(spans, causal, q.shape[0], q.shape[1] * n_u * n_r)
    if check and n_u * n_r > 1:
        names, values = call_values(
            q, k, causal, layout, scale, backend, window, None, v, softcap, sinks, spans
        )
        _agree(names, values, (n_u, n_r), (ulysses_group, ring_group), timeout, q.device)
    # (B, S/R, H_r, D): this ring rank's shard, in local order, for this Ulysses rank's heads
    qh, kh, vh, sent = scatter_heads(q, k, v, split, ulysses_group, timeout, "usp_attention")
    shards = Shards.of_layout(q.shape[1] * n_u * n_r, layout, n_r)
    mine = split.q_heads(u_rank)
    local_sinks = None if sinks is None else sinks[mine.start : mine.stop]  # (H_r,): its heads
    ring_stats = RingStats()
    out, lse = ring_attention_shards(
        qh,
        kh,
        vh,
        shards,
        causal=causal,
        comm=RingComm(ring_group, timeout),
        softmax_scale=scale,
        backend=backend,
        window=window,
        softcap=softcap,
        sinks=local_sinks,
        stats=ring_stats,
        spans=spans,
    )
    sent += ring_stats.bytes_sent
    out, lse, sent_back = gather_heads(
        out, lse if return_lse else None, split, ulysses_group, timeout, "usp_attention"
    )
    if stats is not None:
        stats.method, stats.bytes_sent = "usp", sent + sent_back
    return (out, lse) if return_lse else out
