"""Cross-entropy and per-token log-probs of a linear head that never build the whole logits tensor.

    # hidden (N, H), weight (V, H), targets (N,)
    loss_sum = linear_cross_entropy(hidden, weight, targets)
    logp, entropy, top1 = linear_log_probs(hidden, weight, targets, entropy=True, top1=True)  # (N,)

The language-model loss at long context is dominated by its logits: ``(N, V)`` in float32 for
``N`` tokens and a vocabulary of ``V`` (49K-256K), kept alive several times over by autograd.
Here the tokens go through the head in chunks of ``chunk`` rows. When a gradient is needed the
forward computes it chunk by chunk as well (the softmax minus the one-hot target, times the
head): ``d hidden`` ``(N, H)`` and ``d weight`` ``(V, H)`` (float32 accumulation), so at most one
chunk's logits are alive at any time, in forward and in backward; the backward only scales the
stored gradients by the incoming scalar. That is the same three matrix products the unfused
head and loss do (one forward, two backward).

``linear_log_probs`` is the "selective log-softmax" of post-training (TRL's per-token log-probs,
DPO, GRPO): the log-prob of the target at every row, optionally the entropy of the row's
distribution and whether the target is its argmax (the first maximum, as ``argmax``). Its incoming
gradient is one value per row, unknown in forward, so its backward recomputes each chunk's logits
(four matrix products in all); it saves only ``(N,)`` statistics besides its inputs. Log-probs and
entropy are differentiable (TRL's GRPO has an entropy bonus); ``is_top1`` is not.

Exactness: per chunk, ``logits = (hidden @ weight.T + bias).float()`` as the unfused head
computes them in the weights' dtype and the loss then upcasts; log-softmax and its gradient in
float32; ``d hidden`` is cast back to the hidden states' dtype as autograd would, and ``d weight``
is accumulated over chunks in float32 before the cast. ``softcap`` (Gemma's
``final_logit_softcapping``: ``cap * tanh(logits / cap)``) and ``scale`` (a factor on the
logits: Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) are applied in float32, in
that order: ``cap * tanh(scale * z / cap)``; ``linear_log_probs``'s ``temperature`` then divides
(TRL's order).

Single-device math, no communication: ``ringkv.hf`` adds the SP group's sum.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["linear_cross_entropy", "linear_log_probs", "TokenLogProbs", "default_chunk"]

CHUNK_BYTES = 64 * 2**20  # one chunk's float32 logits: a constant, whatever the length


def default_chunk(vocab: int) -> int:
    """Rows per chunk: about ``CHUNK_BYTES`` of float32 logits (at least 16 rows)."""
    return max(16, CHUNK_BYTES // (4 * max(1, vocab)))


class _Head(NamedTuple):
    """The head as a chunk sees it: ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or None, and the
    transform of its logits (``scale``, then ``softcap``, then ``1 / temperature``)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: Optional[float]
    scale: Optional[float]
    temperature: float = 1.0

    def logits(self, h: torch.Tensor):
        """``(n, V)`` float32 logits of the chunk ``h`` ``(n, H)`` and ``tanh(.)`` of the softcap
        (None without)."""
        z = torch.nn.functional.linear(h, self.weight, self.bias).float()
        if self.scale is not None:
            z = z * self.scale
        t = None
        if self.softcap is not None:
            t = torch.tanh(z / self.softcap)
            z = t * self.softcap
        if self.temperature != 1.0:
            z = z / self.temperature
        return z, t

    def chain_(self, g: torch.Tensor, t: Optional[torch.Tensor]) -> torch.Tensor:
        """``d/d logits`` ``g`` ``(n, V)`` (in place) into ``d/d (hidden @ weight.T + bias)``."""
        if self.temperature != 1.0:
            g.div_(self.temperature)
        if t is not None:
            g.mul_(1.0 - t * t)
        if self.scale is not None:
            g.mul_(self.scale)
        return g


class _Grads:
    """Gradient buffers for the inputs whose gradient is wanted (``wants``: hidden, weight, bias):
    ``d hidden`` ``(N, H)`` in hidden's dtype, ``d weight`` and ``d bias`` float32 sums over
    chunks; ``buffers`` is the three (None where not wanted)."""

    def __init__(self, hidden, head: _Head, wants):
        w, b = head.weight, head.bias
        f32 = dict(dtype=torch.float32)
        self.head = head
        self.buffers = (
            torch.empty_like(hidden) if wants[0] else None,
            torch.zeros(w.shape, device=w.device, **f32) if wants[1] else None,
            torch.zeros(b.shape, device=b.device, **f32) if wants[2] else None,
        )

    def add(self, g: torch.Tensor, h: torch.Tensor, lo: int) -> None:
        """Rows ``lo:lo+n``: ``g`` ``(n, V)`` float32 (after ``chain_``), ``h`` ``(n, H)``."""
        d_hidden, d_weight, d_bias = self.buffers
        if d_hidden is not None:
            w = self.head.weight
            d_hidden[lo : lo + g.shape[0]] = (g.to(w.dtype) @ w).to(d_hidden.dtype)
        if d_weight is not None:
            d_weight.addmm_(g.t(), h.float())
        if d_bias is not None:
            d_bias += g.sum(0)


