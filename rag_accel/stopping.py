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


class OutputText:
    """A request's output as it grows: token ids, and the text safe to emit so far.

    :meth:`push` takes a step's new tokens up to the first one that ends the
    output (a stop string, an EOS token, or ``max_new_tokens``) and returns the
    text that became safe to emit. ``finish`` is then ``"stop"``, ``"eos"`` or
    ``"length"``, and :attr:`text` the final text (cut before a stop string).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos_token_ids: frozenset[int],
                 max_new_tokens: int) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._matcher = StopStringMatcher(stops)
        self._eos, self.max_new_tokens = eos_token_ids, max_new_tokens
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self._emitted = 0  # characters already returned by push()
        self._end: int | None = None  # where the final text ends

    def push(self, new_tokens: Sequence[int]) -> tuple[int, str]:
        """Append ``new_tokens`` up to the one that ends the output; returns how many were
        kept and the text that became safe to emit (text that may still start a stop string
        is held back)."""
        safe, n_kept = self._emitted, 0
        for tok in new_tokens:
            self.token_ids.append(tok)
            n_kept += 1
            stop_at, safe = self._matcher.feed(self._detok.push(tok))
            if stop_at is not None:
                self.finish, self._end = "stop", stop_at
            elif tok in self._eos:
                self.finish = "eos"
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish = "length"
            if self.finish:
                break
        if self.finish is None:
            end = safe
        else:
            if self.finish != "stop":  # a held-back partial character may still complete a stop string
                stop_at, _ = self._matcher.feed(self._detok.flush())
                self.finish, self._end = ("stop", stop_at) if stop_at is not None else (self.finish,
                                                                                        len(self._matcher.text))
            end = self._end
        piece = self._matcher.text[self._emitted:end]
        self._emitted += len(piece)
        return n_kept, piece

    @property
    def text(self) -> str:
        """The output text: all of it once finished (cut before a stop string), else what was emitted."""
        return self._matcher.text[:self._end if self.finish else self._emitted]
