"""Cost-aware draft length: draft the length that maximises tokens per unit of time.

A verification forward over ``1 + L`` tokens costs ``cost[L]`` plain steps (measured once per model and device).
A draft of length ``L`` yields ``E(L) = 1 + a0 * (1 + a1 + ... + a1^(L-1))`` tokens in expectation, where ``a0`` is
the chance its first token is right and ``a1`` the chance each further token is, given the previous one was; both
are learnt online per drafter and strength of evidence (matched suffix length), shrunk towards the drafter's
overall rate. The policy picks ``argmax_L E(L) / cost[L]``, ``L = 0`` (a plain step) included, so a drafter whose
guesses keep failing stops costing time. Learning needs no sent draft: the model's own next token tells whether
the first unsent draft token was right (a free "shadow" check), so the rates recover when a drafter is right again.

Some requests defeat every drafter at once (the model paraphrases instead of copying). So the policy also keeps,
per request, the first-token hits of all drafts (sent or shadow) against what the learnt rates predicted, and
scales every first-token rate down by that ratio (never up).

A draft that carries a probability for each of its tokens (the frequency drafter's, from how many earlier
occurrences continue that way) is valued by those instead: ``E(L) = 1 + sum_i min(1, g_i p_i)`` over its first
``L`` tokens, where ``g_i`` calibrates the claims per drafter, match-length bucket and bucket of draft positions
(how often drafts reached that position over the probability they claimed; ``1`` before any evidence): counts over
few occurrences overstate (one earlier occurrence claims 0.5 for every token it copies).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from .drafters import NO_DRAFT, Draft

# Lower edges of the match-length buckets.
_BUCKET_EDGES = (0, 1, 2, 3, 4, 6, 9, 16, 32)

# What a drafter with no evidence yet is expected to get right, per match-length bucket (its lower
# edge): (first token, each later token). Copy drafts on a 1-token match are mostly wrong, on a
# 6-token match mostly right: one flat prior (0.5, as before) made a fresh process draft on weak
# matches and lose, and hold back on strong ones. Measured on the bundled sample's FIRST 40 items
# (the defaults are judged on the last ones), pooled over the reference, prompt-lookup and n-gram
# drafters; each entry is the lower of two runs (one with the flat prior, one with this table:
# benchmarks/results/cold_rates_cpu_smollm2.md, `python benchmarks/experiments/cold_rates.py`), rounded down to
# 0.05, first-token rates at most 0.9 (cautious: the learnt rates earn their way up). Bucket 0 holds
# drafts with no copy evidence (draft models), which keep the flat 0.5.
COLD_RATES: dict[int, tuple[float, float]] = {
    0: (0.5, 0.5), 1: (0.2, 0.25), 2: (0.35, 0.75), 3: (0.45, 0.7), 4: (0.55, 0.85),
    6: (0.75, 0.9), 9: (0.75, 0.9), 16: (0.85, 0.9), 32: (0.9, 0.85),
}


# The request factor's memory: each observation (a draft's first token checked, sent or shadow)
# weighs 0.8 of the one after it, so a request whose drafts hit early and then keep missing stops
# drafting sooner, and one that starts hitting after misses opens up sooner. Chosen on the sample's
# FIRST 50 items (benchmarks/experiments/cold_replay.py --request-decay 0.95,0.9,0.8,0.7,0.5: 0.7-0.9 alike, 1-1.5%
# above 1.0); on the last 100 (judged, not tuned): geo-mean 1.244x -> 1.250x cold, 1.246x -> 1.254x
# warm, items below 0.97x 10 -> 5 cold, 16 -> 8 warm, worst item unchanged (0.962x / 0.964x).
REQUEST_DECAY = 0.8

# Pseudo-observations behind each cell of the probability calibration (``g = 1`` before evidence), and the
# weight an observation keeps at every later one (~100 drafts' memory). Chosen on the sample's FIRST 50
# items (benchmarks/experiments/suffix_replay.py, a draft token costing 0.025 and 0.1 of a step): calibrated per
# match-length and position bucket, frequency drafts valued by their probabilities beat the same drafts
# valued by the match-length rates (2.007x against 1.980x at 0.025), where one factor per drafter lost at
# 0.1 (1.529x against 1.590x per cell) and the rates' first token times the counts' later ones lost at both.
CALIBRATION_PRIOR = 4.0
CALIBRATION_DECAY = 0.99

# A step timed at more than this many times its price is the machine's stall (another process), not its draft's
# cost: the loss budget charges a draft at most this many times the (learnt) curve's price, and the step costs
# learn from times winsorised to this factor (rag_accel.speculation.StepCosts). Jitter (tens of per cent, even
# on a loaded machine) stays inside it, so a quiet machine's accounting is unchanged; a stall counts as 2x.
STALL = 2.0


def _bucket(match_len: int) -> int:
    return bisect_right(_BUCKET_EDGES, match_len) - 1


_POSITION_BUCKET = [_bucket(i) for i in range(33)]  # a draft position's bucket (positions past 32: 32's)


def _calibration_key(draft: Draft) -> tuple[str, int]:
    """Where a draft's probabilities are calibrated: its drafter and the lower edge of its match-length bucket."""
    return draft.source, _BUCKET_EDGES[_bucket(draft.match_len)]


