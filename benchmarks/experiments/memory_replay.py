"""The memory of earlier answers against vLLM's suffix decoding, replayed on the model's greedy answers (no timing).

    python benchmarks/experiments/memory_replay.py --generate benchmarks/results/greedy_outputs_smollm2_reworded_last100x128.json
    python benchmarks/experiments/memory_replay.py --outputs benchmarks/results/greedy_outputs_smollm2_reworded_last100x128.json \\
        --out benchmarks/results/memory_replay_smollm2_last100
    python benchmarks/experiments/memory_replay.py --plot benchmarks/results/memory_replay_smollm2_last100.json

(the first two in the vLLM virtualenv, arctic-inference installed for suffix decoding, the third in one with
matplotlib; ``--generate`` takes ``--first N`` for the sample's first items, the ones defaults are chosen on).
``--generate`` saves vLLM greedy's answers
(float32, all prompts in one batch) to each item's question and to the same question reworded
(:data:`rag_accel.bench.harness.REWORDED`, the cached-answer case of ``rag-accel bench --reworded``). The replay
then knows what every draft gets accepted: each step keeps the draft's tokens up to the first wrong one plus the
model's own next token, and costs ``CURVE[L]`` plain steps for ``L`` draft tokens. One engine learning across the
items in order, as vLLM's per-request loop: first every original question (``rag``: the memory holds the answers
of the items before), then every reworded one (``reworded``: the memory holds every original answer; suffix
decoding's tree of earlier answers too):

* suffix decoding: arctic-inference called as vLLM's suffix proposer calls it (``suffix_replay.py``);
* ours: :class:`rag_accel.speculation.RequestDrafting` with the default chain (references, frequency drafter),
  without a memory; with the memory of answers this project shipped before (the latest answer continuing
  the longest 2-4-token n-gram); with :class:`rag_accel.memory.AnswerMemory` as it is (suffix decoding's
  counts over the answers, factor 3); the same with its factor priced as the frequency drafter's; and with
  arctic-inference's tree of earlier answers, its probabilities included, in the memory's place;
* ours with the cached answer passed by the client (a reference: ``vllm-ours`` in the reworded case), alone
  and with the memory;
* each of ours with the references' drafter choosing by counts (``reference_choice="counts"``: suffix
  decoding's choice over the references) instead of LLMA's longest match (the default).

The cost curve is vLLM's on this project's 2-core CPU at one request in flight (SmolLM2-135M float32;
``benchmarks/experiments/step_costs.py``): a first draft token costs 0.08 of a step, the next ones ~0.03, with a step up
at 6 draft tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rag_accel_lab.replay import (
    MAX_TREE_DEPTH,
    MIN_TOKEN_PROB,
    FrequencyTreeDrafter,
    FrequencyTreeMemory,
    replay_request,
)
from rag_accel.drafters import NO_DRAFT, Draft, FrequencyDrafter, MemoryDrafter, _SpanCopier
from rag_accel.kernels import SEPARATOR, CountedSuffixes, concat_with_separators, counted_draft

K = 10
# vLLM at one request in flight on the 2-core CPU (benchmarks/results/step_costs_vllm_cpu_smollm2.md): a step
# with L draft tokens over a plain one, forward, sampling and the engine's own work included.
CURVE = (1.0, 1.079, 1.119, 1.125, 1.172, 1.192, 1.316, 1.329, 1.344, 1.373, 1.432)


class NgramMemory:
    """The memory of answers before suffix decoding's counts: the latest answer continuing the longest
    2-4-token n-gram of the context's tail, its span followed while the model accepts it."""

    def __init__(self) -> None:
        from rag_accel.kernels import NgramIndex

        self.tokens: list[int] = []
        self.index = NgramIndex(2, 4)

    def drafter(self, item_id: str) -> Any:
        return _NgramMemoryDrafter(self) if self.tokens else None

    def add(self, item_id: str, answer: Sequence[int]) -> None:
        from rag_accel.kernels import SEPARATOR

        self.tokens.extend(([SEPARATOR] if self.tokens else []) + list(answer))
        self.index.extend(self.tokens)


