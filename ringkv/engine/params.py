"""``SamplingParams`` (per request) and the outputs ``LLM.generate``/``LLM.stream`` return."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 16


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int = 16
    stop: List[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None  # reproducible sampling for this request
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    repetition_penalty: float = 1.0  # prompt and output tokens: logit / r if > 0 else logit * r
    presence_penalty: float = 0.0  # output tokens: logit - presence x (count > 0)
    frequency_penalty: float = 0.0  # output tokens: logit - frequency x count
    logprobs: Optional[int] = None  # log-prob of each sampled token and of the top ``logprobs`` ones
    n: int = 1  # samples of the prompt (they share its cached blocks)
    prompt_logprobs: Optional[int] = None  # 0: the log-prob of each prompt token after the first

    def problem(self) -> Optional[str]:
        """Why these params are invalid, or None."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            return f"top_k must be an int >= 0 (0 or -1 = off), got {self.top_k!r}"
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            return f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not all(isinstance(s, str) and s for s in stop):
            return f"stop must be a list of non-empty strings, got {self.stop!r}"
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.stop_token_ids):
            return f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            return f"seed must be an int or None, got {self.seed!r}"
        for name, lo, hi in (("min_p", 0, 1), ("repetition_penalty", 1e-9, float("inf")),
                             ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi) or not math.isfinite(v):
                return f"{name} must be a number in [{lo}, {hi}], got {v!r}"
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            return f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            return f"n must be an int in [1, {MAX_N}], got {self.n!r}"
        if self.prompt_logprobs not in (None, 0) or isinstance(self.prompt_logprobs, bool):
            return (f"prompt_logprobs must be None or 0 (each prompt token's own log-prob; top alternatives are "
                    f"not returned), got {self.prompt_logprobs!r}")
        return None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass
class Logprob:
    """A sampled token's log-probability under the model (log-softmax of its logits, before
    penalties, temperature and filtering) and the ``logprobs`` most likely tokens', best first."""
    token_id: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""
    index: int
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[List[Logprob]] = None


@dataclass
class RequestOutput:
    """A request's state. The flat fields (``token_ids``, ``text``, ``finish_reason``,
    ``logprobs``) are those of the first sample; ``outputs`` holds all ``n``."""
    request_id: Union[int, str]
    prompt: object  # the prompt as given (str or token ids)
    prompt_token_ids: List[int]
    token_ids: List[int]  # generated tokens (an EOS / stop token id that ended it is included)
    text: str  # decoded generated text ("" without a tokenizer); stop strings cut off
    finish_reason: Optional[str]  # "stop" | "length" | "error" | "abort"
    error: Optional[str] = None  # why the request failed (finish_reason == "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    logprobs: Optional[List[Logprob]] = None
    outputs: List[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Optional[List[float]] = None  # log p(prompt[i] | prompt[:i]) for i >= 1

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs) if self.outputs else \
            self.finish_reason is not None


@dataclass
class TokenDelta:
    """One streamed token: its id and the text it adds (may be "" mid-character)."""
    token_id: int
    text: str
    finish_reason: Optional[str] = None
