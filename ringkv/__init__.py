"""ringkv: exact attention over sequences longer than one device holds."""

from .kernels import attention, attention_backward
from .sp.merge import merge, merge_

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "merge", "merge_"]
