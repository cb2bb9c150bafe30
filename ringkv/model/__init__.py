"""Decoders with no parallel code: the Llama family (``llama.py``) and hybrid models whose layers
are attention or recurrent mixers (``hybrid.py``, ``mixers.py``), and their weight loading."""

from .config import ModelConfig
from .hybrid import HybridForCausalLM, SequenceContext, new_model, state_layers
from .llama import DenseContext, LlamaForCausalLM
from .loader import load_model

__all__ = [
    "ModelConfig",
    "LlamaForCausalLM",
    "HybridForCausalLM",
    "DenseContext",
    "SequenceContext",
    "load_model",
    "new_model",
    "state_layers",
]
