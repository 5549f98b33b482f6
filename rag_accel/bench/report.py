"""What ``rag-accel bench`` writes: ``NAME.json`` and ``NAME.md``, rewritten after every item (a run
stopped midway leaves what it measured, marked incomplete), and ``NAME.png`` at the end.

The plot needs matplotlib, the ``[bench]`` extra; without it the JSON and the markdown are
written all the same and the run says how to add the plot.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..methods import VLLM_METHODS
from .results import (
    BatchRun,
    Run,
    concurrency_table,
    item_seconds,
    markdown_table,
    split_table,
    summarize,
    summarize_concurrency,
    timing_notes,
)

PLOT_HINT = "matplotlib is not installed; pip install 'rag-accel[bench]' adds it"


def loadavg() -> str:
    """The machine's 1, 5 and 15-minute load averages, as the reports print them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(PLOT_HINT) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: Sequence[Run], path: str | Path, title: str) -> None:
    """Per-item speed-up against greedy (one column per method) and tokens per step. ImportError
    (saying what to install) without matplotlib."""
    plt = _pyplot()
    seconds = item_seconds(runs)
    methods = [m for m in dict.fromkeys(r.method for r in runs) if m != "greedy"]
    # one colour per method in both panels, never greedy's grey (matplotlib's C7): with eight methods or more the
    # default cycle gave the eighth greedy's colour
    colour = {m: f"C{k}" for m, k in zip(methods, (k % 10 for k in range(100) if k % 10 != 7))}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(methods):
        sp = [seconds["greedy", it] / t for (mm, it), t in seconds.items() if mm == m]
        a.scatter([i + (j % 7 - 3) * 0.03 for j in range(len(sp))], sp, s=10, alpha=0.6, color=colour[m])
        a.hlines(math.exp(sum(map(math.log, sp)) / len(sp)), i - 0.3, i + 0.3, colors="k")
    a.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    with_greedy = ["greedy", *methods]  # greedy's bar (1.00) is the baseline the others are read against
    for i, m in enumerate(with_greedy):
        b.bar(i, sum(r.new_tokens for r in runs if r.method == m) / sum(r.steps for r in runs if r.method == m),
              color="grey" if m == "greedy" else colour[m])
    b.set_xticks(range(len(with_greedy)), with_greedy, rotation=30, ha="right")
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_ylabel("speed-up vs greedy (per item; bar = geo-mean)")
    b.set_ylabel("tokens per verification step")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class BenchReport:
    """One ``rag-accel bench`` run's files, under the prefix ``out``. :meth:`write` (after each
    item) rewrites ``out.json`` and ``out.md`` with the runs so far, ``"complete": false``;
    :meth:`finish` writes them complete, with the plot.

    ``env``: :func:`~rag_accel.bench.environment` and what the command adds to it (load before,
    draft model, vLLM's version and settings); ``item_ids``: the items to time, in order;
    ``skipped``: the items left out before any timing, ``{"item": id, "why": ...}``."""

    out: Path
    command: str
    env: dict[str, Any]
    methods: Sequence[str]
    item_ids: list[str]
    max_new_tokens: int
    repeats: int = 1
    cold: bool = False
    last: bool = False
    reworded: int = 0
    concurrency_items: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = Path(self.out)

    def tables(self, runs: Sequence[Run], batch_runs: Sequence[BatchRun] = ()) -> str:
        """The results as printed: the main table, then the reworded case, the time split, the
        in-flight throughput and the skipped items, each where there is one."""
        summary = summarize(runs)
        parts = [markdown_table(summary)]
        notes = timing_notes(summary, self.repeats)
        if notes:
            parts += ["", *(f"- {n}" for n in notes)]
        reworded_summary = summarize(runs, "reworded") if self.reworded else {}
        if reworded_summary:
            parts += ["", f"Cached-answer case ({self.reworded} items): the question reworded, greedy's answer to the "
                      "original passed by the client (not in the prompt) as `answers=`, beside the passages:", "",
                      markdown_table(reworded_summary, legend=False)]
        split = split_table(summary)
        if split:
            parts += ["", "Where the time went (transformers methods, mean per request):", "", split]
        if batch_runs:
            parts += ["", f"Throughput with several requests in flight (vLLM; {self.concurrency_items} items per "
                      "level, one generate_batch per group; the transformers methods run one request at a time):",
                      "", concurrency_table(summarize_concurrency(batch_runs))]
        if self.skipped:
            parts += ["", f"Skipped before any timing ({len(self.skipped)} item(s): prompt + --max-new-tokens over "
                      "the context window):", "", *(f"- {s['item']}: {s['why']}" for s in self.skipped)]
        return "\n".join(parts)

    def title(self) -> str:
        env = self.env
        return (f"{env['model']} {env['dtype']} on {env['device']}, {len(self.item_ids)} "
                f"{'last ' if self.last else ''}MS-MARCO items"
                f"{' (cold: our methods forget what earlier requests taught before each run)' if self.cold else ''}, "
                f"{self.max_new_tokens} tokens, {env['date']}")

    def write(self, runs: Sequence[Run], batch_runs: Sequence[BatchRun] = (),
              cost_curves: Mapping[tuple[int, bool, bool, bool], Any] | None = None, *, complete: bool = False,
              plotted: bool = False) -> str:
        """Rewrite ``out.json`` and ``out.md`` with ``runs`` (all so far); returns the tables."""
        self.env["load_after"] = loadavg()
        env = self.env
        done = len(dict.fromkeys(r.item for r in runs if r.case == "rag"))
        summary = summarize(runs)
        result = {"environment": env, "command": self.command, "complete": complete, "items": len(self.item_ids),
                  "max_new_tokens": self.max_new_tokens, "repeats": self.repeats,
                  "cold": self.cold, "last": self.last,
                  "item_ids": self.item_ids, "skipped": self.skipped, "cost_curve": {
                      f"{n}{'' if packed else '-unpacked'}{'' if fast else '-library'}{'-exact' if exact else ''}": v
                      for (n, packed, fast, exact), v in (cost_curves or {}).items()},
                  "summary": summary, "reworded": self.reworded,
                  # where the cached answer went: answers= (the runs before 2026-11-27 passed it as a reference)
                  "cached_answer_as": "answers" if self.reworded else None,
                  "reworded_summary": summarize(runs, "reworded") if self.reworded else {},
                  "concurrency_summary": summarize_concurrency(batch_runs) if batch_runs else {},
                  "concurrency_runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in batch_runs],
                  "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        tables = self.tables(runs, batch_runs)
        uses_vllm = any(m in VLLM_METHODS for m in self.methods)
        k = env.get("max_draft_tokens", env.get("num_speculative_tokens"))  # (the name older runs recorded)
        self.out.with_suffix(".md").write_text("\n".join([
            f"# {self.title()}", "",
            *([] if complete else [f"- incomplete: {done} of {len(self.item_ids)} items measured so far (the run "
                                   "stopped, or is still going); the tables cover those", ""]),
            f"- command: `{self.command}`", f"- torch {env['torch']}, transformers {env['transformers']}",
            *([f"- draft model: {env['draft_model']}"] if env.get("draft_model") else []),
            *([f"- our transformers steps: {'exact' if env['exact_steps'] else 'the library kernels'}, "
               + ("static (one preallocated cache in fixed sizes)" if env.get("static_steps") else "a dynamic cache")]
              if "exact_steps" in env else []),  # (runs before these were recorded name neither)
            *([f"- per-item latency: median of {self.repeats} interleaved runs"] if self.repeats > 1 else []),
            *([f"- vLLM {env['vllm']}, {k} draft tokens per step, env {env['vllm_env']}; "
               "vLLM methods' identical = equal to vllm-greedy (the same engine, speculation off)"
               + ("; a spare plain engine built and closed before them (none timed is the process's first)"
                  if env.get("spare_engine_first") else "")]
              if uses_vllm else []),
            *(["- vllm-suffix: vLLM's suffix decoding (arctic-inference), vLLM's defaults but at most "
               f"{k} tokens a step; it also copies from its engine's earlier answers, so it warms up "
               "on an untimed item, runs each item once and sits out the in-flight table (its levels repeat the "
               "items); in the reworded case it holds the original question's answer, as a deployed engine would"]
              if "vllm-suffix" in self.methods else []),
            *(["- vllm-suffix-f3: the same with suffix_decoding_max_spec_factor 3 (vLLM's default 1): a draft up to 3 "
               "times its match long, the best of 1-3 when its drafting was replayed on the sample's first 50 answers"]
              if "vllm-suffix-f3" in self.methods else []),
            *(["- vllm-suffix-elsewhere: vLLM's suffix decoding on another engine than the one that answered the "
               "questions first (another data-parallel engine, or the server after a restart): it runs the reworded "
               "case only, its tree holding the reworded answers it gave before, never the original's"]
              if "vllm-suffix-elsewhere" in self.methods else []),
            *(["- vllm-ours-memory: our proposer with the memory of earlier answers (all its requests in one scope): "
               "the same rules as vllm-suffix, and in the reworded case the client passes the passages only, "
               "the cached answer being in its memory"] if "vllm-ours-memory" in self.methods else []),
            f"- machine load (1/5/15-min averages, {os.cpu_count()} cores): before {env['load_before']}, "
            f"after {env['load_after']}",
            "", tables, *(["", f"![per-item speed-up]({self.out.with_suffix('.png').name})"] if plotted else []),
            ""]))
        return tables

    def save_outputs(self, path: str | Path, runs: Sequence[Run]) -> None:
        """Greedy's token ids per item (``--save-outputs``): the answers the replays of
        :mod:`rag_accel_lab.replay` and ``benchmarks/experiments/`` draft against; and every method's (its first
        run of each item), which ``benchmarks/experiments/compare_outputs.py`` holds against another run's (another dtype's)."""
        first = [r for r in runs if r.repeat == 0 and r.case == "rag"]
        by_method: dict[str, dict[str, list[int]]] = {}
        for r in first:
            by_method.setdefault(r.method, {})[r.item] = r.token_ids
        Path(path).write_text(json.dumps({"model": self.env["model"], "date": self.env["date"],
                                          "dtype": self.env.get("dtype"),
                                          "outputs": {r.item: r.token_ids for r in first if r.method == "greedy"},
                                          "by_method": by_method}))

    def finish(self, runs: Sequence[Run], batch_runs: Sequence[BatchRun] = (),
               cost_curves: Mapping[tuple[int, bool, bool, bool], Any] | None = None) -> tuple[str, str | None]:
        """The plot, then both files complete; returns the tables and, where the plot could not be
        made (no matplotlib), the line that says so and how to add it."""
        skipped_plot = None
        rag_runs = [r for r in runs if r.case == "rag"]
        try:
            if rag_runs:
                plot(rag_runs, self.out.with_suffix(".png"), self.title())
        except ImportError as e:
            skipped_plot = f"plot skipped: {e}"
        tables = self.write(runs, batch_runs, cost_curves, complete=True,
                            plotted=bool(rag_runs) and skipped_plot is None)
        return tables, skipped_plot
