"""Every method's outputs of one bench run held against another run's greedy outputs (another dtype's, another engine's).

    python benchmarks/experiments/compare_outputs.py --outputs benchmarks/results/outputs_qwen15_bf16.json \\
        --against benchmarks/results/greedy_outputs_qwen15_last16x64.json --out benchmarks/results/NAME

``--outputs`` and ``--against``: files ``rag-accel bench --save-outputs`` wrote (greedy's outputs under ``outputs``,
every method's first run of each item under ``by_method``). For each method of ``--outputs``, on the items both runs
have: how many outputs equal ``--against``'s greedy output token for token, and where the others first differ (the
token index, from 0). A bfloat16 run held against a float32 run's greedy says how often a method's bfloat16 output is
the float32 model's; the same run's own ``identical`` column says how often it is bfloat16 greedy's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length counts), ``None`` where they are equal.

    Example:
        >>> first_difference([1, 2, 3], [1, 2, 4]), first_difference([1, 2], [1, 2, 3]), first_difference([5], [5])
        (2, 2, None)
    """
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(outputs: dict, against: dict, baseline: str = "greedy") -> dict[str, dict]:
    """Per method of ``outputs``: items compared, how many are identical to ``against``'s ``baseline`` method (its
    greedy by default), the first differences of the others."""
    reference = against["outputs"] if baseline == "greedy" else against["by_method"][baseline]
    methods = outputs.get("by_method") or {"greedy": outputs["outputs"]}
    out = {}
    for method, by_item in methods.items():
        items = [i for i in by_item if i in reference]
        diffs = {i: first_difference(by_item[i], reference[i]) for i in items}
        out[method] = {"items": len(items), "identical": sum(d is None for d in diffs.values()),
                       "first_differences": sorted(d for d in diffs.values() if d is not None)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", required=True, type=Path)
    ap.add_argument("--against", required=True, type=Path)
    ap.add_argument("--baseline", default="greedy", help="the method of --against to hold the outputs against "
                    "(e.g. ours-plain: the same decoder with drafting off)")
    ap.add_argument("--out", type=Path, help="path without suffix: writes .json and .md (default: print only)")
    args = ap.parse_args()
    outputs, against = json.loads(args.outputs.read_text()), json.loads(args.against.read_text())
    result = compare(outputs, against, args.baseline)
    lines = [f"# {outputs.get('model')} {outputs.get('dtype') or ''} outputs against {against.get('model')} "
             f"{against.get('dtype') or ''} {args.baseline}", "",
             f"- command: `python benchmarks/experiments/compare_outputs.py --outputs {args.outputs} --against {args.against}"
             + (f" --baseline {args.baseline}" if args.baseline != "greedy" else "")
             + (f" --out {args.out}`" if args.out else "`"), "",
             f"| method | identical to {args.baseline} there | first differing token of the others |", "|---|---|---|"]
    for method, r in result.items():
        lines.append(f"| {method} | {r['identical']}/{r['items']} | {', '.join(map(str, r['first_differences'])) or '-'} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps({"outputs": str(args.outputs), "against": str(args.against),
                                                             "baseline": args.baseline, "result": result}, indent=1))
        args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
