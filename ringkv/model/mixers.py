"""The recurrent mixers of hybrid decoders: LFM2's gated short convolution, Mamba2 (Bamba,
Nemotron-H, Granite 4 hybrid; Falcon-H1's with its muP multipliers) and the gated DeltaNet
(Qwen3.5; Qwen3-Next's with fused projections). No parallel code; the math is ``ringkv.kernels``'
references (``causal_conv1d_ref``, ``ssd_scan_ref``, ``gated_delta_ref``).

Each mixer splits its work in two. The per-token parts (projections, gates, norms) run on all
``T`` flattened tokens of a step at once; the sequential part, ``scan``, is handed to the context::

    y = ctx.recur(self.layer_idx, self.scan, u, self.state_shapes)   # u (T, F) -> y (T, F')

``scan(u_b, states, ops) -> (y_b, new_states)`` runs ``B`` sequences' pieces of equal length
``L`` (``u_b (B, L, F)``) from their states (float32 ``(B, *shape)`` for each of
``state_shapes``; zeros at a sequence's start) and returns the output ``(B, L, F')`` (in ``u``'s
dtype) and the states after each piece's last token. Running a sequence in pieces with the state
carried equals running it whole, up to rounding. The convolution's state is its last ``K - 1``
inputs; the scans' is their recurrent state. ``state_shapes`` is read from the module's own
sizes, so a module whose heads are cut (tensor parallelism) reports its own.

A ``scan`` only names its model's structure; its sequential cores (``ops.conv``, ``ops.ssd``,
``ops.delta``) come from ``ops``: ``Reference`` (one device, the default) or the context's
sequence-parallel ops (``parallel.spread``), whose states are its own; a ``scan`` passes them
through untouched.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.delta_ref import gated_delta_ref
from ..kernels.scan_ref import causal_conv1d_ref, process_dt, ssd_scan_ref
from .config import ModelConfig

States = List[torch.Tensor]


def conv_scan(
    conv: nn.Conv1d, u: torch.Tensor, state: torch.Tensor, activation: Optional[str]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of a piece: ``u (B, L, C)`` after the inputs ``state
    (B, C, K-1)`` -> ``(B, L, C)`` in ``u``'s dtype and the new state, the last ``K - 1`` inputs
    (float32)."""
    x = u.transpose(1, 2)  # (B, C, L)
    y = causal_conv1d_ref(x, conv.weight.squeeze(1), conv.bias, activation, halo=state)
    seen = torch.cat([state.to(x.dtype), x], -1)  # (B, C, K-1+L)
    return y.transpose(1, 2), seen[..., seen.shape[-1] - state.shape[-1] :].float()


class Reference:
    """The sequential cores on one device (``ringkv.kernels``' references): a ``scan``'s default
    ``ops``. States are float32 ``(B, *shape)``."""

    @staticmethod
    def conv(conv: nn.Conv1d, u, state, activation):
        """``u (B, L, C)`` after the inputs ``state (B, C, K-1)`` -> ``(B, L, C)``, new state."""
        return conv_scan(conv, u, state, activation)

    @staticmethod
    def ssd(x, dt, A, B, C, *, D, dt_bias, dt_limit, chunk_size, state):
        """Mamba2's scan with the ``D`` skip: ``x (B, L, H, P)``, raw ``dt (B, L, H)``, ``A
        (H,)``, ``B``/``C (B, L, G, N)`` -> ``y (B, L, H, P)`` float32, state ``(B, H, P, N)``."""
        h = x.shape[2]
        B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
        dt = process_dt(dt, dt_bias, softplus=True, limit=dt_limit)  # (B, L, H)
        # any chunk gives the same result (up to rounding): L=1 (decode) is one recurrence step
        chunk = min(chunk_size, x.shape[1])
        y, ssm = ssd_scan_ref(x, dt, A, B, C, chunk, initial_state=state)  # (B, L, H, P)
        return y + D[:, None].float() * x.float(), ssm.float()

    @staticmethod
    def delta(q, k, v, g, beta, *, chunk_size, state):
        """The gated delta rule, q and k l2-normed: ``q``/``k (B, L, Hk, Dk)``, ``v (B, L, Hv,
        Dv)``, ``g``/``beta (B, L, Hv)`` -> ``o (B, L, Hv, Dv)``, state ``(B, Hv, Dk, Dv)``."""
        return gated_delta_ref(q, k, v, g, beta, None, state, chunk_size, use_qk_l2norm=True)


REFERENCE = Reference()


