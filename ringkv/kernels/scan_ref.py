"""Torch references for the local pieces of three recurrent layers: the short causal convolution
(Mamba, Mamba2, LFM2), Mamba2's SSD scan (one decay per head) and Mamba's selective scan (one
decay per channel and state). Chunked, float32 inside (float64 when given), each able to start
from an initial state and to return its final state. No communication here.

SSD, per head (``a_t = dt_t A`` a scalar, state ``h`` ``(P, N)``)::

    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T          y_t = h_t C_t

Selective scan, per channel ``d`` (``a_t = dt_t A_d`` a vector over the state ``N``)::

    h_t = exp(a_t) * h_{t-1} + dt_t x_t B_t           y_t = <h_t, C_t>

Within a chunk of ``L`` tokens with inclusive cumulative log-decay ``G`` every exponent is
``G_l - G_s`` with ``s <= l`` (masked to ``-inf`` before the ``exp`` elsewhere) or ``G_l``
itself, never a positive ``-G``, so nothing overflows for ``A <= 0``. Between chunks the state
is carried in a short loop (one step per chunk); the selective scan's chunks (``(B, D, L, L, N)``
decays) are recomputed in the backward, so it keeps ``O(B D T)`` besides one state per chunk.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["causal_conv1d_ref", "ssd_scan_ref", "selective_scan_ref", "ACTIVATIONS"]

ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    halo: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Depthwise causal convolution: ``x`` ``(B, C, T)``, ``weight`` ``(C, K)``, ``bias``
    ``(C,)``, ``halo`` ``(B, C, K-1)`` the inputs just before ``x`` (zeros if None) -> ``(B, C,
    T)`` in ``x.dtype``. Computed in ``weight.dtype`` as transformers' ``causal_conv1d_fn``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    b, c, t = x.shape
    k = weight.shape[-1]
    if halo is None:
        halo = x.new_zeros(b, c, k - 1)
    xx = torch.cat([halo.to(x.dtype), x], -1).to(weight.dtype)  # (B, C, K-1+T)
    out = F.conv1d(xx, weight.unsqueeze(1), bias, groups=c)  # (B, C, T)
    if activation is not None:
        out = ACTIVATIONS[activation](out)
    return out.to(x.dtype)


def decay_matrix(a: torch.Tensor, dim: int) -> torch.Tensor:
    """``a`` log-decays with the chunk's positions along ``dim`` -> ``exp(sum_{s<j<=l} a_j)`` for
    ``s <= l`` and 0 above the diagonal, with ``(l, s)`` in place of ``dim`` (as dims ``dim,
    dim+1``)."""
    dim %= a.dim()
    g = a.cumsum(dim)
    gl, gs = g.unsqueeze(dim + 1), g.unsqueeze(dim)  # (.., L, 1, ..), (.., 1, L, ..)
    n = a.shape[dim]
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    keep = keep.reshape((n, n) + (1,) * (a.dim() - dim - 1))
    return torch.exp((gl - gs).masked_fill(~keep, float("-inf")))


def _chunked(t: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """Pad ``dim`` with zeros to a multiple of ``chunk`` and split it into ``(chunks, chunk)``."""
    pad = (-t.shape[dim]) % chunk
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim)
    return t.unflatten(dim, (-1, chunk))


def _carry_chunks(states, decays, initial):
    """Chunk states from zero ``(B, nc, *S)`` and chunk decays ``(B, nc, *S')`` (broadcasting
    against S) -> the state entering each chunk ``(B, nc, *S)`` and the final state."""
    h = torch.zeros_like(states[:, 0]) if initial is None else initial.to(states.dtype)
    entering = []
    for state, decay in zip(states.unbind(1), decays.unbind(1)):  # (one backward each)
        entering.append(h)
        h = decay * h + state
    return torch.stack(entering, 1), h


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD scan (no ``D`` skip): ``x`` ``(B, T, H, P)``, ``dt`` ``(B, T, H)`` already
    processed (bias, softplus, clamp), ``A`` ``(H,)``, ``B``/``C`` ``(B, T, H, N)`` (groups
    expanded), ``initial_state`` ``(B, H, P, N)`` -> ``y`` ``(B, T, H, P)`` and the final state
    ``(B, H, P, N)``, float32 (float64 when given)."""
    b, t, h, p = x.shape
    dt, x, B, C = _float(dt), _float(x), _float(B), _float(C)
    A = A.to(dt.dtype)
    xs = _chunked(x * dt[..., None], 1, chunk_size)  # (B, c, L, H, P)
    Bc, Cc = _chunked(B, 1, chunk_size), _chunked(C, 1, chunk_size)  # (B, c, L, H, N)
    a = _chunked(dt * A, 1, chunk_size)  # (B, c, L, H); zero past the end: no decay
    g = a.cumsum(2)  # (B, c, L, H)
    decay = decay_matrix(a, 2)  # (B, c, L, S, H)
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * decay
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xs)  # within each chunk, from zero
    to_end = torch.exp(g[:, :, -1:] - g)  # (B, c, L, H)
    states = torch.einsum("bclhn,bclh,bclhp->bchpn", Bc, to_end, xs)  # (B, c, H, P, N)
    entering, final = _carry_chunks(states, torch.exp(g[:, :, -1])[..., None, None], initial_state)
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, entering) * torch.exp(g)[..., None]
    return y.flatten(1, 2)[:, :t], final


