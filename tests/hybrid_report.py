"""The hybrid families against the unpatched model, as numbers (``test_hf_hybrid.py`` asserts the
same comparisons within tolerances):

    python -m tests.hybrid_report            # sp = 2 (zigzag) and 3 (contiguous), every family

For each family of ``tests.hybrid_cases.FAMILIES`` (tiny random models, float32) and SP size it
prints the training loss's absolute difference (patched - unpatched, chunked loss), the largest
gradient difference over all parameters (gradients summed over the SP group) relative to that
parameter's largest gradient, and the largest eval-logit difference."""

from __future__ import annotations

import sys

import torch

from tests.dist import World
from tests.hybrid_cases import FAMILIES
from tests.test_hf_hybrid import _ids, _reference

CASES = ((2, "zigzag", 13), (3, "contiguous", 14))


def compare(res, logits, loss, grads) -> dict:
    """Differences of the ranks' results ``res`` from the unpatched ``(logits, loss, grads)``."""
    d_loss = max(abs(r["loss"] - loss) for r in res)
    d_logits = max((r["logits"] - logits).abs().max().item() for r in res)
    d_grad = 0.0
    for name, want in grads.items():
        total = sum(r["grads"][name] for r in res)
        scale = max(want.abs().max().item(), 1e-12)
        d_grad = max(d_grad, (total - want).abs().max().item() / scale)
    return dict(loss=loss, d_loss=d_loss, d_grad=d_grad, d_logits=d_logits, params=len(grads))


def main() -> int:
    torch.manual_seed(0)
    world = World(max(sp for sp, _, _ in CASES))
    try:
        print(
            "| family | sp | layout | tokens | loss | abs. loss diff | max rel. grad diff "
            "| max logit diff |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for family in FAMILIES:
            for sp, layout, s in CASES:
                ids = _ids(2, s, sp)
                want = _reference(family, 0, ids)
                res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, layout)
                c = compare(res, *want)
                print(
                    f"| {family} | {sp} | {layout} | 2 x {s} | {c['loss']:.5f} | "
                    f"{c['d_loss']:.1e} | {c['d_grad']:.1e} ({c['params']} params) | "
                    f"{c['d_logits']:.1e} |",
                    flush=True,
                )
    finally:
        world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
