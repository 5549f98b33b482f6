"""``rag-accel demo``'s timing: a call's forward passes and its prefill, and the median of a few runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class ForwardTimes:
    """How many forward passes a call made and how long its first one (the prefill) took: hooks on the
    model, the same for plain greedy and for us. Syncs a GPU around the first forward only."""

    def __init__(self, model: Any) -> None:
        import torch

        self.count, self.prefill_s, self._t0 = 0, 0.0, 0.0
        self._sync = torch.cuda.synchronize if next(model.parameters()).device.type == "cuda" else (lambda: None)
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        if self.count == 0:
            self._sync()
            self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        if self.count == 0:
            self._sync()
            self.prefill_s = time.perf_counter() - self._t0
        self.count += 1

    def run(self, fn: Callable[[], Any]) -> tuple[Any, tuple[float, float, int]]:
        """``fn()``'s output and its timing: total seconds, prefill seconds, forward passes."""
        self.count = 0
        self._sync()
        t0 = time.perf_counter()
        out = fn()
        self._sync()
        return out, (time.perf_counter() - t0, self.prefill_s, self.count)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def median_run(timings: list[tuple[float, float, int]]) -> tuple[float, float, int, float]:
    """The run of median total time (prefill and forwards from that same run), and the spread of the
    totals: the largest distance from the median, relative.

    Example:
        >>> median_run([(2.0, 0.5, 9), (1.0, 0.4, 9), (1.5, 0.4, 9)])
        (1.5, 0.4, 9, 0.3333333333333333)
    """
    ordered = sorted(timings)
    total, prefill, forwards = ordered[(len(ordered) - 1) // 2]
    spread = max(abs(t - total) for t, _, _ in timings) / total
    return total, prefill, forwards, spread


def where_the_time_went(name: str, total: float, prefill: float, forwards: int) -> str:
    """One run's time as prefill plus steps.

    Example:
        >>> where_the_time_went("ours", 1.5, 0.5, 11)
        'ours 1.50 s = prefill 0.50 s + 10 steps x 100 ms'
    """
    steps = forwards - 1
    per_step = f" + {steps} steps x {1000 * (total - prefill) / steps:.0f} ms" if steps else ""
    return f"{name} {total:.2f} s = prefill {prefill:.2f} s{per_step}"
