"""The vision-language models against the unpatched model, as numbers (``test_hf_vlm.py`` asserts
the same comparisons within tolerances):

    python -m tests.vlm_report            # every model of tests.vlm_cases.VLMS at sp = 2 and 3

For each tiny random model (float32), number of images and SP size it prints the largest absolute
differences from the unpatched model: training loss, every gradient (summed over the group, the
vision tower's included), eval logits (gathered), generate's scores over 3 greedy steps, and
whether the generated tokens are equal on every rank."""

from __future__ import annotations

import sys

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
        for arch in vc.VLMS:
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


if __name__ == "__main__":
    sys.exit(main())