class _NgramMemoryDrafter(_SpanCopier):
    name = "memory"

    def __init__(self, memory: NgramMemory) -> None:
        super().__init__()
        self.memory = memory

    def _source(self) -> Sequence[int]:
        return self.memory.tokens

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        return self.memory.index.longest_match(context, 32, self.memory.tokens)


class Memory:
    """:class:`rag_accel.memory.AnswerMemory`, every answer in one scope (``vllm-ours-memory``); ``priced``: its
    drafter's factor priced by what a draft token costs, as the frequency drafter's is."""

    def __init__(self, priced: bool = False) -> None:
        from rag_accel.memory import AnswerMemory

        self.memory, self.priced = AnswerMemory(), priced

    def drafter(self, item_id: str) -> Any:
        found = self.memory.drafter("all")
        return PricedMemoryDrafter(found) if found is not None and self.priced else found

    def add(self, item_id: str, answer: Sequence[int]) -> None:
        self.memory.add("all", list(answer))


class PricedMemoryDrafter(MemoryDrafter, FrequencyDrafter):
    """The memory's drafter (its ``propose``) with its factor priced as the frequency drafter's is (its ``price``,
    which :class:`rag_accel.speculation.RequestDrafting` calls on every FrequencyDrafter in a chain)."""

    def __init__(self, drafter: MemoryDrafter) -> None:
        MemoryDrafter.__init__(self, drafter._segments, drafter.factor, drafter.min_prob)
        self.max_factor = drafter.factor


class TreeMemory(FrequencyTreeMemory):
    """arctic-inference's tree of earlier answers in the memory's place, its drafts carrying its probabilities."""

    def drafter(self, item_id: str) -> Any:
        import numpy as np

        self.cache.start_request(item_id, np.zeros(0, dtype=np.int32))
        return _ProbTreeDrafter(self.cache, item_id)


class _ProbTreeDrafter(FrequencyTreeDrafter):
    def propose(self, context: Sequence[int], max_len: int) -> Any:
        import numpy as np

        from rag_accel.drafters import NO_DRAFT, Draft

        found = self.cache.speculate(self.request, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                     max_spec_tokens=max_len, max_spec_factor=float(K), min_token_prob=MIN_TOKEN_PROB)
        return Draft(list(found.token_ids), int(found.match_len), self.name, tuple(found.probs)) \
            if found.token_ids else NO_DRAFT


