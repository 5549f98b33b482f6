"""Lossless sampling with copy drafts: speculative sampling where the draft
distribution is a point mass (q = one-hot on the drafted token).

For a drafted token x at a position whose target distribution is p: accept x with
probability p(x); on rejection, sample from p with x removed and renormalised,
and stop. If every draft token is accepted, the next token is sampled from p at
the position after the draft. Each emitted token is then distributed exactly as
p, whatever the draft (Leviathan et al. 2023 / Chen et al. 2023 with q = one-hot).
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


def accept_point_mass(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None) -> tuple[int, int]:
    """Verify ``draft`` against ``probs`` [len(draft) + 1, V]: (tokens accepted, next token).

    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    >>> accept_point_mass(p, [1, 2], None)      # certain tokens are always accepted
    (2, 0)
    >>> accept_point_mass(p, [0, 2], None)      # p(0) = 0 at the first position: rejected, resampled
    (0, 1)
    """
    n = len(draft)
    if n:
        idx = torch.tensor(draft, device=probs.device)
        p_draft = probs[torch.arange(n, device=probs.device), idx]  # [n]
        u = torch.rand(n, generator=generator, device=probs.device)
        accepted = int((u < p_draft).int().cumprod(0).sum())  # one host sync per step
    else:
        accepted = 0
    dist = probs[accepted]
    if accepted < n:  # rejected: sample from p without the drafted token
        dist = dist.clone()
        dist[draft[accepted]] = 0.0
        dist = dist / dist.sum()
    return accepted, int(torch.multinomial(dist, 1, generator=generator))
