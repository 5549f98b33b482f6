"""One request's drafting, shared by the engines: which draft to verify, how much of it, and what it cost.

Every verify step of a request, on any engine, goes through the same verbs:

1. :meth:`RequestDrafting.learn`: the context grew by the tokens the last step
   produced; the drafters index them and every candidate draft learns from them.
2. :meth:`RequestDrafting.choose`: propose candidates, and pick the draft and the
   number of its tokens worth verifying (0: a plain step).
3. (the engine verifies them in one forward pass)
4. :meth:`RequestDrafting.account`: charge what the step really took and how many
   tokens it bought; learn how far the measured cost curve is off.

The Hugging Face decoder (:mod:`rag_accel.hf.decoder`) calls these once per step of
its one request; the vLLM proposer once per row of its batch. What is learnt
across requests lives in :class:`StepCosts` (:class:`BatchStepCosts` for a batch engine)
and the policy's :class:`~rag_accel.policy.AcceptanceStats`, one of each per engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .config import DecoderConfig
from .drafters import NO_DRAFT, Draft, Drafter, DrafterChain, FrequencyDrafter, build_drafters
from .policy import AcceptanceStats, DraftLengthPolicy

# A frequency drafter is priced by the cost of draft tokens up to this many (vLLM's default for this project's
# proposer, and the drafts its pricing was chosen on): a verify curve flat up to 8 tokens and steep past 16
# (transformers on a CPU) must not read as dear for the short drafts most matches allow.
FREQUENCY_PRICED_UP_TO = 10


class StepCosts:
    """What steps really cost, learnt across requests from timing them (one per decoder or engine).

    ``scale[b]``: the extra cost of a multi-token verify step beyond a one-token one, observed
    over what the measured curve says, per context-length bucket ``b = len(context).bit_length()``
    (longer contexts make multi-token steps dearer than the one-off measurement).
    ``step_s``: running time of a one-token step. ``draft_token_s`` / ``catchup_token_s``: a
    draft model's time per drafted token, and per context token it catches up on.
    """

    def __init__(self) -> None:
        self.scale: dict[int, float] = {}
        self.step_s: float | None = None
        self.draft_token_s: float | None = None
        self.catchup_token_s: float | None = None

    def scale_at(self, context_len: int) -> float:
        return self.scale.get(context_len.bit_length(), 1.0)

    def learn_step(self, policy: DraftLengthPolicy, n_send: int, seconds: float,
                   plain_s: float | None, context_len: int) -> float | None:
        """Learn from one verify step that took ``seconds`` for ``n_send`` draft tokens;
        returns its cost in this request's plain steps (``None`` before a plain step was timed)."""
        step_s = seconds / policy.cost[n_send]  # a one-token step's time, as this step tells it
        self.step_s = step_s if self.step_s is None else 0.9 * self.step_s + 0.1 * step_s
        if n_send == 0 or plain_s is None or not policy.adaptive:
            return None
        timed_cost = seconds / plain_s
        ratio = (timed_cost - 1.0) / max(policy.base_cost[n_send] - 1.0, 1e-3)
        bucket = context_len.bit_length()
        old = self.scale.get(bucket, 1.0)
        self.scale[bucket] = min(4.0, max(0.25, 0.9 * old + 0.1 * ratio))
        return timed_cost

    def learn_draft_model(self, drafter: object) -> None:
        """Learn a draft model's cost per drafted token and per caught-up context token."""
        fed = getattr(drafter, "fed", 0)
        if fed > 4:  # a catch-up over many ids: learn its cost per id
            per_id = drafter.sync_s / fed  # type: ignore[attr-defined]
            self.catchup_token_s = per_id if self.catchup_token_s is None else 0.8 * self.catchup_token_s + 0.2 * per_id
        per_token = getattr(drafter, "token_s", None)
        if per_token is not None:
            self.draft_token_s = per_token if self.draft_token_s is None else 0.8 * self.draft_token_s + 0.2 * per_token


