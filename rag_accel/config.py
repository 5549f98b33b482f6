"""Typed, validated decoding configuration."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The copy drafters: the continuation most earlier occurrences of the context's tail share (prompt + output:
# suffix decoding's choice), the references, prompt lookup, ANPD's n-gram tables.
COPY_DRAFTERS = ("frequency", "reference", "prompt_lookup", "ngram")
DRAFTER_NAMES = (*COPY_DRAFTERS, "draft_model")
# The default chain's copy drafters. Prompt lookup and the n-gram tables copy from the same text as the frequency
# drafter, and their drafts, valued by match-length rates, won the policy's choice over better frequency drafts:
# replayed on SmolLM2's answers to the sample's FIRST 50 items (benchmarks/experiments/suffix_replay.py), leaving them out
# gained 0.5% at a draft token costing 0.025 of a step and 1.5% at 0.1. The references stay: their text is
# not always in the prompt (whole documents behind its chunks, cached answers). They come first: the order
# decides only ties when the policy weighs the drafts (the same replay either way), and with adaptive=False
# the first draft is sent whole, LLMA's copy from the references as before.
DEFAULT_COPY_DRAFTERS = ("reference", "frequency")
# How the reference drafter chooses among the places its match occurs: "longest", LLMA's (the longest match, its
# earliest place, followed while accepted), or "counts", the continuation most of them share (suffix decoding's
# choice, over the references). LLMA's stays the default, by timing: counts drafted more per step where replayed
# (benchmarks/experiments/memory_replay.py, at vLLM's one-request step costs on the 2-core CPU, the sample's last 100: 1.941x
# against 1.921x as first asked, 2.184x against 2.121x where the client passes a cached answer), but timed on one
# vLLM engine request by request (benchmarks/config_ab.py, the last 48 items) it tied (1.000x; cached answer 1.008x)
# and lost 2.3% with 16 requests in flight (faster in 1 of 6 groups): each row's lookup reads up to 256 places
# every step, where LLMA's followed span costs ~1 us.
REFERENCE_CHOICES = ("counts", "longest")
# reference_min_match's default per choice, each the best measured: counts 1 (suffix decoding's too; memory_replay.py
# on the sample's first 50: 2.059x / 1.736x against 2.055x / 1.693x at 2), longest 2 (benchmarks/experiments/simulate.py: 1 lost
# 2-4%).
REFERENCE_MIN_MATCH = {"counts": 1, "longest": 2}

# Upper bounds of the integer options. Each protects time or memory that grows with the option;
# the defaults sit far below them.
MAX_DRAFT_TOKENS = 256
MAX_MATCH = 256
MAX_NGRAM = 16
MAX_REFERENCE_TOKENS = 16_000_000
MAX_FREQUENCY_FACTOR = 32.0

_WHY = {
    "draft": "a verification forward runs over 1 + max_draft_tokens tokens and the first call times forwards "
             "of up to that size; drafts that long are never accepted",
    "match": "each lookup compares up to this many tokens; a longer match tells the policy nothing more",
    "ngram": "the context is indexed under every n-gram size up to this, so memory and time per context token "
             "grow with it (~4 KB a token at 16)",
    "refs": "the references' index takes ~120 MB and ~1.5-3 s per million tokens, encoding text ~600 MB; "
            "retrieve fewer, shorter passages",
}
# field: (lowest, highest, why the highest)
_INT_BOUNDS = {
    "max_draft_tokens": (1, MAX_DRAFT_TOKENS, _WHY["draft"]),
    "reference_min_match": (1, MAX_MATCH, _WHY["match"]),
    "reference_max_match": (1, MAX_MATCH, _WHY["match"]),
    "prompt_lookup_min_ngram": (1, MAX_NGRAM, _WHY["ngram"]),
    "prompt_lookup_max_ngram": (1, MAX_NGRAM, _WHY["ngram"]),
    "ngram_min_n": (2, MAX_NGRAM, _WHY["ngram"]),
    "ngram_max_n": (2, MAX_NGRAM, _WHY["ngram"]),
    "max_reference_tokens": (1, MAX_REFERENCE_TOKENS, _WHY["refs"]),
}


def _is_int(value: Any) -> bool:
    """A real integer: ``int`` or a numpy integer, not a bool, a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounded_int(name: str, value: Any) -> int:
    lo, hi, why = _INT_BOUNDS[name]
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer >= {lo} and <= {hi} ({why}), got {value!r}")
    return int(value)


