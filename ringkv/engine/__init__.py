"""Inference engine: paged KV cache, prefix caching, continuous batching, on one process or a (pp, sp, tp) mesh."""

from .llm import LLM, EngineConfig
from .params import CompletionOutput, Logprob, RequestOutput, SamplingParams, TokenDelta
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
]
