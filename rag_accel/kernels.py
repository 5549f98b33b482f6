"""Pure matching kernels over token arrays.

Everything here is a plain function or a small index object over Python lists /
numpy arrays of token ids: no model, no torch, testable on five-token examples.

Two indexes cover the two kinds of copy source:

* :class:`SuffixArrayIndex` for *static* sources (the retrieved references):
  built once per request in ``O(N log N)`` with numpy, queried in
  ``O(m log N)`` for the longest suffix of the context that occurs anywhere
  in the source. Cost per query grows with ``log N``, not ``N``.
* :class:`NgramIndex` for the *growing* source (prompt + output so far):
  hash maps from n-gram to its latest continuation, updated incrementally
  with every accepted token (``O(max_n)`` per token), never rescanned.

:class:`CountedSuffixes` and :func:`counted_draft` choose as suffix decoding does: the continuation
most earlier occurrences of the tail share, counted on demand over a bounded number of them, in the
growing source (the frequency drafter) or in earlier answers (the memory's drafter).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

try:  # the hot loops below in C (rag_accel/_native.c: this module's own), built at install where a C compiler is found
    import rag_accel._native as _native
except ImportError:  # pragma: no cover - an install without a compiler: the Python below, the same results
    _native = None

#: Whether this install runs the C build of the hot loops (:func:`counted_draft`, :func:`suffix_array`,
#: :meth:`SuffixArrayIndex.longest_match`, :meth:`CountedSuffixes.extend`); without it they run in Python, with the
#: same results and more host time a step.
NATIVE = _native is not None

#: Token value used between documents: never equal to a real token id, so a
#: match or a copied continuation never crosses a document boundary.
SEPARATOR = -1
# Sorts below every token (and below SEPARATOR): "past the end of the source".
_END = -2


def concat_with_separators(docs: Sequence[Sequence[int]]) -> np.ndarray:
    """Concatenate token lists into one int64 array with :data:`SEPARATOR` between them.

    Example:
        >>> concat_with_separators([[5, 6], [7]]).tolist()
        [5, 6, -1, 7]
    """
    if all(type(doc) is list for doc in docs):  # (the usual case: one array from one list, not one per document)
        joined: list[int] = []
        for i, doc in enumerate(docs):
            if i:
                joined.append(SEPARATOR)
            joined += doc
        try:
            flat = np.array(joined, dtype=np.int64)
        except ValueError:  # (nested lists: flattened below, document by document)
            flat = None
        if flat is not None and flat.ndim == 1:
            return flat
    parts: list[np.ndarray] = []
    sep = np.full(1, SEPARATOR, dtype=np.int64)
    for i, doc in enumerate(docs):
        if i:
            parts.append(sep)
        parts.append(np.asarray(doc, dtype=np.int64).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def suffix_array(tokens: np.ndarray, depth: int | None = None) -> np.ndarray:
    """Suffix array of an integer array by prefix doubling (numpy, ``O(N log^2 N)``).

    Suffixes are ordered lexicographically with "end of array" smaller than any
    symbol. Returns int64 start positions. ``depth``: order the suffixes by their first
    ``depth`` symbols rounded up to a power of two only, suffixes equal there by their
    position, latest first (the earliest in forward order, for an index over a reversed
    source); the doubling stops after ``log2(depth)`` rounds, where a source with long
    repeats would need ``log2`` of its longest one.

    Example:
        >>> suffix_array(np.array([2, 1, 2, 1])).tolist()   # suffixes: 1 | 1 2 1 | 2 1 | 2 1 2 1
        [3, 1, 2, 0]
        >>> suffix_array(np.array([1, 2, 1, 3])).tolist()            # 1 2 1 3 | 1 3 | 2 1 3 | 3
        [0, 2, 1, 3]
        >>> suffix_array(np.array([1, 2, 1, 3]), depth=1).tolist()   # 1 (at 2, 0) | 2 | 3
        [2, 0, 1, 3]
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if _native is not None:  # (the same order: by the first `depth` symbols rounded up to a power of two)
        order = np.empty(n, dtype=np.int64)
        _native.suffix_order(np.ascontiguousarray(tokens, dtype=np.int64), -1 if depth is None else
                             1 << max(0, depth - 1).bit_length(), order)
        return order
    # rank: of each suffix by its first k symbols, 1-based (0 = past the end); the symbols themselves
    # at first (shifted), dense ranks (<= n) after the first round.
    tokens = np.asarray(tokens, dtype=np.int64)
    low, high = int(tokens.min()), int(tokens.max())
    if high - low < 1 << 31:
        rank, top = tokens - low + 1, high - low + 1
    else:  # (far beyond any vocabulary: dense ranks, so that rank * (top + 1) fits in int64)
        rank = np.unique(tokens, return_inverse=True)[1].reshape(-1).astype(np.int64) + 1
        top = int(rank.max())
    k = 1
    while depth is None or k < depth:
        second = np.zeros(n, dtype=np.int64)
        if k < n:
            second[: n - k] = rank[k:]
        # one key, (rank, second) in one int64: a single sort instead of a two-key lexsort
        key = rank * (top + 1) + second
        order = np.argsort(key, kind="stable")
        key = key[order]
        new_group = np.empty(n, dtype=bool)
        new_group[0] = True
        new_group[1:] = key[1:] != key[:-1]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group)
        top = int(rank[order[-1]])
        if new_group.all() or k >= n:
            return order.astype(np.int64)
        k *= 2
    # ranked by the first k >= depth symbols: ties by position, latest first
    return np.lexsort((-np.arange(n, dtype=np.int64), rank)).astype(np.int64)


