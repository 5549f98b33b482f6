"""The memory of earlier answers: scoped, bounded, and a drafter that copies from it (issue 29)."""

from __future__ import annotations

import pytest

from rag_accel.kernels import SEPARATOR, NgramIndex
from rag_accel.memory import ANSWER_OVERHEAD, SEGMENTS, AnswerMemory


def test_an_answer_drafts_for_later_requests_of_its_scope_only():
    memory = AnswerMemory(max_tokens=10_000)
    memory.add("a", [5, 6, 7, 8, 9])
    assert memory.drafter("a").propose([1, 2, 5, 6], max_len=8).tokens == [7, 8, 9]
    assert memory.drafter("b") is None  # another tenant: nothing
    assert memory.drafter(None) is None  # no scope: the memory is not read
    memory.add("b", [5, 6, 4])
    assert memory.drafter("a").propose([5, 6], max_len=8).tokens == [7, 8, 9]  # a's answer, not b's
    assert memory.drafter("b").propose([5, 6], max_len=8).tokens == [4]


def test_the_continuation_most_answers_share_wins_the_latest_on_ties_and_answers_never_run_together():
    memory = AnswerMemory(max_tokens=10_000)
    memory.add("s", [1, 2, 3])
    memory.add("s", [1, 2, 4, 5])
    d = memory.drafter("s")
    draft = d.propose([9, 1, 2], max_len=8)
    assert (draft.tokens, draft.probs) == ([4, 5], (0.5, 0.5))  # a tie: the latest answer's continuation
    assert d.propose([7, 2, 3], max_len=8).tokens == []  # "2 3" ends an answer: nothing copied past it
    memory.add("s", [8, 1, 2, 3])  # now "1 2" went on to 3 twice, to 4 once
    draft = d.propose([9, 1, 2], max_len=8)  # (the running drafter sees the new answer)
    assert (draft.tokens, draft.probs, draft.match_len) == ([3], (2 / 3,), 2)
    memory.add("s", [6, 1, 2])  # an answer that ends in "1 2" counts as an occurrence with no continuation
    assert memory.drafter("s").propose([9, 1, 2], max_len=8).probs == (0.5,)


def test_probabilities_come_from_counts_over_the_answers_and_stop_the_draft():
    memory = AnswerMemory(max_tokens=10_000)
    for tail in ([3, 4], [3, 4], [3, 7], [5, 6]):
        memory.add("s", [1, 2, *tail])
    draft = memory.drafter("s", factor=4.0, min_prob=0.4).propose([0, 1, 2], max_len=8)
    assert (draft.tokens, draft.probs, draft.match_len) == ([3, 4], (0.75, 0.5), 2)
    # the cap follows the match: at factor 0.5 a 2-token match drafts one token
    assert memory.drafter("s", factor=0.5).propose([0, 1, 2], max_len=8).tokens == [3]
    # under min_prob nothing is drafted: 3 went on to 4 in only half the answers
    assert memory.drafter("s", factor=4.0, min_prob=0.8).propose([0, 1, 2], max_len=8).tokens == []


def test_a_drafter_sees_answers_added_while_it_runs_and_its_evidence_grows_with_the_match():
    memory = AnswerMemory(max_tokens=10_000)
    memory.add("s", [1, 2, 3])
    d = memory.drafter("s")
    memory.add("s", [7, 8, 9, 10])
    first = d.propose([0, 7, 8], max_len=1)
    assert (first.tokens, first.match_len, first.source) == ([9], 2, "memory")
    d.update([0, 7, 8, 9], 1)  # the model accepted it: the longer tail matches, its evidence grows
    draft = d.propose([0, 7, 8, 9], max_len=4)
    assert (draft.tokens, draft.match_len) == ([10], 3)


def test_bounded_oldest_first_and_many_tiny_scopes_cannot_grow_it():
    memory = AnswerMemory(max_tokens=800)
    assert memory.segment_tokens == 800 // SEGMENTS
    for i in range(200):
        memory.add(f"s{i % 3}", [i % 50 + 1, 1000 + i, 2000 + i])
        assert memory.charged <= memory.max_tokens
    assert 0 < memory.charged and memory.added == 200
    newest = 199
    assert memory.drafter(f"s{newest % 3}").propose([newest % 50 + 1, 1000 + newest], max_len=2).tokens == \
        [2000 + newest]
    assert memory.drafter("s0").propose([1, 1000], max_len=2).tokens == []  # the very first answer: evicted
    tiny = AnswerMemory(max_tokens=10 * (1 + ANSWER_OVERHEAD))
    for i in range(1000):
        tiny.add(f"tenant-{i}", [i])
    assert 0 < len(tiny.scopes()) <= 10  # each answer is charged its scope's bookkeeping too


def test_eviction_mid_request_takes_the_answers_from_running_drafters_too_and_raises_nothing():
    memory = AnswerMemory(max_tokens=8 * (4 + ANSWER_OVERHEAD))  # one answer a segment
    memory.add("s", [1, 2, 3, 4])
    d = memory.drafter("s")
    assert d.propose([1, 2], max_len=1).tokens == [3]
    for i in range(20):
        memory.add("other", [10 + i, 11 + i, 12 + i, 13 + i])
    assert memory.drafter("s") is None  # evicted: new requests do not see it
    d.update([1, 2, 3], 1)
    assert d.propose([1, 2, 3], max_len=4).tokens == []  # nor the running one: the bound holds, no error
    memory.add("s", [2, 3, 5])  # the scope again, anew
    assert memory.drafter("s").propose([1, 2, 3], max_len=4).tokens == [5]


def test_a_lookup_reads_a_bounded_number_of_occurrences_newest_segments_first():
    memory = AnswerMemory(max_tokens=8 * (40 + ANSWER_OVERHEAD))  # one answer a segment
    memory.add("s", [1, 2] * 20)  # "1" went on to 2 twenty times, in the oldest segment
    memory.add("s", [1, 3] * 3)  # and to 3 three times in the newest
    assert memory.drafter("s").propose([9, 1], max_len=1).tokens == [2]
    d = memory.drafter("s")
    d.scan = 4  # the 4 latest occurrences of "1": three in the newest segment, one in the oldest
    assert d.propose([9, 1], max_len=1).tokens == [3]


def test_too_large_or_empty_answers_are_not_kept_and_bad_bounds_are_refused():
    memory = AnswerMemory(max_tokens=8 * 50)
    memory.add("s", [])
    memory.add("s", list(range(1, 60)))  # larger than a segment (50)
    assert memory.scopes() == [] and memory.charged == 0
    assert AnswerMemory(0).drafter("s") is None
    AnswerMemory(0).add("s", [1, 2])  # off: remembers nothing, no error
    for bad in (-1, 1.5, True, "100"):
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
            AnswerMemory(bad)


def test_ngram_index_matches_another_source_and_a_separator_continues_nothing():
    source = [5, 6, 7, SEPARATOR, 1, 5, 6, SEPARATOR, 2]  # three answers
    idx = NgramIndex(1, 3)
    idx.extend(source)
    # "5 6" ends the second answer: the first answer's continuation (7) is still found
    assert idx.longest_match([9, 5, 6], max_match=8, source=source) == (2, 2)
    assert idx.longest_match([9, 1, 5], max_match=8, source=source) == (2, 6)
    assert idx.longest_match([9, 6, 7], max_match=8, source=source) is None  # "7" continues nothing
