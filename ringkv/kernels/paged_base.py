"""The paged-attention contract: its records, argument checks and plain-torch reference.

Every paged backend (``paged_torch.py``, ``triton_paged.py``) implements what this module
describes and imports it; ``paged.py`` holds the registry and the public calls, which take a
``backend=`` name::

    out, lse = paged_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None)

- ``q`` ``(N, Q, H, D)``: ``Q`` newest tokens of each of ``N`` sequences (decode: ``Q = 1``);
- ``k_cache`` ``(num_blocks, block_size, Hkv, D)``, ``v_cache``
  ``(num_blocks, block_size, Hkv, Dv)``
  (``Dv`` may differ from ``D``: MLA); token ``t`` of sequence ``n`` lives in block
  ``block_table[n, t // block_size]`` at slot ``t % block_size``;
- ``block_table`` ``(N, max_blocks)`` int; ``seq_lens`` ``(N,)`` int: tokens in the cache for
  each sequence, the ``Q`` new ones included (their K/V were written before the call);
- causal: query ``i`` of sequence ``n`` sits at position ``seq_lens[n] - Q + i`` and sees keys
  at positions ``<=`` its own; with ``causal=False`` every query sees all ``seq_lens[n]`` keys;
- ``scale`` (default ``1/sqrt(D)``); ``softcap`` (a float > 0, or None): each score is
  ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2), the mask applied after;
- ``window`` (an int ``W``, ``-1`` = unbounded): a query at position ``p`` sees only keys at
  positions ``>= p - W`` (the left extent: transformers' ``sliding_window`` ``S`` is ``W = S - 1``),
  on the sequence's global positions (see the SP striping below); ``causal`` bounds the right side;
- ``out`` ``(N, Q, H, Dv)`` in ``q.dtype``; ``lse`` float32 ``(N, H, Q)`` (over the capped scores),
  so partial results of several ranks (each holding a shard of the sequence) merge with
  ``kernels.merge``. A sequence with no visible key gives ``out = 0``, ``lse = -inf``;
- a quantized cache (``kernels/quant.py``: int8 / fp8 values) comes with ``k_scale`` /
  ``v_scale`` ``(num_blocks, block_size, Hkv)``: every backend dequantizes as it reads.

``paged_attention_reference`` is plain torch: gather each sequence's blocks, attend. On CUDA
the ``"triton"`` backend runs the flash-decoding kernel for one new token per sequence and
the prefill kernel for several.

Varlen (prefill chunks, prefix-continued prompts; the engine's call on CUDA)::

    out, lse = paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                             max_seqlen_q=...)

- ``q`` ``(T, H, D)``: the new tokens of ``N`` sequences packed, sequence ``n``'s ``T_n`` tokens
  at rows ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` (``cu_seqlens_q`` ``(N + 1,)`` int, from 0);
  ``max_seqlen_q``: a host int ``>= max T_n`` (sizes the launch; nothing is read back);
- ``seq_lens`` ``(N,)``: keys in the cache for each sequence (the new tokens included);
- query ``i`` of sequence ``n`` sits at position ``q_start[n] + i`` (default
  ``q_start = seq_lens - T_n``: the new tokens are the cache's last);
- ``sp``/``sp_rank``: the cache holds every ``sp``-th token of the sequence, from position
  ``sp_rank`` (local key ``j`` is position ``j * sp + sp_rank``: an SP rank's striped share);
  causal: key ``j`` is visible to a query at position ``p`` iff ``j * sp + sp_rank <= p``; a
  ``window`` ``W``: iff also ``j * sp + sp_rank >= p - W``;
- ``scale``/``softcap``/``window`` as above;
- ``out`` ``(T, H, Dv)`` in ``q.dtype``, ``lse`` float32 ``(H, T)`` (flash-attn's varlen layout).

A step of the engine (the same every layer), built once per step by a backend's ``plan_step``::

    attn = plan_step(seqs, block_size=..., sp=1, sp_rank=0, device=None)   # -> StepAttention
    parts = attn.attend(q, cache, lse=True, scale=None, softcap=None, window=-1)   # every layer

- ``seqs``: ``PagedSeq(row, start, n, block_table)`` for each sequence whose ``n`` queries
  (local rows ``row ..``, positions ``start ..``) attend over the cache; the cache holds this
  rank's striped share (``sp``/``sp_rank`` as above), the new tokens' K/V already written;
- ``q`` ``(T, H, D)``: the step's local query rows; ``cache``: a ``LayerCache`` (one layer's
  K/V and, quantized, scales);
- ``parts``: ``RowsOut(rows (R,), out (R, H, Dv), lse (H, R) float32 or None)`` covering every
  row of ``seqs`` once; with ``lse=False`` a backend may take a faster path without it;
  ``scale``/``softcap``/``window`` per layer as above (a model may alternate windowed and full
  layers).

Attention sinks are not a kernel feature: ``paged.paged_attention``/``paged_prefill`` apply them
to the final output (``kernels.merge.apply_sinks``); the backends never see them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .checks import check_softcap, resolve_scale
from .quant import as_bytes, dequantize

__all__ = [
    "LayerCache",
    "PagedSeq",
    "RowsOut",
    "StepAttention",
    "SeqGroup",
    "by_query_count",
    "padded_table",
    "paged_attention_reference",
    "paged_prefill_reference",
    "validate_paged",
    "validate_prefill",
    "check_features",
    "visible_keys",
    "attend_dense",
    "check_capacity",
    "check_striping",
    "query_limits",
    "striped_limits",
    "read_blocks",
    "read_slots",
]


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class LayerCache:
    """One layer's paged K/V: ``k`` ``(num_blocks, block_size, Hkv, D)``, ``v`` ``(num_blocks,
    block_size, Hkv, Dv)`` (``Dv`` may differ from ``D``); a quantized cache (int8 / fp8 values)
    has ``k_scale``/``v_scale`` ``(num_blocks, block_size, Hkv)``."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    def read(self, slots: torch.Tensor, dtype=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """K ``(S, Hkv, D)`` and V ``(S, Hkv, Dv)`` at flat ``slots (S,)``
        (``block * block_size + offset``); a quantized cache is dequantized to ``dtype`` (default
        float32)."""
        return read_slots(self.k, self.k_scale, slots, dtype), read_slots(
            self.v, self.v_scale, slots, dtype
        )

    def read_blocks(self, blocks: torch.Tensor, dtype=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """K ``(n, block_size, Hkv, D)`` and V ``(.., Dv)`` of ``blocks (n,)``, dequantized like
        ``read``."""
        return (
            read_blocks(self.k, self.k_scale, blocks, dtype or torch.float32),
            read_blocks(self.v, self.v_scale, blocks, dtype or torch.float32),
        )


@dataclass(frozen=True)
class PagedSeq:
    """One sequence of a step attended over the cache: ``n`` queries at local rows ``row ..
    row + n - 1`` and positions ``start .. start + n - 1``; its K/V, the new tokens' included, in
    the blocks of ``block_table`` (under SP striping, this rank's positions ``sp_rank, sp_rank +
    sp, ...`` of them: local key ``i`` at ``block_table[i // block_size]``, offset ``i %
    block_size``)."""

    row: int
    start: int
    n: int
    block_table: Sequence[int]

    def keys(self, sp: int = 1, sp_rank: int = 0) -> int:
        """Keys of the sequence stored on SP rank ``sp_rank`` of ``sp``, the new ones included."""
        return len(range(sp_rank, self.start + self.n, sp))


@dataclass(frozen=True)
class RowsOut:
    """Attention of some query rows of a step over the cache."""

    rows: torch.Tensor  # (R,) local query rows
    out: torch.Tensor  # (R, H, Dv) in q's dtype
    lse: Optional[torch.Tensor]  # (H, R) float32; None when not asked for


class StepAttention(Protocol):
    """A backend's per-step metadata (``plan_step``): built once per step, used by every layer."""

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerCache,
        *,
        lse: bool = True,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        window: int = -1,
    ) -> List[RowsOut]:
        """``q (T, H, D)``: the step's query rows; every row of the step's ``PagedSeq``s once
        (``scale``: default ``1/sqrt(D)``; ``softcap``, ``window``: see the module docstring)."""


