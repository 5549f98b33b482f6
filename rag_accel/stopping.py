"""Incremental detokenisation and stop strings that may span verify steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """Turns token ids into text a token at a time, in ``O(window)`` per token.

    Decodes a short window of recent tokens and emits only complete characters
    (a byte-level token may end mid-character: ``"\\ufffd"`` is held back).
    The concatenation of what :meth:`push` and :meth:`flush` return equals the
    decoded text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into emitted text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds the first stop string in a growing text and says how much text is safe to emit.

    Text that could be the beginning of a stop string is held back until the
    next tokens decide it, so a stop string split across steps (or across
    stream chunks) never leaks into the output.

    Example:
        >>> m = StopStringMatcher(["\\n\\n"])
        >>> m.feed("Hello\\n")   # "\\n" may start the stop string: hold it
        (None, 5)
        >>> m.feed("\\nmore")    # stop found at 5
        (5, 5)
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self._searched = 0

    def feed(self, delta: str) -> tuple[int | None, int]:
        """Append text; return ``(stop_position or None, safe_length)``."""
        self.text += delta
        if not self.stops:
            return None, len(self.text)
        start = max(0, self._searched - self._longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        self._searched = len(self.text)
        if hits:
            first = min(hits)
            return first, first
        return None, len(self.text) - self._holdback()

    def _holdback(self) -> int:
        text = self.text
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
