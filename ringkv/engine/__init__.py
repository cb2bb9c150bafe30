"""Single-process inference engine: paged KV cache, prefix caching, continuous batching."""

from .llm import LLM
from .params import RequestOutput, SamplingParams, TokenDelta

__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenDelta"]
