"""What a benchmark run measured, and what it adds up to: the per-run records (:class:`Run`,
:class:`BatchRun`), their summaries per method and the markdown tables. Plain Python: no torch, no
model, so a saved run can be summarised and tabled anywhere."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..methods import VLLM_METHODS


@dataclass
class Run:
    method: str
    item: str
    seconds: float
    new_tokens: int
    steps: int
    identical: bool
    token_ids: list[int] = field(repr=False, default_factory=list)
    repeat: int = 0
    case: str = "rag"  # "rag": the item's passages; "reworded": its cached answer, not in the prompt
    identical_hf: bool = False  # equal to transformers' greedy (what vLLM methods are also held to)
    # Where the time went (transformers methods): seconds until the first forward pass (the prefill) had
    # finished, from the call; ours also: per-request set-up (references tokenised, drafters built) and
    # drafting (host time choosing drafts, all steps); what of the set-up the first token waited for
    # (it runs during the prefill).
    first_s: float | None = None
    setup_s: float | None = None
    setup_wait_s: float | None = None
    draft_s: float | None = None


@dataclass
class BatchRun:
    method: str
    in_flight: int
    group: int
    seconds: float
    new_tokens: int
    identical: int  # requests whose output equals vllm-greedy's in the same group
    requests: int
    token_ids: list[list[int]] = field(repr=False, default_factory=list)


def item_seconds(runs: Sequence[Run]) -> dict[tuple[str, str], float]:
    """(method, item) -> median latency over that item's repeats."""
    times: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        times.setdefault((r.method, r.item), []).append(r.seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def summarize(runs: Sequence[Run], case: str = "rag") -> dict[str, dict[str, Any]]:
    """Per method, over the runs of ``case``: speed-ups per item (median latency of its repeats
    against greedy's), their geometric mean and worst; tokens per step and tokens/s over all
    runs; identical-output rate over all runs (against the method's engine's greedy, and
    against transformers' greedy). vLLM methods also get their speed-up against vllm-greedy."""
    runs = [r for r in runs if r.case == case]
    seconds = item_seconds(runs)
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    out = {}
    for m, rs in by_method.items():
        items = list(dict.fromkeys(r.item for r in rs))
        latency = [seconds[m, it] for it in items]
        speedups = [seconds["greedy", it] / seconds[m, it] for it in items]
        out[m] = {
            "items": len(items),
            "runs_per_item": len(rs) / len(items),
            "median_latency_s": statistics.median(latency),
            "tokens_per_s": sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs),
            "speedup_geomean": _geomean(speedups),
            "speedup_total_time": sum(seconds["greedy", it] for it in items) / sum(latency),
            "speedup_worst": min(speedups),
            "worst_item": items[speedups.index(min(speedups))],
            "tokens_per_step": sum(r.new_tokens for r in rs) / sum(r.steps for r in rs),
            "identical_rate": sum(r.identical for r in rs) / len(rs),
            "identical_to_hf_greedy_rate": sum(r.identical_hf for r in rs) / len(rs),
        }
        if m in VLLM_METHODS:
            vs = [seconds["vllm-greedy", it] / seconds[m, it] for it in items]
            out[m]["speedup_vs_vllm_greedy_geomean"] = _geomean(vs)
            out[m]["speedup_vs_vllm_greedy_worst"] = min(vs)
            out[m]["worst_item_vs_vllm_greedy"] = items[vs.index(min(vs))]
        timed = [r for r in rs if r.first_s is not None]
        if timed:
            later = sum(r.steps - 1 for r in timed)
            out[m]["split"] = {
                "first_forward_s": statistics.mean(r.first_s for r in timed),  # type: ignore[misc]
                "later_steps": later / len(timed),
                "ms_per_later_step": 1000 * sum(r.seconds - r.first_s for r in timed) / later if later else None,
                "setup_ms": (1000 * statistics.mean(r.setup_s for r in timed)  # type: ignore[misc]
                             if all(r.setup_s is not None for r in timed) else None),
                "setup_wait_ms": (1000 * statistics.mean(r.setup_wait_s for r in timed)  # type: ignore[misc]
                                  if all(r.setup_wait_s is not None for r in timed) else None),
                "draft_us_per_step": (1e6 * sum(r.draft_s for r in timed) / later  # type: ignore[misc]
                                      if later and all(r.draft_s is not None for r in timed) else None),
            }
    return out


