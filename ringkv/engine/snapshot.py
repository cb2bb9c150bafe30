"""``KVSnapshot``: what another engine needs to continue a request exactly.

The request's tokens (prompt and generated), sampling parameters and sampler state (the
generator's state, so a seeded request continues with the same random stream), log-probs so
far, and the K/V of its computed tokens ``[start, end)``, token-major per layer:
``k``/``v`` ``(layers, T, Hkv, D)`` in the cache's storage dtype, with ``k_scale``/``v_scale``
``(layers, T, Hkv)`` for a quantized cache. Token-major K/V do not depend on the block size,
so the receiver may use another one. ``base_id`` names the snapshot this one extends: an
incremental snapshot holds only what is new since it (K/V of ``[start, end)``, tokens from
``tokens_from``, log-probs from ``logprobs_from``), so its size and the work to make and apply
it do not grow with the context. ``final`` is set when the source stopped the request: the
receiver runs it once it is imported.

Stored as safetensors (``save`` / ``load`` / ``to_bytes`` / ``from_bytes``; never pickled): the
tensors, and the rest as JSON in the metadata with a SHA-256 of the tensor bytes, so a
truncated or altered file is refused. ``send`` / ``recv`` move one over a
``torch.distributed`` group without touching the file system.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional

import torch

VERSION = 1
_TENSORS = ("k", "v", "k_scale", "v_scale", "generator_state")


@dataclass
class KVSnapshot:
    model: str  # digest of the model config: a snapshot only fits the same model
    kv_cache_dtype: str  # the storage format of k / v ("float32", "int8", "fp8_e4m3", ...)
    request_id: object
    snapshot_id: str
    base_id: Optional[str]
    final: bool
    prompt: object  # (a first snapshot only)
    prompt_token_ids: List[int]  # (a first snapshot only)
    token_ids: List[int]  # prompt + generated at export time, from position tokens_from
    tokens_from: int
    params: Dict
    cache_salt: Optional[str]
    start: int  # first token whose K/V this snapshot holds
    end: int  # tokens with K/V in the source: [0, end)
    k: torch.Tensor
    v: torch.Tensor
    generator_state: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    logprobs: List = field(default_factory=list)  # [token_id, logprob, [[id, logprob], ...]] per token ...
    logprobs_from: int = 0  # ... from this generated token on
    prompt_logprobs: Optional[List] = None
    num_cached_tokens: int = 0
    version: int = VERSION

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def _tensors(self) -> Dict[str, torch.Tensor]:
        return {n: getattr(self, n).contiguous() for n in _TENSORS if getattr(self, n) is not None}

    def _meta(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _TENSORS}

    # -- files and bytes ---------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {n: t.cpu() for n, t in self._tensors().items()}
        meta = dict(self._meta(), tensors_sha256=_digest(save(tensors)))
        return save(tensors, metadata={"ringkv_snapshot": json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "snapshot") -> "KVSnapshot":
        from safetensors.torch import load

        try:
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + n])
            meta = json.loads(header["__metadata__"]["ringkv_snapshot"])
            tensors = load(data)
        except Exception as e:  # noqa: BLE001 - any damage is the same error to the caller
            raise ValueError(f"{what} is corrupt or not a ringkv KV snapshot: {type(e).__name__}: {e}") from None
        if meta.pop("tensors_sha256", None) != _digest(data):
            raise ValueError(f"{what} is corrupt: its tensors do not match their checksum")
        if meta.get("version") != VERSION:
            raise ValueError(f"{what} has snapshot format version {meta.get('version')}, this ringkv reads {VERSION}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in known},
                   **{n: tensors.get(n) for n in _TENSORS})

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str) -> "KVSnapshot":
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), f"snapshot file {path!r}")

    # -- processes -------------------------------------------------------------------------
    def send(self, dst: int, group=None, timeout=None) -> None:
        """To rank ``dst`` of ``group`` (default: the world), which calls ``KVSnapshot.recv``."""
        from ..parallel.transfer import send_bytes

        send_bytes(self.to_bytes(), dst, group, timeout)

    @classmethod
    def recv(cls, src: int, group=None, timeout=None) -> "KVSnapshot":
        from ..parallel.transfer import recv_bytes

        return cls.from_bytes(recv_bytes(src, group, timeout), f"snapshot from rank {src}")


def _digest(data: bytes) -> str:
    """SHA-256 of a safetensors buffer's data section (the same with or without metadata)."""
    (n,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(memoryview(data)[8 + n:]).hexdigest()


def model_digest(cfg) -> str:
    """The model a snapshot's K/V belong to (its architecture numbers, not its weights)."""
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("extra", "eos_token_id", "bos_token_id", "torch_dtype")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