class SuffixArrayIndex:
    """Longest-suffix matching against a static token source.

    The source is stored reversed with a suffix array over it, so that the
    context read backwards (last token first) is a *prefix* pattern: each extra
    token of context narrows the suffix-array interval by two binary searches.
    The result is the longest suffix of the context that occurs in the source
    (up to ``max_match``) and where its continuation starts. ``max_match`` given
    here bounds every query's match length and sorts the suffixes that deep only
    (fewer rounds of :func:`suffix_array` on a source with long repeats).

    Example:
        >>> idx = SuffixArrayIndex([7, 1, 2, 3, 9, 1, 2, 4])
        >>> idx.longest_match([5, 1, 2], min_match=1, max_match=8)   # "1 2" twice; earliest wins
        (2, 3)
        >>> idx.longest_match([8, 2, 3], min_match=1, max_match=8)   # "2 3" -> continues at 9
        (2, 4)
        >>> idx.longest_match([6, 6], min_match=1, max_match=8) is None
        True
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray, candidate_scan: int = 64,
                 max_match: int | None = None) -> None:
        arr = np.asarray(tokens, dtype=np.int64)
        self.n = len(arr)
        self.tokens = arr.tolist()  # forward order, for copying continuations
        self.max_match = max_match  # (None: any length)
        self._rev = arr[::-1].copy()
        self._sa = suffix_array(self._rev, max_match)
        self._lists: tuple[list[int], list[int], list[int]] | None = None  # the Python loops': built if they run
        self._candidate_scan = candidate_scan

    def __len__(self) -> int:
        return self.n

    def _python_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The reversed source, its suffix array and each suffix's first symbol, as lists (the Python loops')."""
        if self._lists is None:
            self._lists = self._rev.tolist(), self._sa.tolist(), self._rev[self._sa].tolist()
        return self._lists

    def _narrow(self, lo: int, hi: int, depth: int, symbol: int) -> tuple[int, int]:
        rev, sa, _ = self._python_lists()
        n = self.n

        def key(i: int) -> int:
            p = sa[i] + depth
            return rev[p] if p < n else _END

        return (
            bisect_left(range(hi), symbol, lo, hi, key=key),
            bisect_right(range(hi), symbol, lo, hi, key=key),
        )

    def longest_match(
        self, context: Sequence[int], min_match: int, max_match: int
    ) -> tuple[int, int] | None:
        """Longest suffix of ``context`` found in the source.

        Returns ``(match_len, continuation_start)`` where ``continuation_start``
        indexes :attr:`tokens`, or ``None`` when no suffix of at least
        ``min_match`` tokens occurs (or the match has no continuation). When
        several occurrences share the longest match, the earliest in the source
        wins (the first reference is usually the best-ranked one).
        """
        if self.n == 0 or not context:
            return None
        m = min(max_match, len(context), self.max_match or max_match)
        if _native is not None:
            return _native.longest_match(self._sa, self._rev, self.tokens, context, min_match, m,
                                         self._candidate_scan)
        _, sa, first = self._python_lists()
        q0 = int(context[-1])
        lo = bisect_left(first, q0)
        hi = bisect_right(first, q0, lo)
        if lo == hi:
            return None
        depth = 1
        while depth < m:
            nlo, nhi = self._narrow(lo, hi, depth, int(context[-1 - depth]))
            if nlo == nhi:
                break
            lo, hi, depth = nlo, nhi, depth + 1
        if depth < min_match:
            return None
        # Among occurrences (reversed starts sa[lo:hi]) pick the earliest in forward
        # order whose continuation exists: forward last-matched pos = n - 1 - s.
        best = None
        for i in range(lo, min(hi, lo + self._candidate_scan)):
            cont = self.n - sa[i]  # = (n - 1 - s) + 1
            if cont < self.n and self.tokens[cont] != SEPARATOR and (best is None or cont < best):
                best = cont
        if best is None:
            return None
        return depth, best


