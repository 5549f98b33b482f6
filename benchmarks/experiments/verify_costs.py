"""What a plain step and a verify forward cost per model and dtype, with the planned projections and without.

    python benchmarks/experiments/verify_costs.py --models qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct \\
        --dtypes float32,bfloat16 --out benchmarks/results/verify_costs_cpu

For each model and dtype: how long :meth:`rag_accel.ReferenceDecoder.plan_linears` takes and what it chose
(per weight shape, the row counts it moves off the library's own ``F.linear``), then a forward over ``N``
new tokens on a cached context of ``--context`` random tokens (an answer's context in the bundled sample
is 700-900), ``N`` in ``--sizes``, with ``fast_linears`` on (the planned layouts) and off (the model's own
projections): milliseconds (the least disturbed of ``--repeats`` rounds, round-robin over sizes and arms,
after a warm-up round) and the ratio to the same arm's one-token forward, the price the draft-length policy
pays for ``N - 1`` draft tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from rag_accel import ReferenceDecoder
from rag_accel.hf.kv import rollback_cache

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)


ARMS = {"library": dict(fast_linears=False), "planned": dict(fast_linears=True), "exact": dict(exact=True)}


def measure(dec: ReferenceDecoder, context: int, sizes: tuple[int, ...], repeats: int,
            arms: tuple[str, ...]) -> tuple[dict, float, dict]:
    """(arm -> N -> ms, the prefill's ms, arm -> N -> rows of an N-token forward bit-equal to one-token steps)."""
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, dec.vocab_size, (context,), generator=gen).tolist()
    samples: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in sizes} for arm in arms}
    equal: dict[str, dict[int, int]] = {arm: {} for arm in arms}
    with torch.inference_mode():
        dec.steps.forward(ctx[:16], dec.steps.new_cache(), last_only=True)  # (the first forward of all pays set-ups)
        cache = dec.steps.new_cache()
        t0 = time.perf_counter()
        dec.steps.forward(ctx, cache, last_only=True)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        for r in range(repeats + 1):
            for n in sizes:
                for arm in (arms if r % 2 else arms[::-1]):
                    ids = torch.randint(0, dec.vocab_size, (n,), generator=gen).tolist()
                    t0 = time.perf_counter()
                    dec.steps.forward(ids, cache, pack_gqa=dec.steps.pack_gqa, **ARMS[arm])
                    if r:
                        samples[arm][n].append(time.perf_counter() - t0)
                    rollback_cache(cache, n)
        seq = torch.randint(0, dec.vocab_size, (max(sizes),), generator=gen).tolist()
        for arm in arms:  # each row of an N-token forward against the same token's one-token step
            alone = []
            for t in seq:
                alone.append(dec.steps.forward([t], cache, pack_gqa=dec.steps.pack_gqa, **ARMS[arm])[-1])
            rollback_cache(cache, len(seq))
            for n in sizes:
                logits = dec.steps.forward(seq[:n], cache, pack_gqa=dec.steps.pack_gqa, **ARMS[arm])
                rollback_cache(cache, n)
                equal[arm][n] = sum(torch.equal(logits[i], alone[i]) for i in range(n))
    return ({arm: {n: min(v) * 1e3 for n, v in by.items()} for arm, by in samples.items()}, prefill_ms, equal)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--context", type=int, default=849)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="library,planned", help=f"from {','.join(ARMS)}: the model's own projections, "
                    "the planned ones (hf/linears.py), exact steps (hf/attention.py's row attention, invariant plans)")
    ap.add_argument("--out", required=True, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            arms = tuple(args.arms.split(","))
            dec = ReferenceDecoder.from_pretrained(name, device="cpu", dtype=dtype, calibrate=False,
                                                   exact="exact" in arms)
            t0 = time.perf_counter()
            plans = dec.plan_linears()
            plan_s = time.perf_counter() - t0
            chosen = {f"{o}x{i}": {n: (f"as {p.rows[n]}" if p.rows[n] != n else "") +
                                   (" transposed" if p.transposed[n] else "")
                                   for n in range(1, len(p.rows)) if p.rows[n]}
                      for (o, i, _), p in plans.items()}
            ms, prefill_ms, equal = measure(dec, args.context, sizes, args.repeats, arms)
            runs.append({"model": name, "dtype": dtype, "plan_s": round(plan_s, 2), "prefill_ms": round(prefill_ms),
                         "plans": chosen, "bit_equal_rows": {arm: {str(n): e for n, e in by.items()}
                                                             for arm, by in equal.items()},
                         "ms": {arm: {str(n): round(v, 1) for n, v in by.items()} for arm, by in ms.items()}})
            print(json.dumps(runs[-1]["ms"]), flush=True)
            del dec
    env = {"date": datetime.now(timezone.utc).date().isoformat(), "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
           "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    out = Path(args.out)
    command = "python benchmarks/experiments/verify_costs.py " + " ".join(
        f"--{k} {v}" for k, v in (("models", args.models), ("dtypes", args.dtypes), ("context", args.context),
                                  ("repeats", args.repeats), ("arms", args.arms), ("out", args.out)))
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command, "context": args.context,
                                                    "sizes": sizes, "runs": runs}, indent=1))
    lines = [f"# Plain and verify forwards by arm (the library's projections, planned ones, exact steps), cpu ({env['cpu_threads']} threads), "
             f"{env['date']}", "",
             f"- command: `{command}`",
             f"- torch {env['torch']}, transformers {env['transformers']}; machine load (1/5/15 min) before "
             f"{load_before}, after {env['load_after']}",
             f"- a forward over N new tokens (N - 1 draft tokens) on a {args.context}-token cached context: ms, and "
             "in brackets over the same arm's N = 1", ""]
    head = "| model | dtype | prefill (s) | projections | " + " | ".join(f"N={n}" for n in sizes) + " |"
    lines += [head, "|---|---|---|---|" + "---|" * len(sizes)]
    for run in runs:
        for arm in run["ms"]:
            by = run["ms"][arm]
            base = by["1"]
            lines.append(f"| {run['model']} | {run['dtype']} | {run['prefill_ms'] / 1e3:.1f} | {arm} | " +
                         " | ".join(f"{by[str(n)]:.0f} ({by[str(n)] / base:.2f})" for n in sizes) + " |")
    lines += ["", "Rows of an N-token forward bit-equal (`torch.equal`) to the same tokens' one-token steps, per arm:", "",
              "| model | dtype | arm | " + " | ".join(f"N={n}" for n in sizes) + " |",
              "|---|---|---|" + "---|" * len(sizes)]
    for run in runs:
        for arm, by in run.get("bit_equal_rows", {}).items():
            lines.append(f"| {run['model']} | {run['dtype']} | {arm} | " + " | ".join(f"{by[str(n)]}/{n}" for n in sizes)
                         + " |")
    lines += ["", "What the plans chose (per weight shape, the row counts moved off `F.linear`) and how long planning took:", ""]
    for run in runs:
        lines.append(f"- {run['model']}, {run['dtype']}: {run['plan_s']} s; " + "; ".join(
            f"{shape}: " + (", ".join(f"{n}: {how.strip()}" for n, how in by.items()) or "none")
            for shape, by in run["plans"].items()))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