def leading_matches(draft: Sequence[int], actual: Sequence[int]) -> int:
    """Number of leading positions where ``draft`` and ``actual`` agree.

    Example:
        >>> leading_matches([4, 5, 6], [4, 5, 9, 1])
        2
    """
    n = 0
    for d, a in zip(draft, actual):
        if d != a:
            break
        n += 1
    return n


class _Rates:
    """Successes/failures of the first draft token (s0, f0) and of each later one (s1, f1)."""

    __slots__ = ("s0", "f0", "s1", "f1")

    def __init__(self) -> None:
        self.s0 = self.f0 = self.s1 = self.f1 = 0.0

    def forget(self, horizon: float) -> None:
        # Exponential forgetting: keep roughly the last `horizon` observations, so the
        # rates follow a change of task or model behaviour.
        if self.s0 + self.f0 > horizon:
            self.s0 *= 0.5
            self.f0 *= 0.5
        if self.s1 + self.f1 > horizon:
            self.s1 *= 0.5
            self.f1 *= 0.5


class AcceptanceStats:
    """Learnt acceptance rates, per drafter and per match-length bucket.

    Kept by the decoder across requests (acceptance is a property of the model
    and the task as much as of one request), with exponential forgetting.
    """

    def __init__(self, horizon: float = 400.0) -> None:
        self.horizon = horizon
        self.overall: dict[str, _Rates] = {}
        self.buckets: dict[tuple[str, int], _Rates] = {}
        # per (drafter, match-length bucket's lower edge) whose drafts carry probabilities, per bucket of draft
        # positions (index into _BUCKET_EDGES): [times the leading tokens right reached it, sum of the
        # probabilities claimed for it]
        self.calibration: dict[tuple[str, int], list[list[float]]] = {}

    def calibration_factors(self, key: tuple[str, int]) -> list[float]:
        """How far the probabilities claimed by drafts of ``key`` (:func:`_calibration_key`) are to be trusted,
        per bucket of draft positions (:data:`_BUCKET_EDGES`): ``g`` of :mod:`rag_accel.policy`.

        Example:
            >>> stats = AcceptanceStats()
            >>> stats.calibration_factors(("frequency", 1))[:3]
            [1.0, 1.0, 1.0]
            >>> stats.calibration[("frequency", 1)] = [[0, 0], [2, 8]] + [[0, 0]] * 7  # 1st: claimed 8, got 2
            >>> stats.calibration_factors(("frequency", 1))[:3]
            [1.0, 0.5, 1.0]
        """
        found = self.calibration.get(key)
        if found is None:
            return [1.0] * len(_BUCKET_EDGES)
        return [(hits + CALIBRATION_PRIOR) / (claimed + CALIBRATION_PRIOR) for hits, claimed in found]


