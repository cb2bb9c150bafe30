"""``SamplingParams`` (per request) and the outputs ``LLM.generate``/``LLM.stream`` return."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional


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
        return None

    @property
    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass
class RequestOutput:
    request_id: int
    prompt: object  # the prompt as given (str or token ids)
    prompt_token_ids: List[int]
    token_ids: List[int]  # generated tokens (an EOS / stop token id that ended it is included)
    text: str  # decoded generated text ("" without a tokenizer); stop strings cut off
    finish_reason: Optional[str]  # "stop" | "length" | "error"
    error: Optional[str] = None  # why the request failed (finish_reason == "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenDelta:
    """One streamed token: its id and the text it adds (may be "" mid-character)."""
    token_id: int
    text: str
    finish_reason: Optional[str] = None
