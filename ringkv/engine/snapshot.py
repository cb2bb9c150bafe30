"""``KVSnapshot``: what another engine needs to continue a request exactly.

The request's tokens (prompt and generated), sampling parameters and sampler state (the
generator's state, so a seeded request continues with the same random stream), log-probs so
far, and the K/V of its computed tokens ``[start, end)``, token-major per K/V layer (a hybrid
model's attention layers, with ``state``: its recurrent layers' state after token ``end``):
``k``/``v`` ``(layers, T, Hkv, D)`` in the cache's storage dtype, with ``k_scale``/``v_scale``
``(layers, T, Hkv)`` for a quantized cache. Token-major K/V do not depend on the block size,
so the receiver may use another one. ``base_id`` names the snapshot this one extends: an
incremental snapshot holds only what is new since it (K/V of ``[start, end)``, tokens from
``tokens_from``, log-probs from ``logprobs_from``), so its size and the work to make and apply
it do not grow with the context. ``final`` is set when the source stopped the request: the
receiver runs it once it is imported.

Stored as safetensors (``save`` / ``load`` / ``to_bytes`` / ``from_bytes``; never pickled): the
tensors, and the rest as JSON in the metadata with a SHA-256 over the metadata (canonical
JSON), the tensors' names, dtypes and shapes, and their bytes, so a truncated, damaged or
edited file is refused. The checksum detects corruption and accidental edits, not deliberate
forgery (anyone can recompute it): ``import_request`` checks every field of a snapshot itself.
``send`` / ``recv`` move one over a ``torch.distributed`` group without touching the file system.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional

import torch

from ..cache.disk_tier import checksum
from ..model.loader import in_memory_names, model_tensors

VERSION = 2  # 2: the checksum covers the metadata too
_TENSORS = ("k", "v", "k_scale", "v_scale", "generator_state", "state")


@dataclass
class KVSnapshot:
    model: str  # model_digest of the exporting model (config and weights): a snapshot only fits it
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
    # a hybrid model: the recurrent state after token ``end`` (every layer, flat float32:
    # ``cache.state_pool.flatten``); None when nothing new was computed (or a dense model)
    state: Optional[torch.Tensor] = None
    logprobs: List = field(
        default_factory=list
    )  # [token_id, logprob, [[id, logprob], ...]] per token ...
    logprobs_from: int = 0  # ... from this generated token on
    prompt_logprobs: Optional[List] = None
    prompt_top_logprobs: Optional[List] = (
        None  # [[token id, log-prob] * k or None] per prompt position
    )
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
        meta = json.loads(json.dumps(self._meta()))  # as the reader will see it (tuples are lists)
        meta["sha256"] = checksum(meta, tensors, save(tensors))
        return save(tensors, metadata={"ringkv_snapshot": json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "snapshot") -> "KVSnapshot":
        from safetensors.torch import load

        try:
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + n])
            meta = json.loads(header["__metadata__"]["ringkv_snapshot"])
            tensors = load(data)
        except Exception as e:  # noqa: BLE001 - any damage is the same error to the caller
            raise ValueError(
                f"{what} is corrupt or not a ringkv KV snapshot: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            version = meta.get("version") if isinstance(meta, dict) else None
            raise ValueError(
                f"{what} has snapshot format version {version}, this ringkv reads {VERSION}; "
                f"export it again with this ringkv"
            )
        if meta.pop("sha256", None) != checksum(meta, tensors, data):
            raise ValueError(
                f"{what} is corrupt or edited: its contents do not match their checksum"
            )
        known = {f.name for f in fields(cls)}
        try:
            return cls(
                **{k: v for k, v in meta.items() if k in known},
                **{n: tensors.get(n) for n in _TENSORS},
            )
        except TypeError as e:  # a field missing
            raise ValueError(f"{what} is not a complete ringkv KV snapshot: {e}") from None

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


@dataclass
class PrefixKV:
    """A cached prompt prefix moving between engines (``LLM.export_prefix`` /
    ``import_prefix``; ``remote.send_prefix`` / ``recv_prefix``): its ``token_ids`` and
    ``cache_salt`` (the receiver hashes them itself, so the blocks land under the same salted
    chain) and their K/V token-major, ``k``/``v`` ``(layers, len(token_ids), Hkv, D)`` in the
    cache's storage dtype, ``k_scale``/``v_scale`` ``(layers, len(token_ids), Hkv)`` on a
    quantized cache; a hybrid model's ``state`` after the last token (flat float32, as in
    ``KVSnapshot``) and the ``state_dtype`` the exporter kept it in (its values are that
    dtype's: an engine keeping another refuses it, as a cold run there would differ). ``model``
    and ``kv_cache_dtype`` as in ``KVSnapshot``."""

    model: str
    kv_cache_dtype: str
    token_ids: List[int]
    cache_salt: Optional[str]
    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    state: Optional[torch.Tensor] = None  # a hybrid model: the state after the last token
    state_dtype: str = "float32"

    TENSORS = ("k", "v", "k_scale", "v_scale", "state")

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.k, self.v, self.k_scale, self.v_scale, self.state)
            if t is not None
        )


DIGEST_ROWS = 8  # rows sampled per weight tensor by model_digest


def model_digest(cfg, weights=None) -> str:
    """Which model a snapshot's K/V belong to: its architecture numbers and, given ``weights``
    (a ``StateDictSource`` or ``SafetensorsSource`` of the whole checkpoint), every tensor the
    model reads (sorted by name): its name, its shape and up to ``DIGEST_ROWS`` evenly spaced
    rows along dim 0 (a 1-D tensor whole), as float32. So another checkpoint of the same
    architecture (a fine-tune) gets another digest, while the same checkpoint gets the same
    one as a directory, an in-memory model or in another storage dtype that holds the same
    values, on every rank and mesh (it reads the checkpoint, not a rank's slice). Cheap: a few
    rows per tensor are read, never a whole file (SmolLM2-135M: under 0.1 s, 0.2 s the first
    time in a process)."""
    keep = {
        k: v
        for k, v in asdict(cfg).items()
        if k not in ("extra", "eos_token_id", "bos_token_id", "torch_dtype")
    }
    h = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode())
    if weights is not None:  # the model's names, however its checkpoint saves them
        weights = in_memory_names(cfg, weights)
    for name in sorted(model_tensors(cfg, weights)) if weights is not None else ():
        shape = tuple(weights.shape(name))
        h.update(json.dumps([name, shape]).encode())
        if len(shape) < 2:
            parts = [weights.get(name)]
        else:
            rows = (
                sorted({i * (shape[0] - 1) // (DIGEST_ROWS - 1) for i in range(DIGEST_ROWS)})
                if shape[0]
                else []
            )
            parts = [weights.get(name, 0, i, i + 1) for i in rows]
        for t in parts:
            h.update(
                t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()
            )
    return h.hexdigest()[:16]