class DraftLengthPolicy:
    """Chooses how many draft tokens to verify, from cost and observed acceptance.

    Args:
        cost_curve: ``cost_curve[L]`` = time of a forward over ``1 + L`` tokens
            relative to one token (``cost_curve[0] == 1``).
        adaptive: if ``False``, always verify the whole draft.
        prior: prior acceptance rate for a drafter not seen yet; ``None``
            (default): :data:`COLD_RATES`, by the draft's match length.
        prior_weight: pseudo-observations behind the prior, and behind the
            drafter-wide rate when it is used as the prior of a bucket.
        min_gain: a draft must beat a plain step by this fraction of its value.
        exploration: plain steps any request may lose on top of its loss budget
            (default 0: the budget alone bounds the loss; it counts the prefill).
        request_prior: pseudo-hits behind :meth:`request_factor` (smaller: it
            falls faster after the first misses of a request; the pooling is always on: its
            A/B, when it was the option ``pool_misses``, measured no difference and it bounds failed drafts).
        request_decay: each observation's weight in :meth:`request_factor` is
            multiplied by this at every later one (``1.0``: all count alike;
            smaller: recent misses outweigh an early hit; see :data:`REQUEST_DECAY`).
    """

    def __init__(
        self,
        cost_curve: Sequence[float],
        adaptive: bool = True,
        stats: AcceptanceStats | None = None,
        prior: float | None = None,
        prior_weight: float = 2.0,
        min_gain: float = 0.1,
        exploration: float = 0.0,
        request_prior: float = 0.5,
        request_decay: float = REQUEST_DECAY,
    ) -> None:
        self.base_cost = [float(c) / float(cost_curve[0]) for c in cost_curve]
        self.cost = list(self.base_cost)
        self.cost_scale = 1.0
        self.adaptive = adaptive
        self.stats = stats if stats is not None else AcceptanceStats()
        self.prior, self.w = prior, prior_weight
        self.min_gain = min_gain  # a draft must beat a plain step by this fraction
        self.exploration = exploration  # plain steps any request may lose before its budget grows
        self._overall = self.stats.overall
        self._buckets = self.stats.buckets
        self._local: dict[tuple[str, int], _Rates] = {}  # this request only
        # This request's first-token hits, and the hits the rates predicted for the same drafts;
        # request_prior pseudo-hits on both sides keep one early miss from closing the request.
        self.request_prior = request_prior
        if not 0.0 < request_decay <= 1.0:
            raise ValueError(f"request_decay must be in (0, 1], got {request_decay!r}")
        self.request_decay = request_decay
        self._hits = self._expected = 0.0
        # Time lost to drafts so far in this request, in plain-step units (negative: time won).
        self.debt = 0.0

    def rates(self, source: str, match_len: int) -> tuple[float, float]:
        """Estimated (first-token, next-token) acceptance for a draft with this evidence,
        the first-token rate scaled by :meth:`request_factor`."""
        g0, g1 = self._learnt_rates(source, match_len)
        return g0 * self.request_factor(), g1

    def request_factor(self) -> float:
        """This request's first-token hits over those the learnt rates predicted, pooled over
        drafters and evidence, at most 1 (``1.0`` before anything is observed)."""
        k = self.request_prior
        return min(1.0, (self._hits + k) / (self._expected + k))

    def _learnt_rates(self, source: str, match_len: int) -> tuple[float, float]:
        return self._bucket_rates(source, _bucket(match_len))

    def _bucket_rates(self, source: str, bucket: int) -> tuple[float, float]:
        w = self.w
        p0, p1 = COLD_RATES[_BUCKET_EDGES[bucket]] if self.prior is None else (self.prior, self.prior)
        o = self._overall.get(source)
        if o is None:
            g0, g1 = p0, p1
        else:
            g0 = (o.s0 + w * p0) / (o.s0 + o.f0 + w)
            g1 = (o.s1 + w * p1) / (o.s1 + o.f1 + w)
        key = (source, bucket)
        # Shrink: drafter-wide rate -> this bucket's rate (all requests) -> this bucket in this request.
        for r in (self._buckets.get(key), self._local.get(key)):
            if r is not None:
                g0, g1 = (r.s0 + w * g0) / (r.s0 + r.f0 + w), (r.s1 + w * g1) / (r.s1 + r.f1 + w)
        return g0, g1

    def scale_cost(self, scale: float) -> None:
        """Correct the measured curve by what verification really costs now: the extra cost of
        a forward over ``1 + L`` tokens beyond one token is taken ``scale`` times (longer
        contexts make multi-token forwards dearer than the one-off measurement says)."""
        if abs(scale - self.cost_scale) > 0.01:
            self.cost_scale = scale
            self.cost = [1.0] + [1.0 + (c - 1.0) * scale for c in self.base_cost[1:]]

    def value(self, draft: Draft) -> tuple[float, int]:
        """Best expected tokens per unit of cost for this draft, and the length that achieves it."""
        n = min(len(draft.tokens), len(self.cost) - 1)
        if draft.probs:
            g = self.stats.calibration_factors(_calibration_key(draft))
            best_value, best_len = self._best_length_probs(draft.probs, g, n)
        else:
            best_value, best_len = self._best_length(*self.rates(draft.source, draft.match_len), n)
        plain = 1.0 / self.cost[0]
        return (best_value, best_len) if best_value > plain else (plain, 0)

    def _best_length(self, a0: float, a1: float, n: int, per_token: float = 0.0,
                     fixed: float = 0.0) -> tuple[float, int]:
        """max over L = 1..n of E(L) / (cost[L] + L * per_token + fixed * E(L)), and the first L reaching it."""
        best_value, best_len = 0.0, 0
        expected, p = 1.0, a0
        for length in range(1, n + 1):
            expected += p
            p *= a1
            value = expected / (self.cost[length] + length * per_token + fixed * expected)
            if value > best_value:
                best_value, best_len = value, length
        return best_value, best_len

    def _best_length_probs(self, probs: Sequence[float], g: Sequence[float], n: int) -> tuple[float, int]:
        """max over L = 1..n of (1 + sum of the first L of min(1, g p)) / cost[L], and the first L reaching it
        (``g`` per bucket of positions)."""
        best_value, best_len, expected = 0.0, 0, 1.0
        for length in range(1, min(n, len(probs)) + 1):
            expected += min(1.0, g[_POSITION_BUCKET[min(length, 32)]] * probs[length - 1])
            value = expected / self.cost[length]
            if value > best_value:
                best_value, best_len = value, length
        return best_value, best_len

    def token_cost(self, up_to: int | None = None) -> float:
        """What a draft token costs now beyond the first, in plain steps: the curve's average slope from 1
        draft token to ``up_to`` (``None``, or past its end: its longest), as scaled by :meth:`scale_cost`;
        below 2 draft tokens, the cost of the first.

        Example:
            >>> DraftLengthPolicy([1.0, 1.4, 1.4, 1.4]).token_cost()   # a CPU forward: flat after one token
            0.0
            >>> round(DraftLengthPolicy([1.0 + 0.1 * n for n in range(11)]).token_cost(), 6)
            0.1
        """
        n = len(self.cost) - 1 if up_to is None else min(len(self.cost) - 1, up_to)
        if n < 2:
            return self.cost[n] - self.cost[0]
        return max(0.0, (self.cost[n] - self.cost[1]) / (n - 1))

    def choose(self, draft: Draft) -> int:
        """Number of leading draft tokens to verify (0 = plain step)."""
        if not self.adaptive:
            return min(len(draft.tokens), len(self.cost) - 1)
        return self.value(draft)[1]

    def select(self, drafts: Sequence[Draft], loss_budget: float = float("inf")) -> tuple[Draft, int]:
        """The draft and length with the most expected tokens per unit of cost
        (the first draft on ties; non-adaptive: the first draft, whole).

        ``loss_budget``: plain steps this request may lose to failed drafts, on top
        of :attr:`exploration`; once :attr:`debt` exceeds both, only plain steps
        until the budget (which grows with the tokens generated) catches up. This
        bounds the worst case when the learnt rates are too optimistic for an item.
        """
        if not drafts:
            return NO_DRAFT, 0
        if not self.adaptive:
            return drafts[0], self.choose(drafts[0])
        if self.debt > loss_budget + self.exploration:
            return NO_DRAFT, 0
        best, best_value, best_len = NO_DRAFT, (1.0 + self.min_gain) / self.cost[0], 0
        for d in drafts:
            value, length = self.value(d)
            if value > best_value:
                best, best_value, best_len = d, value, length
        return best, best_len

    def model_window(self, source: str, draft_cost: float | None, max_len: int,
                     loss_budget: float = float("inf"), probe: bool = False,
                     catch_up: float = 0.0, remaining: int = 1_000_000) -> int:
        """How many tokens a draft model should draft now; 0: not worth asking it.

        ``draft_cost``: time of one drafted token in plain steps (``None``: not
        measured yet). Drafting ``L`` tokens costs ``L * draft_cost`` on top of
        verifying them, so the window maximises ``E(L) / (cost[L] + L * draft_cost)``.
        ``catch_up``: plain steps the draft model needs to process context it has not
        seen (the prompt, at a request's first ask: a prefill of the draft model), paid
        once and spread over the ``remaining`` tokens it may draft for. A source never
        observed is priced the same way at :data:`COLD_RATES`' rates for drafts without
        copy evidence (PEARL's window of ``1 / draft_cost`` tokens, the rule until issue
        63, asked a 0.5B draft model of a 1.5B target to prefill an 849-token prompt,
        24 of the target's steps, for a 64-token answer). A ``probe`` asks even when the
        model falls short by up to 20%, so that rates near the edge can recover. All
        of it is charged to the same loss budget as failed drafts.
        """
        max_len = min(max_len, len(self.cost) - 1)
        if max_len <= 0 or (self.adaptive and self.debt > loss_budget + self.exploration):
            return 0
        if not self.adaptive:
            return max_len
        if draft_cost is None:  # (a decoder that has not measured its draft model: the first request does)
            return min(4, max_len)
        best_value, best_len = self._best_length(*self.rates(source, 0), max_len, draft_cost,
                                                 catch_up / max(1, remaining))
        threshold = (1.0 + self.min_gain) / self.cost[0]
        if best_value > threshold or (probe and best_value > 0.8 * threshold):
            return best_len
        return 0

    def charge(self, units: float) -> None:
        """Account time spent drafting (in plain steps) against the loss budget."""
        self.debt += units

    def _calibrate(self, draft: Draft, m: int, known: int) -> None:
        """The probabilities claim leading tokens right: position ``i`` (1-based) is reached when the first
        ``i`` are. After a miss every later position is known to be unreached, so the whole draft counts;
        without one, the positions known."""
        key = _calibration_key(draft)
        cal = self.stats.calibration.get(key)
        if cal is None:
            cal = self.stats.calibration[key] = [[0.0, 0.0] for _ in _BUCKET_EDGES]
        d = CALIBRATION_DECAY
        for b in cal:
            b[0] *= d
            b[1] *= d
        for i, p in enumerate(draft.probs if m < known else draft.probs[:known], start=1):
            b = cal[_POSITION_BUCKET[min(i, 32)]]
            b[0] += i <= m
            b[1] += p

    def record(self, sent: int, accepted: int, timed_cost: float | None = None) -> None:
        """Account a verified draft: its cost against the tokens it bought beyond a plain step.

        ``timed_cost``: what the verify step really took, in plain steps of this request
        (the decoder times every step); without it, the curve's ``cost[sent]``. The timed
        cost keeps the loss budget a bound on real time where the curve is off: on long
        contexts or a busy machine a failed draft can cost 1.5 plain steps, not 0.6.

        But one step's time is noisy, and the budget is small (3% of a request's time: about
        one plain step early in an answer), so a single stall used to close drafting for the
        rest of a request whose drafts were being accepted (a 3-token draft accepted whole,
        stalled 5x: ``7.5 - 1 - 3 = 3.5`` steps charged, the budget of 117 tokens). Two rules:
        a draft whose accepted tokens pay for it by the curve (``1 + accepted >= cost[sent]``,
        as scaled by what timing has taught) is never charged a loss by its timing alone (it
        saved forward passes; what steps really cost reaches its price through the scale,
        learnt robustly); and any draft is charged at most :data:`STALL` times its price.

        Example:
            >>> p = DraftLengthPolicy([1.0, 1.5, 1.5, 1.5])
            >>> p.record(3, 1, timed_cost=7.5)  # 1 accepted, stalled 5x: no loss (2 tokens for 1.5 steps)
            >>> p.debt
            0.0
            >>> p.record(3, 0, timed_cost=7.5)  # rejected, stalled: charged 2 x 1.5 - 1
            >>> p.debt
            2.0
        """
        if not sent:
            return
        price = self.cost[sent]
        loss = (price if timed_cost is None else min(timed_cost, STALL * price)) - 1.0 - accepted
        if 1.0 + accepted >= price:
            loss = min(loss, 0.0)
        self.debt += loss

    def observe(self, draft: Draft, new_tokens: Sequence[int]) -> None:
        """Learn from the tokens the step produced (accepted draft + the model's next token).

        Every draft position up to ``len(new_tokens)`` is known, whether or not
        it was sent: the model's token there is what greedy decoding yields.
        """
        known = min(len(draft.tokens), len(new_tokens))
        if known == 0:
            return
        m = leading_matches(draft.tokens, new_tokens)  # (over the first `known`: zip stops at the shorter)
        if draft.probs:
            self._calibrate(draft, m, known)
        decay, source = self.request_decay, draft.source
        key = (source, _bucket(draft.match_len))
        self._expected = decay * self._expected + self._bucket_rates(*key)[0]  # (before learning from it)
        self._hits = decay * self._hits + (m > 0)
        horizon = self.stats.horizon
        for table, at in ((self._overall, source), (self._buckets, key), (self._local, key)):
            rates = table.get(at)
            if rates is None:
                rates = table[at] = _Rates()
            if m == 0:
                rates.f0 += 1
            else:
                rates.s0 += 1
                rates.s1 += m - 1
                if m < known:
                    rates.f1 += 1
            rates.forget(horizon)
