"""Moved to ``ringkv.kernels.merge`` (single-device math belongs with the kernels); kept so
``from ringkv.sp.merge import merge, merge_`` still works."""

from ..kernels.merge import empty_partial, merge, merge_  # noqa: F401

__all__ = ["empty_partial", "merge", "merge_"]
