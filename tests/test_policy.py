"""The cost-aware draft-length policy."""

from __future__ import annotations

import pytest

from rag_accel import Draft
from rag_accel.drafters import NO_DRAFT
from rag_accel.policy import AcceptanceStats, DraftLengthPolicy, leading_matches

CPU_CURVE = [1.0, 1.21, 1.5, 1.76, 1.9, 2.0, 2.1, 2.15, 2.17] + [2.17 + 0.11 * i for i in range(1, 9)]  # 0..16
FLAT = [1.0] * 17


def train(policy, source, match_len, right: bool, times=30):
    draft = Draft([1, 2, 3, 4], match_len, source)
    actual = [1, 2, 3, 4, 5] if right else [9, 9]
    for _ in range(times):
        policy.observe(draft, actual)


def test_leading_matches():
    assert leading_matches([1, 2, 3], [1, 2, 4]) == 2
    assert leading_matches([], [1]) == 0
    assert leading_matches([5], [6]) == 0


def test_drafts_nothing_when_drafts_keep_failing():
    p = DraftLengthPolicy(CPU_CURVE)
    train(p, "reference", 1, right=False)
    assert p.choose(Draft([1] * 16, 1, "reference")) == 0


def test_drafts_long_when_spans_keep_being_accepted():
    p = DraftLengthPolicy(CPU_CURVE)
    train(p, "reference", 8, right=True)
    assert p.choose(Draft([1] * 16, 8, "reference")) == 16


def test_weak_and_strong_evidence_are_learnt_apart():
    p = DraftLengthPolicy(CPU_CURVE)
    train(p, "prompt_lookup", 1, right=False)
    train(p, "prompt_lookup", 12, right=True)
    assert p.choose(Draft([1] * 8, 1, "prompt_lookup")) == 0
    assert p.choose(Draft([1] * 8, 12, "prompt_lookup")) == 8


def test_flat_cost_curve_sends_whole_draft_with_modest_acceptance():
    p = DraftLengthPolicy(FLAT)
    assert p.choose(Draft([1] * 10, 2, "ngram")) == 10


def test_non_adaptive_sends_everything():
    p = DraftLengthPolicy(CPU_CURVE, adaptive=False)
    train(p, "reference", 1, right=False)
    assert p.choose(Draft([1] * 5, 1, "reference")) == 5
    assert p.select([Draft([1] * 3, 1, "ngram"), Draft([2] * 5, 1, "reference")]) == (Draft([1] * 3, 1, "ngram"), 3)


def test_unsent_drafts_still_learn_from_the_models_token():
    p = DraftLengthPolicy(CPU_CURVE)
    before = p.rates("ngram", 3)
    for _ in range(20):  # nothing was sent: only the model's own next token is known
        p.observe(Draft([7, 8, 9], 3, "ngram"), [7])
    assert p.rates("ngram", 3)[0] > before[0]


def test_select_picks_the_more_promising_drafter():
    p = DraftLengthPolicy(CPU_CURVE)
    train(p, "reference", 2, right=False)
    train(p, "prompt_lookup", 2, right=True)
    chosen, n = p.select([Draft([1] * 8, 2, "reference"), Draft([2] * 8, 2, "prompt_lookup")])
    assert chosen.source == "prompt_lookup" and n > 0


def test_stats_carry_across_requests_and_forget():
    stats = AcceptanceStats(horizon=50)
    train(DraftLengthPolicy(CPU_CURVE, stats=stats), "reference", 8, right=True)
    fresh = DraftLengthPolicy(CPU_CURVE, stats=stats)  # a later request sharing the stats
    assert fresh.choose(Draft([1] * 16, 8, "reference")) == 16
    train(fresh, "reference", 8, right=False, times=200)
    later = DraftLengthPolicy(CPU_CURVE, stats=stats)
    assert later.choose(Draft([1] * 16, 8, "reference")) == 0
    r = stats.overall["reference"]
    assert r.s0 + r.f0 <= 51


def test_loss_budget_stops_drafting_after_failed_drafts_and_reopens():
    p = DraftLengthPolicy(CPU_CURVE, exploration=1.0)
    train(p, "reference", 8, right=True)  # the rates say: draft
    good = Draft([1] * 8, 8, "reference")
    assert p.select([good], loss_budget=0.0)[1] == 8
    p.record(8, 0)  # a whole draft rejected: 2.17 - 1 = 1.17 plain steps lost
    assert p.debt > 1.0
    assert p.select([good], loss_budget=0.0) == (Draft(), 0)  # over budget + exploration: plain step
    assert p.select([good], loss_budget=0.5)[1] == 8  # the budget grows with the tokens generated
    p.record(8, 8)  # an accepted draft pays the debt back
    assert p.debt < 0 and p.select([good], loss_budget=0.0)[1] == 8


