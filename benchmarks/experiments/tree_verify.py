"""Would verifying a tree of drafts (several candidates in one forward) pay on the transformers path on this CPU?

    python benchmarks/experiments/tree_verify.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --out benchmarks/results/tree_verify_smollm2_last100

Issue 29 asks it before anything is built. Two measurements answer it, with no tree code in the library:

1. What a forward over ``N`` new tokens costs on a cached prompt of ``--context`` tokens, relative to one token
   (the decoder's own forward, this machine's threads, the least disturbed of ``--repeats`` round-robin runs).
2. The model's greedy answers replayed (``--save-outputs`` of ``rag-accel bench --methods greedy`` wrote them):
   what each way of drafting gets accepted per step, and the decoding steps' modelled speed-up at the costs of
   part 1 (a step that verifies a tree of ``n`` draft tokens costs ``cost[n + 1]``).

   - our drafting: the real drafters and cost-aware policy (one chain a step, its length chosen by the costs);
   - chains of the longest match's continuation, ``K`` tokens (latest occurrence in the context, else the earliest
     in the references: the rule that did best in ``match_choice.py``, beside this script);
   - the best single chain of ``K`` tokens among all occurrences' continuations, chosen knowing the answer. No
     tree of ``K`` nodes over the same continuations accepts more: its accepted path is one of those chains;
   - trees of ``n`` nodes, as suffix decoding builds them: the continuations (up to ``K``) of every occurrence of
     the longest match, merged, nodes kept best-first by their share of the occurrences that pass through them.

Tune on the sample's first items, judge on its last ones.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rag_accel import ReferenceDecoder
from rag_accel_lab.replay import continuation, cost_of, forward_costs, occurrences, replay
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.kernels import concat_with_separators

def found_at(ref: np.ndarray, ctx: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """Every match of the context's tail with a continuation: (length, in the context?, position, source)."""
    return [(length, 0, p, ref) for length, p in occurrences(ref, ctx)] + \
           [(length, 1, p, ctx) for length, p in occurrences(ctx, ctx)]


def rule_chain(found: list, k: int) -> set[tuple[int, ...]]:
    """The longest match's continuation: latest in the context, else earliest in the references."""
    if not found:
        return set()
    _, _, p, src = max(found, key=lambda f: (f[0], f[1], f[2] if f[1] else -f[2]))
    return prefixes(continuation(src, p)[:k])


def oracle_chain(found: list, k: int, truth: Sequence[int]) -> set[tuple[int, ...]]:
    """The continuation (of any match) with the most tokens right: a bound for any tree of ``k`` nodes over them."""
    best, best_right = set(), -1
    for _, _, p, src in found:
        chain = prefixes(continuation(src, p)[:k])
        right = accepted(chain, truth)
        if right > best_right:
            best, best_right = chain, right
    return best


def frequency_tree(found: list, nodes: int, k: int) -> set[tuple[int, ...]]:
    """The continuations of the longest match's occurrences merged; ``nodes`` kept best-first by the share of
    occurrences through them (suffix decoding's scoring)."""
    if not found:
        return set()
    longest = max(f[0] for f in found)
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for length, _, p, src in found:
        if length == longest:
            for prefix in prefixes(continuation(src, p)[:k]):
                counts[prefix] += 1
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    for node in counts:
        children[node[:-1]].append(node)
    total = sum(counts[c] for c in children[()])
    heap = [(-counts[c] / total, c) for c in children[()]]
    heapq.heapify(heap)
    kept: set[tuple[int, ...]] = set()
    while heap and len(kept) < nodes:
        score, node = heapq.heappop(heap)
        kept.add(node)
        for c in children[node]:
            heapq.heappush(heap, (score * counts[c] / counts[node], c))
    return kept


def prefixes(tokens: Sequence[int]) -> set[tuple[int, ...]]:
    t = tuple(int(x) for x in tokens)
    return {t[:i + 1] for i in range(len(t))}


def accepted(tree: set[tuple[int, ...]], truth: Sequence[int]) -> int:
    """How deep the tree follows ``truth`` from its root."""
    n = 0
    while n < len(truth) and tuple(truth[:n + 1]) in tree:
        n += 1
    return n


