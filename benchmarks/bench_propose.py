"""Cost of one draft proposal against reference size: ours vs Hugging Face's prompt lookup.

    python benchmarks/bench_propose.py --sizes 1000,100000,1000000 --out benchmarks/results/propose_cpu

For each size N: build time and peak memory of our reference index; median
time of one `propose` (a fresh search, and a followed span); and the peer's
way of matching, transformers' PromptLookupCandidateGenerator.get_candidates,
which compares every window of the sequence each step (cost grows with N).
Synthetic references: Zipf-distributed token ids (vocab 49152), contexts cut
from the references so matches exist.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rag_accel.drafters import ReferenceDrafter


def zipf_tokens(n: int, rng: np.random.Generator, vocab: int = 49152) -> np.ndarray:
    return (rng.zipf(1.2, size=n) % vocab).astype(np.int64)


def bench(n: int, queries: int, rng: np.random.Generator) -> dict:
    ref = zipf_tokens(n, rng)
    tracemalloc.start()
    t0 = time.perf_counter()
    drafter = ReferenceDrafter([ref.tolist()], min_match=1, max_match=32)
    build_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    contexts = []
    for _ in range(queries):
        s = int(rng.integers(0, max(1, n - 64)))
        ctx = ref[s: s + 32].tolist()
        ctx[0] = 49151  # make the longest match end inside the context
        contexts.append(ctx)
    search, follow = [], []
    for ctx in contexts:
        drafter._follow = None
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,100000,1000000")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = [bench(int(s), args.queries, rng) for s in args.sizes.split(",")]
    lines = ["| reference tokens | index build (s) | index peak memory (MiB) | propose, search (µs, median / p99) "
             "| propose, followed span (µs) | HF prompt lookup (µs) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['reference_tokens']:,} | {r['index_build_s']:.3f} | {r['index_peak_mem_mb']:.0f} | "
                     f"{r['propose_search_us_median']:.0f} / {r['propose_search_us_p99']:.0f} | "
                     f"{r['propose_follow_us_median']:.0f} | {r['hf_prompt_lookup_us_median']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        env = {"device": f"cpu: {platform.processor() or platform.machine()}", "threads": torch.get_num_threads(),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": platform.python_version()}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python benchmarks/bench_propose.py " + f"--sizes {args.sizes} --queries {args.queries} --out {args.out}"
        out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": cmd, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(
            f"# Drafting cost against reference size\n\n- {env['device']}, {env['date']}\n- command: `{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
