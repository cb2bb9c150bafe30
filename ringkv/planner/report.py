"""Output of ``ringkv plan``: ``format_table`` (one row per option, the recommended one marked
``*``) and ``plot`` (prefill time against decode tokens/s; ``_svg`` without matplotlib)."""

from __future__ import annotations

import math
from typing import List

from .memory import gb
from .options import Option


def format_table(options: List[Option]) -> str:
    """One row per option, the recommended one marked ``*``."""
    head = (
        f"{'':1s} {'tp':>3s} {'pp':>3s} {'sp':>4s} {'uly':>3s} {'kv':>8s} {'weights/GPU':>11s} "
        f"{'KV B/tok/GPU':>12s} {'KV/GPU':>9s} {'fits':>4s} {'ring B/step':>11s} "
        f"{'TP AR B/layer':>13s} "
        f"{'prefill':>9s} {'decode tok/s':>12s}  reason"
    )
    lines = [head]
    for o in options:
        lines.append(
            f"{'*' if o.recommended else ' '} {o.tp:3d} {o.pp:3d} {o.sp:4d} {o.ulysses:3d} "
            f"{o.kv_cache_dtype:>8s} {gb(o.weight_bytes_per_gpu):>11s} "
            f"{o.kv_bytes_per_token_per_gpu:12,d} "
            f"{gb(o.kv_bytes_per_gpu):>9s} {'yes' if o.fits else 'no':>4s} "
            f"{o.ring_bytes_per_step:11.3g} "
            f"{o.tp_allreduce_bytes_per_layer:13.3g} {o.prefill_s:8.3g}s "
            f"{o.decode_tokens_per_s:12.3g}  "
            f"{o.reason}"
        )
    return "\n".join(lines)


def plot(options: List[Option], path: str, title: str = "") -> None:
    """Prefill time against decode tokens/s of every option (matplotlib; a plain SVG without it)."""
    pts = [
        (
            o.prefill_s,
            o.decode_tokens_per_s,
            f"tp{o.tp} pp{o.pp} sp{o.sp}" + (f" u{o.ulysses}" if o.ulysses > 1 else ""),
            o,
        )
        for o in options
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg(pts, path, title)
    fig, ax = plt.subplots(figsize=(8, 5))
    for x, y, label, o in pts:
        style = (
            dict(marker="*", s=200, c="tab:red")
            if o.recommended
            else dict(marker="o", c="tab:blue")
            if o.fits
            else dict(marker="x", c="tab:gray")
        )
        ax.scatter([x], [y], **style)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted prefill (s)")
    ax.set_ylabel("predicted decode (tokens/s)")
    ax.set_title(title or "ringkv plan: * recommended, o fits, x does not fit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _svg(pts, path: str, title: str) -> None:
    w, h, m = 640, 400, 50
    xs = [math.log10(max(p[0], 1e-12)) for p in pts]
    ys = [math.log10(max(p[1], 1e-12)) for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs) + 1e-9, min(ys), max(ys) + 1e-9
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="9">',
        f'<text x="{m}" '
        f'y="20">{title or "ringkv plan (log-log): prefill s (x) vs decode tok/s (y)"}</text>',
    ]
    for (px, py, label, o), lx, ly in zip(pts, xs, ys):
        cx = m + (lx - x0) / (x1 - x0) * (w - 2 * m)
        cy = h - m - (ly - y0) / (y1 - y0) * (h - 2 * m)
        color = "red" if o.recommended else "blue" if o.fits else "gray"
        out.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color}"/>'
            f'<text x="{cx + 5:.1f}" y="{cy - 5:.1f}">{label}</text>'
        )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))
