"""A request's references and answers, from what it gave to the drafters that copy from them: one
set-up for both engines (the transformers decoder and the vLLM proposer).

- **One limit rule.** References and answers together hold at most ``max_reference_tokens``
  tokens: token ids count as they are, text as the tokens it encodes to. It is applied where it
  can first be told: before any tokenising, by :func:`~rag_accel.inputs.certain_tokens` (ids counted,
  text by its tokenizer's lower bound), then exactly, as
  :func:`~rag_accel.inputs.tokenize_references` counts. A call is refused; a request that a vLLM
  worker already runs is drafted without them (a warning says so).
- **One threshold, one unit.** References of up to :data:`WAITED_REFERENCE_SIZE` characters of
  text plus token ids are indexed before the request's first draft (a few milliseconds: less
  than a step); larger ones off the hot path, joining the request's drafting when ready.
- **One component**: :class:`ReferenceSetUp` tokenises (through a :class:`~rag_accel.inputs.TokenCache`),
  counts and indexes, inline or on a thread the engine gives it, and hands the drafters over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .drafters import Drafter, reference_drafter
from .inputs import TokenCache, tokenize_references
from .memory import answers_drafter

__all__ = ["WAITED_REFERENCE_SIZE", "ReferenceSetUp", "reference_drafters"]

#: A request's references (and answers) of up to this many characters of text or token ids in all are
#: tokenised and indexed before its first draft, by either engine: a few milliseconds, less than a step.
#: Larger ones are indexed off the hot path and join the request's drafting when they are ready, so that
#: no token waits for them.
WAITED_REFERENCE_SIZE = 8192


def reference_drafters(ref_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]]) -> list[Drafter]:
    """A request's drafters over its references (:func:`~rag_accel.drafters.reference_drafter`) and
    the answers it brings (drafted as the memory of answers: :func:`~rag_accel.memory.answers_drafter`).

    Example:
        >>> [d.name for d in reference_drafters([[1, 2, 3]], [[4, 5, 6]])]
        ['reference', 'memory']
        >>> reference_drafters([[]], [])
        []
    """
    found = [reference_drafter(ref_ids) if any(ref_ids) else None, answers_drafter(answer_ids)]
    return [d for d in found if d is not None]


class ReferenceSetUp:
    """One request's references and answers (checked: :func:`~rag_accel.inputs.check_references`)
    tokenised, counted against ``max_tokens`` and indexed as its drafters.

    ``tokenizer``: called for the tokenizer when text needs one (a vLLM worker loads its own lazily).
    :attr:`waited`: small enough to run before the first draft (:data:`WAITED_REFERENCE_SIZE`);
    :meth:`run` does the work where it is called (the engine's set-up thread, its step when
    ``waited``); :meth:`take` hands the drafters over once, without waiting (``None`` before they are
    ready), raising what the work raised; :meth:`stop` tells the work the request needs it no more.

    Example:
        >>> setup = ReferenceSetUp([[1, 2, 3]], [], tokenizer=None, max_tokens=10)
        >>> setup.waited, setup.take()
        (True, None)
        >>> setup.run(); [d.name for d in setup.take()], setup.take()
        (['reference'], [])
    """

    def __init__(self, refs: Sequence[str | Sequence[int]], answers: Sequence[str | Sequence[int]],
                 tokenizer: Callable[[], Any] | None, max_tokens: int, cache: TokenCache | None = None) -> None:
        self.refs, self.answers = list(refs), list(answers)
        self.waited = sum(len(r) for r in [*self.refs, *self.answers]) <= WAITED_REFERENCE_SIZE
        self.seconds = 0.0  # the work's time
        self._tokenizer, self._max_tokens, self._cache = tokenizer, max_tokens, cache
        self._drafters: list[Drafter] | None = None
        self._error: BaseException | None = None
        self._done, self._stop = threading.Event(), threading.Event()

    @property
    def done(self) -> bool:
        """Whether :meth:`run` has finished (its drafters, or its error, are ready to take)."""
        return self._done.is_set()

    def run(self) -> None:
        """Tokenise (refusing more than ``max_tokens`` as soon as the running count passes it), then
        index; what it raises, :meth:`take` raises. Stops early, with no drafters, after :meth:`stop`."""
        t0 = time.perf_counter()
        try:
            texts = any(isinstance(r, str) and r for r in [*self.refs, *self.answers])
            tokenizer = self._tokenizer() if texts and self._tokenizer is not None else None
            ids = tokenize_references(tokenizer, [*self.refs, *self.answers], self._max_tokens, self._stop.is_set,
                                      self._cache)
            n = len(self.refs)
            self._drafters = [] if self._stop.is_set() else reference_drafters(ids[:n], ids[n:])
        except BaseException as e:  # noqa: BLE001 - handed to the engine by take()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`run` to finish (at most ``timeout`` seconds): whether it has."""
        return self._done.wait(timeout)

    def take(self) -> list[Drafter] | None:
        """The drafters, once they are ready (``[]`` after the first take); ``None`` before."""
        if not self._done.is_set():
            return None
        if self._error is not None:
            error, self._error = self._error, None
            self._drafters = []
            raise error
        drafters, self._drafters = self._drafters or [], []
        return drafters

    def stop(self) -> None:
        self._stop.set()