def split_table(summary: dict[str, dict[str, Any]]) -> str:
    """Where each transformers method's time went, per request on average (empty: no split measured)."""
    rows = [(m, s["split"]) for m, s in summary.items() if "split" in s]
    if not rows:
        return ""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| method | first forward done (s) | later steps | ms per later step | set-up (ms) | "
             "set-up the first token waited for (ms) | drafting per step (us) |", "|---|---|---|---|---|---|---|"]
    for m, sp in rows:
        lines.append(f"| {m} | {sp['first_forward_s']:.3f} | {sp['later_steps']:.1f} | "
                     f"{num(sp['ms_per_later_step'], '.1f')} | {num(sp['setup_ms'], '.1f')} | "
                     f"{num(sp.get('setup_wait_ms'), '.1f')} | {num(sp['draft_us_per_step'], '.0f')} |")
    return "\n".join(lines + ["", SPLIT_LEGEND])


#: How much cheaper than ``model.generate``'s a step of ours may be with no timing noise: our plain steps skip its
#: logits processors and, on a CPU, take the planned projections (1.17x-1.26x on this project's CPUs). Verifying a
#: draft never makes a step cheaper than a plain one.
PLAIN_STEP_ADVANTAGE = 1.3


def timing_notes(summary: dict[str, dict[str, Any]], repeats: int) -> list[str]:
    """What the bench's noise rule says of a run's figures (the demo's rule): a speed-up that the forward passes
    saved cannot explain (``ours 1.66x`` at 1.22 tokens a step: its steps would be 1.36x cheaper than greedy's), and
    a run of one repeat per item.

    Example:
        >>> for note in timing_notes({"greedy": {"speedup_geomean": 1.0, "tokens_per_step": 1.0},
        ...                           "ours": {"speedup_geomean": 1.66, "tokens_per_step": 1.22}}, 1):
        ...     print(note[:80])
        timing noise: ours 1.66x at 1.22 tokens a step would make its steps 1.36x cheape
        one run per item: a shared machine's noise (a few per cent, and stalls of whole
    """
    notes = []
    for m, s in summary.items():
        if m in ("greedy", "vllm-greedy") or not s.get("tokens_per_step"):
            continue
        cheaper = s["speedup_geomean"] / s["tokens_per_step"]
        if cheaper > PLAIN_STEP_ADVANTAGE:
            notes.append(f"timing noise: {m} {s['speedup_geomean']:.2f}x at {s['tokens_per_step']:.2f} tokens a step "
                         f"would make its steps {cheaper:.2f}x cheaper than greedy's, where a step that verifies a "
                         f"draft costs at least a plain one (ours' plain steps are at most ~{PLAIN_STEP_ADVANTAGE}x "
                         "cheaper): another process, or a busy core, slowed greedy's runs")
    if repeats == 1:
        notes.append("one run per item: a shared machine's noise (a few per cent, and stalls of whole steps) is not "
                     "averaged out; --repeats 3 takes each item's median")
    return notes


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize_concurrency(runs: Sequence[BatchRun]) -> dict[str, dict[str, Any]]:
    """``"<method>@<in flight>"`` -> tokens/s over all its groups, identical-output rate, and the
    throughput against ``vllm-greedy`` at the same level."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys((r.method, r.in_flight) for r in runs):
        rs = [r for r in runs if (r.method, r.in_flight) == key]
        out[f"{key[0]}@{key[1]}"] = {
            "method": key[0], "in_flight": key[1], "groups": len(rs), "requests": sum(r.requests for r in rs),
            "tokens_per_s": sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs),
            "identical_rate": sum(r.identical for r in rs) / sum(r.requests for r in rs)}
    for s in out.values():
        s["vs_vllm_greedy"] = s["tokens_per_s"] / out[f"vllm-greedy@{s['in_flight']}"]["tokens_per_s"]
    return out


def concurrency_table(summary: dict[str, dict[str, Any]]) -> str:
    levels = sorted({s["in_flight"] for s in summary.values()})
    methods = list(dict.fromkeys(s["method"] for s in summary.values()))
    lines = ["| method | " + " | ".join(f"tokens/s, {c} in flight (vs vllm-greedy)" for c in levels)
             + " | identical |", "|---" * (len(levels) + 2) + "|"]
    for m in methods:
        cells = [f"{summary[f'{m}@{c}']['tokens_per_s']:.1f} ({summary[f'{m}@{c}']['vs_vllm_greedy']:.2f}x)"
                 for c in levels]
        ident = " / ".join(f"{summary[f'{m}@{c}']['identical_rate']:.0%}" for c in levels)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {ident} |")
    return "\n".join(lines)


TABLE_LEGEND = """\
- speed-up: per item, greedy's latency over the method's (an item's latency: the median of its runs);
  geo-mean: the geometric mean over items.
- worst item: the lowest per-item speed-up, and which item it was.
- tokens/step: new tokens per model forward pass, prefill included, over all runs (greedy: 1.00).
- tokens/s: new tokens over seconds, all runs together. median latency: the median over items.
- identical: the share of runs whose token ids equal the item's first greedy run of the method's engine
  (transformers' greedy; vllm-greedy for vllm-* methods), token for token."""
SPLIT_LEGEND = """\
- first forward done: seconds from the call until the model's first forward pass (the prefill) had
  finished: the method's set-up and the prefill. later steps: the forward passes after it, per request;
  ms per later step: the rest of the request's time over them (drafting, verifying, emitting included).
- set-up: ours' per-request work (references tokenised, drafters built), done on a thread during the
  prefill; waited for: what of it outlasted the prefill; drafting: host time choosing drafts and their
  length, per later step. Means over all runs."""
ENGINES_LEGEND = """\
- vs vllm-greedy: the speed-up against vllm-greedy, per item as above: geo-mean; worst item (vllm-* methods).
- identical to transformers' greedy: the same share against transformers' greedy, for every method."""


def markdown_table(summary: dict[str, dict[str, Any]], legend: bool = True) -> str:
    """The summary as a markdown table; with ``legend``, the definitions of its columns below it."""
    engines = any(m in VLLM_METHODS for m in summary)
    lines = [
        "| method | speed-up (geo-mean) | worst item | tokens/step | tokens/s | median latency (s) | identical |"
        + (" vs vllm-greedy (geo-mean; worst item) | identical to transformers' greedy |" if engines else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if engines else ""),
    ]
    for m, s in summary.items():
        vs = s.get("speedup_vs_vllm_greedy_geomean")
        worst = s.get("speedup_vs_vllm_greedy_worst")  # (runs committed before it was kept: geo-mean only)
        vs = "-" if vs is None else f"{vs:.2f}x" + ("" if worst is None else f"; {worst:.2f}x")
        lines.append(
            f"| {m} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x ({s['worst_item']}) | "
            f"{s['tokens_per_step']:.2f} | {s['tokens_per_s']:.1f} | {s['median_latency_s']:.2f} | "
            f"{s['identical_rate']:.0%} |"
            + (f" {vs} | {s['identical_to_hf_greedy_rate']:.0%} |" if engines else "")
        )
    notes = [TABLE_LEGEND, *([ENGINES_LEGEND] if engines else [])] if legend else []
    return "\n".join(lines + ([""] + notes if notes else []))
