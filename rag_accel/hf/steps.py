"""A transformers decoder's forwards: :class:`Steps` owns the KV cache each request takes (the static cache where
it holds one, else a dynamic one), the forward path (packed attention, planned or exact products), the plans and
probes that path needs, and the cost curves timed on it; the timing harness those curves come from."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .attention import VERDICT_KIND, exact_attention, packed_gqa
from .attention import install as install_packed_gqa
from .calibration import Calibration
from .kv import cache_kwarg, context_window, new_cache, rollback_cache
from .linears import exact_linears, exact_plans, install_exact, plan_linears, planned_linears
from .linears import install as install_linear_plans
from .static import StaticLease, release, size_for
from .static import resolve as resolve_static_steps
from ..invariant import VERDICTS
from ..speculation import StepCosts

__all__ = ["CALIBRATION_BUDGET_S", "Steps", "forward_seconds", "measure_cost_curve", "measure_draft_costs"]

#: Seconds after which the cost curve's timing stops at the round it is in (one timed round always runs).
CALIBRATION_BUDGET_S = 10.0


class Steps:
    """The forwards of one model, serialised on :attr:`lock` (held for one step of a call).

    ``exact``: verify steps compute every row as a one-token step does (:func:`forward`'s ``exact``).
    ``static_steps``: see :meth:`rag_accel.hf.decoder.ReferenceDecoder.from_pretrained`.
    :attr:`calibration`: what an earlier process measured on this machine (``None``: measure, keep nothing).
    """

    # The forward path of verify steps (class constants; an experiment may set them on an instance): grouped-query
    # attention reading the cached keys and values in place (rag_accel.hf.attention), and each projection's few rows
    # in the layout measured fastest for its weight shape (rag_accel.hf.linears).
    pack_gqa: bool = True
    fast_linears: bool = True

    def __init__(self, model: Any, *, exact: bool, static_steps: bool | None, max_draft_tokens: int,
                 draft_model: Any = None) -> None:
        self.model, self.exact, self.draft_model = model, exact, draft_model
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.context_window: int | None = context_window(model)
        self.lock = threading.RLock()
        self.calibration: Calibration | None = None
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = cache_kwarg(model)
        install_packed_gqa()  # inert until a forward asks for it
        # on a GPU: steps on a static KV cache, captured as CUDA graphs (rag_accel.hf.static; None on a CPU by default)
        self.static = resolve_static_steps(model, static_steps, exact, self._cache_kwarg, max_draft_tokens,
                                           self.context_window)
        self._static_curves: dict[int, tuple[float, ...]] = {}  # max_draft -> the static steps' cost curve
        self._linear_plans: dict | None = None  # measured before the first forward that takes them
        # (max_draft, pack_gqa, fast_linears, exact) -> curve: each forward path is timed as it runs
        self._curves: dict[tuple[int, bool, bool, bool], tuple[float, ...]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def static_steps(self) -> bool:
        """Whether requests' steps run on the static cache in fixed sizes (captured as CUDA graphs on a GPU; exact
        steps: unless no size computed its rows alike, found at the first request)."""
        return self.static is not None and not self.static.closed

    @property
    def curves(self) -> dict[tuple[int, bool, bool, bool], tuple[float, ...]]:
        """The cost curves measured so far: ``(max_draft, pack_gqa, fast_linears, exact) -> curve``."""
        return dict(self._curves)

    def open_calibration(self, draft_name: str | None = None) -> Calibration | None:
        """Open what an earlier process measured on this machine for this model (and ``draft_name``'s draft model),
        as :attr:`calibration`; the attention probe's verdicts in it are known from now on."""
        self.calibration = Calibration.open(getattr(self.model, "name_or_path", ""), self.model.dtype, self.device,
                                            draft_name)
        if self.calibration is not None:
            VERDICTS.seed(VERDICT_KIND, self.calibration.get("attention") or {})
        return self.calibration

    def curves_measured(self) -> int:
        """How many cost curves this process has (a request that adds one paid for its measurement)."""
        return len(self._curves) + len(self._static_curves)

    def plan_linears(self) -> dict:
        """The layout of each projection's few-row products (:mod:`rag_accel.hf.linears`), timed on this model once
        (on a CPU; elsewhere none) and installed, with the exact plans where steps are exact; a draft model's are
        planned too (its drafting forwards take them)."""
        with self.lock:
            if self._linear_plans is None:
                cal = self.calibration
                plans = cal.get("linear_plans") if cal else None
                if plans is None:
                    plans = plan_linears(self.model) if self.device.type == "cpu" else {}
                    if cal:
                        cal.put("linear_plans", plans)
                install_linear_plans(self.model, plans)
                if self.exact:
                    exact = cal.get("exact_plans") if cal else None
                    if exact is None:
                        exact = exact_plans(self.model)
                        if cal:
                            cal.put("exact_plans", exact)
                    install_exact(self.model, exact)
                if self.draft_model is not None:
                    install_linear_plans(self.draft_model, plan_linears(self.draft_model))
                self._linear_plans = plans
            return self._linear_plans

    def forward(self, ids: list[int], cache: Any, last_only: bool = False, pack_gqa: bool = False,
                fast_linears: bool = True, exact: bool = False) -> torch.Tensor:
        """The model over ``ids`` on top of ``cache``: logits [len(ids), V] (``last_only``: the last row's). ``exact``:
        a step (plain or verify) whose every row is computed as a one-token step computes it (the prefill need not:
        drafting on and off share it)."""
        if (fast_linears or exact) and self._linear_plans is None:
            self.plan_linears()
        if isinstance(cache, StaticLease):  # (its steps take no packed attention: a graph replays one path)
            with planned_linears(fast_linears):
                return cache.forward(ids, last_only, self.device)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, S]
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if exact:
            with exact_attention(), exact_linears():
                return self.model(input_ids=input_ids, **kwargs).logits[0]  # [S or 1, V]
        with packed_gqa(pack_gqa), planned_linears(fast_linears):
            return self.model(input_ids=input_ids, **kwargs).logits[0]  # [S or 1, V]

    def new_cache(self, need: int | None = None) -> Any:
        """A request's KV cache: the static cache where it is free and holds ``need`` positions, else a dynamic one.
        Exact static steps find their sizes here, at the first lease (an explicit point, before any step)."""
        if self.static is not None and need is not None:
            lease = self.static.lease(need)
            if lease is not None and self.static.unprobed:
                try:
                    if self._linear_plans is None:
                        self.plan_linears()
                    with planned_linears(self.fast_linears):  # (the products the steps will run)
                        found = self.static.probe()
                except BaseException:
                    lease.release()
                    raise
                if not found:
                    lease.release()
                    lease = None
            if lease is not None:
                return lease
        return new_cache(self.model)

    def curve_key(self, max_draft: int, pack_gqa: bool | None = None, fast_linears: bool | None = None,
                  exact: bool | None = None) -> tuple[int, bool, bool, bool]:
        return (max_draft, self.pack_gqa if pack_gqa is None else pack_gqa,
                self.fast_linears if fast_linears is None else fast_linears, self.exact if exact is None else exact)

    def cost_curve(self, max_draft: int, pack_gqa: bool | None = None, fast_linears: bool | None = None,
                   exact: bool | None = None) -> tuple[float, ...]:
        """Relative cost of verifying 0..max_draft draft tokens on a forward path (by default the steps' own):
        measured once per length bound and path, remembered in :attr:`calibration`."""
        if self.static is not None and self.static.unprobed:
            release(self.new_cache(1))  # (exact steps: the first lease finds their sizes, or closes the cache)
        if self.static_steps and (pack_gqa, fast_linears, exact) == (None, None, None):  # the steps' own path
            if max_draft not in self._static_curves:  # (not remembered: a GPU times its steps in a moment)
                self._static_curves[max_draft] = measure_cost_curve(self, max_draft, static=True)
            return self._static_curves[max_draft]
        key = self.curve_key(max_draft, pack_gqa, fast_linears, exact)
        if key not in self._curves:
            cal = self.calibration
            known = dict(cal.get("cost_curves") or {}) if cal else {}
            if key in known:
                self._curves[key] = known[key]
            else:
                self._curves[key] = measure_cost_curve(self, max_draft, pack_gqa=key[1], fast_linears=key[2],
                                                       exact=key[3])
                if cal:
                    cal.put("cost_curves", {**known, key: self._curves[key]})
                    cal.put("attention", VERDICTS.known(VERDICT_KIND))  # (the exact forwards' probes ran by now)
        return self._curves[key]

    def calibrated(self, max_draft: int) -> bool:
        """Whether the remembered calibration has what a first request needs (plans, this curve)."""
        cal = self.calibration
        return (cal is not None and (cal.get("linear_plans") is not None or self.device.type != "cpu")
                and (not self.exact or cal.get("exact_plans") is not None)
                and self.curve_key(max_draft) in (cal.get("cost_curves") or {}))


