"""Which sequence-parallel attention a model runs on ``world`` ranks: the ring, Ulysses, or USP
(Ulysses ``U`` x ring ``R``), priced by the planner's time model (``simulation``: one rank's
forward ring attention, messages over a link of the hardware table). What
``patch_model(method="auto")`` and ``patch_model(method="usp")`` without ``ulysses=`` choose
with (``choose_sp``); ``local_rates`` gives the rates of the device a model is on.

One layer's forward on the busiest rank, for each ``U`` dividing ``world`` with ``U <= heads``:

- attention: ``ring_attention_seconds`` over ``R = world / U`` ranks for that rank's query heads
  (``ceil(H/U)`` where the split is uneven) and the KV heads its kernel runs with
  (``HeadSplit``): R steps of the causal work, each overlapped with its K/V block's transfer;
- Ulysses (``U > 1``): the two all-to-alls (q, K, V there; out back), not overlapped, the bytes
  that rank sends (``ulysses_bytes``) over the link, plus one latency each.

The smallest time wins; a split with ``U > 1`` must win by more than 2% (the rule of
``plan()``: one more collective to run). ``U = 1`` is the ring, ``U = world`` Ulysses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from ..sp.ulysses import HeadSplit
from .hardware import Rates, load_hardware, rates, with_threads
from .simulation import message_seconds, ring_attention_seconds

__all__ = ["SPChoice", "choose_sp", "sp_seconds", "ulysses_bytes", "local_rates"]

ULYSSES_MARGIN = 1.02  # a Ulysses split must be modelled this much faster than the plain ring


@dataclass(frozen=True)
class SPChoice:
    """``method`` (``"ring"``, ``"ulysses"`` or ``"usp"``) with ``ulysses`` x ``ring`` ranks;
    ``seconds``: the modelled forward seconds per layer of every degree ``U`` considered;
    ``why``: the reason in words."""

    method: str
    ulysses: int
    ring: int
    seconds: Dict[int, float]
    why: str


def _kernel_heads(split: HeadSplit) -> list:
    """``(query heads, KV heads)`` each rank's kernel runs with."""
    out = []
    for r in range(split.world):
        hq = len(split.q_heads(r))
        out.append((hq, hq // split.group(r)))
    return out


def ulysses_bytes(split: HeadSplit, tokens: int, d: int, dv: int, act: int) -> int:
    """Bytes the busiest rank of a Ulysses group sends in one forward (both all-to-alls), each
    rank holding ``tokens`` of the sequence: q of rank ``j``'s heads and the K/V heads it receives
    to every other rank ``j``, then its own heads' output of every other rank's tokens."""
    n = split.world
    kv = [len(split.kv_heads_of(j)) for j in range(n)]
    hq = [len(split.q_heads(j)) for j in range(n)]
    to_j = [tokens * (hq[j] * d + kv[j] * (d + dv)) for j in range(n)]
    return max((sum(to_j) - to_j[r] + tokens * (n - 1) * hq[r] * dv) * act for r in range(n))


def sp_seconds(
    heads: int,
    kv_heads: int,
    d: int,
    seq: int,
    ulysses: int,
    ring: int,
    act: int,
    r: Rates,
    link: str,
    dv: Optional[int] = None,
) -> float:
    """One layer's modelled forward attention seconds on the busiest rank with Ulysses
    ``ulysses`` x ring ``ring`` (see the module docstring)."""
    dv = dv or d
    split = HeadSplit(heads, kv_heads, ulysses)
    attn = max(
        ring_attention_seconds(seq, hq, hkv, d, ring, act, r, link)[0]
        for hq, hkv in set(_kernel_heads(split))
    )
    if ulysses == 1:
        return attn
    tokens = -(-seq // (ulysses * ring))
    return attn + message_seconds(ulysses_bytes(split, tokens, d, dv, act), link, r, 2)


def _name(u: int, world: int) -> str:
    return "ring" if u == 1 else "ulysses" if u == world else "usp"


def _label(u: int, world: int) -> str:
    return _name(u, world) + (f" {u}x{world // u}" if 1 < u < world else "")


def choose_sp(
    heads: int,
    kv_heads: int,
    d: int,
    world: int,
    seq: int,
    r: Rates,
    link: str,
    *,
    act: int = 2,
    dv: Optional[int] = None,
    degrees: Optional[Sequence[int]] = None,
    source: str = "",
) -> SPChoice:
    """The fastest of the Ulysses degrees ``degrees`` (default: every divisor ``U`` of ``world``
    with ``U <= heads``; ``U = 1`` is the ring, ``U = world`` Ulysses) for a sequence of ``seq``
    tokens, as ``SPChoice``. ``source``: where the rates come from, for ``why``."""
    if degrees is None:
        degrees = [u for u in range(1, world + 1) if world % u == 0 and u <= heads]
    seconds = {
        u: sp_seconds(heads, kv_heads, d, seq, u, world // u, act, r, link, dv) for u in degrees
    }
    best = min(seconds, key=lambda u: (seconds[u] * (ULYSSES_MARGIN if u > 1 else 1.0), u))
    split = HeadSplit(heads, kv_heads, best)
    per_rank = "/".join(str(n) for n in sorted({len(split.q_heads(j)) for j in range(best)})[::-1])
    times = ", ".join(f"{_label(u, world)} {seconds[u] * 1e3:.3g} ms" for u in sorted(seconds))
    why = (
        f"{_label(best, world)}: "
        + (f"query heads per Ulysses rank {per_rank}" if best > 1 else "every rank all heads")
        + f" (heads {heads}, kv heads {kv_heads}); modelled forward attention per layer at "
        f"{seq} tokens on {world} ranks ({source or 'the given rates'}, link {link}): {times}"
        + ("; a split needs to win by 2% over the ring" if len(seconds) > 1 else "")
    )
    return SPChoice(_name(best, world), best, world // best, seconds, why)


def local_rates(device, dtype: str) -> Tuple[Rates, str, str]:
    """``(rates, link, source)`` of the hardware table for ``device`` (a ``torch.device``) and the
    activation ``dtype`` name: a CPU process (the table's ``"cpu"`` per-thread rates times its
    threads, over ``loopback``) or the table's GPU whose name the CUDA device's contains (NVLink;
    an H100 when none matches)."""
    import torch

    hw = load_hardware()
    dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    if device.type != "cuda":
        r = with_threads(rates(hw, "cpu", dtype), torch.get_num_threads())
        return r, "loopback", f"hardware table 'cpu' x {torch.get_num_threads()} threads"
    name = torch.cuda.get_device_name(device).lower()
    gpu = next((g for g in hw["gpus"] if g != "cpu" and g in name), "h100")
    g = hw["gpus"][gpu]
    link = "nvlink" if "nvlink" in g["links"] else next(iter(g["links"]))
    return rates(hw, gpu, dtype), link, f"hardware table {gpu!r}"
