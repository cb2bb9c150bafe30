"""The ``(pp, sp, tp)`` mesh of an engine: one process group per axis, TP innermost.

Global rank ``= (pp_rank * sp + sp_rank) * tp + tp_rank``: TP peers are neighbours (their
all-reduces are the most frequent, so they belong inside a node), SP next (the K/V ring),
PP outermost (only activations cross stages, the traffic a slower link can carry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch.distributed as dist

from ..sp.collectives import Memo

AXES = ("pp", "sp", "tp")


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    sp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.sp * self.tp

    def coords(self, rank: int) -> Dict[str, int]:
        """``{"pp": i, "sp": j, "tp": k}`` of a global rank."""
        return {
            "pp": rank // (self.sp * self.tp),
            "sp": rank // self.tp % self.sp,
            "tp": rank % self.tp,
        }

    def rank_of(self, pp: int, sp: int, tp: int) -> int:
        return (pp * self.sp + sp) * self.tp + tp


class Mesh:
    """This rank's place in the mesh and the process group of each axis (``None`` for an axis
    of size 1: nothing on it communicates)."""

    def __init__(self, shape: MeshShape, rank: int = 0, groups: Optional[Dict[str, object]] = None):
        self.shape, self.rank = shape, rank
        c = shape.coords(rank)
        self.pp_rank, self.sp_rank, self.tp_rank = c["pp"], c["sp"], c["tp"]
        groups = groups or {}
        self.pp_group, self.sp_group, self.tp_group = (groups.get(a) for a in AXES)

    pp = property(lambda self: self.shape.pp)
    sp = property(lambda self: self.shape.sp)
    tp = property(lambda self: self.shape.tp)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that turns the last stage's hidden states into logits for the driver."""
        return self.shape.rank_of(self.pp - 1, 0, 0)

    def neighbour(self, stage_step: int) -> int:
        """The rank holding this rank's (sp, tp) coordinate in stage ``pp_rank + stage_step``."""
        return self.shape.rank_of(self.pp_rank + stage_step, self.sp_rank, self.tp_rank)

    def __repr__(self) -> str:
        return f"Mesh(pp={self.pp}, sp={self.sp}, tp={self.tp}, rank={self.rank})"


MESHES = Memo()  # (world, device type, shape) -> axis -> process group


def build_mesh(shape: MeshShape, device_type: str) -> Mesh:
    """The mesh over the default process group (whose size must be ``shape.world``), built
    with ``torch.distributed.device_mesh`` once per shape and process group."""
    if shape.world == 1:
        return Mesh(shape)
    world = dist.group.WORLD
    groups = MESHES.get((id(world), device_type, shape), lambda: _groups(shape, device_type))
    return Mesh(shape, dist.get_rank(), groups)


def _groups(shape: MeshShape, device_type: str) -> Dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh(device_type, (shape.pp, shape.sp, shape.tp), mesh_dim_names=AXES)
    return {a: dm.get_group(a) for a, n in zip(AXES, (shape.pp, shape.sp, shape.tp)) if n > 1}


def forget_meshes() -> None:
    """Drop cached groups (their process group was destroyed)."""
    MESHES.reset()