class BatchStepCosts(StepCosts):
    """Step time as a line in the tokens a step schedules, learnt from every decode step.

    ``t(T) = a + b T``, fitted by exponentially weighted least squares over the last
    ~``1 / (1 - decay)`` steps, pulled towards ``prior_slope`` (``b / a``) with the weight of
    ``prior_weight`` steps, and never below ``min_slope_frac`` of it: on a shared machine a
    step's time varies more than the draft tokens change it, and a fit that finds ``b = 0``
    would make every draft free. That floor gives way only where ~1,000 steps' data place the
    slope below it (:meth:`slope_floor`: a GPU with a few requests in flight, where an H200's
    CUDA-graph steps put a draft token at 0.2-0.4% of a step from 4 rows up, against ~1.3% at one
    row; ``benchmarks/results/gpu_step_costs_h200.md``, replayed in
    ``benchmarks/results/batch_costs_smollm2_last100_h200.md``). The prior, 0.03, was
    measured on the 2-core CPU of ``benchmarks/results/vllm_cpu_smollm2.md`` (SmolLM2-135M
    float32, ~700-token RAG prompts: one row with 10 draft tokens took ~1.25x a plain step; four
    rows ~1.6x at 4 draft tokens each).
    :meth:`set_batch` turns it into this step's :meth:`scale_at`: the cost of one draft token
    on one row in that row's plain steps, ``B b / t(T)`` (``B`` rows all wait for it).

    What the data taught is kept: a draft token's cost grows with the batch (a few rows leave
    the CPU waiting on memory, where extra tokens ride along almost free; sixteen rows keep it
    computing, where each token costs its full share). When the recent steps have spread in
    ``T`` (the ridge trusts the data 4:1 over the prior), the fitted slope, relative to the
    average cost of a token in those steps, is remembered for that size of step (powers of two
    of ``T``; 1 means fully compute-bound); later, when a busy
    batch has stopped drafting and ``T`` no longer varies, the ridge pulls towards that memory
    instead of the generic prior. Otherwise the slope would drift back to the cheap prior, the
    rows would draft again, lose, and learn it again: a cycle that cost ~3% at 16 in flight.

    The policy gets the curve ``1 + CURVE_SLOPE L`` and the scale ``s / CURVE_SLOPE``, so that
    its update tolerance (0.01 of the scale) is 1% of the slope, not 0.01 per token.
    """

    CURVE_SLOPE = 0.05

    def __init__(self, decay: float = 0.98, prior_slope: float = 0.03, prior_weight: float = 16.0,
                 min_slope_frac: float = 0.5, floor_z: float | None = 4.0, floor_decay: float = 0.998) -> None:
        super().__init__()
        self.decay, self.prior_slope, self.prior_weight = decay, prior_slope, prior_weight
        self.min_slope_frac, self.floor_z, self.floor_decay = min_slope_frac, floor_z, floor_decay
        self._sums = [0.0] * 5  # weight, sum T, sum t, sum T^2, sum T t
        self._long = [0.0] * 7  # the same over ~1 / (1 - floor_decay) steps, and sum t^2, sum weight^2
        self._learnt: dict[int, float] = {}  # bucket of T (bit length) -> learnt b / (mean t / mean T)
        self.slope = prior_slope  # cost of one draft token on one row, in that row's steps (s)
        self.batch_scale = prior_slope / self.CURVE_SLOPE

    def observe(self, tokens: int, seconds: float) -> None:
        """One decode step scheduled ``tokens`` tokens and took ``seconds``."""
        d = self.decay
        w, st, sy, stt, sty = (v * d for v in self._sums)
        self._sums = [w + 1, st + tokens, sy + seconds, stt + tokens * tokens, sty + tokens * seconds]
        d = self.floor_decay
        w, st, sy, stt, sty, syy, sww = self._long
        self._long = [w * d + 1, st * d + tokens, sy * d + seconds, stt * d + tokens * tokens,
                      sty * d + tokens * seconds, syy * d + seconds * seconds, sww * d * d + 1]
        self.step_s = seconds if self.step_s is None else 0.9 * self.step_s + 0.1 * seconds

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``, or ``None`` before any step."""
        w, st, sy, stt, sty = self._sums
        if w <= 0:
            return None
        mt, my = st / w, sy / w
        var, cov = stt / w - mt * mt, sty / w - mt * my
        # Ridge towards the prior slope: with little spread in T the data cannot tell b.
        generic_b = self.generic_prior_b()
        bucket = max(1, int(round(mt))).bit_length()
        learnt = self._learnt.get(bucket)
        prior_b = generic_b if learnt is None else learnt * my / mt
        k = self.prior_weight / w
        b = max(self.slope_floor(), (cov + k * prior_b) / (var + k))
        if var >= 4.0 * k and my > 0:  # the data outweigh the prior (4:1): remember what they say at this size
            rel = b * mt / my  # the marginal token's cost in average tokens' (1: fully compute-bound)
            self._learnt[bucket] = rel if learnt is None else 0.9 * learnt + 0.1 * rel
        return max(my - b * mt, 1e-6), b

    def generic_prior_b(self) -> float:
        """``b`` as the prior slope puts it (``b / a = prior_slope``) at the recent steps' mean ``T`` and
        time (0 before any step)."""
        w, st, sy = self._sums[:3]
        if w <= 0:
            return 0.0
        return self.prior_slope * (sy / w) / (1.0 + self.prior_slope * st / w)

    def slope_floor(self) -> float:
        """The least ``b`` may be: ``min_slope_frac`` of :meth:`generic_prior_b`, unless the long window's
        data place the slope below that (a GPU with several rows in a step, where a draft token costs a
        fraction of a percent of it): then their upper bound (:meth:`slope_bound`). Noise alone cannot lower
        it: it widens the bound."""
        floor = self.min_slope_frac * self.generic_prior_b()
        bound = self.slope_bound()
        return floor if bound is None else min(floor, bound)

    def slope_bound(self) -> float | None:
        """The long window's fitted ``b`` plus ``floor_z`` standard errors (:meth:`long_fit`); ``None``
        with ``floor_z=None`` or without a fit."""
        fit = self.long_fit()
        if self.floor_z is None or fit is None:
            return None
        b, se = fit
        return max(0.0, b + self.floor_z * se)

    def long_fit(self) -> tuple[float, float] | None:
        """``(b, its standard error)`` fitted over the long window (seconds per scheduled token);
        ``None`` with fewer than ~100 steps' worth of data or no spread in ``T``."""
        w, st, sy, stt, sty, syy, sww = self._long
        if w <= 0 or w * w < 100.0 * sww:
            return None
        mt, my = st / w, sy / w
        var, cov = stt / w - mt * mt, sty / w - mt * my
        if var <= 1e-9:
            return None
        resid = max(0.0, syy / w - my * my - cov * cov / var)
        return cov / var, (resid * sww / (w * w * var)) ** 0.5  # the weighted fit's standard error of b

    def set_batch(self, rows: int, tokens: int) -> float:
        """This step's per-draft-token cost for one row of ``rows``, the batch scheduling
        ``tokens``: ``s = rows b / t(tokens)``. Returns the policy's scale, ``s / CURVE_SLOPE``."""
        ab = self.line()
        if ab is None:
            a, b = 1.0, self.prior_slope
        else:
            a, b = ab
        self.slope = min(4.0, max(1e-3, rows * b / (a + b * tokens)))
        self.batch_scale = self.slope / self.CURVE_SLOPE
        return self.batch_scale

    def scale_at(self, context_len: int) -> float:
        return self.batch_scale

    def prefill_steps(self, prompt_tokens: int) -> float:
        """What prefilling ``prompt_tokens`` costs in one row's plain steps, ``t(P) / t(1)`` on the
        learnt line (the prior's before any step): a request's loss budget counts its prefill."""
        a, b = self.line() or (1.0, self.prior_slope)
        return (a + b * prompt_tokens) / (a + b)

    def learn_step(self, policy: Any, n_send: int, seconds: float, plain_s: float | None,
                   context_len: int) -> float | None:
        return None  # learnt per step for the whole batch (observe), not per row


