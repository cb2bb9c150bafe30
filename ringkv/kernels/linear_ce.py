"""Cross-entropy of a linear head that never builds the whole logits tensor.

    # hidden (N, H), weight (V, H), targets (N,)
    loss_sum = linear_cross_entropy(hidden, weight, targets)

The language-model loss at long context is dominated by its logits: ``(N, V)`` in float32 for
``N`` tokens and a vocabulary of ``V`` (49K-256K), kept alive several times over by autograd.
Here the tokens go through the head in chunks of ``chunk`` rows. When a gradient is needed the
forward computes it chunk by chunk as well (the softmax minus the one-hot target, times the
head): ``d hidden`` ``(N, H)`` and ``d weight`` ``(V, H)`` (float32 accumulation), so at most one
chunk's logits are alive at any time, in forward and in backward; the backward only scales the
stored gradients by the incoming scalar. That is the same three matrix products the unfused
head and loss do (one forward, two backward).

Exactness: per chunk, ``logits = (hidden @ weight.T + bias).float()`` as the unfused head
computes them in the weights' dtype and the loss then upcasts; log-softmax and its gradient in
float32; ``d hidden`` is cast back to the hidden states' dtype as autograd would, and ``d weight``
is accumulated over chunks in float32 before the cast. ``softcap`` (Gemma's
``final_logit_softcapping``: ``cap * tanh(logits / cap)``) and ``scale`` (a factor on the
logits: Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) are applied in float32.

Single-device math, no communication: ``ringkv.hf`` adds the SP group's sum.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["linear_cross_entropy", "default_chunk"]

CHUNK_BYTES = 64 * 2**20  # one chunk's float32 logits: a constant, whatever the length


def default_chunk(vocab: int) -> int:
    """Rows per chunk: about ``CHUNK_BYTES`` of float32 logits (at least 16 rows)."""
    return max(16, CHUNK_BYTES // (4 * max(1, vocab)))


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], softcap, scale):
    """``(n, V)`` float32 logits of the chunk ``h`` ``(n, H)`` and ``tanh(z / cap)`` (None without
    softcap)."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    if scale is not None:
        z = z * scale
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk, softcap, scale):
        n = hidden.shape[0]
        grad = any(ctx.needs_input_grad[:3])
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if want_h else None  # (N, H)
        d_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        d_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        )
        for lo in range(0, n, chunk):
            h, y = hidden[lo : lo + chunk], targets[lo : lo + chunk]  # (c, H), (c,)
            logits, t = _logits(h, weight, bias, softcap, scale)  # (c, V) float32
            lse = torch.logsumexp(logits, -1)  # (c,)
            valid = y != ignore_index
            safe = torch.where(valid, y, 0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if not grad:
                continue
            # d loss / d logits = softmax - onehot on counted rows; then through softcap and scale
            g = logits.sub_(lse[:, None]).exp_()  # (c, V) in place
            g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
            g.mul_(valid[:, None])
            if t is not None:
                g.mul_(1.0 - t * t)
            if scale is not None:
                g.mul_(scale)
            if want_h:
                d_hidden[lo : lo + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                d_weight.addmm_(g.t(), h.float())
            if want_b:
                d_bias += g.sum(0)
            del g, logits, t
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        g = grad_out.float()
        dh = None if d_hidden is None else d_hidden * g.to(d_hidden.dtype)
        dw = None if d_weight is None else (d_weight * g).to(ctx.dtypes[0])
        db = None if d_bias is None else (d_bias * g).to(ctx.dtypes[1])
        return dh, dw, db, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    chunk: Optional[int] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``.

    ``hidden`` ``(N, H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or None, ``targets`` ``(N,)``
    integer (``ignore_index`` rows count nothing). ``chunk``: rows per chunk (default: about
    64 MiB of float32 logits, ``default_chunk(V)``). Returns a float32 scalar, the sum over counted
    rows (divide it by the count, or by ``num_items_in_batch``, for a mean); differentiable in
    ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden must be (N, H) and weight (V, H), got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point:
        raise ValueError(
            f"linear_cross_entropy: targets must be (N,) = ({hidden.shape[0]},) integers, got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy: bias must be (V,) = ({weight.shape[0]},), got "
            f"{tuple(bias.shape)}"
        )
    if chunk is None:
        chunk = default_chunk(weight.shape[0])
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(
            f"linear_cross_entropy: chunk must be a positive int (rows per chunk), got {chunk!r}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be positive or None, got {softcap!r}")
    targets = targets.to(hidden.device).long()
    return _LinearCrossEntropy.apply(
        hidden, weight, bias, targets, ignore_index, chunk, softcap, scale
    )
