"""Which occurrence of a match to copy from: simple rules against an oracle, on the model's own answers.

    python benchmarks/experiments/match_choice.py --outputs benchmarks/results/greedy_outputs_smollm2_first50x64.json \\
        --out benchmarks/results/match_choice_smollm2_first50

(``--save-outputs`` of ``rag-accel bench --methods greedy`` wrote the outputs file.) No timing: the model's
greedy answers are known, so what a draft would get accepted is too.

1. At every position of every answer, the occurrences of the longest suffix of the context (prompt + answer so
   far, up to 32 tokens) in the references and in the context itself, and how many of the next ``K`` tokens each
   occurrence's continuation gets right. Per position, by the longest match's length: the best occurrence (an
   oracle that knows the answer), the best of all matches of any length, and rules that pick without knowing it:
   the earliest in the references (the reference drafter's), the latest in the context (prompt lookup's), the
   answer so far first, a vote on the next token, and the occurrence closest after the span last followed.
2. The real drafting (:class:`rag_accel.speculation.RequestDrafting`: drafters and the cost-aware policy, one
   engine learning across the items) at vLLM-like costs on this CPU (a verify of ``L`` draft tokens costs
   ``1 + 0.025 L`` plain steps at one request in flight): tokens per step and modelled speed-up of the decoding
   steps, at ``K`` = 10 and 24, and with the closest-after-the-span rule in the reference drafter.
3. With ``--learn-from`` (another outputs file: the items to learn on): a learned choice. Every distinct
   continuation of every match (any length; references, prompt, answer so far) gets the features of
   :data:`FEATURES`, and a linear score fitted by least squares to the tokens it gets accepted on the
   ``--learn-from`` answers picks one. Judged on ``--outputs``: each step sends the ``K`` tokens of the pick
   (no policy) against the drafter chain's first draft and the best continuation (an oracle), and the pick in
   place of the reference drafter inside the real drafting of part 2.

Tune on the sample's first items, judge on its last ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel_lab.replay import K, SLOPE, continuation, match_lengths, occurrences, prepare, replay
from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.drafters import ReferenceDrafter, _SpanCopier, build_drafters
from rag_accel.kernels import SEPARATOR, concat_with_separators
from rag_accel.policy import leading_matches

NEAR = 64


def bucket(length: int) -> str:
    return "1" if length == 1 else "2" if length == 2 else "3-4" if length <= 4 else "5-8" if length <= 8 else "9+"


def rules_at_positions(prepared: Sequence[tuple]) -> dict[str, dict[str, float]]:
    """Part 1: mean accepted tokens per position, per rule, by the longest match's length."""
    sums: dict[str, Counter] = defaultdict(Counter)
    for _, prompt, refs, target in prepared:
        ref = concat_with_separators(refs)
        near = None  # where the span last followed in the references stands now
        for n in range(1, len(target) - 1):
            ctx = np.asarray(list(prompt) + list(target[:n]), dtype=np.int64)
            truth = target[n:]
            found = [(L, "ref", p) for L, p in occurrences(ref, ctx)] + \
                    [(L, "answer" if p > len(prompt) else "prompt", p) for L, p in occurrences(ctx, ctx)]
            if not found:
                near = None if near is None else near + 1
                continue
            longest = max(c[0] for c in found)
            top = [c for c in found if c[0] == longest]
            got = {c: leading_matches(continuation(ref if c[1] == "ref" else ctx, c[2]), truth) for c in found}
            refs_at = [c for c in top if c[1] == "ref"]
            ctx_at = [c for c in top if c[1] != "ref"]
            answer_at = [c for c in top if c[1] == "answer"]
            earliest_ref = min(refs_at, key=lambda c: c[2]) if refs_at else None
            latest_ctx = max(ctx_at, key=lambda c: c[2]) if ctx_at else None
            first_token = {c: int((ref if c[1] == "ref" else ctx)[c[2]]) for c in top}
            voted = Counter(first_token.values()).most_common(1)[0][0]
            winners = [c for c in top if first_token[c] == voted]
            close = [c for c in refs_at if near is not None and 0 <= c[2] - near <= NEAR
                     and SEPARATOR not in ref[near:c[2]].tolist()]
            picks = {
                "oracle: best occurrence of the longest match": max(got[c] for c in top),
                "oracle: best occurrence of any match": max(got.values()),
                "earliest in the references, else latest in the context": got[earliest_ref or latest_ctx],
                "latest in the context, else earliest in the references": got[latest_ctx or earliest_ref],
                "the answer so far first (latest), then as the reference drafter":
                    got[max(answer_at, key=lambda c: c[2])] if answer_at else got[earliest_ref or latest_ctx],
                "a vote on the next token, then the earliest": got[min(winners, key=lambda c: (c[1] != "ref", c[2]))],
                "closest after the span last followed, else the reference drafter's":
                    got[min(close, key=lambda c: c[2])] if close else got[earliest_ref or latest_ctx],
            }
            b = bucket(longest)
            for name, value in picks.items():
                sums[b][name] += value
                sums["all"][name] += value
            sums[b]["positions"] += 1
            sums["all"]["positions"] += 1
            # the span followed: where the references continue the answer's tail, closest after the last one
            nxt = np.asarray(list(ctx) + [target[n]], dtype=np.int64)
            spans = [p for L, p in occurrences(ref, nxt) if L >= 3]
            after = [p for p in spans if near is not None and 0 <= p - near <= NEAR]
            near = min(after) if after else (min(spans) if spans else (None if near is None else near + 1))
    return {b: {k: (v / c["positions"] if k != "positions" else v) for k, v in c.items()} for b, c in sums.items()}


