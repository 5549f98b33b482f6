"""Few-row projections on a CPU, each weight shape in the layout and row count measured fastest for it.

A decoding step multiplies 1 row (a plain step) or ``1 + L`` rows (a verify step) by every weight of the model. On
a CPU, with that few rows, the library's own ``hidden @ weight.T`` runs far below the memory speed for some shapes
and row counts, where ``weight @ hidden.T`` (the weight streamed once, the rows as the narrow operand) runs near it
(Qwen2.5-Coder-1.5B float32: a step 293 -> 215 ms, a 2-token verify 574 -> 250 ms;
``benchmarks/results/verify_costs_cpu_qwen.md``). Which layout wins differs by shape, dtype and machine, so
:func:`plan_linears` times both on the model's own weights at :data:`MEASURED_ROWS` rows, once per decoder (a row
count may be padded up to a cheaper measured one), and :func:`install` wraps the ``forward`` of every ``nn.Linear``
whose shape gained. The wrapper takes its plan only inside :func:`planned_linears`, a context variable the decoder
sets around its own forwards: ``model.generate``, other callers and other threads compute what they did before.
The logits differ from the library's layout by float rounding only, as a verify step's do from one-token steps.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._context import scoped
from ..invariant import EXACT_CANDIDATES, ExactPlan, compute_rows, exact_linear, is_invariant

# What wrapped linears compute inside the decoder's forwards: OFF (their own forward), FAST (their speed plan),
# EXACT (their invariant plan: a row's values do not depend on how many rows come with it).
OFF, FAST, EXACT = 0, 1, 2
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("rag_accel_planned_linears", default=OFF)

#: Row counts timed per weight shape; a count between two is computed as the one above it, or in the
#: library's layout (``1 + max_draft_tokens`` is 33 by default; a prefill, past the last, never takes a plan).
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)
#: Weights of one shape timed in turn (each one read from memory, as in a forward, not from the cache).
CYCLE = 8
#: Rounds of the timing; each (rows, layout) keeps its least disturbed round (the first one warms up: only a
#: round of its own would change nothing the minimum does not).
REPEATS = 2
#: A plan is taken where it is at least this much faster than the library's own layout (timing noise stays out).
MARGIN = 0.95


@dataclass(frozen=True)
class LinearPlan:
    """How a weight computes ``n`` rows, for ``n`` up to ``len(rows) - 1``: ``rows[n]`` rows (``n`` or a
    padded count; ``0``: the library's own ``F.linear``), in the transposed layout if ``transposed[n]``."""

    rows: tuple[int, ...]
    transposed: tuple[bool, ...]

    @property
    def changes(self) -> bool:
        """Whether any row count leaves the library's own path."""
        return any(self.rows)

    @classmethod
    def from_times(cls, times: dict[tuple[int, bool], float], margin: float = MARGIN) -> LinearPlan:
        """The plan that ``times`` (seconds of ``(rows, transposed)`` at the measured rows) make fastest:
        for each ``n``, the cheapest measured ``(m >= n, layout)``, where it beats the library's layout at
        ``n`` (or, ``n`` not measured, at the next measured count) by ``margin``.

        Example:
            >>> t = {(1, False): 3.0, (1, True): 1.5, (2, False): 6.0, (2, True): 2.0, (4, False): 5.0, (4, True): 5.5}
            >>> plan = LinearPlan.from_times(t)
            >>> [(plan.rows[n], plan.transposed[n]) for n in range(1, 5)]
            [(1, True), (2, True), (0, False), (0, False)]
        """
        measured = sorted({m for m, _ in times})
        rows, transposed = [0], [False]
        for n in range(1, measured[-1] + 1):
            at = next(m for m in measured if m >= n)
            default = times[(at, False)]
            cost, m, t = min((times[(m, t)], m, t) for m in measured if m >= n for t in (False, True))
            better = cost < margin * default and (m, t) != (n, False)
            rows.append(m if better else 0)
            transposed.append(t if better else False)
        return cls(tuple(rows), tuple(transposed))


def planned_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   plan: LinearPlan) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` as ``plan`` says for ``hidden``'s number of rows.

    Example:
        >>> w, x = torch.randn(6, 4), torch.randn(1, 3, 4)
        >>> plan = LinearPlan((0, 2, 4, 4), (False, True, True, False))
        >>> torch.allclose(planned_linear(x, w, None, plan), torch.nn.functional.linear(x, w), atol=1e-6)
        True
    """
    n = hidden.numel() // hidden.shape[-1]
    if n >= len(plan.rows) or not plan.rows[n]:
        return torch.nn.functional.linear(hidden, weight, bias)
    out = compute_rows(hidden.reshape(n, hidden.shape[-1]), weight, bias, plan.rows[n], plan.transposed[n])
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def exact_plan(modules: Sequence[torch.nn.Linear]) -> ExactPlan:
    """The first of :data:`EXACT_CANDIDATES` that :func:`is_invariant` on these modules' weight shape (on one
    module of each kind among them: ``nn.Linear``, ``Conv1D``, with and without a bias)."""
    kinds = {(_is_conv1d(m), m.bias is not None): m for m in reversed(modules)}.values()
    return next(plan for plan in EXACT_CANDIDATES
                if plan.pad == 1 or all(is_invariant(_weight(m), m.bias, plan) for m in kinds))


def exact_plans(model: Any) -> dict[tuple[int, int, torch.dtype], ExactPlan]:
    """An invariant plan per weight shape of ``model``'s projections, ``nn.Linear`` and ``Conv1D`` (tested on this
    machine's kernels)."""
    return {shape: exact_plan(mods) for shape, mods in linears(model, device=None, conv1d=True).items()}


def forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a wrapped ``nn.Linear``: inside :func:`planned_linears` its speed plan, inside
    :func:`exact_linears` its invariant plan, else its own."""
    mode = _ACTIVE.get()
    if mode and hidden.dtype == self.weight.dtype and not torch.is_grad_enabled():
        if mode == EXACT:
            plan = self.__dict__.get("_rag_accel_exact")
            if plan is not None:
                return exact_linear(hidden, self.weight, self.bias, plan)
        else:
            plan = self.__dict__.get("_rag_accel_plan")
            if plan is not None and hidden.device.type == "cpu":
                return planned_linear(hidden, self.weight, self.bias, plan)
    return torch.nn.Linear.forward(self, hidden)


def conv1d_forward(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a wrapped ``Conv1D``: inside :func:`exact_linears` its invariant plan, else its own."""
    if _ACTIVE.get() == EXACT and hidden.dtype == self.weight.dtype and not torch.is_grad_enabled():
        plan = self.__dict__.get("_rag_accel_exact")
        if plan is not None:
            return exact_linear(hidden, self.weight.t(), self.bias, plan)
    return type(self).forward(self, hidden)


def linears(model: Any, device: str | None = "cpu",
            conv1d: bool = False) -> dict[tuple[int, int, torch.dtype], list[torch.nn.Linear]]:
    """The model's plain ``nn.Linear`` modules (on ``device``'s type; ``None``: any), by weight shape and dtype;
    ``conv1d``: transformers' ``Conv1D`` too (GPT-2's projections), by the shape of their weight transposed."""
    groups: dict[tuple[int, int, torch.dtype], list[torch.nn.Linear]] = {}
    if not isinstance(model, torch.nn.Module):
        return groups
    for m in model.modules():
        if (type(m) is torch.nn.Linear or (conv1d and _is_conv1d(m))) and (device is None or
                                                                          m.weight.device.type == device):
            groups.setdefault((*_weight(m).shape, m.weight.dtype), []).append(m)  # type: ignore[arg-type]
    return groups


def _is_conv1d(module: Any) -> bool:
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)


def _weight(module: Any) -> torch.Tensor:
    """A projection's weight as ``F.linear`` takes it, [out, in] (a ``Conv1D`` keeps it as [in, out])."""
    return module.weight.t() if _is_conv1d(module) else module.weight


def time_layouts(modules: Sequence[torch.nn.Linear], rows: Sequence[int] = MEASURED_ROWS,
                 repeats: int = REPEATS) -> dict[tuple[int, bool], float]:
    """Seconds one weight of ``modules``' shape takes for each ``(rows, transposed)``: the least disturbed
    of ``repeats`` rounds, each a pass over up to :data:`CYCLE` of the weights (round-robin over the
    candidates, so that drift hits them alike)."""
    cycle = list(modules)[:CYCLE]
    weight = cycle[0].weight
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(n, weight.shape[1], generator=gen).to(weight.dtype) for n in rows}
    best: dict[tuple[int, bool], float] = {}
    with torch.inference_mode():
        compute_rows(inputs[rows[0]], weight, cycle[0].bias, rows[0], False)  # (the first call of all pays set-ups)
        for _ in range(repeats):
            for n in rows:
                for transposed in (False, True):
                    t0 = time.perf_counter()
                    for m in cycle:
                        compute_rows(inputs[n], m.weight, m.bias, n, transposed)
                    seconds = (time.perf_counter() - t0) / len(cycle)
                    key = (n, transposed)
                    best[key] = min(best.get(key, seconds), seconds)
    return best


def plan_linears(model: Any, rows: Sequence[int] = MEASURED_ROWS) -> dict[tuple[int, int, torch.dtype], LinearPlan]:
    """A plan per weight shape of ``model``'s linears on a CPU, from timing both layouts on its own weights
    (on a 2-core CPU, float32: about 1 s for SmolLM2-135M, 9 s for a 1.5B model)."""
    return {shape: LinearPlan.from_times(time_layouts(mods, rows)) for shape, mods in linears(model).items()}


def install(model: Any, plans: dict[tuple[int, int, torch.dtype], LinearPlan]) -> int:
    """Give each linear of ``model`` its shape's plan, wrapping the ``forward`` of those whose plan changes
    anything (idempotent; a plan that changes nothing unwraps none but is not taken). Returns how many
    modules a plan changes.

    The wrapper is a method bound to its module, so ``copy.deepcopy`` and pickling carry it (and the plan)
    over to the copy's own weights."""
    changed = 0
    for shape, mods in linears(model).items():
        plan = plans.get(shape)
        for m in mods:
            m.__dict__["_rag_accel_plan"] = plan if plan is not None and plan.changes else None
            if plan is not None and plan.changes:
                changed += 1
                if "forward" not in vars(m):
                    m.forward = types.MethodType(forward, m)
    return changed


def install_exact(model: Any, plans: dict[tuple[int, int, torch.dtype], ExactPlan]) -> int:
    """Give every projection of ``model`` (``nn.Linear``, ``Conv1D``) its shape's invariant plan, wrapping its
    ``forward`` (idempotent); returns how many modules have one."""
    count = 0
    for shape, mods in linears(model, device=None, conv1d=True).items():
        for m in mods:
            m.__dict__["_rag_accel_exact"] = plans.get(shape)
            if plans.get(shape) is not None:
                count += 1
                if "forward" not in vars(m):
                    m.forward = types.MethodType(conv1d_forward if _is_conv1d(m) else forward, m)
    return count


def planned_linears(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / context only) wrapped linears compute as their speed plan says."""
    return scoped(_ACTIVE, FAST if enabled else OFF)


def exact_linears() -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / context only) wrapped linears compute as their invariant plan says."""
    return scoped(_ACTIVE, EXACT)
