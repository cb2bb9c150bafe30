"""The vision-language models against the unpatched model, as numbers (``test_hf_vlm.py`` asserts
the same comparisons within tolerances):

    python -m tests.vlm_report            # every model of tests.vlm_cases (VLMS, MORE), sp 2 and 3
    python -m tests.vlm_report share      # the vision tower's share of a training step
    python -m tests.vlm_report encoders   # tests.encoder_cases' families, sp 2 and 3
    python -m tests.vlm_report gemma3     # Gemma 3 multimodal (tests.gemma3_cases), sp 2 and 3

For each tiny random model (float32), number of images and SP size it prints the largest absolute
differences from the unpatched model: training loss, every gradient (summed over the group, the
vision tower's included), eval logits (gathered), generate's scores over 3 greedy steps, and
whether the generated tokens are equal on every rank. ``encoders``: per family (every head of
``encoder_cases.HEADS``) on a right-padded batch, the masked-LM loss, the largest per-token logit
difference (masked-LM and token classification, real tokens), sequence classification loss and
logits, pooled embeddings and every gradient (relative: over the tensor's largest entry, at least
1; ``test_hf_encoders.py`` asserts these). ``gemma3``:
loss, every gradient (relative: each tensor's difference over 1 + its largest entry, as
``test_hf_gemma3.py`` asserts; the vision tower's apart, with its largest gradient), eval logits and
greedy tokens, with 1 and 2 images (``gemma3_cases.build`` makes the multimodal projector, which
transformers initialises to zeros, random: the images reach the text and the vision tower's
gradients)."""

from __future__ import annotations

import sys
import time

import torch

from tests import vlm_cases as vc
from tests.dist import World
from tests.test_hf_vlm import differences

CASES = ((2, "zigzag"), (3, "striped"))
HEADER = (
    "| model | images | tokens | sp | layout | loss | max grad diff | max eval-logit diff "
    "| generate: max score diff, tokens |\n|" + "---|" * 9
)


def main() -> int:
    world = World(3)
    try:
        print(HEADER)
        for arch in vc.VLMS + vc.MORE:
            for images in (1, 2):
                kw = vc.inputs(arch, images)
                ref = vc.reference(arch, 0, kw, new_tokens=3)
                for sp, layout in CASES:
                    res = world.check("tests.vlm_cases:patched_run", sp, arch, 0, kw, layout, 3)
                    d = differences(res, ref)
                    print(
                        f"| {arch} | {images} | {kw['input_ids'].shape[1]} | {sp} | {layout} | "
                        f"{d['loss']:.1e} | {d['grad']:.1e} | {d['eval']:.1e} | "
                        f"{d['scores']:.1e}, {'equal' if d['tokens'] else 'DIFFERENT'} |",
                        flush=True,
                    )
    finally:
        world.close()
    return 0


def _fmt(values) -> str:
    return f"{max(values):.1e}" if values else "-"


def encoders() -> int:
    from tests import encoder_cases as ec

    lengths = {2: [21, 13], 3: [24, 9]}  # right-padded rows
    print(
        "| family | sp | layout | lengths | MLM loss | max logits diff | classification: loss, "
        "logits | pooled embedding | max grad diff (relative) |\n|" + "---|" * 9
    )
    world = World(3)
    try:
        for family in ec.HEADS:
            for sp, layout in ((2, "zigzag"), (3, "contiguous")):
                data = ec.batch(family, 2, max(lengths[sp]), lengths[sp], seed=sp)
                ref = ec.reference(family, 0, data)
                res = world.check("tests.encoder_cases:encoder_step", sp, family, 0, data, layout)
                real = data["mask"].bool()
                d = dict(mlm=[], logits=[], cls=[], cls_logits=[], pooled=[], grad=[], rel=[])
                for head, want in ref.items():
                    kind = head.partition(":")[0]
                    got = [r[head] for r in res]
                    loss = [abs(g["loss"] - want["loss"]) for g in got]
                    d["mlm" if kind == "mlm" else "cls"] += loss if kind in ("mlm", "cls") else []
                    if kind in ("mlm", "tok"):
                        d["logits"] += [
                            (g["logits"] - want["logits"])[real].abs().max() for g in got
                        ]
                    if kind == "cls":
                        d["cls_logits"] += [(g["logits"] - want["logits"]).abs().max() for g in got]
                    if kind == "base":
                        d["pooled"] += [(g["pooled"] - want["pooled"]).abs().max() for g in got]
                    assert all(set(g["grads"]) == set(want["grads"]) for g in got), head
                    for name, w in want["grads"].items():
                        diff = (sum(g["grads"][name] for g in got) - w).abs().max()
                        d["grad"].append(diff)
                        d["rel"].append(diff / max(1.0, w.abs().max()))  # test_hf_encoders'

                d = {k: [float(v) for v in vs] for k, vs in d.items()}
                print(
                    f"| {family} | {sp} | {layout} | {lengths[sp]} | {_fmt(d['mlm'])} | "
                    f"{_fmt(d['logits'])} | {_fmt(d['cls'])}, {_fmt(d['cls_logits'])} | "
                    f"{_fmt(d['pooled'])} | {_fmt(d['grad'])} ({_fmt(d['rel'])}) |",
                    flush=True,
                )
    finally:
        world.close()
    return 0


