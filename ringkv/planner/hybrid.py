"""``ringkv plan`` for hybrid models: how ``patch_model`` splits their recurrent layers over an SP
group, per layer kind and SP size, from the shapes alone (no process group, no weights).

The engine does not serve hybrid models yet (issue #57), so there is no TP/PP/SP table for them;
what this gives is the choice ``method="auto"`` makes for each recurrent layer and what each form
sends (``sp.recurrent_heads.layer_bytes`` and ``choose_form``, the functions the patched model
runs):

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

__all__ = ["recurrent_layers", "hybrid_plan", "format_hybrid"]

# ringkv's layer kinds (hf.recurrent) -> sp.recurrent_heads' names
_KINDS = {"gated delta rule": "gdn", "kda": "kda", "mamba2": "mamba2", "mamba": "selective"}


def _meta_model(model):
    """``model`` (an HF directory or config.json, a config dict or a transformers config) as a
    causal LM on the meta device; ``None`` when transformers cannot build one from it."""
    try:
        import torch
        import transformers
    except ImportError:  # the planner works without the hf extra
        return None
    from .catalogue import read_json

    if isinstance(model, (str, os.PathLike)):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else str(model)
        if not os.path.isfile(path):
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


def _dims(mixer, kind: str) -> Dict[str, int]:
    """``layer_bytes``' dims of a transformers mixer (attribute names shared by the families)."""
    m = mixer
    if kind == "gdn":
        return dict(
            k_heads=m.num_k_heads, v_heads=m.num_v_heads, d_k=m.head_k_dim, d_v=m.head_v_dim
        )
    if kind == "kda":
        return dict(heads=m.num_heads, d_k=m.head_dim, d_v=m.head_dim)
    if kind == "mamba2":
        h, p = m.num_heads, m.head_dim
        return dict(heads=h, head_dim=p, state=m.ssm_state_size, groups=m.n_groups)
    return dict(channels=m.intermediate_size, state=m.ssm_state_size)


def _conv(mixer):
    """The mixer's causal convolution (``torch.nn.Conv1d`` over the sequence), or None."""
    import torch

    convs = [c for c in mixer.modules() if isinstance(c, torch.nn.Conv1d) and c.kernel_size[0] > 1]
    return convs[0] if convs else None


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
            sp_kind = _KINDS.get(kind)  # None: a convolution alone (LFM2)
            conv = _conv(mixer)
            groups[name] = dict(
                layer=name,
                kind=sp_kind or "conv",
                count=0,
                dims=_dims(mixer, sp_kind) if sp_kind else {},
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
            channels, taps = g["conv"] or (0, 0)
            halo = pieces.slots * channels * taps * 4 * (sp - 1)  # float32 tails
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