def _common_pairs(index: Any, tokens: Sequence[int], more_than: int) -> dict[tuple[int, int], list[int]]:
    """The positions of each token that occurs more than ``more_than`` times in ``tokens``, by the token
    before it: where a token is too common for a bounded lookup to read all its places, its pairs still
    reach every part of a long source."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for t, places in index._pos.items():
        if len(places) > more_than:
            for p in places:
                pairs.setdefault((tokens[p - 1] if p else SEPARATOR, t), []).append(p)
    return pairs


class CountedReferenceDrafter:
    """Reference decoding by counts: of the places in the references where the context's tail occurs, copy
    the continuation most of them share (suffix decoding's choice, :func:`~rag_accel.kernels.counted_draft`),
    each draft token with its probability from those counts, at most ``factor`` times its match long, cut
    where its probability falls under ``min_prob``. Matches of 1 to ``max_match`` tokens.
    Was ``DecoderConfig(reference_choice="counts")`` until issue 55 (timed, it tied LLMA's choice on one
    engine and lost at 16 in flight); kept here to reproduce this replay's rows.

    A lookup reads at most ``scan`` places: those of the tail's last token, or where that token is commoner,
    those of its last two tokens (an index of the common tokens' places by the token before): the cost
    stays flat in the references' size, and a match of two tokens or more is found anywhere in them.
    """

    name = "reference"

    def __init__(self, references: Sequence[Sequence[int]], max_match: int = 32,
                 factor: float = 3.0, min_prob: float = 0.1, scan: int = 256) -> None:
        self.tokens = concat_with_separators(references).tolist()
        self.index = CountedSuffixes(max_match, scan)
        self.index.extend(self.tokens)
        self._pairs = _common_pairs(self.index, self.tokens, scan)  # (the common tokens' places, by pair)
        self.max_match = max_match
        self.factor, self.min_prob, self.scan = factor, min_prob, scan

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if not context or max_len <= 0:
            return NO_DRAFT
        last = context[-1]
        places = self.index.latest(last, self.scan + 1)
        if len(places) > self.scan:  # a common token: the places of the last two tokens
            places = self._pairs.get((context[-2], last), [])[-self.scan:] if len(context) > 1 else []
        if not places:
            return NO_DRAFT
        tokens, probs, match_len = counted_draft([(self.tokens, places)], context, max_len, self.factor,
                                                 self.min_prob, self.max_match)
        return Draft(tokens, match_len, self.name, tuple(probs)) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        pass  # the references do not change; every proposal reads the context's tail afresh


def ours(sequence: Sequence[tuple], memory: Any = None, reference_choice: str = "longest") -> list[dict]:
    """Our drafting over ``(id, case, prompt, references, answer)`` in order; one row per item
    (``reference_choice``: ``"counts"`` drafts from the references by counts, :class:`CountedReferenceDrafter`)."""
    from rag_accel.config import DEFAULT_COPY_DRAFTERS, DecoderConfig
    from rag_accel.drafters import build_drafters
    from rag_accel.policy import AcceptanceStats
    from rag_accel.speculation import RequestDrafting, StepCosts

    cfg = DecoderConfig(drafters=DEFAULT_COPY_DRAFTERS, max_draft_tokens=K)
    acceptance, costs, rows = AcceptanceStats(), StepCosts(), []
    for item_id, case, prompt, refs, target in sequence:
        context = list(prompt)
        chain = build_drafters(cfg, context, refs).drafters
        if reference_choice == "counts" and chain and chain[0].name == "reference":
            chain[0] = CountedReferenceDrafter(refs)
        if memory is not None and (remembered := memory.drafter(item_id)) is not None:
            chain = chain[:1] + [remembered] + chain[1:]  # just after the references, as the vLLM proposer puts it
        drafting = RequestDrafting.from_config(cfg, context, refs, CURVE, acceptance, costs, drafters=chain)
        drafting.prefill_steps = 0.03 * len(prompt)
        cost, steps, sent_total = replay_request(drafting, context, len(prompt), target, CURVE)
        if memory is not None:
            memory.add(item_id, target)
        rows.append({"item": item_id, "case": case, "tokens": len(target), "steps": steps, "sent": sent_total,
                     "cost": cost})
    return rows


def suffix(sequence: Sequence[tuple]) -> list[dict]:
    """Suffix decoding as vLLM drives it (vLLM's defaults but 10 tokens), its tree of earlier answers included."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from rag_accel.policy import leading_matches

    cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=10_000)
    rows = []
    for item_id, case, prompt, _, target in sequence:
        cache.start_request(item_id, np.asarray(prompt, dtype=np.int32))
        context = list(prompt) + [target[0]]
        cache.add_active_response(item_id, [target[0]])
        cost, steps, sent_total = 0.0, 1, 0
        while (n := len(context) - len(prompt)) < len(target):
            found = cache.speculate(item_id, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                    max_spec_tokens=K, max_spec_factor=1.0, min_token_prob=MIN_TOKEN_PROB)
            sent = list(found.token_ids)
            accepted = leading_matches(sent, target[n:n + len(sent) + 1])
            new = sent[:accepted] + target[n + accepted:n + accepted + 1]
            cache.add_active_response(item_id, new)
            cost, steps, sent_total = cost + CURVE[len(sent)], steps + 1, sent_total + len(sent)
            context.extend(new)
        cache.stop_request(item_id)
        rows.append({"item": item_id, "case": case, "tokens": len(target), "steps": steps, "sent": sent_total,
                     "cost": cost})
    return rows


# name -> (run(sequence) -> rows, whether the client passes the cached answer as a reference in the reworded case)
CONFIGS = {
    "suffix decoding (vLLM's defaults, 10 tokens)": (suffix, False),
    "ours, no memory": (ours, False),
    "ours + the n-gram memory (before)": (lambda seq: ours(seq, NgramMemory()), False),
    "ours + the memory (suffix decoding's counts, factor 3)": (lambda seq: ours(seq, Memory()), False),
    "ours + the memory, its factor priced": (lambda seq: ours(seq, Memory(priced=True)), False),
    "ours + arctic's tree of earlier answers as the memory": (lambda seq: ours(seq, TreeMemory()), False),
    "ours, the client passes the cached answer": (ours, True),
    "ours, the client passes it, + the memory": (lambda seq: ours(seq, Memory()), True),
    # the references' drafter choosing by counts (reference_choice="counts": an option from 2026-11-27 to issue 55)
    "ours, no memory, the references by counts": (lambda seq: ours(seq, None, "counts"), False),
    "ours + the memory, the references by counts": (lambda seq: ours(seq, Memory(), "counts"), False),
    "ours, the client passes it, the references by counts": (lambda seq: ours(seq, None, "counts"), True),
    "ours, the client passes it, + the memory, the references by counts": (
        lambda seq: ours(seq, Memory(), "counts"), True),
}


def summarize(rows: list[dict], case: str) -> dict[str, float]:
    rows = [r for r in rows if r["case"] == case]
    tokens, steps = sum(r["tokens"] for r in rows), sum(r["steps"] for r in rows)
    return {"items": len(rows), "tokens_per_step": tokens / steps, "sent_per_step": sum(r["sent"] for r in rows) / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(
                math.log((r["tokens"] - 1) / r["cost"]) for r in rows))}


def plot(path: Path) -> None:
    """Each configuration's modelled speed-up, new questions and reworded, next to the run's JSON (``--plot``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    names = list(run["results"])
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, case in enumerate(("rag", "reworded")):
        ax.barh([y + 0.4 * i for y in range(len(names))],
                [run["results"][n][case]["modelled_speedup_decoding"] for n in names], height=0.4,
                label={"rag": "the questions as first asked", "reworded": "reworded (the cached-answer case)"}[case])
    ax.set_yticks([y + 0.2 for y in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(1.0, None)
    ax.set_xlabel("modelled speed-up of the decoding steps (geo-mean)")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"The memory of answers and suffix decoding replayed on {run['items']} items (no timing)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def generate(path: Path, n: int, first: bool) -> None:
    """vLLM greedy's answers to the ``n`` first (or last) items' questions and to the same questions reworded."""
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import REWORDED
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.vllm import VllmDecoder

    sample = load_msmarco_sample(with_answers=True)
    items = sample[:n] if first else sample[-n:]
    dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct", calibrate=False)  # (the tokenizer)
    prompts = [dec.encode_prompt(rag_messages(it.query, it.passages)) for it in items]
    reworded = [dec.encode_prompt(rag_messages(REWORDED.format(query=it.query.rstrip("?")), it.passages))
                for it in items]
    engine = VllmDecoder.from_pretrained("smollm2-135m-instruct", speculation="off", dtype="float32",
                                         max_model_len=4096, enforce_eager=True, enable_prefix_caching=False)
    try:
        answers = engine.generate_batch(prompts, None, max_new_tokens=128)
        answers_reworded = engine.generate_batch(reworded, None, max_new_tokens=128)
    finally:
        engine.close()
    path.write_text(json.dumps({
        "model": "smollm2-135m-instruct", "dtype": "float32", "max_new_tokens": 128,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "how": "vLLM greedy (speculation off), each set of prompts in one batch",
        "command": f"python benchmarks/experiments/memory_replay.py --generate {path}" + (f" --first {n}" if first else ""),
        "items": [{"id": it.id, "answer": a.token_ids, "reworded_answer": r.token_ids}
                  for it, a, r in zip(items, answers, answers_reworded)]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generate", type=Path, default=None, help="save greedy answers here, and nothing else")
    ap.add_argument("--first", type=int, default=None, help="with --generate: the sample's first N items")
    ap.add_argument("--last", type=int, default=100, help="with --generate: the sample's last N items")
    ap.add_argument("--outputs", type=Path, default=None, help="a --generate file to replay")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_replay"))
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.generate is not None:
        return generate(args.generate, args.first or args.last, args.first is not None)
    if args.outputs is None:
        ap.error("--outputs or --generate")
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import REWORDED
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    saved = json.loads(args.outputs.read_text())
    dec = ReferenceDecoder.from_pretrained(saved["model"], calibrate=False)
    sample = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    saved_items = [s for s in saved["items"] if len(s["answer"]) > 1 and len(s["reworded_answer"]) > 1]
    refs = {s["id"]: dec.encode_references(list(sample[s["id"]].passages)) for s in saved_items}
    rag = [(s["id"], "rag", dec.encode_prompt(rag_messages(sample[s["id"]].query, sample[s["id"]].passages)),
            refs[s["id"]], s["answer"]) for s in saved_items]

    def reworded(client: bool) -> list[tuple]:
        return [(s["id"] + "~reworded", "reworded",
                 dec.encode_prompt(rag_messages(REWORDED.format(query=sample[s["id"]].query.rstrip("?")),
                                                sample[s["id"]].passages)),
                 refs[s["id"]] + ([s["answer"]] if client else []), s["reworded_answer"]) for s in saved_items]

    results = {}
    for name, (run, client) in CONFIGS.items():
        rows = run(rag + reworded(client))
        results[name] = {case: summarize(rows, case) for case in ("rag", "reworded")}
        print(name, {c: round(v["modelled_speedup_decoding"], 3) for c, v in results[name].items()}, flush=True)
    command = f"python benchmarks/experiments/memory_replay.py --outputs {args.outputs} --out {args.out}"
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "outputs": str(args.outputs), "items": len(saved_items), "k": K, "curve": CURVE,
         "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "results": results}, indent=1))
    lines = [f"# The memory of earlier answers and suffix decoding, replayed on {len(saved_items)} items' greedy "
             "answers (no timing)", "",
             f"- command: `{command}`", f"- answers: `{args.outputs}` ({saved['how']}, {saved['model']} "
             f"{saved['dtype']}, {saved['max_new_tokens']} new tokens; `{saved['command']}`)",
             f"- a verify of L draft tokens costs CURVE[L] plain steps, vLLM's at one request in flight on the "
             f"2-core CPU: {', '.join(f'{c:g}' for c in CURVE)}; at most {K} draft tokens a step",
             "- rag: each question in turn (the memory holds the answers of the items before); reworded: then each "
             "question reworded (the cached-answer case: the memory, and suffix decoding's tree, hold every "
             "original answer; the client-passes rows pass it as a reference instead)", "",
             "| configuration | rag: tokens/step | rag: modelled speed-up | reworded: tokens/step | "
             "reworded: modelled speed-up | reworded: draft tokens sent/step |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['rag']['tokens_per_step']:.3f} | {r['rag']['modelled_speedup_decoding']:.3f}x | "
              f"{r['reworded']['tokens_per_step']:.3f} | {r['reworded']['modelled_speedup_decoding']:.3f}x | "
              f"{r['reworded']['sent_per_step']:.2f} |" for name, r in results.items()]
    lines += ["", f"![modelled speed-up per configuration]({args.out.with_suffix('.png').name}) (`python "
              f"benchmarks/experiments/memory_replay.py --plot {args.out}.json`, in a virtualenv with matplotlib)"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
