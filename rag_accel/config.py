"""Typed, validated decoding configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DRAFTER_NAMES = ("reference", "prompt_lookup", "ngram", "draft_model")


@dataclass(frozen=True)
class DecoderConfig:
    """How drafts are made and how long they may be.

    Args:
        drafters: drafter names tried in order each step; the first non-empty
            draft is verified. Any of ``"reference"`` (LLMA copy from the
            references), ``"prompt_lookup"`` (copy from prompt + output so far)
            ``"ngram"`` (ANPD multi-level n-gram tables) and ``"draft_model"`` (the
            decoder's draft model, if it has one; skipped otherwise). With
            ``adaptive``, the draft model is asked only when no copy draft is
            worth sending (references first), and its window is chosen from the
            measured cost of a draft token and the learnt acceptance.
        max_draft_tokens: upper bound on the tokens verified in one step.
        adaptive: choose each draft's length from the measured verification
            cost curve and the acceptance observed so far (may choose 0: a plain
            step). ``False`` always sends the whole draft (plain LLMA/PLD).
        reference_min_match / reference_max_match: shortest context suffix
            that may start a copy from the references, and the longest one
            the matcher looks at. 2 by measurement: replaying SmolLM2's own
            answers and the human answers of 40 MS-MARCO items
            (``benchmarks/simulate.py``), n=2 gave the best modelled speed-up
            of the adaptive chain on both (n=1 lost 2-4%).
        prompt_lookup_min_ngram / prompt_lookup_max_ngram: the same for
            prompt lookup.
        ngram_min_n / ngram_max_n: ANPD table levels (N-grams, N >= 2).
        cost_curve: relative wall time of a verification forward over
            ``1 + L`` tokens, index ``L`` (``cost_curve[0] == 1``). ``None``
            measures it once for the model at hand.
        max_loss: the largest fraction of plain greedy time (prefill included)
            that failed drafts may cost one request before the policy stops
            drafting (adaptive mode); bounds the worst case on items where
            nothing copies.
        draft_confidence: a draft model stops drafting when its probability for
            its next token falls below this (the first token is always drafted).
        max_reference_tokens: refuse references longer than this (tokens,
            all references together) instead of running out of memory.
        pack_gqa: in verification forwards, let grouped-query attention read the
            cached keys/values in place instead of copying them per query head
            (see :mod:`rag_accel.attention`); ``False`` runs the model's own SDPA path.
        pool_misses: scale every drafter's learnt first-token rate by how this
            request's drafts (sent or not) fared against those rates, pooled over
            drafters (see :mod:`rag_accel.policy`): a request where the model does
            not copy stops drafting after a few misses in all, not a few per drafter.
        fast_head: on a CPU in float32, compute the output projection of the
            decoder's forwards as ``weight @ hidden.T`` (see :mod:`rag_accel.lm_head`):
            MKL runs it at full memory speed where ``hidden @ weight.T`` with 1-16
            rows does not; ``False`` runs the model's own ``nn.Linear``.
    """

    drafters: tuple[str, ...] = DRAFTER_NAMES
    max_draft_tokens: int = 32
    adaptive: bool = True
    reference_min_match: int = 2
    reference_max_match: int = 32
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 4
    ngram_min_n: int = 2
    ngram_max_n: int = 5
    cost_curve: tuple[float, ...] | None = None
    max_loss: float = 0.03
    draft_confidence: float = 0.4
    max_reference_tokens: int = 4_000_000
    pack_gqa: bool = True
    pool_misses: bool = True
    fast_head: bool = True

    def __post_init__(self) -> None:
        drafters = tuple(self.drafters)
        object.__setattr__(self, "drafters", drafters)
        unknown = [d for d in drafters if d not in DRAFTER_NAMES]
        if unknown:
            raise ValueError(f"unknown drafter(s) {unknown}; choose from {list(DRAFTER_NAMES)}")
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"drafters listed twice: {list(drafters)}")
        for name in (
            "max_draft_tokens",
            "reference_min_match",
            "reference_max_match",
            "prompt_lookup_min_ngram",
            "prompt_lookup_max_ngram",
            "max_reference_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.reference_min_match > self.reference_max_match:
            raise ValueError(
                f"reference_min_match ({self.reference_min_match}) > reference_max_match ({self.reference_max_match})"
            )
        if self.prompt_lookup_min_ngram > self.prompt_lookup_max_ngram:
            raise ValueError(
                f"prompt_lookup_min_ngram ({self.prompt_lookup_min_ngram}) > "
                f"prompt_lookup_max_ngram ({self.prompt_lookup_max_ngram})"
            )
        if not 2 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(f"need 2 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if not isinstance(self.max_loss, (int, float)) or not 0 <= self.max_loss:
            raise ValueError(f"max_loss must be a number >= 0, got {self.max_loss!r}")
        if not isinstance(self.draft_confidence, (int, float)) or not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence!r}")
        for name in ("adaptive", "pack_gqa", "pool_misses", "fast_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cost_curve is not None:
            curve = tuple(float(c) for c in self.cost_curve)
            if len(curve) < self.max_draft_tokens + 1:
                raise ValueError(
                    f"cost_curve needs max_draft_tokens + 1 = {self.max_draft_tokens + 1} entries, got {len(curve)}"
                )
            if any(c <= 0 for c in curve):
                raise ValueError("cost_curve entries must be positive")
            object.__setattr__(self, "cost_curve", curve)

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes`` applied; unknown keys are an error, not ignored."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise ValueError(f"unknown decoder option(s) {unknown}; valid options: {sorted(valid)}")
        return dataclasses.replace(self, **changes)
