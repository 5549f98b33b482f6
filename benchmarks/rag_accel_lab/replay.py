"""Drafting replayed on the model's known answers, and what its steps cost: the benchmarks' no-timing kit.

A model's greedy answers (``rag-accel bench --methods greedy --save-outputs FILE``) fix every verify step's outcome,
so drafters and policies can be compared without timing noise: each step keeps the draft up to its first wrong token
plus the model's own next token, and is charged what a cost curve or measured step times say it costs. Used by the
replays in ``benchmarks/experiments/`` (``match_choice.py``, ``suffix_replay.py``, ``memory_replay.py``,
``batch_costs.py``, ``tree_verify.py``, ``cost_curve_ab.py``, ``gpu_step_costs.py``).

- where a context's tail occurs and what copying from there gets accepted: :func:`occurrences`,
  :func:`continuation`, :func:`longest_copy`, :func:`copy_ceiling` (an oracle's bound on any copying);
- the real drafting (:class:`rag_accel.speculation.RequestDrafting`) on known answers: :func:`replay_request`,
  :func:`replay`, over :func:`prepare`'s items;
- suffix decoding's tree of earlier answers (arctic-inference) as a memory in our chain:
  :class:`FrequencyTreeMemory`;
- step prices: :class:`LineCost`, :class:`TableCost` (measured step times, by rows and tokens),
  :func:`least_squares`; a forward's cost by its tokens on this machine: :func:`forward_costs`, :func:`cost_of`.

numpy only at import; torch, the model and arctic-inference inside the functions that need them.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rag_accel.config import DecoderConfig
from rag_accel.kernels import SEPARATOR, concat_with_separators
from rag_accel.policy import AcceptanceStats, leading_matches

#: Draft tokens a step copies at most, in the replays.
K = 10
#: The longest match of the context's tail that :func:`match_lengths` counts.
MAX_MATCH = 32
#: What a draft token costs in plain steps: vLLM at one request in flight on the 2-core CPU.
SLOPE = 0.025
MAX_TREE_DEPTH = 24  # vLLM's default suffix_decoding_max_tree_depth
MIN_TOKEN_PROB = 0.1  # and suffix_decoding_min_token_prob


# ----------------------------------------------------------------------------- where copying gets accepted
def match_lengths(source: np.ndarray, context: np.ndarray) -> np.ndarray:
    """``L[p]``: how many tokens of the context's tail end at ``source[p - 1]`` (a match continued at ``p``).

    Example:
        >>> match_lengths(np.array([7, 1, 2, 7, 1]), np.array([5, 7, 1])).tolist()
        [0, 0, 2, 0, 0]
    """
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


def continuation(source: np.ndarray, start: int, k: int = K) -> list[int]:
    """The ``k`` tokens of ``source`` from ``start``, cut at a :data:`SEPARATOR`."""
    out = source[start:start + k].tolist()
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


# ----------------------------------------------------------------------------- the real drafting, replayed
def replay_request(drafting: Any, context: list[int], prompt_len: int, target: Sequence[int],
                   curve: Sequence[float], exact_lengths: bool = False) -> tuple[float, int, int]:
    """One request decoded on its known answer ``target`` from ``context`` (the prompt, which grows), by
    ``drafting`` (a :class:`rag_accel.speculation.RequestDrafting`): each step keeps the draft's tokens up to the
    first wrong one plus the model's own next token and costs ``curve[L]`` for ``L`` draft tokens sent.
    ``exact_lengths``: the policy's length is replaced by an oracle's, the number of the draft's tokens (of at
    most ``len(curve) - 1``) that get accepted. Returns (cost of the steps after the first token, steps with the
    first, draft tokens sent)."""
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


def replay(prepared: Sequence[tuple], k: int, curve: Sequence[float] | None = None, *,
           memory: Any = None, make_chain: Any = None,
           drafters: Sequence[str] = ("reference", "prompt_lookup", "ngram"),
           exact_lengths: bool = False, prefill_per_token: float = 0.03) -> dict[str, Any]:
    """The real drafting over :func:`prepare`'s items, one engine learning across them, a verify of ``L`` draft
    tokens costing ``curve[L]`` plain steps (default ``1 + SLOPE L``).

    Args:
        memory: earlier answers as a source, an object with ``drafter(item id)`` (a drafter for that item, or
            ``None``), which joins the chain just after the reference drafter as in the vLLM proposer (after the
            first drafter in a chain without one), and ``add(item id, answer)``, called after each item.
        make_chain: ``make_chain(prompt, references, chain)``, the drafters to use instead of ``chain`` (the
            config's).
        drafters: the config's chain (default: the copy drafters before the frequency drafter, as the committed
            replays ran).
        exact_lengths: every draft sent at just its accepted length (an oracle: what the policy's choice of
            lengths leaves).
        prefill_per_token: a prompt token's share of the prefill, in plain steps (what the loss budget counts;
            the default: this CPU's).

    Returns:
        tokens per step, draft tokens sent per step, the modelled speed-up of the decoding steps (geo-mean over the
        items) and the worst item's, and per item (``costs``) its decoding steps' cost in plain steps.
    """
    from rag_accel.drafters import build_drafters
    from rag_accel.speculation import RequestDrafting, StepCosts

    cfg = DecoderConfig(drafters=tuple(drafters), max_draft_tokens=k)
    curve = [1.0 + SLOPE * n for n in range(k + 1)] if curve is None else list(curve[:k + 1])
    acceptance, costs = AcceptanceStats(), StepCosts()
    tokens = steps = sent_tokens = 0
    speedups, item_costs = [], []
    for item_id, prompt, refs, target in prepared:
        context = list(prompt)
        chain = build_drafters(cfg, context, refs).drafters
        if make_chain is not None:
            chain = make_chain(context, refs, chain)
        if memory is not None and (remembered := memory.drafter(item_id)) is not None:
            names = [d.name for d in chain]
            at = names.index("reference") + 1 if "reference" in names else 1
            chain = chain[:at] + [remembered] + chain[at:]
        drafting = RequestDrafting.from_config(cfg, context, refs, curve, acceptance, costs, drafters=chain)
        drafting.prefill_steps = prefill_per_token * len(prompt)
        cost, n_steps, n_sent = replay_request(drafting, context, len(prompt), target, curve, exact_lengths)
        sent_tokens += n_sent
        if memory is not None:
            memory.add(item_id, target)
        tokens += len(target)
        steps += n_steps
        speedups.append((len(target) - 1) / cost if cost else 1.0)
        item_costs.append(cost)
    return {"tokens_per_step": tokens / steps, "sent_per_step": sent_tokens / steps,
            "modelled_speedup_decoding": math.exp(statistics.fmean(math.log(s) for s in speedups)),
            "worst_item": min(speedups), "costs": item_costs}


class PromptTokens:
    """What :func:`rag_accel_lab.replay.prepare` needs of a decoder, the tokenizer alone (no weights loaded)."""

    def __init__(self, model: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from rag_accel.config import DecoderConfig
        from rag_accel.models import local_model

        path = local_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.vocab_size = AutoConfig.from_pretrained(path).vocab_size
        self.limit = DecoderConfig().max_reference_tokens

    def encode_prompt(self, prompt: Any) -> list[int]:
        from rag_accel.inputs import encode_prompt

        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def encode_references(self, references: Any) -> list[list[int]]:
        from rag_accel.references import encode_references

        return encode_references(self.tokenizer, references, self.vocab_size, self.limit)


def prepare(path: Path, dec: Any, items: dict) -> list[tuple]:
    """``(item id, prompt ids, reference ids, the model's answer ids)`` of an outputs file's items (``dec``: the
    model's decoder, for its tokenizer; ``items``: the sample's items by id)."""
    from rag_accel.rag.msmarco import rag_messages

    saved = json.loads(path.read_text())
    return [(item_id, dec.encode_prompt(rag_messages(items[item_id].query, items[item_id].passages)),
             dec.encode_references(list(items[item_id].passages)), target)
            for item_id, target in saved["outputs"].items()]


# ----------------------------------------------------------------------------- suffix decoding's tree
class FrequencyTreeDrafter:
    """A drafter over arctic-inference's tree of earlier answers: the continuation most of them share, at most
    ``factor`` times its match long."""

    name = "memory"

    def __init__(self, cache: Any, request: str, factor: float = float(K)) -> None:
        self.cache, self.request, self.factor = cache, request, factor

    def propose(self, context: Sequence[int], max_len: int) -> Any:
        from rag_accel.drafters import NO_DRAFT, Draft

        found = self.cache.speculate(self.request, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                     max_spec_tokens=max_len, max_spec_factor=self.factor,
                                     min_token_prob=MIN_TOKEN_PROB)
        return Draft(list(found.token_ids), int(found.match_len), self.name) if found.token_ids else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        pass


class FrequencyTreeMemory:
    """arctic-inference's global tree of earlier answers in our memory's place (its per-request tree empty:
    our other drafters cover the prompt and the answer so far); a ``memory`` for :func:`replay`. ``factor``: its
    drafts' ``max_spec_factor``."""

    def __init__(self, factor: float = float(K)) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=10_000)
        self.factor = factor

    def drafter(self, item_id: str) -> FrequencyTreeDrafter:
        self.cache.start_request(item_id, np.zeros(0, dtype=np.int32))
        return FrequencyTreeDrafter(self.cache, item_id, self.factor)

    def add(self, item_id: str, answer: Sequence[int]) -> None:
        self.cache.add_active_response(item_id, list(answer))
        self.cache.stop_request(item_id)


