"""The drafting micro-benchmark (``rag-accel bench-drafting``): the cost of one draft proposal against
reference size, ours against Hugging Face's prompt lookup on the same tokens."""

from __future__ import annotations

import json
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from ..drafters import REFERENCE_MAX_MATCH, ReferenceDrafter

T = TypeVar("T")


def _zipf_tokens(n: int, rng: np.random.Generator, vocab: int = 49152) -> np.ndarray:
    return (rng.zipf(1.2, size=n) % vocab).astype(np.int64)


def _built(make: Callable[[], T]) -> tuple[T, float, int]:
    """``make()``, the seconds it took and its peak of traced memory (bytes)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    made = make()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return made, seconds, peak


def _propose_cost_row(n: int, queries: int, rng: np.random.Generator) -> dict:
    ref = _zipf_tokens(n, rng)
    drafter, build_s, peak = _built(lambda: ReferenceDrafter([ref.tolist()], min_match=1, max_match=REFERENCE_MAX_MATCH))
    contexts = []
    for _ in range(queries):
        s = int(rng.integers(0, max(1, n - 64)))
        ctx = ref[s: s + 32].tolist()
        ctx[0] = 49151  # make the longest match end inside the context
        contexts.append(ctx)
    search, follow = [], []
    for ctx in contexts:
        drafter.forget_span()
        t0 = time.perf_counter()
        d = drafter.propose(ctx, 10)
        search.append(time.perf_counter() - t0)
        if d.tokens:
            ctx2 = ctx + d.tokens[:3]
            drafter.update(ctx2, 3)
            t0 = time.perf_counter()
            drafter.propose(ctx2, 10)
            follow.append(time.perf_counter() - t0)
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    hf = PromptLookupCandidateGenerator(num_output_tokens=10, max_matching_ngram_size=2, max_length=n + 64)
    hf_times = []
    for ctx in contexts[: max(3, queries // 10)]:
        ids = torch.tensor([ref.tolist() + ctx])
        t0 = time.perf_counter()
        hf.get_candidates(ids)
        hf_times.append(time.perf_counter() - t0)
    return {
        "reference_tokens": n,
        "index_build_s": build_s,
        "index_peak_mem_mb": peak / 2**20,
        "propose_search_us_median": statistics.median(search) * 1e6,
        "propose_search_us_p99": float(np.percentile(search, 99)) * 1e6,
        "propose_follow_us_median": statistics.median(follow) * 1e6 if follow else None,
        "hf_prompt_lookup_us_median": statistics.median(hf_times) * 1e6,
    }


def propose_cost(sizes: Sequence[int], queries: int = 300, seed: int = 0) -> list[dict]:
    """Cost of one reference-drafter ``propose`` (LLMA's longest match: a fresh search, a followed span),
    index build time and peak memory, against
    transformers' prompt lookup on the same tokens, for each reference size.
    Synthetic references: Zipf-distributed token ids; contexts cut from them so matches exist."""
    rng = np.random.default_rng(seed)
    return [_propose_cost_row(int(n), queries, rng) for n in sizes]


def propose_table(rows: Sequence[dict]) -> str:
    lines = ["| reference tokens | index build (s) | index peak memory (MiB) | propose, search (µs, median / p99) "
             "| propose, followed span (µs) | HF prompt lookup (µs) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['reference_tokens']:,} | {r['index_build_s']:.3f} | "
                     f"{r['index_peak_mem_mb']:.0f} | "
                     f"{r['propose_search_us_median']:.0f} / {r['propose_search_us_p99']:.0f} | "
                     f"{r['propose_follow_us_median']:.0f} | {r['hf_prompt_lookup_us_median']:.0f} |")
    return "\n".join(lines)


def write_drafting_report(rows: Sequence[dict], out: str | Path, command: str) -> str:
    """``out.json`` (the environment, the command, ``rows``) and ``out.md`` (the table); returns the table."""
    import platform
    from datetime import datetime, timezone

    out = Path(out)
    table = propose_table(rows)
    env = {"device": f"cpu: {platform.processor() or platform.machine()}", "threads": torch.get_num_threads(),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": platform.python_version(),
           "machine_load_after": [round(x, 2) for x in os.getloadavg()]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command, "rows": list(rows)},
                                                   indent=1))
    out.with_suffix(".md").write_text(f"# Drafting cost against reference size\n\n- {env['device']}, {env['date']}\n"
                                      f"- command: `{command}`\n- machine load (1/5/15-min averages) after the run: "
                                      f"{' '.join(map(str, env['machine_load_after']))}\n\n{table}\n")
    return table
