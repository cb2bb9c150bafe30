"""Llama-family decoder (no parallel code) and its weight loading."""

from .config import ModelConfig
from .llama import DenseContext, LlamaForCausalLM
from .loader import load_model

__all__ = ["ModelConfig", "LlamaForCausalLM", "DenseContext", "load_model"]
