"""Sequence layouts: which global tokens each SP rank holds.

- ``contiguous``: rank r holds tokens ``[r*S/N, (r+1)*S/N)``;
- ``zigzag``: the sequence is cut in ``2N`` chunks, rank r holds chunks ``r`` and ``2N-1-r``
  (causal work is balanced: early and late chunks pair up);
- ``striped``: token ``i`` lives on rank ``i mod N``.

A shard is described by ``chunks(...)``: a list of ``range``s of global positions, in the
order the tokens sit in the local tensor (always increasing). Masks and rotary embeddings
use these global positions.

Packed sequences (``cu_seqlens = [0, l0, l0+l1, ..., S]``, one batch row): the layout splits
*each document* over the ranks (zigzag: every document in 2N chunks), after padding it to a
multiple of ``granule``. A rank's shard is the concatenation, document by document, of its
pieces (``varlen_chunks``): ``(document, positions within the document)``, document ``-1`` for
pad rows. Every rank has ``varlen_local_len`` rows; ``shard``/``unshard``/``positions`` take
``cu_seqlens=`` and hide the padding from the caller.
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .collectives import all_gather, rank_world

LAYOUTS = ("contiguous", "zigzag", "striped")
CuSeqlens = Union[Sequence[int], torch.Tensor]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def granule(layout: str, world: int, ulysses: int = 1) -> int:
    """The global sequence length must be a multiple of this (``ulysses``: see ``chunks``)."""
    check_layout(layout)
    ring = world // ulysses
    return (2 * ring if layout == "zigzag" else ring) * ulysses


def check_seq_len(seq_len: int, layout: str, world: int, ulysses: int = 1) -> None:
    g = granule(layout, world, ulysses)
    if seq_len % g:
        pad = -seq_len % g
        raise ValueError(
            f"layout {layout!r} over {world} ranks needs a sequence length divisible by {g}, "
            f"got {seq_len}; pad the sequence by {pad} tokens (to {seq_len + pad})"
        )


def chunks(seq_len: int, layout: str, rank: int, world: int, ulysses: int = 1) -> List[range]:
    """Global positions of rank ``rank``'s shard, as increasing ranges in local order.

    ``ulysses > 1``: the ``world`` ranks form ``sp_groups``' ``(ring, ulysses)`` mesh (rank
    ``= ring_rank * ulysses + ulysses_rank``) and the shard is that rank's part of the 2D layout
    ``usp_attention`` takes (``usp_chunks``)."""
    if ulysses != 1:
        if ulysses < 1 or world % ulysses:
            raise ValueError(
                f"ulysses={ulysses} must be a positive divisor of the world size {world}"
            )
        return usp_chunks(
            seq_len, layout, rank // ulysses, world // ulysses, rank % ulysses, ulysses
        )
    check_seq_len(seq_len, layout, world)
    if layout == "contiguous":
        n = seq_len // world
        return [range(rank * n, (rank + 1) * n)]
    if layout == "zigzag":
        c = seq_len // (2 * world)
        hi = 2 * world - 1 - rank
        return [range(rank * c, (rank + 1) * c), range(hi * c, (hi + 1) * c)]
    return [range(rank, seq_len, world)]


def cut(ranges: List[range], lo: int, hi: int) -> List[range]:
    """The ranges of local rows ``[lo, hi)`` of a shard given by ``ranges`` (in local order)."""
    out, start = [], 0
    for r in ranges:
        a, b = max(lo - start, 0), min(hi - start, len(r))
        if a < b:
            out.append(r[a:b])
        start += len(r)
    return out


def usp_chunks(
    seq_len: int,
    layout: str,
    ring_rank: int,
    ring_world: int,
    ulysses_rank: int,
    ulysses_world: int,
) -> List[range]:
    """Global positions of a 2D rank's tokens: part ``ulysses_rank`` of ``ulysses_world``
    contiguous parts of ring rank ``ring_rank``'s shard in ``layout`` over ``ring_world``."""
    ranges = chunks(seq_len, layout, ring_rank, ring_world)
    n = seq_len // ring_world
    if n % ulysses_world:
        g = granule(layout, ring_world) * ulysses_world
        raise ValueError(
            f"layout {layout!r} over {ulysses_world} (ulysses) x {ring_world} (ring) ranks needs a "
            f"sequence length divisible by {g}, got {seq_len}; pad the sequence by {-seq_len % g} "
            "tokens"
        )
    part = n // ulysses_world
    return cut(ranges, ulysses_rank * part, (ulysses_rank + 1) * part)


