"""The hybrid families against the unpatched model, as numbers (``test_hf_hybrid.py`` asserts the
same comparisons within tolerances):

    python -m tests.hybrid_report            # sp = 2 (zigzag) and 3 (contiguous), every family

For each family of ``tests.hybrid_cases.FAMILIES`` and ``MORE`` (tiny random models, float32) and SP
size it prints the training loss's absolute difference (patched - unpatched, chunked loss), the
gradient differences (``compare``) and the largest eval-logit difference."""

from __future__ import annotations

import sys

import torch

from tests.dist import World
from tests.hybrid_cases import FAMILIES, MORE
from tests.test_hf_hybrid import _ids, _reference

CASES = ((2, "zigzag", 13), (3, "contiguous", 14))


def compare(res, logits, loss, grads) -> dict:
    """Differences of the ranks' results ``res`` from the unpatched ``(logits, loss, grads)``:
    the largest absolute gradient difference over all parameters (gradients summed over the
    group) beside the largest gradient, and the parameter where the difference is largest
    relative to that parameter's own largest gradient (tiny gradients, e.g. of experts few
    tokens reach, make that ratio large at float noise)."""
    d_loss = max(abs(r["loss"] - loss) for r in res)
    d_logits = max((r["logits"] - logits).abs().max().item() for r in res)
    d_grad, g_max, worst = 0.0, 0.0, (0.0, "", 0.0)
    for name, want in grads.items():
        diff = (sum(r["grads"][name] for r in res) - want).abs().max().item()
        scale = want.abs().max().item()
        d_grad, g_max = max(d_grad, diff), max(g_max, scale)
        worst = max(worst, (diff / max(scale, 1e-30), name, scale))
    out = dict(loss=loss, d_loss=d_loss, d_grad=d_grad, g_max=g_max, worst=worst, n=len(grads))
    return dict(out, d_logits=d_logits)


HEADER = (
    "| family | sp | layout | tokens | loss | loss diff | max grad diff (max grad) "
    "| worst relative (its max grad) | max logit diff |\n|" + "---|" * 9
)


def row(family, sp, layout, s, c) -> str:
    rel, name, scale = c["worst"]
    return (
        f"| {family} | {sp} | {layout} | 2 x {s} | {c['loss']:.5f} | {c['d_loss']:.1e} | "
        f"{c['d_grad']:.1e} ({c['g_max']:.1e}; {c['n']} params) | {rel:.1e} `{name}` "
        f"({scale:.1e}) | {c['d_logits']:.1e} |"
    )


def main() -> int:
    torch.manual_seed(0)
    world = World(max(sp for sp, _, _ in CASES))
    try:
        print(HEADER)
        for family in FAMILIES + MORE:
            for sp, layout, s in CASES:
                ids = _ids(2, s, sp)
                want = _reference(family, 0, ids)
                res = world.check("tests.hybrid_cases:train_step", sp, family, 0, ids, layout)
                print(row(family, sp, layout, s, compare(res, *want)), flush=True)
    finally:
        world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
