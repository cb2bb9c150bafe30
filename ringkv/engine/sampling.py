"""Sampling on the driver, batched over the rows of a step's logits on their device.

Per row, in this order (the order of transformers' logits processors):

1. penalties on the raw logits: repetition (prompt and output tokens: ``l / r`` if ``l > 0``
   else ``l * r``), then presence (``l - presence`` for tokens in the output) and frequency
   (``l - frequency x count``);
2. greedy rows (``temperature < GREEDY_TEMPERATURE``, 0 included, or ``top_k == 1``) take the
   argmax (dividing by a tiny temperature would overflow to inf and NaN);
3. the others: ``l / temperature``; top-k keeps the ``k`` largest; top-p the smallest set of
   the (top-k renormalised) distribution whose mass reaches ``top_p``; min-p drops tokens below
   ``min_p`` x the largest probability; then one draw per row with the request's own generator
   (``argmax(p / E)``, ``E ~ Exp(1)``: a categorical draw, one batched op after per-row noise).

Log-probabilities are the model's: ``log_softmax`` of the raw logits (before penalties,
temperature and filtering), for the sampled token and the ``logprobs`` most likely ones.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .params import GREEDY_TEMPERATURE, Logprob


def greedy(params) -> bool:
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def needs_logits(params) -> bool:
    """Whether the driver needs the row's logits (else the sampler rank's argmax will do)."""
    return not greedy(params) or params.penalized or params.logprobs is not None


def penalty_state(seq, vocab: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(in_prompt bool (V,), output counts float (V,))``, built once per sequence and then
    updated by ``observe`` as tokens are added (no per-step work that grows with the text)."""
    if seq.penalty is None:
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=device)] = True
        counts = torch.zeros(vocab, device=device)
        out = seq.output_token_ids
        if out:
            counts.index_add_(
                0, torch.tensor(out, device=device), torch.ones(len(out), device=device)
            )
        seq.penalty = (prompt, counts)
    return seq.penalty


def observe(seq, token: int) -> None:
    if seq.penalty is not None:
        seq.penalty[1][token] += 1


def apply_penalties(
    x: torch.Tensor, params, in_prompt: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``x (R, V)`` penalised as the module docstring says; ``in_prompt``/``counts`` ``(R, V)``."""

    def col(name):
        return torch.tensor([getattr(p, name) for p in params], dtype=x.dtype, device=x.device)[
            :, None
        ]

    r = col("repetition_penalty")
    seen = in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - col("presence_penalty") * (counts > 0) - col("frequency_penalty") * counts


def filter_logits(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Temperature-scaled logits ``x (R, V)`` with everything outside each row's top-k, top-p
    and min-p sets at ``-inf``. ``top_k`` (R,) int (<= 0: off), ``top_p``/``min_p`` (R,) float."""
    v = x.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sx, order = x.sort(dim=-1, descending=True)  # one batched sort
        rank = torch.arange(v, device=x.device)[None, :]
        k = torch.where(top_k > 0, top_k, v)[:, None]
        sx = sx.masked_fill(rank >= k, float("-inf"))
        probs = torch.softmax(sx, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        sx = sx.masked_fill((before >= top_p[:, None]) & (rank > 0), float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sx)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def sample(logits: torch.Tensor, seqs) -> Tuple[List[int], List[Optional[Logprob]]]:
    """Next token of each row of ``logits (M, vocab)`` fp32 under its sequence's params, and
    its ``Logprob`` (None where the request did not ask)."""
    m, v = logits.shape
    params = [s.params for s in seqs]
    x = logits
    pen = [i for i, p in enumerate(params) if p.penalized]
    if pen:
        states = [penalty_state(seqs[i], v, x.device) for i in pen]
        rows = torch.tensor(pen, device=x.device)
        x = x.clone()
        x[rows] = apply_penalties(
            x[rows],
            [params[i] for i in pen],
            torch.stack([s[0] for s in states]),
            torch.stack([s[1] for s in states]),
        )
    tokens = x.argmax(dim=-1)  # (M,): the greedy rows' answer
    drawn = [i for i, p in enumerate(params) if not greedy(p)]
    if drawn:
        rows = torch.tensor(drawn, device=x.device)
        sel = [params[i] for i in drawn]

        def col(name, dtype):
            return torch.tensor([getattr(p, name) for p in sel], dtype=dtype, device=x.device)

        xs = filter_logits(
            x[rows] / col("temperature", x.dtype)[:, None],
            col("top_k", torch.long),
            col("top_p", x.dtype),
            col("min_p", x.dtype),
        )
        noise = torch.stack(
            [torch.empty(v).exponential_(generator=seqs[i].generator) for i in drawn]
        )
        tokens[rows] = (torch.softmax(xs, dim=-1) / noise.to(x.device)).argmax(dim=-1)
    tokens = tokens.tolist()
    out: List[Optional[Logprob]] = [None] * m
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        lp = torch.log_softmax(logits[torch.tensor(asked, device=logits.device)], dim=-1)
        n = max(params[i].logprobs for i in asked)
        top_v, top_i = lp.topk(min(n, v), dim=-1) if n else (lp[:, :0], lp[:, :0].long())
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in asked], device=lp.device)[:, None])[
            :, 0
        ].tolist()
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(asked):
            k = params[i].logprobs
            out[i] = Logprob(tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
    return tokens, out
