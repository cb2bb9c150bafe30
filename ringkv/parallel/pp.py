"""Pipeline parallelism: the decoder's layers cut into ``pp`` contiguous stages.

Stage 0 also holds the embedding, the last stage the final norm and the LM head; each stage
holds only its layers' weights and KV cache. Hidden states ``(T, hidden)`` go from a rank to
the rank with the same (sp, tp) coordinate in the next stage as one point-to-point message.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..sp.collectives import wait

HIDDEN_TAG = 7  # keeps stage-to-stage messages apart from the ring's and the driver's


def stage_sizes(
    num_layers: int, pp: int, layers: Optional[Sequence[int]] = None, head_cost: float = 0.0
) -> List[int]:
    """Layers per stage: ``layers`` as given (validated), else balanced for decode: the last
    stage also runs the LM head, which costs ``head_cost`` layers (its weights over a layer's),
    so it takes fewer layers; the other stages split the rest as evenly as possible (extra
    layers on the first ones)."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers; use pp <= {num_layers}")
    if layers is not None:
        layers = list(layers)
        if (
            len(layers) != pp
            or any(not isinstance(n, int) or n < 1 for n in layers)
            or sum(layers) != num_layers
        ):
            raise ValueError(
                f"pp_layers must list {pp} positive layer counts summing to {num_layers}, got "
                f"{layers}"
            )
        return layers
    if pp == 1:
        return [num_layers]

    def even(n: int, parts: int) -> List[int]:
        return [n // parts + (i < n % parts) for i in range(parts)]

    last = min(
        range(1, num_layers - pp + 2),  # the last stage's layers; ties: the even split
        key=lambda k: (
            max(-(-(num_layers - k) // (pp - 1)), k + head_cost),
            abs(k - num_layers / pp),
        ),
    )
    return even(num_layers - last, pp - 1) + [last]


def stage_range(sizes: Sequence[int], stage: int) -> range:
    first = sum(sizes[:stage])
    return range(first, first + sizes[stage])


def apply_pp(model, layers: range, first: bool, last: bool) -> None:
    """Keep only this stage's parts of ``model`` (on the meta device). Layers stay under their
    global index (``model.layers.<i>``), so checkpoint names still match."""
    m = model.model
    m.layers = nn.ModuleDict({str(i): m.layers[i] for i in layers})
    if not first:
        m.embed_tokens = None
    if not last:
        m.norm = None
        model.lm_head = None


def stage_forward(model, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
    """This stage's part of the forward pass: token ids ``(T,)`` on the first stage or hidden
    states ``(T, hidden)`` -> hidden states ``(T, hidden)`` (final-normed on the last stage)."""
    m = model.model
    if m.embed_tokens is not None:
        x = m.embed_tokens(x)  # (T, hidden)
    cos, sin = m.rotary.cos_sin(positions, x.dtype)  # (T, 1, D)
    for layer in m.layers.values() if isinstance(m.layers, nn.ModuleDict) else m.layers:
        x = layer(x, cos, sin, ctx)
    return m.norm(x) if m.norm is not None else x


class StageLink:
    """Sends hidden states to the next stage, receives them from the previous one. ``depth``:
    the steps the driver keeps in flight; a send older than that many steps has been received
    (the driver got that step's result before it published the step being run now)."""

    def __init__(self, timeout: Optional[timedelta] = None, depth: int = 1):
        self.timeout, self.depth = timeout, depth
        self.pending: List = []  # (work, tensor) of sends not known to be complete, oldest first

    def send(self, x: torch.Tensor, dst: int, tag: int = HIDDEN_TAG) -> None:
        """Post ``x`` to ``dst`` without waiting; the tensor is kept until its send is known to be
        complete. gloo marks a send complete only in ``wait()``, so sends older than ``depth``
        steps (two sends a step at most: a result and its prompt log-probs) are waited for here,
        which returns at once: what is kept stays bounded (the last stage's results too)."""
        x = x.contiguous()
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        while len(self.pending) >= 2 * self.depth:
            w, t = self.pending.pop(0)
            wait(w, t, self.timeout, "an earlier send to the next pipeline stage")
        self.pending.append((dist.isend(x, dst, tag=tag), x))

    def recv(self, shape, dtype, device, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        wait(
            dist.irecv(x, src, tag=HIDDEN_TAG),
            x,
            self.timeout,
            f"hidden states from pipeline rank {src}",
        )
        return x

    def flush(self) -> None:
        for w, t in self.pending:
            wait(w, t, self.timeout, "hidden states to the next pipeline stage")
        self.pending = []