def _is_2d(group, rank, ulysses_group, ring_group) -> bool:
    if ulysses_group is None and ring_group is None:
        return False
    if ulysses_group is None or ring_group is None or group is not None or rank is not None:
        raise ValueError(
            "pass both ulysses_group and ring_group (see ringkv.sp_groups) for a 2D shard, "
            "or group/rank/world for a 1D one, not both"
        )
    return True


def _ranges(
    seq_len: int, layout: str, group, rank, world, ulysses_group, ring_group, ulysses=1
) -> List[range]:
    if not _is_2d(group, rank, ulysses_group, ring_group):
        if rank is None or world is None:
            rank, world = rank_world(group)
        return chunks(seq_len, layout, rank, world, ulysses)
    (u, n_u), (r, n_r) = rank_world(ulysses_group), rank_world(ring_group)
    return usp_chunks(seq_len, layout, r, n_r, u, n_u)


def positions(
    seq_len: int,
    layout: str,
    rank: Optional[int] = None,
    world: Optional[int] = None,
    device=None,
    *,
    cu_seqlens: Optional[CuSeqlens] = None,
    ulysses_group: Optional[dist.ProcessGroup] = None,
    ring_group: Optional[dist.ProcessGroup] = None,
    ulysses: int = 1,
) -> torch.Tensor:
    """Global positions ``(seq_len // world,)`` int64 of rank ``rank``'s tokens, in local order
    (default: this rank of the world; with ``ulysses_group``/``ring_group``, or ``ulysses=U`` and
    a rank of the ``(ring, ulysses)`` mesh: its 2D part).

    With ``cu_seqlens``: ``(varlen_local_len,)`` positions *within each token's document* (what
    RoPE needs for packed sequences); a pad row gets its position in its document padded to a
    multiple of ``granule`` (so ``>=`` the document's length).
    """
    if cu_seqlens is not None:
        if rank is None or world is None:
            rank, world = rank_world()
        ranges = [
            r for _, r in varlen_chunks(check_cu_seqlens(cu_seqlens, seq_len), layout, rank, world)
        ]
    else:
        ranges = _ranges(seq_len, layout, None, rank, world, ulysses_group, ring_group, ulysses)
    return torch.cat([torch.arange(r.start, r.stop, r.step, device=device) for r in ranges])


