"""Cases for tests/test_hf_vlm.py (vision-language models), run on every rank of a gloo world.

Tiny random Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision (and Qwen2-VL, Qwen3-VL-MoE), built from
configs (no downloads), and their inputs built without a processor: random ``pixel_values`` with
the grids / image sizes that say how many image tokens each image becomes, and the ``input_ids``
with that many image tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ringkv import hf  # noqa: E402

VLMS = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")
MORE = ("qwen2_vl", "qwen3_vl_moe")  # the same code paths as Qwen2.5-VL / Qwen3-VL: fewer cases
IMAGE, VIDEO, START, END = 150, 151, 152, 153  # special tokens of the tiny configs
_TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_QWEN_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_SPECIAL = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)


def config(arch: str):
    """A tiny config: 2 text layers of 64 (4 heads, 2 KV heads), a 1-2 layer vision tower of 32."""
    import transformers

    if arch == "qwen2_5_vl":
        vision = dict(_QWEN_VISION, depth=1, window_size=8, fullatt_block_indexes=[0])
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_parameters=_MROPE), vision_config=vision, **_SPECIAL
        )
    if arch == "qwen3_vl":  # two deepstack layers: image features added inside the decoder
        vision = dict(
            _QWEN_VISION, depth=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1]
        )
        rope = dict(_MROPE, mrope_interleaved=True)
        return transformers.Qwen3VLConfig(
            text_config=dict(_TEXT, head_dim=16, rope_parameters=rope),
            vision_config=vision,
            **_SPECIAL,
        )
    if arch == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=2)
        return transformers.Qwen2VLConfig(
            text_config=dict(_TEXT, rope_parameters=_MROPE), vision_config=vision, **_SPECIAL
        )
    if arch == "qwen3_vl_moe":  # 4 experts, each token routed to all (smooth routing)
        vision = dict(
            _QWEN_VISION, depth=1, num_position_embeddings=16, deepstack_visual_indexes=[0]
        )
        rope = dict(_MROPE, mrope_interleaved=True)
        moe = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32)
        return transformers.Qwen3VLMoeConfig(
            text_config=dict(_TEXT, head_dim=16, rope_parameters=rope, **moe),
            vision_config=vision,
            **_SPECIAL,
        )
    if arch == "llava_onevision":
        vision = dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
            vision_use_head=False,
        )
        text = dict(_TEXT, model_type="qwen2")
        return transformers.LlavaOnevisionConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=IMAGE,
            video_token_index=VIDEO,
            image_grid_pinpoints=[[8, 8], [8, 16], [16, 8]],
        )
    raise ValueError(arch)


def build(arch: str, seed: int):
    """The tiny VLM, fp32, eval mode, the same weights for the same seed."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config(arch)).eval()


def _tokens(n_text, n_images, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 140, (n,), generator=g).tolist() for n in n_text[: n_images + 1]]


def inputs(arch: str, images: int, seed: int = 0, rows: int = 1) -> dict:
    """``rows`` samples (B = rows; each its own tokens and pixels) of ``images`` images: the
    model's keyword arguments (``input_ids``, pixels, grids or sizes, token types)."""
    parts = [_sample(arch, images, seed + r) for r in range(rows)]
    kw = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if arch != "llava_onevision" and images:
        kw["mm_token_type_ids"] = (kw["input_ids"] == IMAGE).int()  # the 3-D positions need them
    return kw


