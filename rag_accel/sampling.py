"""Lossless sampling with copy drafts: speculative sampling where the draft
distribution is a point mass (q = one-hot on the drafted token).

For a drafted token x at a position whose target distribution is p: accept x with
probability p(x); on rejection, sample from p with x removed and renormalised,
and stop. If every draft token is accepted, the next token is sampled from p at
the position after the draft. Each emitted token is then distributed exactly as
p, whatever the draft (Leviathan et al. 2023 / Chen et al. 2023 with q = one-hot).

:func:`sample_positions` implements this with one uniform per output position
(inverse-CDF sampling, then the greedy-style longest matching prefix), which has
exactly these acceptance and rejection laws and makes a seeded output independent
of the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Sampling settings, processed as ``generate(do_sample=True, ...)`` does:
    temperature, then top-k, then top-p (transformers' own logits warpers)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature!r} "
                             "(use greedy decoding, do_sample=False, for temperature 0)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def warpers(self) -> list:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out: list = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k is not None:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(float(self.top_p)))
        return out


def probabilities(logits: torch.Tensor, warpers: Sequence) -> torch.Tensor:
    """Row-wise target distributions: ``logits`` [S, V] -> probabilities [S, V] (float32)."""
    scores = logits.float()
    for w in warpers:  # these warpers act on each row alone; input_ids are not read
        scores = w(None, scores)
    return torch.softmax(scores, dim=-1)


def sample_positions(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Inverse-CDF sampling, one token per row: ``probs`` [S, V], ``u`` [S] uniforms in [0, 1).

    Each output position owns one uniform, drawn up front from the seed. Verifying a
    draft against these tokens (accept the longest prefix equal to them, as in greedy
    decoding) is point-mass speculative sampling with coupled randomness: a draft token
    d is accepted with probability p(d), and on rejection the token is distributed as p
    without d, renormalised. The output is also the same whatever the drafts were, so a
    seed reproduces it even though the drafting policy learns between calls.

    >>> p = torch.tensor([[0.0, 0.25, 0.75], [0.5, 0.0, 0.5]])
    >>> sample_positions(p, torch.tensor([0.0, 0.6]))   # u = 0 never picks a zero-probability token
    [1, 2]
    >>> sample_positions(p, torch.tensor([0.2, 0.49]))
    [1, 0]
    """
    cdf = probs.cumsum(-1)  # [S, V]
    target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [S, 1], below the total mass
    return torch.searchsorted(cdf, target, side="right").squeeze(-1).tolist()
