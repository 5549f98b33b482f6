"""Which occurrence of a match to copy from: simple rules against an oracle, on the model's own answers.

    python benchmarks/match_choice.py --outputs benchmarks/results/greedy_outputs_smollm2_first50x64.json \\
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
from typing import Any

import numpy as np

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.data import load_msmarco_sample, rag_messages
from rag_accel.drafters import ReferenceDrafter, _SpanCopier, build_drafters
from rag_accel.kernels import SEPARATOR, concat_with_separators
from rag_accel.policy import AcceptanceStats, leading_matches
from rag_accel.speculation import RequestDrafting, StepCosts

K, MAX_MATCH, SLOPE, NEAR = 10, 32, 0.025, 64


def match_lengths(source: np.ndarray, context: np.ndarray) -> np.ndarray:
    """``L[p]``: how many tokens of the context's tail end at ``source[p - 1]`` (a match continued at ``p``)."""
    n = len(source)
    lengths = np.zeros(n + 1, dtype=np.int64)
    alive = np.nonzero(source == context[-1])[0] + 1  # continuation positions of a 1-token match
    for j in range(min(MAX_MATCH, len(context))):
        if j:
            alive = alive[alive - 1 - j >= 0]
            alive = alive[source[alive - 1 - j] == context[-1 - j]]
        if not len(alive):
            break
        lengths[alive] += 1
    return lengths[:n]


def occurrences(source: np.ndarray, context: np.ndarray) -> list[tuple[int, int]]:
    """``(match length, continuation start)`` of every match with a continuation."""
    lengths = match_lengths(source, context)
    return [(int(lengths[p]), int(p)) for p in np.nonzero(lengths)[0] if source[p] != SEPARATOR]


def continuation(source: np.ndarray, start: int) -> list[int]:
    out = source[start:start + K].tolist()
    return out[:out.index(SEPARATOR)] if SEPARATOR in out else out


def longest_copy(source: np.ndarray, context: np.ndarray, truth: Sequence[int], k: int, min_match: int = 1) -> int:
    """The most of ``truth``'s first ``k`` tokens that a copy from ``source`` gets right, over every place the
    context's last ``min_match`` tokens occur there (a match of any length from ``min_match`` on, since a longer
    one is also a shorter one): what an oracle that copies from the best place would get accepted. A
    continuation ends at a :data:`SEPARATOR` or at the end of ``source``.

    Example:
        >>> source = np.array([7, 1, 2, 3, 7, 1, 2, 9])
        >>> longest_copy(source, np.array([5, 7]), [1, 2, 9, 4], 10), longest_copy(source, np.array([2, 7]), [2], 10, 2)
        (3, 0)
    """
    alive = np.nonzero(source[:-1] == context[-1])[0] + 1
    for j in range(1, min(min_match, len(context))):
        alive = alive[alive - 1 - j >= 0]
        alive = alive[source[alive - 1 - j] == context[-1 - j]]
    if len(context) < min_match:
        alive = alive[:0]
    got = 0
    for j in range(min(k, len(truth))):
        alive = alive[alive + j < len(source)]
        alive = alive[source[alive + j] == truth[j]]
        if not len(alive):
            break
        got = j + 1
    return got


def copy_ceiling(prepared: Sequence[tuple], k: int, earlier_answers: bool = False,
                 min_match: int = 1) -> list[list[int]]:
    """Per item, the draft tokens accepted at each decoding step by an oracle that copies from the best place: each
    step takes the :func:`longest_copy` of at most ``k`` tokens from the references, the prompt and the answer so
    far (and with ``earlier_answers`` the answers of the items before it, as suffix decoding's tree and our memory
    hold them), sends just that many and adds the model's own next token. Taking the most each step gives the fewest
    steps of any drafter copying at most ``k`` tokens from those sources after matches of ``min_match`` tokens or
    more (ours, prompt lookup, n-grams, suffix decoding: at ``min_match`` 1): a copy that reaches position ``q``
    from ``p`` reaches it from ``p + 1`` too, so a shorter step never gets further later. So its tokens per step
    bound theirs; each step sent at exactly its accepted length is the cheapest step that accepts it."""
    out, earlier = [], []
    for _, prompt, refs, target in prepared:
        sources = [concat_with_separators(refs)] + ([concat_with_separators(earlier)] if earlier else [])
        context, steps = list(prompt) + [target[0]], []
        while (n := len(context) - len(prompt)) < len(target):
            ctx, truth = np.asarray(context, dtype=np.int64), target[n:]
            # at most all but the last token: the model's own next token ends the answer
            best = max(longest_copy(src, ctx, truth[:-1], k, min_match) for src in (*sources, ctx))
            steps.append(best)
            context.extend(truth[:best + 1])
        out.append(steps)
        if earlier_answers:
            earlier.append(list(target))
    return out


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