def test_loss_budget_charges_the_timed_cost_when_the_decoder_gives_it():
    # The curve says a failed 8-token draft loses 1.17 plain steps; timed, it took 2.6 steps.
    modelled, timed = DraftLengthPolicy(CPU_CURVE), DraftLengthPolicy(CPU_CURVE)
    modelled.record(8, 0)
    timed.record(8, 0, timed_cost=2.6)
    assert abs(modelled.debt - 1.17) < 1e-9 and abs(timed.debt - 1.6) < 1e-9
    good = Draft([1] * 8, 8, "reference")
    for p in (modelled, timed):
        train(p, "reference", 8, right=True)
    # A budget of 1.3 plain steps: the modelled debt still fits, the real one does not.
    assert modelled.select([good], loss_budget=1.3)[1] == 8
    assert timed.select([good], loss_budget=1.3) == (Draft(), 0)
    timed.record(8, 8, timed_cost=2.6)  # accepted tokens pay back against the timed cost too
    assert abs(timed.debt - (1.6 + 1.6 - 8)) < 1e-9


def _request_after_misses(stats, request_prior=0.5):
    """A request whose reference and prompt-lookup drafts miss (the model paraphrases)."""
    p = DraftLengthPolicy(CPU_CURVE, stats=stats, request_prior=request_prior)
    for source, match_len in (("reference", 2), ("prompt_lookup", 3), ("reference", 5), ("prompt_lookup", 2)):
        p.observe(Draft([1, 2, 3, 4], match_len, source), [9])  # first token wrong (sent or shadow)
    return p


def test_misses_in_one_request_hold_back_every_drafter_in_it():
    stats = AcceptanceStats()
    earlier = DraftLengthPolicy(CPU_CURVE, stats=stats)
    for source, match_len in (("reference", 2), ("reference", 5), ("prompt_lookup", 2), ("prompt_lookup", 3),
                              ("ngram", 4)):
        train(earlier, source, match_len, right=True, times=20)
    ngram = Draft([1] * 8, 4, "ngram")
    assert DraftLengthPolicy(CPU_CURVE, stats=stats).choose(ngram) == 8  # a new request trusts the learnt rates
    p = _request_after_misses(stats)
    assert p.request_factor() < 0.3
    assert p.choose(ngram) == 0  # the n-gram drafter never missed here, but this request defeats drafters
    # Without the pooled factor (a huge prior) the same misses leave the n-gram bucket untouched.
    assert _request_after_misses(stats, request_prior=1e9).choose(ngram) == 8
    # Shadow checks keep counting: once drafts start hitting again, the request opens up.
    for _ in range(6):
        p.observe(Draft([5, 6], 4, "ngram"), [5, 6])
    assert p.choose(ngram) == 8
    # The next request starts from the learnt rates alone.
    assert DraftLengthPolicy(CPU_CURVE, stats=stats).request_factor() == 1.0


def test_request_factor_never_raises_the_learnt_rates():
    p = DraftLengthPolicy(CPU_CURVE)
    assert p.request_factor() == 1.0
    before = p.rates("reference", 8)
    for _ in range(5):  # more hits than the prior 0.5 predicts
        p.observe(Draft([1, 2], 8, "prompt_lookup"), [1, 2])
    assert p.request_factor() == 1.0
    assert p.rates("reference", 8) == before  # another drafter's bucket: unchanged, not raised


def _factor_after(outcomes, decay):
    p = DraftLengthPolicy(CPU_CURVE, request_decay=decay)
    for hit in outcomes:
        p.observe(Draft([1, 2], 6, "reference"), [1, 2] if hit else [9])
    return p.request_factor()


def test_a_decayed_request_factor_weighs_recent_outcomes_more():
    """Early hits, then misses: with a decay the hits fade, so the factor falls lower than when
    every observation weighs alike; misses, then hits: it recovers sooner."""
    early_hits = [True] * 3 + [False] * 6
    assert _factor_after(early_hits, 0.7) < _factor_after(early_hits, 1.0) < 1.0
    late_hits = [False] * 6 + [True]
    assert _factor_after(late_hits, 1.0) < _factor_after(late_hits, 0.7)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="request_decay"):
            DraftLengthPolicy(CPU_CURVE, request_decay=bad)


MEASURED_CPU_CURVE = [1.0, 1.5, 1.5, 1.5, 1.5, 1.51, 1.51, 1.52, 1.56, 1.6, 1.64]  # SmolLM2 f32, this CPU


def test_a_fresh_policy_drafts_on_strong_evidence_only():
    """Nothing learnt yet (a fresh process): the cold rates depend on the match length, so a
    1-token match is not worth a verify step, a long match is worth a long draft."""
    for curve in (CPU_CURVE, MEASURED_CPU_CURVE):
        p = DraftLengthPolicy(curve)
        n = len(curve) - 1
        assert p.choose(Draft([1] * n, 1, "reference")) == 0
        assert p.choose(Draft([1] * n, 6, "reference")) >= 8
        assert p.choose(Draft([1] * n, 9, "a drafter never seen")) >= 8


