"""Torch references for the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) and KDA
(Kimi Delta Attention: Kimi Linear), chunked, float32 inside, with a state in and out.

Per head the state ``S`` is ``(D_k, D_v)``; token ``t`` updates it as

    S <- diag(exp(g_t)) S                          (GDN: one g per head; KDA: one per channel)
    S <- S + beta_t k_t (v_t - S^T k_t)^T          (the delta rule)
    o_t = S^T (scale q_t)

i.e. ``S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T`` (decay first,
then the delta update, as transformers' ``torch_chunk_gated_delta_rule`` and
``chunk_kimi_delta_attention``). ``scale`` defaults to ``D_k ** -0.5`` and multiplies q after
the optional l2-normalisation of q and k.

The chunked form (``chunk_delta_rule``): within a chunk of ``C`` tokens with cumulative log-decay
``G_i`` (from the chunk start, inclusive), the delta-rule corrections ``u`` solve the unit
lower-triangular system ``(I + A) u = beta (v - (Gamma k)^T S_0)`` with
``A_ij = beta_i k_i^T diag(exp(G_i - G_j)) k_j`` (j < i); the outputs read
``q_i^T diag(exp G_i) S_0`` plus ``sum_{j<=i} q_i^T diag(exp(G_i - G_j)) k_j u_j``. Every
exponent is ``G_i - G_j <= 0`` (j <= i) or ``G_last - G_j <= 0``, masked to ``-inf`` before the
``exp`` elsewhere, so nothing overflows for ``g <= 0`` (KDA's per-channel factors are formed per
chunk as ``(C, C, D_k)``, never as ``exp(G)`` and ``exp(-G)`` separately).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = ["gated_delta_ref", "kda_ref", "chunk_delta_rule", "prepare_gdn", "prepare_kda"]


def _l2norm_gdn(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)  # qwen3_next's l2norm


def _l2norm_kda(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)  # kimi_linear's l2norm


def _heads_first(*xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    # (B, T, H, ...) -> (B, H, T, ...) float32
    return tuple(x.transpose(1, 2).float().contiguous() for x in xs)


def prepare_gdn(q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """transformers' GDN preamble: q/k ``(B, T, H_k, D_k)`` repeated to ``H_v`` heads (each q/k
    head serves ``H_v // H_k`` consecutive v heads), l2-normalised if asked, q scaled. Returns
    float32 ``(B, H_v, T, ...)`` tensors ``q, k, v, g, beta`` for ``chunk_delta_rule``."""
    hk, hv = k.shape[2], v.shape[2]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    if hk != hv:  # after the float32 cast: the backward sums the repeated heads in float32
        q, k = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm_gdn(q), _l2norm_gdn(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def prepare_kda(q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    """transformers' KDA preamble (one head count for q, k, v, g, beta; g ``(B, T, H, D_k)``):
    float32 ``(B, H, T, ...)`` tensors, l2-normalised if asked, q scaled."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    if use_qk_l2norm:
        q, k = _l2norm_kda(q), _l2norm_kda(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _pairs(x: torch.Tensor, y: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """``x_i^T diag(exp(G_i - G_j)) y_j`` for ``j < i`` (``strict``) or ``j <= i``, else 0.

    x, y ``(..., C, D_k)``; G ``(..., C)`` (one decay per head) or ``(..., C, D_k)``
    (per channel) -> ``(..., C, C)``."""
    c = x.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool, device=x.device).triu(1 if not strict else 0)
    if G.dim() == x.dim() - 1:  # scalar decay: a (C, C) factor
        d = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        return (x @ y.transpose(-1, -2)) * d
    d = G.unsqueeze(-2) - G.unsqueeze(-3)  # (..., C, C, D_k): G_i - G_j
    d = d.masked_fill(upper.unsqueeze(-1), float("-inf")).exp()
    return (x.unsqueeze(-2) * y.unsqueeze(-3) * d).sum(-1)


def _col(G: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``exp(G)`` shaped to multiply ``x`` ``(..., C, D_k)`` row-wise (scalar or per channel)."""
    return G.exp().unsqueeze(-1) if G.dim() == x.dim() - 1 else G.exp()


def _chunk_step(S, qc, kc, vc, Gc, bc):
    """One chunk: state ``S`` ``(N, H, D_k, D_v)`` in, ``(o (N, H, C, D_v), S out)``."""
    c = kc.shape[-2]
    kb = kc * bc.unsqueeze(-1)  # beta_i k_i
    eye = torch.eye(c, dtype=kc.dtype, device=kc.device)
    system = eye + _pairs(kb, kc, Gc, strict=True)  # (N, H, C, C) unit lower triangular
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * _col(Gc, kc)], -1)  # (N, H, C, D_v + D_k)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    dv = vc.shape[-1]
    u = sol[..., :dv] - sol[..., dv:] @ S  # (N, H, C, D_v): the delta-rule corrections
    o = (qc * _col(Gc, qc)) @ S + _pairs(qc, kc, Gc, strict=False) @ u
    last = Gc[..., -1:, :] if Gc.dim() == kc.dim() else Gc[..., -1:]  # G at the chunk's end
    k_to_end = kc * _col(last - Gc, kc)
    decay = _col(last, kc).transpose(-1, -2)  # (N, H, D_k | 1, 1)
    return o, S * decay + k_to_end.transpose(-1, -2) @ u


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule on prepared float32 tensors (see ``prepare_gdn``/``prepare_kda``).

    q, k ``(N, H, T, D_k)`` (q already scaled); v ``(N, H, T, D_v)``; g ``(N, H, T)`` (GDN) or
    ``(N, H, T, D_k)`` (KDA), log-decays ``<= 0``; beta ``(N, H, T)``; initial_state
    ``(N, H, D_k, D_v)`` or None (zeros). Returns ``o (N, H, T, D_v)`` and the final state
    ``(N, H, D_k, D_v)``, float32, differentiable."""
    n, h, t, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(int(chunk_size), t))
    pad = -t % c
    if pad:  # zero tokens at the end: k = 0, beta = 0, g = 0 leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
        g = F.pad(g, (0, 0, 0, pad)) if g.dim() == 4 else F.pad(g, (0, pad))
    nc = (t + pad) // c
    q, k, v = (x.reshape(n, h, nc, c, x.shape[-1]) for x in (q, k, v))  # (N, H, nc, C, D)
    beta = beta.reshape(n, h, nc, c)
    G = (g.reshape(n, h, nc, c, dk) if g.dim() == 4 else g.reshape(n, h, nc, c)).cumsum(3)
    S = q.new_zeros(n, h, dk, dv) if initial_state is None else initial_state.float()
    # KDA's per-channel factors are (C, C, D_k) per chunk and head: recomputed in the backward
    # rather than kept for every chunk (that is C * D_k times the chunk's q in float32)
    recompute = G.dim() == 5 and torch.is_grad_enabled()
    outs = []
    # one unbind per tensor (its backward is one stack), not an index per chunk (each index's
    # backward writes a full-size gradient: quadratic in the chunks)
    for qc, kc, vc, Gc, bc in zip(*(x.unbind(2) for x in (q, k, v, G, beta))):
        args = (S, qc, kc, vc, Gc, bc)
        if recompute:
            o, S = torch.utils.checkpoint.checkpoint(_chunk_step, *args, use_reentrant=False)
        else:
            o, S = _chunk_step(*args)
        outs.append(o)
    o = torch.cat(outs, 2) if outs else v.new_zeros(n, h, 0, dv)  # (N, H, nc * C, D_v)
    return o[:, :, :t], S


def _finish(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return o.transpose(1, 2).contiguous().to(dtype)  # (B, H, T, D_v) -> (B, T, H, D_v)


def gated_delta_ref(
    q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64, use_qk_l2norm=False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule as transformers' ``torch_chunk_gated_delta_rule`` (qwen3_next).

    q, k ``(B, T, H_k, D_k)``; v ``(B, T, H_v, D_v)`` with ``H_v % H_k == 0``; g, beta
    ``(B, T, H_v)``; initial_state ``(B, H_v, D_k, D_v)`` or None. Returns
    ``o (B, T, H_v, D_v)`` in q's dtype and the final state ``(B, H_v, D_k, D_v)`` float32."""
    qf, kf, vf, gf, bf = prepare_gdn(q, k, v, g, beta, scale, use_qk_l2norm)
    o, final = chunk_delta_rule(qf, kf, vf, gf, bf, initial_state, chunk_size)
    return _finish(o, q.dtype), final


def kda_ref(
    q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64, use_qk_l2norm=False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA as transformers' ``chunk_kimi_delta_attention`` (kimi_linear): per-channel decay.

    q, k, g ``(B, T, H, D_k)``; v ``(B, T, H, D_v)``; beta ``(B, T, H)``; initial_state
    ``(B, H, D_k, D_v)`` or None. Returns ``o (B, T, H, D_v)`` in q's dtype and the final
    state ``(B, H, D_k, D_v)`` float32."""
    qf, kf, vf, gf, bf = prepare_kda(q, k, v, g, beta, scale, use_qk_l2norm)
    o, final = chunk_delta_rule(qf, kf, vf, gf, bf, initial_state, chunk_size)
    return _finish(o, q.dtype), final
