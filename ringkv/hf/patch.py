"""``patch_model`` / ``unpatch_model``: a transformers causal LM switched to ringkv's attention,
with the forward hooks that plan each forward (``_pre_hook``), keep the base model's output for the
chunked loss (``_capture_hidden``) and finish its output (``_post_hook``); ``patch_state`` reads a
model's patch."""

from __future__ import annotations

import inspect
import zlib
from datetime import timedelta
from typing import Optional

import torch

from .. import memory
from ..sp.collectives import agree, rank_world
from ..sp.layout import check_layout
from . import encoder as enc, image_mask, recurrent, vlm
from .attention import begin_cache, eager_attention, resolve_cache
from .loss import kept_logits, step_loss
from .method import choose, describe as _describe
from .plan import AGREE_NAMES, as_kwargs, check_shards, prepare
from .state import ATTN_NAME, METHODS, State, Step, Undo, checkpointing
from .vlm import MEDIA_INPUTS  # noqa: F401 - its old home

STATE_ATTR = "_ringkv_state"  # the patch, on the model and on each of its patched layers


def patch_state(model) -> Optional[State]:
    """The ringkv patch of ``model`` (a patched model, or one that wraps it: PEFT, DDP), or None."""
    for m in model.modules():
        state = getattr(m, STATE_ATTR, None)
        if state is not None:
            return state
    return None


# ---------------------------------------------------------------------------------------------
# the forward's hooks


def _plan(state: State, model, kw: dict):
    """``prepare``'s plan; when this rank's own inputs break a rule with ``inputs="shard"``, the
    peers are told (they raise too instead of waiting) before the error is raised here."""
    try:
        cache, explicit = resolve_cache(model, kw, hybrid=state.hybrid is not None)
        return prepare(state, model, kw, cache, explicit)
    except (ValueError, TypeError):
        if state.inputs == "shard" and state.world > 1:  # per-rank inputs: the peers must raise
            x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
            try:
                agree(
                    [-1] * (len(AGREE_NAMES) - 1) + [1],
                    AGREE_NAMES,
                    state.group,
                    state.timeout,
                    "ringkv.patch_model",
                    device=None if x is None else x.device,
                )
            except Exception:  # noqa: BLE001 - this rank's own error is the one to report
                pass
        raise


def _pre_hook(state: State, model, args, kwargs):
    kw = as_kwargs(model, args, kwargs)
    state.step, state.hidden = None, None
    media_pos, media = vlm.read_call(kw, model) if state.vlm is not None else (None, 0)
    p = _plan(state, model, kw)
    device = p.x_local.device
    values = p.values + [0]
    if state.vlm is not None:  # the media too: "input tokens" is theirs and the tokens' checksum
        tokens = AGREE_NAMES.index("input tokens")
        values[tokens] = zlib.crc32(repr((values[tokens], media)).encode())
    # every rank must make the same call: one tiny all-gather
    agree(values, AGREE_NAMES, state.group, state.timeout, "ringkv.patch_model", device=device)
    step = p.step if p.shards is None else check_shards(state, p)
    step = image_mask.with_spans(state.span_type, kw, step, type(model).__name__)
    # commit
    if state.store is not None and not step.decode and model.training and torch.is_grad_enabled():
        state.offload = memory.offload_checkpoints(
            state.store, model.config.get_text_config().hidden_size
        )
        state.offload.__enter__()
    if state.vlm is not None:  # the whole inputs: the text decoder's pre-hook cuts them
        return vlm.whole_inputs(state, kw, step, p.rows, media_pos)
    whole, kw[p.name] = kw[p.name], p.x_local
    q_pos = step.q_positions.to(device)
    kw["position_ids"] = (
        q_pos if q_pos.dim() == 2 else q_pos.unsqueeze(0).expand(p.x_local.shape[0], -1)
    )  # global positions
    if state.encoder is not None:
        _encoder_inputs(state, model, kw, step, p, whole)
    else:
        kw["cache"] = step.cache
        if step.cache is None:
            kw["use_cache"] = False
    state.step = begin_cache(step, p.rows, device)
    return (), kw


