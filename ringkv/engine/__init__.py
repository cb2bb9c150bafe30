"""Inference engine: paged KV cache, prefix caching, continuous batching, on one process or a
(pp, sp, tp) mesh. ``LLM`` is the facade over ``EngineCore`` (core.py) and its
``OutputProcessor`` (output.py)."""

from .llm import LLM, EngineConfig
from .params import CompletionOutput, Logprob, RequestOutput, SamplingParams, TokenDelta
from .pipeline import RequestState
from .snapshot import KVSnapshot

__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TokenDelta",
    "KVSnapshot",
    "RequestState",
]
