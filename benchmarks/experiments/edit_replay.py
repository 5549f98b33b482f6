"""How far ahead of vLLM's n-gram speculation can any copier get on code edits? Replayed on the model's answers.

    python benchmarks/experiments/edit_replay.py --bench benchmarks/results/edits_cpu_qwen15_bf16.json \\
        --data ../shared/data/edits/edits_dev.jsonl --out benchmarks/results/edit_replay_qwen15_bf16

    python benchmarks/experiments/edit_replay.py --plot benchmarks/results/edit_replay_qwen15_bf16.json

(the first in the vLLM virtualenv: the n-gram rows call vLLM's own proposer function; the plot in one with
matplotlib). An edit bench's greedy answers
(``benchmarks/edit_bench.py``'s rows of its baseline method) fix what every draft gets accepted, as in
``rag_accel_lab.replay``; the items are rebuilt as the bench built them (same data, ``--items``, ``--max-chars``,
seed), the file before the edit as the prediction. At each draft length ``K`` (vLLM's ``num_speculative_tokens``):

* ``vllm-ngram``: vLLM's prompt lookup as the benchmarks configure it (``rag_accel.vllm.requests``: n-grams of 2 to
  4 tokens, the earliest occurrence of the longest), its function called on the prompt and the answer so far,
  ``K`` tokens sent whenever it matches;
* ``ours+prediction`` and ``ours`` (no prediction): the real drafting and cost-aware policy
  (``rag_accel_lab.replay.replay``, the vLLM proposer's default chain), the prediction as the reference;
* ``ceiling``: the copy oracle (``copy_ceiling``): each step the most tokens any copy of at most ``K`` tokens from
  the prediction, the prompt or the answer so far gets accepted. No drafter copying from those sources, ours
  included, takes fewer steps, so ``ceiling / vllm-ngram`` bounds what copying can gain over n-gram at that ``K``
  (and against n-gram at 10, what a longer draft can).

And modelled, the same answers held fixed: the file taken out of the prompt (the instruction alone), as where a
prediction comes from elsewhere (a cached answer, an earlier draft, a client's copy of the file the prompt does not
quote): what the prediction alone brings, which prompt-copying peers cannot see.

Costs: a verify of ``L`` draft tokens costs ``1 + slope L`` plain steps, at each of ``--slopes``. Tokens per step need
no cost model; the modelled speed-up of the decoding steps (geo-mean over the items) does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rag_accel.policy import leading_matches
from rag_accel_lab.replay import copy_ceiling, replay

EDIT_BENCH = Path(__file__).resolve().parents[1] / "edit_bench.py"  # the bench's items, drawn as it draws them

KS = (10, 16, 32)
# A draft token in plain steps: exact bf16 steps here (a 16-token verify 1.16x a step), vLLM float32 here.
SLOPES = (0.01, 0.025)


def vllm_ngram(context: Sequence[int], k: int) -> list[int]:
    """vLLM's n-gram draft after ``context`` (vLLM 0.32's own function, as its proposer calls it per request)."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose

    return propose(np.asarray(context, dtype=np.int32), 2, 4, 1 << 30, k).tolist()


def ngram_steps(prompt: Sequence[int], target: Sequence[int], k: int,
                propose: Callable[[Sequence[int], int], list[int]] = vllm_ngram) -> list[tuple[int, int]]:
    """Per decoding step after the first token, (draft tokens sent, accepted) by ``propose`` on ``target`` after
    ``prompt``: its draft of at most ``k`` tokens, cut before the answer's last token (the model's own ends it).

    Example:
        >>> ngram_steps([1, 2, 3], [1, 2, 3, 4, 5], 2, lambda ctx, k: [2, 3, 9][:k])
        [(2, 2), (0, 0)]
    """
    context, out = list(prompt) + [target[0]], []
    while (n := len(context) - len(prompt)) < len(target):
        draft = list(propose(context, k))[:k][:len(target) - 1 - n]
        got = leading_matches(draft, target[n:])
        out.append((len(draft), got))
        context.extend(target[n:n + got + 1])
    return out


def summarise(per_item: list[list[tuple[int, int]]], targets: list[Sequence[int]], slope: float) -> dict[str, float]:
    """tokens per step (the first token's step included), drafts sent per step, modelled speed-ups."""
    steps = sum(len(s) + 1 for s in per_item)
    speedups = [(len(t) - 1) / sum(1 + slope * sent for sent, _ in s) if s else 1.0 for s, t in zip(per_item, targets)]
    return {"tokens_per_step": sum(map(len, targets)) / steps,
            "sent_per_step": sum(sent for s in per_item for sent, _ in s) / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(x) for x in speedups)),
            "worst_item": min(speedups)}


def prepared_items(bench: dict, data: Path, n: int, max_chars: int) -> list[tuple]:
    from transformers import AutoTokenizer

    from rag_accel.inputs import encode_prompt
    from rag_accel.models import local_model

    spec = importlib.util.spec_from_file_location("edit_bench", EDIT_BENCH)
    edit_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edit_bench)
    edit_items = edit_bench.edit_items
    tokenizer = AutoTokenizer.from_pretrained(local_model(bench["model"]))
    answers = {r["item"]: r["token_ids"] for r in bench["rows"]
               if r["method"] == bench["baseline"] and r.get("level", 1) == 1}
    out, bare = [], []
    for it in edit_items(data, n, max_chars, tokenizer):
        if it["id"] in answers:
            prompt = encode_prompt(tokenizer, it["messages"], len(tokenizer))
            ref = tokenizer(it["prediction"], add_special_tokens=False)["input_ids"]
            out.append((it["id"], prompt, [ref], answers[it["id"]]))
            system, user = it["messages"]
            head = user["content"][:user["content"].index(it["prediction"])]  # the instruction, then the fence
            instruction = [system, {"role": "user", "content": head[:head.rindex("\n\n```")]}]
            bare.append((it["id"], encode_prompt(tokenizer, instruction, len(tokenizer)), [ref], answers[it["id"]]))
    return out, bare


