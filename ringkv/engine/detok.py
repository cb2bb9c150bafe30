"""Incremental detokenization: the text each new output token adds, decoding a short window
of tokens (from the last point where text was released) instead of the whole output.

Decoding ``ids[prefix:]`` and subtracting ``ids[prefix:read]`` keeps the leading context a
tokenizer needs (spaces, byte-level merges); a window ending inside a multi-byte character
(``"\\ufffd"``) releases nothing until the character completes.
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, start: int = 0):
        """``start``: output tokens whose text is already known (a request that moved in)."""
        self.tokenizer = tokenizer
        self.prefix = self.read = start  # ids[prefix:read]: the window already turned into text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, ids: Sequence[int]) -> str:
        """The text ``ids`` (all output tokens so far, the newest last) add; "" while incomplete."""
        before = self._decode(ids[self.prefix : self.read])
        now = self._decode(ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(ids)
            return now[len(before) :]
        return ""

    def flush(self, ids: Sequence[int]) -> str:
        """Whatever is still held back (the output ended mid-character)."""
        before = self._decode(ids[self.prefix : self.read])
        now = self._decode(ids[self.prefix :])
        self.prefix = self.read = len(ids)
        return now[len(before) :] if len(now) > len(before) else ""