def _encoder_inputs(state: State, model, kw: dict, step: Step, p, whole) -> None:
    """A bidirectional model's other per-token inputs sharded like its tokens, and RoBERTa's
    position ids (counted from the pad id on whole rows)."""
    names = inspect.signature(model.forward).parameters
    kw.pop("cache", None)
    if "use_cache" in names:
        kw["use_cache"] = False
    where = (state.layout, state.rank, state.world, state.ulysses)
    for name in enc.TOKEN_INPUTS:
        if kw.get(name) is not None:
            kw[name] = enc.shard_tokens(kw[name], step, *where).to(p.x_local.device)
    pad = state.encoder.roberta_pad
    if pad is not None:  # whole: (B, S) ids or (B, S, E) embeddings
        full = enc.roberta_positions(whole if p.name == "input_ids" else None, whole, pad)
        kw["position_ids"] = enc.shard_tokens(full.cpu(), step, *where).to(p.x_local.device)


def _post_hook(state: State, model, args, kwargs, output):
    step, state.step = state.step, None
    hidden, state.hidden = state.hidden, None
    offload, state.offload = state.offload, None
    if offload is not None:  # the layers' inputs are saved; the loss's tensors stay where they are
        offload.__exit__(None, None, None)
    if step is None or output is None:  # the forward raised
        return None
    # activation checkpointing replays the layers' forwards during backward, after this hook
    replay = not step.decode and torch.is_grad_enabled() and checkpointing(model)
    state.recompute = (
        Step(
            decode=False,
            q_positions=step.q_positions,
            total=step.total,
            packing=step.packing,
            pieces=step.pieces,
            spans=step.spans,
        )
        if replay
        else None
    )
    if step.keep:  # assemble the last `keep` global logits on every rank
        output.logits = kept_logits(output.logits, step, state.group, state.timeout)
    if step.targets is not None:
        output.loss = step_loss(state, step, model, output, hidden)
    if step.pooling is not None:  # (B, H) on every rank, from the base model's last hidden states
        x = hidden if hidden is not None else output.last_hidden_state
        output["pooled"] = enc.pool(x, step.tokens, step.pooling, state.group, state.timeout)
    return output


def _capture_hidden(state: State, output) -> None:
    """Forward hook of the base model: keep its last hidden states for the chunked loss."""
    if state.step is not None and (state.step.chunked or state.encoder is not None):
        state.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state


# torch.compile: the hooks run eagerly (one graph break each: they communicate and make per-call
# Python decisions that would otherwise be traced and guarded on); the layers between them compile
@torch.compiler.disable
def _run_eager(fn, *args):
    return fn(*args)


# ---------------------------------------------------------------------------------------------
# public API