class RequestDrafting:
    """One request's drafters, draft-length policy and step timing.

    Args:
        chain: the request's drafters (see :func:`rag_accel.drafters.build_drafters`).
        policy: the request's :class:`~rag_accel.policy.DraftLengthPolicy`.
        costs: the engine's :class:`StepCosts`, shared by its requests.
        max_draft_tokens: most draft tokens one step verifies.
        max_loss: the fraction of this request's plain-greedy time that failed drafts may cost.
        probe_every: steps without asking the draft model before one probe ask.
    """

    def __init__(self, chain: DrafterChain, policy: DraftLengthPolicy, costs: StepCosts,
                 max_draft_tokens: int, max_loss: float, probe_every: int = 32) -> None:
        self.chain, self.policy, self.costs = chain, policy, costs
        self.max_draft_tokens, self.max_loss, self.probe_every = max_draft_tokens, max_loss, probe_every
        self.candidates: list[Draft] = []  # the last step's drafts, sent or not: they learn from its tokens
        self.prefill_s = 0.0  # the request's prefill time, for the loss budget
        self.prefill_steps: float | None = None  # or its cost in plain steps, where the engine knows that instead
        self.plain_s: float | None = None  # running time of this request's plain (one-token) steps
        self._since_model = 0  # steps since a draft model was last asked

    @classmethod
    def from_config(cls, config: DecoderConfig, context: Sequence[int], references: Sequence[Sequence[int]],
                    cost_curve: Sequence[float], acceptance: AcceptanceStats, costs: StepCosts, *,
                    drafters: Sequence[Drafter] | None = None,
                    draft_model: Callable[[], Drafter] | None = None) -> RequestDrafting:
        """A request's drafting as ``config`` says: its drafters (``drafters`` instead, if given;
        ``draft_model`` makes a draft-model drafter) over ``context`` (the prompt; drafters index it
        and keep a reference to the list, which the engine extends) and ``references``."""
        chain = (DrafterChain(drafters) if drafters is not None
                 else build_drafters(config, context, references, draft_model))
        policy = DraftLengthPolicy(cost_curve, adaptive=config.adaptive, stats=acceptance, min_gain=config.min_gain,
                                   request_prior=0.5 if config.pool_misses else None)
        return cls(chain, policy, costs, config.max_draft_tokens, config.max_loss)

    def add_drafter(self, drafter: Drafter, order: Sequence[str]) -> None:
        """``drafter``, built off the step loop (a reference index), joins mid-request where ``order``
        (the config's drafter names) puts it: after the drafters named before it there, in front of
        the others. It sees the context's updates from here on.

        Example:
            >>> from rag_accel.drafters import DrafterChain, NgramDrafter, ReferenceDrafter
            >>> drafting = RequestDrafting(DrafterChain([NgramDrafter([1, 2, 3])]), None, StepCosts(), 8, 0.03)
            >>> drafting.add_drafter(ReferenceDrafter([[7, 8, 9]]), ("reference", "ngram"))
            >>> [d.name for d in drafting.chain.drafters]
            ['reference', 'ngram']
        """
        before = set(order[:order.index(drafter.name)]) if drafter.name in order else set(order)
        position = sum(1 for d in self.chain.drafters if d.name in before)
        self.chain.insert(position, drafter)

    # 1. learn
    def learn(self, context: Sequence[int], new_tokens: Sequence[int]) -> None:
        """``context`` (prompt + output) now ends with ``new_tokens``, the last step's output."""
        self.chain.update(context, len(new_tokens))
        for d in self.candidates:  # every candidate learns, sent or not
            self.policy.observe(d, new_tokens)

    # 2. choose
    def choose(self, context: Sequence[int], n_generated: int, remaining: int) -> tuple[Draft, int]:
        """The draft to verify next and how many of its tokens to send (0: a plain step).
        ``remaining``: tokens the request may still produce (a step always adds one of its own)."""
        max_len = min(self.max_draft_tokens, remaining - 1)
        policy = self.policy
        policy.scale_cost(self.costs.scale_at(len(context)))
        if policy.adaptive:
            for d in self.chain.drafters:  # a frequency draft's length cap follows what a draft token costs now
                if isinstance(d, FrequencyDrafter):
                    d.price(policy.token_cost(FREQUENCY_PRICED_UP_TO))
            self.candidates = self.chain.candidates(context, max_len)
        else:
            self.candidates = [d for d in [self.chain.propose(context, max_len)] if d.tokens]
        budget = self.loss_budget(n_generated)
        draft, n_send = policy.select(self.candidates, budget)
        if n_send == 0 and self.chain.costly and policy.adaptive:  # references first, then the draft model
            draft, n_send = self._ask_draft_models(context, max_len, budget, remaining)
        return draft, n_send

    def loss_budget(self, n_generated: int) -> float:
        """Plain steps failed drafts may still cost: ``max_loss`` of the plain-greedy time so far,
        prefill included (before this request has timed a plain step, at the engine's running
        one-token step time: a fresh request may draft from its first step)."""
        prefill = self.prefill_steps
        if prefill is None:
            plain = self.plain_s or self.costs.step_s
            if not plain:
                return 0.0
            prefill = self.prefill_s / plain
        return self.max_loss * (prefill + n_generated)

    def _ask_draft_models(self, context: Sequence[int], max_len: int, loss_budget: float,
                          remaining: int) -> tuple[Draft, int]:
        """No copy draft is worth sending: ask the draft model(s), if the cost model says it pays
        (or for one probe after ``probe_every`` steps without asking, if it nearly pays).
        Drafting time is charged to the loss budget."""
        costs, policy = self.costs, self.policy
        draft_cost = costs.draft_token_s / costs.step_s if costs.draft_token_s is not None and costs.step_s else None
        for drafter in self.chain.costly:
            catch_up = 0.0
            if costs.catchup_token_s is not None and costs.step_s and hasattr(drafter, "behind"):
                catch_up = drafter.behind(context) * costs.catchup_token_s / costs.step_s
            window = policy.model_window(drafter.name, draft_cost, max_len, loss_budget,
                                         probe=self._since_model >= self.probe_every, catch_up=catch_up,
                                         remaining=remaining)
            if window == 0:
                continue
            t0 = time.perf_counter()
            draft = drafter.propose(context, window)
            dt = time.perf_counter() - t0
            costs.learn_draft_model(drafter)
            if costs.step_s:
                policy.charge(dt / costs.step_s)  # all of it, catch-up included
            self._since_model = 0
            if draft.tokens:
                self.candidates.append(draft)  # learns from the step like the others
                return draft, len(draft.tokens)
            return NO_DRAFT, 0
        self._since_model += 1
        return NO_DRAFT, 0

    # 4. account
    def account(self, n_send: int, n_accepted: int, seconds: float, context_len: int) -> None:
        """The verify step of ``n_send`` draft tokens took ``seconds`` and accepted ``n_accepted``."""
        timed_cost = self.costs.learn_step(self.policy, n_send, seconds, self.plain_s, context_len)
        if n_send == 0:
            self.plain_s = seconds if self.plain_s is None else 0.8 * self.plain_s + 0.2 * seconds
        # The loss budget is charged what the step really took (in this request's plain steps).
        self.policy.record(n_send, n_accepted, timed_cost)