def copy_continuation(source: Sequence[int], start: int, max_len: int) -> list[int]:
    """Up to ``max_len`` tokens of ``source`` from ``start``, stopping at a separator.

    Example:
        >>> copy_continuation([4, 5, -1, 6], 0, 10)
        [4, 5]
    """
    out: list[int] = []
    for t in source[start : start + max_len]:
        if t == SEPARATOR:
            break
        out.append(t)
    return out


class NgramIndex:
    """Incremental map from each n-gram (``min_n..max_n``) to its latest continuation.

    ``extend`` indexes new tokens only (``O(max_n)`` each); ``longest_match``
    tries the longest n first and then extends the match backwards to measure
    how long it really is (capped), which is the evidence the draft-length
    policy uses.

    Example:
        >>> idx = NgramIndex(min_n=1, max_n=3)
        >>> toks = [1, 2, 3, 9, 1, 2]
        >>> idx.extend(toks)
        >>> idx.longest_match(toks, max_match=8)   # "1 2" seen before, continued by 3 at index 2
        (2, 2)
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # tokens[:_indexed] have their n-grams registered

    def extend(self, tokens: Sequence[int]) -> None:
        """Register the n-grams that now have a continuation (all ending before the last token).
        A :data:`SEPARATOR` is no continuation: the end of one text does not hide where the same
        n-gram was continued before."""
        for i in range(max(self._indexed, 1), len(tokens)):
            if tokens[i] == SEPARATOR:
                continue
            # n-grams ending at i-1, continued by tokens[i]
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._tables[n][tuple(tokens[i - n : i])] = i
        self._indexed = len(tokens)

    def longest_match(self, tokens: Sequence[int], max_match: int,
                      source: Sequence[int] | None = None) -> tuple[int, int] | None:
        """``(match_len, continuation_start)`` for the longest indexed suffix of ``tokens``.
        ``source``: the sequence this index was extended with, when it is not ``tokens`` itself
        (prompt lookup indexes the context it matches; a memory of answers indexes other text).

        Example:
            >>> idx = NgramIndex(min_n=1, max_n=2)
            >>> idx.extend([7, 1, 2, 3])
            >>> idx.longest_match([9, 7, 1, 2], max_match=8, source=[7, 1, 2, 3])   # "7 1 2", then 3
            (3, 3)
        """
        source = tokens if source is None else source
        L = len(tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            start = self._tables[n].get(tuple(tokens[L - n :]))
            if start is None:
                continue
            length = n  # extend backwards: source[start-1-j] vs tokens[L-1-j]
            while length < max_match and start - 1 - length >= 0 and length < L and \
                    source[start - 1 - length] == tokens[L - 1 - length]:
                length += 1
            return length, start
        return None


class NgramTables:
    """ANPD's multi-level n-gram tables: for N in ``min_n..max_n``, the last
    ``N-1`` tokens map to the token that followed them most recently.

    Example:
        >>> t = NgramTables(2, 3)
        >>> t.extend([1, 2, 3, 1, 2])
        >>> t.draft([7, 1, 2], max_len=3)   # (1,2)->3, (2,3)->1, (3,1)->2
        ([3, 1, 2], 3)
    """

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 2 <= min_n <= max_n:
            raise ValueError(f"need 2 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        for i in range(max(self._indexed, 1), len(tokens)):
            nxt = tokens[i]
            for N in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._tables[N][tuple(tokens[i - N + 1 : i])] = nxt
        self._indexed = len(tokens)

    def draft(self, tokens: Sequence[int], max_len: int) -> tuple[list[int], int]:
        """Draft autoregressively, each token from the highest level whose context matches.

        Returns ``(draft, level_of_first_token)``; ``([], 0)`` when nothing matches.
        """
        tail = list(tokens[-(self.max_n - 1) :])
        out: list[int] = []
        first_level = 0
        while len(out) < max_len:
            nxt = None
            for N in range(min(self.max_n, len(tail) + 1), self.min_n - 1, -1):
                nxt = self._tables[N].get(tuple(tail[len(tail) - N + 1 :]))
                if nxt is not None:
                    if not out:
                        first_level = N
                    break
            if nxt is None:
                break
            out.append(nxt)
            tail.append(nxt)
            if len(tail) > self.max_n - 1:
                del tail[0]
        return out, first_level


class CountedSuffixes:
    """Suffix decoding's per-request tree, counted on demand: where each token of a growing source
    occurred, and from that the continuation most earlier occurrences of the context's tail share.

    ``extend`` records new tokens' positions (``O(1)`` each). :meth:`draft` walks the match lengths
    ``1..max_depth`` of the tail; at each it narrows the occurrences of the last ``m`` tokens (the
    ``scan`` latest of the last token, at most: the cost does not grow with the source), follows the
    token most of them continue with, and scores the draft by its tokens' probabilities (counts over
    the node's count, the tail itself counted as an occurrence that has no continuation yet, as a
    suffix tree counts it). The best score wins, the longer match on ties; a draft is at most
    ``factor`` times its match long and stops where the probability falls under ``min_prob``
    (:func:`counted_draft`, which also drafts from other sources' indexes: the memory of answers).

    Example:
        >>> idx = CountedSuffixes()
        >>> src = [1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7, 1, 2]
        >>> idx.extend(src)
        >>> idx.draft(src, max_len=3, factor=2.0, min_prob=0.1)  # "1 2" twice before, then "3 9" both times
        ([3, 9, 1], [0.6666666666666666, 0.6666666666666666, 0.3333333333333333], 2)
    """

    def __init__(self, max_depth: int = 24, scan: int = 256) -> None:
        self.max_depth, self.scan = max_depth, scan
        self._pos: dict[int, list[int]] = {}
        self._indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        pos, start = self._pos, self._indexed
        if _native is not None:
            _native.index_positions(pos, tokens, start)
        else:
            for i, t in enumerate(tokens[start:], start):
                if t != SEPARATOR:
                    at = pos.get(t)
                    if at is None:
                        pos[t] = [i]
                    else:
                        at.append(i)
        self._indexed = len(tokens)

    def latest(self, token: int, limit: int) -> list[int]:
        """The positions of ``token`` in the source, at most the ``limit`` latest, oldest first."""
        return self._pos.get(token, [])[-limit:] if limit > 0 else []

    def draft(self, tokens: Sequence[int], max_len: int, factor: float = 1.0,
              min_prob: float = 0.1) -> tuple[list[int], list[float], int]:
        """``(draft, probability of each draft token, match length)`` after ``tokens`` (the source this
        index was extended with); ``([], [], 0)``: none."""
        last = len(tokens) - 1
        if last < 1 or max_len <= 0:
            return [], [], 0
        occ = self.latest(tokens[last], self.scan + 1)
        if occ and occ[-1] == last:  # (the tail itself, indexed: every position before it is earlier)
            occ.pop()
        else:
            occ = [p for p in occ if p < last]
        return counted_draft([(tokens, occ)], tokens, max_len, factor, min_prob, self.max_depth, tail=True)


def counted_draft(groups: Sequence[tuple[Sequence[int], list[int]]], pattern: Sequence[int], max_len: int,
                  factor: float, min_prob: float, max_depth: int = 24,
                  tail: bool = False) -> tuple[list[int], list[float], int]:
    """The continuation most occurrences of ``pattern``'s tail share, over several sources:
    ``groups`` holds ``(source, positions of pattern[-1] in it)``. ``tail``: the pattern is the end of
    the (only) source, and counts as an occurrence with no continuation yet (:class:`CountedSuffixes`);
    otherwise the sources are other text (earlier answers) and only their occurrences count.
    Only matches of up to ``max_depth`` tokens draft. ``([], [], 0)``: none.

    Example:
        >>> a, b = [5, 6, 7, -1, 4, 6, 7], [1, 6, 7, 8]    # "6 7" three times: twice at an answer's end
        >>> counted_draft([(a, [1, 5]), (b, [1])], [0, 6], max_len=4, factor=2.0, min_prob=0.1)
        ([7, 8], [1.0, 0.3333333333333333], 1)
    """
    if _native is not None:
        return _native.counted_draft(groups, pattern, max_len, factor, min_prob, max_depth, tail)
    last = len(pattern) - 1
    best: tuple[list[int], list[float], int] = ([], [], 0)
    best_score = 0.0
    m, extra = 1, int(tail)
    count = 0
    for _, occ in groups:
        count += len(occ)
    while count:
        deeper: list[tuple[Sequence[int], list[int]]] = []
        deeper_count = 0
        if m < max_depth and m <= last:
            want = pattern[last - m]
            for src, occ in groups:
                kept = [p for p in occ if p >= m and src[p - m] == want]
                if kept:
                    deeper.append((src, kept))
                    deeper_count += len(kept)
        if deeper_count < count:  # the last level with this set of occurrences: its draft
            cap = min(max_len, int(m * factor + 1e-6))
            out, probs, score = _walk(groups, count + extra, cap, min_prob)
            if out and score >= best_score:
                best, best_score = (out, probs, m), score
        groups, count, m = deeper, deeper_count, m + 1
    return best


def _walk(groups: Sequence[tuple[Sequence[int], list[int]]], node: int, cap: int,
          min_prob: float) -> tuple[list[int], list[float], float]:
    """The most frequent path from the occurrences in ``groups`` (``node``: their count, the tail's own
    one included where it counts), at most ``cap`` tokens, while its probability stays at least ``min_prob``."""
    out: list[int] = []
    probs: list[float] = []
    prob, score = 1.0, 0.0
    while len(out) < cap and node:
        # one pass: each occurrence's next token, and the occurrences that go on to it (by source, in order)
        follow: dict[int, list[tuple[Sequence[int], list[int]]]] = {}
        counts: dict[int, int] = {}
        for src, occ in groups:
            n = len(src)
            for p in occ:
                q = p + 1
                if q < n:
                    t = src[q]
                    if t != SEPARATOR:
                        went = follow.get(t)
                        if went is None:
                            follow[t] = [(src, [q])]
                            counts[t] = 1
                        else:
                            last = went[-1]
                            if last[0] is src:
                                last[1].append(q)
                            else:
                                went.append((src, [q]))
                            counts[t] += 1
        if not counts:
            break
        token, c = max(counts.items(), key=lambda kv: kv[1])  # (first seen on ties: the first group's, earliest)
        prob *= c / node
        if prob < min_prob:
            break
        out.append(token)
        probs.append(prob)
        score += prob
        groups, node = follow[token], c  # the occurrences that went on to `token`: c of them
    return out, probs, score
