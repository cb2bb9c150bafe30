"""Vision-language models (``*ForConditionalGeneration``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and MoE),
LLaVA-OneVision):
the language model's sequence, text and image tokens together, split across the SP group.

The patched model's pre-hook plans the forward from the whole ``input_ids`` as for a text LM (the
labels become this rank's targets, the ranks agree, media inputs included) but hands the model its
whole inputs: the vision tower runs whole on every rank (replicated) and the model merges the image
features into ``inputs_embeds`` and computes its positions (Qwen's 3-D multimodal RoPE and its
``rope_deltas``) as it does unpatched. A pre-hook on the text decoder (``text_decoder``: the
model's ``language_model``) then cuts what reaches it to this rank's shard in the patch's layout
(``shard_text_inputs``): ``inputs_embeds`` ``(B, S, E)``, ``position_ids`` ``(B, S)`` or
``(R, B, S)`` (R = 3 or 4 rows of multimodal RoPE), every other ``(B, S)`` tensor (token masks) and
the features that follow a token mask (Qwen3-VL's deepstack embeddings, ``TOKEN_FEATURES``). The
head and the loss see this rank's shard, as for text LMs; gradients reach the vision tower through
the shard's image rows only, so each rank's vision gradient is its share and their sum over the
group is the unpatched model's. A decode step (new tokens, the same on every rank) is not cut.

Other models build on this hook (Gemma 3's image-token mask): ``SPLIT[model_type] = fn`` admits a
family and gives its text decoder's pre-hook an extra step ``fn(state, kw, index, decode)``, called
last (``kw``: the decoder's keyword arguments, already cut; ``index``: this rank's ``(S_pad / N,)``
global token indices, None in a decode step).
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch

# forward arguments of multimodal models (images, video, audio merged into the token sequence)
MEDIA_INPUTS = {
    "pixel_values",
    "pixel_values_videos",
    "image_patches",
    "input_features",
    "input_values",
    "audio_values",
    "input_audio_embeds",
    "input_image_embeds",
    "image_embeds",
}
# the VLM families whose split is verified exact (tests/test_hf_vlm.py, test_hf_gemma3.py), by
# config.model_type, each with the extra step its text decoder's pre-hook needs (None: none; see
# ``Vlm.extra``). These decoders mask causally whatever the tokens are, or as ringkv splits it
# (Gemma 3: each image attends to all of itself; its token_type_ids never reach the decoder, so the
# model's pre-hook reads them: hf/image_mask.py). Others are refused until their masks are split too
SPLIT = dict.fromkeys(
    ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava_onevision", "gemma3")
)
# list-of-features arguments of a text decoder -> the (B, S) token mask whose True rows they follow
# (in row-major order): each rank keeps the features of its own masked tokens
TOKEN_FEATURES = {"deepstack_visual_embeds": "visual_pos_masks"}


@dataclass
class Vlm:
    """A patched vision-language model: its text decoder, the extra steps of the decoder's pre-hook
    (``SPLIT``'s) and the forward under way's rows to cache (set by the model's pre-hook, used by
    the text decoder's)."""

    text: torch.nn.Module
    extra: list = field(default_factory=list)
    rows: Optional[torch.Tensor] = None


def record(model, media: list) -> Vlm:
    """The ``Vlm`` of a vision-language ``model`` taking ``media`` (``text_decoder``'s checks)."""
    text = text_decoder(model, media)
    step = SPLIT[model.config.model_type]
    return Vlm(text, [] if step is None else [step])


def media_inputs(model) -> list:
    """The media arguments ``model.forward`` takes (sorted; empty for a text LM)."""
    return sorted(set(inspect.signature(model.forward).parameters) & MEDIA_INPUTS)


def text_decoder(model, media: list):
    """The text decoder of the vision-language ``model`` (its ``language_model``, which takes
    ``inputs_embeds`` and ``position_ids``); ``TypeError`` naming why for a model ringkv cannot
    split (the media merged some other way)."""
    name, kind = type(model).__name__, getattr(model.config, "model_type", "?")
    if kind not in SPLIT:
        raise TypeError(
            f"ringkv.patch_model splits vision-language models whose text decoder is causal over "
            f"text and image tokens alike ({', '.join(sorted(SPLIT))}); {name} ({kind!r}) also "
            f"takes {', '.join(media)}, and how it masks the merged sequence is not verified "
            f"(e.g. PaliGemma's prefix tokens see each other both ways). Patch its text model's "
            f"causal LM class instead"
        )
    base = getattr(model, "base_model", model)
    text = getattr(base, "language_model", None) or getattr(model, "language_model", None)
    params = set(inspect.signature(text.forward).parameters) if text is not None else set()
    if text is None or not {"inputs_embeds", "position_ids"} <= params:
        raise TypeError(
            f"ringkv.patch_model splits the language model's sequence of a vision-language model "
            f"after the model merged its media ({', '.join(media)}) into it, at its text decoder "
            f"(`language_model`, called with inputs_embeds and position_ids); {name} has no such "
            f"decoder. Patch its text model's causal LM class instead"
        )
    return text


def read_call(kw: dict, model):
    """``(position_ids, media checksum)`` of a VLM forward, before it is planned: the positions
    taken out of ``kw`` (the model's own, handed back to it by ``whole_inputs``) and
    ``media_checksum``; ``check_call``'s errors."""
    pos = check_call(kw, model)
    return pos, media_checksum(kw)


def whole_inputs(state, kw: dict, step, rows, pos):
    """The end of the model's pre-hook for a VLM: the model gets its whole inputs and its own
    ``pos``; the planned ``step`` and the ``rows`` to cache wait for the text decoder's hook."""
    kw["position_ids"], kw["cache"] = pos, step.cache
    if step.cache is None:
        kw["use_cache"] = False
    state.step, state.vlm.rows = step, rows
    return (), kw


def check_call(kw: dict, model) -> Optional[torch.Tensor]:
    """A VLM forward's arguments that ringkv does not split (a ``ValueError``, the same on every
    rank: the inputs are whole); returns the ``position_ids`` taken out of ``kw``."""
    name = type(model).__name__
    mask = kw.get("attention_mask")
    if mask is not None and not isinstance(mask, dict) and not bool(mask.bool().all()):
        raise ValueError(
            f"ringkv: padding in attention_mask is not supported for the vision-language model "
            f"{name}: pass unpadded rows of one length (or one row per forward)"
        )
    from .plan import PACKING_KEYS

    packed = sorted(k for k in PACKING_KEYS if kw.get(k) is not None)
    pos = kw.pop("position_ids", None)
    if pos is not None and pos.dim() == 3 and pos.shape[0] == 4:
        packed += ["position_ids whose text row restarts"] if _restarts(pos[0]) else []
    elif pos is not None and pos.dim() == 2 and _restarts(pos):
        packed += ["position_ids that restart"]
    if packed:
        raise ValueError(
            f"ringkv: packed documents ({', '.join(packed)}) are not supported for the "
            f"vision-language model {name}; pass one sequence per row"
        )
    return pos


def _restarts(pos: torch.Tensor) -> bool:
    """Whether text positions ``(B, T)`` ever fail to grow by one (packed documents)."""
    return pos.shape[-1] > 1 and bool((pos[..., 1:] - pos[..., :-1] != 1).any())


def media_checksum(kw: dict) -> int:
    """One number for the forward's tensors besides the tokens (pixels, grids, sizes), so that the
    ranks can agree they were all given the same media: their names, shapes and the sums of their
    bits as integers (exact, whatever the order of the sum)."""
    crc = 0
    for name in sorted(kw):
        t = kw[name]
        if isinstance(t, torch.Tensor) and name not in ("input_ids", "attention_mask"):
            crc = zlib.crc32(repr((name, tuple(t.shape), _bit_sum(t))).encode(), crc)
    return crc


def _bit_sum(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """The sum of ``t``'s elements read as integers of their width (in chunks of ``chunk``)."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.view(ints)
    return sum(int(flat[i : i + chunk].long().sum()) for i in range(0, flat.numel(), chunk))


# ---------------------------------------------------------------------------------------------
# the text decoder's pre-hook


def _pad_end(x: torch.Tensor, dim: int, s_pad: int) -> torch.Tensor:
    """``x`` padded at the end of ``dim`` to ``s_pad`` (zeros; positions continue by one): rows no
    real token sees under causal attention."""
    extra = s_pad - x.shape[dim]
    if extra == 0:
        return x
    if x.dtype in (torch.long, torch.int32, torch.int64) and dim == x.dim() - 1:  # positions
        last = x.narrow(dim, x.shape[dim] - 1, 1)
        step = torch.arange(1, extra + 1, device=x.device, dtype=x.dtype)
        return torch.cat([x, last + step], dim)
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def shard_text_inputs(kw: dict, index: torch.Tensor, b: int, s: int, s_pad: int) -> None:
    """Cut the text decoder's whole-sequence arguments in ``kw`` (``S`` tokens, padded at the end
    to ``S_pad``) to this rank's rows ``index`` ``(S_pad / N,)`` (global token indices, in the
    patch's layout): ``inputs_embeds`` ``(B, S, E)`` -> ``(B, S_pad / N, E)``; ``position_ids``
    ``(B, S)`` or ``(R, B, S)`` along the last dim; every other ``(B, S, ...)`` tensor along dim 1;
    ``TOKEN_FEATURES`` to the local tokens'."""

    def cut(x, dim):
        x = _pad_end(x, dim, s_pad)
        return x.index_select(dim, index.to(x.device))

    for name, mask_name in TOKEN_FEATURES.items():
        if kw.get(name) is None or kw.get(mask_name) is None:
            continue
        mask = kw[mask_name].to(index.device).bool()  # (B, S)
        order = (mask.reshape(-1).long().cumsum(0) - 1).view(b, s)  # each masked token's feature
        mine = cut(order, 1)[cut(mask, 1)]  # this rank's masked tokens' features, row-major
        kw[name] = [f.index_select(0, mine.to(f.device)) for f in kw[name]]
    for name, x in list(kw.items()):
        if not isinstance(x, torch.Tensor):
            continue
        if name == "position_ids":
            kw[name] = cut(x, x.dim() - 1)
        elif x.dim() >= 2 and tuple(x.shape[:2]) == (b, s):
            kw[name] = cut(x, 1)


def text_pre_hook(state, module, args, kwargs):
    """The text decoder's pre-hook: its inputs cut to this rank's shard (prefill), the sharded KV
    cache begun for this forward, positions supplied where the model gave none."""
    from .attention import begin_cache
    from .plan import as_kwargs

    step, vlm = state.step, state.vlm
    if step is None:
        raise RuntimeError(
            "ringkv: the text decoder of a patched vision-language model ran outside the patched "
            "model's forward: call the model itself"
        )
    kw = as_kwargs(module, args, kwargs)
    x = kw.get("inputs_embeds")
    if x is None:
        x = kw["inputs_embeds"] = module.get_input_embeddings()(kw.pop("input_ids"))
    kw["input_ids"] = None
    b, s = x.shape[:2]
    cache = step.cache
    if kw.get("position_ids") is None:  # global positions; the model adds its RoPE rows
        seen = cache.seen if cache is not None else 0
        kw["position_ids"] = (seen + torch.arange(s, device=x.device)).expand(b, s)
    index = None
    if not step.decode:
        index = step.q_positions.reshape(-1)  # (S_pad / N,) global rows of this rank
        shard_text_inputs(kw, index, b, s, index.numel() * state.world)
    kw["attention_mask"] = None  # ringkv's attention masks by global positions
    kw["cache"] = cache
    if cache is None:
        kw["use_cache"] = False
    for fn in vlm.extra:
        fn(state, kw, index, step.decode)
    state.step = begin_cache(step, vlm.rows, kw["inputs_embeds"].device)
    vlm.rows = None
    return (), kw
