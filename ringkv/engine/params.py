"""``SamplingParams`` (per request) and the outputs ``LLM.generate``/``LLM.stream`` return."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 16
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string (a stream holds back one less than the longest)
MAX_STOP_TOKEN_IDS = 1024
GREEDY_TEMPERATURE = (
    1e-5  # temperatures below this are greedy (vLLM's rule): l / T overflows near 1e-38
)
INT64 = 1 << 63  # seed and top_k must fit in an int64 (torch's generator and tensors)


@dataclass
class SamplingParams:
    """What one request samples. ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) or
    ``top_k=1`` is greedy. ``problem()`` bounds what a request may ask: ``n <= MAX_N``,
    ``logprobs <= MAX_LOGPROBS``, at most ``MAX_STOP`` stop strings of at most
    ``MAX_STOP_CHARS`` characters, at most ``MAX_STOP_TOKEN_IDS`` stop token ids, ``seed`` and
    ``top_k`` within int64."""

    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) = greedy
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
    logprobs: Optional[int] = (
        None  # log-prob of each sampled token and of the top ``logprobs`` ones
    )
    n: int = 1  # samples of the prompt (they share its cached blocks)
    prompt_logprobs: Optional[int] = (
        None  # k: the log-prob of each prompt token after the first, and the top k
    )

    def problem(self) -> Optional[str]:
        """Why these params are invalid, or None. The message starts with the field's name;
        every field's type is checked (values decoded from JSON reach here unchecked)."""
        t = self.temperature
        if not _number(t) or t < 0:
            return f"temperature must be a finite number >= 0 (0 = greedy), got {_shown(t)}"
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {_shown(self.top_p)}"
        if not is_int(self.top_k) or not -1 <= self.top_k < INT64:
            return f"top_k must be an int >= 0 (0 or -1 = off), got {_shown(self.top_k)}"
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an int >= 1, got {_shown(self.max_tokens)}"
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            return f"stop must be a string or a list of non-empty strings, got {_shown(self.stop)}"
        if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
            return (
                f"stop must hold at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                f"characters, got {len(stop)} of up to {max(map(len, stop))}"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) for i in ids):
            return f"stop_token_ids must be a list of ints, got {_shown(ids)}"
        if len(ids) > MAX_STOP_TOKEN_IDS:
            return f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be a bool, got {_shown(self.ignore_eos)}"
        if self.seed is not None and (not is_int(self.seed) or not -INT64 <= self.seed < INT64):
            return f"seed must be an int in [-2**63, 2**63) or None, got {_shown(self.seed)}"
        for name, lo, hi in (
            ("min_p", 0, 1),
            ("repetition_penalty", 1e-9, float("inf")),
            ("presence_penalty", -2, 2),
            ("frequency_penalty", -2, 2),
        ):
            v = getattr(self, name)
            if not _number(v) or not lo <= v <= hi:
                return f"{name} must be a number in [{lo}, {hi}], got {_shown(v)}"
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            return (
                f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                f"got {_shown(self.logprobs)}"
            )
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            return f"n must be an int in [1, {MAX_N}], got {_shown(self.n)}"
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            return (
                f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                f"got {_shown(self.prompt_logprobs)}"
            )
        return None

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @property
    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def is_int(v) -> bool:
    """An int that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    """A finite float, or an int within float range (JSON carries 1e999 as inf and 10**400 as an
    int)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _shown(v) -> str:
    """``repr(v)``, cut short: a rejected value may be megabytes."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


@dataclass
class Logprob:
    """A sampled token's log-probability under the model (log-softmax of its logits, before
    penalties, temperature and filtering) and the ``logprobs`` most likely tokens', best first."""

    token_id: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)


@dataclass(kw_only=True)
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[List[Logprob]] = None


@dataclass(kw_only=True)
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
    prompt_top_logprobs: Optional[List[List[Tuple[int, float]]]] = (
        None  # and the top prompt_logprobs there
    )

    @property
    def finished(self) -> bool:
        return (
            all(o.finish_reason is not None for o in self.outputs)
            if self.outputs
            else self.finish_reason is not None
        )


@dataclass
class TokenDelta:
    """One streamed token: its id and the text it adds (may be "" mid-character)."""

    token_id: int
    text: str
    finish_reason: Optional[str] = None