def replay_request(drafting: RequestDrafting, context: list[int], prompt_len: int, target: Sequence[int],
                   curve: Sequence[float], exact_lengths: bool = False) -> tuple[float, int, int]:
    """One request decoded on its known answer ``target`` from ``context`` (the prompt, which grows): each step
    keeps the draft's tokens up to the first wrong one plus the model's own next token and costs ``curve[L]``
    for ``L`` draft tokens sent. ``exact_lengths``: the policy's length is replaced by an oracle's, the number
    of the draft's tokens (of at most ``len(curve) - 1``) that get accepted. Returns (cost of the steps after
    the first token, steps with the first, draft tokens sent)."""
    cost, n_steps, sent_tokens, new = 0.0, 1, 0, [target[0]]
    context.append(target[0])
    while len(context) - prompt_len < len(target):
        drafting.learn(context, new)
        n = len(context) - prompt_len
        draft, n_send = drafting.choose(context, n, 1 << 30)
        if exact_lengths:
            n_send = leading_matches(draft.tokens[:len(curve) - 1], target[n:len(target) - 1])
        sent = draft.tokens[:n_send]
        accepted = leading_matches(sent, target[n:n + n_send + 1])
        new = sent[:accepted] + target[n + accepted:n + accepted + 1]
        drafting.account(n_send, accepted, curve[n_send], len(context))
        cost += curve[n_send]
        n_steps += 1
        sent_tokens += n_send
        context.extend(new)
    return cost, n_steps, sent_tokens


def replay(prepared: Sequence[tuple], k: int, close_after_span: bool,
           curve: Sequence[float] | None = None, weights: np.ndarray | None = None,
           memory: Any = None, make_chain: Any = None,
           drafters: Sequence[str] = ("reference", "prompt_lookup", "ngram"),
           exact_lengths: bool = False) -> dict[str, float]:
    """Part 2: the real drafting, one engine learning across the items, a verify of ``L`` draft tokens costing
    ``curve[L]`` plain steps (default ``1 + SLOPE L``); ``weights``: part 3's learned choice in the reference
    drafter's place. ``memory``: earlier answers as a source (``benchmarks/suffix_replay.py``), an object with
    ``drafter(item id)`` (a drafter for that item, or ``None``), which joins the chain just after the
    reference drafter as in the vLLM proposer (after the first drafter in a chain without one), and ``add(item id, answer)``, called after each item.
    ``make_chain(prompt, references, chain)``: the drafters to use instead of ``chain`` (the config's).
    ``drafters``: the config's chain (default: the copy drafters before the frequency drafter, as this
    benchmark's committed results ran). ``exact_lengths``: every draft sent at just its accepted length (an
    oracle: what the policy's choice of lengths leaves)."""
    cfg = DecoderConfig(drafters=tuple(drafters), max_draft_tokens=k)
    curve = [1.0 + SLOPE * n for n in range(k + 1)] if curve is None else list(curve[:k + 1])
    acceptance, costs = AcceptanceStats(), StepCosts()
    tokens = steps = sent_tokens = 0
    speedups = []
    for item_id, prompt, refs, target in prepared:
        context = list(prompt)
        chain = build_drafters(cfg, context, refs).drafters
        if make_chain is not None:
            chain = make_chain(context, refs, chain)
        if close_after_span:
            chain = [CloseAfterSpan(refs, cfg.min_match, cfg.reference_max_match)
                     if d.name == "reference" else d for d in chain]
        if weights is not None:
            learned = LearnedChoice(refs, len(prompt))
            learned.weights = weights
            chain = [learned if d.name == "reference" else d for d in chain]
        if memory is not None and (remembered := memory.drafter(item_id)) is not None:
            names = [d.name for d in chain]
            at = names.index("reference") + 1 if "reference" in names else 1
            chain = chain[:at] + [remembered] + chain[at:]
        drafting = RequestDrafting.from_config(cfg, context, refs, curve, acceptance, costs, drafters=chain)
        drafting.prefill_steps = 0.03 * len(prompt)
        cost, n_steps, n_sent = replay_request(drafting, context, len(prompt), target, curve, exact_lengths)
        sent_tokens += n_sent
        if memory is not None:
            memory.add(item_id, target)
        tokens += len(target)
        steps += n_steps
        speedups.append((len(target) - 1) / cost if cost else 1.0)
    return {"tokens_per_step": tokens / steps, "sent_per_step": sent_tokens / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups)),
            "worst_item": min(speedups)}


def prepare(path: Path, dec: ReferenceDecoder, items: dict) -> list[tuple]:
    """``(item id, prompt ids, reference ids, the model's answer ids)`` of an outputs file's items."""
    saved = json.loads(path.read_text())
    return [(item_id, dec.encode_prompt(rag_messages(items[item_id].query, items[item_id].passages)),
             dec.encode_references(list(items[item_id].passages)), target)
            for item_id, target in saved["outputs"].items()]


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
    replays = {f"K={k}{', closest after the span' if close else ''}": replay(prepared, k, close)
               for k, close in ((10, False), (24, False), (10, True))}
    learned = None
    if args.learn_from is not None:
        weights = fit_score(prepare(args.learn_from, dec, items))
        replays["K=10, the learned choice in the reference drafter's place"] = replay(prepared, 10, False,
                                                                                      weights=weights)
        learned = {"from": str(args.learn_from), "weights": dict(zip(FEATURES, weights.tolist())),
                   "always_send": {c: always_send(prepared, c, weights) for c in ("chain", "learned", "oracle")}}
    command = f"python benchmarks/match_choice.py --outputs {args.outputs} --out {args.out}" + \
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
