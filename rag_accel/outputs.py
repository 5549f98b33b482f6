"""What a generation call returns, whichever engine ran it: text, token ids and stats."""

from __future__ import annotations

import reprlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from .prediction import REFERENCE_SOURCE

_short = reprlib.Repr()
_short.maxstring = 80  # text in a repr: its start and end
_short.maxlist = 8


@dataclass
class GenerationStats:
    """What one call did. ``steps`` counts model forward passes, prefill included,
    so plain greedy decoding has ``tokens_per_step == 1``.

    ``None`` means the engine cannot tell (a remote server, :class:`~rag_accel.serving.remote.RemoteDecoder`:
    an OpenAI-compatible response has no per-request steps or draft counts); ``tokens_per_step``
    and ``acceptance_rate`` are then ``None`` too, never a made-up number."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int | None = 0
    drafted: int | None = 0  # draft tokens sent for verification
    accepted: int | None = 0  # of those, accepted
    by_drafter: dict[str, dict[str, int]] = field(default_factory=dict)
    finish_reason: str = ""  # "eos" | "stop" | "length"
    time_s: float = 0.0
    prefill_s: float | None = 0.0  # to the first token: the prefill, and in a shared engine any wait for it
    draft_s: float | None = 0.0  # drafting + choosing the length (host side)
    calibration_s: float = 0.0  # one-off measurement of the cost curve, if this call did it
    setup_s: float | None = 0.0  # per-request set-up: tokenising the references, building the drafters
    setup_wait_s: float | None = 0.0  # what of it outlasted the prefill it runs beside (delayed the first token)
    # OpenAI's Predicted Outputs counts (rag_accel.prediction): draft tokens copied from the request's
    # references (its prediction's parts and references given beside them) that verification kept / threw away.
    accepted_prediction_tokens: int | None = 0
    rejected_prediction_tokens: int | None = 0
    # Per forward pass: (drafter whose draft was verified, "" for none; tokens that step produced:
    # accepted draft tokens + the model's own next one). The last entry may exceed what a stop kept.
    trace: list[tuple[str, int]] = field(default_factory=list)

    def record_step(self, source: str, drafted: int, accepted: int) -> None:
        """A verify step: ``drafted`` tokens of ``source``'s draft sent (``""``, 0: a plain step),
        ``accepted`` of them kept (the step also produced the model's own next token)."""
        self.steps += 1
        self.trace.append((source, accepted + 1))
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            row = self.by_drafter.setdefault(source, {"steps": 0, "drafted": 0, "accepted": 0})
            row["steps"] += 1
            row["drafted"] += drafted
            row["accepted"] += accepted
            if source == REFERENCE_SOURCE:
                self.accepted_prediction_tokens += accepted
                self.rejected_prediction_tokens += drafted - accepted

    @property
    def tokens_per_step(self) -> float | None:
        if self.steps is None:
            return None
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        if self.drafted is None or self.accepted is None:
            return None
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_step"] = self.tokens_per_step
        d["acceptance_rate"] = self.acceptance_rate
        return d

    def __repr__(self) -> str:
        # One readable line: the per-step trace (one entry per forward pass) is summarised by its
        # length; ``stats.trace`` / ``to_dict()`` have it whole.
        times = ", ".join(f"{k}={getattr(self, k):.3f}" for k in ("time_s", "setup_s", "prefill_s", "draft_s",
                                                                      "calibration_s")
                          if getattr(self, k))
        return (f"GenerationStats(new_tokens={self.new_tokens}, steps={self.steps}, "
                f"tokens_per_step={'None' if self.tokens_per_step is None else f'{self.tokens_per_step:.2f}'}, "
                f"drafted={self.drafted}, accepted={self.accepted}, "
                f"by_drafter={self.by_drafter}, finish_reason={self.finish_reason!r}, "
                f"prompt_tokens={self.prompt_tokens}{', ' + times if times else ''}, trace=<{len(self.trace)} steps>)")


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    def __repr__(self) -> str:
        return (f"GenerationOutput(text={_short.repr(self.text)}, token_ids=<{len(self.token_ids)} ids>, "
                f"stats={self.stats!r})")

    def steps(self) -> list[tuple[str, list[int]]]:
        """The output split by forward pass: (drafter whose draft was verified, ``""`` for a
        plain step; the tokens that pass produced). Joined, the tokens are ``token_ids``."""
        out, i = [], 0
        for source, n in self.stats.trace:
            if i >= len(self.token_ids):
                break
            out.append((source, self.token_ids[i:i + n]))
            i += n
        return out


class GenerationStream:
    """Iterate to get text pieces; ``.output`` holds the full result once the
    iteration has ended."""

    def __init__(self, gen: Iterator[str]) -> None:
        self._gen = gen
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        result = yield from self._gen
        if result is not None:  # iterating an exhausted stream again keeps the output
            self.output = result

    def close(self) -> None:
        self._gen.close()
