"""The async engine's counters for ``/metrics``, kept on the engine's thread (``Metrics``), and
the rates a peer pull's cost model reads (EWMAs of the link, its set-up and the prefill)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
EWMA = 0.3  # weight of the newest measurement of the link and prefill rates
PULL_OUTCOMES = ("pull", "recompute", "failed")


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft_buckets: List[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    migrations_in: int = 0
    migrations_out: int = 0
    rejected: int = 0  # 429s (max_waiting)
    recent: deque = field(default_factory=deque)  # (time, tokens) of the last steps, for tokens/s
    # peer pull: hints by outcome (PULL_OUTCOMES), what came in, what went out to pullers
    pulls: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(PULL_OUTCOMES, 0))
    pulled_tokens: int = 0  # prompt tokens this instance holds more thanks to pulls
    pulled_bytes: int = 0
    shared: int = 0  # prefixes sent to pulling peers
    shared_bytes: int = 0
    pull_error: Optional[str] = None  # why the last failed pull failed
    link_rate: Optional[float] = None  # bytes/s of pulls and migrations (EWMA); None: unmeasured
    link_setup: Optional[float] = None  # seconds before a pull's first byte (EWMA): ask, join
    prefill_rate: Optional[float] = None  # uncached prompt tokens / TTFT (EWMA), tokens/s
    kv_bytes_per_token: Optional[float] = None  # of a pulled prefix (measured)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, b in enumerate(TTFT_BUCKETS):
            if seconds <= b:
                self.ttft_buckets[i] += 1

    def observe_link(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` took ``seconds``: the link rate's EWMA."""
        if nbytes > 0 and seconds > 0:
            self.link_rate = _ewma(self.link_rate, nbytes / seconds)

    def observe_setup(self, seconds: float) -> None:
        """A pull's holder was asked and its link joined after ``seconds``."""
        self.link_setup = _ewma(self.link_setup, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request's ``tokens`` uncached prompt tokens gave its first token after ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate = _ewma(self.prefill_rate, tokens / seconds)


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