def patch_model(
    model,
    sp: Optional[int] = None,
    group=None,
    layout: str = "zigzag",
    *,
    method: str = "ring",
    ulysses: Optional[int] = None,
    seq_len: Optional[int] = None,
    inputs: str = "full",
    timeout: Optional[float] = None,
    mesh_dim=None,
    keep_logits: Optional[bool] = None,
    loss_chunk: Optional[int] = None,
    tile_mlp=False,
    offload_checkpoints=False,
):
    """Make ``model`` (a transformers causal LM, or an encoder / bidirectional model: the module
    docstring's "Encoders") run exact sequence-parallel attention over the SP ``group``.

    Call it on every rank of ``group`` (default: the world; no process group = one rank) with
    identical weights. ``group`` may also be a ``torch.distributed.device_mesh.DeviceMesh``: a
    1-D mesh is its group; an n-D mesh needs ``mesh_dim`` (the name or index of its
    sequence-parallel dimension, e.g. ``patch_model(model, group=mesh, mesh_dim="sp")`` on a
    ``("dp", "sp")`` mesh, the same as ``group=mesh["sp"]``). ``sp`` (optional) must equal the
    group size. ``layout`` is how the sequence is split (``"zigzag"`` balances causal work;
    ``"contiguous"``, ``"striped"``).
    ``method``: ``"ring"`` (``ring_attention``), ``"ulysses"`` (``ulysses_attention``: any
    number of heads ``>= N``, split unevenly where ``N`` does not divide them), ``"usp"``
    (``usp_attention`` on ``sp_groups(ulysses=U, ring=N/U)`` of the default world: ``ulysses=U``,
    or None to let the planner's time model choose ``U``) or ``"auto"`` (the ring, Ulysses or USP,
    whichever the planner's time model gives the shortest attention at ``seq_len`` tokens,
    default the config's ``max_position_embeddings``, on the model's device: ``hf.method``; a
    hybrid model keeps the ring and its recurrent layers take the form ``hf.recurrent.form``
    gives). ``ringkv.hf.describe(model)`` says what runs and why.
    Layers with a sliding window (Mistral, Qwen2) attend within it, at any length.
    ``inputs`` is ``"full"`` (every rank passes the whole sequence) or ``"shard"`` (every rank
    passes its own shard); see the module docstring. ``timeout`` (seconds) bounds every wait
    on a peer. Returns the same model, patched in place; ``unpatch_model`` restores it.

    Training memory (docs/hf.md, "Training at any length"):

    - ``keep_logits``: ``None`` (default) computes the loss of a **training-mode** forward with
      ``labels`` (or ``shift_labels``) from the final hidden states through the head in chunks
      of ``loss_chunk`` tokens, never building the ``(B, S/N, V)`` logits: ``output.logits`` is
      ``None`` then (eval-mode forwards return logits as before). ``True``: logits always (the
      loss from them). ``False``: never for a forward with labels, in eval too (``logits_to_keep``
      in eval is then a ``ValueError``). HF's ``num_items_in_batch`` divides the loss instead of the
      global count of targets.
    - ``tile_mlp``: ``True`` (or tokens per tile) runs every decoder layer's MLP over sequence
      tiles and recomputes them in backward (``ringkv.memory.tile_mlp``).
    - ``offload_checkpoints``: ``True`` moves the layer inputs that gradient checkpointing saves
      to pinned host memory (CUDA) and back for backward; or a ``ringkv.memory.CheckpointStore``.
    """
    _check_options(model, layout, method, inputs)
    span_type = image_mask.check_model(model)  # before the layers' check: it names the option
    layers, mixers = _patched_layers(model)
    media = _vlm(model, inputs, mixers)
    if mixers:
        recurrent.check_hybrid_options(model, layout, method)
    encoder = enc.classify(model, layers)
    if encoder is not None and (inputs != "full" or mixers):
        raise ValueError(
            f"ringkv.patch_model: a bidirectional model ({encoder.name}) takes inputs='full' "
            f"(every rank passes the whole rows, which its padding and positions need)"
            + (" and no recurrent layers" if mixers else f", not inputs={inputs!r}")
        )
    group = _sp_group(group, mesh_dim)
    rank, world = rank_world(group)
    _check_sp(sp, world)
    _check_loss_options(keep_logits, loss_chunk)
    store = _checkpoint_store(model, offload_checkpoints)
    # the last check; building USP's groups is the first collective
    choice = choose(model, method, ulysses, group, world, seq_len, hybrid=bool(mixers))
    tile = None if tile_mlp is True else tile_mlp  # True: memory.tile_mlp's default tile
    restore = [] if tile_mlp is False or tile_mlp is None else [memory.tile_mlp(model, tile)]
    state = State(
        group=group,
        layout=layout,
        rank=rank,
        world=world,
        method=method,
        ulysses=choice.ulysses,
        groups=choice.groups,
        inputs=inputs,
        timeout=None if timeout is None else timedelta(seconds=timeout),
        keep_logits=keep_logits,
        loss_chunk=loss_chunk,
        store=store,
        hybrid=type(model).__name__ if mixers else None,
        attention=choice.attention,
        why=choice.why,
        vlm=media,
        encoder=encoder,
        span_type=span_type,
    )
    if mixers:
        _agree_layers(model, state, mixers)
    _install(model, state, layers, restore, mixers)
    return model


def _vlm(model, inputs: str, mixers) -> Optional[vlm.Vlm]:
    """A vision-language model's record (its text decoder: ``hf/vlm.py``), or None for a text LM;
    ``ValueError`` for what a VLM's patch does not support."""
    media = vlm.media_inputs(model)
    if not media:
        return None
    name = type(model).__name__
    if inputs != "full":
        raise ValueError(
            f"ringkv: {name} merges its media ({', '.join(media)}) into the whole sequence before "
            f"ringkv shards it: patch it with inputs='full' (every rank passes the whole inputs)"
        )
    if mixers:
        raise TypeError(
            f"ringkv.patch_model does not split vision-language models with recurrent layers "
            f"({name})"
        )
    return vlm.record(model, media)


