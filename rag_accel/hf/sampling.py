"""Lossless sampling with drafts: drafter-invariant speculative sampling (Gumbel-max coupling).

Every output position j owns one Gumbel noise vector g_j, drawn in order from the
seed. The model's token at j is ``argmax(scores_j + g_j)`` (``scores``: its logits
after temperature / top-k / top-p), which is an exact draw from its sampling
distribution p_j (the Gumbel-max trick). A draft is verified as in greedy decoding,
against these tokens: the longest matching prefix is accepted, plus the model's token
after it. So the output never depends on the drafts, and a seed reproduces it
whatever the drafting policy has learnt.

* A copy draft (references, prompt lookup, n-grams) is a point mass on a token d:
  it is accepted with probability p(d), and on rejection the token follows p
  without d, renormalised: exactly speculative sampling with q = one-hot
  (Leviathan et al. 2023; Chen et al. 2023).
* A draft model with distribution q draws its token with the SAME noise:
  ``argmax(log q_j + g_j)``. Its token is distributed as q and agrees with the
  model's with probability at least (1 - TV) / (1 + TV), TV the total-variation
  distance between p and q, against 1 - TV for the standard accept/resample rule
  (Daliri et al. 2024, "Coupling without communication and drafter-invariant
  speculative decoding"). The standard rule would make a seeded output depend on
  the draft lengths the adaptive policy picks; this one does not.

The transformers engine's (the settings act through transformers' own logits warpers); vLLM samples
and verifies drafts itself.
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
    return torch.softmax(warp(logits, warpers), dim=-1)


class GumbelNoise:
    """One Gumbel(0, 1) vector of the vocabulary size per output position, drawn in
    position order from one CPU generator (same seed, same noise, on any device).
    Rows are kept only while they may still be asked for (:meth:`forget_before`)."""

    def __init__(self, vocab_size: int, seed: int | None, device: torch.device | str = "cpu") -> None:
        self.vocab_size, self.device = int(vocab_size), torch.device(device)
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)
        self._rows: dict[int, torch.Tensor] = {}
        self._drawn = 0  # positions drawn so far

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Noise for output positions ``start .. stop - 1``: [stop - start, V] on the device."""
        if start < 0 or stop < start:
            raise ValueError(f"bad noise range [{start}, {stop})")
        if start < self._drawn and start not in self._rows:
            raise ValueError(f"noise for position {start} was already forgotten")
        fresh = []
        while self._drawn < stop:
            e = torch.empty(self.vocab_size).exponential_(generator=self._gen)  # Exp(1)
            fresh.append(e.log_().neg_())  # -log Exp(1) ~ Gumbel(0, 1)
            self._drawn += 1
        if fresh:
            new = torch.stack(fresh).to(self.device)
            for k, row in enumerate(new, start=self._drawn - len(fresh)):
                self._rows[k] = row
        return torch.stack([self._rows[k] for k in range(start, stop)]) if stop > start else \
            torch.empty(0, self.vocab_size, device=self.device)

    def forget_before(self, position: int) -> None:
        for k in [k for k in self._rows if k < position]:
            del self._rows[k]


def warp(logits: torch.Tensor, warpers: Sequence) -> torch.Tensor:
    """Row-wise processed scores (float32): ``logits`` [S, V] -> [S, V]; -inf outside top-k / top-p."""
    scores = logits.float()
    for w in warpers:  # these warpers act on each row alone; input_ids are not read
        scores = w(None, scores)
    return scores


def gumbel_argmax(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One sample per row from ``softmax(scores)``: ``argmax(scores + noise)``, [S, V] -> [S].

    >>> scores = torch.tensor([[0.0, float("-inf"), 1.0]])
    >>> gumbel_argmax(scores, torch.tensor([[5.0, 9.0, 0.0]])).tolist()   # -inf is never picked
    [0]
    """
    return (scores + noise).argmax(-1)


def model_sampling(given: dict | None, model: object) -> Sampling | None:
    """A request's sampling (:func:`~rag_accel.protocol.sampling_request`'s; ``None``: greedy), the values it leaves
    unset taken from the model's generation config, as ``generate(do_sample=True)`` takes them."""
    if given is None:
        return None
    gen_cfg = getattr(model, "generation_config", None)

    def given_or_model(name: str, fallback: object) -> object:
        if name in given:
            return given[name]
        model_value = getattr(gen_cfg, name, None)
        return fallback if model_value is None else model_value

    return Sampling(temperature=given_or_model("temperature", 1.0), top_k=given_or_model("top_k", None),
                    top_p=given_or_model("top_p", None), seed=given.get("seed"))
