"""One request's K/V gathered from, and scattered to, the ranks of an engine of any mesh (what
``engine/migrate.py`` exports and imports).

A snapshot holds K/V token-major, ``(layers, T, Hkv, D)``, whatever the mesh. A rank stores a
box of it: the layers of its pipeline stage, the KV heads of its TP rank (``tp > Hkv``
replicates a head on ``tp / Hkv`` ranks) and, along the tokens, every ``sp``-th one from its SP
rank on (``context.py``: token ``t`` lives on SP rank ``t % sp``, in logical block
``t // (block_size * sp)`` at offset ``t % (block_size * sp) // sp``).

- **gather** (export): the driver publishes ``{"kind": "kv_read", ...}`` with the slice of
  the block table that covers tokens ``[start, end)``; every rank reads its box of those tokens
  and the first replica of each head sends it to the driver over the control group (the step
  channel's gloo group); the driver places each box in the snapshot.
- **scatter** (import): the driver publishes ``"kv_write"`` and sends each rank (replicas
  too) its box; the ranks write it and answer with one word, so the import is complete (or a
  rank's error known) before the call returns.

Both sides agree on every box's size before a box travels: the message carries the token count
the driver expects of each rank (``counts``), a rank sends its own count (a header word) before
its box on export and answers with it on import, and a rank whose count differs moves no box of
its size. A mismatch is an ``EngineError`` naming both sizes on the driver and on that rank,
never a gloo receive of the wrong size (which aborts the process).

The message and the boxes are O(end - start): an incremental snapshot costs what is new. Boxes
travel as bytes (fp8 included) with their scales beside them on a quantized cache. The driver
holds the snapshot once plus one box at a time (received, or sent and not yet taken).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..cache.kv_cache import KVCache
from ..kernels.quant import SCALE_DTYPE, as_bytes
from .control import EngineError

KV_TAG = 15  # apart from the step results (RESULT_TAG) and snapshot transfers
KINDS = ("kv_read", "kv_write", "state_read", "state_write")
States = Dict[int, List[torch.Tensor]]  # a hybrid's recurrent state: layer -> its tensors

KV = Tuple[
    torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]
]  # k, v, k_scale, v_scale


@dataclass(frozen=True)
class Box:
    """What one model rank stores of a snapshot: ``layers`` (indices among the model's K/V
    layers: a hybrid model's attention layers) and ``heads`` (global ids) and tokens
    ``sp_rank, sp_rank + sp, ...``. ``owner``: the first replica of these heads (the one that
    sends them on export)."""

    rank: int
    layers: range
    heads: range
    sp_rank: int
    owner: bool

    @staticmethod
    def of(info: dict, num_kv_heads: int, tp: int) -> "Box":
        t = info["tp_rank"]
        first = (
            t * num_kv_heads // tp
        )  # tp <= Hkv: Hkv / tp heads each; tp > Hkv: one head per tp / Hkv ranks
        return Box(
            info["rank"],
            range(*info["kv_layers"]),
            range(first, first + info["kv_heads"]),
            info["sp_rank"],
            owner=t * num_kv_heads % tp < num_kv_heads,
        )

    def tokens(self, start: int, end: int, sp: int) -> slice:
        """Its tokens among ``[start, end)``, as a slice of the snapshot's token dim."""
        return slice((self.sp_rank - start) % sp, end - start, sp)

    def count(self, start: int, end: int, sp: int) -> int:
        """How many of its tokens lie among ``[start, end)``."""
        return len(range(*self.tokens(start, end, sp).indices(end - start)))

    def index(self, start: int, end: int, sp: int) -> tuple:
        """Its box of ``(L, 2, T, H, ...)`` K/V (or scales) of tokens ``[start, end)``."""
        return (
            slice(self.layers.start, self.layers.stop),
            slice(None),
            self.tokens(start, end, sp),
            slice(self.heads.start, self.heads.stop),
        )


def _slots(
    table: List[int], first: int, start: int, end: int, block_size: int, sp: int, sp_rank: int
) -> torch.Tensor:
    """Slots of SP rank ``sp_rank``'s tokens among ``[start, end)``; ``table`` is the block table
    from logical block ``first`` on."""
    lb = block_size * sp  # tokens per logical block
    first_pos = (
        start + (sp_rank - start) % sp
    )  # may lie past ``end``: this rank stores none of them
    pos = torch.arange(first_pos, max(first_pos, end), sp)
    return torch.tensor(table, dtype=torch.long)[pos // lb - first] * block_size + pos % lb // sp


def mismatch(
    rank: int, start: int, end: int, got: int, expected: int, token_bytes: int
) -> EngineError:
    """The error of a box whose size the two sides disagree on (token counts and bytes)."""
    return EngineError(
        f"moving the K/V of tokens [{start}, {end}): model rank {rank} stores {got} of them "
        f"({got * token_bytes} bytes), the driver expects {expected} ({expected * token_bytes} "
        f"bytes); the two sides disagree on the layout"
    )


def _agree(expected: int, got: int, kv: KVCache, rank: int, start: int, end: int) -> None:
    """``EngineError`` naming both sizes unless this rank stores the ``expected`` token count."""
    if got != expected:
        L, _, _, _, h, d = kv.data.shape
        raise mismatch(rank, start, end, got, expected, _nbytes((L, 2, 1, h, d), kv.data.dtype))


def read(
    kv: KVCache,
    table: List[int],
    first: int,
    start: int,
    end: int,
    sp: int = 1,
    sp_rank: int = 0,
    expected: Optional[int] = None,
    rank: int = 0,
):
    """This rank's stored tokens among ``[start, end)``: data ``(L, 2, n, H, D)`` and scale
    ``(L, 2, n, H)`` (None unless quantized), on the CPU. ``expected``: the token count the
    driver expects (``EngineError`` otherwise)."""
    slots = _slots(table, first, start, end, kv.block_size, sp, sp_rank).to(kv.data.device)
    if expected is not None:
        _agree(expected, slots.numel(), kv, rank, start, end)
    # (L, 2, slots, H, D); L may be 0 (a hybrid's stage of recurrent layers only)
    data = as_bytes(kv.data).flatten(2, 3).index_select(2, slots).view(kv.data.dtype).cpu()
    scale = None if kv.scale is None else kv.scale.flatten(2, 3).index_select(2, slots).cpu()
    return data, scale


def write(
    kv: KVCache,
    table: List[int],
    first: int,
    start: int,
    end: int,
    data: torch.Tensor,
    scale: Optional[torch.Tensor],
    sp: int = 1,
    sp_rank: int = 0,
    rank: int = 0,
) -> None:
    """Store ``read``'s layout back: ``data`` ``(L, 2, n, H, D)``, ``scale`` ``(L, 2, n, H)``."""
    slots = _slots(table, first, start, end, kv.block_size, sp, sp_rank).to(kv.data.device)
    _agree(data.shape[2], slots.numel(), kv, rank, start, end)
    as_bytes(kv.data).flatten(2, 3).index_copy_(2, slots, as_bytes(data.to(kv.data.device)))
    if kv.scale is not None:
        kv.scale.flatten(2, 3).index_copy_(2, slots, scale.to(kv.scale.device))


def _wire(x: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (any dtype, fp8 included), as gloo can carry them."""
    return x.contiguous().view(-1).view(torch.uint8)


def _unwire(buf: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return buf.view(dtype).view(shape)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class Mover:
    """The driver's side: ``gather`` / ``scatter`` over ``cluster``'s ranks (any launch mode)."""

    def __init__(self, cluster):
        self.cluster = cluster
        sh, cfg = cluster.shape, cluster.cfg
        self.sp, self.block_size = sh.sp, sh.block_size
        self.boxes = [Box.of(i, cfg.num_kv_heads, sh.tp) for i in cluster.infos]
        self.dtype = sh.quant.dtype if sh.quant else cluster.dtype  # what the cache stores
        self.scale_dtype = SCALE_DTYPE if sh.quant else None
        self.state_shapes = model_states(cfg)  # a hybrid's state: layer -> shapes (else empty)
        self.shape = (
            len(cfg.kv_layers()),
            cfg.num_kv_heads,
            cfg.head_dim,
        )  # a snapshot's K/V: (K/V layers, T, Hkv, D)

    def _table(self, table: List[int], start: int, end: int):
        lb = self.block_size * self.sp
        first = start // lb
        return first, [int(b) for b in table[first : -(-end // lb)]]

    def _local(self, box: Box) -> bool:
        """The box is this process's own (a torchrun driver is model rank 0)."""
        return self.cluster.worker is not None and box.rank == self.cluster.worker.mesh.rank

    def _counts(self, start: int, end: int) -> List[int]:
        """The token count of ``[start, end)`` the driver expects of each model rank."""
        return [box.count(start, end, self.sp) for box in self.boxes]

    def _token_bytes(self, box: Box) -> int:
        """Bytes of one token's K/V in ``box``."""
        return _nbytes((len(box.layers), 2, 1, len(box.heads), self.shape[2]), self.dtype)

    def _recv(self, box: Box, shape, dtype: torch.dtype) -> torch.Tensor:
        c = self.cluster
        buf = torch.empty(_nbytes(shape, dtype), dtype=torch.uint8)
        return _unwire(
            c.control.recv_from(
                box.rank + c.offset, buf, KV_TAG, f"the K/V of model rank {box.rank}"
            ),
            dtype,
            shape,
        )

    def empty(self) -> KV:
        """The K/V of no token: ``(layers, 0, Hkv, D)`` (scales ``(layers, 0, Hkv)``)."""
        L, H, D = self.shape
        k = torch.empty(L, 0, H, D, dtype=self.dtype)
        s = None if self.scale_dtype is None else torch.empty(L, 0, H, dtype=self.scale_dtype)
        return k, k.clone(), s, None if s is None else s.clone()

    def gather(self, table: List[int], start: int, end: int) -> KV:
        """K/V (and scales) of tokens ``[start, end)`` of the sequence with block table
        ``table``: ``k``/``v`` ``(layers, T, Hkv, D)``, scales ``(layers, T, Hkv)`` (None
        unless quantized), on the CPU."""
        c = self.cluster
        if end <= start:
            return self.empty()
        first, part = self._table(table, start, end)
        if c.world == 1:
            data, scale = read(c.worker.kv, part, first, start, end)
        else:
            L, H, D = self.shape
            data = torch.empty(L, 2, end - start, H, D, dtype=self.dtype)  # (L, 2, T, H, D)
            scale = (
                None
                if self.scale_dtype is None
                else torch.empty(L, 2, end - start, H, dtype=self.scale_dtype)
            )
            counts = self._counts(start, end)
            c.control.publish(
                {
                    "kind": "kv_read",
                    "table": part,
                    "first": first,
                    "start": start,
                    "end": end,
                    "counts": counts,
                }
            )
            for box in self.boxes:
                if not box.owner:
                    continue
                at = box.index(start, end, self.sp)
                if self._local(box):  # the torchrun driver's own box
                    mine, mine_scale = read(
                        c.worker.kv,
                        part,
                        first,
                        start,
                        end,
                        self.sp,
                        box.sp_rank,
                        counts[box.rank],
                        box.rank,
                    )
                else:
                    shape = data[at].shape  # (l, 2, n, h, D)
                    got = int(
                        self._recv(box, (1,), torch.int64)[0]
                    )  # the rank's own count, before its box
                    if got != counts[box.rank]:
                        raise mismatch(
                            box.rank, start, end, got, counts[box.rank], self._token_bytes(box)
                        )
                    mine = self._recv(box, shape, data.dtype)
                    mine_scale = None if scale is None else self._recv(box, shape[:-1], scale.dtype)
                data[at] = mine
                if scale is not None:
                    scale[at] = mine_scale
        return (
            data[:, 0],
            data[:, 1],
            *((None, None) if scale is None else (scale[:, 0], scale[:, 1])),
        )

    def scatter(self, table: List[int], start: int, kv: KV) -> None:
        """Write ``kv`` (``gather``'s layout, tokens ``[start, start + T)``) into the blocks of
        ``table`` on every rank; returns once every rank has written its box."""
        c = self.cluster
        k, v, ks, vs = kv
        end = start + k.shape[1]
        if end <= start:
            return
        first, part = self._table(table, start, end)
        data = torch.stack((k, v), 1)  # (L, 2, T, H, D)
        scale = None if ks is None else torch.stack((ks, vs), 1)  # (L, 2, T, H)
        if c.world == 1:
            write(c.worker.kv, part, first, start, end, data, scale)
            return
        counts = self._counts(start, end)
        c.control.publish(
            {
                "kind": "kv_write",
                "table": part,
                "first": first,
                "start": start,
                "end": end,
                "counts": counts,
            }
        )
        for box in self.boxes:
            at = box.index(start, end, self.sp)
            mine, mine_scale = data[at], None if scale is None else scale[at]
            if self._local(box):
                write(
                    c.worker.kv,
                    part,
                    first,
                    start,
                    end,
                    mine,
                    mine_scale,
                    self.sp,
                    box.sp_rank,
                    box.rank,
                )
                continue
            c.control.send(_wire(mine), box.rank + c.offset, KV_TAG)
            if mine_scale is not None:
                c.control.send(_wire(mine_scale), box.rank + c.offset, KV_TAG)
            c.control.channel.reap(
                0
            )  # one box in flight at a time: the snapshot plus one box, never twice
        for box in self.boxes:  # every rank has written (or failed: then its error reaches us)
            if not self._local(box):
                got = int(
                    c.control.recv_from(
                        box.rank + c.offset,
                        torch.zeros(1, dtype=torch.int64),
                        KV_TAG,
                        f"model rank {box.rank} to store the imported K/V",
                    )[0]
                )
                if (
                    got != counts[box.rank]
                ):  # it answers with the count it stores: then it wrote nothing
                    raise mismatch(
                        box.rank, start, end, got, counts[box.rank], self._token_bytes(box)
                    )

    # -- a hybrid model's recurrent state: one slot, every layer --------------------------------
    def _state_owner(self, box: Box) -> bool:
        """The ranks that send their stage's state on export: its first SP rank's TP ranks, each
        its own heads (every SP rank holds the same)."""
        return self.cluster.infos[box.rank]["sp_rank"] == 0

    def _stage_states(self, box: Box) -> List[int]:
        """The recurrent layers of ``box``'s stage, in order."""
        lo, hi = self.cluster.infos[box.rank]["layers"]
        return [i for i in sorted(self.state_shapes) if lo <= i < hi]

    def gather_state(self, slot: int) -> States:
        """The state in ``slot`` of every recurrent layer (float32, on the CPU), each tensor whole
        (the model's layout): under TP assembled from every TP rank's heads (``state_ranges``)."""
        from .tp import place_state_part, state_ranges

        c, out, tp = self.cluster, {}, self.cluster.shape.tp
        if c.world > 1:
            c.control.publish({"kind": "state_read", "slot": slot})
        for box in self.boxes:
            if not self._state_owner(box):
                continue
            ranges = state_ranges(c.cfg, tp, c.infos[box.rank]["tp_rank"])
            for i in self._stage_states(box):
                if self._local(box) or c.world == 1:
                    parts = [
                        t[slot].to("cpu", torch.float32, copy=True)
                        for t in c.worker.states.layers[i]
                    ]
                else:
                    parts = [
                        self._recv(box, (sum(map(len, rs)), *shape[1:]), torch.float32)
                        for shape, rs in zip(self.state_shapes[i], ranges[i])
                    ]
                if tp == 1:
                    out[i] = parts
                    continue
                whole = out.setdefault(i, [torch.empty(s) for s in self.state_shapes[i]])
                for w, part, rs in zip(whole, parts, ranges[i]):
                    place_state_part(w, part, rs)
        return out

    def scatter_state(self, slot: int, states: States) -> None:
        """Write ``states`` (``gather_state``'s layout) into ``slot`` on every rank (under TP each
        rank its heads' part); returns once every rank has written."""
        from .tp import state_part, state_ranges

        c, tp = self.cluster, self.cluster.shape.tp

        def part(box: Box) -> States:
            if tp == 1:
                return states
            ranges = state_ranges(c.cfg, tp, c.infos[box.rank]["tp_rank"])
            return {
                i: [state_part(t, rs) for t, rs in zip(ts, ranges[i])] for i, ts in states.items()
            }

        if c.world == 1:
            _write_state(c.worker, slot, states)
            return
        c.control.publish({"kind": "state_write", "slot": slot})
        for box in self.boxes:
            mine = part(box)
            if self._local(box):
                _write_state(c.worker, slot, mine)
                continue
            for i in self._stage_states(box):
                for t in mine[i]:
                    c.control.send(_wire(t.float()), box.rank + c.offset, KV_TAG)
                    c.control.channel.reap(0)
        for box in self.boxes:
            if not self._local(box):
                c.control.recv_from(
                    box.rank + c.offset,
                    torch.zeros(1, dtype=torch.int64),
                    KV_TAG,
                    f"model rank {box.rank} to store the imported state",
                )


def model_states(cfg) -> Dict[int, List[tuple]]:
    """A model's recurrent layers and their state shapes (empty for a dense model)."""
    from ..model import new_model, state_layers
    from ..model.loader import on_meta

    with on_meta():
        return state_layers(new_model(cfg))


def _write_state(worker, slot: int, states: States) -> None:
    for i, ts in worker.states.layers.items():
        for t, x in zip(ts, states[i]):
            t[slot] = x.to(t.device)


def serve_state(worker, control, msg: dict) -> None:
    """A rank other than the driver: its stage's state of ``msg["slot"]`` to the driver (its
    stage's first SP rank's TP ranks, each its heads' part) or from it (every rank its part; one
    word back once written)."""
    m, slot, pool = worker.mesh, msg["slot"], worker.states
    layers = sorted(pool.layers) if pool is not None else []
    if msg["kind"] == "state_read":
        if m.sp_rank == 0:
            for i in layers:
                for t in pool.layers[i]:
                    control.send(_wire(t[slot].to("cpu", torch.float32).contiguous()), 0, KV_TAG)
        return
    got = {}
    for i in layers:
        got[i] = []
        for t in pool.layers[i]:
            shape = tuple(t.shape[1:])
            buf = torch.empty(_nbytes(shape, torch.float32), dtype=torch.uint8)
            got[i].append(
                _unwire(
                    control.recv_from(0, buf, KV_TAG, "the imported state from the driver"),
                    torch.float32,
                    shape,
                )
            )
    _write_state(worker, slot, got)
    control.send(torch.tensor([1]), 0, KV_TAG)


def serve(worker, control, msg: dict) -> None:
    """A rank other than the driver: its part of a ``kv_read`` or ``kv_write`` message (or of a
    ``state_read`` / ``state_write``: ``serve_state``)."""
    if msg["kind"].startswith("state"):
        return serve_state(worker, control, msg)
    m, kv = worker.mesh, worker.kv
    table, first, start, end = msg["table"], msg["first"], msg["start"], msg["end"]
    sp, expected = m.sp, msg["counts"][m.rank]
    if msg["kind"] == "kv_read" and not Box.of(worker.info(), worker.cfg.num_kv_heads, m.tp).owner:
        return  # a replica: another rank sends these heads
    own = _slots(
        table, first, start, end, kv.block_size, sp, m.sp_rank
    ).numel()  # what this rank stores
    if msg["kind"] == "kv_read":
        control.send(
            torch.tensor([own]), 0, KV_TAG
        )  # its count first: the driver checks it before the box
        _agree(expected, own, kv, m.rank, start, end)
        data, scale = read(kv, table, first, start, end, sp, m.sp_rank)
        control.send(_wire(data), 0, KV_TAG)
        if scale is not None:
            control.send(_wire(scale), 0, KV_TAG)
        return
    L, _, _, _, h, d = kv.data.shape
    shape = (L, 2, expected, h, d)  # what the driver sends, whatever this rank stores

    def recv(shape, dtype):
        buf = torch.empty(_nbytes(shape, dtype), dtype=torch.uint8)
        return _unwire(
            control.recv_from(0, buf, KV_TAG, "the imported K/V from the driver"), dtype, shape
        )

    data = recv(shape, kv.data.dtype)
    scale = None if kv.scale is None else recv(shape[:-1], kv.scale.dtype)
    if (
        own == expected
    ):  # written before the answer: the import is complete once every rank answered
        write(kv, table, first, start, end, data, scale, sp, m.sp_rank, m.rank)
    control.send(torch.tensor([own]), 0, KV_TAG)  # the count it stores: the driver checks it
    _agree(expected, own, kv, m.rank, start, end)