class CloseAfterSpan(ReferenceDrafter):
    """The reference drafter, but when its longest match is 1-2 tokens it copies from the occurrence closest after
    where the span it followed broke off (within ``NEAR`` tokens, same reference), if there is one."""

    def __init__(self, refs: Sequence[Sequence[int]], min_match: int, max_match: int) -> None:
        super().__init__(refs, min_match, max_match)
        self._source_arr = np.asarray(self.index.tokens, dtype=np.int64)
        self._near: int | None = None

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        found = super()._search(context)
        if found is None or found[0] > 2 or self._near is None:
            return found
        ctx = np.asarray(context[-found[0]:], dtype=np.int64)
        close = [p for L, p in occurrences(self._source_arr, ctx) if L == found[0]
                 and 0 <= p - self._near <= NEAR and SEPARATOR not in self.index.tokens[self._near:p]]
        return (found[0], min(close)) if close else found

    def update(self, context: Sequence[int], num_new: int) -> None:
        if self._follow is not None and num_new > 0:
            new, start, j = context[len(context) - num_new:], self._follow, 0
            while j < num_new and start + j < len(self.index.tokens) and self.index.tokens[start + j] == new[j]:
                j += 1
            self._near = start + j
        super().update(context, num_new)


#: Part 3's features of a distinct continuation (the occurrence with its longest match stands for it).
FEATURES = ("bias", "match length / 32", "log match length", "is the longest match", "longest - its match length",
            "occurs in the references", "occurs in the answer so far", "occurs in the prompt",
            "log occurrences", "share of all occurrences with its first token",
            "overlap of the 64 tokens before it with the context's last 32", "position in its source (0-1)",
            "length / K", "first token among the context's last 3")


def continuations(ref: np.ndarray, ctx: np.ndarray, n_prompt: int) -> tuple[np.ndarray, list[tuple]]:
    """Part 3: every distinct ``K``-token continuation of any match of the context's tail, its :data:`FEATURES`
    (rows) and ``(tokens, (source, start), match length)`` of the occurrence standing for it (source 0: references,
    1: context)."""
    groups: dict[tuple, dict] = {}
    recent = set(ctx[-32:].tolist())
    for kind, src in ((0, ref), (1, ctx)):
        lengths = match_lengths(src, ctx)
        for p in np.nonzero(lengths)[0].tolist():
            tokens = tuple(continuation(src, p))
            if not tokens:
                continue
            length = int(lengths[p])
            overlap = len(set(src[max(0, p - length - 64):p - length].tolist()) & recent) / 32
            g = groups.setdefault(tokens, {"n": 0, "where": set(), "best": (0, 0.0, 0.0, (kind, p))})
            g["n"] += 1
            g["where"].add("ref" if kind == 0 else "answer" if p >= n_prompt else "prompt")
            g["best"] = max(g["best"], (length, overlap, p / max(1, len(src)), (kind, p)))
    if not groups:
        return np.zeros((0, len(FEATURES))), []
    longest = max(g["best"][0] for g in groups.values())
    first = Counter()
    for tokens, g in groups.items():
        first[tokens[0]] += g["n"]
    total, last = sum(first.values()), set(ctx[-3:].tolist())
    rows, picks = [], []
    for tokens, g in groups.items():
        length, overlap, position, where = g["best"]
        rows.append([1.0, min(length, 32) / 32, math.log(length), float(length == longest), float(longest - length),
                     float("ref" in g["where"]), float("answer" in g["where"]), float("prompt" in g["where"]),
                     math.log(g["n"]), first[tokens[0]] / total, overlap, position, len(tokens) / K,
                     float(tokens[0] in last)])
        picks.append((list(tokens), where, length))
    return np.asarray(rows), picks


