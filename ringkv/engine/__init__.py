"""Inference engine: paged KV cache, prefix caching, continuous batching, on one process or a (pp, sp, tp) mesh."""

from .llm import LLM
from .params import RequestOutput, SamplingParams, TokenDelta

__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenDelta"]
