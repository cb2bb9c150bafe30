"""Cases for tests/test_hf_gemma3.py (Gemma 3 multimodal), run on every rank of a gloo world.

A tiny random ``Gemma3ForConditionalGeneration`` built from its config (no downloads): 3 text
layers (sliding, full, sliding; window 4) and a one-layer SigLIP tower whose images become 9
tokens each, longer than the window. Inputs are built without a processor: random pixels and the
``input_ids`` with ``<boi>``, 9 image tokens and ``<eoi>`` per image, ``token_type_ids`` 1 at the
image tokens (what the processor gives), from which transformers' mask lets each image see itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ringkv import hf  # noqa: E402

IMAGE, BOI, EOI = 150, 151, 152
TOKENS_PER_IMAGE = 9


def config(**text):
    """The tiny Gemma 3 config; ``text`` overrides its text config."""
    import transformers

    text = dict(
        dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            max_position_embeddings=512,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        **text,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=12,
        patch_size=4,
        vision_use_head=False,
    )
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )


def build(seed: int, **text):
    """The tiny model, fp32, eval mode, the same weights for the same seed."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config(**text)).eval()
    # transformers starts the image projector at zero: the pixels would reach nothing (no logit,
    # no vision-tower gradient to compare); random, the images change the logits
    w = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return model


def inputs(rows, seed: int = 0) -> dict:
    """``rows``: per batch row, the text runs around its images (``[3, 5, 2]``: 3 tokens, an image,
    5 tokens, an image, 2 tokens; rows of one length). The model's keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for runs in rows:
        row = torch.randint(3, 140, (runs[0],), generator=g).tolist()
        for n in runs[1:]:
            row += [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI]
            row += torch.randint(3, 140, (n,), generator=g).tolist()
        ids.append(row)
    ids = torch.tensor(ids)
    images = sum(len(runs) - 1 for runs in rows)
    return dict(
        input_ids=ids,
        pixel_values=torch.randn(images, 3, 12, 12, generator=g),
        token_type_ids=(ids == IMAGE).long(),
    )


def labels_of(kw: dict) -> torch.Tensor:
    ids = kw["input_ids"]
    return ids.masked_fill(ids == IMAGE, -100)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _generate(model, kw, new_tokens):
    return model.generate(
        **kw, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )


def reference(seed: int, kw: dict, new_tokens: int) -> dict:
    """The unpatched model: training loss and every gradient; eval logits; greedy tokens."""
    model = build(seed)
    out = model.train()(**kw, labels=labels_of(kw), use_cache=False)
    out.loss.backward()
    res = dict(loss=out.loss.item(), grads=grads_of(model))
    model.eval()
    with torch.no_grad():
        res["eval_logits"] = model(**kw).logits
        res["tokens"] = _generate(model, kw, new_tokens)
    return res


def patched_run(ctx, seed, kw, layout, new_tokens, method="ring", checkpointing=False) -> dict:
    """The patched model: training loss and every gradient summed over the group (each rank holds
    its share); eval logits gathered; greedy tokens of ``generate``."""
    ulysses = 2 if method == "usp" else None  # usp: a 2 x 2 mesh of the 4-rank world
    model = hf.patch_model(
        build(seed), group=ctx.group, layout=layout, method=method, ulysses=ulysses
    )
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    out = model(**kw, labels=labels_of(kw), use_cache=False)
    out.loss.backward()
    grads = grads_of(model)
    for g in grads.values():
        dist.all_reduce(g, group=ctx.group)
    res = dict(loss=out.loss.item(), grads=grads)
    model.eval()
    s = kw["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**kw).logits
        u = hf.patch.patch_state(model).ulysses  # usp: the logits are in its 2-D layout
        res["eval_logits"] = hf.gather_logits(logits, layout, ctx.group, seq_len=s, ulysses=u)
        res["tokens"] = _generate(model, kw, new_tokens)
    return res