def fit_score(prepared: Sequence[tuple]) -> np.ndarray:
    """Part 3: least-squares weights of :data:`FEATURES` for the tokens a continuation gets accepted, over every
    position of every answer."""
    xs, ys = [], []
    for _, prompt, refs, target in prepared:
        ref = concat_with_separators(refs)
        for n in range(1, len(target) - 1):
            rows, picks = continuations(ref, np.asarray(list(prompt) + list(target[:n]), dtype=np.int64), len(prompt))
            xs.append(rows)
            ys += [leading_matches(tokens, target[n:]) for tokens, _, _ in picks]
    return np.linalg.lstsq(np.concatenate(xs), np.asarray(ys, dtype=np.float64), rcond=None)[0]


class LearnedChoice(_SpanCopier):
    """The reference drafter's place in the chain, picking by the learned score among every continuation of any
    match in the references and the context (then following the picked span, as copy drafters do)."""

    name = "reference"
    weights: np.ndarray = np.zeros(len(FEATURES))

    def __init__(self, refs: Sequence[Sequence[int]], n_prompt: int) -> None:
        super().__init__()
        self.ref = concat_with_separators(refs)
        self.ref_tokens, self.n_prompt = self.ref.tolist(), n_prompt
        self._tokens: Sequence[int] = self.ref_tokens

    def _source(self) -> Sequence[int]:
        return self._tokens

    def _search(self, context: Sequence[int]) -> tuple[int, int] | None:
        rows, picks = continuations(self.ref, np.asarray(context, dtype=np.int64), self.n_prompt)
        if not picks:
            return None
        best = int(np.argmax(rows @ self.weights))
        _, (kind, start), length = picks[best]
        self._tokens = self.ref_tokens if kind == 0 else context
        return length, start

    def update(self, context: Sequence[int], num_new: int) -> None:
        if self._tokens is not self.ref_tokens:
            self._tokens = context  # (a span in the context: the context as it grew)
        super().update(context, num_new)


def always_send(prepared: Sequence[tuple], choice: str, weights: np.ndarray | None = None) -> dict[str, float]:
    """Part 3: every step sends ``K`` tokens (no policy) of ``choice``: ``chain`` (the drafter chain's first draft),
    ``learned`` (the learned score's pick, its span followed while it is accepted) or ``oracle`` (the continuation
    of any match that gets the most accepted)."""
    cfg = DecoderConfig(drafters=("reference", "prompt_lookup", "ngram"), max_draft_tokens=K)
    tokens = steps = 0
    speedups = []
    for _, prompt, refs, target in prepared:
        ref = concat_with_separators(refs)
        context = list(prompt) + [target[0]]
        chain = build_drafters(cfg, context, refs)
        chain.update(context, 1)
        learned = LearnedChoice(refs, len(prompt))
        learned.weights = weights if weights is not None else learned.weights
        cost, n_steps = 0.0, 1
        while len(context) - len(prompt) < len(target):
            truth = target[len(context) - len(prompt):]
            if choice == "chain":
                draft = chain.propose(context, K).tokens
            elif choice == "learned":
                draft = learned.propose(context, K).tokens
            else:
                ctx = np.asarray(context, dtype=np.int64)
                picks = continuations(ref, ctx, len(prompt))[1]
                draft = max((t for t, _, _ in picks), key=lambda t: leading_matches(t, truth), default=[])
            accepted = leading_matches(draft, truth)
            new = draft[:accepted] + truth[accepted:accepted + 1]
            cost += 1.0 + SLOPE * len(draft)
            n_steps += 1
            context.extend(new)
            chain.update(context, len(new))
            learned.update(context, len(new))
        tokens += len(target)
        steps += n_steps
        speedups.append((len(target) - 1) / cost)
    return {"tokens_per_step": tokens / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups))}


