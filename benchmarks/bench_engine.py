"""Side-by-side engine benchmark on the bundled MS-MARCO sample.

    python benchmarks/bench_engine.py --items 24 --max-new-tokens 96 \
        --methods greedy,hf-pld,ours --out benchmarks/results/engine_cpu_smollm2

Writes <out>.json (environment, command, per-item runs, summary) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from rag_accel import DEFAULT_MODEL, ReferenceDecoder
from rag_accel.bench import ALL_METHODS, environment, markdown_table, run_benchmark, summarize
from rag_accel.data import load_msmarco_sample


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--items", type=int, default=24)
    p.add_argument("--skip", type=int, default=0, help="skip the first N answered items")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--methods", default="greedy,hf-pld,ours")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    dec = ReferenceDecoder.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    items = load_msmarco_sample(with_answers=True, limit=args.skip + args.items)[args.skip:]
    runs = run_benchmark(dec, items, methods, args.max_new_tokens, progress=lambda s: print(s, file=sys.stderr))
    summary = summarize(runs)
    env = environment(dec)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    table = markdown_table(summary)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"environment": env, "command": command, "items": len(items),
                  "max_new_tokens": args.max_new_tokens, "cost_curve": dec._cost_curves,
                  "summary": summary,
                  "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]}
        out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
        md = [f"# Engine benchmark: {env['model']} on {env['device']}", "",
              f"- date: {env['date']}, dtype: {env['dtype']}, torch {env['torch']}, transformers {env['transformers']}",
              f"- items: {len(items)} answered MS-MARCO sample items, {args.max_new_tokens} new tokens, greedy",
              f"- command: `{command}`", "", table, ""]
        out.with_suffix(".md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