def _conv1d(channels: int, kernel: int, bias: bool) -> nn.Conv1d:
    # HF's depthwise convolution (its padding is not used: the references pad with the state)
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias, padding=kernel - 1)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate. Mamba2 (``norm_before_gate=False``): gated first, then normed in
    ``groups`` groups of channels; Qwen3.5's DeltaNet: normed, weighted, then gated."""

    def __init__(self, dim: int, eps: float, groups: int = 1, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.groups, self.norm_before_gate = eps, groups, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate (..., dim) -> (..., dim) in x's dtype; statistics in float32 as transformers
        dtype, xf = x.dtype, x.float()
        if not self.norm_before_gate:
            xf = xf * F.silu(gate.float())
        g = xf.unflatten(-1, (self.groups, -1))  # (..., groups, dim / groups)
        xf = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        out = self.weight * xf.to(dtype)
        if self.norm_before_gate:
            out = out * F.silu(gate.float())
        return out.to(dtype)


class ShortConv(nn.Module):
    """LFM2's mixer: ``in_proj`` to ``(B, C, x)``, ``y = C * conv(B * x)``, ``out_proj``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        rc, h = cfg.recurrent, cfg.hidden_size
        self.layer_idx, self.activation = layer_idx, rc.activation
        self.conv = _conv1d(h, rc.conv_kernel, rc.conv_bias)
        self.in_proj = nn.Linear(h, 3 * h, bias=rc.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=rc.conv_bias)

    @property
    def state_shapes(self) -> List[tuple]:
        c, _, k = self.conv.weight.shape
        return [(c, k - 1)]

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        # x (T, hidden) -> (T, hidden)
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)  # (T, hidden) each
        y = ctx.recur(self.layer_idx, self.scan, b * xx, self.state_shapes)  # (T, hidden)
        return self.out_proj(c * y)

    def scan(self, u: torch.Tensor, states: States, ops=REFERENCE) -> Tuple[torch.Tensor, States]:
        """``u (B, L, hidden)`` -> the convolution ``(B, L, hidden)``, ``[conv state]``."""
        y, conv_state = ops.conv(self.conv, u, states[0], self.activation)
        return y, [conv_state]


class Mamba2Mixer(nn.Module):
    """Mamba2 (SSD) as Bamba's and Nemotron-H's mixers: ``in_proj`` to the gate, the convolved
    ``(x, B, C)`` and ``dt``; the scan with the ``D`` skip; the gated norm (or, without one,
    ``y * silu(gate)``: ``RecurrentConfig.gated_norm``); ``out_proj``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        rc = cfg.recurrent
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = rc.heads, rc.head_dim
        self.n_groups, self.ssm_state_size = rc.groups, rc.state
        self.chunk_size, self.dt_limit, self.activation = rc.chunk_size, rc.dt_limit, rc.activation
        self.intermediate_size = inter = rc.heads * rc.head_dim
        self.conv_dim = inter + 2 * rc.groups * rc.state
        self.conv1d = _conv1d(self.conv_dim, rc.conv_kernel, rc.conv_bias)
        self.in_proj = nn.Linear(
            cfg.hidden_size, inter + self.conv_dim + rc.heads, bias=rc.proj_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(rc.heads))
        self.A_log = nn.Parameter(torch.zeros(rc.heads))
        self.D = nn.Parameter(torch.ones(rc.heads))
        self.norm = (
            GatedRMSNorm(inter, rc.norm_eps, groups=rc.groups, norm_before_gate=rc.norm_before_gate)
            if rc.gated_norm
            else None
        )
        out_bias = rc.proj_bias if rc.out_bias is None else rc.out_bias
        self.out_proj = nn.Linear(inter, cfg.hidden_size, bias=out_bias)

    @property
    def state_shapes(self) -> List[tuple]:
        k = self.conv1d.weight.shape[-1]
        return [(self.conv_dim, k - 1), (self.num_heads, self.head_dim, self.ssm_state_size)]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``in_proj``'s output ``(T, I + conv_dim + H)``: gate, x, B, C,
        dt."""
        return self.in_proj(x)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        # x (T, hidden) -> (T, hidden)
        gate, xbc_dt = self.project(x).split(
            [self.intermediate_size, self.conv_dim + self.num_heads], dim=-1
        )
        y = ctx.recur(self.layer_idx, self.scan, xbc_dt, self.state_shapes)  # (T, I)
        y = y * F.silu(gate) if self.norm is None else self.norm(y, gate)
        return self.out_proj(y)

    def scan(self, u: torch.Tensor, states: States, ops=REFERENCE) -> Tuple[torch.Tensor, States]:
        """``u (B, L, conv_dim + H)``: the convolution's inputs and raw ``dt`` -> the scan's
        output with the ``D`` skip ``(B, L, I)``, ``[conv state, SSM state (B, H, P, N)]``."""
        b, n = u.shape[0], u.shape[1]
        h, p, g, s = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
        xbc, dt = u.split([self.conv_dim, h], dim=-1)
        xbc, conv_state = ops.conv(self.conv1d, xbc, states[0], self.activation)
        x, B, C = xbc.split([self.intermediate_size, g * s, g * s], dim=-1)
        x = x.reshape(b, n, h, p)
        B, C = (t.reshape(b, n, g, s) for t in (B, C))
        A = -torch.exp(self.A_log.float())
        y, ssm = ops.ssd(
            x,
            dt,
            A,
            B,
            C,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_limit=self.dt_limit,
            chunk_size=self.chunk_size,
            state=states[1],
        )  # (B, L, H, P)
        return y.reshape(b, n, h * p).to(u.dtype), [conv_state, ssm]


class FalconMamba2Mixer(Mamba2Mixer):
    """Falcon-H1's Mamba2: the input times ``ssm_in``, ``in_proj``'s output times a multiplier per
    part (``MupConfig.ssm``: z, x, B, C, dt; transformers' ``mup_vector``), built from the
    module's own sizes so a tensor-parallel cut keeps each part's multiplier."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.ssm_in_multiplier, self.ssm_multipliers = cfg.mup.ssm_in, tuple(cfg.mup.ssm)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if self.ssm_in_multiplier != 1.0:
            x = x * self.ssm_in_multiplier
        u = self.in_proj(x)
        if all(m == 1.0 for m in self.ssm_multipliers):
            return u
        i, bc = self.intermediate_size, self.n_groups * self.ssm_state_size
        sizes = (i, i, bc, bc, self.num_heads)
        mup = torch.cat(
            [
                torch.full((n,), m, dtype=torch.float32, device=u.device)
                for n, m in zip(sizes, self.ssm_multipliers)
            ]
        )  # float32, then u's dtype: as transformers' buffer in a model of that dtype
        return u * mup.to(u.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's gated DeltaNet: the convolved ``(q, k, v)``, ``beta = sigmoid(b)``, the decay
    ``g = -exp(A_log) softplus(a + dt_bias)``, the delta rule (q, k l2-normed), a norm gated by
    ``z``, ``out_proj``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        rc, hidden = cfg.recurrent, cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_v_heads, self.num_k_heads = rc.heads, rc.k_heads
        self.head_v_dim, self.head_k_dim = rc.head_dim, rc.k_head_dim
        self.key_dim, self.value_dim = rc.k_heads * rc.k_head_dim, rc.heads * rc.head_dim
        self.chunk_size, self.activation = rc.chunk_size, rc.activation
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = _conv1d(self.conv_dim, rc.conv_kernel, False)
        self.dt_bias = nn.Parameter(torch.ones(rc.heads))
        self.A_log = nn.Parameter(torch.zeros(rc.heads))
        self.norm = GatedRMSNorm(rc.head_dim, rc.norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.new_projections(hidden)

    def new_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x (T, hidden)`` -> ``u (T, conv_dim + 2 Hv)`` (q, k, v, b, a), ``z (T, Hv * Dv)``."""
        u = torch.cat([self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x)], -1)
        return u, self.in_proj_z(x)

    @property
    def state_shapes(self) -> List[tuple]:
        k = self.conv1d.weight.shape[-1]
        return [(self.conv_dim, k - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)]

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        # x (T, hidden) -> (T, hidden)
        t = x.shape[0]
        u, z = self.project(x)
        y = ctx.recur(self.layer_idx, self.scan, u, self.state_shapes)  # (T, Hv * Dv)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        y = self.norm(y.view(t, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(y.reshape(t, self.value_dim))

    def scan(self, u: torch.Tensor, states: States, ops=REFERENCE) -> Tuple[torch.Tensor, States]:
        """``u (B, L, conv_dim + 2 Hv)``: the convolution's inputs, raw ``b`` and ``a`` -> the
        delta rule's output ``(B, L, Hv * Dv)``, ``[conv state, state (B, Hv, Dk, Dv)]``."""
        bsz, n = u.shape[0], u.shape[1]
        hv = self.num_v_heads
        qkv, b, a = u.split([self.conv_dim, hv, hv], dim=-1)
        qkv, conv_state = ops.conv(self.conv1d, qkv, states[0], self.activation)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.reshape(bsz, n, self.num_k_heads, self.head_k_dim) for t in (q, k))
        v = v.reshape(bsz, n, hv, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, L, Hv)
        o, state = ops.delta(q, k, v, g, beta, chunk_size=self.chunk_size, state=states[1])
        return o.reshape(bsz, n, self.value_dim).to(u.dtype), [conv_state, state]


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's gated DeltaNet: Qwen3.5's, with q, k, v, z fused in ``in_proj_qkvz`` and b, a
    in ``in_proj_ba``, each grouped by key head (a key head's q, k, then its value heads' v, z)."""

    def new_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * (self.key_dim + self.value_dim), bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        t, hk, dk = x.shape[0], self.num_k_heads, self.head_k_dim
        per = self.num_v_heads // hk * self.head_v_dim  # a key head's value channels
        qkvz = self.in_proj_qkvz(x).view(t, hk, -1)  # (T, Hk, 2 Dk + 2 per)
        q, k, v, z = qkvz.split([dk, dk, per, per], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, -1).chunk(2, dim=-1)  # (T, Hk, Hv / Hk) each
        u = torch.cat([y.reshape(t, -1) for y in (q, k, v, b, a)], -1)
        return u, z.reshape(t, self.value_dim)