def _maybe_checkpoint(fn, *args):
    """``fn(*args)``, recomputed in the backward instead of keeping its insides (when a gradient
    is wanted)."""
    if torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _selective_chunk(dt, x, B, C, A, h):
    """One chunk: ``dt`` ``(B, D, L)``, ``x`` ``(B, D, L)`` or None (no input), ``B``/``C``
    ``(B, N, L)``, ``A`` ``(D, N)``, the entering state ``h`` ``(B, D, N)`` -> ``y`` ``(B, D,
    L)`` and the state after the chunk."""
    g = dt.cumsum(-1)[..., None] * A[:, None]  # (B, D, L, N) log-decay from the chunk start
    states = torch.exp(g) * h[:, :, None]  # (B, D, L, N)
    if x is not None:
        a = dt[..., None] * A[:, None]  # (B, D, L, N)
        u = (dt * x)[..., None] * B.transpose(1, 2)[:, None]  # (B, D, L, N)
        states = states + torch.einsum("bdlsn,bdsn->bdln", decay_matrix(a, 2), u)
    return torch.einsum("bdln,bnl->bdl", states, C), states[:, :, -1]


def selective_scan_ref(
    x: Optional[torch.Tensor],
    dt: torch.Tensor,
    A: torch.Tensor,
    B: Optional[torch.Tensor],
    C: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    chunk_size: int = 16,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mamba's selective scan (no ``D`` skip, no ``z`` gate), channels first as mamba_ssm:
    ``x`` ``(B, D, T)``, ``dt`` ``(B, D, T)`` already processed (bias, softplus), ``A`` ``(D,
    N)``, ``B``/``C`` ``(B, N, T)``, ``initial_state`` ``(B, D, N)`` -> ``y`` ``(B, D, T)`` and
    the final state ``(B, D, N)``, float32 (float64 when given). ``x`` and ``B`` None: no input
    (what the initial state alone gives). One chunk at a time, each recomputed in the backward:
    memory ``(B, D, L, L, N)`` for one chunk, ``(B, D, N)`` per chunk kept."""
    dt, C = _float(dt), _float(C)
    x, B = (None if t is None else _float(t) for t in (x, B))
    A = A.to(dt.dtype)
    b, d, t = dt.shape
    h = dt.new_zeros(b, d, A.shape[1]) if initial_state is None else initial_state.to(dt.dtype)
    ys = []
    # each tensor split once (one backward for all its chunks), not sliced per chunk (each
    # slice's backward allocates a full-size zero gradient: quadratic in the chunks)
    n = -(-t // chunk_size)
    xs, bs = ([None] * n if v is None else v.split(chunk_size, -1) for v in (x, B))
    for dtc, xc, bc, cc in zip(dt.split(chunk_size, -1), xs, bs, C.split(chunk_size, -1)):
        y, h = _maybe_checkpoint(_selective_chunk, dtc, xc, bc, cc, A, h)
        ys.append(y)
    return torch.cat(ys, -1), h


def process_dt(dt: torch.Tensor, bias=None, softplus: bool = False, limit=None) -> torch.Tensor:
    """Raw ``dt`` -> ``softplus(dt + bias)`` clamped to ``limit``, in ``dt``'s dtype (the bias
    cast to it first, as transformers does)."""
    if bias is not None:
        dt = dt + bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    if limit is not None:
        dt = torch.clamp(dt, min=limit[0], max=limit[1])
    return dt
