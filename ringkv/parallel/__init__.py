"""Parallelism applied to the engine's model from outside: the ``(pp, sp, tp)`` mesh, tensor
and pipeline sharding, the per-rank step executor and how ranks start. With ``ringkv.sp``
the only package that communicates."""

from .launch import CacheBudget, Cluster, ClusterMode, EngineError
from .mesh import Mesh, MeshShape, build_mesh
from .plan import SeqStep, StepPlan
from .worker import EngineShape, Worker

__all__ = [
    "CacheBudget",
    "Cluster",
    "ClusterMode",
    "EngineError",
    "Mesh",
    "MeshShape",
    "build_mesh",
    "SeqStep",
    "StepPlan",
    "EngineShape",
    "Worker",
]