def _dtypes(weight, bias) -> tuple:
    """What ``_cast`` casts the three buffers to (d hidden is in hidden's dtype already)."""
    return None, weight.dtype, None if bias is None else bias.dtype


def _cast(buffers, dtypes, factor=None) -> tuple:
    """``_Grads.buffers`` times ``factor`` (a float32 scalar, or None), cast to ``dtypes``."""
    out = []
    for grad, dtype in zip(buffers, dtypes):
        if grad is not None and factor is not None:
            grad = grad * factor.to(grad.dtype)
        out.append(grad if grad is None or dtype is None else grad.to(dtype))
    return tuple(out)


def _rows(targets: torch.Tensor, ignore_index: int):
    """``(valid, safe)``: the counted rows ``(n,)`` and targets with 0 at the others."""
    valid = targets != ignore_index
    return valid, torch.where(valid, targets, 0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk, softcap, scale):
        head = _Head(weight, bias, softcap, scale)
        grads = _Grads(hidden, head, ctx.needs_input_grad[:3])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk):
            h, y = hidden[lo : lo + chunk], targets[lo : lo + chunk]  # (c, H), (c,)
            logits, t = head.logits(h)  # (c, V) float32
            lse = torch.logsumexp(logits, -1)  # (c,)
            valid, safe = _rows(y, ignore_index)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if not any(ctx.needs_input_grad[:3]):
                continue
            # d loss / d logits = softmax - onehot on counted rows; then through the transform
            g = logits.sub_(lse[:, None]).exp_()  # (c, V) in place
            g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
            g.mul_(valid[:, None])
            grads.add(head.chain_(g, t), h, lo)
            del g, logits, t
        ctx.save_for_backward(*grads.buffers)
        ctx.dtypes = _dtypes(weight, bias)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = _cast(ctx.saved_tensors, ctx.dtypes, grad_out.float())
        return (*grads, None, None, None, None, None)


class TokenLogProbs(NamedTuple):
    """``linear_log_probs``'s rows ``(N,)``, 0 (False) where the target is ``ignore_index``:
    ``log_probs`` (float32), ``entropy`` (float32, or None), ``is_top1`` (bool, or None) and
    ``mean_logits`` (float32, or None: the mean over the vocabulary of the row's transformed logits,
    TRL's ``logits/chosen`` metric; no gradient)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    is_top1: Optional[torch.Tensor]
    mean_logits: Optional[torch.Tensor] = None


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        ignore_index,
        chunk,
        spec,
        want_ent,
        want_top1,
        want_mean,
    ):
        ctx.set_materialize_grads(False)  # an unused entropy (a metric) costs no backward work
        head = spec._replace(weight=weight, bias=bias)
        n, f32 = hidden.shape[0], dict(dtype=torch.float32, device=hidden.device)
        logp, lse = torch.zeros(n, **f32), torch.empty(n, **f32)  # (N,)
        ent = torch.zeros(n, **f32) if want_ent else None
        top1 = torch.zeros(n, dtype=torch.bool, device=hidden.device) if want_top1 else None
        mean = torch.zeros(n, **f32) if want_mean else None
        for lo in range(0, n, chunk):
            rows = slice(lo, lo + chunk)
            z, _ = head.logits(hidden[rows])  # (c, V) float32
            valid, safe = _rows(targets[rows], ignore_index)  # (c,)
            lse[rows] = torch.logsumexp(z, -1)
            logp[rows] = torch.where(valid, z.gather(1, safe[:, None]).squeeze(1) - lse[rows], 0.0)
            if want_top1:
                top1[rows] = valid & (z.argmax(-1) == safe)
            if want_mean:
                mean[rows] = torch.where(valid, z.mean(-1), 0.0)
            if want_ent:
                logp_v = z.sub_(lse[rows, None])  # (c, V) log-softmax, in place
                ent[rows] = torch.where(valid, _entropy(logp_v.exp(), logp_v), 0.0)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.args = (ignore_index, chunk, spec)
        ctx.mark_non_differentiable(*(x for x in (top1, mean) if x is not None))
        return logp, ent, top1, mean

    @staticmethod
    def backward(ctx, g_logp, g_ent, _top1, _mean):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        ignore_index, chunk, spec = ctx.args
        head = spec._replace(weight=weight, bias=bias)
        grads = _Grads(hidden, head, ctx.needs_input_grad[:3])
        for lo in range(0, hidden.shape[0], chunk):
            rows = slice(lo, lo + chunk)
            z, t = head.logits(hidden[rows])  # (c, V) float32, recomputed
            gl, ge = (None if x is None else x[rows] for x in (g_logp, g_ent))
            g = _rows_grad(z, targets[rows], ignore_index, lse[rows], gl, ge)
            grads.add(head.chain_(g, t), hidden[rows], lo)
            del g, z, t
        return (*_cast(grads.buffers, _dtypes(weight, bias)), *(None,) * 7)


def _entropy(p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``-sum_v p_v log p_v`` of rows ``(c, V)``: from the rounded ``log p`` itself, so that in
    ``log p_v + H`` (its gradient) their common rounding cancels, as in autograd's (``lse -
    sum_v p_v z_v`` loses ``|z| * eps`` there: 1e-3 of the gradient of a peaked row)."""
    return -(p * logp).sum(-1)