def check_cu_seqlens(cu_seqlens: CuSeqlens, seq_len: Optional[int] = None) -> Tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints ``(0, l0, l0+l1, ..., S)``, or a clear error.

    A tensor is read once (``.tolist()``, a host synchronisation on CUDA) and remembered by its
    identity and version: passing the same, unmodified tensor again reads nothing. A list is
    cheaper still (and what ``ring_attention`` prefers)."""
    if isinstance(cu_seqlens, torch.Tensor):
        hit = _CU_READ.get(id(cu_seqlens))
        if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
            cu = hit[2]
        else:
            cu = _check_cu_seqlens(cu_seqlens)
            key = id(cu_seqlens)
            _CU_READ[key] = (
                weakref.ref(cu_seqlens, lambda _: _CU_READ.pop(key, None)),
                cu_seqlens._version,
                cu,
            )
    else:
        cu = _check_cu_seqlens(cu_seqlens)
    if seq_len is not None and cu[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens must end at the packed sequence length {seq_len}, got {cu[-1]}"
        )
    return cu


_CU_READ: Dict[
    int, tuple
] = {}  # id(tensor) -> (weakref, version, checked tuple): tensors read once


def _check_cu_seqlens(cu_seqlens: CuSeqlens) -> Tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor):
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.dtype.is_floating_point
            or cu_seqlens.dtype.is_complex
            or cu_seqlens.dtype == torch.bool
        ):
            raise TypeError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints, got a "
                f"{cu_seqlens.dim()}-D {cu_seqlens.dtype} tensor"
            )
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens
    ):
        cu = tuple(cu_seqlens)
    else:
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor or a list of ints [0, l0, l0+l1, ..., S], "
            f"got {cu_seqlens!r}"
        )
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(
            f"cu_seqlens must start at 0 and hold at least one document ([0, l0, ..., S]), "
            f"got {list(cu)[:8]}"
        )
    bad = next((i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]), None)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens must be strictly increasing (every document has at least one token), "
            f"got {cu[bad - 1]} then {cu[bad]} at index {bad}"
        )
    return cu


def varlen_chunks(
    cu_seqlens: CuSeqlens, layout: str, rank: int, world: int
) -> List[Tuple[int, range]]:
    """Rank ``rank``'s pieces of a packed sequence, in local order: ``(document, positions within
    the document)``; document ``-1`` marks pad rows. Each document is padded to a multiple of
    ``granule(layout, world)`` and split by ``layout`` on its own."""
    cu, g = check_cu_seqlens(cu_seqlens), granule(layout, world)
    pieces = []
    for doc in range(len(cu) - 1):
        n = cu[doc + 1] - cu[doc]
        for r in chunks(-(-n // g) * g, layout, rank, world):
            real = range(r.start, min(r.stop, n), r.step)
            pieces += [(doc, real)] if len(real) else []
            pieces += [(-1, r[len(real) :])] if len(real) < len(r) else []
    return pieces


def varlen_local_len(cu_seqlens: CuSeqlens, layout: str, world: int) -> int:
    """Rows of every rank's shard of a packed sequence (its tokens plus its pad rows)."""
    cu, g = check_cu_seqlens(cu_seqlens), granule(layout, world)
    return sum(-(-(b - a) // g) * g for a, b in zip(cu, cu[1:])) // world


def varlen_index(
    cu_seqlens: CuSeqlens, layout: str, rank: int, world: int, device=None
) -> torch.Tensor:
    """``(varlen_local_len,)`` int64: the packed index of each local row, ``-1`` for pad rows."""
    cu = check_cu_seqlens(cu_seqlens)
    return torch.cat(
        [
            torch.arange(r.start, r.stop, r.step, device=device) + cu[d]
            if d >= 0
            else torch.full((len(r),), -1, dtype=torch.long, device=device)
            for d, r in varlen_chunks(cu, layout, rank, world)
        ]
    )


def _check_packed(x: torch.Tensor, dim: int, what: str) -> None:
    if dim % x.dim() != 0 and x.shape[0] != 1:
        raise ValueError(
            f"{what} with cu_seqlens takes one packed batch row, got batch {x.shape[0]} "
            f"(shape {tuple(x.shape)}); concatenate the documents into shape (1, S, ...)"
        )


def _shard_varlen(
    x: torch.Tensor, dim: int, layout: str, rank: int, world: int, cu_seqlens
) -> torch.Tensor:
    dim %= x.dim()
    _check_packed(x, dim, "shard")
    cu = check_cu_seqlens(cu_seqlens, x.shape[dim])
    index = varlen_index(cu, layout, rank, world, x.device)
    padded = torch.cat(
        [x, x.new_zeros(x.shape[:dim] + (1,) + x.shape[dim + 1 :])], dim
    )  # row S: zeros
    return padded.index_select(dim, torch.where(index < 0, x.shape[dim], index))


def _unshard_varlen(
    x_local: torch.Tensor, dim: int, layout: str, group, cu_seqlens
) -> torch.Tensor:
    _check_packed(x_local, dim, "unshard")
    rank, world = rank_world(group)
    cu = check_cu_seqlens(cu_seqlens)
    if x_local.shape[dim] != varlen_local_len(cu, layout, world):
        raise ValueError(
            f"unshard: cu_seqlens give {varlen_local_len(cu, layout, world)} local rows per rank "
            f"(pad rows included), got {x_local.shape[dim]} along dim {dim}"
        )
    parts = all_gather(x_local, group, what="unshard") if world > 1 else [x_local]
    index = torch.cat(
        [varlen_index(cu, layout, r, world) for r in range(world)]
    )  # packed index of gathered rows
    order = torch.empty(cu[-1], dtype=torch.long)
    order[index[index >= 0]] = torch.arange(len(index))[index >= 0]
    return torch.cat(parts, dim).index_select(dim, order.to(x_local.device))


def _select(x: torch.Tensor, dim: int, ranges: List[range]) -> torch.Tensor:
    parts = [
        x.narrow(dim, r.start, len(r))
        if r.step == 1
        else x.index_select(dim, torch.arange(r.start, r.stop, r.step, device=x.device))
        for r in ranges
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def shard(
    x: torch.Tensor,
    dim: int = 1,
    layout: str = "zigzag",
    group: Optional[dist.ProcessGroup] = None,
    *,
    rank: Optional[int] = None,
    world: Optional[int] = None,
    cu_seqlens: Optional[CuSeqlens] = None,
    ulysses_group: Optional[dist.ProcessGroup] = None,
    ring_group: Optional[dist.ProcessGroup] = None,
    ulysses: int = 1,
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (local op, no communication);
    with ``ulysses_group`` and ``ring_group`` (or ``ulysses=U`` and a rank of the ``(ring,
    ulysses)`` mesh), its part of the 2D layout ``usp_attention`` takes.

    ``cu_seqlens``: ``x`` is a packed sequence ``(1, S, ...)``; returns this rank's
    ``varlen_local_len`` rows, pad rows (zeros) included.
    """
    if cu_seqlens is not None:
        if rank is None or world is None:
            rank, world = rank_world(group)
        return _shard_varlen(x, dim, layout, rank, world, cu_seqlens)
    return _select(
        x,
        dim,
        _ranges(x.shape[dim], layout, group, rank, world, ulysses_group, ring_group, ulysses),
    )


@functools.lru_cache(maxsize=64)
def gather_order(
    seq_len: int, layout: str, world: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(index, order)`` on ``device``, both ``(S,)``: ``index[i]`` is the global position of row
    ``i`` of every rank's shard concatenated in rank order; ``order`` is its inverse (the rows of
    that concatenation in global order). Cached: read-only."""
    index = torch.cat([positions(seq_len, layout, r, world) for r in range(world)])
    order = torch.empty_like(index)
    order[index] = torch.arange(seq_len)
    return index.to(device), order.to(device)


def unshard(
    x_local: torch.Tensor,
    dim: int = 1,
    layout: str = "zigzag",
    group: Optional[dist.ProcessGroup] = None,
    *,
    cu_seqlens: Optional[CuSeqlens] = None,
    ulysses_group: Optional[dist.ProcessGroup] = None,
    ring_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """All-gather the shards of every rank and put them back in global order (not differentiable).

    ``cu_seqlens``: the shards hold a packed sequence; returns ``(1, S, ...)`` without pad rows.
    """
    check_layout(layout)
    if cu_seqlens is not None:
        return _unshard_varlen(x_local, dim, layout, group, cu_seqlens)
    if _is_2d(group, None, ulysses_group, ring_group):
        # the Ulysses parts of one ring shard, in order, are that ring rank's 1D shard
        x_local = torch.cat(all_gather(x_local, ulysses_group, what="unshard"), dim)
        group = ring_group
    rank, world = rank_world(group)
    if world == 1:
        return x_local
    parts = all_gather(x_local, group, what="unshard")
    _, order = gather_order(x_local.shape[dim] * world, layout, world, x_local.device)
    return torch.cat(parts, dim).index_select(dim, order)
