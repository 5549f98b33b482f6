"""Matching kernels on small hand-written and generated token arrays."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_accel import kernels
from rag_accel.kernels import (
    SEPARATOR,
    CountedSuffixes,
    NgramIndex,
    NgramTables,
    SuffixArrayIndex,
    concat_with_separators,
    copy_continuation,
    counted_draft,
    suffix_array,
)

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@given(tokens)
def test_suffix_array_sorts_all_suffixes(seq):
    sa = suffix_array(np.array(seq, dtype=np.int64)).tolist()
    assert sa == sorted(range(len(seq)), key=lambda i: seq[i:])


@given(tokens, st.integers(1, 6))
def test_suffix_array_to_a_depth_sorts_by_that_many_symbols(seq, depth):
    sa = suffix_array(np.array(seq, dtype=np.int64), depth).tolist()
    k = 1 << (depth - 1).bit_length()  # depth rounded up to a power of two
    # by the first k symbols (a shorter suffix first on a tie of its symbols), then latest first
    assert sa == sorted(range(len(seq)), key=lambda i: (seq[i:i + k], -i))


@given(st.lists(st.sampled_from([2**63 - 1, 2**62, 5, 0, -3, -(2**62), -(2**63)]), max_size=12))
def test_suffix_array_of_huge_symbols(seq):
    """Symbols far beyond any vocabulary (their range overflows int64) still sort exactly."""
    sa = suffix_array(np.array(seq, dtype=np.int64)).tolist()
    assert sa == sorted(range(len(seq)), key=lambda i: seq[i:])


def _brute_longest(source, context, min_match, max_match):
    """Reference implementation of the documented rule: take the longest suffix of the context
    (up to max_match) that occurs in the source; among its occurrences the earliest one
    that has a continuation; None if that length is below min_match or nothing continues."""
    def occurrences(L):
        pat = context[-L:]
        return [i for i in range(len(source) - L + 1) if source[i:i + L] == pat]

    longest = 0
    for L in range(1, min(max_match, len(context)) + 1):
        if occurrences(L):
            longest = L
    if longest == 0 or longest < min_match:
        return None
    starts = [i + longest for i in occurrences(longest)
              if i + longest < len(source) and source[i + longest] != SEPARATOR]
    return (longest, min(starts)) if starts else None


@settings(max_examples=300)
@given(st.lists(st.lists(st.integers(0, 3), max_size=15), max_size=3), tokens,
       st.integers(1, 3), st.integers(1, 8))
def test_suffix_array_index_matches_brute_force(docs, context, min_match, max_match):
    source = concat_with_separators(docs).tolist()
    idx = SuffixArrayIndex(source, candidate_scan=10_000)
    assert idx.longest_match(context, min_match, max_match) == _brute_longest(source, context, min_match, max_match)


@settings(max_examples=300)
@given(st.lists(st.lists(st.integers(0, 2), max_size=15), max_size=3), tokens,
       st.integers(1, 8), st.integers(1, 5))
def test_suffix_array_index_to_a_depth_matches_brute_force(docs, context, max_match, depth):
    """Sorted only ``depth`` symbols deep, the index answers as the rule says for matches up to ``depth``."""
    source = concat_with_separators(docs).tolist()
    idx = SuffixArrayIndex(source, candidate_scan=10_000, max_match=depth)
    assert idx.longest_match(context, 1, max_match) == _brute_longest(source, context, 1, min(max_match, depth))


@settings(max_examples=200)
@given(st.lists(st.lists(st.integers(-3, 1 << 40), max_size=6), max_size=4))
def test_concat_of_lists_equals_it_document_by_document(docs):
    joined = concat_with_separators(docs)  # (lists: joined as one list first)
    by_document = concat_with_separators([np.array(d, dtype=np.int64) for d in docs])
    assert joined.dtype == by_document.dtype == np.int64 and joined.tolist() == by_document.tolist()


def test_concat_flattens_nested_documents():
    assert concat_with_separators([[[1, 2], [3, 4]], [5]]).tolist() == [1, 2, 3, 4, SEPARATOR, 5]


def test_suffix_array_index_five_tokens():
    idx = SuffixArrayIndex([3, 1, 4, 1, 5])
    assert idx.longest_match([9, 4, 1], min_match=1, max_match=4) == (2, 4)  # "4 1" -> 5
    assert idx.longest_match([9, 3, 1], min_match=1, max_match=4) == (2, 2)  # "3 1" -> 4
    assert idx.longest_match([9, 9, 1], min_match=1, max_match=4) == (1, 2)  # "1": earliest -> 4
    assert idx.longest_match([9, 9, 1], min_match=2, max_match=4) is None
    assert idx.longest_match([9, 9, 5], min_match=1, max_match=4) is None  # 5 ends the source
    assert SuffixArrayIndex([]).longest_match([1], 1, 4) is None


def test_matches_never_cross_documents():
    source = concat_with_separators([[1, 2], [3, 4]]).tolist()
    assert source == [1, 2, SEPARATOR, 3, 4]
    idx = SuffixArrayIndex(source)
    assert idx.longest_match([7, 2], 1, 4) is None  # "2" is followed only by the separator
    assert idx.longest_match([2, 3], 1, 4) == (1, 4)  # only "3" matches; "2 3" spans the boundary
    assert copy_continuation(source, 0, 10) == [1, 2]


@given(tokens, st.integers(1, 3), st.integers(3, 5))
def test_ngram_index_incremental_equals_batch(seq, min_n, max_n):
    whole = NgramIndex(min_n, max_n)
    whole.extend(seq)
    inc = NgramIndex(min_n, max_n)
    for i in range(len(seq) + 1):
        inc.extend(seq[:i])
    assert whole._tables == inc._tables
    got = inc.longest_match(seq, max_match=16)
    if got is not None:
        L, start = got
        assert start < len(seq)
        assert seq[start - L:start] == seq[len(seq) - L:]


def test_ngram_index_five_tokens():
    idx = NgramIndex(1, 3)
    seq = [1, 2, 3, 1, 2]
    idx.extend(seq)
    assert idx.longest_match(seq, max_match=8) == (2, 2)
    seq.append(3)
    idx.extend(seq)
    assert idx.longest_match(seq, max_match=8) == (3, 3)  # "1 2 3" seen, continued by 1
    idx2 = NgramIndex(2, 3)
    idx2.extend([1, 2, 3, 4, 5])
    assert idx2.longest_match([1, 2, 3, 4, 5], 8) is None


def test_ngram_tables_draft_and_online_update():
    t = NgramTables(2, 3)
    seq = [5, 6, 7, 5]
    t.extend(seq)
    assert t.draft(seq, 4) == ([6, 7, 5, 6], 2)  # only bigram (5,)->6 at first, then trigrams
    seq += [6, 8]
    t.extend(seq)  # (5, 6) now followed by 8: the latest wins
    assert t.draft([1, 5, 6], 1) == ([8], 3)
    assert t.draft([9], 3) == ([], 0)


# ------------------------------------------------------------------ CountedSuffixes (suffix decoding's counts)
def counted(seq, **kw):
    idx = CountedSuffixes(**kw)
    idx.extend(seq)
    return idx


def test_counted_suffixes_follow_the_majority_and_count_the_tail():
    # "5" occurred three times before the tail: twice continued by 6, once by 7 (and never after the 3 that
    # precedes the tail). The tail's own "5" counts in the node (no continuation yet): 6 has 2 of 4.
    seq = [5, 6, 1, 5, 7, 2, 5, 6, 3, 5]
    assert counted(seq).draft(seq, max_len=1) == ([6], [0.5], 1)
    # a longer match that scores as well wins: "5 6 5" occurred once, then 7 (1 of 2)
    seq = [5, 6, 5, 7, 5, 6, 5]
    assert counted(seq).draft(seq, max_len=1) == ([7], [0.5], 3)


def test_counted_suffixes_prefer_the_longer_match_when_it_scores_as_well():
    # "1 2" once before (then 3 4), "2" alone twice more (then 9): the 2-token match scores 0.5 + 0.5.
    seq = [1, 2, 3, 4, 2, 9, 2, 9, 1, 2]
    tokens, probs, match = counted(seq).draft(seq, max_len=4, factor=1.0)
    assert (tokens, match) == ([3, 4], 2) and probs == [0.5, 0.5]
    # factor caps a draft at factor * match tokens: at 0.5 the 2-token match drafts 1, the 1-token one none
    assert counted(seq).draft(seq, max_len=4, factor=0.5) == ([3], [0.5], 2)


def test_counted_suffixes_stop_where_the_probability_falls_under_min_prob():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # "1 2" four times before: 3, 4, 5, 6 once each
    tokens, probs, match = counted(seq).draft(seq, max_len=4, factor=4.0, min_prob=0.1)
    assert tokens == [3, 1, 2, 4] and probs == [0.2] * 4 and match == 2   # 1 of 5, then one way on
    assert counted(seq).draft(seq, max_len=4, factor=4.0, min_prob=0.25) == ([], [], 0)


def test_counted_suffixes_no_draft_is_a_normal_answer():
    assert counted([]).draft([], max_len=4) == ([], [], 0)
    assert counted([1, 2, 3]).draft([1, 2, 3], max_len=4) == ([], [], 0)   # 3 never occurred before
    assert counted([1, 2, 1]).draft([1, 2, 1], max_len=0) == ([], [], 0)


def test_counted_suffixes_never_cross_a_separator():
    seq = [1, 2, SEPARATOR, 1, 2, SEPARATOR, 1]
    assert counted(seq).draft(seq, max_len=4, factor=4.0) == ([2], [2 / 3], 1)


def test_counted_suffixes_scan_a_bounded_number_of_occurrences():
    # the cost of a lookup does not grow with the source: only the `scan` latest occurrences are read
    seq = [1, 2] * 50 + [1, 3] * 3 + [1]
    assert counted(seq, scan=4).draft(seq, max_len=1)[0] == [3]   # the 4 latest "1": three 3s, one 2
    assert counted(seq).draft(seq, max_len=1)[0] == [2]


@settings(max_examples=200, deadline=None)
@given(tokens, st.integers(1, 6), st.floats(0.5, 4.0), st.floats(0.0, 1.0))
def test_counted_suffixes_against_brute_force_counts(seq, max_len, factor, min_prob):
    """The draft's first token is the most frequent continuation of some suffix of the context that occurred
    before, its probability that count over the occurrences (+1, the tail), and the draft obeys the caps."""
    tokens_, probs, m = counted(seq).draft(seq, max_len, factor, min_prob)
    if not tokens_:
        return
    n = len(seq)
    pattern = seq[n - m:]
    occ = [p for p in range(m - 1, n - 1) if seq[p - m + 1:p + 1] == pattern]
    follow = [seq[p + 1] for p in occ]
    assert follow.count(tokens_[0]) == max(follow.count(t) for t in set(follow))
    assert probs[0] == follow.count(tokens_[0]) / (len(occ) + 1)
    assert len(tokens_) <= min(max_len, int(m * factor + 1e-6)) and all(p >= min_prob for p in probs)
    assert all(a >= b for a, b in zip(probs, probs[1:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 6), st.floats(0.5, 4.0),
       st.floats(0.0, 1.0))
def test_counted_draft_over_several_sources_counts_as_over_them_joined(answers, pattern, max_len, factor, min_prob):
    """Earlier answers as separate sources draft what the same answers joined by separators draft (the same
    match, probabilities and length; a tie may pick another token), and the first token is the most
    frequent continuation of the matched tail over all of them, its probability that count over the
    occurrences (none for the pattern itself: it is not in the sources)."""
    groups = [(a, [p for p, t in enumerate(a) if t == pattern[-1]]) for a in answers]
    joined = list(concat_with_separators(answers))
    one = [(joined, [p for p, t in enumerate(joined) if t == pattern[-1]])]
    tokens_, probs, m = counted_draft(groups, pattern, max_len, factor, min_prob)
    tokens1, probs1, m1 = counted_draft(one, pattern, max_len, factor, min_prob)
    assert (probs, m) == (probs1, m1) and len(tokens_) == len(tokens1)
    if not tokens_:
        return
    tail = pattern[len(pattern) - m:]
    occ = [(a, p) for a in answers for p in range(m - 1, len(a)) if a[p - m + 1:p + 1] == tail]
    follow = [a[p + 1] for a, p in occ if p + 1 < len(a)]
    assert follow.count(tokens_[0]) == max(follow.count(t) for t in set(follow))
    assert probs[0] == follow.count(tokens_[0]) / len(occ)
    assert len(tokens_) <= min(max_len, int(m * factor + 1e-6)) and all(p >= min_prob for p in probs)




# --- the C build of the hot loops (rag_accel/_native.c): the same results as the Python, exactly ---------------

needs_native = pytest.mark.skipif(not kernels.NATIVE, reason="rag_accel._native is not built (no C compiler at install)")


def _python(monkeypatch):
    """From here on in this test, rag_accel.kernels runs its Python."""
    monkeypatch.setattr(kernels, "_native", None)


def test_the_c_build_is_installed_where_a_compiler_is():
    # the build is optional: an install without a compiler runs the Python. Where one is (CI), a build that failed
    # must not pass unnoticed, with every test below skipped.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert kernels.NATIVE


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 4), min_size=0, max_size=40), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=0, max_size=8), st.integers(-1, 12), st.floats(0.5, 4.0),
       st.floats(0.0, 1.0), st.integers(1, 30), st.booleans(), st.sampled_from([list, tuple, np.array]))
def test_counted_draft_in_c_equals_the_python(sources, pattern, max_len, factor, min_prob, max_depth, tail, kind):
    last = pattern[-1] if pattern else 0
    groups = [(kind(s), [p for p, t in enumerate(s) if t == last]) for s in sources]
    native = kernels.counted_draft(groups, pattern, max_len, factor, min_prob, max_depth, tail)
    with pytest.MonkeyPatch.context() as mp:
        _python(mp)
        python = kernels.counted_draft(groups, pattern, max_len, factor, min_prob, max_depth, tail)
    assert native == python  # tokens, the probabilities' floats and the match length, exactly
    assert all(type(t) is int for t in native[0])


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=3),
       st.lists(st.integers(0, 5), min_size=0, max_size=12), st.integers(1, 4), st.integers(1, 40),
       st.sampled_from([None, 3, 8]), st.sampled_from([1, 64]))
def test_longest_match_in_c_equals_the_python(docs, context, min_match, max_match, depth, scan):
    index = SuffixArrayIndex(concat_with_separators(docs), candidate_scan=scan, max_match=depth)
    native = index.longest_match(context, min_match, max_match)
    with pytest.MonkeyPatch.context() as mp:
        _python(mp)
        python = index.longest_match(context, min_match, max_match)
    assert native == python


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 5), min_size=0, max_size=40), st.lists(st.integers(0, 40), max_size=4))
def test_counted_suffixes_extend_in_c_equals_the_python(seq, cuts):
    native, python = CountedSuffixes(), CountedSuffixes()
    for cut in [*sorted(cuts), len(seq)]:  # extended in steps, as a request grows
        native.extend(seq[:cut])
        with pytest.MonkeyPatch.context() as mp:
            _python(mp)
            python.extend(seq[:cut])
        assert native._pos == python._pos and native._indexed == python._indexed
        if seq:
            with pytest.MonkeyPatch.context() as mp:
                _python(mp)
                expected = python.draft(seq[:cut], 6, 2.0, 0.1)
            assert native.draft(seq[:cut], 6, 2.0, 0.1) == expected


@needs_native
def test_the_c_loops_refuse_what_is_not_token_ids():
    with pytest.raises(TypeError):
        kernels.counted_draft([([1, "a", 1], [0, 2])], [1], 4, 1.0, 0.1)
    with pytest.raises(TypeError):
        kernels.counted_draft([1, 2], [1], 4, 1.0, 0.1)  # groups that are not (source, positions) pairs
    with pytest.raises(TypeError):
        CountedSuffixes().extend([1, None])
    for source in ([1, 2, 1, 3], (1, 2, 1, 3), np.array([1, 2, 1, 3])):  # a position outside its source
        with pytest.raises(IndexError):
            kernels.counted_draft([(source, [0, 9])], [5, 1], 4, 2.0, 0.1)
        with pytest.raises(IndexError):
            kernels.counted_draft([(source, [-7])], [1], 4, 2.0, 0.1)


@needs_native
def test_the_c_match_refuses_an_index_that_is_not_its_sources():
    with pytest.raises(IndexError):  # a suffix array naming a position past its source
        kernels._native.longest_match(np.array([0, 7]), np.array([1, 2]), [2, 1], [1], 1, 4, 64)
    with pytest.raises(ValueError):
        kernels._native.longest_match(np.array([0]), np.array([1, 2]), [2, 1], [1], 1, 4, 64)
    with pytest.raises(TypeError):  # not int64
        kernels._native.longest_match(np.array([0, 1], dtype=np.int32), np.array([1, 2]), [2, 1], [1], 1, 4, 64)


@needs_native
def test_the_c_draft_takes_any_max_len():
    src = [1, 2, 3, 1, 2, 3, 1, 2]  # (its buffers are as long as the longest source, not max_len)
    native = kernels.counted_draft([(src, [0, 3, 6])], [1], 1 << 40, 8.0, 0.0)
    assert native[0] == [2, 3, 1, 2, 3, 1, 2] and native[2] == 1
    with pytest.MonkeyPatch.context() as mp:
        _python(mp)
        assert native == kernels.counted_draft([(src, [0, 3, 6])], [1], 1 << 40, 8.0, 0.0)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=0, max_size=60), st.sampled_from([None, 0, 1, 2, 3, 5, 8, 32]),
       st.booleans())
def test_suffix_array_in_c_equals_the_python(seq, depth, huge):
    tokens = np.array(seq, dtype=np.int64) * ((1 << 40) if huge else 1)
    native = suffix_array(tokens, depth)
    with pytest.MonkeyPatch.context() as mp:
        _python(mp)
        python = suffix_array(tokens, depth)
    assert native.dtype == python.dtype == np.int64 and native.tolist() == python.tolist()
