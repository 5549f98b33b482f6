"""vLLM's suffix decoding against our drafting, replayed on the model's greedy answers (no timing).

    python benchmarks/experiments/suffix_replay.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --out benchmarks/results/suffix_replay_smollm2_last100
    python benchmarks/experiments/suffix_replay.py --plot benchmarks/results/suffix_replay_smollm2_last100.json
    python benchmarks/experiments/suffix_replay.py --measured benchmarks/results/gpu_step_costs_h200.json \\
        --out benchmarks/results/suffix_replay_smollm2_last100_h200

(the first in the vLLM virtualenv with arctic-inference installed, the second in one with matplotlib). The
model's greedy answers are known (``--save-outputs`` of ``rag-accel bench --methods greedy``), so what each
draft gets accepted is too: every step sends a draft, keeps its tokens up to the first wrong one plus the
model's own next token, and costs ``curve[L]`` plain steps for ``L`` draft tokens. Items in the file's order,
one engine learning across them, as in the vLLM benchmarks' per-request loop:

* ours: :class:`rag_accel.speculation.RequestDrafting` (the drafter chain and the cost-aware policy,
  ``rag_accel_lab.replay.replay``): the chain before the frequency drafter (reference, prompt lookup,
  n-grams) and the default chain (references, the frequency drafter), each with the memory of earlier answers (``vllm-ours-memory``: one
  scope) or without, or with arctic-inference's frequency tree of earlier answers in the memory's place;
  and our policy over arctic-inference's per-request tree alone (:class:`RequestTreeDrafter`), which asks
  whether our policy or suffix decoding's own rule sends the better share of the same drafts;
* what our choice of draft lengths leaves: the default chain's drafts, each sent at just the length that
  gets accepted (an oracle; the drafts, and so the tokens per step, are ours);
* the ceiling of copying (``rag_accel_lab.replay.copy_ceiling``): an oracle that knows the answer takes, each step,
  the most tokens any copy of at most ``K`` tokens after a match in the references, the prompt or the answer so
  far (and, in its second row, earlier answers) gets accepted, and sends just those: no drafter that copies from
  those sources takes fewer steps; then the same after matches of at least 2 tokens only (a 1-token match,
  where the last token occurs in many places, leaves the oracle a choice no drafter can make without the
  answer);
* suffix decoding: arctic-inference's ``SuffixDecodingCache`` called as vLLM's suffix proposer calls it (a
  tree of the prompt and the answer so far, a global tree of earlier answers, the pattern the context's last
  ``max_tree_depth`` tokens), vLLM's defaults but 10 tokens as in the benchmarks; also without the global tree,
  and at ``max_spec_factor`` 2 and 3 (a draft at most that many times its match long).

Run it on the sample's first 50 answers too (``greedy_outputs_smollm2_first50x64.json``): a setting chosen
from these rows is chosen there and judged on the last 100.

Three cost curves: this CPU's (a draft token costs 0.025 of a step, vLLM at one request in flight), four
times dearer (0.1: a busy batch) and nearly free draft tokens (0.002), where sending more pays: the question
there is who gets the most tokens per step. ``--measured``: instead, one row's step times measured on a GPU
(``benchmarks/experiments/gpu_step_costs.py``'s CUDA-graph steps, one curve per model shape), where the first draft tokens
of a step cost most.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_accel_lab.replay import (
    MAX_TREE_DEPTH,
    MIN_TOKEN_PROB,
    FrequencyTreeMemory,
    TableCost,
    copy_ceiling,
    prepare,
    replay,
)
from rag_accel.config import DEFAULT_COPY_DRAFTERS

K = 10
# What a draft token costs in plain steps: this CPU at one request in flight; four times that (a busy batch,
# where a row's draft tokens compete with other rows' for compute); nearly free (a GPU at one request).
SLOPES = {"cpu": 0.025, "4x dearer": 0.1, "nearly free": 0.002}


class OneScopeMemory:
    """Our :class:`~rag_accel.memory.AnswerMemory`, every answer in one scope (``vllm-ours-memory``)."""

    def __init__(self) -> None:
        from rag_accel.memory import AnswerMemory

        self.memory = AnswerMemory()

    def drafter(self, item_id: str) -> Any:
        return self.memory.drafter("all")

    def add(self, item_id: str, answer: Sequence[int]) -> None:
        self.memory.add("all", list(answer))


class RequestTreeDrafter:
    """arctic-inference's per-request suffix tree (the prompt and the answer so far) as a drafter in our chain:
    the continuation of the longest match most occurrences share, at most ``factor`` times the match long,
    stopping where a branch falls under ``min_token_prob``; our policy then picks whether and how much to send."""

    name = "suffix_tree"
    _ids = 0

    def __init__(self, prompt: Sequence[int], factor: float) -> None:
        import numpy as np
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        RequestTreeDrafter._ids += 1
        self.request, self.factor = f"r{RequestTreeDrafter._ids}", factor
        self.cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=0)
        self.cache.start_request(self.request, np.asarray(prompt, dtype=np.int32))
        self.seen = len(prompt)

    def update(self, context: Sequence[int], num_new: int) -> None:
        if len(context) > self.seen:
            self.cache.add_active_response(self.request, list(context[self.seen:]))
            self.seen = len(context)

    def propose(self, context: Sequence[int], max_len: int) -> Any:
        import numpy as np

        from rag_accel.drafters import NO_DRAFT, Draft

        self.update(context, 0)
        found = self.cache.speculate(self.request, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                     max_spec_tokens=max_len, max_spec_factor=self.factor,
                                     min_token_prob=MIN_TOKEN_PROB)
        return Draft(list(found.token_ids), int(found.match_len), self.name) if found.token_ids else NO_DRAFT


def suffix_replay(prepared: Sequence[tuple], curve: Sequence[float], *, factor: float = 1.0,
                  global_tree: bool = True) -> dict[str, float]:
    """Suffix decoding as vLLM's ``SuffixDecodingProposer`` drives it, on the known answers."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from rag_accel.policy import leading_matches

    cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=10_000 if global_tree else 0)
    tokens = steps = sent_tokens = 0
    speedups = []
    for item_id, prompt, _, target in prepared:
        cache.start_request(item_id, np.asarray(prompt, dtype=np.int32))
        context = list(prompt) + [target[0]]
        cache.add_active_response(item_id, [target[0]])
        cost, n_steps = 0.0, 1
        while (n := len(context) - len(prompt)) < len(target):
            found = cache.speculate(item_id, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                    max_spec_tokens=K, max_spec_factor=factor, min_token_prob=MIN_TOKEN_PROB)
            sent = list(found.token_ids)
            accepted = leading_matches(sent, target[n:n + len(sent) + 1])
            new = sent[:accepted] + target[n + accepted:n + accepted + 1]
            cache.add_active_response(item_id, new)
            cost += curve[len(sent)]
            n_steps += 1
            sent_tokens += len(sent)
            context.extend(new)
        cache.stop_request(item_id)
        tokens += len(target)
        steps += n_steps
        speedups.append((len(target) - 1) / cost)
    return {"tokens_per_step": tokens / steps, "sent_per_step": sent_tokens / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups))}