def _agree_layers(model, state: State, mixers) -> None:
    """Every rank of the group patches the same hybrid model: its recurrent layers (class, kind)
    and every parameter's shape agree (one tiny all-gather; ``ValueError`` on every rank
    otherwise), so no rank meets a peer's other state size inside a layer's collectives."""
    kinds = [(type(m).__name__, kind) for m, kind in mixers]
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    device = next(model.parameters()).device
    agree(
        [zlib.crc32(repr(kinds).encode()), zlib.crc32(repr(shapes).encode())],
        ["its recurrent layers (classes and kinds)", "the model's parameter shapes"],
        state.group,
        state.timeout,
        f"ringkv.patch_model({type(model).__name__})",
        device=None if device.type == "meta" else device,
    )


def _check_options(model, layout: str, method: str, inputs: str) -> None:
    check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if inputs not in ("full", "shard"):
        raise ValueError(f"inputs must be 'full' or 'shard', got {inputs!r}")
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError(
            "this model is already patched by ringkv; call ringkv.unpatch_model(model) first"
        )


def _check_sp(sp: Optional[int], world: int) -> None:
    if sp is not None and sp != world:
        raise ValueError(
            f"sp={sp} but the SP group has {world} rank(s); pass the process group of {sp} ranks "
            "as group= (or omit sp)"
            + ("" if world > 1 else "; call torch.distributed.init_process_group first for sp > 1")
        )


def _check_loss_options(keep_logits, loss_chunk) -> None:
    if keep_logits not in (None, True, False):
        raise ValueError(
            f"keep_logits must be None (logits in eval only), True or False, got {keep_logits!r}"
        )
    if loss_chunk is not None and (
        isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1
    ):
        raise ValueError(
            f"loss_chunk must be a positive int (tokens per chunk of the loss), got {loss_chunk!r}"
        )


def _patched_layers(model):
    """``(layers, mixers)``: the self-attention layers the patch reaches (modules with
    ``layer_idx`` and ``is_causal``; each gets the patch's state; ``encoder.classify`` reads
    whether they are causal) of a model whose attention goes
    through ``AttentionInterface``, and its recurrent mixers (``recurrent.classify``); ``TypeError``
    for any other model, naming the layer ringkv cannot split."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    refused = TypeError(
        f"ringkv.patch_model needs a transformers model whose attention goes through "
        f"AttentionInterface (model._supports_attention_backend and set_attn_implementation), "
        f"e.g. Llama, Qwen2, Mistral; {name} does not"
    )
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        raise refused
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(
            f"ringkv.patch_model supports decoder-only causal LMs, not the encoder-decoder {name}"
        )
    media = vlm.media_inputs(model)
    text = vlm.text_decoder(model, media) if media else model  # a VLM: its language model's layers
    mixers = recurrent.classify(model)
    layers = [m for m in text.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not getattr(model, "_supports_attention_backend", False):
        # transformers marks hybrids False (their recurrent layers are no attention backend), their
        # attention layers still call ALL_ATTENTION_FUNCTIONS, and ringkv splits the rest itself
        if not mixers or not all(recurrent.calls_attention_interface(m) for m in layers):
            raise refused
    if not layers and not mixers:
        raise TypeError(
            "ringkv.patch_model found no attention layers (modules with layer_idx and is_causal) "
            f"in {name}"
        )
    return layers, mixers


def _install(model, state: State, layers: list, restore: list, mixers=()) -> None:
    """Switch ``model`` to the ``"ringkv"`` attention, give its ``layers`` the state, wrap its
    recurrent ``mixers`` (``recurrent.install``) and add the forward hooks (``restore``: what else
    ``unpatch_model`` undoes)."""
    from transformers import AttentionInterface

    handles = []
    if mixers:
        handles, held, undo_recurrent = recurrent.install(model, state, mixers)
        layers, restore = list(layers) + list(held), list(restore) + [undo_recurrent]
    if state.encoder is not None:
        handles += enc.install(model, state, state.encoder)
    AttentionInterface.register(ATTN_NAME, eager_attention)
    text = model if state.vlm is None else state.vlm.text  # a VLM's vision tower keeps its own
    prev_impl = text.config._attn_implementation
    text.set_attn_implementation(ATTN_NAME)
    for m in layers:
        setattr(m, STATE_ATTR, state)
    handles += [
        model.register_forward_pre_hook(
            lambda mod, a, k: _run_eager(_pre_hook, state, mod, a, k), with_kwargs=True
        ),
        model.register_forward_hook(
            lambda mod, a, k, o: _run_eager(_post_hook, state, mod, a, k, o),
            with_kwargs=True,
            always_call=True,
        ),
    ]
    if state.vlm is not None:  # cuts the merged sequence to this rank's shard
        handles.append(
            text.register_forward_pre_hook(
                lambda mod, a, k: _run_eager(vlm.text_pre_hook, state, mod, a, k),
                with_kwargs=True,
            )
        )
    if getattr(model, "base_model", model) is not model:  # its output feeds the chunked loss
        handles.append(
            model.base_model.register_forward_hook(
                lambda mod, a, o: _run_eager(_capture_hidden, state, o)
            )
        )
    state.undo = Undo(prev_impl, tuple(layers), tuple(handles), tuple(restore))
    setattr(model, STATE_ATTR, state)


def unpatch_model(model):
    """Undo ``patch_model``: remove the hooks and restore the previous attention implementation."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not patched by ringkv")
    undo = state.undo
    for h in undo.handles:
        h.remove()
    for restore in undo.restore:
        restore()
    for m in undo.layers:
        delattr(m, STATE_ATTR)
    delattr(model, STATE_ATTR)
    (model if state.vlm is None else state.vlm.text).set_attn_implementation(undo.prev_impl)
    return model