def test_cold_rates_rise_with_the_evidence_and_give_way_to_what_is_learnt():
    p = DraftLengthPolicy(CPU_CURVE)
    cold = [p.rates("reference", m)[0] for m in (1, 2, 3, 4, 6, 16, 32)]
    assert cold == sorted(cold) and cold[0] < 0.3 < 0.7 < cold[-1]
    train(p, "reference", 1, right=True, times=40)  # this model copies even on 1-token matches
    assert p.rates("reference", 1)[0] > 0.9
    assert p.choose(Draft([1] * 16, 1, "reference")) == 16
    flat = DraftLengthPolicy(CPU_CURVE, prior=0.5)  # the old flat prior, still available
    assert flat.rates("reference", 1) == flat.rates("reference", 32) == (0.5, 0.5)


def test_min_gain_is_the_margin_a_draft_must_promise():
    """A cold 1-token match promises 1.2 tokens (``COLD_RATES``) for a verify costing 1.1 plain steps:
    9% over a plain step, under the default 10% margin and over a 2% one; the config's value
    is the policy's default (a constant since issue 55), which every request's drafting takes."""
    from rag_accel import DecoderConfig
    from rag_accel.speculation import RequestDrafting, StepCosts

    curve = [1.0 + 0.1 * n for n in range(9)]
    weak = Draft([1] * 8, 1, "prompt_lookup")
    assert DraftLengthPolicy(curve).select([weak]) == (NO_DRAFT, 0)
    assert DraftLengthPolicy(curve, min_gain=0.02).select([weak]) == (weak, 1)
    cfg = DecoderConfig(drafters=("prompt_lookup",), max_draft_tokens=8)
    drafting = RequestDrafting.from_config(cfg, [5, 6, 7], [], curve, AcceptanceStats(), StepCosts())
    assert drafting.policy.min_gain == 0.1 and drafting.policy.select([weak]) == (NO_DRAFT, 0)


def test_a_draft_with_probabilities_is_sent_as_far_as_they_pay():
    """A frequency draft's length comes from its tokens' probabilities: at 0.1 of a step per draft token
    a token claiming 0.9 pays, one claiming 0.05 does not; a cheap curve sends further."""
    steep = [1.0 + 0.1 * n for n in range(9)]
    draft = Draft([1, 2, 3, 4], 3, "frequency", (0.9, 0.8, 0.05, 0.04))
    assert DraftLengthPolicy(steep).select([draft]) == (draft, 2)
    cheap = [1.0 + 0.01 * n for n in range(9)]
    assert DraftLengthPolicy(cheap).select([draft]) == (draft, 4)
    # the same draft without probabilities goes by the match-length rates (a cold 3-token match: 0.45, 0.7)
    plain = Draft([1, 2, 3, 4], 3, "frequency")
    assert DraftLengthPolicy(steep).value(plain) != DraftLengthPolicy(steep).value(draft)


def test_probabilities_are_calibrated_by_what_their_drafts_got_right():
    """Drafts on 1-token matches claiming 0.5 a token whose first token keeps missing: the calibration of
    that match length falls (the whole draft's claim counted after a miss) and the policy stops sending
    them, while the same claim on 6-token matches, still right, keeps being sent."""
    steep = [1.0 + 0.1 * n for n in range(9)]
    stats = AcceptanceStats()
    policy = DraftLengthPolicy(steep, stats=stats)
    weak = Draft([1, 2, 3, 4], 1, "frequency", (0.5, 0.5, 0.5, 0.5))
    strong = Draft([1, 2, 3, 4], 6, "frequency", (0.5, 0.5, 0.5, 0.5))
    assert policy.select([weak])[1] == 4 and policy.select([strong])[1] == 4
    for _ in range(40):
        policy.observe(weak, [9])              # missed at once: claimed 2 leading tokens, got 0
        policy.observe(strong, [1, 2, 3, 4])   # all four right
    g_weak = stats.calibration_factors(("frequency", 1))
    assert g_weak[1] < 0.2 and g_weak[4] < 0.2  # (positions past the miss counted as claimed, not reached)
    assert stats.calibration_factors(("frequency", 6))[1] > 1.5
    assert policy.select([weak]) == (NO_DRAFT, 0)
    assert policy.select([strong]) == (strong, 4)
    # a draft that was right as far as the step showed claims only the positions known
    fresh = AcceptanceStats()
    DraftLengthPolicy(steep, stats=fresh).observe(strong, [1, 2])
    cells = fresh.calibration[("frequency", 6)]
    assert [cells[1], cells[2]] == [[1.0, 0.5], [1.0, 0.5]] and cells[3] == [0.0, 0.0]


def test_token_cost_is_the_curve_slope_up_to_a_length():
    """A transformers CPU curve, flat to 8 draft tokens and steep past 16, reads as cheap over the first 10
    (what the frequency drafter is priced over), dear over all 32."""
    hf_cpu = [1.0] + [1.4] * 8 + [1.4 + 0.1 * i for i in range(1, 25)]  # 0..32
    policy = DraftLengthPolicy(hf_cpu)
    assert policy.token_cost(10) == pytest.approx(0.2 / 9)
    assert policy.token_cost() == pytest.approx(2.4 / 31)
    assert policy.token_cost(1) == pytest.approx(0.4)  # one draft token: what it costs over a plain step
    policy.scale_cost(2.0)  # verification got dearer: so does each draft token
    assert policy.token_cost(10) == pytest.approx(0.4 / 9)