# ----------------------------------------------------------------------------- what a step costs
def least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``t = a + b T`` through ``(T, t)`` points.

    Example:
        >>> least_squares([(1, 3.0), (3, 7.0)])
        (1.0, 2.0)
    """
    n = len(points)
    mt, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    b = sum((p[0] - mt) * (p[1] - my) for p in points) / var if var > 0 else 0.0
    return my - b * mt, b


class LineCost:
    """A step scheduling ``tokens`` tokens costs ``1 + slope * tokens``, however many rows they are in."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def __call__(self, rows: int, tokens: int) -> float:
        return 1.0 + self.slope * tokens

    def line(self, rows: int) -> tuple[float, float]:
        return 1.0, self.slope


class TableCost:
    """Step times measured by rows and tokens per row (``benchmarks/experiments/gpu_step_costs.py``'s shapes), in
    units of a one-row plain step: piecewise linear in the tokens along each measured number of rows (a plain step of
    as many rows below the first point, the last two points' line beyond the last), linear in the rows between
    them."""

    def __init__(self, shapes: Sequence[dict[str, Any]]) -> None:
        unit = next(x["ms_median"] for x in shapes if x["rows"] == 1 and x["tokens_per_row"] == 1)
        self.points = {r: sorted((x["tokens"], x["ms_median"] / unit) for x in shapes if x["rows"] == r)
                       for r in sorted({x["rows"] for x in shapes})}
        self.lines = {r: least_squares(p) for r, p in self.points.items()}

    def _along(self, rows: int, tokens: float) -> float:
        pts = self.points[rows]
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, y0), (t1, y1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return y0 + (y1 - y0) * (tokens - t0) / (t1 - t0)
        (t0, y0), (t1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (tokens - t1) / (t1 - t0)

    def _bracket(self, rows: int) -> tuple[int, int, float]:
        measured = list(self.points)
        if rows <= measured[0]:
            return measured[0], measured[0], 0.0
        for lo, hi in zip(measured, measured[1:]):
            if rows <= hi:
                return lo, hi, (rows - lo) / (hi - lo)
        return measured[-1], measured[-1], 0.0

    def __call__(self, rows: int, tokens: int) -> float:
        lo, hi, w = self._bracket(rows)
        return (1 - w) * self._along(lo, tokens) + w * self._along(hi, tokens)

    def line(self, rows: int) -> tuple[float, float]:
        """The least-squares line of the measured steps of the nearest measured number of rows."""
        lo, hi, w = self._bracket(rows)
        return self.lines[hi if w >= 0.5 else lo]


#: The forward sizes (new tokens on a cached context) :func:`forward_costs` times by default.
SIZES = (1, 2, 3, 4, 6, 8, 11, 12, 16, 22, 24, 32)


def forward_costs(dec: Any, context: int, repeats: int, sizes: Sequence[int] = SIZES, *, pack_gqa: bool = True,
                  fast_linears: bool = True) -> dict[int, float]:
    """A forward of the transformers decoder ``dec`` over ``N`` tokens on a cached ``context``, relative to
    ``N = 1`` (which ``sizes`` must hold), for ``N`` in ``sizes``: round-robin, the first round a warm-up, the least
    disturbed of ``repeats`` (:func:`rag_accel.hf.steps.forward_seconds`). ``pack_gqa``, ``fast_linears``: the
    forward path, by default the decoder's own."""
    from rag_accel.hf.steps import forward_seconds

    seconds = forward_seconds(dec.steps, sizes, context, repeats, pack_gqa=pack_gqa, fast_linears=fast_linears)
    return {n: s / seconds[1] for n, s in seconds.items()}


def cost_of(costs: dict[int, float], n: int) -> float:
    """A forward over ``n`` tokens, linear between measured sizes.

    Example:
        >>> cost_of({1: 1.0, 4: 1.3}, 2)
        1.1
    """
    lo, hi = max(s for s in costs if s <= n), min(s for s in costs if s >= n)
    return costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)