def close_after_span(prompt: list[int], refs: Sequence[Sequence[int]], chain: list) -> list:
    """Part 2's chain with :class:`CloseAfterSpan` in the reference drafter's place (a ``make_chain`` of
    :func:`rag_accel_lab.replay.replay`)."""
    return [CloseAfterSpan(refs, 2, 32) if d.name == "reference" else d for d in chain]  # (LLMA's match lengths)


def learned_choice(weights: np.ndarray):
    """A ``make_chain`` with part 3's :class:`LearnedChoice` of these weights in the reference drafter's place."""
    def make_chain(prompt: list[int], refs: Sequence[Sequence[int]], chain: list) -> list:
        learned = LearnedChoice(refs, len(prompt))
        learned.weights = weights
        return [learned if d.name == "reference" else d for d in chain]
    return make_chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, required=True)
    ap.add_argument("--learn-from", type=Path, default=None, help="outputs file of the items part 3 learns on")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/match_choice"))
    args = ap.parse_args()
    model = json.loads(args.outputs.read_text()).get("model", "smollm2-135m-instruct")
    dec = ReferenceDecoder.from_pretrained(model, calibrate=False)
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    prepared = prepare(args.outputs, dec, items)
    positions = rules_at_positions(prepared)
    replays = {f"K={k}{', closest after the span' if close else ''}":
               replay(prepared, k, make_chain=close_after_span if close else None)
               for k, close in ((10, False), (24, False), (10, True))}
    learned = None
    if args.learn_from is not None:
        weights = fit_score(prepare(args.learn_from, dec, items))
        replays["K=10, the learned choice in the reference drafter's place"] = replay(
            prepared, 10, make_chain=learned_choice(weights))
        learned = {"from": str(args.learn_from), "weights": dict(zip(FEATURES, weights.tolist())),
                   "always_send": {c: always_send(prepared, c, weights) for c in ("chain", "learned", "oracle")}}
    command = f"python benchmarks/experiments/match_choice.py --outputs {args.outputs} --out {args.out}" + \
        (f" --learn-from {args.learn_from}" if args.learn_from else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "items": len(prepared), "k": K,
                                                         "positions": positions, "replays": replays,
                                                         "learned": learned}, indent=1))
    buckets = [b for b in ("1", "2", "3-4", "5-8", "9+", "all") if b in positions]
    rules = [r for r in positions["all"] if r != "positions"]
    lines = [f"# Which occurrence to copy from: {len(prepared)} items' greedy answers replayed (no timing)", "",
             f"- command: `{command}`", "",
             f"Mean tokens a {K}-token draft from the chosen occurrence gets accepted, per answer position, by the "
             "length of the context's longest match (references, prompt, answer so far):", "",
             "| rule | " + " | ".join(f"longest {b} ({int(positions[b]['positions'])})" for b in buckets) + " |",
             "|---|" + "---|" * len(buckets)]
    lines += [f"| {r} | " + " | ".join(f"{positions[b][r]:.2f}" for b in buckets) + " |" for r in rules]
    lines += ["", f"The real drafting and policy, one engine learning across the items, a verify of L draft tokens "
                  f"costing 1 + {SLOPE} L plain steps (vLLM at one request in flight on this CPU):", "",
              "| configuration | tokens/step | modelled speed-up of the decoding steps (geo-mean) |", "|---|---|---|"]
    lines += [f"| {name} | {v['tokens_per_step']:.3f} | {v['modelled_speedup_decoding']:.3f}x |"
              for name, v in replays.items()]
    if learned is not None:
        names = {"chain": "the drafter chain's first draft", "learned": "the learned choice",
                 "oracle": "oracle: the best continuation of any match"}
        lines += ["", f"A learned choice among every continuation of any match, its linear score fitted on "
                      f"`{args.learn_from}`. Every step sends {K} tokens, no policy, at the same costs:", "",
                  "| draft | tokens/step | modelled speed-up of the decoding steps (geo-mean) |", "|---|---|---|"]
        lines += [f"| {names[c]} | {v['tokens_per_step']:.3f} | {v['modelled_speedup_decoding']:.3f}x |"
                  for c, v in learned["always_send"].items()]
        lines += ["", "Its weights: " + "; ".join(f"{f}: {w:+.3f}" for f, w in learned["weights"].items()) + "."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