def forward_seconds(
    steps: Steps, sizes: Sequence[int], context_len: int = 256, repeats: int = 2, *,
    pack_gqa: bool = True, fast_linears: bool = True, exact: bool = False, seed: int = 0,
    budget_s: float | None = None, static: bool = False,
) -> dict[int, float]:
    """Seconds of a forward over ``n`` new tokens on a cached ``context_len``-token context (random ids), for each
    ``n`` in ``sizes``: round-robin over sizes, the first round a warm-up (so drift hits all sizes alike), the least
    disturbed of ``repeats`` (fewer where ``budget_s`` has passed after one: a busy machine stops early).
    ``pack_gqa``, ``fast_linears``, ``exact``: the forward path; ``static``: the static steps (each size padded to
    its step's, as a request's are)."""
    sync = torch.cuda.synchronize if steps.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, steps.vocab_size, (context_len,), generator=gen).tolist()
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    start = time.perf_counter()
    with torch.inference_mode():
        # (the static cache where it is free: a request holding it leaves this timing to a dynamic one)
        cache = steps.new_cache(context_len + max(sizes) + 1 if static else None)
        try:
            steps.forward(ctx, cache, last_only=True, fast_linears=fast_linears)
            for r in range(repeats + 1):
                if r > 1 and budget_s is not None and time.perf_counter() - start > budget_s:
                    break
                for n in sizes:
                    ids = torch.randint(0, steps.vocab_size, (n,), generator=gen).tolist()
                    sync()
                    t0 = time.perf_counter()
                    steps.forward(ids, cache, pack_gqa=pack_gqa, fast_linears=fast_linears, exact=exact)
                    sync()
                    if r:
                        samples[n].append(time.perf_counter() - t0)
                    rollback_cache(cache, n)
        finally:
            release(cache)
    return {n: min(v) for n, v in samples.items()}