def describe(model) -> dict:
    """What ``model``'s patch runs (``hf.method.describe``): the method asked and the attention it
    runs (``"auto"``'s choice), the Ulysses x ring degrees, the query heads per Ulysses rank and
    why."""
    state = patch_state(model)
    if state is None:
        raise ValueError("this model is not patched by ringkv")
    return _describe(state, model.config)


def _checkpoint_store(model, offload):
    """The ``CheckpointStore`` that ``offload_checkpoints=`` names (None: no offload)."""
    if offload is None or offload is False:
        return None
    if isinstance(offload, memory.CheckpointStore):
        return offload
    if offload is not True:
        raise ValueError(
            f"offload_checkpoints must be True, False or a ringkv.memory.CheckpointStore, got "
            f"{offload!r}"
        )
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(
            "offload_checkpoints=True moves checkpoints from CUDA memory to pinned host memory, "
            f"but the model is on {device}; on a CPU there is nothing to offload to (pass False, "
            "or a ringkv.memory.CheckpointStore such as FileStore to store them elsewhere)"
        )
    return memory.HostStore(device)


def _mesh_group(mesh, mesh_dim):
    """The process group of ``mesh`` (a ``DeviceMesh``): itself (1-D) or its ``mesh_dim``."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim is None:
        if mesh.ndim == 1:
            return mesh.get_group()
        raise ValueError(
            f"group= is a {mesh.ndim}-D DeviceMesh (dims {names or tuple(range(mesh.ndim))}); "
            "name its sequence-parallel dimension: patch_model(model, group=mesh, mesh_dim='sp') "
            "(or pass group=mesh['sp'])"
        )
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(
                f"mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh; its dims are {names}"
            )
    elif (
        isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not 0 <= mesh_dim < mesh.ndim
    ):
        raise ValueError(
            f"mesh_dim must be a dimension name in {names} or an index 0..{mesh.ndim - 1}, "
            f"got {mesh_dim!r}"
        )
    return mesh.get_group(mesh_dim)


def _sp_group(group, mesh_dim):
    """The SP process group that ``patch_model(group=, mesh_dim=)`` names: ``group`` itself (a
    process group or None), or a ``DeviceMesh``'s group (1-D), or its ``mesh_dim`` dimension's."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without device meshes: only process groups
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        return _mesh_group(group, mesh_dim)
    if mesh_dim is not None:
        raise ValueError(
            f"mesh_dim={mesh_dim!r} picks a dimension of a DeviceMesh, but group= is "
            f"{type(group).__name__}; pass the mesh as group= (or drop mesh_dim)"
        )
    return group