@dataclass(frozen=True)
class SeqGroup:
    """Sequences of a step with the same query count ``n``, batched in the decode layout."""

    n: int
    seqs: Tuple[PagedSeq, ...]
    rows: torch.Tensor  # (N * n,) local query rows, sequence-major
    block_table: torch.Tensor  # (N, width) int32, padded with 0
    seq_lens: torch.Tensor  # (N,) int32: keys stored here, the new ones included
    leading: bool = False  # rows are 0, 1, ..., N * n - 1 (a decode step's usual order): no gather

    @classmethod
    def build(cls, n: int, seqs: Sequence[PagedSeq], sp: int, sp_rank: int, device) -> "SeqGroup":
        rows = [s.row + j for s in seqs for j in range(n)]
        return cls(
            n,
            tuple(seqs),
            torch.tensor(rows, device=device),
            padded_table([s.block_table for s in seqs], device),
            torch.tensor([s.keys(sp, sp_rank) for s in seqs], dtype=torch.int32, device=device),
            leading=rows == list(range(len(rows))),
        )

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q (T, H, D)`` -> this group's ``(N, n, H, D)``."""
        if self.leading:  # the first rows as they are: a view where q allows one
            return q[: self.rows.numel()].reshape(-1, self.n, *q.shape[1:])
        return q.index_select(0, self.rows).view(-1, self.n, *q.shape[1:])

    def result(self, out: torch.Tensor, lse: Optional[torch.Tensor] = None) -> RowsOut:
        """``out (N, n, H, Dv)``, ``lse (N, H, n)`` (decode layout) -> the rows' ``RowsOut``."""
        return RowsOut(
            self.rows,
            out.reshape(-1, *out.shape[2:]),
            None if lse is None else lse.transpose(0, 1).reshape(lse.shape[1], -1),
        )


