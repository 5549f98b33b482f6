"""Row-invariant products on a CPU: a row's bits do not depend on the rows computed beside it.

A decoder's verify step multiplies ``1 + L`` rows by every weight where a plain step multiplies one; an engine's
forward also holds other requests' rows. A library's matrix product picks its blocking, and so its order of
additions, by the number of rows, so a row's result can change with its neighbours by a rounding. Exact steps
compute every row as it would be computed alone, by a plan found on the machine, never assumed:

- :class:`ExactPlan` / :func:`exact_linear`: torch's own kernels in chunks of a fixed size, in the layout
  (``weight @ hidden.T`` or ``F.linear``) that :func:`is_invariant` finds invariant for a weight shape;
- :func:`invariant_rows`: for any row kernel (an engine's own, such as vLLM's oneDNN product), the largest number
  of rows for which every row of every smaller call is bit-equal to the row alone: calls of at most that many rows
  are then invariant;
- :func:`cancelling_rows`: probe input that shows another order of additions where random rows hide it (the
  static steps' probes take it).

Every probe of both engines (these, the attention kernels', the static sizes', vLLM's pieces) asks one question,
:func:`rows_agree`: does a call give each row the bits a reference gives it? What the probes found is kept in
:data:`VERDICTS`, one table per process. Both engines use them: the transformers decoder's exact steps
(:mod:`rag_accel.hf.linears`) and vLLM's CPU worker in exact mode (:mod:`rag_accel.vllm.exact`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CANCEL_GAIN", "EXACT_CANDIDATES", "EXACT_DTYPES", "PROBE_TRIALS", "VERDICTS", "ExactPlan", "Verdicts",
           "big_power_of_two", "cancelling_rows", "compute_rows", "exact_linear", "invariant_rows", "is_invariant",
           "rows_agree"]

#: The dtypes both engines compute exactly by default on a CPU (the transformers decoder's ``exact=None``, vLLM's mode
#: "auto"): where a product's order of additions shows in the result's rounding.
EXACT_DTYPES = (torch.bfloat16, torch.float16)

#: Random inputs a probe tries before it calls a plan invariant. A kernel whose order of additions changes with the
#: row count changes a bfloat16 result only where the rounding flips, so one input can miss it: on a 2-core AMD EPYC
#: (AVX-512 BF16, no AMX) vLLM's oneDNN product of a 1536-wide weight looked invariant to 17-32 rows on 4 of 15
#: inputs and differed from 1-9 rows on the rest; one such false verdict on SmolLM2's MLP changed a verify's logits.
PROBE_TRIALS = 8


#: How far above a sum's size a probe's cancelling terms go, by the dtype the kernel writes: a small term added to a
#: partial sum that large loses low bits down to about the output's last bit (float32 sums, 24 bits), so an
#: order of additions that puts the big terms apart shows in the result. (float16 stops lower: its largest value.)
CANCEL_GAIN = {torch.bfloat16: 2.0 ** 17, torch.float16: 2.0 ** 11, torch.float32: 2.0 ** 6}


def rows_agree(call: Callable[[int, int], torch.Tensor], reference: torch.Tensor,
               spans: Iterable[tuple[int, int]], dim: int = 0) -> bool:
    """The one probe: whether ``call(start, count)`` gives, for every ``(start, count)`` of ``spans``, bit for bit
    ``reference``'s rows ``start .. start + count`` (rows along ``dim``). The callers say what a call and its
    reference are: a product of a few rows against the same rows computed alone, a small step against a large
    one's rows, a request's rows beside others against its one-token steps.

    Example:
        >>> w, x = torch.randn(3, 4), torch.randn(5, 4)
        >>> alone = torch.cat([x[i:i + 1] @ w.t() for i in range(5)])
        >>> rows_agree(lambda o, n: torch.cat([x[i:i + 1] @ w.t() for i in range(o, o + n)]), alone, [(0, 5), (2, 2)])
        True
        >>> rows_agree(lambda o, n: alone.narrow(0, o, n) + 1, alone, [(0, 1)])
        False
    """
    return all(torch.equal(call(start, count), reference.narrow(dim, start, count)) for start, count in spans)


class Verdicts:
    """What this process's probes found, one table: ``kind`` (which probe) and its key -> the verdict. A verdict is
    probed once (under a lock: a probe may run on a request's thread) and kept for the process's life; an earlier
    process's, remembered on disk by the engine that probed, can seed it (:meth:`seed`).

    Example:
        >>> table = Verdicts()
        >>> table.get("demo", (1, 2), lambda: True), table.get("demo", (1, 2), lambda: False)  # probed once
        (True, True)
        >>> table.known("demo")
        {(1, 2): True}
    """

    def __init__(self) -> None:
        self._found: dict[str, dict[Any, Any]] = {}
        self._lock = threading.RLock()

    def get(self, kind: str, key: Any, probe: Callable[[], Any]) -> Any:
        """The verdict of ``kind`` for ``key``: ``probe()``'s, the first time it is asked in this process."""
        table = self._found.setdefault(kind, {})
        if key not in table:
            with self._lock:
                if key not in table:
                    table[key] = probe()
        return table[key]

    def known(self, kind: str) -> dict[Any, Any]:
        """The verdicts of ``kind`` found (or seeded) so far, a copy."""
        return dict(self._found.get(kind, {}))

    def seed(self, kind: str, known: dict[Any, Any]) -> None:
        """Take verdicts an earlier process found (a key probed here already keeps its own)."""
        table = self._found.setdefault(kind, {})
        for key, verdict in known.items():
            table.setdefault(key, verdict)

    def forget(self, kind: str | None = None) -> None:
        """Forget ``kind``'s verdicts (``None``: all): the next ask probes again."""
        with self._lock:
            if kind is None:
                self._found.clear()
            else:
                self._found.pop(kind, None)


#: This process's verdicts (every probe's, both engines').
VERDICTS = Verdicts()


def big_power_of_two(dtype: torch.dtype, typical: float) -> float:
    """A power of two about :data:`CANCEL_GAIN` times ``typical`` (what a sum of the small terms comes to)."""
    return float(2.0 ** math.ceil(math.log2(CANCEL_GAIN.get(dtype, 2.0 ** 6) * max(typical, 1e-30))))


def cancelling_rows(n: int, weight_rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``n`` random rows ``x`` (float32) that each make one output row of ``x @ weight_rows.T`` (``weight_rows``:
    [out, in], in the kernel's dtype) a cancellation: small random terms plus two big ones that cancel exactly,
    ``w[i, a] * x[a] = - w[i, b] * x[b]`` (``x[a]``, ``x[b]``: the other's weight times a power of two, exact in
    the weight's dtype). Summed in another order, the small terms lose other low bits to the big partial sums, so a
    product whose order of additions changes with the number of rows almost surely gives that output other bits;
    random rows alone differ only where a rounding flips (for a bfloat16 output about one in ten thousand)."""
    out_f, in_f = weight_rows.shape
    x = torch.randn(n, in_f, generator=gen)
    w = weight_rows.float().cpu()
    rms = float(w.pow(2).mean().sqrt())
    limit = torch.finfo(weight_rows.dtype).max / (4 * in_f)
    for r in range(n):
        for _ in range(16):  # (weights below the row's typical size would need too big a partner: pick again)
            i = int(torch.randint(out_f, (1,), generator=gen))
            a, b = torch.randperm(in_f, generator=gen)[:2].tolist()
            wa, wb = float(w[i, a]), float(w[i, b])
            if abs(wa) < rms or abs(wb) < rms:
                continue
            c = big_power_of_two(weight_rows.dtype, rms * math.sqrt(in_f)) / abs(wa * wb)
            c = 2.0 ** math.floor(math.log2(c))
            if max(abs(wa), abs(wb)) * c <= limit:
                x[r, a], x[r, b] = wb * c, -wa * c
                break
    return x


def compute_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
             transposed: bool) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` over ``rows`` rows (``hidden``'s, padded with zeros), in the
    transposed layout if ``transposed``; the first ``len(hidden)`` rows, contiguous."""
    n = hidden.shape[0]
    x = hidden.contiguous()
    if rows > n:
        x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
    out = (weight @ x.t()).t() if transposed else torch.nn.functional.linear(x, weight)
    out = out[:n].contiguous()
    return out if bias is None else out + bias



@dataclass(frozen=True)
class ExactPlan:
    """Rows computed in chunks of at most ``chunk``, each padded with zero rows to at least ``pad``, in the
    transposed layout if ``transposed``: a plan under which a row's values do not depend on how many rows come
    with it, nor on where among them it is (:func:`is_invariant` tests one on the kernels it uses).

    Example:
        >>> w, x = torch.randn(6, 4), torch.randn(5, 4)
        >>> plan = ExactPlan(chunk=2, transposed=True)
        >>> torch.allclose(exact_linear(x, w, None, plan), torch.nn.functional.linear(x, w), atol=1e-6)
        True
    """

    chunk: int
    transposed: bool
    pad: int = 2


def exact_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 plan: ExactPlan) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` as ``plan`` computes it, whatever the number of rows."""
    n = hidden.numel() // hidden.shape[-1]
    rows = hidden.reshape(n, hidden.shape[-1])
    c = plan.chunk
    parts = [compute_rows(rows[i:i + c], weight, bias, max(plan.pad, min(c, n - i)), plan.transposed)
             for i in range(0, n, c)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


#: The invariant plans tried, cheapest first for a verify (one product for up to 33 rows; then chunks): the first
#: whose rows equal each row computed alone is taken. Found on this project's CPU (torch 2.13, oneDNN): in bfloat16
#: ``weight @ hidden.T`` gives every row of 2-33 the values of the same row alone (two rows, the second zeros) for
#: every weight shape of Qwen2.5-Coder-0.5B/1.5B, where ``F.linear`` differs from two rows on; in float32 only up to
#: three rows do (MKL). The last, every row alone in the library's layout, is invariant by construction.
EXACT_CANDIDATES = (ExactPlan(33, True), ExactPlan(16, True), ExactPlan(8, True), ExactPlan(4, True),
                    ExactPlan(3, True), ExactPlan(2, True), ExactPlan(1, False, pad=1))


def is_invariant(weight: torch.Tensor, bias: torch.Tensor | None, plan: ExactPlan, rows: int | None = None,
                 trials: int = PROBE_TRIALS) -> bool:
    """Whether under ``plan`` every row of 1..``rows`` rows (default ``plan.chunk``: chunks repeat it) is bit for bit
    the same row computed alone, on ``trials`` sets of random rows in the weight's dtype and device."""
    rows = rows or plan.chunk
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(trials):
            x = torch.randn(rows, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
            alone = torch.cat([exact_linear(x[j:j + 1], weight, bias, plan) for j in range(rows)])
            if not rows_agree(lambda _, n: exact_linear(x[:n], weight, bias, plan), alone,
                              ((0, n) for n in range(2, rows + 1))):
                return False
    return True


def invariant_rows(rows: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                   max_rows: int, trials: int = PROBE_TRIALS) -> int:
    """The largest ``c <= max_rows`` for which ``rows(x)`` gives every row of every ``x`` of ``1..c`` rows bit for
    bit what it gives that row alone (``trials`` sets of random rows in ``dtype``; at least 1: a row alone is
    itself).

    Example:
        >>> w = torch.randn(8, 16)
        >>> invariant_rows(lambda x: torch.cat([x[i:i + 1] @ w.t() for i in range(len(x))]), 16, torch.float32, 5)
        5
    """
    gen = torch.Generator().manual_seed(0)
    best = max_rows
    with torch.inference_mode():
        for _ in range(trials):
            x = torch.randn(best, in_features, generator=gen).to(dtype)
            alone = torch.cat([rows(x[j:j + 1]) for j in range(best)])
            best = next((n - 1 for n in range(2, best + 1) if not rows_agree(lambda _, m: rows(x[:m]), alone,
                                                                             [(0, n)])), best)
            if best == 1:
                break
    return best
