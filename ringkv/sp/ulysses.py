"""Ulysses (DeepSpeed-Ulysses) attention: all-to-all from sequence shards to head shards.

Each rank holds ``q, k, v`` for its shard of the sequence (in ``layout``). One all-to-all (q, K
and V packed into one message per pair of ranks) gives every rank the whole sequence for
``H/N`` query heads and their KV heads; the gathered tokens are put in global order so one
plain causal single-device attention (a fused kernel) computes them; a second all-to-all brings
``out`` (and ``lse``) back to sequence shards. KV heads are split when ``Hkv % N == 0`` and
replicated when ``N % Hkv == 0`` (each rank gets the one KV head its query heads use; the
gradients of the replicas sum back to the owner). Differentiable: the all-to-all's backward is
the same all-to-all of the gradients. Bytes sent per rank: ``(N-1)/N`` of local q, K, V and out.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels.mask import NO_WINDOW, check_window
from .collectives import CommStats, agree_once, all_to_all, rank_world
from .layout import gather_order
from .ring import call_values, check_inputs

__all__ = ["ulysses_attention", "head_plan"]


def _valid_worlds(h: int, hkv: int) -> List[int]:
    return [n for n in range(1, h + 1) if h % n == 0 and (hkv % n == 0 or n % hkv == 0)]


def head_plan(h: int, hkv: int, world: int, what: str = "ulysses_attention") -> torch.Tensor:
    """The KV heads sent to each rank, ``(N * Hkv_local,)`` grouped by rank: rank ``j`` gets
    query heads ``[j*H/N, (j+1)*H/N)`` and the KV heads they use. ``ValueError`` naming the
    valid world sizes when ``H % N`` or (``Hkv % N`` and ``N % Hkv``) are not zero."""
    if h % world or (hkv % world and world % hkv):
        raise ValueError(
            f"{what} over {world} ranks splits heads: it needs heads ({h}) divisible by {world}, "
            f"and kv heads ({hkv}) divisible by {world} (split) or dividing it (replicated); valid "
            f"world sizes for heads={h}, kv_heads={hkv}: {_valid_worlds(h, hkv)}"
        )
    if hkv % world == 0:
        return torch.arange(hkv)
    return torch.arange(world) // (
        world // hkv
    )  # one KV head per rank: the one its query heads share


def _bytes(x: torch.Tensor, world: int) -> int:
    return x.numel() * x.element_size() // world * (world - 1)


def scatter_heads(q, k, v, group, timeout, what):
    """Sequence shards -> head shards over ``group`` (N ranks), differentiable.

    q ``(B, S_l, H, D)``, k ``(B, S_l, Hkv, D)``, v ``(B, S_l, Hkv, Dv)`` -> q
    ``(B, N*S_l, H/N, D)``, k/v ``(B, N*S_l, Hkv_l, D or Dv)``: every rank's tokens in rank order.
    Also returns the bytes sent.
    """
    b, s, h, d = q.shape
    dv = v.shape[-1]
    _, n = rank_world(group)
    kv_index = head_plan(h, k.shape[2], n, what)  # host
    hkv = kv_index.numel() // n
    if (
        kv_index.numel() != k.shape[2]
    ):  # replicated KV heads (the index_select backward sums the replicas)
        kv_index = kv_index.to(k.device)
        k, v = k.index_select(2, kv_index), v.index_select(2, kv_index)
    # one message per pair: q, K, V heads for rank j packed along the flattened (heads, head_dim)
    packed = torch.cat(
        [q.reshape(b, s, n, h // n * d), k.reshape(b, s, n, hkv * d), v.reshape(b, s, n, hkv * dv)],
        dim=3,
    )
    packed = packed.permute(
        2, 0, 1, 3
    )  # (N, B, S_l, (H/N + Hkv_l) * D + Hkv_l * Dv): row j goes to rank j
    (got,) = all_to_all(packed, group=group, timeout=timeout, what=what)  # row i came from rank i
    got = got.permute(1, 0, 2, 3).reshape(
        b, n * s, -1
    )  # (B, N*S_l, (H/N + Hkv_l) * D + Hkv_l * Dv)
    q, k, v = got.split([h // n * d, hkv * d, hkv * dv], dim=2)
    return (
        q.unflatten(2, (h // n, d)),
        k.unflatten(2, (hkv, d)),
        v.unflatten(2, (hkv, dv)),
        _bytes(packed, n),
    )


def gather_heads(out, lse, group, timeout, what):
    """Head shards -> sequence shards: out ``(B, N*S_l, H/N, Dv)`` (rows in rank order) ->
    ``(B, S_l, H, Dv)``; lse (or ``None``) ``(B, H/N, N*S_l)`` -> ``(B, H, S_l)``. Differentiable.
    Also returns the bytes sent."""
    b, s_all, hl, d = out.shape
    _, n = rank_world(group)
    s = s_all // n
    send = [
        out.reshape(b, n, s, hl, d).transpose(0, 1)
    ]  # (N, B, S_l, H/N, D): rows of rank j's tokens
    if lse is not None:
        send.append(lse.reshape(b, hl, n, s).permute(2, 0, 1, 3))  # (N, B, H/N, S_l)
    got = all_to_all(*send, group=group, timeout=timeout, what=what)  # row i: rank i's heads
    out = got[0].permute(1, 2, 0, 3, 4).reshape(b, s, n * hl, d)
    lse = got[1].permute(1, 0, 2, 3).reshape(b, n * hl, s) if lse is not None else None
    return out, lse, sum(_bytes(x, n) for x in send)


def ulysses_attention(
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
    window=NO_WINDOW,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    stats: Optional[CommStats] = None,
):
    """Exact attention of this rank's query shard over the whole sharded sequence, by head shards.

    Args:
        q: ``(B, S_local, H, D)``, this rank's shard in ``layout``; ``H % N == 0``.
        k, v: ``(B, S_local, Hkv, D)``, ``(B, S_local, Hkv, Dv)``; ``Hkv % N == 0`` (split) or
            ``N % Hkv == 0`` (replicated).
        causal: mask ``q_pos >= k_pos`` on global positions.
        group: the SP process group (default: the world; no process group = one rank).
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see ``ringkv.sp.layout``).
        softmax_scale, backend, timeout, check, window, softcap: as in ``ring_attention``.
        sinks: ``(H,)``; each rank applies its heads' sinks (their gradient lands on this rank's
            heads for every row: the sum over the group is the whole gradient).
        return_lse: also return the float32 LSE ``(B, H, S_local)``.
        stats: a ``CommStats`` this call fills with the bytes this rank sent (both all-to-alls).

    Returns:
        ``out`` ``(B, S_local, H, Dv)`` in ``q.dtype`` (and ``lse``). Differentiable w.r.t. q, k, v
        (and sinks).
    """
    rank, n = rank_world(group)
    scale, softcap = check_inputs(
        q, k, v, causal, layout, softmax_scale, backend, n, softcap=softcap, sinks=sinks
    )
    head_plan(q.shape[2], k.shape[2], n)
    window = check_window(window)
    if check and n > 1:
        names, values = call_values(
            q, k, causal, layout, scale, backend, window, v=v, softcap=softcap, sinks=sinks
        )
        agree_once(values, names, group, timeout, "ulysses_attention", q.device)
    seq_len = q.shape[1] * n
    qh, kh, vh, sent = scatter_heads(
        q, k, v, group, timeout, "ulysses_attention"
    )  # (B, S, H/N, D), rank order
    # only a causal or windowed mask needs the tokens in global order
    in_order = layout == "contiguous" or n == 1 or (not causal and window == NO_WINDOW)
    if not in_order:  # global order, so that plain causal (a fused kernel) applies
        index, order = gather_order(
            seq_len, layout, n, q.device
        )  # global position of each row, its inverse
        qh, kh, vh = (t.index_select(1, order) for t in (qh, kh, vh))
    local_sinks = None if sinks is None else sinks.view(n, -1)[rank]  # (H/N,): this rank's heads
    out, lse = kernels.attention(
        qh,
        kh,
        vh,
        scale=scale,
        causal=causal,
        window=window,
        backend=backend,
        softcap=softcap,
        sinks=local_sinks,
    )
    if not in_order:  # back to rank order
        out, lse = out.index_select(1, index), lse.index_select(2, index)
    out, lse, sent_back = gather_heads(
        out, lse if return_lse else None, group, timeout, "ulysses_attention"
    )
    if stats is not None:
        stats.method, stats.bytes_sent = "ulysses", sent + sent_back
    return (out, lse) if return_lse else out