def query_limits(seq_lens: torch.Tensor, nq: int, causal: bool = True) -> torch.Tensor:
    """``(N, Q)`` int64: how many leading keys query ``i`` of each sequence sees, its queries the
    last ``Q`` of ``seq_lens (N,)`` keys (causal; all of them otherwise; may be < 0: none)."""
    lens = seq_lens.to(torch.long)[:, None]  # (N, 1)
    return lens - nq + 1 + torch.arange(nq, device=lens.device) if causal else lens.expand(-1, nq)


def striped_limits(
    seqs: Sequence[PagedSeq], n: int, sp: int, sp_rank: int, device=None
) -> torch.Tensor:
    """``(N, n)`` int64: how many of the keys SP rank ``sp_rank`` stores (positions ``sp_rank,
    sp_rank + sp,
    ...``) each of the ``n`` queries of ``seqs`` sees (those at positions <= its own)."""
    p = torch.tensor([s.start for s in seqs], device=device)[:, None] + torch.arange(
        n, device=device
    )  # (N, n)
    return torch.div(p - sp_rank, sp, rounding_mode="floor") + 1


def by_query_count(seqs: Sequence[PagedSeq]) -> Dict[int, List[PagedSeq]]:
    """``n -> sequences with n queries``, in order of first appearance."""
    groups = defaultdict(list)
    for s in seqs:
        groups[s.n].append(s)
    return groups


def padded_table(tables: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Block tables of several sequences as one ``(N, width)`` int32 tensor, padded with 0."""
    width = max(len(t) for t in tables)
    return torch.tensor(
        [list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )


# ----------------------------------------------------------------------------- checks


def _validate_cache(q, k_cache, v_cache, k_scale, v_scale, tensors, q_layout: str) -> None:
    """Types, ``q``'s rank and the cache's shape, shared by both layouts."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), *tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (a quantized cache) or neither")
    if k_scale is None:
        if not (q.dtype.is_floating_point and q.dtype == k_cache.dtype == v_cache.dtype):
            raise TypeError(
                f"q, k_cache and v_cache must share one floating dtype, "
                f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
            )
    else:
        if not (
            k_cache.element_size() == 1
            and k_cache.dtype == v_cache.dtype
            and q.dtype.is_floating_point
        ):
            raise TypeError(
                f"a quantized cache holds one-byte values (int8 / fp8), got {k_cache.dtype}, "
                f"{v_cache.dtype}"
            )
        if tuple(k_scale.shape) != tuple(k_cache.shape[:3]) or tuple(v_scale.shape) != tuple(
            v_cache.shape[:3]
        ):
            raise ValueError(
                "k_scale/v_scale must be (num_blocks, block_size, Hkv) = "
                f"{tuple(k_cache.shape[:3])}, "
                f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}"
            )
    if q.dim() != q_layout.count(",") + 1:
        raise ValueError(f"q must be {q_layout}, got {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache (num_blocks, block_size, Hkv, D) must be 4-D, got {tuple(k_cache.shape)}"
        )
    if v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must match in (num_blocks, block_size, Hkv) (v_cache's head size "
            f"may differ), got {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}"
        )
    if (
        q.shape[-1] != k_cache.shape[-1]
        or k_cache.shape[2] == 0
        or q.shape[-2] % k_cache.shape[2] != 0
    ):
        raise ValueError(
            f"q heads/head_dim {tuple(q.shape[-2:])} do not fit the cache's "
            f"{tuple(k_cache.shape[2:])}: "
            f"need the same head_dim and heads % kv_heads == 0"
        )
    for name, t in tensors:
        if t.dtype.is_floating_point:
            raise TypeError(
                f"block_table and seq_lens must be integer tensors, got {t.dtype} for {name}"
            )


