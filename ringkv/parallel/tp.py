"""Tensor parallelism applied to a ``LlamaForCausalLM`` from outside (the model file stays a
single-device model): attention split by heads, the MLP by its hidden units, the embedding
and LM head by vocabulary rows.

- q/k/v and gate/up are column-parallel: a plain ``nn.Linear`` holding this rank's output
  rows; no communication.
- o_proj and down_proj are row-parallel (``RowParallelLinear``): this rank's input columns,
  one all-reduce, then the bias.
- KV heads: ``Hkv / tp`` per rank; when ``tp > Hkv`` (and ``tp % Hkv == 0``) each rank holds
  the one KV head its query heads read (replicated on ``tp / Hkv`` ranks).
- ``VocabParallelEmbedding`` looks up this rank's vocabulary rows and all-reduces; the LM
  head is an ``nn.Linear`` over the same rows (tied weights stay tied) and the driver-side
  gather (``gather_vocab``) assembles full logits where sampling happens.

Hybrid models (``model.hybrid``) split the same way, and their recurrent mixers by heads; each
rank keeps the state of its own heads (``state_shapes`` follow the cut module):

- LFM2's short convolution: by channels (``in_proj``'s B, C and x parts, the convolution),
  ``out_proj`` row-parallel.
- Mamba2: by SSD heads (gate, x and ``dt`` rows, ``A_log``/``D``/``dt_bias``, the conv channels
  of x); B and C by group when ``tp`` divides the groups, else each rank holds (and convolves) the
  one group its heads read. The gated norm is per group: local when the groups are split, else
  its statistics are summed over the ranks that share a group (``SharedGroupGatedNorm``).
  Falcon-H1's Mamba2 the same (its per-part muP multipliers follow, read off the cut module's
  sizes; without a gated norm, ``y * silu(gate)`` is per channel), its attention beside it as any
  attention (the key multiplier is in the attention scale, the other multipliers are scalars).
- Gated DeltaNet: by key heads with their value heads (q/k rows per key head, v/z/b/a per value
  head; Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head, so a
  rank's part is one range); the norm (per head dim) stays whole.
- MLPs of every family by hidden units; MoE experts each by their hidden units (the router
  replicated) with one all-reduce for the whole block (a forward hook on it).

A rank's part of a fused tensor may be several ranges of a dim (``(dim, ((start, stop), ...))``,
read and concatenated by ``materialize``). ``state_ranges`` says which rows of each full state
tensor a rank holds (for moving a request's state between engines of any tp).

``apply_tp`` works on a model built on the meta device and returns, per parameter, the
slice of the checkpoint tensor it holds, for ``model.loader.materialize``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..model.config import ModelConfig
from ..model.hybrid import (
    GraniteMoE,
    GraniteSharedMLP,
    HybridLayer,
    Lfm2MLP,
    Relu2MLP,
    SparseMoE,
)
from ..model.mixers import (
    FusedGatedDeltaNet,
    GatedDeltaNet,
    GatedRMSNorm,
    Mamba2Mixer,
    ShortConv,
)
from ..sp.collectives import all_gather, all_reduce_


def split(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``range(n)`` cut into ``parts`` nearly equal pieces (sizes differ by <= 1)."""
    return range(i * n // parts, (i + 1) * n // parts)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """``ValueError`` naming the fix when the model cannot be split over ``tp`` ranks."""
    h, hkv = cfg.num_heads, cfg.num_kv_heads
    ok = [d for d in range(1, h + 1) if h % d == 0 and (hkv % d == 0 if d <= hkv else d % hkv == 0)]
    if h % tp:
        raise ValueError(f"tp={tp} does not divide the model's {h} attention heads; use tp in {ok}")
    if hkv % tp if tp <= hkv else tp % hkv:
        raise ValueError(
            f"tp={tp} cannot split the model's {hkv} KV heads (need kv_heads % tp == 0, or "
            f"tp % kv_heads == 0 to replicate them); use tp in {ok}"
        )
    if cfg.vocab_size < tp or cfg.intermediate_size < tp:
        raise ValueError(
            f"tp={tp} exceeds the vocabulary ({cfg.vocab_size}) or MLP width "
            f"({cfg.intermediate_size}); use tp in {ok}"
        )
    moe = cfg.moe
    if moe is not None and min(moe.intermediate_size, moe.shared_intermediate_size or tp) < tp:
        raise ValueError(
            f"tp={tp} exceeds the MoE experts' width ({moe.intermediate_size}) or the shared "
            f"expert's ({moe.shared_intermediate_size})"
        )
    _check_recurrent(cfg, tp)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_recurrent(cfg: ModelConfig, tp: int) -> None:
    """A hybrid's recurrent layers: ``ValueError`` naming the first layer ``tp`` cannot split."""
    rc = cfg.recurrent
    for i in range(cfg.num_layers):
        kind = cfg.recurrent_kind(i)
        if kind == "mamba2":
            h, g = rc.heads, rc.groups
            ok = [d for d in _divisors(h) if g % d == 0 or d % g == 0]
            if h % tp or not (g % tp == 0 or tp % g == 0):
                raise ValueError(
                    f"tp={tp} cannot split layer {i} (mamba2): its {h} SSD heads must divide by "
                    f"tp, and its {g} B/C groups too (or tp by them, to replicate a group); use "
                    f"tp in {ok}"
                )
        elif kind == "gdn" and rc.k_heads % tp:
            raise ValueError(
                f"tp={tp} cannot split layer {i} (gdn): it does not divide its {rc.k_heads} "
                f"key heads (each rank keeps its key heads' {rc.heads // rc.k_heads} value heads "
                f"each); use tp in {_divisors(rc.k_heads)}"
            )
        elif kind == "conv" and cfg.hidden_size < tp:
            raise ValueError(
                f"tp={tp} cannot split layer {i} (conv): more ranks than its "
                f"{cfg.hidden_size} channels"
            )


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    return max(1, cfg.num_kv_heads // tp)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: ``x`` holds this rank's input features."""

    def __init__(
        self, in_local: int, out_features: int, bias: bool, group, timeout: Optional[timedelta]
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group, self.timeout = group, timeout

    def forward(self, x):
        y = all_reduce_(
            F.linear(x, self.weight), self.group, self.timeout, "tensor-parallel all-reduce"
        )
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab`` of the embedding; tokens outside them contribute zeros to the all-reduce."""

    def __init__(self, vocab: range, dim: int, group, timeout: Optional[timedelta]):
        super().__init__()
        self.vocab, self.group, self.timeout = vocab, group, timeout
        self.weight = nn.Parameter(torch.empty(len(vocab), dim))

    def forward(self, ids):
        # ids (T,) -> (T, dim)
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        x = F.embedding((ids - self.vocab.start).clamp(0, len(self.vocab) - 1), self.weight)
        x = x * mine[:, None].to(x.dtype)
        return all_reduce_(x, self.group, self.timeout, "vocab-parallel embedding")


class SharedGroupGatedNorm(nn.Module):
    """Mamba2's gated norm (gated first, then normed per group; ``norm_before_gate``: normed,
    weighted, then gated, as Falcon-H1's may be) on a rank whose heads are part of one norm group
    (``group`` of ``groups``, ``width`` channels) that other ranks share: each rank's sum of
    squares goes in its group's column and the columns are summed over the TP group."""

    def __init__(
        self,
        dim: int,
        eps: float,
        group: int,
        groups: int,
        width: int,
        pg,
        timeout,
        norm_before_gate: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.group, self.groups, self.width = eps, group, groups, width
        self.pg, self.timeout, self.norm_before_gate = pg, timeout, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate (..., dim) -> (..., dim) in x's dtype; statistics in float32
        dtype, xf = x.dtype, x.float()
        if not self.norm_before_gate:
            xf = xf * F.silu(gate.float())
        sums = xf.new_zeros(*xf.shape[:-1], self.groups)
        sums[..., self.group] = xf.pow(2).sum(-1)
        sums = all_reduce_(sums, self.pg, self.timeout, "tensor-parallel gated norm")
        var = sums[..., self.group, None] / self.width
        out = self.weight * (xf * torch.rsqrt(var + self.eps)).to(dtype)
        if self.norm_before_gate:
            out = out * F.silu(gate.float())
        return out.to(dtype)


def _shift(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _scale(r: range, by: int) -> range:
    return range(r.start * by, r.stop * by)


def _take(dim: int, ranges: Sequence[range]) -> tuple:
    """``materialize``'s slice of ``dim`` for ``ranges`` (one, or several concatenated)."""
    rs = [r for r in ranges if len(r)]
    if len(rs) == 1:
        return (dim, rs[0].start, rs[0].stop)
    return (dim, tuple((r.start, r.stop) for r in rs))


def _conv_parts(cfg: ModelConfig, tp: int, rank: int) -> dict:
    """LFM2's short convolution: rank's channels, its rows of ``in_proj`` (B, C, x)."""
    h = cfg.hidden_size
    ch = split(h, tp, rank)
    return dict(channels=ch, conv=[ch], in_rows=[ch, _shift(ch, h), _shift(ch, 2 * h)])


def _mamba2_parts(cfg: ModelConfig, tp: int, rank: int) -> dict:
    """Mamba2: rank's heads and B/C groups, its channels of x (``x``), conv channels (x, B, C)
    and rows of ``in_proj`` (gate, x, B, C, dt)."""
    rc = cfg.recurrent
    h, p, g, n = rc.heads, rc.head_dim, rc.groups, rc.state
    inner, gs = h * p, g * n
    heads = split(h, tp, rank)
    if g % tp == 0:
        groups = split(g, tp, rank)
    else:  # tp % g == 0: the one group this rank's heads read, replicated
        first = heads.start // (h // g)
        groups = range(first, first + 1)
    x, bc = _scale(heads, p), _scale(groups, n)
    conv = [x, _shift(bc, inner), _shift(bc, inner + gs)]
    rows = [x, _shift(x, inner), _shift(bc, 2 * inner), _shift(bc, 2 * inner + gs)]
    return dict(
        heads=heads,
        groups=groups,
        x=x,
        conv=conv,
        in_rows=rows + [_shift(heads, 2 * inner + 2 * gs)],
    )


def _gdn_parts(cfg: ModelConfig, tp: int, rank: int) -> dict:
    """Gated DeltaNet: rank's key heads, value heads, value channels (``v``) and conv channels
    (q, k, v)."""
    rc = cfg.recurrent
    kh, vh = split(rc.k_heads, tp, rank), split(rc.heads, tp, rank)
    q, v, kd = _scale(kh, rc.k_head_dim), _scale(vh, rc.head_dim), rc.k_heads * rc.k_head_dim
    return dict(k_heads=kh, v_heads=vh, v=v, conv=[q, _shift(q, kd), _shift(v, 2 * kd)])


def state_ranges(cfg: ModelConfig, tp: int, rank: int) -> Dict[int, List[List[range]]]:
    """Recurrent layer -> for each of its state tensors (``state_shapes``' order), the ranges of
    the full tensor's dim 0 that TP rank ``rank`` holds, in its order (conv states: channels;
    SSM / delta states: heads). A replicated Mamba2 group is held by each of its ranks."""
    out = {}
    for i in range(cfg.num_layers):
        kind = cfg.recurrent_kind(i)
        if kind == "conv":
            out[i] = [_conv_parts(cfg, tp, rank)["conv"]]
        elif kind == "mamba2":
            pr = _mamba2_parts(cfg, tp, rank)
            out[i] = [pr["conv"], [pr["heads"]]]
        elif kind == "gdn":
            pr = _gdn_parts(cfg, tp, rank)
            out[i] = [pr["conv"], [pr["v_heads"]]]
    return out


def apply_tp(
    model, cfg: ModelConfig, rank: int, tp: int, group, timeout: Optional[timedelta] = None
) -> Dict:
    """Reshape ``model`` (on the meta device) into TP rank ``rank``'s shard; return the
    checkpoint slice ``{param name: (dim, start, stop)}`` (or ``(dim, ((start, stop), ...))``)
    each sharded parameter holds."""
    check_tp(cfg, tp)
    if tp == 1:
        return {}
    sh = _Sharder(cfg, rank, tp, group, timeout)
    for name, layer in _layers(model):
        p = f"model.layers.{name}"
        if isinstance(layer, HybridLayer):
            mixer, mp = layer.mixer_module, f"{p}.{layer.mixer_name}"
            if layer.kind == "attention":
                sh.attention(mp, mixer)
            elif layer.kind == "mlp":
                sh.mlp(mp, mixer)
            else:
                sh.recurrent(mp, mixer)
            if layer.attention_module is not None:  # Falcon-H1: attention beside the Mamba2
                sh.attention(f"{p}.{layer.attention_name}", layer.attention_module)
            for n in layer.mlp_names:
                sh.mlp(f"{p}.{n}", getattr(layer, n))
        else:
            sh.attention(f"{p}.self_attn", layer.self_attn)
            sh.mlp(f"{p}.mlp", layer.mlp)
    vocab, hidden = split(cfg.vocab_size, tp, rank), cfg.hidden_size
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, group, timeout)
        sh.slices["model.embed_tokens.weight"] = (0, vocab.start, vocab.stop)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, len(vocab), bias=False)
        sh.slices["lm_head.weight"] = (0, vocab.start, vocab.stop)
    return sh.slices


class _Sharder:
    """``apply_tp``'s work on one rank: new modules holding this rank's part of each layer, and
    the checkpoint slice each of their parameters reads (``slices``)."""

    def __init__(self, cfg: ModelConfig, rank: int, tp: int, group, timeout):
        self.cfg, self.rank, self.tp, self.group, self.timeout = cfg, rank, tp, group, timeout
        self.hidden, d = cfg.hidden_size, cfg.head_dim
        self.heads = split(cfg.num_heads, tp, rank)
        if tp <= cfg.num_kv_heads:
            kv = split(cfg.num_kv_heads, tp, rank)
        else:  # the head its queries read
            kv = range(rank * cfg.num_kv_heads // tp, rank * cfg.num_kv_heads // tp + 1)
        self.kv, self.rows_q, self.rows_kv = kv, _scale(self.heads, d), _scale(kv, d)
        self.slices: Dict[str, tuple] = {}

    # -- the pieces ------------------------------------------------------------------------
    def column(self, prefix: str, rows, bias: bool) -> nn.Linear:
        rows = [rows] if isinstance(rows, range) else rows
        self.slices[f"{prefix}.weight"] = _take(0, rows)
        if bias:
            self.slices[f"{prefix}.bias"] = _take(0, rows)
        return nn.Linear(self.hidden, sum(map(len, rows)), bias=bias)

    def row(self, prefix: str, cols: range, out: int, bias: bool) -> RowParallelLinear:
        self.slices[f"{prefix}.weight"] = (1, cols.start, cols.stop)
        return RowParallelLinear(len(cols), out, bias, self.group, self.timeout)

    def partial(self, prefix: str, cols: range, out: int, bias: bool) -> nn.Linear:
        """A row-parallel part whose sum the block around it all-reduces (rank 0's bias)."""
        self.slices[f"{prefix}.weight"] = (1, cols.start, cols.stop)
        return nn.Linear(len(cols), out, bias=bias and self.rank == 0)

    def param(self, prefix: str, dim: int, ranges: Sequence[range], shape: tuple) -> nn.Parameter:
        self.slices[prefix] = _take(dim, ranges)
        return nn.Parameter(torch.empty(shape))

    def conv(self, prefix: str, ranges: Sequence[range], kernel: int, bias: bool) -> nn.Conv1d:
        n = sum(map(len, ranges))
        self.slices[f"{prefix}.weight"] = _take(0, ranges)
        if bias:
            self.slices[f"{prefix}.bias"] = _take(0, ranges)
        return nn.Conv1d(n, n, kernel, groups=n, bias=bias, padding=kernel - 1)

    def reduced(self, m: nn.Module) -> None:
        """The block's output is the sum of every rank's part: one all-reduce after it."""
        group, timeout = self.group, self.timeout
        m.register_forward_hook(
            lambda mod, args, out: all_reduce_(out, group, timeout, "tensor-parallel MoE")
        )

    # -- the layers ------------------------------------------------------------------------
    def attention(self, p: str, a: nn.Module) -> None:
        cfg, d = self.cfg, self.cfg.head_dim
        q_rows = _scale(self.heads, 2 * d) if a.gated else self.rows_q  # Qwen3.5: q, gate
        a.q_proj = self.column(f"{p}.q_proj", q_rows, cfg.qkv_bias)
        a.k_proj = self.column(f"{p}.k_proj", self.rows_kv, cfg.qkv_bias)
        a.v_proj = self.column(f"{p}.v_proj", self.rows_kv, cfg.qkv_bias)
        setattr(a, a.OUT, self.row(f"{p}.{a.OUT}", self.rows_q, self.hidden, cfg.o_bias))
        a.h, a.hkv = len(self.heads), len(self.kv)

    def mlp(self, p: str, m: nn.Module, reduce: bool = True) -> None:
        tp, rank, hidden = self.tp, self.rank, self.hidden
        down = self.row if reduce else self.partial
        if isinstance(m, SparseMoE):  # experts and the shared expert: one all-reduce
            for e, expert in enumerate(m.experts):
                self.mlp(f"{p}.experts.{e}", expert, reduce=False)
            self.mlp(f"{p}.shared_expert", m.shared_expert, reduce=False)
            self.reduced(m)
        elif isinstance(m, GraniteMoE):
            ex = m.experts
            e, two, h = ex.gate_up_proj.shape
            u = split(two // 2, tp, rank)
            ex.gate_up_proj = self.param(
                f"{p}.experts.gate_up_proj", 1, [u, _shift(u, two // 2)], (e, 2 * len(u), h)
            )
            ex.down_proj = self.param(f"{p}.experts.down_proj", 2, [u], (e, h, len(u)))
            self.reduced(m)
        elif isinstance(m, Lfm2MLP):
            u = split(m.w1.out_features, tp, rank)
            m.w1, m.w3 = self.column(f"{p}.w1", u, False), self.column(f"{p}.w3", u, False)
            m.w2 = down(f"{p}.w2", u, hidden, False)
        elif isinstance(m, GraniteSharedMLP):
            i = m.output_linear.in_features
            u = split(i, tp, rank)
            m.input_linear = self.column(f"{p}.input_linear", [u, _shift(u, i)], False)
            m.output_linear = down(f"{p}.output_linear", u, hidden, False)
        elif isinstance(m, Relu2MLP):
            u, b = split(m.up_proj.out_features, tp, rank), m.up_proj.bias is not None
            m.up_proj = self.column(f"{p}.up_proj", u, b)
            m.down_proj = down(f"{p}.down_proj", u, hidden, b)
        else:  # Llama's gated MLP
            u, b = split(m.up_proj.out_features, tp, rank), m.up_proj.bias is not None
            m.gate_proj = self.column(f"{p}.gate_proj", u, b)
            m.up_proj = self.column(f"{p}.up_proj", u, b)
            m.down_proj = down(f"{p}.down_proj", u, hidden, b)

    def recurrent(self, p: str, m: nn.Module) -> None:
        if isinstance(m, ShortConv):
            self.short_conv(p, m)
        elif isinstance(m, Mamba2Mixer):
            self.mamba2(p, m)
        elif isinstance(m, GatedDeltaNet):
            self.gated_delta_net(p, m)
        else:
            raise ValueError(f"{p}: tensor parallelism does not know {type(m).__name__}")

    def short_conv(self, p: str, m: ShortConv) -> None:
        rc, k = self.cfg.recurrent, m.conv.weight.shape[-1]
        pr, b = _conv_parts(self.cfg, self.tp, self.rank), rc.conv_bias
        m.in_proj = self.column(f"{p}.in_proj", pr["in_rows"], b)
        m.conv = self.conv(f"{p}.conv", pr["conv"], k, b)
        m.out_proj = self.row(f"{p}.out_proj", pr["channels"], self.hidden, b)

    def mamba2(self, p: str, m: Mamba2Mixer) -> None:
        rc, k = self.cfg.recurrent, m.conv1d.weight.shape[-1]
        pr = _mamba2_parts(self.cfg, self.tp, self.rank)
        hs, gs, x = pr["heads"], pr["groups"], pr["x"]
        m.in_proj = self.column(f"{p}.in_proj", pr["in_rows"], rc.proj_bias)
        m.conv1d = self.conv(f"{p}.conv1d", pr["conv"], k, rc.conv_bias)
        for name in ("dt_bias", "A_log", "D"):
            setattr(m, name, self.param(f"{p}.{name}", 0, [hs], (len(hs),)))
        m.num_heads, m.n_groups, m.intermediate_size = len(hs), len(gs), len(x)
        m.conv_dim = len(x) + 2 * len(gs) * rc.state
        if m.norm is not None:  # (none: y * silu(gate), per channel)
            eps, before = m.norm.eps, rc.norm_before_gate
            if rc.groups % self.tp == 0:
                m.norm = GatedRMSNorm(len(x), eps, groups=len(gs), norm_before_gate=before)
            else:
                width = rc.heads * rc.head_dim // rc.groups
                m.norm = SharedGroupGatedNorm(
                    len(x), eps, gs.start, rc.groups, width, self.group, self.timeout, before
                )
            m.norm.weight = self.param(f"{p}.norm.weight", 0, [x], (len(x),))
        out_bias = rc.proj_bias if rc.out_bias is None else rc.out_bias
        m.out_proj = self.row(f"{p}.out_proj", x, self.hidden, out_bias)

    def gated_delta_net(self, p: str, m: GatedDeltaNet) -> None:
        rc, k = self.cfg.recurrent, m.conv1d.weight.shape[-1]
        pr = _gdn_parts(self.cfg, self.tp, self.rank)
        kh, vh, v = pr["k_heads"], pr["v_heads"], pr["v"]
        if isinstance(m, FusedGatedDeltaNet):  # grouped per key head: one range each
            per = rc.heads // rc.k_heads
            width = 2 * rc.k_head_dim + 2 * per * rc.head_dim
            m.in_proj_qkvz = self.column(f"{p}.in_proj_qkvz", _scale(kh, width), False)
            m.in_proj_ba = self.column(f"{p}.in_proj_ba", _scale(kh, 2 * per), False)
        else:
            m.in_proj_qkv = self.column(f"{p}.in_proj_qkv", pr["conv"], False)
            m.in_proj_z = self.column(f"{p}.in_proj_z", v, False)
            m.in_proj_b = self.column(f"{p}.in_proj_b", vh, False)
            m.in_proj_a = self.column(f"{p}.in_proj_a", vh, False)
        m.conv1d = self.conv(f"{p}.conv1d", pr["conv"], k, False)
        for name in ("dt_bias", "A_log"):
            setattr(m, name, self.param(f"{p}.{name}", 0, [vh], (len(vh),)))
        m.num_v_heads, m.num_k_heads = len(vh), len(kh)
        m.key_dim, m.value_dim = len(kh) * rc.k_head_dim, len(v)
        m.conv_dim = 2 * m.key_dim + m.value_dim
        m.out_proj = self.row(f"{p}.out_proj", v, self.hidden, False)


def _layers(model):
    layers = model.model.layers
    return (
        layers.items()
        if isinstance(layers, nn.ModuleDict)
        else ((str(i), layer) for i, layer in enumerate(layers))
    )


def gather_vocab(
    logits: torch.Tensor, cfg: ModelConfig, tp: int, group, timeout=None
) -> torch.Tensor:
    """Full logits ``(M, vocab)`` from each TP rank's ``(M, vocab_rank)`` columns (every rank gets
    them)."""
    if tp == 1:
        return logits
    width = -(-cfg.vocab_size // tp)
    padded = F.pad(logits, (0, width - logits.shape[1]))  # equal sizes for the all-gather
    parts = all_gather(padded, group, timeout, "logits gather")
    return torch.cat(
        [p[:, : len(split(cfg.vocab_size, tp, r))] for r, p in enumerate(parts)], dim=1
    )


def state_part(whole: torch.Tensor, ranges: Sequence[range]) -> torch.Tensor:
    """A rank's part of a full state tensor: the rows ``ranges`` (``state_ranges``) of dim 0."""
    return torch.cat([whole[r.start : r.stop] for r in ranges])


def place_state_part(whole: torch.Tensor, part: torch.Tensor, ranges: Sequence[range]) -> None:
    """Write a rank's ``part`` (``state_part``'s layout) into the full state tensor ``whole``."""
    at = 0
    for r in ranges:
        whole[r.start : r.stop] = part[at : at + len(r)]
        at += len(r)
