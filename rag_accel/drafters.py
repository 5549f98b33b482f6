"""Drafters: propose the next tokens cheaply; the model verifies them.

The protocol has two methods (as transformers' candidate generators do):

* ``propose(context, max_len) -> Draft``: a guess of the tokens after
  ``context`` (prompt + output so far). An empty draft is a normal answer:
  the decoder then takes a plain step.
* ``update(context, num_new)``: ``context`` grew by ``num_new`` tokens (what
  the model accepted plus its own next token); index them and learn from them.

A drafter whose drafts' length follows what a draft token costs may also have
``priced_up_to`` (an int) and ``price(token_cost)``: before each adaptive step
it is told the cost of a draft token, averaged over drafts of up to
``priced_up_to`` tokens (:class:`FrequencyDrafter`).

Drafters are built per request by :func:`build_drafters` and keep only small
state: an index over their source and, for copy drafters, the span they are
following (so a followed span continues without a new search).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .config import DecoderConfig
from .kernels import (CountedSuffixes, NgramIndex, NgramTables, SuffixArrayIndex, concat_with_separators,
                      copy_continuation, counted_draft)

# The copy drafters' fixed settings, each the best measured (once options; no user had a reason to tune
# them, and no run found one that paid elsewhere).
# The references: a match of 2 to 32 tokens starts a copy. Replaying SmolLM2's own answers and the human answers of
# 40 MS-MARCO items (benchmarks/experiments/simulate.py), 1-token matches lost 2-4%; a longer match tells the policy nothing more.
REFERENCE_MIN_MATCH, REFERENCE_MAX_MATCH = 2, 32
# The frequency drafter (and the memory of answers): a draft at most 3 times its match long, cut where its
# probability falls under 0.1. Replaying SmolLM2's answers to the sample's FIRST 50 items
# (benchmarks/experiments/suffix_replay.py), factors 2.5-3 did best and 0.07-0.15 alike; 0.1 is suffix decoding's default.
FREQUENCY_FACTOR, FREQUENCY_MIN_PROB = 3.0, 0.1
# Prompt lookup's n-gram sizes and ANPD's table levels: the opt-in fallbacks, at the defaults they always had
# (never retuned: they are out of the default chain).
PROMPT_LOOKUP_NGRAM = (1, 4)
NGRAM_N = (2, 5)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens plus the evidence behind them.

    ``match_len`` is how many context tokens the proposal rests on (the length
    of the matched suffix, grown as a copied span keeps being accepted); the
    draft-length policy learns acceptance per source and ``match_len``.
    """

    tokens: list[int] = field(default_factory=list)
    match_len: int = 0
    source: str = ""
    probs: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft()


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], max_len: int) -> Draft: ...

    def update(self, context: Sequence[int], num_new: int) -> None: ...


class _SpanCopier:
    """Shared span-following for copy drafters: after a copy is proposed, the
    next tokens of the same span are proposed again as long as the context
    keeps following it; only a break triggers a new search."""

    name = "copy"

    def __init__(self) -> None:
        self._follow: int | None = None  # index in the source of the next expected token
        self._match_len = 0

    def forget_span(self) -> None:
        """Stop following the current span: the next proposal searches afresh."""
        self._follow = None

    def _source(self) -> Sequence[int]:
        raise NotImplementedError

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        raise NotImplementedError

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if self._follow is not None:
            tokens = copy_continuation(self._source(), self._follow, max_len)
            if tokens:
                return Draft(tokens, self._match_len, self.name)
        found = self._search(context)  # (may change the source: a memory searches several)
        if found is None:
            self._follow = None
            return NO_DRAFT
        self._match_len, self._follow = found
        return Draft(copy_continuation(self._source(), self._follow, max_len), self._match_len, self.name)

    def update(self, context: Sequence[int], num_new: int) -> None:
        if self._follow is None or num_new <= 0:
            return
        source, start = self._source(), self._follow
        new = list(context[len(context) - num_new :])
        if list(source[start : start + num_new]) == new:
            self._follow = start + num_new
            self._match_len += num_new
        else:
            self._follow = None