def _cost_curve(curve: Any, max_draft_tokens: int) -> tuple[float, ...]:
    if isinstance(curve, (str, bytes)) or not isinstance(curve, Iterable):
        raise ValueError(f"cost_curve must be a sequence of numbers (or None), got {type(curve).__name__}")
    curve = tuple(curve)
    if len(curve) > MAX_DRAFT_TOKENS + 1:
        raise ValueError(f"cost_curve has {len(curve)} entries; at most MAX_DRAFT_TOKENS + 1 = "
                         f"{MAX_DRAFT_TOKENS + 1} are used (entry L: a forward over 1 + L tokens)")
    if len(curve) < max_draft_tokens + 1:
        raise ValueError(f"cost_curve needs max_draft_tokens + 1 = {max_draft_tokens + 1} entries, got {len(curve)}")
    bad = next((c for c in curve if not (_is_real(c) and math.isfinite(c) and c > 0)), None)
    if bad is not None:
        raise ValueError(f"cost_curve entries must be finite numbers > 0, got {bad!r} (relative forward times)")
    return tuple(float(c) for c in curve)


@dataclass(frozen=True)
class DecoderConfig:
    """How drafts are made and how long they may be.

    Args:
        drafters: drafter names tried in order each step; the first non-empty
            draft is verified. Any of ``"frequency"`` (the continuation most
            earlier occurrences of the context's tail in prompt + output share,
            as vLLM's suffix decoding chooses; each draft token carries its
            probability from those counts), ``"reference"`` (LLMA copy from the
            references), ``"prompt_lookup"`` (copy from prompt + output so far)
            ``"ngram"`` (ANPD multi-level n-gram tables) and ``"draft_model"`` (the
            decoder's draft model, if it has one; skipped otherwise). With
            ``adaptive``, the draft model is asked only when no copy draft is
            worth sending (references first), and its window is chosen from the
            measured cost of a draft token and the learnt acceptance. Default:
            ``("reference", "frequency", "draft_model")`` (see
            ``DEFAULT_COPY_DRAFTERS``; prompt lookup and n-grams are opt-in).
        max_draft_tokens: upper bound on the tokens verified in one step;
            1..256 (``MAX_DRAFT_TOKENS``: a verification forward runs over
            ``1 + max_draft_tokens`` tokens and the first call times forwards
            of up to that size; drafts that long are never accepted).
        adaptive: choose each draft's length from the measured verification
            cost curve and the acceptance observed so far (may choose 0: a plain
            step). ``False`` always sends the whole draft (plain LLMA/PLD).
        reference_min_match / reference_max_match: shortest context suffix
            that may start a copy from the references, and the longest one
            the matcher looks at. Both 1..256 (``MAX_MATCH``: a lookup compares
            up to that many tokens). ``None`` (the default): the best measured
            for ``reference_choice`` (``REFERENCE_MIN_MATCH``): 1 with counts;
            2 with ``"longest"``, where replaying SmolLM2's own answers and the
            human answers of 40 MS-MARCO items (``benchmarks/experiments/simulate.py``),
            n=1 lost 2-4%.
        reference_choice: which continuation the references' drafter copies where
            its match occurs in several places: ``"longest"`` (default), LLMA's:
            the longest match's earliest place, followed while the model accepts
            it; ``"counts"``, the one most of them share, each draft token with
            its probability from the counts (``frequency_factor`` /
            ``frequency_min_prob`` cap it, as a frequency draft): more tokens per
            step where replayed, a tie timed at one request, 2.3% slower at 16 in
            flight on a 2-core CPU (``REFERENCE_CHOICES``).
        prompt_lookup_min_ngram / prompt_lookup_max_ngram: the same for
            prompt lookup; 1..16.
        frequency_factor / frequency_min_prob: a frequency draft is at most
            ``frequency_factor`` times its match long (in (0, 32]; less when
            draft tokens are dear: ``drafters.EVIDENCE_COST``) and stops
            where its probability falls under ``frequency_min_prob`` (in
            [0, 1]). 3 and 0.1: replaying SmolLM2's answers to the sample's
            FIRST 50 items (``benchmarks/experiments/suffix_replay.py``), factors 2.5-3
            did best and 0.07-0.15 alike; 0.1 is suffix decoding's default.
        ngram_min_n / ngram_max_n: ANPD table levels (N-grams), 2..16. N-gram sizes are
            bounded by ``MAX_NGRAM`` = 16: the context is indexed under every size up
            to the largest, so memory and time per context token grow with it.
        cost_curve: relative wall time of a verification forward over
            ``1 + L`` tokens, index ``L`` (``cost_curve[0] == 1``). ``None``
            measures it once for the model at hand. Finite positive numbers,
            ``max_draft_tokens + 1`` to ``MAX_DRAFT_TOKENS + 1`` of them.
        max_loss: the largest fraction of plain greedy time (prefill included)
            that failed drafts may cost one request before the policy stops
            drafting (adaptive mode); bounds the worst case on items where
            nothing copies. In [0, 1]: 1 already lets failed drafts double the time.
        min_gain: the margin a draft must promise over a plain step (adaptive mode): it is sent
            only if its expected tokens per unit of verify cost exceed a plain step's by this
            fraction. In [0, 1]; the loss budget (``max_loss``) bounds what a too-low margin can cost.
        draft_confidence: a draft model stops drafting when its probability for
            its next token falls below this (the first token is always drafted); in [0, 1).
        max_reference_tokens: refuse references longer than this (tokens,
            all references together) instead of running out of memory; 1..16M
            (``MAX_REFERENCE_TOKENS``: the index takes ~120 MB and 1.5-3 s per
            million tokens, ``rag-accel bench-drafting``; encoding text ~600 MB). Text that is certainly longer
            (from its length in characters) is refused before it is tokenised.
        pack_gqa: in verification forwards, let grouped-query attention read the
            cached keys/values in place instead of copying them per query head
            (see :mod:`rag_accel.hf.attention`); ``False`` runs the model's own SDPA path.
        pool_misses: scale every drafter's learnt first-token rate by how this
            request's drafts (sent or not) fared against those rates, pooled over
            drafters (see :mod:`rag_accel.policy`): a request where the model does
            not copy stops drafting after a few misses in all, not a few per drafter.
        fast_head: on a CPU in float32, compute the output projection of the
            decoder's forwards as ``weight @ hidden.T`` (see :mod:`rag_accel.hf.lm_head`):
            MKL runs it at full memory speed where ``hidden @ weight.T`` with 1-16
            rows does not; ``False`` runs the model's own ``nn.Linear``.

    Integer options must be integers (Python or numpy; not bools or floats), number
    options finite numbers, each within its bound; anything else is a ``ValueError``
    naming the option, its bound and why.
    """

    drafters: tuple[str, ...] = (*DEFAULT_COPY_DRAFTERS, "draft_model")
    max_draft_tokens: int = 32
    adaptive: bool = True
    reference_min_match: int | None = None
    reference_max_match: int = 32
    reference_choice: str = "longest"
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 4
    ngram_min_n: int = 2
    ngram_max_n: int = 5
    frequency_factor: float = 3.0
    frequency_min_prob: float = 0.1
    cost_curve: tuple[float, ...] | None = None
    max_loss: float = 0.03
    min_gain: float = 0.1
    draft_confidence: float = 0.4
    max_reference_tokens: int = 4_000_000
    pack_gqa: bool = True
    pool_misses: bool = True
    fast_head: bool = True

    def __post_init__(self) -> None:
        drafters = (self.drafters,) if isinstance(self.drafters, str) else self.drafters
        if not isinstance(drafters, Iterable):
            raise ValueError(f"drafters must be a list of drafter names from {list(DRAFTER_NAMES)}, "
                             f"got {type(drafters).__name__}")
        drafters = tuple(drafters)
        object.__setattr__(self, "drafters", drafters)
        unknown = [d for d in drafters if d not in DRAFTER_NAMES]
        if unknown:
            raise ValueError(f"unknown drafter(s) {unknown}; choose from {list(DRAFTER_NAMES)}")
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"drafters listed twice: {list(drafters)}")
        if not isinstance(self.reference_choice, str) or self.reference_choice not in REFERENCE_CHOICES:
            raise ValueError(f"reference_choice must be one of {list(REFERENCE_CHOICES)}, "
                             f"got {self.reference_choice!r}")
        for name in _INT_BOUNDS:
            if name != "reference_min_match" or self.reference_min_match is not None:
                object.__setattr__(self, name, _bounded_int(name, getattr(self, name)))
        if self.min_match > self.reference_max_match:
            raise ValueError(
                f"reference_min_match ({self.min_match}) > reference_max_match ({self.reference_max_match})"
            )
        if self.prompt_lookup_min_ngram > self.prompt_lookup_max_ngram:
            raise ValueError(
                f"prompt_lookup_min_ngram ({self.prompt_lookup_min_ngram}) > "
                f"prompt_lookup_max_ngram ({self.prompt_lookup_max_ngram})"
            )
        if self.ngram_min_n > self.ngram_max_n:
            raise ValueError(f"need 2 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if not (_is_real(self.max_loss) and 0 <= self.max_loss <= 1):  # NaN fails too
            raise ValueError(f"max_loss must be a number in [0, 1] (the fraction of plain greedy time failed "
                             f"drafts may cost; 1 already lets them double it), got {self.max_loss!r}")
        object.__setattr__(self, "max_loss", float(self.max_loss))
        if not (_is_real(self.min_gain) and 0 <= self.min_gain <= 1):
            raise ValueError(f"min_gain must be a number in [0, 1] (the margin a draft must promise over a plain "
                             f"step), got {self.min_gain!r}")
        object.__setattr__(self, "min_gain", float(self.min_gain))
        if not (_is_real(self.frequency_factor) and 0 < self.frequency_factor <= MAX_FREQUENCY_FACTOR):
            raise ValueError(f"frequency_factor must be a number > 0 and <= {MAX_FREQUENCY_FACTOR} (a frequency "
                             f"draft's length over its match's; longer drafts than 32 times the evidence are "
                             f"never accepted), got {self.frequency_factor!r}")
        object.__setattr__(self, "frequency_factor", float(self.frequency_factor))
        if not (_is_real(self.frequency_min_prob) and 0 <= self.frequency_min_prob <= 1):
            raise ValueError(f"frequency_min_prob must be a number in [0, 1] (where a frequency draft stops), "
                             f"got {self.frequency_min_prob!r}")
        object.__setattr__(self, "frequency_min_prob", float(self.frequency_min_prob))
        if not (_is_real(self.draft_confidence) and 0 <= self.draft_confidence < 1):
            raise ValueError(f"draft_confidence must be a number in [0, 1) (the probability a draft model's next "
                             f"token must reach), got {self.draft_confidence!r}")
        object.__setattr__(self, "draft_confidence", float(self.draft_confidence))
        for name in ("adaptive", "pack_gqa", "pool_misses", "fast_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cost_curve is not None:
            object.__setattr__(self, "cost_curve", _cost_curve(self.cost_curve, self.max_draft_tokens))

    @property
    def min_match(self) -> int:
        """The shortest match that starts a copy from the references: ``reference_min_match``, or where that
        is ``None`` the default for ``reference_choice`` (:data:`REFERENCE_MIN_MATCH`).

        Example:
            >>> DecoderConfig().min_match, DecoderConfig(reference_choice="counts").min_match
            (2, 1)
        """
        m = self.reference_min_match
        return REFERENCE_MIN_MATCH[self.reference_choice] if m is None else m

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes`` applied; unknown keys are an error, not ignored."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise ValueError(f"unknown decoder option(s) {unknown}; valid options: {sorted(valid)}")
        return dataclasses.replace(self, **changes)
