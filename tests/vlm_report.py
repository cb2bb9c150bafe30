"""The vision-language models against the unpatched model, as numbers (``test_hf_vlm.py`` asserts
the same comparisons within tolerances):

    python -m tests.vlm_report            # every model of tests.vlm_cases (VLMS, MORE), sp 2 and 3
    python -m tests.vlm_report share      # the vision tower's share of a training step

For each tiny random model (float32), number of images and SP size it prints the largest absolute
differences from the unpatched model: training loss, every gradient (summed over the group, the
vision tower's included), eval logits (gathered), generate's scores over 3 greedy steps, and
whether the generated tokens are equal on every rank."""

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
    sys.exit(vision_share() if sys.argv[1:] == ["share"] else main())