def _rows_grad(z, y, ignore_index, lse, g_logp, g_ent) -> torch.Tensor:
    """``d/d z`` ``(c, V)`` of ``sum(g_logp * log p_y) + sum(g_ent * H)`` from the chunk's logits
    ``z`` (consumed), targets ``y``, ``lse`` and incoming gradients (``(c,)`` each; one of the
    gradients may be None); uncounted rows get zero."""
    valid, safe = _rows(y, ignore_index)
    logp = z.sub_(lse[:, None])  # (c, V) log-softmax, in place
    p = logp.exp()
    gl = None if g_logp is None else g_logp.float() * valid  # (c,)
    if g_ent is None:  # d log p_y / d z_v = onehot - p
        g = p.mul_(-gl[:, None])
    else:  # d H / d z_v = -p_v (log p_v + H)
        ge = g_ent.float() * valid
        g = logp.add_(_entropy(p, logp)[:, None]).mul_(p).mul_(-ge[:, None])
        if gl is not None:
            g.sub_(p.mul_(gl[:, None]))
    if gl is not None:
        g[torch.arange(g.shape[0], device=g.device), safe] += gl
    return g


def _check(name, hidden, weight, targets, bias, chunk, softcap) -> int:
    """The checks both functions share; returns the chunk (default: ``default_chunk(V)``)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{name}: hidden must be (N, H) and weight (V, H), got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point:
        raise ValueError(
            f"{name}: targets must be (N,) = ({hidden.shape[0]},) integers, got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"{name}: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if chunk is None:
        chunk = default_chunk(weight.shape[0])
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{name}: chunk must be a positive int (rows per chunk), got {chunk!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{name}: softcap must be positive or None, got {softcap!r}")
    return chunk


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
    chunk = _check("linear_cross_entropy", hidden, weight, targets, bias, chunk, softcap)
    targets = targets.to(hidden.device).long()
    return _LinearCrossEntropy.apply(
        hidden, weight, bias, targets, ignore_index, chunk, softcap, scale
    )


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    chunk: Optional[int] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
    temperature: float = 1.0,
    entropy: bool = False,
    top1: bool = False,
    mean_logits: bool = False,
) -> TokenLogProbs:
    """Per-row ``log_softmax(z)[target]`` of the logits ``z`` of ``hidden @ weight.T (+ bias)``
    (``scale``, ``softcap``, ``/ temperature`` applied), in chunks of ``chunk`` rows.

    ``hidden`` ``(N, H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or None, ``targets`` ``(N,)``
    integer. Returns ``TokenLogProbs`` of ``(N,)`` rows, 0 where the target is ``ignore_index``:
    ``log_probs`` float32; with ``entropy=True`` the entropy ``-sum_v p_v log p_v`` of each row,
    float32; with ``top1=True`` whether ``argmax(z) == target`` (bool, no gradient); with
    ``mean_logits=True`` the mean of ``z`` over the vocabulary (float32, no gradient). Log-probs and
    entropy are differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    chunk = _check("linear_log_probs", hidden, weight, targets, bias, chunk, softcap)
    if not temperature > 0:
        raise ValueError(f"linear_log_probs: temperature must be positive, got {temperature!r}")
    spec = _Head(None, None, softcap, scale, float(temperature))  # the tensors come in forward
    targets = targets.to(hidden.device).long()
    out = _LinearLogProbs.apply(
        hidden,
        weight,
        bias,
        targets,
        ignore_index,
        chunk,
        spec,
        bool(entropy),
        bool(top1),
        bool(mean_logits),
    )
    return TokenLogProbs(*out)
