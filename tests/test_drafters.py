"""Drafters and the chain, on five-token examples."""

from __future__ import annotations

from rag_accel import (
    NO_DRAFT,
    DecoderConfig,
    Draft,
    Drafter,
    DrafterChain,
    FrequencyDrafter,
    NgramDrafter,
    PromptLookupDrafter,
    ReferenceDrafter,
    build_drafters,
)
from rag_accel.drafters import FREQUENCY_FACTOR, FREQUENCY_MIN_PROB


class CountingReference(ReferenceDrafter):
    searches = 0

    def _search(self, context):
        self.searches += 1
        return super()._search(context)


def test_reference_drafter_copies_longest_match_and_follows_span():
    d = CountingReference([[1, 2, 3, 4, 5, 6, 7]], min_match=1, max_match=8)
    ctx = [9, 1, 2]
    assert d.propose(ctx, 2) == Draft([3, 4], 2, "reference")
    ctx += [3, 4, 5]  # the model accepted the draft and its own next token equals the span's next
    d.update(ctx, 3)
    assert d.propose(ctx, 2) == Draft([6, 7], 5, "reference")
    assert d.searches == 1  # the followed span continued without a new search


def test_reference_drafter_searches_again_after_a_break():
    d = CountingReference([[1, 2, 3, 4], [8, 3, 6]], min_match=1, max_match=8)
    ctx = [1, 2]
    assert d.propose(ctx, 3).tokens == [3, 4]
    ctx += [8, 3]  # diverged: the span said 3, the model said 8
    d.update(ctx, 2)
    assert d.propose(ctx, 3) == Draft([6], 2, "reference")  # "8 3" found in the second reference
    assert d.searches == 2


def test_reference_drafter_prefers_longest_matching_prefix():
    d = ReferenceDrafter([[5, 1, 7], [6, 5, 1, 8]], min_match=1, max_match=8)
    assert d.propose([6, 5, 1], 1).tokens == [8]  # "6 5 1" beats the earlier "5 1"
    assert ReferenceDrafter([[5, 1, 7], [6, 5, 1, 8]]).propose([4, 5, 1], 1).tokens == [7]  # tie: earliest


def test_no_match_is_an_empty_draft_not_an_error():
    assert ReferenceDrafter([[1, 2, 3]]).propose([7, 8], 4) is NO_DRAFT
    assert ReferenceDrafter([[1, 2, 3]], min_match=2).propose([7, 1], 4) is NO_DRAFT
    assert PromptLookupDrafter([1, 2, 3]).propose([1, 2, 3], 4) is NO_DRAFT
    assert NgramDrafter([1, 2, 3]).propose([1, 2, 3], 4) is NO_DRAFT


def test_prompt_lookup_indexes_output_incrementally():
    ctx = [1, 2, 3]
    d = PromptLookupDrafter(ctx, min_ngram=1, max_ngram=3)
    ctx += [4, 1, 2]
    d.update(ctx, 3)
    assert d.propose(ctx, 2) == Draft([3, 4], 2, "prompt_lookup")
    ctx += [3, 4]
    d.update(ctx, 2)
    # "1 2 3 4" matched and followed: next copy continues the span (now overlapping the output)
    assert d.propose(ctx, 3) == Draft([1, 2, 3], 4, "prompt_lookup")


def test_ngram_drafter_learns_from_accepted_tokens():
    ctx = [1, 2, 3]
    d = NgramDrafter(ctx, min_n=2, max_n=3)
    assert d.propose(ctx + [9], 2) is NO_DRAFT
    ctx += [9, 4]
    d.update(ctx, 2)
    assert d.propose([9], 1) == Draft([4], 1, "ngram")


def test_chain_order_and_candidates():
    ctx = [1, 2, 3, 1, 2]
    ref = ReferenceDrafter([[1, 2, 7]])
    pld = PromptLookupDrafter(ctx)
    chain = DrafterChain([ref, pld])
    assert chain.propose(ctx, 2).source == "reference"
    assert [d.source for d in chain.candidates(ctx, 2)] == ["reference", "prompt_lookup"]
    assert chain.propose(ctx, 0) is NO_DRAFT
    assert all(isinstance(x, Drafter) for x in (ref, pld, NgramDrafter(ctx)))


def test_factory_follows_config():
    ctx = [1, 2, 3]
    chain = build_drafters(DecoderConfig(), ctx, [[1, 2]])
    assert [d.name for d in chain.drafters] == ["reference", "frequency"]  # (no draft model given)
    chain = build_drafters(DecoderConfig(drafters=("ngram", "prompt_lookup")), ctx, [[1, 2]])
    assert [d.name for d in chain.drafters] == ["ngram", "prompt_lookup"]
    # no (or only empty) references: the reference drafter is simply absent
    assert [d.name for d in build_drafters(DecoderConfig(), ctx, [[]]).drafters] == ["frequency"]
    # the fixed settings reach the drafters (constants beside the runs that chose them, not options)
    freq = build_drafters(DecoderConfig(), ctx, []).drafters[0]
    assert (freq.factor, freq.min_prob) == (FREQUENCY_FACTOR, FREQUENCY_MIN_PROB) == (3.0, 0.1)
    ref = build_drafters(DecoderConfig(), ctx, [[1, 2]]).drafters[0]
    assert type(ref) is ReferenceDrafter and (ref.min_match, ref.max_match) == (2, 32)


def test_frequency_drafter_follows_the_context_as_it_grows():
    ctx = [4, 5, 6, 9, 4, 5]
    d = FrequencyDrafter(ctx, factor=2.0)
    draft = d.propose(ctx, max_len=4)
    assert (draft.tokens, draft.match_len, draft.source) == ([6, 9, 4, 5], 2, "frequency")
    assert draft.probs == (0.5, 0.5, 0.5, 0.5)  # one earlier "4 5", and the tail's own
    ctx += [6, 7]  # the model went 6, then 7 (not 9): "6 7" now joins the counts
    d.update(ctx, 2)
    ctx += [4, 5, 6]
    d.update(ctx, 3)
    # "4 5 6" twice before, then 9 once and 7 once: a tie, the earliest first; 1 of 3 (the tail counts)
    draft = d.propose(ctx, max_len=2)
    assert (draft.tokens, draft.match_len, draft.probs) == ([9, 4], 3, (1 / 3, 1 / 3))
    ctx.append(8)  # a token never seen before: no draft, a normal answer
    d.update(ctx, 1)
    assert d.propose(ctx, max_len=4) is NO_DRAFT


def test_frequency_drafts_need_more_match_when_draft_tokens_are_dear():
    """The request's drafting prices the frequency drafter from its policy's curve before each proposal: at 0.1
    of a step per draft token a draft is at most as long as its match, at 0.01 up to the configured factor."""
    from rag_accel.policy import AcceptanceStats
    from rag_accel.speculation import RequestDrafting, StepCosts

    ctx = [4, 5, 6, 7, 8, 9, 1, 4, 5]  # "4 5" once before: up to 2 x factor tokens after it
    for slope, want in ((0.1, [6, 7]), (0.01, [6, 7, 8, 9, 1, 4])):
        cfg = DecoderConfig(drafters=("frequency",), max_draft_tokens=8)
        drafting = RequestDrafting.from_config(cfg, list(ctx), [], [1.0 + slope * n for n in range(9)],
                                               AcceptanceStats(), StepCosts())
        drafting.choose(list(ctx), n_generated=1, remaining=100)
        assert drafting.candidates[0].tokens == want