def _ours(memory: Any = None, tree_factor: float | None = None,
          drafters: Sequence[str] = ("reference", "prompt_lookup", "ngram"), exact_lengths: bool = False):
    def run(prepared: Sequence[tuple], curve: Sequence[float]) -> dict[str, float]:
        make_chain = None if tree_factor is None else (
            lambda prompt, refs, chain: [RequestTreeDrafter(prompt, tree_factor)])
        return replay(prepared, K, curve, memory=memory() if memory else None, make_chain=make_chain,
                      drafters=drafters, exact_lengths=exact_lengths)
    return run


def _suffix(factor: float, global_tree: bool = True):
    return lambda prepared, curve: suffix_replay(prepared, curve, factor=factor, global_tree=global_tree)


def _ceiling(earlier_answers: bool, min_match: int = 1):
    """:func:`rag_accel_lab.replay.copy_ceiling`: the oracle's steps do not depend on the cost curve, so they are found once."""
    found: dict[tuple, list[list[int]]] = {}

    def run(prepared: Sequence[tuple], curve: Sequence[float]) -> dict[str, float]:
        if (key := (id(prepared), K)) not in found:
            found[key] = copy_ceiling(prepared, K, earlier_answers, min_match)
        steps = found[key]
        speedups = [(len(target) - 1) / sum(curve[a] for a in got) if got else 1.0
                    for (*_, target), got in zip(prepared, steps)]
        n_steps = sum(1 + len(got) for got in steps)
        return {"tokens_per_step": sum(len(item[3]) for item in prepared) / n_steps,
                "sent_per_step": sum(map(sum, steps)) / n_steps,
                "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups))}
    return run


# name -> run(prepared answers, cost curve). "ours": the chain before the frequency drafter (reference, prompt
# lookup, n-grams), as the first runs of this benchmark had it; "ours, the default chain": references, frequency.
CONFIGS = {
    "ours": _ours(),
    "ours + memory of earlier answers": _ours(OneScopeMemory),
    "ours, the default chain (references, frequency drafter)": _ours(drafters=DEFAULT_COPY_DRAFTERS),
    "the default chain + memory of earlier answers": _ours(OneScopeMemory, drafters=DEFAULT_COPY_DRAFTERS),
    "ours + arctic's frequency tree of earlier answers": _ours(lambda: FrequencyTreeMemory(factor=float(K))),
    "our policy over arctic's per-request tree (factor 3), no other drafter": _ours(tree_factor=3.0),
    "the same + memory of earlier answers": _ours(OneScopeMemory, tree_factor=3.0),
    "suffix decoding (vLLM's defaults)": _suffix(1.0),
    "suffix decoding without its tree of earlier answers": _suffix(1.0, global_tree=False),
    "suffix decoding without its tree of earlier answers, max_spec_factor 3": _suffix(3.0, global_tree=False),
    "suffix decoding, max_spec_factor 2": _suffix(2.0),
    "suffix decoding, max_spec_factor 3": _suffix(3.0),
    "the default chain, each draft sent at just its accepted length (an oracle)":
        _ours(drafters=DEFAULT_COPY_DRAFTERS, exact_lengths=True),
    "the default chain + memory, each draft sent at just its accepted length (an oracle)":
        _ours(OneScopeMemory, drafters=DEFAULT_COPY_DRAFTERS, exact_lengths=True),
    "ceiling: an oracle copying from the best place (references, prompt, answer so far)": _ceiling(False),
    "ceiling: the same, earlier answers too": _ceiling(True),
    "ceiling: the oracle after matches of 2+ tokens only": _ceiling(False, 2),
    "ceiling: the oracle after matches of 2+ tokens only, earlier answers too": _ceiling(True, 2),
}


def measured_curves(path: Path) -> dict[str, list[float]]:
    """One row's measured step time for ``L`` = 0..K draft tokens over a plain step's, per model shape."""
    data = json.loads(path.read_text())
    curves = {}
    for run in data["runs"]:
        table = TableCost(run["modes"]["graph"]["shapes"])
        curves[f"{data['device']}, {run['model']} {run['dtype']}"] = [table(1, 1 + n) for n in range(K + 1)]
    return curves


def plot(path: Path) -> None:
    """Tokens per step and the modelled speed-up of each configuration, per cost curve, next to the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5), sharey=True)
    for ax, metric, label in zip(axes, ("tokens_per_step", "modelled_speedup_decoding"),
                                 ("tokens per verification step", "modelled speed-up of the decoding steps")):
        names = list(run["results"][next(iter(run["results"]))])
        height = 0.8 / len(run["results"])
        for i, curve in enumerate(run["results"]):
            values = [run["results"][curve][n][metric] for n in names]
            ax.barh([y + height * i for y in range(len(names))], values, height=height,
                    label=f"{curve} draft tokens ({run['slopes'][curve]} of a step each)" if "slopes" in run else
                    f"{curve}, measured")
        ax.set_yticks([y + 0.4 - height / 2 for y in range(len(names))], names, fontsize=8)
        ax.set_xlabel(label)
        ax.set_xlim(1.0, None)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(3, len(labels)))
    fig.suptitle(f"Suffix decoding and ours replayed on {run['items']} greedy answers (no timing)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03 * (1 + (len(labels) - 1) // 3) + 0.03, 1, 1))
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    global K  # --k: read by every configuration's run (one run per process)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=Path("benchmarks/results/greedy_outputs_smollm2_last100x64.json"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/suffix_replay"))
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    ap.add_argument("--k", type=int, default=K, help="at most this many draft tokens a step, for every configuration")
    ap.add_argument("--measured", type=Path, default=None, metavar="JSON",
                    help="cost curves: one row's CUDA-graph steps of benchmarks/experiments/gpu_step_costs.py's run")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    K = args.k
    from rag_accel import ReferenceDecoder
    from rag_accel.rag.msmarco import load_msmarco_sample

    model = json.loads(args.outputs.read_text()).get("model", "smollm2-135m-instruct")
    dec = ReferenceDecoder.from_pretrained(model, calibrate=False)
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    prepared = prepare(args.outputs, dec, items)
    curves = measured_curves(args.measured) if args.measured is not None else {
        curve: [1.0 + slope * n for n in range(K + 1)] for curve, slope in SLOPES.items()}
    results = {curve: {name: run(prepared, costs) for name, run in CONFIGS.items()} for curve, costs in curves.items()}
    command = f"python benchmarks/experiments/suffix_replay.py --outputs {args.outputs} --out {args.out}" + (
        f" --measured {args.measured}" if args.measured is not None else "") + (f" --k {K}" if K != 10 else "")
    from importlib.metadata import version

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "items": len(prepared), "k": K, "curves": curves,
         **({"slopes": SLOPES} if args.measured is None else {"measured": str(args.measured)}),
         "arctic_inference": version("arctic-inference"), "results": results}, indent=1))
    lines = [f"# vLLM's suffix decoding and our drafting replayed on {len(prepared)} greedy answers (no timing)", "",
             f"- command: `{command}`; the plot: `python benchmarks/experiments/suffix_replay.py --plot {args.out}.json`",
             f"- answers: `{args.outputs}` (SmolLM2-135M-Instruct float32, greedy); at most {K} draft tokens a step; "
             f"suffix decoding: arctic-inference, max_tree_depth {MAX_TREE_DEPTH}, min_token_prob {MIN_TOKEN_PROB}",
             ""]
    for curve, costs in curves.items():
        said = (f"1 + {SLOPES[curve]} L plain steps ({curve} draft tokens)" if args.measured is None else
                f"what one row's step of {curve} cost ({', '.join(f'{c:.2f}' for c in costs)} plain steps for L = "
                f"0..{K})")
        lines += [f"A verify of L draft tokens costing {said}:", "",
                  "| configuration | tokens/step | draft tokens sent/step | modelled speed-up of the decoding steps "
                  "(geo-mean) |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['tokens_per_step']:.3f} | {v['sent_per_step']:.2f} | "
                  f"{v['modelled_speedup_decoding']:.3f}x |" for name, v in results[curve].items()]
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
