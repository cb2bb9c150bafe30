"""The recurrent layers of a patched hybrid model: short convolutions, Mamba2 (SSD) and Mamba
(selective scan) mixers, gated DeltaNet and KDA, split over the SP group like the attention.

transformers' hybrid modeling modules (Qwen3-Next, Qwen3.5, Falcon-H1, Bamba, Nemotron-H, Granite 4
hybrid, LFM2, Jamba, Zamba2, Kimi Linear, and the same mixers in Qwen3.5-MoE, OLMo-hybrid, LFM2-MoE,
LFM3, Lara-Mini and Bailing-hybrid) run these layers through *module-level* functions that
each mixer looks up in its module's globals at call time (``causal_conv1d_forward``,
``mamba2_scan_forward``, ``mamba_scan_forward``, ``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ...). ``install`` puts ringkv's wrappers in their place (reference
counted per modeling module: ``unpatch_model`` of the last patched model of a family puts the
originals back) and gives each mixer the patch: ``_ringkv_state`` on the mixer and its convolutions,
and a forward pre-hook that adds the state to the mixer's keyword arguments, which the mixer passes
on to every one of these functions (the wrappers take it out again).

In a sharded forward (``state.step``, planned by the model's pre-hook with its ``pieces``: which
rows of each rank belong to which document, in sequence order) a wrapper runs the SP form of its
layer from ``ringkv.sp``: the convolution with the K-1 tokens before each piece fetched from the
rank that holds them, the scans and delta rules with the state passed across pieces in sequence
order (resetting at each document's start). Anywhere else (a model of the same family that is not
patched) the original runs. Packed documents: the unpatched CPU torch path ignores document
boundaries in these layers (``cu_seqlens`` arrives in ``**kwargs`` unused); ringkv resets the state
at each boundary, so its oracle is each document run alone.

``classify`` decides at patch time: the known mixers of a model, or a ``TypeError`` naming the
class of a recurrent, convolution or state-space layer ringkv does not know how to split.
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
from typing import Callable, Dict, List, Tuple

import torch

from .state import active_step

STATE_ATTR = "_ringkv_state"
KW = "_ringkv"  # the keyword argument the mixers' pre-hooks add (the wrappers take it out)

CONV, MAMBA2, MAMBA, GDN, KDA = "conv", "mamba2", "mamba", "gated delta rule", "kda"
FAMILIES = (  # the hybrid families of MIXERS, as users name them
    "Qwen3-Next",
    "Qwen3.5",
    "Falcon-H1",
    "Bamba",
    "Nemotron-H",
    "Granite 4 hybrid",
    "LFM2",
    "Jamba",
    "Zamba2",
    "Kimi Linear",
    "Qwen3.5-MoE",
    "OLMo-hybrid",
    "LFM2-MoE",
    "LFM3",
    "Lara-Mini",
    "Bailing-hybrid",
)
# the mixers ringkv splits: class name -> layer kind (each is checked to come from transformers)
MIXERS = {
    "Qwen3NextGatedDeltaNet": GDN,
    "Qwen3_5GatedDeltaNet": GDN,
    "FalconH1Mixer": MAMBA2,
    "BambaMixer": MAMBA2,
    "NemotronHMamba2Mixer": MAMBA2,
    "GraniteMoeHybridMambaLayer": MAMBA2,
    "Zamba2MambaMixer": MAMBA2,
    "JambaMambaMixer": MAMBA,
    "Lfm2ShortConv": CONV,
    "KimiLinearDeltaAttention": KDA,
    # the same mixers (and modeling functions) in other families' modules
    "Qwen3_5MoeGatedDeltaNet": GDN,
    "LaraMiniGatedDeltaNet": GDN,
    "OlmoHybridGatedDeltaNet": GDN,
    "Lfm2MoeShortConv": CONV,
    "Lfm3ShortConv": CONV,
    "BailingHybridDeltaAttention": KDA,
}
# each kind's name in ringkv.sp.recurrent_heads (the convolution alone has no state to pass)
SP_KINDS = {GDN: "gdn", KDA: "kda", MAMBA2: "mamba2", MAMBA: "selective"}
# the module-level functions of each kind's modeling module that ringkv wraps
WRAPPED = {
    CONV: ("causal_conv1d_forward",),
    MAMBA2: ("causal_conv1d_forward", "mamba2_scan_forward", "mamba2_split_conv1d_scan_combined"),
    MAMBA: ("causal_conv1d_forward", "mamba_scan_forward"),
    GDN: (
        "causal_conv1d_forward",
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
    ),
    KDA: (
        "causal_conv1d_forward",
        "chunk_kimi_delta_attention",
        "recurrent_kimi_delta_attention",
    ),
}
# layers that mix tokens without softmax attention (by class name): refused unless in MIXERS
RECURRENT_NAMES = re.compile(
    r"Mamba\d*Mixer|MambaLayer|ShortConv|Recurrent(Block|Layer)|R[gG][lL]ru|DeltaNet|"
    r"DeltaAttention|Linear\w*Attention|LightningAttention|TimeMix|Rwkv\w*Attention|"
    r"[LS]?LSTM|[ms]?Lstm|Retention|Hyena|Mixer$"
)

NOT_LAYERS = re.compile(r"Norm|Model$|ForCausalLM$|Config$")  # wrappers and norms of such layers


# ---------------------------------------------------------------------------------------------
# patch time: which layers a model has


def seq_conv(m: torch.nn.Module) -> bool:
    """Whether ``m`` is a convolution over the sequence (a ``Conv1d`` of more than one tap)."""
    return isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1


def layer_dims(mixer: torch.nn.Module, kind: str) -> Dict[str, int]:
    """``sp.recurrent_heads.layer_bytes``' dims of a transformers mixer of ``kind`` (a key of
    ``SP_KINDS``), from the attribute names the families share."""
    m = mixer
    if kind == GDN:
        return dict(
            k_heads=m.num_k_heads, v_heads=m.num_v_heads, d_k=m.head_k_dim, d_v=m.head_v_dim
        )
    if kind == KDA:
        return dict(heads=m.num_heads, d_k=m.head_dim, d_v=m.head_dim)
    if kind == MAMBA2:
        h, p = m.num_heads, m.head_dim
        return dict(heads=h, head_dim=p, state=m.ssm_state_size, groups=m.n_groups)
    return dict(channels=m.intermediate_size, state=m.ssm_state_size)


def _is_mixer(m: torch.nn.Module) -> bool:
    cls = type(m)
    return cls.__name__ in MIXERS and cls.__module__.startswith("transformers.models.")


def classify(model) -> List[Tuple[torch.nn.Module, str]]:
    """``[(mixer, kind)]``: the recurrent mixers of ``model`` that ringkv splits (possibly none).

    ``TypeError`` naming the class when ``model`` has a token-mixing layer that is neither
    attention nor one of ``MIXERS``: a module with a 1-D convolution over the sequence, or one
    whose class name says it is recurrent (RWKV, xLSTM, RG-LRU, linear or lightning attention,
    another Mamba or DeltaNet)."""
    found = [(n, m) for n, m in model.named_modules() if _is_mixer(m)]
    mixers = [(m, MIXERS[type(m).__name__]) for _, m in found]
    inside = {id(s) for _, m in found for s in m.modules()}
    # the layers holding a known mixer (OlmoHybridLinearAttentionDecoderLayer) are not judged by
    # their name (their other children and own convolutions still are)
    holders = {".".join(n.split(".")[:i]) for n, _ in found for i in range(n.count(".") + 1)}
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        cls = type(m).__name__
        conv = any(seq_conv(c) for c in m.children())
        # an attention layer's class name may say "linear" (Kimi's MLA is KimiLinearAttention)
        named = name not in holders and RECURRENT_NAMES.search(cls) and not NOT_LAYERS.search(cls)
        if named and _is_attention(m) and calls_attention_interface(m):
            named = False
        if conv or named:
            what = "a 1-D convolution over the sequence" if conv else "a recurrent layer"
            raise TypeError(
                f"ringkv.patch_model cannot split {type(model).__name__}: its layer {cls} "
                f"({name or 'the model'}) is {what} that ringkv does not know how to split "
                f"across ranks. Hybrid models ringkv splits: {', '.join(FAMILIES)}"
            )
    return mixers


def _is_attention(m: torch.nn.Module) -> bool:
    return hasattr(m, "layer_idx") and getattr(m, "is_causal", None) is not None


def calls_attention_interface(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s forward calls its attention through ``ALL_ATTENTION_FUNCTIONS``."""
    try:
        src = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def check_hybrid_options(model, layout: str, method: str) -> None:
    """``ValueError`` for the patch options a hybrid model cannot run with."""
    name = type(model).__name__
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(
            f"ringkv: {name} has recurrent layers (convolution, state-space, linear attention), "
            f"which run on layouts 'contiguous' and 'zigzag', not {layout!r}: striped would make "
            f"every token its own piece of the state passing"
        )
    if method == "usp":
        raise ValueError(
            f"ringkv: method='usp' is not supported for {name}: its recurrent layers pass their "
            f"state along the sequence layout of one SP group; use method='ring' (or 'ulysses')"
        )


