"""Draft-model drafters: a small causal LM proposes the next tokens autoregressively.

Unlike the copy drafters these cost real compute per drafted token, so the
decoder asks them only when no copy draft is worth sending (references first)
and picks their window from the measured cost of a draft token and the learnt
acceptance (see :meth:`DraftLengthPolicy.model_window`). Within a window,
drafting stops early when the draft model's probability for its own token
falls below ``confidence`` (as transformers' ``assistant_confidence_threshold``).

* :class:`ModelDrafter`: same tokenizer as the target. Keeps its own KV cache
  over the context; rejected draft tokens are rolled back lazily at the next
  proposal (only the positions that differ are recomputed).
* :class:`UniversalDrafter`: a draft model with a different tokenizer
  (universal assisted generation): the context reaches it as text, re-tokenised
  incrementally with a look-behind window, and its draft returns as text,
  re-tokenised by the target's tokenizer after a look-behind of target tokens.

Greedy decoding stays lossless whatever they propose. With sampling, a
same-tokenizer draft model draws its tokens with the decoder's Gumbel noise for
each position (coupled speculative sampling, :mod:`rag_accel.hf.sampling`); a
different-vocabulary one drafts greedily (a point-mass draft).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any

import torch

# Where a draft model stops drafting: its probability for its next token under 0.4 (the first token is always
# drafted). transformers' assistant_confidence_threshold default; never retuned (draft models are opt-in).
DRAFT_CONFIDENCE = 0.4

from ..drafters import NO_DRAFT, Draft
from .kv import cache_kwarg, context_window, new_cache, rollback_cache
from .linears import planned_linears
from ..policy import leading_matches
from .sampling import GumbelNoise, warp
from ..stopping import IncrementalDetokenizer


def check_model(model: Any, what: str) -> None:
    if not hasattr(model, "forward") or not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"{what} must be a Hugging Face causal LM, got {type(model).__name__}")


class ModelDrafter:
    """A small causal LM with the target's tokenizer drafts the next tokens.

    Example:
        >>> drafter = ModelDrafter(small_model, confidence=0.4)  # doctest: +SKIP
        >>> decoder.generate(prompt, drafters=[drafter])          # doctest: +SKIP
    """

    name = "draft_model"
    costly = True  # the decoder consults it only when no cheap draft is sent

    def __init__(self, model: Any, *, confidence: float = DRAFT_CONFIDENCE) -> None:
        check_model(model, "draft model")
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence!r}")
        self.model, self.confidence = model, float(confidence)
        self.device = next(model.parameters()).device
        self._cache = new_cache(model)
        self._cached: list[int] = []  # the ids whose keys/values are in the cache
        self._synced = 0  # leading ids of _cached known to equal the context
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = cache_kwarg(model)
        self._warpers: list = []
        self._noise: GumbelNoise | None = None
        self._first_position = 0  # context length at output position 0
        self._context: Sequence[int] | None = None
        self.context_window = context_window(model)
        self.fed = 0  # ids fed by the last catch-up
        self.token_s: float | None = None  # measured time of one drafted token, last proposal
        self.sync_s = 0.0  # time of the last catch-up forward (over `fed` ids)

    def behind(self, context: Sequence[int]) -> int:
        """Context ids the cache would have to catch up on before drafting after ``context``."""
        if context is not self._context:
            return len(context)
        return len(context) - min(self._synced, len(self._cached))

    def bind_sampling(self, warpers: Sequence, noise: GumbelNoise, prompt_len: int) -> None:
        """Sample drafts with the decoder's settings and per-position noise. A draft model whose
        logits are wider or narrower than the target's drafts greedily instead (still lossless)."""
        self._warpers, self._noise, self._first_position = list(warpers), noise, prompt_len

    def _start(self, context: Sequence[int]) -> None:
        """A new request (the decoder passes one context list per request): forget the old cache."""
        if context is not self._context:
            self._context = context
            self._cache = new_cache(self.model)
            self._cached, self._synced = [], 0

    def time_steps(self, context: Sequence[int], repeats: int = 3) -> tuple[float, float]:
        """Seconds per token of a prefill of ``context`` (what catching up on a prompt costs) and of a one-token
        step after it (the least disturbed of ``repeats``), timed now on a fresh cache; the cache is left empty."""
        with torch.inference_mode():
            self._forward(context[:8])  # (the first forward of all pays set-ups)
            self._context, self._cache, self._cached, self._synced = None, new_cache(self.model), [], 0
            t0 = time.perf_counter()
            self._forward(context)
            catchup = (time.perf_counter() - t0) / len(context)
            steps = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                self._forward(context[:1])
                steps.append(time.perf_counter() - t0)
            self._cache = new_cache(self.model)
        return catchup, min(steps)

    def _forward(self, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # [1, S]
        kwargs: dict[str, Any] = {self._cache_kwarg: self._cache, "use_cache": True}
        if self._keep:
            kwargs["logits_to_keep"] = 1
        with planned_linears():  # (the decoder planned the draft model's projections, on a CPU)
            return self.model(input_ids=x, **kwargs).logits[0, -1]  # [V_draft]

    def _sync(self, ids: Sequence[int], stable: int) -> torch.Tensor:
        """Bring the cache to ``ids[:-1]`` + feed the rest; logits after ``ids``.

        ``stable``: leading ids known unchanged since the last call (the cache is
        compared from there on, so a sync costs O(new ids), not O(context))."""
        start = min(stable, len(self._cached))
        common = start + leading_matches(self._cached[start:], ids[start:])
        common = min(common, len(ids) - 1)  # at least one id is fed: its logits are needed
        rollback_cache(self._cache, len(self._cached) - common)
        del self._cached[common:]
        feed = list(ids[common:])
        self.fed = len(feed)
        logits = self._forward(feed)
        self._cached.extend(feed)
        return logits

    def draft(self, ids: Sequence[int], max_len: int, stable: int, position: int | None = None) -> list[int]:
        """Up to ``max_len`` tokens after ``ids``; ``position``: output index of the first
        one (for the sampling noise), ``None`` drafts greedily. Nothing once the context
        outgrows the draft model's own context window (the target may have a longer one)."""
        if self.context_window is not None:
            max_len = min(max_len, self.context_window - len(ids))
        if max_len <= 0:
            self.token_s, self.fed, self.sync_s = None, 0, 0.0
            return []
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = self._sync(ids, stable)
            t1 = time.perf_counter()
            tokens: list[int] = []
            forwards = 0
            sampled = self._noise is not None and position is not None and logits.shape[-1] == self._noise.vocab_size
            for i in range(max_len):
                if sampled:
                    scores = warp(logits[None], self._warpers)  # [1, V]
                    noise = self._noise.rows(position + i, position + i + 1)
                    tok = int((scores + noise).argmax())
                    conf = float(torch.softmax(scores[0], -1)[tok])
                else:
                    probs = torch.softmax(logits.float(), -1)
                    conf, tok_t = probs.max(-1)
                    tok, conf = int(tok_t), float(conf)
                if tokens and conf < self.confidence:
                    break
                tokens.append(tok)
                if i + 1 < max_len:
                    logits = self._forward([tok])
                    self._cached.append(tok)
                    forwards += 1
        # Per drafted token, as one-token forwards cost it (the catch-up forward over new
        # context ids is excluded: after a long gap, e.g. the prompt, it costs far more).
        self.sync_s = t1 - t0
        loop = time.perf_counter() - t1
        self.token_s = loop / forwards if forwards else t1 - t0
        if not forwards and self.fed > 4:
            self.token_s = None  # only a catch-up was timed
        return tokens

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if max_len <= 0:
            return NO_DRAFT
        self._start(context)
        position = len(context) - self._first_position if self._noise is not None else None
        tokens = self.draft(context, max_len, self._synced, position)
        self._synced = len(context)
        return Draft(tokens, 0, self.name) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        """Nothing to do eagerly: the cache catches up (and drops rejected tokens) at the next proposal."""


class UniversalDrafter:
    """A draft model with a different tokenizer (universal assisted generation).

    The target's context is detokenised incrementally; the new text is
    re-tokenised by the draft tokenizer starting ``look_behind`` draft tokens
    back (token boundaries near the end may move as text arrives). The draft's
    text is re-tokenised by the target tokenizer after the last ``look_behind``
    target tokens, and kept only where those re-tokenise to themselves.

    Example:
        >>> drafter = UniversalDrafter(other_model, other_tokenizer, target_tokenizer)  # doctest: +SKIP
    """

    name = "draft_model"
    costly = True

    def __init__(self, model: Any, draft_tokenizer: Any, target_tokenizer: Any, *, confidence: float = DRAFT_CONFIDENCE,
                 look_behind: int = 8) -> None:
        for tok, what in ((draft_tokenizer, "draft_tokenizer"), (target_tokenizer, "target_tokenizer")):
            if not callable(tok) or not callable(getattr(tok, "decode", None)):
                raise TypeError(f"{what} must be a Hugging Face tokenizer, got {type(tok).__name__}")
        if not getattr(draft_tokenizer, "is_fast", False):
            raise ValueError("the draft tokenizer must be a fast tokenizer (character offsets are needed)")
        if not isinstance(look_behind, int) or look_behind < 1:
            raise ValueError(f"look_behind must be an integer >= 1, got {look_behind!r}")
        self.inner = ModelDrafter(model, confidence=confidence)
        self.draft_tokenizer, self.target_tokenizer, self.look_behind = draft_tokenizer, target_tokenizer, look_behind
        self._detok = IncrementalDetokenizer(target_tokenizer)
        self._seen = 0  # target context tokens turned into text
        self._text = ""  # the tail of the context's text still needed for re-tokenising
        self._text_start = 0  # absolute character index of _text[0]
        self._a_ids: list[int] = []  # draft-vocabulary ids of the context's text
        self._a_starts: list[int] = []  # character where each of them starts
        self._stable = 0  # leading _a_ids unchanged since the inner drafter last saw them
        self._context: Sequence[int] | None = None

    @property
    def token_s(self) -> float | None:
        return self.inner.token_s

    @property
    def fed(self) -> int:
        return self.inner.fed

    @property
    def sync_s(self) -> float:
        return self.inner.sync_s

    def behind(self, context: Sequence[int]) -> int:
        """Target ids not yet absorbed (about as many draft ids to catch up on)."""
        return len(context) - self._seen if context is self._context else len(context)

    def bind_sampling(self, warpers: Sequence, noise: GumbelNoise, prompt_len: int) -> None:
        """Different vocabularies cannot share the noise: drafts stay greedy (point masses), still lossless."""

    def _absorb(self, context: Sequence[int]) -> None:
        if context is not self._context:  # a new request: start over
            self._context, self._detok, self._seen, self._text = context, IncrementalDetokenizer(self.target_tokenizer), 0, ""
            self._a_ids, self._a_starts, self._stable, self._text_start = [], [], 0, 0
            self.inner._context = None
        piece = "".join(self._detok.push(t) for t in context[self._seen:])
        self._seen = len(context)
        if not piece:
            return
        self._text += piece
        keep = max(0, len(self._a_ids) - self.look_behind)
        base = self._a_starts[keep] if keep < len(self._a_starts) else self._text_start  # absolute characters
        enc = self.draft_tokenizer(self._text[base - self._text_start:], add_special_tokens=False,
                                   return_offsets_mapping=True)
        del self._a_ids[keep:], self._a_starts[keep:]
        self._a_ids.extend(enc["input_ids"])
        self._a_starts.extend(base + s for s, _ in enc["offset_mapping"])
        self._stable = min(self._stable, keep)
        # Text before the next look-behind's start is never re-read: drop it (O(window) per step, not O(context)).
        cut = self._a_starts[max(0, len(self._a_ids) - self.look_behind)] if self._a_ids else self._text_start
        self._text, self._text_start = self._text[cut - self._text_start:], cut

    def propose(self, context: Sequence[int], max_len: int) -> Draft:
        if max_len <= 0:
            return NO_DRAFT
        self._absorb(context)
        if not self._a_ids:
            return NO_DRAFT
        self.inner._start(self._a_ids)
        a_draft = self.inner.draft(self._a_ids, max_len, self._stable)
        self._stable = len(self._a_ids)
        if not a_draft:
            return NO_DRAFT
        tail = self._a_ids[-self.look_behind:]
        dec = self.draft_tokenizer.decode
        before = dec(tail, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        after = dec(tail + a_draft, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if not after.startswith(before) or len(after) == len(before):
            return NO_DRAFT
        draft_text = after[len(before):].rstrip("\ufffd")
        t_tail = list(context[-self.look_behind:])
        t_text = self.target_tokenizer.decode(t_tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        enc = self.target_tokenizer(t_text + draft_text, add_special_tokens=False)["input_ids"]
        if enc[: len(t_tail)] != t_tail:  # the boundary moved: the look-behind does not re-tokenise to itself
            return NO_DRAFT
        tokens = enc[len(t_tail):][:max_len]
        return Draft(tokens, 0, self.name) if tokens else NO_DRAFT

    def update(self, context: Sequence[int], num_new: int) -> None:
        """Text is absorbed lazily, at the next proposal."""


def new_drafter(draft_model: Any, draft_tokenizer: Any, tokenizer: Any, universal: bool) -> Any:
    """A request's drafter over ``draft_model``: :class:`UniversalDrafter` where its tokenizer is its own."""
    if universal:
        return UniversalDrafter(draft_model, draft_tokenizer, tokenizer, confidence=DRAFT_CONFIDENCE)
    return ModelDrafter(draft_model, confidence=DRAFT_CONFIDENCE)
