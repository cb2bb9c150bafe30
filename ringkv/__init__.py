"""ringkv: exact attention over sequences longer than one device holds."""

from .kernels import attention, attention_backward
from .kernels.merge import merge, merge_
from .sp import (
    LAYOUTS,
    RingAttention,
    RingTimeoutError,
    allgather_attention,
    positions,
    ring_attention,
    shard,
    sp_groups,
    ulysses_attention,
    unshard,
    usp_attention,
)

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_backward",
    "ring_attention",
    "RingAttention",
    "RingTimeoutError",
    "ulysses_attention",
    "usp_attention",
    "allgather_attention",
    "sp_groups",
    "LAYOUTS",
    "shard",
    "unshard",
    "positions",
    "merge",
    "merge_",
    "patch_model",
    "unpatch_model",
    "gather_logits",
    "causal_lm_loss",
    "sequence_sums",
    "ShardedKVCache",
    "LLM",
    "EngineConfig",
    "ServeConfig",
    "SamplingParams",
    "RequestOutput",
    "EngineError",
    "KVSnapshot",
    "plan",
    "sp_trainer",
]

_LAZY = {
    "patch_model": "hf",
    "unpatch_model": "hf",
    "gather_logits": "hf",
    "causal_lm_loss": "hf",
    "sequence_sums": "hf",
    "ShardedKVCache": "hf",
    "LLM": "engine",
    "EngineConfig": "engine",
    "ServeConfig": "serve",
    "SamplingParams": "engine",
    "RequestOutput": "engine",
    "EngineError": "parallel",
    "KVSnapshot": "engine",
    "plan": "planner",
    "sp_trainer": "trainer",
}


def __getattr__(name):  # the HF patch needs transformers (extra "hf"): import parts on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ringkv' has no attribute {name!r}")
