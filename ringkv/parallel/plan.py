"""A step plan: what the driver sends every rank once per step (JSON-serialisable).

For each scheduled sequence: the first position computed this step (``start``), how many
tokens (``n``), their token ids, the sequence's block table (logical block ids, the same on
every rank) and whether the step completes it (its last token's logits are sampled);
``targets``: for a request that wants prompt log-probs, the prompt tokens that the step's
first ``len(targets)`` positions predict (their log-probs are returned too).
``want``: what the sampler rank returns to the driver, ``"tokens"`` (greedy argmax, when
every completing row is greedy) or ``"logits"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SeqStep:
    start: int
    n: int
    tokens: List[int]  # token ids of positions [start, start + n)
    block_table: List[int]
    completes: bool
    targets: Optional[List[int]] = None


@dataclass
class StepPlan:
    seqs: List[SeqStep] = field(default_factory=list)
    want: str = "logits"

    @property
    def num_completing(self) -> int:
        return sum(s.completes for s in self.seqs)

    @property
    def num_targets(self) -> int:
        return sum(len(s.targets or ()) for s in self.seqs)

    def to_json(self) -> dict:
        return {"seqs": [[s.start, s.n, s.tokens, s.block_table, s.completes, s.targets] for s in self.seqs],
                "want": self.want}

    @classmethod
    def from_json(cls, d: dict) -> "StepPlan":
        return cls([SeqStep(*s) for s in d["seqs"]], d["want"])
