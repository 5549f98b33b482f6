"""What an oracle could reach on a model's own answers: copying, a draft model, or both, at measured step costs.

    python benchmarks/experiments/ceilings.py --model qwen2.5-coder-1.5b-instruct \\
        --outputs benchmarks/results/greedy_outputs_qwen15_last16x64.json --draft-model qwen2.5-coder-0.5b-instruct \\
        --costs benchmarks/results/verify_costs_cpu.json --out benchmarks/results/ceilings_qwen15_last16x64

The answers fix every step's outcome. At each position of an answer the oracle knows (1) the most tokens a copy
from the references, the prompt or the answer so far gets accepted (:func:`rag_accel_lab.replay.longest_copy`,
from any match of 1 token or more: a bound on every copy drafter), and (2) the most a greedy draft of the draft
model gets accepted (its argmax over the true context, one teacher-forced forward per item, agrees with the
answer that many positions in a row). A shortest-path over the positions then picks, step by step, a plain
step, a copy of ``L`` tokens or a draft of ``L`` tokens, at what the verify-costs run measured on this machine:
a forward over ``1 + L`` tokens of the target; for a draft, ``L + 1`` one-token forwards of the draft model
(its catch-up on the step before, then its tokens), and once per answer the draft model's prefill of the
prompt (its cache must hold the context before its first draft). No drafter can do better than this oracle on
these answers at these costs: it is the ceiling of the drafting, the prefill included (the same for every
method). The oracle's steps cost what our decoder's do (the planned projections; in bf16 and fp16, where the
decoder runs exact steps by default and the costs run measured them, exact steps); it is set against greedy
at our decoder's plain steps (``planned`` or ``exact``: drafting off, what drafting alone can add) and at
``model.generate``'s (``library``: what a user compares with), per dtype of the costs run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rag_accel import ReferenceDecoder
from rag_accel_lab.replay import longest_copy, prepare
from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.kernels import concat_with_separators

K = 32


def copy_lengths(prompt: list[int], refs: list[list[int]], target: list[int], k: int = K) -> list[int]:
    """``c[n]``: the most of ``target[n:]`` (all but its last token) a copy accepts after ``target[:n]``."""
    source = concat_with_separators(refs)
    out = [0]
    for n in range(1, len(target)):
        ctx = np.asarray(prompt + target[:n], dtype=np.int64)
        truth = target[n:len(target) - 1]
        out.append(max(longest_copy(source, ctx, truth, k), longest_copy(ctx, ctx, truth, k)) if truth else 0)
    return out


def model_lengths(draft: ReferenceDecoder, prompt: list[int], target: list[int], k: int = K) -> list[int]:
    """``m[n]``: the most of ``target[n:]`` a greedy draft of ``draft`` accepts after ``target[:n]``."""
    ids = torch.tensor([prompt + target])
    with torch.inference_mode():
        logits = draft.model(input_ids=ids).logits[0]
    pred = logits[len(prompt) - 1:-1].argmax(-1).tolist()  # pred[j]: its token after prompt + target[:j]
    right = [p == t for p, t in zip(pred, target)]
    out = []
    for n in range(len(target)):
        run = 0
        while n + run < len(target) - 1 and run < k and right[n + run]:
            run += 1
        out.append(run)
    return out


def oracle_ms(copy: list[int], model: list[int] | None, verify_ms, draft_ms: float, draft_prefill_ms: float) -> float:
    """The least decoding time (after the prefill's first token) over plain, copy and draft steps."""
    t = len(copy)
    best = [math.inf] * (t + 1)
    best[1] = 0.0
    for n in range(1, t):
        if best[n] == math.inf:
            continue
        options = [(1, verify_ms(0))]
        options += [(1 + L, verify_ms(L)) for L in range(1, copy[n] + 1)]
        if model is not None:
            options += [(1 + L, verify_ms(L) + (L + 1) * draft_ms) for L in range(1, model[n] + 1)]
        for step, cost in options:
            if n + step <= t:
                best[n + step] = min(best[n + step], best[n] + cost)
    return best[t] + (draft_prefill_ms if model is not None and any(model[1:]) else 0.0)


def interpolate(ms: dict[str, float], n: int) -> float:
    """A forward over ``n`` tokens, linear between measured sizes (past the last: its slope)."""
    sizes = sorted(int(s) for s in ms)
    lo = max((s for s in sizes if s <= n), default=sizes[0])
    hi = min((s for s in sizes if s >= n), default=sizes[-1])
    if lo == hi:
        return ms[str(lo)] * (n / lo if n > lo else 1.0)
    return ms[str(lo)] + (ms[str(hi)] - ms[str(lo)]) * (n - lo) / (hi - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--outputs", required=True, help="the model's greedy answers (rag-accel bench --save-outputs)")
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--costs", required=True, help="a verify_costs.py JSON holding both models")
    ap.add_argument("--out", required=True, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    costs = json.loads(Path(args.costs).read_text())
    dtypes = sorted({r["dtype"] for r in costs["runs"] if r["model"] == args.model})
    run_of = {(r["model"], r["dtype"]): r for r in costs["runs"]}
    from transformers import AutoTokenizer

    from rag_accel.models import local_model

    draft = ReferenceDecoder.from_pretrained(args.draft_model, calibrate=False)
    if AutoTokenizer.from_pretrained(local_model(args.model)).get_vocab() != draft.tokenizer.get_vocab():
        raise SystemExit("the draft model must share the model's tokenizer (its drafts are verified token by token)")
    items = {it.id: it for it in load_msmarco_sample()}
    prepared = prepare(Path(args.outputs), draft, items)  # (the same tokenizer: the same prompt ids)
    per_item = []
    for item_id, prompt, refs, target in prepared:
        per_item.append({"item": item_id, "prompt_tokens": len(prompt), "tokens": len(target),
                         "copy": copy_lengths(list(prompt), refs, list(target)),
                         "model": model_lengths(draft, list(prompt), list(target))})
    del draft
    results = {}
    for dtype in dtypes:
        tgt, dft = run_of[(args.model, dtype)], run_of[(args.draft_model, dtype)]
        prefill_scale = 1.0 / costs["context"]  # the prefills were measured on the costs run's context
        arms = {}
        # our decoder's forwards: exact steps where it runs them by default (bf16, fp16 on a CPU), else planned
        ours_arm = "exact" if dtype in ("bfloat16", "float16") and "exact" in tgt["ms"] else "planned"

        def verify(L: int, ms: dict[str, float] = tgt["ms"][ours_arm]) -> float:
            return interpolate(ms, L + 1)

        for arm in (ours_arm, "library"):
            plain, draft_ms = tgt["ms"][arm]["1"], dft["ms"]["planned"]["1"]
            ratios: dict[str, list[float]] = {"copy": [], "model": [], "copy + model": [], "copy + model, no prefill": []}
            for it in per_item:
                prefill = tgt["prefill_ms"] * it["prompt_tokens"] * prefill_scale
                draft_prefill = dft["prefill_ms"] * it["prompt_tokens"] * prefill_scale
                greedy = prefill + (it["tokens"] - 1) * plain
                only_model = [0] * len(it["copy"])
                for name, (c, m, dp) in {"copy": (it["copy"], None, 0.0),
                                         "model": (only_model, it["model"], draft_prefill),
                                         "copy + model": (it["copy"], it["model"], draft_prefill),
                                         "copy + model, no prefill": (it["copy"], it["model"], 0.0)}.items():
                    ours = prefill + min(oracle_ms(c, m, verify, draft_ms, dp), oracle_ms(c, None, verify, draft_ms, dp))
                    ratios[name].append(greedy / ours)
            arms[arm] = {name: {"geo_mean": round(math.exp(statistics.fmean(map(math.log, r))), 3),
                                "worst": round(min(r), 3), "best": round(max(r), 3)} for name, r in ratios.items()}
            arms[arm]["plain_ms"], arms[arm]["draft_token_ms"] = round(plain, 1), draft_ms
        results[dtype] = arms
    tokens = sum(it["tokens"] for it in per_item)

    def steps(key: str) -> float:  # tokens per step of the greedy oracle that takes the longest accepted draft
        n_steps = 0
        for it in per_item:
            n = 1
            while n < it["tokens"]:
                n += 1 + it[key][n]
                n_steps += 1
        return round((tokens - len(per_item)) / n_steps, 2)

    env = {"date": datetime.now(timezone.utc).date().isoformat(), "machine": platform.machine(),
           "torch": torch.__version__, "load_before": load_before,
           "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    command = (f"python benchmarks/experiments/ceilings.py --model {args.model} --outputs {args.outputs} "
               f"--draft-model {args.draft_model} --costs {args.costs} --out {args.out}")
    data = {"environment": env, "command": command, "k": K, "results": results,
            "longest_steps": {"copy": steps("copy"), "model": steps("model")}, "items": per_item}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    lines = [f"# Ceilings: {args.model} on its own {len(per_item)} answers ({tokens} tokens), draft model "
             f"{args.draft_model}, {env['date']}", "", f"- command: `{command}`",
             f"- costs: {args.costs} (this CPU); machine load before {load_before}, after {env['load_after']}",
             f"- tokens per decoding step when every step takes the longest accepted draft of at most {K}: copying "
             f"{data['longest_steps']['copy']}, the draft model {data['longest_steps']['model']}", "",
             "| dtype | greedy's plain steps | plain step (ms) | draft token (ms) | copy | draft model | copy + draft model "
             "| the same, the draft model's prefill free |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype, arms in results.items():
        for arm, r in arms.items():
            lines.append(f"| {dtype} | {arm} | {r['plain_ms']} | {r['draft_token_ms']} | " + " | ".join(
                f"{r[k]['geo_mean']:.2f}x ({r[k]['worst']:.2f}x)"
                for k in ("copy", "model", "copy + model", "copy + model, no prefill")) + " |")
    lines += ["", "Speed-ups end to end (the target's prefill included), the oracle's steps at our decoder's costs, over "
              "greedy decoding: geo-mean (worst item). Greedy at `planned` steps: our decoder with drafting off "
              "(hf/linears.py); at `exact` steps: the same with exact steps (bf16, fp16: the oracle's steps are "
              "exact ones too); at `library` steps: `model.generate`'s."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