def gemma3() -> int:
    from tests import gemma3_cases as gc

    print(
        "| images | tokens | sp | layout | loss | max grad diff (relative) "
        "| vision tower: max grad diff; largest grad "
        "| max eval-logit diff | generate: tokens |\n|" + "---|" * 9
    )
    world = World(3)
    try:
        for images, rows in ((1, [[4, 6]]), (2, [[3, 5, 2]])):
            kw = gc.inputs(rows)
            ref = gc.reference(0, kw, 3)
            for sp, layout in ((2, "zigzag"), (3, "contiguous")):
                res = world.check("tests.gemma3_cases:patched_run", sp, 0, kw, layout, 3)
                assert all(r["grads"].keys() == ref["grads"].keys() for r in res)
                grad, rel, vision = [], [], [0.0, 0.0]  # vision: largest diff, |grad|
                for n, w in ref["grads"].items():  # the sums were all-reduced: on every rank
                    diff = max((r["grads"][n] - w).abs().max().item() for r in res)
                    grad.append(diff)
                    rel.append(diff / (1 + w.abs().max().item()))  # test_hf_gemma3's measure
                    if n.startswith("model.vision_tower"):
                        vision = [max(vision[0], diff), max(vision[1], w.abs().max().item())]
                logits = [(r["eval_logits"] - ref["eval_logits"]).abs().max() for r in res]
                equal = all(torch.equal(r["tokens"], ref["tokens"]) for r in res)
                print(
                    f"| {images} | {kw['input_ids'].shape[1]} | {sp} | {layout} | "
                    f"{_fmt([abs(r['loss'] - ref['loss']) for r in res])} | "
                    f"{_fmt(grad)} ({_fmt(rel)}) | {vision[0]:.1e}; {vision[1]:.1e} | "
                    f"{_fmt([float(x) for x in logits])} | {'equal' if equal else 'DIFFERENT'} |",
                    flush=True,
                )
    finally:
        world.close()
    return 0


def vision_share() -> int:
    """The vision tower's share of one training step (forward + backward, one process, one
    thread) of a Qwen2.5-VL-shaped model (LM 8 x 512, ViT 8 x 256, patch 14, 256 tokens per 448 x
    448 image), for one image in a mostly-text sequence and four images alone: what replicating
    the tower costs (each rank pays the share whole instead of 1/N of it)."""
    import transformers

    torch.set_num_threads(1)
    text = dict(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]},
    )
    vision = dict(
        depth=8,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        patch_size=14,
        out_hidden_size=512,
        fullatt_block_indexes=[3, 7],
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=990, video_token_id=991
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).train()
    for images, n_text in ((1, 1020), (4, 0)):
        grid = torch.tensor([[1, 32, 32]] * images)  # 1024 patches -> 256 tokens each
        pixels = torch.randn(1024 * images, 3 * 2 * 14 * 14)
        parts = [torch.randint(3, 900, (n_text,))]
        for _ in range(images):
            parts += [torch.full((256,), 990), torch.randint(3, 900, (4,))]
        ids = torch.cat(parts)[None]
        kw = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
        kw["mm_token_type_ids"] = (ids == 990).int()

        def timed(fn):
            best = float("inf")
            for _ in range(3):
                model.zero_grad()
                t0 = time.perf_counter()
                fn().backward()
                best = min(best, time.perf_counter() - t0)
            return best

        step = timed(lambda: model(**kw, labels=ids).loss)
        tower = timed(lambda: model.model.visual(pixels, grid_thw=grid).pooler_output.sum())
        print(
            f"{images} image(s) x 256 tokens + {ids.shape[1] - 256 * images} text tokens: step "
            f"{step * 1e3:.0f} ms, vision tower {tower * 1e3:.0f} ms (share {tower / step:.2f})"
        )
    return 0


if __name__ == "__main__":
    modes = dict(share=vision_share, encoders=encoders, gemma3=gemma3)
    sys.exit(modes[sys.argv[1]]() if sys.argv[1:] else main())
