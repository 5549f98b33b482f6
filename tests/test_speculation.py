"""A request's drafting (rag_accel.speculation) learning what steps cost from timings that are noisy.

No model and no clock: each step "takes" what a made-up verify cost says, times seeded noise, and the
drafting is told so through ``RequestDrafting.account``, as the transformers decoder tells it."""

import math
import random

from rag_accel.drafters import Draft, DrafterChain
from rag_accel.policy import AcceptanceStats, DraftLengthPolicy
from rag_accel.speculation import RequestDrafting, StepCosts

# SmolLM2-135M float32 on a 2-core CPU, as the decoder measures it: any draft ~1.5 plain steps, flat after.
CURVE = (1.0, 1.5, 1.5, 1.5, 1.5, 1.51, 1.51, 1.52, 1.56, 1.6, 1.64)
ANSWER = 60  # tokens per request
PREFILL = 8.0  # plain steps (a ~700-token RAG prompt)


class Copying:
    """A reference drafter whose every draft the model accepts for its first ``right`` tokens; it finds no
    match in the first ``own`` of every ``every`` tokens of the answer (the model's own words: plain steps)."""

    name = "reference"

    def __init__(self, right, every=12, own=4):
        self.right, self.every, self.own = right, every, own

    def propose(self, context, max_len):
        if (len(context) - 700) % self.every < self.own:
            return Draft()
        right = min(self.right, max_len)
        return Draft([1] * right + [2] * (max_len - right), 8, self.name)  # (the model's tokens are all 1)

    def update(self, context, num_new):
        pass


def serve(requests, right, extra_scale=1.0, jitter=0.0, stalls=0.0, drift=0.0, seed=0, every=12, own=4):
    """``requests`` requests in turn on one engine's learnt costs; a verify step of ``n`` draft tokens costs
    ``1 + extra_scale * (CURVE[n] - 1)`` plain steps (1 s each on a steady machine). The machine's noise: each
    step's time is jittered (log-normal, ``jitter``), stalled 2-10x by another process (probability
    ``stalls``), and its speed drifts (the log of a step's time a random walk, ``drift`` a step, pulled back
    by 5% a step). Returns each request's (steps, draft steps) and the costs learnt."""
    rng, costs, stats, out, speed = random.Random(seed), StepCosts(), AcceptanceStats(), [], [0.0]

    def noisy():
        speed[0] = 0.95 * speed[0] + rng.gauss(0.0, drift)
        f = math.exp(speed[0]) * rng.lognormvariate(0.0, jitter)
        return f * rng.uniform(2.0, 10.0) if rng.random() < stalls else f

    for _ in range(requests):
        context = [0] * 700
        drafting = RequestDrafting(DrafterChain([Copying(right, every, own)]), DraftLengthPolicy(CURVE, stats=stats),
                                   costs, max_draft_tokens=len(CURVE) - 1, max_loss=0.03)
        drafting.prefill_s = PREFILL * noisy()
        new, steps, drafted = [1], 1, 0
        context += new
        while len(context) - 700 < ANSWER:
            drafting.learn(context, new)
            _, n = drafting.choose(context, len(context) - 700, ANSWER - (len(context) - 700))
            accepted = min(n, right)
            cost = 1.0 + extra_scale * (CURVE[n] - 1.0)
            drafting.account(n, accepted, cost * noisy(), len(context))
            new = [1] * (accepted + 1)
            context += new
            steps, drafted = steps + 1, drafted + (n > 0)
        out.append((steps, drafted))
    return out, costs


def test_noisy_timings_do_not_turn_off_drafts_that_pay():
    """Every draft's first 4 tokens are accepted: 5 tokens a step for 1.5 plain steps. On a loaded machine
    (step times jittered by 25%, 1 step in 10 stalled 2-10x) drafting must stay on in every request, and the
    learnt scale of the curve (truly 1) under 2: a running mean of the raw ratios reached 2-4."""
    quiet, _ = serve(8, right=4)
    for seed in range(3):
        loaded, costs = serve(8, right=4, jitter=0.25, stalls=0.1, seed=seed)
        for (steps, drafted), (quiet_steps, quiet_drafted) in zip(loaded, quiet):
            assert steps <= quiet_steps + 2 and drafted >= quiet_drafted - 1, (seed, loaded, quiet)
        assert costs.scale_at(760) <= 2.0, (seed, costs.scale)


def test_a_drifting_machine_does_not_turn_off_drafts_that_pay():
    """Drafts of one right token each (2 tokens for 1.5 plain steps: they pay, by a third), in runs of 28
    drafted steps, on a machine whose speed drifts (by 10% a step): a run's late steps, compared with the plain
    steps before it, would look dear. Drafting must stay on as on a steady machine."""
    steady, _ = serve(8, right=1, every=30, own=2)
    for seed in range(3):
        drifting, costs = serve(8, right=1, drift=0.1, every=30, own=2, seed=seed)
        assert drifting == steady, (seed, drifting, steady)
        assert 0.5 <= costs.scale_at(760) <= 1.5, (seed, costs.scale)


def test_consistent_evidence_still_turns_off_drafts_that_cost_more_than_they_save():
    """Each verify step really costs 3x the curve's extra (2.5 plain steps) and buys 2 tokens (1 accepted):
    the timings, steady this time, must teach the scale so, and drafting stop."""
    served, costs = serve(8, right=1, extra_scale=3.0, jitter=0.05)
    assert served[0][1] > 0  # at first the curve (1.5 steps for 2 tokens) says drafting pays
    assert all(drafted <= 2 for _, drafted in served[2:]), served
    assert costs.scale_at(760) > 1.6, costs.scale  # above 1.64, where 2 tokens stop paying for a step


def test_a_paying_draft_is_never_charged_by_its_timing_alone():
    """A draft whose accepted tokens pay for it by the curve (3 accepted for 1.5 plain steps) owes the loss
    budget nothing however long a stall made its step; any draft is charged at most twice its price."""
    p = DraftLengthPolicy(CURVE)
    p.record(3, 3, timed_cost=7.5)  # stalled 5x: taken as 3 plain steps, for 4 tokens
    assert abs(p.debt - (3.0 - 4.0)) < 1e-9
    p.record(3, 1, timed_cost=4.0)  # 2 tokens for what the curve prices at 1.5 steps: no loss
    assert abs(p.debt - (3.0 - 4.0)) < 1e-9
    p.record(3, 3, timed_cost=1.2)  # a quick one is credited as timed
    assert abs(p.debt - (3.0 - 4.0 + 1.2 - 4.0)) < 1e-9
    q = DraftLengthPolicy(CURVE)
    q.record(3, 0, timed_cost=7.5)
    assert abs(q.debt - (2 * 1.5 - 1.0)) < 1e-9
    q.record(3, 0, timed_cost=1.8)  # within twice its price: charged as timed
    assert abs(q.debt - (2.0 + 0.8)) < 1e-9