def replay_trees(prepared: Sequence[tuple], draft: Callable[[list, Sequence[int]], set],
                 costs: dict[int, float]) -> dict[str, float]:
    """Tokens per step (the prefill's included, as in ``match_choice.replay``), draft tokens verified per step and
    the decoding steps' modelled speed-up (geo-mean over items) of ``draft(found, truth) -> tree``."""
    tokens = steps = nodes = 0
    speedups = []
    for _, prompt, refs, target in prepared:
        ref = concat_with_separators(refs)
        n, cost = 1, 0.0
        steps += 1
        while n < len(target):
            ctx = np.asarray(list(prompt) + list(target[:n]), dtype=np.int64)
            tree = draft(found_at(ref, ctx), target[n:])
            n += min(accepted(tree, target[n:]) + 1, len(target) - n)
            cost += cost_of(costs, len(tree) + 1)
            steps += 1
            nodes += len(tree)
        tokens += len(target)
        speedups.append((len(target) - 1) / cost)
    return {"tokens_per_step": tokens / steps, "draft_tokens_per_step": nodes / (steps - len(prepared)),
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path)
    ap.add_argument("--render", type=Path, help="only write the markdown of this run's JSON")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tree_verify"))
    ap.add_argument("--context", type=int, default=800, help="cached tokens under the timed forwards (~a prompt)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.render:
        render(json.loads(args.render.read_text()), args.render)
        return
    if args.outputs is None:
        ap.error("--outputs is required (or --render)")
    saved = json.loads(args.outputs.read_text())
    dec = ReferenceDecoder.from_pretrained(saved.get("model", "smollm2-135m-instruct"), calibrate=False)
    load_before = os.getloadavg()
    costs = forward_costs(dec, args.context, args.repeats)
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    prepared = [(item_id, dec.encode_prompt(rag_messages(items[item_id].query, items[item_id].passages)),
                 dec.encode_references(list(items[item_id].passages)), target)
                for item_id, target in saved["outputs"].items()]
    curve = [cost_of(costs, n + 1) for n in range(11)]
    rows = {"our drafting (a chain, the cost-aware policy at these costs), K=10": replay(prepared, 10, curve)}
    for k in (3, 7, 10):
        rows[f"longest match's chain, K={k}"] = replay_trees(prepared, lambda f, t, k=k: rule_chain(f, k), costs)
    for k in (7, 10):
        rows[f"best chain knowing the answer, K={k} (bound for trees of {k} nodes)"] = replay_trees(
            prepared, lambda f, t, k=k: oracle_chain(f, k, t), costs)
    for n in (3, 7, 15):
        rows[f"frequency tree, {n} nodes, depth <= 10"] = replay_trees(
            prepared, lambda f, t, n=n: frequency_tree(f, n, 10), costs)
    load_after = os.getloadavg()
    command = f"python benchmarks/experiments/tree_verify.py --outputs {args.outputs} --out {args.out}"
    data = {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads", "model": saved.get("model", "smollm2-135m-instruct"),
            "items": len(prepared), "context": args.context, "repeats": args.repeats,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after],
            "forward_cost": costs, "replays": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    render(data, args.out)


def render(data: dict, out: Path) -> None:
    """The markdown of a run, from its JSON (``--render``)."""
    costs = data["forward_cost"]
    lines = [f"# Trees of drafts on the transformers path: {data['model']} float32, {data['items']} items' greedy "
             f"answers replayed, {data['date']}", "",
             f"- command: `{data['command']}`", f"- machine: {data['machine']}; load (1/5/15 min) before "
             f"{data['load_before']}, after {data['load_after']}", "",
             f"A forward over N tokens on a cached {data['context']}-token prompt, relative to one token (least "
             f"disturbed of {data['repeats']} round-robin runs):", "",
             "| N | " + " | ".join(str(n) for n in costs) + " |", "|---|" + "---|" * len(costs),
             "| cost | " + " | ".join(f"{c:.2f}" for c in costs.values()) + " |", "",
             "The answers replayed, a step verifying n draft tokens costing the forward over n + 1:", "",
             "| drafting | tokens/step | draft tokens verified a step | modelled speed-up of the decoding steps "
             "(geo-mean) |", "|---|---|---|---|"]
    for name, r in data["replays"].items():
        sent = f"{r['draft_tokens_per_step']:.2f}" if "draft_tokens_per_step" in r else "-"
        lines.append(f"| {name} | {r['tokens_per_step']:.3f} | {sent} | {r['modelled_speedup_decoding']:.3f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
