"""Where the policy's cold acceptance rates (``rag_accel.policy.COLD_RATES``) come from.

    python benchmarks/experiments/cold_rates.py --items 40 --out benchmarks/results/cold_rates_cpu_smollm2

Runs ``ours`` (reference, prompt lookup, n-gram drafts) over the bundled MS-MARCO sample's FIRST
``--items`` items (the defaults are judged on the last ones: ``rag-accel bench --last``), 64 new
tokens each, in one decoder that learns across them with no forgetting, and writes what it learnt:
per drafter and per match-length bucket, how often the first draft token was right (p0; every
draft counts, sent or checked in the shadow of the model's own next token) and each later one
given the one before (p1). The policy's table pools the three copy drafters per bucket and rounds
down to 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.policy import _BUCKET_EDGES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cold_rates"))
    args = ap.parse_args()
    dec = ReferenceDecoder.from_pretrained(args.model)
    dec.acceptance.horizon = float("inf")  # plain counts
    items = load_msmarco_sample(with_answers=True)[: args.items]
    for it in items:
        dec.generate(rag_messages(it.query, it.passages), references=list(it.passages),
                     max_new_tokens=args.max_new_tokens)
    rows, pooled = [], {}
    for (source, b), r in sorted(dec.acceptance.buckets.items()):
        edge = _BUCKET_EDGES[b]
        rows.append({"drafter": source, "match_len_from": edge, "first_right": r.s0, "first_wrong": r.f0,
                     "later_right": r.s1, "later_wrong": r.f1})
        acc = pooled.setdefault(edge, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((r.s0, r.f0, r.s1, r.f1)):
            acc[i] += v

    def rate(a: float, b: float) -> str:
        return f"{a / (a + b):.2f} ({a + b:.0f})" if a + b else "-"

    env = {"model": args.model, "device": platform.processor() or platform.machine(), "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "load": os.getloadavg()}
    command = f"python benchmarks/experiments/cold_rates.py --items {args.items} --max-new-tokens {args.max_new_tokens} " \
              f"--out {args.out}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command,
                                                         "items": [it.id for it in items], "rows": rows}, indent=1))
    lines = [f"# Acceptance per match length, learnt on the sample's first {args.items} items", "",
             f"- command: `{command}`", f"- {env['model']} float32 on {env['device']}, torch {env['torch']}, "
             f"{env['date']}, load {env['load']}", "- p0: first draft token right (count); p1: each later token "
             "right given the one before (count); pooled: the three copy drafters together", "",
             "| match length from | pooled p0 | pooled p1 | " + " | ".join(
                 f"{s} p0 | {s} p1" for s in ("reference", "prompt_lookup", "ngram")) + " |",
             "|---|---|---|" + "---|---|" * 3]
    by = {(r["drafter"], r["match_len_from"]): r for r in rows}
    for edge, (s0, f0, s1, f1) in sorted(pooled.items()):
        cells = []
        for s in ("reference", "prompt_lookup", "ngram"):
            r = by.get((s, edge))
            cells += ["-", "-"] if r is None else [rate(r["first_right"], r["first_wrong"]),
                                                   rate(r["later_right"], r["later_wrong"])]
        lines.append(f"| {edge} | {rate(s0, f0)} | {rate(s1, f1)} | " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
