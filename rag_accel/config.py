"""Typed, validated decoding configuration: the few settings a user has a reason to tune.

Every other number the drafting uses is a constant beside the measurement that chose it
(:mod:`rag_accel.drafters`: match lengths and the frequency drafter's factor; :mod:`rag_accel.policy`:
the margin a draft must promise; :mod:`rag_accel.hf`: the forward paths). What left the config, and why,
is in ``docs/configuration.md``.
"""

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
# The default chain. Prompt lookup and the n-gram tables copy from the same text as the frequency drafter, and
# their drafts, valued by match-length rates, won the policy's choice over better frequency drafts: replayed on
# SmolLM2's answers to the sample's FIRST 50 items (benchmarks/experiments/suffix_replay.py), leaving them out gained 0.5% at
# a draft token costing 0.025 of a step and 1.5% at 0.1. The references stay: their text is not always in the
# prompt (whole documents behind its chunks, cached answers). They come first: the order decides only ties when
# the policy weighs the drafts, and with adaptive=False the first draft is sent whole (LLMA's copy). A draft model
# is opt-in (``"draft_model"`` added to ``drafters``, with a draft model loaded): measured at 1.39x greedy against
# 1.38x without it on SmolLM2 (benchmarks/results/bench_cpu_smollm2_draft_models.md), 0.67x alone on Gemma.
DEFAULT_COPY_DRAFTERS = ("reference", "frequency")

# One name for the draft length everywhere: max_draft_tokens (DecoderConfig's field, VllmDecoder's and the CLI's
# option, the result JSON); vLLM's own name for it, num_speculative_tokens, appears only where its API takes it
# (rag_accel.vllm.requests.speculative_config). A vLLM engine's default, the same on every way in (rag-accel serve,
# VllmDecoder, the bench): the peers at 10 and at 24 (vLLM's own default for suffix decoding) on the sample's last
# 16 items, benchmarks/results/bench_vllm_cpu_smollm2_last16x64_k10.md and _k24.md. A vLLM engine allocates its
# draft buffers for this many tokens a row at start, hence a lower bound than the transformers decoder's.
VLLM_DRAFT_TOKENS = 10
VLLM_MAX_DRAFT_TOKENS = 64

# Upper bounds of the integer options. Each protects time or memory that grows with the option;
# the defaults sit far below them.
MAX_DRAFT_TOKENS = 256
MAX_REFERENCE_TOKENS = 16_000_000
# rag-accel serve's default: RAG documents are thousands of tokens; an untrusted client gets no more than this.
SERVE_MAX_REFERENCE_TOKENS = 32_768

# field: (lowest, highest, why the highest)
_INT_BOUNDS = {
    "max_draft_tokens": (1, MAX_DRAFT_TOKENS, "a verification forward runs over 1 + max_draft_tokens tokens and "
                         "the first call times forwards of up to that size; drafts that long are never accepted"),
    "max_reference_tokens": (1, MAX_REFERENCE_TOKENS, "the references' index takes ~120 MB and ~1.5-3 s per "
                             "million tokens, encoding text ~600 MB; retrieve fewer, shorter passages"),
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
        drafters: the drafters asked each step, in order: ``"reference"`` (LLMA: copy from the
            request's references), ``"frequency"`` (the continuation most earlier occurrences of the
            context's tail share, as vLLM's suffix decoding chooses), ``"prompt_lookup"``, ``"ngram"``
            (ANPD's tables) and ``"draft_model"`` (the decoder's draft model; needs one loaded).
            Default ``("reference", "frequency")``; the others are opt-in.
        max_draft_tokens: the most draft tokens verified in one step, 1..256. On vLLM the engine's
            own ``max_draft_tokens`` (``VllmDecoder.from_pretrained``, ``rag-accel serve -k``) caps it.
        adaptive: choose each draft's length from the measured verify cost and the acceptance seen so
            far (0: a plain step). ``False`` sends every draft whole (plain LLMA / prompt lookup).
        cost_curve: the relative time of a verify forward over ``1 + L`` tokens, entry ``L``
            (``max_draft_tokens + 1`` finite numbers > 0). ``None``: measured once for the model at
            hand (transformers); give one for reproducible runs or a device you measured.
        max_loss: the fraction of plain greedy time that failed drafts may cost one request before
            drafting stops for it, in [0, 1]: the bound on the worst case where nothing copies.
        max_reference_tokens: refuse references longer than this (tokens, all of a request's
            together) instead of running out of memory, 1..16M.

    Anything else is a ``ValueError`` naming the option, its bound and why.

    Example:
        >>> DecoderConfig().drafters
        ('reference', 'frequency')
        >>> DecoderConfig(max_draft_tokens=0)
        Traceback (most recent call last):
        ...
        ValueError: max_draft_tokens must be an integer >= 1 and <= 256 (a verification forward runs over 1 + max_draft_tokens tokens and the first call times forwards of up to that size; drafts that long are never accepted), got 0
    """

    drafters: tuple[str, ...] = DEFAULT_COPY_DRAFTERS
    max_draft_tokens: int = 32
    adaptive: bool = True
    cost_curve: tuple[float, ...] | None = None
    max_loss: float = 0.03
    max_reference_tokens: int = 4_000_000

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
        for name in _INT_BOUNDS:
            object.__setattr__(self, name, _bounded_int(name, getattr(self, name)))
        if not (_is_real(self.max_loss) and 0 <= self.max_loss <= 1):  # NaN fails too
            raise ValueError(f"max_loss must be a number in [0, 1] (the fraction of plain greedy time failed "
                             f"drafts may cost; 1 already lets them double it), got {self.max_loss!r}")
        object.__setattr__(self, "max_loss", float(self.max_loss))
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {self.adaptive!r}")
        if self.cost_curve is not None:
            object.__setattr__(self, "cost_curve", _cost_curve(self.cost_curve, self.max_draft_tokens))

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes`` applied; unknown keys are an error, not ignored."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise ValueError(f"unknown decoder option(s) {unknown}; valid options: {sorted(valid)}")
        return dataclasses.replace(self, **changes)