# ---------------------------------------------------------------------------------------------
# the wrappers in the modeling modules' globals

_LOCK = threading.Lock()
_INSTALLED: Dict[str, list] = {}  # modeling module -> [count, {name: original}]


def install(model, state, mixers) -> Tuple[list, tuple, Callable[[], None]]:
    """Give ``mixers`` the patch ``state`` and wrap their modules' functions.

    Returns ``(handles, modules, undo)``: the pre-hooks, the modules that got ``_ringkv_state``
    and the function that removes the wrappers again (once per ``install``)."""
    kinds: Dict[str, set] = {}
    for m, kind in mixers:
        kinds.setdefault(type(m).__module__, set()).update(WRAPPED[kind])
    for modname, names in kinds.items():
        mod = importlib.import_module(modname)
        missing = [n for n in sorted(names) if not hasattr(mod, n)]
        if missing:
            raise TypeError(
                f"ringkv: {modname} has no {', '.join(missing)}: this transformers version runs "
                f"its recurrent layers another way, which ringkv does not know how to split"
            )
    for modname, names in kinds.items():
        _wrap_module(modname, names)
    holders, handles = [], []
    for m, _ in mixers:
        for sub in m.modules():
            if sub is m or isinstance(sub, torch.nn.Conv1d):
                setattr(sub, STATE_ATTR, state)
                holders.append(sub)
        handles.append(
            m.register_forward_pre_hook(lambda mod, a, k: (a, {**k, KW: state}), with_kwargs=True)
        )
    done = []

    def undo():
        if not done:
            done.append(True)
            for modname in kinds:
                _unwrap_module(modname)

    return handles, tuple(holders), undo