class ReferenceDrafter(_SpanCopier):
    """LLMA: copy from the references where the longest suffix of the context matches.

    Example:
        >>> d = ReferenceDrafter([[1, 2, 3, 4, 5]], min_match=1, max_match=8)
        >>> d.propose([9, 2, 3], max_len=2)
        Draft(tokens=[4, 5], match_len=2, source='reference')
    """

    name = "reference"

    def __init__(self, references: Sequence[Sequence[int]], min_match: int = 1, max_match: int = 32) -> None:
        super().__init__()
        self.index = SuffixArrayIndex(concat_with_separators(references), max_match=max_match)
        self.min_match, self.max_match = min_match, max_match

    def _source(self) -> Sequence[int]:
        return self.index.tokens

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        return self.index.longest_match(context, self.min_match, self.max_match)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether the references hold ``tokens`` as one run (up to ``max_match`` of its first tokens) with a token
        after it.

        Example:
            >>> d = ReferenceDrafter([[1, 2, 3, 4, 5]])
            >>> d.holds([2, 3, 4]), d.holds([2, 4]), d.holds([])
            (True, False, False)
        """
        run = list(tokens[: self.max_match])
        return bool(run) and self.index.longest_match(run, len(run), len(run)) is not None


def reference_drafter(references: Sequence[Sequence[int]]) -> ReferenceDrafter:
    """The references' drafter: LLMA's longest match, matches of :data:`REFERENCE_MIN_MATCH` to
    :data:`REFERENCE_MAX_MATCH` tokens.

    Example:
        >>> reference_drafter([[1, 2, 3]]).propose([1, 2], max_len=1)
        Draft(tokens=[3], match_len=2, source='reference')
    """
    return ReferenceDrafter(references, REFERENCE_MIN_MATCH, REFERENCE_MAX_MATCH)


def chain_order(drafters: Sequence[str]) -> list[str]:
    """The order of a request's drafter chain for drafters that join it mid-request (``add_drafter``):
    the config's ``drafters``, with ``"memory"`` (earlier answers: the engine's memory, answers a
    request brings) just after ``"reference"``.

    Example:
        >>> chain_order(("reference", "prompt_lookup", "ngram"))
        ['reference', 'memory', 'prompt_lookup', 'ngram']
        >>> chain_order(("prompt_lookup",))
        ['prompt_lookup']
    """
    order = list(drafters)
    if "reference" in order:
        order.insert(order.index("reference") + 1, "memory")
    return order


class PromptLookupDrafter(_SpanCopier):
    """Prompt lookup: copy from earlier in the prompt + output, most recent occurrence.

    Example:
        >>> d = PromptLookupDrafter([1, 2, 3, 4, 1, 2])
        >>> d.propose([1, 2, 3, 4, 1, 2], max_len=2)
        Draft(tokens=[3, 4], match_len=2, source='prompt_lookup')
    """

    name = "prompt_lookup"

    def __init__(self, context: Sequence[int], min_ngram: int = 1, max_ngram: int = 4, max_match: int = 32) -> None:
        super().__init__()
        self.index = NgramIndex(min_ngram, max_ngram)
        self.max_match = max_match
        self._context: Sequence[int] = context
        self.index.extend(context)

    def _source(self) -> Sequence[int]:
        return self._context

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        return self.index.longest_match(context, self.max_match)

    def update(self, context: Sequence[int], num_new: int) -> None:
        self._context = context
        self.index.extend(context)
        super().update(context, num_new)


class NgramDrafter:
    """ANPD: multi-level n-gram tables from the context, updated with every token.

    Example:
        >>> d = NgramDrafter([5, 6, 7, 5, 6], min_n=2, max_n=3)
        >>> d.propose([5, 6, 7, 5, 6], max_len=3)
        Draft(tokens=[7, 5, 6], match_len=2, source='ngram')
    """

    name = "ngram"

    def __init__(self, context: Sequence[int], min_n: int = 2, max_n: int = 5) -> None:
        self.tables = NgramTables(min_n, max_n)
        self.tables.extend(context)

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        tokens, level = self.tables.draft(context, max_len)
        return Draft(tokens, level - 1, self.name) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        self.tables.extend(context)


# The draft-token cost at which a frequency draft may be 1 / cost times its match long. Chosen on the sample's FIRST
# 50 items (benchmarks/experiments/suffix_replay.py): the best factor was 3 at 0.025 of a step per draft token (2.007x, 1.939x
# at 1), none at 0.05 (1.816x-1.829x for 1-3), 1 at 0.1 (1.618x, 1.590x at 3): the policy cuts a draft by its
# value, but cannot pick another match length's draft, which a tighter cap makes the drafter prefer.
EVIDENCE_COST = 0.075


class FrequencyDrafter:
    """Suffix decoding's choice over prompt + output: the continuation most earlier occurrences of the
    context's tail share (:class:`~rag_accel.kernels.CountedSuffixes`), at most ``factor`` times its match
    long, cut where its probability falls under ``min_prob``.

    Example:
        >>> d = FrequencyDrafter([1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7, 1, 2], factor=2.0)
        >>> d.propose([1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7, 1, 2], max_len=3)
        Draft(tokens=[3, 9, 1], match_len=2, source='frequency')
    """

    name = "frequency"
    # Priced (:meth:`price`) by the cost of draft tokens up to this many (vLLM's default for this project's proposer,
    # and the drafts its pricing was chosen on): a verify curve flat up to 8 tokens and steep past 16 (transformers
    # on a CPU) must not read as dear for the short drafts most matches allow.
    priced_up_to = 10

    def __init__(self, context: Sequence[int], factor: float = 3.0, min_prob: float = 0.1,
                 max_depth: int = 24) -> None:
        self.index = CountedSuffixes(max_depth)
        self.max_factor = self.factor = factor
        self.min_prob = min_prob
        self.index.extend(context)

    def price(self, token_cost: float) -> None:
        """A draft token costs ``token_cost`` plain steps now: the dearer it is, the more match each drafted
        token needs (``factor`` = :data:`EVIDENCE_COST` / ``token_cost``, between 1 and the configured one).

        Example:
            >>> d = FrequencyDrafter([1, 2, 3], factor=3.0)
            >>> d.price(0.02); d.factor     # one request on a 2-core CPU: the configured 3
            3.0
            >>> d.price(0.1); d.factor      # a busy batch: a draft at most as long as its match
            1.0
        """
        affordable = EVIDENCE_COST / token_cost if token_cost > 0 else self.max_factor
        self.factor = min(self.max_factor, max(1.0, affordable))

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        self.index.extend(context)
        tokens, probs, match_len = self.index.draft(context, max_len, self.factor, self.min_prob)
        return Draft(tokens, match_len, self.name, tuple(probs)) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        self.index.extend(context)


class MemoryDrafter:
    """Suffix decoding's choice over earlier answers (:class:`~rag_accel.memory.AnswerMemory`): the
    continuation most of their occurrences of the context's tail share, scored and capped as the
    frequency drafter's (:func:`~rag_accel.kernels.counted_draft`), the latest answers first on ties.
    Unlike the frequency drafter's, its ``factor`` is not priced down as draft tokens get dearer: where a
    question comes again reworded, a remembered answer's long copies pay even so (``benchmarks/experiments/memory_replay.py``
    on the sample's first 50 items, at vLLM's step costs on a 2-core CPU: reworded 1.849x unpriced against
    1.814x priced; the questions as first asked 2.050x against 2.076x).
    ``segments``: the answers in segments, oldest first, each with ``tokens`` (answers with
    :data:`~rag_accel.kernels.SEPARATOR` between them) and ``index`` (their
    :class:`~rag_accel.kernels.CountedSuffixes`), read as they are at each proposal (answers added
    or evicted meanwhile included); the ``scan`` latest occurrences of the tail's last token count,
    newest segments first, so a lookup costs the same however much the memory holds.

    Example:
        >>> from types import SimpleNamespace
        >>> def segment(tokens):
        ...     index = CountedSuffixes()
        ...     index.extend(tokens)
        ...     return SimpleNamespace(tokens=tokens, index=index)
        >>> d = MemoryDrafter([segment([5, 6, 7, 8]), segment([6, 7, 9, -1, 3, 6, 7, 9])])
        >>> d.propose([1, 6, 7], max_len=3)   # "6 7" three times: then 9 twice, 8 once
        Draft(tokens=[9], match_len=2, source='memory')
        >>> d.propose([1, 5, 6], max_len=3)   # "5 6" only in the older segment
        Draft(tokens=[7, 8], match_len=2, source='memory')
    """

    name = "memory"

    def __init__(self, segments: Sequence, factor: float = 3.0, min_prob: float = 0.1, max_depth: int = 24,
                 scan: int = 256) -> None:
        self._segments = segments
        self.factor, self.min_prob, self.max_depth, self.scan = factor, min_prob, max_depth, scan

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if not context or max_len <= 0:
            return NO_DRAFT
        last, groups, left = context[-1], [], self.scan
        for seg in reversed(self._segments):
            occ = seg.index.latest(last, left)
            if occ:
                groups.append((seg.tokens, occ[::-1]))  # newest first: the latest answer wins a tie
                left -= len(occ)
                if left <= 0:
                    break
        tokens, probs, match_len = counted_draft(groups, context, max_len, self.factor, self.min_prob,
                                                 self.max_depth)
        return Draft(tokens, match_len, self.name, tuple(probs)) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        pass  # the memory grows by whole answers (AnswerMemory.add), not by this request's tokens


class DrafterChain:
    """Drafters in priority order; all of them see every update.

    :meth:`propose` is the plain chain: the first non-empty draft wins.
    :meth:`candidates` returns every cheap drafter's non-empty draft, in order,
    for the adaptive policy to weigh (it breaks ties by this order). Drafters
    marked ``costly`` (draft models: real compute per token) are left out of it
    and listed in :attr:`costly`: the decoder asks them only when no cheap
    draft is worth sending. :attr:`priced`: those with ``priced_up_to``.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = list(drafters)
        self._split()

    def _split(self) -> None:
        self.costly = [d for d in self.drafters if getattr(d, "costly", False)]
        self._cheap = [d for d in self.drafters if not getattr(d, "costly", False)]
        self.priced = [d for d in self.drafters if getattr(d, "priced_up_to", None) is not None]

    def insert(self, position: int, drafter: Drafter) -> None:
        """Add ``drafter`` at ``position`` mid-request (a reference index that was built off the
        step loop); it sees the updates from here on.

        Example:
            >>> chain = DrafterChain([NgramDrafter([1, 2, 3])])
            >>> chain.insert(0, ReferenceDrafter([[7, 8, 9]]))
            >>> [d.name for d in chain.drafters]
            ['reference', 'ngram']
        """
        self.drafters.insert(position, drafter)
        self._split()

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if max_len <= 0:
            return NO_DRAFT
        for drafter in self.drafters:
            draft = drafter.propose(context, max_len)
            if draft.tokens:
                return draft
        return NO_DRAFT

    def candidates(self, context: Sequence[int], max_len: int) -> list[Draft]:
        drafts = []
        if max_len > 0:
            for drafter in self._cheap:
                draft = drafter.propose(context, max_len)
                if draft.tokens:
                    drafts.append(draft)
        return drafts

    def update(self, context: Sequence[int], num_new: int) -> None:
        for drafter in self.drafters:
            drafter.update(context, num_new)


def build_drafters(
    config: DecoderConfig,
    context: Sequence[int],
    references: Sequence[Sequence[int]],
    draft_model: Callable[[], Drafter] | None = None,
) -> DrafterChain:
    """The factory: one chain from the config, for one request (``draft_model`` makes a
    fresh draft-model drafter; without one, ``"draft_model"`` in the config is skipped)."""
    chain: list[Drafter] = []
    for name in config.drafters:
        if name == "frequency":
            chain.append(FrequencyDrafter(context, FREQUENCY_FACTOR, FREQUENCY_MIN_PROB))
        elif name == "reference":
            if references and any(len(r) for r in references):
                chain.append(reference_drafter(references))
        elif name == "prompt_lookup":
            chain.append(
                PromptLookupDrafter(
                    context,
                    PROMPT_LOOKUP_NGRAM[0],
                    PROMPT_LOOKUP_NGRAM[1],
                    REFERENCE_MAX_MATCH,
                )
            )
        elif name == "ngram":
            chain.append(NgramDrafter(context, NGRAM_N[0], NGRAM_N[1]))
        elif name == "draft_model" and draft_model is not None:
            chain.append(draft_model())
    return DrafterChain(chain)