def measure_cost_curve(
    steps: Steps, max_draft: int, context_len: int = 256, repeats: int = 2, pack_gqa: bool = True,
    fast_linears: bool = True, exact: bool = False, static: bool = False,
) -> tuple[float, ...]:
    """Time a forward over 1, 2, 4, ... tokens on a cached context, relative to 1 token.

    Returns ``curve[L]`` for ``L = 0..max_draft`` (linear interpolation between measured sizes, made non-decreasing;
    ``static``: the static steps, where ``L`` draft tokens cost the step size that holds them). A few seconds for
    small models on a quiet CPU, at most about :data:`CALIBRATION_BUDGET_S` more than one round on a busy one; done
    once per machine (:mod:`rag_accel.hf.calibration` remembers it).
    """
    if steps.context_window is not None:
        context_len = max(1, min(context_len, steps.context_window - max_draft - 2))
    if static and steps.static is not None and steps.static.unprobed:
        release(steps.new_cache(1))  # (exact steps: the first lease finds their sizes)
    if static and steps.static_steps:  # the sizes the steps run in, each timed once (a step pads up to its size)
        top = steps.static.sizes[-1]  # (a step sends no more than it holds)
        run = [size_for(min(n, top), steps.static.sizes) or top for n in range(1, max_draft + 2)]  # run[L]: L drafted
        times = forward_seconds(steps, sorted(set(run)), context_len, repeats, fast_linears=fast_linears,
                                budget_s=CALIBRATION_BUDGET_S, static=True)
        return _non_decreasing([times[s] / times[run[0]] for s in run])
    sizes = sorted({1, *[s for s in (2, 4, 8, 16, 32, 64) if s <= max_draft], max_draft + 1})
    times = forward_seconds(steps, sizes, context_len, repeats, pack_gqa=pack_gqa, fast_linears=fast_linears,
                            exact=exact, budget_s=CALIBRATION_BUDGET_S)
    ratios = []
    for L in range(max_draft + 1):
        s = L + 1
        lo = max(x for x in sizes if x <= s)
        hi = min(x for x in sizes if x >= s)
        t = times[hi] if hi == lo else times[lo] + (times[hi] - times[lo]) * (s - lo) / (hi - lo)
        ratios.append(t / times[1])
    return _non_decreasing(ratios)


def _non_decreasing(ratios: Sequence[float]) -> tuple[float, ...]:
    """A cost curve from step times relative to a plain step's: 1.0 for no draft, then never below 1 nor falling."""
    curve = [1.0]
    for r in ratios[1:]:
        curve.append(max(1.0, r, curve[-1]))
    return tuple(curve)


def measure_draft_costs(steps: Steps, draft_model: Any, context_len: int = 256, repeats: int = 3) -> StepCosts:
    """What ``draft_model`` costs against the steps' model, timed now: a one-token step of each (the least disturbed
    of ``repeats``, on a ``context_len``-token cache) and the draft model's prefill of that context per token (what
    catching up on a prompt costs it), as the :class:`StepCosts` a fresh engine starts from."""
    from .draft_models import ModelDrafter

    gen = torch.Generator().manual_seed(1)
    rows = int(draft_model.get_input_embeddings().weight.shape[0])
    ctx = torch.randint(0, min(rows, steps.vocab_size), (context_len,), generator=gen).tolist()
    catchup, draft_s = ModelDrafter(draft_model).time_steps(ctx, repeats)
    with torch.inference_mode():
        cache = steps.new_cache()
        steps.forward(ctx, cache, last_only=True, fast_linears=steps.fast_linears)
        step_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            steps.forward(ctx[:1], cache, fast_linears=steps.fast_linears, exact=steps.exact)
            step_s.append(time.perf_counter() - t0)
            rollback_cache(cache, 1)
    return StepCosts(step_s=min(step_s), draft_token_s=draft_s, catchup_token_s=catchup)