def _wrap_module(modname: str, names) -> None:
    with _LOCK:
        mod = importlib.import_module(modname)
        entry = _INSTALLED.setdefault(modname, [0, {}])
        for n in names:
            if n not in entry[1]:
                entry[1][n] = getattr(mod, n)
            if not getattr(getattr(mod, n), "_ringkv_wrapper", False):  # (put back by someone)
                setattr(mod, n, _wrapper(n, entry[1][n]))
        entry[0] += 1


def _unwrap_module(modname: str) -> None:
    with _LOCK:
        entry = _INSTALLED[modname]
        entry[0] -= 1
        if entry[0] == 0:
            mod = importlib.import_module(modname)
            for n, original in entry[1].items():
                setattr(mod, n, original)
            del _INSTALLED[modname]


def original(modname: str, name: str):
    """The function ringkv's wrapper replaced (or the module's own when none is installed)."""
    entry = _INSTALLED.get(modname)
    if entry is not None and name in entry[1]:
        return entry[1][name]
    return getattr(importlib.import_module(modname), name)


def _wrapper(name: str, orig):
    def wrapper(*args, **kwargs):
        state = kwargs.pop(KW, None)
        if state is None and args and isinstance(args[0], torch.nn.Module):
            state = getattr(args[0], STATE_ATTR, None)
        if state is None:
            return orig(*args, **kwargs)  # a model of this family that is not patched
        return _sharded(name, orig, state, args, kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = orig
    wrapper._ringkv_wrapper = True
    return wrapper


# torch.compile: the layers' SP forms run eagerly (one graph break each: they communicate and make
# per-call Python decisions), as the attention does; the mixers' projections around them compile
@torch.compiler.disable
def _sharded(name: str, orig, state, args, kwargs):
    step = active_step(state)
    if step is None:
        raise RuntimeError(
            f"ringkv: {name} of a patched model ran outside the forward of the model patched by "
            "ringkv.patch_model: call the patched model itself (not a submodule), or "
            "ringkv.unpatch_model it"
        )
    if step.decode:  # new tokens, the same on every rank, over the cached state (the same too)
        return orig(*args, **kwargs)
    if name == "mamba2_split_conv1d_scan_combined":
        return None  # the fused kernel would run the whole sequence alone: take the split path
    return _RUN[name](state, step, *args, **kwargs)


def _sp(state, step) -> dict:
    """The SP functions' common arguments."""
    return dict(pieces=step.pieces, group=state.group, timeout=state.timeout)


def by_row(finals: dict, step) -> torch.Tensor:
    """The cache's state of each batch row ``(B, ...)`` from the SP function's ``{doc: (b, ...)}``:
    document 0 of an unpadded batch (``b = B``), or one document per row of a left-padded one."""
    if step.pad is None:
        return finals[0]
    return torch.cat([finals[d] for d in range(len(finals))], 0)


def _conv(state, step, conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kw):
    """``causal_conv1d_forward``: ``hidden_states`` ``(B, C, T_local)`` -> ``(B, C, T_local)``; with
    a cache, each row's last K inputs become its conv state."""
    from ..sp.recurrent import causal_conv1d

    x, k = hidden_states, conv1d.kernel_size[0]
    out = causal_conv1d(
        x.to(conv1d.weight.dtype),
        conv1d.weight.squeeze(1),  # (C, K)
        conv1d.bias,
        activation,
        return_tail=cache is not None,
        **_sp(state, step),
    )
    if cache is not None:
        out, tails = out
        tail = by_row(tails, step).to(x.dtype)  # (B, C, K)
        cache.update_conv_state(tail, layer_idx, state_idx=state_idx, conv_kernel_size=k)
    return out.to(x.dtype)


def form(state, kind: str, dims: dict, pieces) -> str:
    """The form a recurrent layer runs in: ``"state"`` (state passing along the sequence) or
    ``"heads"`` (head-parallel, all-to-all). ``method="ring"``: state; ``"ulysses"``: heads where
    the layer's heads divide the group, else state; ``"auto"``:
    ``sp.recurrent_heads.choose_form`` (shapes only: the same on every rank)."""
    from ..sp.recurrent_heads import choose_form, heads_divide

    if state.world == 1 or state.method == "ring":
        return "state"
    if state.method == "ulysses":
        return "heads" if heads_divide(kind, dims, state.world) else "state"
    return choose_form(kind, dims, pieces, state.world)


def _pick(state, step, kind: str, dims: dict, by_state, by_heads):
    return by_heads if form(state, kind, dims, step.pieces) == "heads" else by_state


def _mamba2(state, step, module, hidden_states, B, C, dt, cache, **kw):
    """``mamba2_scan_forward``: ``hidden_states`` ``(b, T, H*P)``, ``B``/``C`` ``(b, T, G*N)``,
    ``dt`` ``(b, T, H)`` -> ``(b, T, H*P)`` (with the ``D`` skip); with a cache, each row's final
    state ``(B, H, P, N)``."""
    from ..sp.recurrent import mamba2_scan
    from ..sp.recurrent_heads import heads_mamba2_scan

    b, t, _ = hidden_states.shape
    g, n = module.n_groups, module.ssm_state_size
    dims = dict(layer_dims(module, MAMBA2), batch=b, itemsize=hidden_states.element_size())
    scan = _pick(state, step, "mamba2", dims, mamba2_scan, heads_mamba2_scan)
    y = scan(
        hidden_states.view(b, t, module.num_heads, module.head_dim),
        dt,
        -torch.exp(module.A_log.float()),
        B.view(b, t, g, n),
        C.view(b, t, g, n),
        chunk_size=module.chunk_size,
        D=module.D,
        dt_bias=module.dt_bias,
        dt_softplus=True,
        dt_limit=module.time_step_limit,
        return_final_state=cache is not None,
        **_sp(state, step),
    )  # (b, T, H, P)
    if cache is not None:
        y, finals = y
        cache.update_recurrent_state(by_row(finals, step), module.layer_idx)
    return y.reshape(b, t, module.intermediate_size)


def _mamba(state, step, module, hidden_states, time_step, B, C, gate, cache, **kw):
    """``mamba_scan_forward`` (Jamba): ``hidden_states``/``time_step``/``gate`` ``(b, I, T)``,
    ``B``/``C`` ``(b, T, N)`` -> ``(b, I, T)`` (gated, with the ``D`` skip); with a cache, each
    row's final state ``(B, I, N)``."""
    from ..sp.recurrent import selective_scan
    from ..sp.recurrent_heads import heads_selective_scan

    bias = module.dt_proj.bias
    b, channels, _ = hidden_states.shape
    dims = dict(channels=channels, state=B.shape[-1], z=gate is not None, batch=b)
    dims.update(itemsize=hidden_states.element_size())
    scan = _pick(state, step, "selective", dims, selective_scan, heads_selective_scan)
    y = scan(
        hidden_states,
        time_step,
        -torch.exp(module.A_log.float()),
        B.transpose(1, 2),  # (b, N, T)
        C.transpose(1, 2),
        D=module.D.float(),
        z=gate,
        delta_bias=None if bias is None else bias.float(),
        delta_softplus=True,
        return_final_state=cache is not None,
        **_sp(state, step),
    )
    if cache is not None:
        y, finals = y
        cache.update_recurrent_state(by_row(finals, step).to(hidden_states.dtype), module.layer_idx)
    return y


def _delta(fn_name: str):
    def run(
        state,
        step,
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kw,
    ):
        """``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention``: q, k ``(B, T, H_k,
        D_k)``, v ``(B, T, H_v, D_v)`` -> ``(o (B, T, H_v, D_v), final state (B, H_v, D_k, D_v)
        float32 when output_final_state, else None)``."""
        from ..sp import delta, recurrent_heads

        if initial_state is not None:
            raise RuntimeError(f"ringkv: {fn_name} from a recurrent state in a sharded prefill")
        (b, _, hk, dk), (hv, dv) = key.shape, value.shape[2:]
        dims = dict(k_heads=hk, v_heads=hv, heads=hv, d_k=dk, d_v=dv, batch=b)
        dims.update(itemsize=value.element_size())
        kind = "gdn" if fn_name == "gated_delta_rule" else "kda"
        by_heads = getattr(recurrent_heads, "heads_" + fn_name)
        rule = _pick(state, step, kind, dims, getattr(delta, fn_name), by_heads)
        o = rule(
            query,
            key,
            value,
            g,
            beta,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            chunk_size=chunk_size,
            return_final_state=output_final_state,
            **_sp(state, step),
        )
        if output_final_state:
            o, finals = o
        return o, by_row(finals, step).float() if output_final_state else None

    return run


def _recurrent_step(state, step, *args, **kwargs):
    raise RuntimeError(
        "ringkv: a one-token recurrent step inside a sharded prefill (recording past states for "
        "a cache rollback is not supported)"
    )


_RUN = {
    "causal_conv1d_forward": _conv,
    "mamba2_scan_forward": _mamba2,
    "mamba_scan_forward": _mamba,
    "torch_chunk_gated_delta_rule": _delta("gated_delta_rule"),
    "chunk_kimi_delta_attention": _delta("kda"),
    "torch_recurrent_gated_delta_rule": _recurrent_step,
    "recurrent_kimi_delta_attention": _recurrent_step,
}