def _sample(arch: str, images: int, seed: int, text=(3, 4, 2, 3)) -> dict:
    """One sample of ``images`` images, each between two text runs (lengths ``text``)."""
    g = torch.Generator().manual_seed(seed)
    runs = _tokens(list(text), images, seed)
    if images == 0:  # text only: no media arguments
        return dict(input_ids=torch.tensor([runs[0] * 4]))
    if arch == "llava_onevision":  # one image: anyres tiles (14 tokens); several: 5 tokens each
        tiles, per = (3, 14) if images == 1 else (1, 5)
        pixels = torch.randn(images, tiles, 3, 8, 8, generator=g)
        counts = [per] * images
        media = dict(
            pixel_values=pixels,
            image_sizes=torch.tensor([[8, 16]] * images),
            batch_num_images=torch.tensor([images]),
        )
    else:
        grids = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 6, 4]][:images])
        per_patch = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
        pixels = torch.randn(int(grids.prod(-1).sum()), per_patch, generator=g)
        counts = (grids.prod(-1) // 4).tolist()
        media = dict(pixel_values=pixels, image_grid_thw=grids)
    ids = list(runs[0])
    for i in range(images):
        ids += [START] + [IMAGE] * counts[i] + [END] + runs[i + 1]
    return dict(input_ids=torch.tensor([ids]), **media)


def labels_of(kw: dict) -> torch.Tensor:
    """The sample's labels: its tokens, -100 at the image tokens (as chat templates mask them)."""
    ids = kw["input_ids"]
    return ids.masked_fill(ids == IMAGE, -100)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(arch: str, seed: int, kw: dict, new_tokens: int = 0) -> dict:
    """The unpatched model: training loss, logits, every gradient; eval logits; greedy tokens."""
    model = build(arch, seed)
    out = model.train()(**kw, labels=labels_of(kw), use_cache=False)
    out.loss.backward()
    res = dict(loss=out.loss.item(), logits=out.logits.detach(), grads=grads_of(model))
    model.eval()
    with torch.no_grad():
        res["eval_logits"] = model(**kw).logits
        if new_tokens:
            res["tokens"], res["scores"] = _generate(model, kw, new_tokens)
    return res


def _generate(model, kw, new_tokens):
    """Greedy ``generate``: ``(tokens (B, S + new), scores (B, new, V))``."""
    out = model.generate(
        **kw,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    return out.sequences, torch.stack(out.scores, 1)


def patched_run(
    ctx, arch, seed, kw, layout, new_tokens=0, method="ring", keep_logits=None, checkpointing=False
):
    """The patched model: training loss (``keep_logits=None``: the chunked loss from the hidden
    states, no logits; True: from the logits, gathered too) and this rank's gradients (with
    activation ``checkpointing``: the text and vision layers replayed in backward); eval logits
    gathered; greedy tokens and scores of ``generate``."""
    model = hf.patch_model(
        build(arch, seed), group=ctx.group, layout=layout, method=method, keep_logits=keep_logits
    )
    if checkpointing:
        model.activation_checkpointing_enable()
    s = kw["input_ids"].shape[1]
    out = model.train()(**kw, labels=labels_of(kw), use_cache=False)
    out.loss.backward()
    res = dict(
        loss=out.loss.item(),
        logits=None
        if out.logits is None
        else hf.gather_logits(out.logits, layout, ctx.group, seq_len=s),
        grads=grads_of(model),
    )
    model.eval()
    with torch.no_grad():
        res["eval_logits"] = hf.gather_logits(model(**kw).logits, layout, ctx.group, seq_len=s)
        if new_tokens:
            res["tokens"], res["scores"] = _generate(model, kw, new_tokens)
    return res


def text_inputs(ctx, arch, seed, kw, layout) -> dict:
    """What the patched model's text decoder runs on this rank in a forward of ``kw``: the
    ``position_ids`` and ``inputs_embeds`` its layers get (after ringkv's pre-hook)."""
    model = hf.patch_model(build(arch, seed), group=ctx.group, layout=layout)
    seen = {}

    def grab(mod, args, kwargs):
        seen.update(position_ids=kwargs["position_ids"], inputs_embeds=kwargs["inputs_embeds"])

    model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)  # after ringkv's
    with torch.no_grad():
        model(**kw, use_cache=False)
    return seen


def forward_error(ctx, arch, seed, kw, layout="zigzag"):
    """One patched eval forward of ``kw``: ``(error type, message)``, or ``("ok", "")``."""
    model = hf.patch_model(build(arch, seed), group=ctx.group, layout=layout, timeout=20)
    try:
        with torch.no_grad():
            model(**kw)
    except (ValueError, TypeError, RuntimeError) as e:
        return (type(e).__name__, str(e))
    return ("ok", "")


def other_pixels(ctx, arch, seed):
    """Every rank calls the same forward but rank 1 with other pixels: ``(error type, message)``
    of each rank."""
    kw = inputs(arch, 1)
    if ctx.rank == 1:
        kw["pixel_values"] = kw["pixel_values"] + 1
    return forward_error(ctx, arch, seed, kw)


def decode_steps(model, kw, steps: int):
    """A prefill forward with a cache, then ``steps`` greedy decode forwards of one token each, no
    positions given (the model derives them from the cache length and its ``rope_deltas``): each
    step's last logits ``(B, steps + 1, V)``."""
    with torch.no_grad():
        out = model(**kw, use_cache=True)
        last = [out.logits[:, -1]]
        for _ in range(steps):
            nxt = last[-1].argmax(-1, keepdim=True)
            out = model(input_ids=nxt, cache=out.cache, use_cache=True)
            last.append(out.logits[:, -1])
    return torch.stack(last, 1)


def patched_decode(ctx, arch, seed, kw, layout, steps):
    """``decode_steps`` on the patched model (the prefill's last logits: ``logits_to_keep=1``)."""
    model = hf.patch_model(build(arch, seed), group=ctx.group, layout=layout)
    return decode_steps(_KeepLast(model), kw, steps)


class _KeepLast:
    """Calls ``model`` with ``logits_to_keep=1`` (every rank then gets the last token's logits)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kw):
        return self.model(**kw, logits_to_keep=1)
