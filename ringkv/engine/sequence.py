"""A request being generated: its tokens, how many have KV in the cache, its block table."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..cache.block_manager import PrefixCursor
from .detok import IncrementalDetokenizer
from .params import SamplingParams


@dataclass
class OutputState:
    """One sample's output text and how much of it (and of its tokens) was reported."""

    text: str = ""  # the output text (cut before a stop string)
    deltas: List[str] = field(default_factory=list)  # the text each output token released
    emitted: int = 0  # characters of ``text`` released so far
    reported: int = 0  # output tokens already in a delta output
    reported_prompt: bool = False  # its prompt log-probs were in a delta output (once)
    detok: Optional[IncrementalDetokenizer] = None  # once its first token is decoded


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of a request (``index`` of its ``n``): tokens, cache state, text so far."""

    def __init__(
        self,
        *,
        seq_id: int,
        prompt,
        prompt_token_ids: List[int],
        params: SamplingParams,
        cache_salt: Optional[str] = None,
        index: int = 0,
        request_id=None,
    ):
        self.seq_id, self.prompt, self.params, self.index = seq_id, prompt, params, index
        self.request_id = seq_id if request_id is None else request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.cache_salt = cache_salt
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: List[int] = []
        self.state_slot: Optional[int] = None  # a hybrid model's recurrent-state slot (running)
        self.snapshot_at: tuple = ()  # and where it saves snapshots besides every checkpoint
        self.saving: set = set()  # positions of its snapshots whose step has not completed
        self.kv_epoch = (
            0  # counts the times its blocks were dropped (the ranks' step mirrors re-learn it)
        )
        self.prefix_cursor = PrefixCursor()  # how far its full blocks are registered
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.out = OutputState()  # its text and what was reported (``OutputProcessor``)
        self.logprobs: List = []
        self.prompt_logprobs: Optional[List[Optional[float]]] = (
            [None] * (len(prompt_token_ids) - 1) if params.prompt_logprobs is not None else None
        )
        self.prompt_top: Optional[
            List[Optional[list]]
        ] = (  # [(token id, log-prob)] * k per position
            [None] * (len(prompt_token_ids) - 1) if params.prompt_logprobs else None
        )
        self.penalty = (
            None  # (in_prompt, counts) once a penalty needs them (sampling.penalty_state)
        )
        self.siblings: List[
            "Sequence"
        ] = []  # samples 1..n-1, admitted once this one's prompt is computed
        self.num_cached_tokens: Optional[int] = None  # set on first admission
        self.num_preemptions = 0
        if params.seed is None:
            seed = random.getrandbits(63)
        else:  # sample i of a seeded request: its own reproducible stream (sample 0: the seed)
            seed = (
                params.seed
                if index == 0
                else random.Random(f"{params.seed}/{index}").getrandbits(63)
            )
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: Optional[str] = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error

    def free_kv(self, blocks) -> None:
        """Give its blocks (and a hybrid model's state slot) back to ``blocks`` (a
        ``BlockManager``): nothing of it is cached any more, and it is recomputed from its tokens
        if it runs again."""
        blocks.free(self.block_table)
        if self.state_slot is not None:
            blocks.states.release(self.state_slot)
            self.state_slot = None
        self.num_computed, self.prefix_cursor = 0, PrefixCursor()
        self.kv_epoch += 1
