"""Cold against warm, old policy against new, without timing noise: replay each request's drafting.

    rag-accel bench --last --items 100 --max-new-tokens 64 --methods greedy --save-outputs /tmp/last100.json \\
        --out /tmp/last100
    python benchmarks/experiments/cold_replay.py --outputs /tmp/last100.json --out benchmarks/results/cold_replay_smollm2

The model's greedy answers are known (``--save-outputs``), so every verify step's outcome is too: the
request's real drafting code (:class:`rag_accel.speculation.RequestDrafting`: drafters, policy, loss
budget) runs against them, and each step is charged what the cost curve says it costs, in plain steps
(the curve measured on this CPU by ``rag-accel bench``, stored in the outputs' bench JSON), the prefill
``--prefill-per-token`` plain steps per prompt token (measured here: a 1,321-token prompt took 2.8 s of
prefill against 70 ms per plain step, 0.03). An item's modelled speed-up is greedy's cost over ours: no
machine noise, so the worst item says what the policy does, not what the machine did. Per-step host time
(drafting, ~0.2 ms of a 65 ms step here) is left out.

Configurations: ``cold`` (every request a fresh process's first: nothing learnt) and ``warm`` (one engine
learning across the items in order), each with the current policy (``new``) and the one before issue 27
(``old``: one flat cold prior of 0.5, one free plain step per request), and the current one without
its request decay (:data:`rag_accel.policy.REQUEST_DECAY`); ``--request-decay 0.9,0.8`` adds the
current policy at each of those decays of the request factor (recent outcomes weigh more).
Tune on the sample's first items (``rag-accel bench --items N``), judge on its last ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.policy import AcceptanceStats, leading_matches
from rag_accel.speculation import RequestDrafting, StepCosts


def replay(prompt: list[int], refs: list[list[int]], target: list[int], curve: list[float], cfg: DecoderConfig,
           acceptance: AcceptanceStats, costs: StepCosts, prefill: float, policy: dict,
           max_new: int) -> tuple[float, int]:
    """(our modelled cost in plain steps, forward passes) for one request whose output is ``target``."""
    context = list(prompt)
    drafting = RequestDrafting.from_config(cfg, context, refs, curve, acceptance, costs)
    for name, value in policy.items():  # the variant's policy settings
        setattr(drafting.policy, name, value)
    drafting.prefill_s = prefill  # seconds = plain steps here: a plain step takes 1.0
    cost, steps, new = prefill, 1, [target[0]]
    context.append(target[0])
    while len(context) - len(prompt) < len(target):
        drafting.learn(context, new)
        n_gen = len(context) - len(prompt)
        draft, n_send = drafting.choose(context, n_gen, max_new - n_gen)  # (the end is not known ahead)
        sent = draft.tokens[:n_send]
        truth = target[n_gen:n_gen + n_send + 1]
        n_acc = leading_matches(sent, truth)
        new = (sent[:n_acc] + [target[n_gen + n_acc]]) if n_gen + n_acc < len(target) else sent[:n_acc]
        step = curve[n_send]
        drafting.account(n_send, n_acc, step, len(context))
        cost += step
        steps += 1
        context.extend(new)
    return cost, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, required=True, help="rag-accel bench --save-outputs FILE")
    ap.add_argument("--bench-json", type=Path, default=None, help="that bench's JSON (its cost curve); default: "
                    "the --out next to the outputs is not known, so give it")
    ap.add_argument("--prefill-per-token", type=float, default=0.03)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the bench's")
    ap.add_argument("--request-decay", default="", help="comma-separated decays to add (e.g. 0.9,0.8)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cold_replay"))
    args = ap.parse_args()
    saved = json.loads(args.outputs.read_text())["outputs"]
    bench = json.loads(args.bench_json.read_text()) if args.bench_json else None
    dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct", calibrate=False)
    cfg = dec.config.replace(drafters=("reference", "prompt_lookup", "ngram"))
    curve = (list(bench["cost_curve"][str(cfg.max_draft_tokens)]) if bench
             else list(dec.cost_curve(cfg.max_draft_tokens)))
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    rows = []
    prepared = []
    for item_id, target in saved.items():
        it = items[item_id]
        prompt = dec.encode_prompt(rag_messages(it.query, it.passages))
        refs = dec.encode_references(list(it.passages))
        prepared.append((item_id, prompt, refs, target))
    result: dict[str, dict] = {}
    variants: dict[str, dict] = {"old policy": {"prior": 0.5, "exploration": 1.0, "request_decay": 1.0},
                                 "new policy without request decay": {"request_decay": 1.0}, "new policy": {}}
    for d in filter(None, args.request_decay.split(",")):
        variants[f"new policy, request decay {float(d)}"] = {"request_decay": float(d)}
    for variant, policy in variants.items():
        for warm in (False, True):
            name = f"{'warm' if warm else 'cold'}, {variant}"
            acceptance, costs = AcceptanceStats(), StepCosts()
            ratios = []
            for item_id, prompt, refs, target in prepared:
                if not warm:
                    acceptance, costs = AcceptanceStats(), StepCosts()
                prefill = args.prefill_per_token * len(prompt)
                ours, steps = replay(prompt, refs, target, curve, cfg, acceptance, costs, prefill, policy,
                                     args.max_new_tokens)
                greedy = prefill + len(target) - 1
                ratios.append(greedy / ours)
                rows.append({"config": name, "item": item_id, "new_tokens": len(target), "steps": steps,
                             "modelled_speedup": greedy / ours})
            worst = min(range(len(ratios)), key=ratios.__getitem__)
            result[name] = {"geomean": math.exp(statistics.fmean(math.log(r) for r in ratios)),
                            "worst": ratios[worst], "worst_item": prepared[worst][0],
                            "below_0.97": sum(r < 0.97 for r in ratios), "items": len(ratios)}
    command = (f"python benchmarks/experiments/cold_replay.py --outputs {args.outputs} "
               f"{'--bench-json ' + str(args.bench_json) + ' ' if args.bench_json else ''}"
               f"--prefill-per-token {args.prefill_per_token} "
               f"{'--request-decay ' + args.request_decay + ' ' if args.request_decay else ''}--out {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "cost_curve": curve,
                                                         "summary": result, "rows": rows}, indent=1))
    lines = [f"# Cold against warm, old policy against new: {len(prepared)} items replayed (modelled, no timing "
             "noise)", "", f"- command: `{command}`", f"- cost curve (plain steps for 0..{len(curve) - 1} draft "
             f"tokens): {', '.join(f'{c:.2f}' for c in curve[:4])}, ..., {curve[-1]:.2f}; prefill "
             f"{args.prefill_per_token} plain steps per prompt token", "",
             "| configuration | modelled speed-up (geo-mean) | worst item | items below 0.97x |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['geomean']:.3f}x | {v['worst']:.3f}x ({v['worst_item']}) | {v['below_0.97']} of "
              f"{v['items']} |" for k, v in result.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
