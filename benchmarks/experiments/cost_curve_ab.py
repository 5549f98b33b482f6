"""A cost curve that keeps its dips, against the transformers decoder's own: same run, same items.

    python benchmarks/experiments/cost_curve_ab.py --items 30 --repeats 3 --out benchmarks/results/cost_curve_ab_cpu_smollm2

:func:`rag_accel.hf.steps.measure_cost_curve` (arm ``before``) times forwards over 1, 2, 4, 8, 16, 32 and
``max_draft + 1`` tokens and makes the curve non-decreasing. On this CPU a forward over 2-3 tokens costs more
than one over 4-8 (the matrix products' kernel for two or three rows is slower than the one for four and more;
``tree_verify.py`` times every size), so that curve charges a 5-token draft what 2 tokens cost. The candidate
(arm ``after``, :func:`curve_with_dips`) times every size up to 8 and keeps the dips. Both curves are measured
here, on the same decoder, and each request passes one of them as its ``cost_curve``: the only difference
between the arms. Cold, as a fresh process's first request
(``reset_learning`` before every run of ours), on the sample's last items (untuned), ``--max-new-tokens`` each;
greedy is ``generate_greedy`` (``model.generate``), the three interleaved per item, their order alternating
by round; an item's latency is the median of its runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel_lab.replay import cost_of, forward_costs
from rag_accel.hf.steps import measure_cost_curve

ARMS = ("greedy", "before", "after")


def curve_with_dips(decoder: ReferenceDecoder, max_draft: int, context_len: int = 256, repeats: int = 2) -> tuple:
    """The candidate rule: every size up to 8 timed (then 12, 16, 24, 32, 48, 64, ``max_draft + 1``), a longer
    forward that costs less kept (linear between sizes, at least 1), as :func:`measure_cost_curve` otherwise
    (its context length and repeats; the timing loop is :func:`rag_accel_lab.replay.forward_costs`)."""
    ctx_len = max(1, min(context_len, (decoder.context_window or 1 << 30) - max_draft - 2))
    sizes = sorted({*range(1, min(8, max_draft + 1) + 1),
                    *(s for s in (12, 16, 24, 32, 48, 64) if s <= max_draft), max_draft + 1})
    costs = forward_costs(decoder, ctx_len, repeats, sizes)
    return (1.0, *(max(1.0, cost_of(costs, L + 1)) for L in range(1, max_draft + 1)))


def geo(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def render(data: dict, out: Path) -> None:
    med = {a: {i: statistics.median(t) for i, t in data["times"][a].items()} for a in ARMS}
    items = list(med["greedy"])
    speed = {a: [med["greedy"][i] / med[a][i] for i in items] for a in ("before", "after")}
    paired = [med["before"][i] / med["after"][i] for i in items]
    worst = {a: min(zip(speed[a], items)) for a in speed}
    lines = [f"# The decoder's cost curve kept non-decreasing (before) and with its dips (after): {data['model']} "
             f"float32, {len(items)} last MS-MARCO items (cold), {data['max_new_tokens']} tokens, {data['date']}", "",
             f"- command: `{data['command']}`", f"- machine: {data['machine']}; load (1/5/15 min) before "
             f"{data['load_before']}, after {data['load_after']}",
             f"- per item: the median of {data['repeats']} interleaved runs of each arm; every run of ours cold",
             "", "The two curves (a forward over 1 + L tokens relative to one token, L = 0..11):", "",
             "| L | " + " | ".join(str(i) for i in range(12)) + " |", "|---|" + "---|" * 12]
    lines += [f"| {a} | " + " | ".join(f"{c:.2f}" for c in data["curves"][a][:12]) + " |" for a in ("before", "after")]
    lines += ["", "| arm | speed-up vs greedy (geo-mean) | worst item | tokens/step | identical to greedy |",
              "|---|---|---|---|---|"]
    for a in ("before", "after"):
        s = data["steps"][a]
        lines.append(f"| {a} | {geo(speed[a]):.3f}x | {worst[a][0]:.3f}x ({worst[a][1]}) | "
                     f"{s['tokens'] / s['steps']:.2f} | {data['identical'][a]}/{data['runs']} |")
    lines += ["", f"Paired, per item: before's latency over after's, geo-mean {geo(paired):.3f}; after faster on "
                  f"{sum(p > 1 for p in paired)} of {len(items)} items."]
    if data.get("note"):
        lines += ["", data["note"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for a in ("before", "after"):
        ax1.plot(range(12), data["curves"][a][:12], marker="o", label=a)
    ax1.set(xlabel="draft tokens L", ylabel="forward over 1 + L tokens / one token", title="cost curve")
    ax1.legend()
    order = sorted(range(len(items)), key=lambda k: speed["before"][k])
    for a in ("before", "after"):
        ax2.plot([speed[a][k] for k in order], marker=".", linestyle="", label=a)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set(xlabel="item (by before's speed-up)", ylabel="speed-up vs greedy", title="per item, cold")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cost_curve_ab_cpu_smollm2"))
    ap.add_argument("--render", type=Path, default=None, help="rewrite a run's markdown and plot from its JSON")
    args = ap.parse_args()
    if args.render is not None:
        return render(json.loads(args.render.read_text()), args.render)
    dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct", calibrate=False)
    k = dec.config.max_draft_tokens
    curves = {"before": measure_cost_curve(dec.steps, k),  # (the decoder's own forward path)
              "after": curve_with_dips(dec, k)}
    items = load_msmarco_sample()[-args.items:]
    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {a: {} for a in ARMS}
    steps = {a: {"tokens": 0, "steps": 0} for a in ("before", "after")}
    identical = {a: 0 for a in ("before", "after")}
    for r in range(args.repeats):
        for item in items:
            ids = dec.encode_prompt(rag_messages(item.query, item.passages))
            outputs = {}
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                t0 = time.perf_counter()
                if arm == "greedy":
                    out = dec.generate_greedy(ids, max_new_tokens=args.max_new_tokens)
                else:
                    dec.reset_learning()
                    out = dec.generate(ids, references=list(item.passages), max_new_tokens=args.max_new_tokens,
                                       config={"cost_curve": curves[arm]})
                    steps[arm]["tokens"] += out.stats.new_tokens
                    steps[arm]["steps"] += out.stats.steps
                times[arm].setdefault(item.id, []).append(time.perf_counter() - t0)
                outputs[arm] = out.token_ids
            for arm in ("before", "after"):
                identical[arm] += outputs[arm] == outputs["greedy"]
        print(f"round {r + 1} of {args.repeats} done", flush=True)
    command = (f"python benchmarks/experiments/cost_curve_ab.py --items {args.items} --repeats {args.repeats} "
               f"--max-new-tokens {args.max_new_tokens} --out {args.out}")
    data = {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads", "model": "smollm2-135m-instruct",
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "runs": args.repeats * len(items),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "curves": curves, "steps": steps, "identical": identical, "times": times}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    render(data, args.out)


if __name__ == "__main__":
    main()