def run(prepared: list[tuple], bare: list[tuple], ks: Sequence[int], slopes: Sequence[float]) -> dict[str, Any]:
    """Per ``K`` and slope, each drafting's tokens per step and modelled speed-up; ``bare``: the same items and
    answers with the file taken out of the prompt (the instruction alone), the prediction still sent."""
    targets = [t for *_, t in prepared]
    no_prediction = [(i, p, [], t) for i, p, _, t in prepared]
    chain = ("reference", "frequency")  # the vLLM proposer's default (rag_accel.config.DEFAULT_COPY_DRAFTERS)
    results: dict[str, Any] = {}
    for k in ks:
        ngram = [ngram_steps(p, t, k) for _, p, _, t in prepared]
        ceiling = [[(a, a) for a in steps] for steps in copy_ceiling(prepared, k)]
        ngram_bare = [ngram_steps(p, t, k) for _, p, _, t in bare]
        ceiling_bare = [[(a, a) for a in steps] for steps in copy_ceiling(bare, k)]
        for slope in slopes:
            curve = [1.0 + slope * n for n in range(k + 1)]
            results[f"K={k}, slope {slope}"] = {
                "vllm-ngram": summarise(ngram, targets, slope),
                "ours+prediction": replay(prepared, k, curve, drafters=chain),
                "ours": replay(no_prediction, k, curve, drafters=chain),
                "ceiling": summarise(ceiling, targets, slope),
                "vllm-ngram, file not in the prompt": summarise(ngram_bare, targets, slope),
                "ours+prediction, file not in the prompt": replay(bare, k, curve, drafters=chain),
                "ceiling, file not in the prompt": summarise(ceiling_bare, targets, slope)}
    return results


def markdown(run_: dict[str, Any]) -> str:
    lines = [f"# Copying on code edits replayed on {run_['items']} greedy answers (no timing)", "",
             f"- command: `{run_['command']}`",
             f"- date: {run_['date']}; no timing (steps counted on fixed answers): the machine's load does not enter",
             f"- answers: `{run_['bench']}` ({run_['model']}, {run_['dtype']}, {run_['baseline']}); items: "
             f"`{run_['data']}`, the file before the edit as the prediction",
             "- \"vs vllm-ngram\": against n-gram with the file in the prompt, as it runs; the rows \"file not in the "
             "prompt\" keep the same answers with the instruction alone as the prompt (modelled)", ""]
    for name, rows in run_["results"].items():
        base = rows["vllm-ngram"]
        lines += [f"{name} (a verify of L draft tokens costs 1 + slope L plain steps):", "",
                  "| drafting | tokens/step | draft tokens sent/step | modelled speed-up (geo-mean) | worst item | "
                  "vs vllm-ngram |", "|---|---|---|---|---|---|"]
        lines += [f"| {m} | {v['tokens_per_step']:.2f} | {v['sent_per_step']:.2f} | "
                  f"{v['modelled_speedup_decoding']:.2f}x | {v['worst_item']:.2f}x | "
                  f"{v['modelled_speedup_decoding'] / base['modelled_speedup_decoding']:.2f}x |"
                  for m, v in rows.items()]
        lines.append("")
    return "\n".join(lines)


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_ = json.loads(path.read_text())
    names = list(run_["results"])
    methods = list(run_["results"][names[0]])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar([i + j * width for i in range(len(names))],
               [run_["results"][n][m]["modelled_speedup_decoding"] for n in names], width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=7)
    ax.set_ylabel("modelled speed-up of the decoding steps")
    ax.legend(fontsize=8)
    ax.set_title(f"Copying on {run_['items']} code edits, replayed (no timing)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, help="an edit bench's JSON (its baseline's answers)")
    ap.add_argument("--data", type=Path, help="the bench's items file")
    ap.add_argument("--items", type=int, default=None, help="default: the bench's")
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--k", type=lambda s: tuple(int(x) for x in s.split(",")), default=KS)
    ap.add_argument("--slopes", type=lambda s: tuple(float(x) for x in s.split(",")), default=SLOPES)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if None in (args.bench, args.data, args.out):
        ap.error("--bench, --data and --out are needed (or --plot)")
    bench = json.loads(args.bench.read_text())
    n = (args.items or bench["items"]) + 1  # the bench loads one more, its warm-up item, which has no answer
    prepared, bare = prepared_items(bench, args.data, n, args.max_chars)
    command = "python benchmarks/experiments/edit_replay.py " + shlex.join(sys.argv[1:])
    run_ = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "bench": str(args.bench), "data": str(args.data), "model": bench["model"],
            "dtype": bench.get("info", {}).get("dtype", "?"), "baseline": bench["baseline"], "items": len(prepared),
            "item_ids": [i for i, *_ in prepared], "results": run(prepared, bare, args.k, args.slopes)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(run_, indent=1))
    args.out.with_suffix(".md").write_text(markdown(run_))
    print(markdown(run_))


if __name__ == "__main__":
    main()
