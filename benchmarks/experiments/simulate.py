"""Replay drafting + draft-length policy against fixed target outputs, without a model.

Given the greedy outputs of a model (or human answers), every verification
step's outcome is known in advance, so drafters and policies can be compared
in seconds: tokens per step, and the modelled speed-up sum(tokens)/sum(cost)
for a given cost curve.

    python benchmarks/experiments/simulate.py --targets /tmp/smollm2_outputs.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rag_accel.config import DecoderConfig
from rag_accel.drafters import build_drafters
from rag_accel.policy import AcceptanceStats, DraftLengthPolicy, leading_matches


def simulate(prompt: list[int], refs: list[list[int]], target: Sequence[int], cfg: DecoderConfig,
             curve: Sequence[float], stats: AcceptanceStats | None = None,
             prefill_units: float = 0.0) -> tuple[int, int, float]:
    """Returns (new tokens, steps incl. prefill, modelled cost in plain-step units, prefill counted as 1)."""
    context = list(prompt)
    chain = build_drafters(cfg, context, refs)
    policy = DraftLengthPolicy(curve, adaptive=cfg.adaptive, stats=stats)
    pos, steps, cost = 1, 1, 1.0
    context.append(target[0])
    new = [target[0]]
    candidates = []
    while pos < len(target):
        chain.update(context, len(new))
        for d in candidates:
            policy.observe(d, new)
        max_len = min(cfg.max_draft_tokens, len(target) - pos - 1)
        if policy.adaptive:
            candidates = chain.candidates(context, max_len)
        else:
            candidates = [d for d in [chain.propose(context, max_len)] if d.tokens]
        draft, n = policy.select(candidates, cfg.max_loss * (prefill_units + pos))
        sent = draft.tokens[:n]
        acc = leading_matches(sent, target[pos:])
        policy.record(n, acc)
        new = list(target[pos: pos + acc + 1])
        context.extend(new)
        pos += len(new)
        steps += 1
        cost += curve[n]
    return len(target), steps, cost


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", required=True, help="json list of {prompt, refs, target} token ids")
    p.add_argument("--prefill-per-token", type=float, default=0.04,
                   help="prefill cost per prompt token in plain-step units (SmolLM2 on 2 CPU cores: ~0.04)")
    p.add_argument("--target", default="target", choices=["target", "human"])
    p.add_argument("--curve", default=None, help="json list; default: the curve stored in the targets file")
    args = p.parse_args()
    data = json.load(open(args.targets))
    curve = json.loads(args.curve) if args.curve else data["cost_curve"]
    variants = {
        "adaptive chain": {},
        "fixed k=10 chain": {"adaptive": False, "max_draft_tokens": 10},
        "fixed k=20 ref n=1": {"adaptive": False, "max_draft_tokens": 20, "drafters": ("reference",)},
        "adaptive ref": {"drafters": ("reference",)},
        "adaptive pld": {"drafters": ("prompt_lookup",)},
        "adaptive ngram": {"drafters": ("ngram",)},
        "adaptive ref+pld": {"drafters": ("reference", "prompt_lookup")},
    }
    for name, changes in variants.items():
        cfg = DecoderConfig(max_draft_tokens=len(curve) - 1).replace(**changes)
        tot_t = tot_s = 0
        tot_c = tot_plain = tot_ours = 0.0
        worst_item = None
        worst = 9.0
        stats = AcceptanceStats()  # carried across items, as the decoder does
        for it in data["items"]:
            pre = args.prefill_per_token * len(it["prompt"])  # prefill, in plain-step units, for both sides
            t, s, c = simulate(it["prompt"], it["refs"], it[args.target], cfg, curve, stats, pre)
            tot_t += t; tot_s += s; tot_c += c
            tot_plain += t + pre; tot_ours += c + pre
            if (t + pre) / (c + pre) < worst:
                worst, worst_item = (t + pre) / (c + pre), (it["id"], t, s, round(c, 1))
        print(f"{name:22s} tokens/step {tot_t / tot_s:.2f}  decode speed-up {tot_t / tot_c:.2f}x  "
              f"with prefill {tot_plain / tot_ours:.2f}x  worst item {worst:.2f}x {worst_item}")


if __name__ == "__main__":
    main()
