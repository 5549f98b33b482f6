"""A vLLM engine's step costs: one decode step schedules every row's tokens at once, so a draft token's cost
is learnt as a line in the tokens a step schedules (:class:`BatchStepCosts`), for the proposer's rows
(:class:`~rag_accel.speculation.RequestDrafting`) to price their drafts by. No vLLM is imported here."""

from __future__ import annotations

from typing import Any

from ..speculation import StepCosts


class BatchStepCosts(StepCosts):
    """Step time as a line in the tokens a step schedules, learnt from every decode step.

    ``t(T) = a + b T``, fitted by exponentially weighted least squares over the last ~``1 / (1 - decay)`` steps,
    pulled towards ``prior_slope`` (``b / a``; measured on a 2-core CPU: ``benchmarks/results/vllm_cpu_smollm2.md``)
    with the weight of ``prior_weight`` steps, and never below ``min_slope_frac`` of it: on a shared machine a step's
    time varies more than the draft tokens change it, and a fit that found ``b = 0`` would make every draft free.
    That floor gives way only where ~1,000 steps' data place the slope below it (:meth:`slope_floor`: a GPU with a
    few requests in flight; ``benchmarks/results/batch_costs_smollm2_last100_h200.md``). :meth:`set_batch` turns the
    line into this step's price of one draft token on one row, ``B b / t(T)`` (``B`` rows all wait for it).

    What the data taught is kept: where the recent steps spread in ``T`` (the data outweigh the prior 4:1), the
    fitted slope relative to the average token's cost is remembered for that size of step (powers of two of ``T``),
    and the ridge pulls towards it once a busy batch has stopped drafting, instead of drifting back to the cheap
    prior and learning the loss again.

    The policy gets the curve ``1 + CURVE_SLOPE L`` and the scale ``s / CURVE_SLOPE``, so that its update tolerance
    (0.01 of the scale) is 1% of the slope, not 0.01 per token.
    """

    CURVE_SLOPE = 0.05

    @classmethod
    def curve(cls, k: int) -> tuple[float, ...]:
        """The policy's cost curve for 0..``k`` draft tokens, ``1 + CURVE_SLOPE L``: a stand-in that
        :meth:`set_batch`'s scale turns into each step's real price.

        Example:
            >>> BatchStepCosts.curve(2)
            (1.0, 1.05, 1.1)
        """
        return tuple(1.0 + cls.CURVE_SLOPE * n for n in range(k + 1))

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
        b = max(self.slope_floor(generic_b), (cov + k * prior_b) / (var + k))
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

    def slope_floor(self, generic_b: float | None = None) -> float:
        """The least ``b`` may be: ``min_slope_frac`` of :meth:`generic_prior_b` (``generic_b``: it, computed
        already), unless the long window's data place the slope below that (a GPU with several rows in a step,
        where a draft token costs a fraction of a percent of it): then their upper bound (:meth:`slope_bound`).
        Noise alone cannot lower it: it widens the bound."""
        floor = self.min_slope_frac * (self.generic_prior_b() if generic_b is None else generic_b)
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