def check_features(softcap=None, window: int = -1) -> Tuple[Optional[float], int]:
    """``softcap`` (None, or a finite number > 0) and ``window`` (an int >= -1) checked:
    ``(softcap as a float or None, window)``, else a ValueError naming the argument."""
    softcap = check_softcap(softcap)
    if isinstance(window, bool) or not isinstance(window, int) or window < -1:
        raise ValueError(
            f"window must be an int >= 0 (the left extent W: a query at p sees keys >= p - W) "
            f"or -1 (unbounded), got {window!r}"
        )
    return softcap, int(window)


def validate_paged(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    k_scale=None,
    v_scale=None,
    softcap=None,
    window: int = -1,
) -> None:
    check_features(softcap, window)
    _validate_cache(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        (("block_table", block_table), ("seq_lens", seq_lens)),
        "(N, Q, H, D)",
    )
    if (
        block_table.dim() != 2
        or block_table.shape[0] != q.shape[0]
        or seq_lens.shape != (q.shape[0],)
    ):
        raise ValueError(
            f"block_table must be (N, max_blocks) and seq_lens (N,) with N = {q.shape[0]}, "
            f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )


def validate_prefill(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    q_start=None,
    k_scale=None,
    v_scale=None,
    sp: int = 1,
    sp_rank: int = 0,
    softcap=None,
    window: int = -1,
) -> None:
    """Shapes and types of a varlen call (host metadata only: never reads device values)."""
    check_features(softcap, window)
    ints = [("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)]
    if q_start is not None:
        ints.append(("q_start", q_start))
    _validate_cache(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        ints,
        "(T, H, D) (the new tokens of all sequences packed)",
    )
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (
        n < 0
        or block_table.dim() != 2
        or block_table.shape[0] != n
        or cu_seqlens_q.shape != (n + 1,)
        or (q_start is not None and q_start.shape != (n,))
    ):
        raise ValueError(
            "need seq_lens (N,), block_table (N, max_blocks), cu_seqlens_q (N + 1,) and q_start "
            f"(N,) or None; got {tuple(seq_lens.shape)}, {tuple(block_table.shape)}, "
            f"{tuple(cu_seqlens_q.shape)}, {None if q_start is None else tuple(q_start.shape)}"
        )
    check_striping(sp, sp_rank)


def check_capacity(seq_lens, capacity: int) -> None:
    """Every ``seq_lens`` entry within ``[0, capacity]`` (what the block table can hold)."""
    if seq_lens.numel() and not (0 <= int(seq_lens.min()) and int(seq_lens.max()) <= capacity):
        raise ValueError(
            f"seq_lens must lie in [0, max_blocks * block_size = {capacity}] "
            f"(the block_table's capacity), got {seq_lens.tolist()}"
        )


def check_striping(sp: int, sp_rank: int) -> None:
    """``sp``/``sp_rank``: the cache holds every ``sp``-th position from ``sp_rank``."""
    if not (isinstance(sp, int) and isinstance(sp_rank, int) and 0 <= sp_rank < sp):
        raise ValueError(f"need integers 0 <= sp_rank < sp, got sp={sp!r}, sp_rank={sp_rank!r}")


# ----------------------------------------------------------------------------- reference


def read_blocks(cache: torch.Tensor, scale, blocks: torch.Tensor, dtype) -> torch.Tensor:
    """``cache[blocks]`` ``(n, block_size, Hkv, D)``, dequantized when ``scale`` is given
    (index_select: faster on CPU than advanced indexing)."""
    if scale is None:
        return cache.index_select(0, blocks)
    return dequantize(
        as_bytes(cache).index_select(0, blocks).view(cache.dtype),
        scale.index_select(0, blocks),
        dtype,
    )


def read_slots(cache: torch.Tensor, scale, slots: torch.Tensor, dtype=None) -> torch.Tensor:
    """``cache`` at flat ``slots (S,)`` as ``(S, Hkv, D)``, dequantized to ``dtype`` (default
    float32) when ``scale`` is given."""
    x = as_bytes(cache).reshape(-1, *cache.shape[2:]).index_select(0, slots).view(cache.dtype)
    if scale is not None:
        x = dequantize(
            x, scale.reshape(-1, cache.shape[2]).index_select(0, slots), dtype or torch.float32
        )
    return x


def visible_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True, window: int = -1
) -> torch.Tensor:
    """Bool ``(Sq, L)``: key ``j`` (global position ``k_pos[j]``) is visible to query ``i`` (at
    ``q_pos[i]``): ``k_pos <= q_pos`` when causal, ``k_pos >= q_pos - window`` when
    ``window >= 0``."""
    visible = torch.ones(q_pos.shape[0], k_pos.shape[0], dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    return visible


def attend_dense(q, k, v, scale: float, visible: torch.Tensor, softcap: Optional[float] = None):
    """The reference's attention of one sequence: ``q (Sq, H, D)`` over ``k (L, Hkv, D)``, ``v (L,
    Hkv, Dv)`` where ``visible (Sq, L)``, scores capped (``softcap``) before the mask. Computed in
    float32 (float64 for float64 ``q``) -> ``out (Sq, H, Dv)`` in ``q.dtype``, ``lse (H, Sq)``
    float32; a row that sees no key gives 0 / -inf."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    sq, h, d = q.shape
    hkv = k.shape[1]
    qg = q.to(compute).reshape(
        sq, hkv, h // hkv, d
    )  # (Sq, Hkv, G, D): GQA as a view, K/V never repeated
    s = torch.einsum("qhgd,khd->hgqk", qg, k.to(compute)) * scale  # (Hkv, G, Sq, L)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, G, Sq); -inf for a row with no key
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("hgqk,khd->qhgd", p, v.to(compute)).reshape(sq, h, v.shape[-1])
    return out.to(q.dtype), lse.reshape(h, sq).float()


def paged_attention_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    softcap: Optional[float] = None,
    window: int = -1,
):
    """The decode-layout contract (module docstring) in plain torch, one sequence at a time."""
    validate_paged(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, softcap, window)
    softcap, window = check_features(softcap, window)
    n, nq, h, d = q.shape
    bs = k_cache.shape[1]
    scale = resolve_scale(scale, d)
    check_capacity(seq_lens, block_table.shape[1] * bs)
    out = torch.zeros(n, nq, h, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((n, h, nq), float("-inf"), device=q.device)
    for i, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue
        blocks = block_table[i, : (length + bs - 1) // bs].long()
        k = read_blocks(k_cache, k_scale, blocks, q.dtype).reshape(-1, *k_cache.shape[2:])[
            :length
        ]  # (L, Hkv, D)
        v = read_blocks(v_cache, v_scale, blocks, q.dtype).reshape(-1, *v_cache.shape[2:])[
            :length
        ]  # (L, Hkv, Dv)
        visible = visible_keys(
            torch.arange(length - nq, length, device=q.device),
            torch.arange(length, device=q.device),
            causal,
            window,
        )
        o, ls = attend_dense(q[i], k, v, scale, visible, softcap)
        out[i], lse[i] = o, ls
    return out, lse


def paged_prefill_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    *,
    max_seqlen_q: int,
    q_start=None,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    sp: int = 1,
    sp_rank: int = 0,
    softcap: Optional[float] = None,
    window: int = -1,
):
    """The varlen contract (module docstring) in plain torch, one sequence at a time."""
    validate_prefill(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        q_start,
        k_scale,
        v_scale,
        sp,
        sp_rank,
        softcap,
        window,
    )
    softcap, window = check_features(softcap, window)
    t, h, d = q.shape
    bs = k_cache.shape[1]
    scale = resolve_scale(scale, d)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    starts = (
        q_start.tolist()
        if q_start is not None
        else [length - (b - a) for length, a, b in zip(lens, cu, cu[1:])]
    )
    if max(b - a for a, b in zip(cu, cu[1:]) or [0]) > max_seqlen_q or (
        cu and (cu[0] != 0 or cu[-1] > t)
    ):
        raise ValueError(
            f"cu_seqlens_q {cu} must start at 0, end at most at T = {t} and have steps <= "
            f"max_seqlen_q = {max_seqlen_q}"
        )
    out = torch.zeros(t, h, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((h, t), float("-inf"), device=q.device)
    for i, length in enumerate(lens):
        a, b = cu[i], cu[i + 1]
        length = min(length, block_table.shape[1] * bs)
        if length <= 0 or b == a:
            continue
        blocks = block_table[i, : (length + bs - 1) // bs].long()
        k = read_blocks(k_cache, k_scale, blocks, q.dtype).reshape(-1, *k_cache.shape[2:])[
            :length
        ]  # (L, Hkv, D)
        v = read_blocks(v_cache, v_scale, blocks, q.dtype).reshape(-1, *v_cache.shape[2:])[
            :length
        ]  # (L, Hkv, Dv)
        visible = visible_keys(
            torch.arange(starts[i], starts[i] + b - a, device=q.device),
            torch.arange(length, device=q.device) * sp + sp_rank,
            causal,
            window,
        )
        out[a:b], lse[:, a:b] = attend_dense(q[a:b], k, v, scale, visible, softcap)
    return out, lse
