"""What a request whose drafts are all rejected costs against greedy (issue 27: at most 3% more).

    python benchmarks/experiments/misleading_refs.py --items 20 --repeats 3 --out benchmarks/results/misleading_refs_cpu_smollm2

For each of the sample's last items (no default was tuned on them): greedy's own answer (with the prompt's
last tokens before it) is cut into its 4-token windows, each followed by a token the answer never contains,
and those snippets are the request's only reference. Every step the output's tail then matches a reference 4 tokens long (strong
evidence to a fresh decoder: ``policy.COLD_RATES`` gives a 4-token match a high prior) and the copy's
first token is always wrong. ``ours-ref`` drafts from the references only, so every draft it sends is
rejected (checked: the run fails if one is accepted); ``ours`` is the default chain over the same
misleading reference, the prompt's passages still there for prompt lookup and n-grams. ``plain`` is
our loop with drafting off (``speculate=False``): against it, the cost of the rejected drafts alone
(our plain steps are cheaper than ``generate``'s, which flatters the ratio against greedy).

Cold: before each run of ours the decoder forgets what earlier requests taught (a fresh process's first
request; the cost curve measured at load is kept). Per item the methods run ``--repeats`` rounds,
interleaved and rotating; an item's time is the median of its rounds. The figure the issue asks about
is the total: all items' greedy time over all items' ours-ref time (per item too, and the worst item).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

WINDOW = 4


def misleading_reference(prompt: list[int], answer: list[int], vocab_size: int) -> list[int]:
    """Each ``WINDOW``-token window of ``prompt + answer`` that ends in the answer or at the prompt's last
    token, followed by a token ``answer`` does not contain. Wherever the output stands, the longest match
    of its tail is a whole window (exactly ``WINDOW`` long: the token before a window is a wrong one),
    and what follows it is wrong; the right continuations sit inside windows, at most ``WINDOW - 1`` long.

    Example:
        >>> misleading_reference([1, 2, 3], [4, 5], vocab_size=10)
        [1, 2, 3, 9, 1, 2, 3, 4, 8, 2, 3, 4, 5, 7]
    """
    present = set(answer)
    wrong = (t for t in range(vocab_size - 1, -1, -1) if t not in present)
    full = [*prompt, *answer]
    ref: list[int] = []
    for end in range(len(prompt), len(full) + 1):
        ref += full[max(0, end - WINDOW):end] + [next(wrong)]
    return ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/misleading_refs"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    dec = ReferenceDecoder.from_pretrained(args.model)
    items = load_msmarco_sample(with_answers=True)[-args.items:]
    methods = ("greedy", "plain", "ours-ref", "ours")
    warm = dec.encode_prompt(rag_messages(items[0].query, items[0].passages))
    dec.generate_greedy(warm, max_new_tokens=8)  # untimed warm-up of both paths
    dec.generate(warm, max_new_tokens=8)
    rows = []
    for n, item in enumerate(items):
        prompt = dec.encode_prompt(rag_messages(item.query, item.passages))
        answer = dec.generate_greedy(prompt, max_new_tokens=args.new).token_ids  # untimed: builds the reference
        ref = misleading_reference(prompt, answer, dec.vocab_size)
        times: dict[str, list[float]] = {m: [] for m in methods}
        stats: dict[str, object] = {}
        for rep in range(args.repeats):
            k = (n * args.repeats + rep) % len(methods)
            for m in methods[k:] + methods[:k]:
                if m != "greedy":
                    dec.reset_learning()
                t0 = time.perf_counter()
                if m == "greedy":
                    out = dec.generate_greedy(prompt, max_new_tokens=args.new)
                elif m == "plain":
                    out = dec.generate(prompt, max_new_tokens=args.new, speculate=False)
                else:
                    cfg = {"drafters": ("reference",)} if m == "ours-ref" else None
                    out = dec.generate(prompt, references=[ref], max_new_tokens=args.new, config=cfg)
                times[m].append(time.perf_counter() - t0)
                if out.token_ids != answer:
                    raise SystemExit(f"{item.id}: {m}'s output differs from greedy's")
                if m not in ("greedy", "plain"):
                    stats[m] = out.stats
        if stats["ours-ref"].accepted:
            raise SystemExit(f"{item.id}: a misleading draft was accepted ({stats['ours-ref'].accepted} tokens)")
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"item": item.id, "tokens": len(answer), "median_s": med,
                     "drafted": {m: stats[m].drafted for m in stats}, "accepted": {m: stats[m].accepted for m in stats},
                     "steps": {m: stats[m].steps for m in stats}, "runs_s": times})
        print(f"{n + 1}/{len(items)} {item.id}: " + " ".join(f"{m}={s:.2f}s" for m, s in med.items())
              + f" ours-ref drafted {stats['ours-ref'].drafted}, steps {stats['ours-ref'].steps}", flush=True)
    total = {m: sum(r["median_s"][m] for r in rows) for m in methods}
    summary = {}
    for m in methods[2:]:
        ratios = [r["median_s"]["greedy"] / r["median_s"][m] for r in rows]
        worst = min(range(len(rows)), key=lambda i: ratios[i])
        vs_plain = [r["median_s"]["plain"] / r["median_s"][m] for r in rows]
        summary[m] = {"total_vs_greedy": total["greedy"] / total[m], "total_vs_plain": total["plain"] / total[m],
                      "worst_vs_plain": min(vs_plain),
                      "geo_mean": statistics.geometric_mean(ratios), "worst": ratios[worst],
                      "worst_item": rows[worst]["item"],
                      "drafted": sum(r["drafted"][m] for r in rows), "accepted": sum(r["accepted"][m] for r in rows),
                      "steps": sum(r["steps"][m] for r in rows), "tokens": sum(r["tokens"] for r in rows)}
    env = {"model": args.model, "device": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "load_before": load_before,
           "load_after": os.getloadavg()}
    command = f"python benchmarks/experiments/misleading_refs.py --items {args.items} --new {args.new} " \
              f"--repeats {args.repeats} --out {args.out}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command,
                                                         "summary": summary, "items": rows}, indent=1))
    lines = ["# A request whose drafts are all rejected, against greedy (cold)", "",
             f"- command: `{command}`",
             f"- {env['model']} float32 on {env['device']} ({env['threads']} threads), torch {env['torch']}, "
             f"{env['date']}; machine load (1/5/15 min) before {load_before}, after {env['load_after']}",
             f"- the sample's last {len(rows)} items, {args.new} new tokens; the only reference: greedy's answer "
             f"in {WINDOW}-token windows, each followed by a wrong token; median of {args.repeats} interleaved "
             "runs per item, every run a fresh decoder's first request; every output identical to greedy's", "",
             "| method | all items' time vs greedy | per item (geo-mean) | worst item | vs our loop without "
             "drafting: all items; worst item | drafted tokens | accepted | forward passes / tokens |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m} | {s['total_vs_greedy']:.3f}x | {s['geo_mean']:.3f}x | {s['worst']:.3f}x ({s['worst_item']}) | "
              f"{s['total_vs_plain']:.3f}x; {s['worst_vs_plain']:.3f}x | {s['drafted']} | {s['accepted']} | "
              f"{s['steps']} / {s['tokens']} |" for m, s in summary.items()]
    lines += ["", "Ratios are speed-ups (above 1: faster). greedy: `model.generate(do_sample=False)`; our loop without "
              "drafting: `generate(..., speculate=False)`, the same loop as ours, so that column is the cost of the "
              "rejected drafts alone."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
