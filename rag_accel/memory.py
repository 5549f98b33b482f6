"""A memory of earlier answers, per scope: a copy source for later requests of the same scope.

vLLM's suffix decoding keeps a tree of every answer the engine gave and copies from it (a question asked again,
reworded, or a follow-up that quotes an answer gains). :class:`AnswerMemory` is that source for our drafters, with
two differences:

- **Scoped.** Each request names a scope (``extra_args["memory_scope"]`` on vLLM); it drafts only from answers
  given in that scope, and its answer joins that scope only. Outputs never change, but time does: a client that
  times its requests learns whether an answer with that text was given earlier *in its scope*, so scope per tenant
  (or user). A request with no scope neither reads nor writes the memory, unless the deployment names a default.
- **Bounded.** ``max_tokens`` over all scopes (each answer also counts ``ANSWER_OVERHEAD``, so
  many tiny scopes cannot grow it either); past it, the oldest segment of answers goes first.

Drafting is suffix decoding's choice (:class:`~rag_accel.drafters.MemoryDrafter`): the
continuation most earlier occurrences of the context's tail share, with each token's probability
from those counts, over the positions of each token in the scope's answers
(:class:`~rag_accel.kernels.CountedSuffixes`); a lookup reads a bounded number of occurrences,
whatever the memory holds. Pure Python, no engine: the vLLM proposer owns one per worker.

Example:
    >>> memory = AnswerMemory(max_tokens=1000)
    >>> memory.add("tenant-a", [5, 6, 7, 8, 9])
    >>> memory.drafter("tenant-a").propose([1, 6, 7], max_len=3)
    Draft(tokens=[8, 9], match_len=2, source='memory')
    >>> memory.drafter("tenant-b") is None          # nothing remembered in that scope
    True
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .drafters import MemoryDrafter
from .kernels import SEPARATOR, CountedSuffixes

__all__ = ["ANSWER_OVERHEAD", "DEFAULT_MAX_TOKENS", "MAX_SCOPE_CHARS", "AnswerMemory", "answers_drafter", "check_scope"]

# ~60 bytes of host memory per remembered token (the token and its position in a list per token id): 100,000
# tokens, ~1,000 answers of 100 tokens, take ~6 MB in each worker (tracemalloc, 1,100 answers of the sample).
DEFAULT_MAX_TOKENS = 100_000
ANSWER_OVERHEAD = 32  # tokens' worth each answer is charged on top of its length (its scope's bookkeeping)
MAX_SCOPE_CHARS = 256


def check_scope(scope: object, name: str = "memory_scope") -> str:
    """``scope`` if it is a memory scope's name, a string of 1 to :data:`MAX_SCOPE_CHARS` characters.

    Example:
        >>> check_scope("tenant-42")
        'tenant-42'
        >>> check_scope("")
        Traceback (most recent call last):
        ...
        ValueError: memory_scope must be a string of 1 to 256 characters, got 0 characters
    """
    if not isinstance(scope, str) or not 1 <= len(scope) <= MAX_SCOPE_CHARS:
        what = type(scope).__name__ if not isinstance(scope, str) else f"{len(scope)} characters"
        raise ValueError(f"{name} must be a string of 1 to {MAX_SCOPE_CHARS} characters, got {what}")
    return scope
SEGMENTS = 8  # a scope's answers are indexed in segments of max_tokens / SEGMENTS: eviction drops one whole


class _Segment:
    """Answers (:data:`SEPARATOR` between them) and where each token occurs in them, appended in place."""

    __slots__ = ("tokens", "index", "charge")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.index = CountedSuffixes()
        self.charge = 0

    def append(self, answer: Sequence[int], charge: int) -> None:
        if self.tokens:
            self.tokens.append(SEPARATOR)
        self.tokens.extend(answer)
        self.index.extend(self.tokens)
        self.charge += charge


class AnswerMemory:
    """Earlier answers per scope, ``max_tokens`` in all (0: remember nothing).

    A scope's answers sit in segments of about ``max_tokens / SEGMENTS``; past the bound the oldest
    segment of all goes whole, in ``O(1)`` (nothing is re-indexed in the engine's step loop). A
    lookup tries a scope's segments newest first: at most ``SEGMENTS + 1`` of them at the bound.
    Not thread-safe: one owner adds and makes drafters (vLLM's worker, in its step loop).
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.segment_tokens = max(1, max_tokens // SEGMENTS)
        self.charged = 0  # tokens + ANSWER_OVERHEAD per answer, over all scopes
        self.added = 0  # answers remembered so far, evicted ones included
        self._scopes: dict[str, deque[_Segment]] = {}
        self._order: deque[tuple[str, _Segment]] = deque()  # every segment, oldest first

    def scopes(self) -> list[str]:
        return list(self._scopes)

    def add(self, scope: str, answer: Sequence[int]) -> None:
        """Remember ``answer`` (token ids) in ``scope``; the oldest segments go if the bound is passed.
        An empty answer, or one larger than a segment, is not kept."""
        charge = len(answer) + ANSWER_OVERHEAD
        if not answer or charge > self.segment_tokens:
            return
        segments = self._scopes.setdefault(scope, deque())
        if not segments or segments[-1].charge + charge > self.segment_tokens:
            segments.append(_Segment())
            self._order.append((scope, segments[-1]))
        segments[-1].append(answer, charge)
        self.charged += charge
        self.added += 1
        while self.charged > self.max_tokens:
            old_scope, seg = self._order.popleft()
            self.charged -= seg.charge
            kept = self._scopes[old_scope]
            kept.remove(seg)  # (its oldest, or the only one: a few entries)
            if not kept:
                del self._scopes[old_scope]

    def drafter(self, scope: str | None, factor: float = 3.0, min_prob: float = 0.1) -> MemoryDrafter | None:
        """A drafter over ``scope``'s answers as they are at each proposal (``None``: no scope, or nothing
        remembered in it yet); ``factor`` / ``min_prob`` as the frequency drafter's
        (:class:`~rag_accel.drafters.MemoryDrafter`)."""
        found = self._scopes.get(scope) if scope is not None else None
        return MemoryDrafter(found, factor, min_prob) if found else None


def answers_drafter(answers: Sequence[Sequence[int]], factor: float = 3.0,
                    min_prob: float = 0.1) -> MemoryDrafter | None:
    """A drafter over answers a request brings (``answers=``: a cached answer to a similar question,
    an earlier turn's), drafting as the memory does, under its name (``"memory"``): the same kind of
    source, the same learnt acceptance. Passed as references instead, the same answer drafts like a
    passage (the longest match, the passages' acceptance): replaying SmolLM2's answers to the sample's
    questions reworded at vLLM's step costs on a 2-core CPU (``benchmarks/experiments/memory_replay.py``), the
    cached answer as an answer against as a reference: 1.672x -> 1.743x on the first 50 items,
    2.121x -> 2.210x on the last 100. ``None``: no tokens.

    Example:
        >>> answers_drafter([[5, 6, 7, 8], [6, 7, 9]]).propose([1, 6, 7], max_len=2)
        Draft(tokens=[9], match_len=2, source='memory')
        >>> answers_drafter([[], []]) is None
        True
    """
    segment = _Segment()
    for answer in answers:
        if answer:
            segment.append(answer, 0)
    return MemoryDrafter([segment], factor, min_prob) if segment.tokens else None
