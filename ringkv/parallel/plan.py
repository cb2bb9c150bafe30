"""A step plan: what the driver sends every rank once per step (JSON-serialisable).

For each scheduled sequence: the first position computed this step (``start``), how many
tokens (``n``), their token ids, the sequence's block table (logical block ids, the same on
every rank) and whether the step completes it (its last token's logits are sampled).
``want``: what the sampler rank returns to the driver, ``"tokens"`` (greedy argmax, when
every completing row is greedy) or ``"logits"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class SeqStep:
    start: int
    n: int
    tokens: List[int]  # token ids of positions [start, start + n)
    block_table: List[int]
    completes: bool


@dataclass
class StepPlan:
    seqs: List[SeqStep] = field(default_factory=list)
    want: str = "logits"

    @property
    def num_completing(self) -> int:
        return sum(s.completes for s in self.seqs)

    def to_json(self) -> dict:
        return {"seqs": [[s.start, s.n, s.tokens, s.block_table, s.completes] for s in self.seqs], "want": self.want}

    @classmethod
    def from_json(cls, d: dict) -> "StepPlan":
        return cls([SeqStep(*s) for s in d["seqs"]], d["want"])
