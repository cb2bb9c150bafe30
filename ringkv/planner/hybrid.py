"""``ringkv plan`` for hybrid models: how ``patch_model`` splits their recurrent layers over an SP
group, per layer kind and SP size, from the shapes alone (no process group, no weights).

The engine serves the hybrid families of ``ringkv.model`` (docs/engine.md, "Hybrid models"), but
the engine planner's TP/PP/SP table does not model recurrent layers yet; for a hybrid the plan
gives what the engine keeps per sequence (``engine_memory``: K/V of the attention layers, the
float32 state) and the choice ``method="auto"`` makes for each recurrent layer under
``patch_model`` and what each form sends (``sp.recurrent_heads.layer_bytes`` and ``choose_form``,
the functions the patched model runs):

- state passing: every piece's final state and transition, float32, all-gathered:
  ``O(N * H * d_k * d_v)`` per layer, constant in the sequence length;
- the head-parallel form: two all-to-alls of the layer's inputs and output, ``O(S/N * H * d)``,
  possible only where the heads divide the group;
- the causal convolution before each of them: every piece's last K inputs, all-gathered.

The model is built on the meta device by transformers from its config (no weights are read), and
its layers are classified as ``patch_model`` does (``hf.recurrent.classify``, which refuses what it
cannot split, naming the layer).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

__all__ = ["recurrent_layers", "hybrid_plan", "format_hybrid", "engine_memory"]

SEQS = (4096, 16384, 65536)  # the lengths ``engine_memory`` prices a sequence at


def _meta_model(model):
    """``model`` (an HF directory or config.json, a config dict or a transformers config) as a
    causal LM on the meta device; ``None`` when transformers cannot build one from it."""
    try:
        import torch
        import transformers
    except ImportError:  # the planner works without the hf extra
        return None
    from .catalogue import config_path, read_json

    if isinstance(model, (str, os.PathLike)):
        path = config_path(model)
        if path is None:
            return None
        model = read_json(path, "model config")
    if isinstance(model, dict):
        if "model_type" not in model:
            return None
        try:
            model = transformers.AutoConfig.for_model(**model)
        except (ValueError, KeyError):
            return None
    if not isinstance(model, transformers.PretrainedConfig):
        return None
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(model)
    except (ValueError, KeyError, TypeError):
        return None


def recurrent_layers(model) -> Optional[List[dict]]:
    """The recurrent layers of ``model`` grouped by class: ``[{"layer", "kind", "count", "dims",
    "conv": (channels, taps) or None}]``; ``None`` when ``model`` is not a hybrid transformers
    can build (then it is the engine's to plan). ``TypeError`` naming the layer for a recurrent
    layer ringkv cannot split."""
    built = _meta_model(model)
    if built is None:
        return None
    from ..hf import recurrent

    groups: Dict[str, dict] = {}
    for mixer, kind in recurrent.classify(built):
        name = type(mixer).__name__
        if name not in groups:
            conv = next((c for c in mixer.modules() if recurrent.seq_conv(c)), None)
            groups[name] = dict(
                layer=name,
                kind=recurrent.SP_KINDS.get(kind, "conv"),  # "conv": a convolution alone (LFM2)
                count=0,
                dims=recurrent.layer_dims(mixer, kind) if kind in recurrent.SP_KINDS else {},
                conv=(conv.in_channels, conv.kernel_size[0]) if conv is not None else None,
            )
        groups[name]["count"] += 1
    return list(groups.values()) or None


def hybrid_plan(
    layers: List[dict], seq: int, gpus: int, itemsize: int = 2, rates: Optional[dict] = None
) -> List[dict]:
    """For every SP size dividing ``gpus`` (zigzag, batch 1) and every layer group of
    ``recurrent_layers``: bytes one rank sends per layer and forward (``state``: state passing;
    ``heads``: the head-parallel form, None where the heads do not divide; ``halo``: the
    convolution), and ``auto``: the form ``choose_form`` picks with ``rates``
    (``link_bytes_per_s``, ``flops_per_s``: the target's; default: ``choose_form``'s, measured
    on a CPU)."""
    from ..sp.pieces import seq_pieces
    from ..sp.recurrent import halo_bytes
    from ..sp.recurrent_heads import choose_form, heads_divide, layer_bytes

    rows = []
    for sp in [d for d in range(2, gpus + 1) if gpus % d == 0]:
        pieces = seq_pieces(seq, "zigzag", sp)
        for g in layers:
            row = dict(sp=sp, layer=g["layer"], kind=g["kind"], count=g["count"])
            state = heads = auto = None
            if g["kind"] != "conv":
                dims = dict(g["dims"], itemsize=itemsize)
                b = layer_bytes(g["kind"], dims, pieces, sp)
                state = b["state"]
                heads = b["heads"] if heads_divide(g["kind"], dims, sp) else None
                auto = choose_form(g["kind"], dims, pieces, sp, **(rates or {}))
            halo = halo_bytes(*(g["conv"] or (0, 0)), pieces, sp)
            rows.append(dict(row, state=state, heads=heads, halo=halo, auto=auto))
    return rows


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / (1 << 20):.2f}"


def format_hybrid(rows: List[dict]) -> str:
    """``hybrid_plan``'s rows as a text table (MiB per layer, forward; backward the same)."""
    head = (
        f"{'sp':>3} {'layer':32} {'kind':9} {'n':>3} {'state MiB':>10} {'heads MiB':>10} "
        f"{'halo MiB':>9}  auto"
    )
    lines = [head]
    for r in rows:
        form = {"state": "state passing", "heads": "head-parallel", None: "halo only"}[r["auto"]]
        lines.append(
            f"{r['sp']:3d} {r['layer'][:32]:32} {r['kind']:9} {r['count']:3d} "
            f"{_mib(r['state']):>10} {_mib(r['heads']):>10} {_mib(r['halo']):>9}  {form}"
        )
    return "\n".join(lines)


def engine_memory(model, itemsize: int = 2, block_size: int = 16) -> Optional[dict]:
    """What the engine keeps for one sequence of hybrid ``model`` (an HF directory or
    config.json, or a config dict) at tp = 1: ``kv_bytes_per_token`` (K and V of the attention
    layers, ``itemsize`` bytes each), ``state_bytes`` (every recurrent layer's state, float32),
    the default ``checkpoint_blocks`` for ``block_size`` and ``per_sequence``: K/V + state at
    ``SEQS`` tokens. None for a model the engine does not run as a hybrid."""
    from ..engine.hybrid import is_hybrid, slot_bytes
    from ..model.config import ModelConfig
    from .catalogue import config_path, read_json

    if isinstance(model, (str, os.PathLike)):
        path = config_path(model)
        model = read_json(path, "model config") if path is not None else None
    try:
        cfg = ModelConfig.from_hf(model)
    except (ValueError, TypeError):
        return None
    if not is_hybrid(cfg):
        return None
    kv = 2 * len(cfg.kv_layers()) * cfg.num_kv_heads * cfg.head_dim * itemsize
    state = slot_bytes(cfg)
    return dict(
        model_type=cfg.model_type,
        kv_bytes_per_token=kv,
        state_bytes=state,
        checkpoint_blocks=max(1, -(-state // max(1, kv * block_size))),
        per_sequence={n: kv * n + state for n in SEQS},
    )


def format_engine_memory(m: dict) -> str:
    """``engine_memory`` as two lines."""
    per = ", ".join(f"{n // 1024}K: {b / (1 << 20):.1f} MiB" for n, b in m["per_sequence"].items())
    return (
        f"the engine keeps per sequence {m['kv_bytes_per_token']} B of K/V per token (attention "
        f"layers) + {m['state_bytes'] / (1 << 20):.2f} MiB of recurrent state (float32): {per};\n"
        f"state snapshots every {m['checkpoint_blocks']} blocks of 16 tokens by default "
        f"(state_checkpoint_blocks)"
    )
