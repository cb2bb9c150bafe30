"""Quantized KV storage: one byte per element and one fp16 scale per (token, KV head).

Formats (``kv_cache_dtype``) and the choices behind them (measured on SmolLM2-135M with
fake quantization of every K/V, 1024 tokens of ``benchmarks/data/kv_quant_text.txt``;
perplexity deltas to the fp32 cache):

- every format rotates each head's vector by a fixed orthogonal matrix first (a normalised
  Hadamard matrix when ``D`` is a power of two, else a seeded random orthogonal one), except
  ``fp8_e5m2``. The rotation spreads a few large channels over all of them, so one scale per
  (token, head) serves every channel;
- ``"int8"``: symmetric, ``q = round(x / s)``, ``s = max|x| / 127`` (+0.068% without the
  rotation, +0.004% with it);
- ``"fp8_e4m3"`` (``"fp8"``): ``s = m x max|x| / 448`` with ``m`` the one of 11 multipliers in
  [0.7, 1] that minimises the vector's squared error (fp8's grid is logarithmic, so a smaller
  scale can fit the vector better at the price of clipping its largest value): +0.549% with
  ``m = 1``, +0.245% with the search;
- ``"fp8_e5m2"``: ``s = max|x| / 57344``, not rotated (+1.4% plain, +2.2% rotated, on an earlier
  750-token version of the text).

Attention never undoes the rotation on the keys: with ``R`` orthogonal,
``(q R) . (k R) = q . k`` and ``sum_j p_j v_j = (sum_j p_j v_j R) R^T``, so readers rotate
the queries and un-rotate the output (cost per query, not per cached key).

Scales are fp16, clamped to its range: values beyond ``65504 x qmax`` saturate, zeros and
tiny values quantize to (near) zero; nothing becomes NaN or inf. Bytes per token and head:
``D + 2`` for K and for V (SmolLM2, ``D = 64``: 0.258x of fp32, 0.516x of bf16).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(frozen=True)
class QuantFormat:
    name: str
    dtype: torch.dtype  # storage
    qmax: float  # largest representable magnitude
    rotate: bool
    scales: Tuple[float, ...] = (1.0,)  # candidate multipliers of max|x| / qmax; the best fit wins


def _formats():
    out = {"int8": QuantFormat("int8", torch.int8, 127.0, True)}
    if hasattr(torch, "float8_e4m3fn"):
        search = tuple(1.0 - 0.03 * i for i in range(11))
        out["fp8_e4m3"] = QuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, True, search)
        out["fp8_e5m2"] = QuantFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, False)
    return out


FORMATS = _formats()
SUPPORTED = ("auto", "fp8", *FORMATS)
SCALE_DTYPE = torch.float16
_TINY, _HUGE = 2.0**-24, 65504.0  # fp16 range for scales


def resolve(kv_cache_dtype) -> Optional[QuantFormat]:
    """None for ``"auto"`` (the model's dtype); a ``QuantFormat``; else ``ValueError``."""
    if kv_cache_dtype in (None, "auto"):
        return None
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if not isinstance(name, str) or name not in FORMATS:
        have = ", ".join(repr(s) for s in SUPPORTED if s == "auto" or ALIASES.get(s, s) in FORMATS)
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; choose one of {have}")
    return FORMATS[name]


def rotation(d: int, device=None) -> torch.Tensor:
    """A fixed ``(D, D)`` orthogonal matrix, the same in every process: normalised Hadamard for
    powers of two, else the Q of a QR of a seeded Gaussian matrix."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / math.sqrt(d)).to(device)
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return (q * torch.sign(torch.diagonal(r))).float().to(device)


def quantize(x: torch.Tensor, fmt: QuantFormat, rot: Optional[torch.Tensor] = None):
    """``x (..., D)`` -> ``(q (..., D) in fmt.dtype, scale (...) fp16)``; ``rot``: the rotation
    (applied first when the format rotates)."""
    x = x.float()
    if fmt.rotate:
        x = x @ rot
    amax = x.abs().amax(dim=-1)
    best = None
    for m in fmt.scales:
        scale = _fp16_at_least((m * amax / fmt.qmax).clamp(_TINY, _HUGE))  # (...,)
        y = (x / scale.float()[..., None]).clamp(-fmt.qmax, fmt.qmax)
        q = y.round().to(fmt.dtype) if fmt.dtype == torch.int8 else y.to(fmt.dtype)
        if len(fmt.scales) == 1:
            return q, scale
        err = (dequantize(q, scale) - x).square().sum(dim=-1)  # (...,)
        if best is None:
            best = [q, scale, err]
            continue
        better = err < best[2]
        best[0] = torch.where(
            better[..., None], q.view(torch.uint8), best[0].view(torch.uint8)
        ).view(fmt.dtype)
        best[1] = torch.where(better, scale, best[1])
        best[2] = torch.minimum(err, best[2])
    return best[0], best[1]


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp16, rounded up: ``max|x| / scale`` never exceeds ``qmax`` (no clipping at m =
    1)."""
    s = x.to(SCALE_DTYPE)
    up = torch.nextafter(s, torch.full_like(s, _HUGE))
    return torch.where(s.float() < x, up, s)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Rotated-space values ``(..., D)`` (``rot`` is not undone: see the module docstring)."""
    if q.dtype != torch.int8 and q.device.type == "cpu":  # fp8 -> float through a 256-entry table:
        lut = byte_values(q.dtype)  # about 2x faster than torch's conversion on CPU
        x = lut.index_select(0, q.reshape(-1).view(torch.uint8).int()).view(q.shape)
    else:
        x = q.float()
    return (x * scale.float()[..., None]).to(dtype)


@functools.lru_cache(maxsize=None)
def byte_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 ``(256,)``: the value of each byte read as the 1-byte float ``dtype`` (CPU; cached,
    ``byte_values.cache_clear()`` forgets)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def bytes_per_head(fmt: Optional[QuantFormat], head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one head: its values, and its scale when quantized."""
    if fmt is None:
        return head_dim * torch.finfo(dtype).bits // 8
    return head_dim + torch.finfo(SCALE_DTYPE).bits // 8


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as bytes: copies and gathers work for them on every device."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.dtype != torch.int8 else x
