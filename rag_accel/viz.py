"""Where an answer's tokens came from: each forward pass's tokens, and the passage a
copied run appears in, as data and as HTML (for notebooks)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .outputs import GenerationOutput

COLORS = {"reference": "#b7e4c7", "frequency": "#e9d5ff", "prompt_lookup": "#bde0fe", "ngram": "#ffe5a8",
          "draft_model": "#fbcfe8"}


@dataclass(frozen=True)
class Span:
    """Tokens produced by one forward pass: ``copied`` accepted draft tokens from
    ``source`` (``""``: none), then the model's own next token. ``passage`` is the
    index of the first reference that contains the copied tokens (``None`` if none does)."""

    source: str
    tokens: list[int]
    copied: int
    passage: int | None


def find_in(haystacks: Sequence[Sequence[int]], needle: Sequence[int]) -> int | None:
    """Index of the first token list that contains ``needle`` contiguously.

    >>> find_in([[1, 2, 3], [4, 5, 6, 7]], [5, 6])
    1
    >>> find_in([[1, 2, 3]], [3, 1]) is None
    True
    """
    n = len(needle)
    if n == 0:
        return None
    first = needle[0]
    for i, h in enumerate(haystacks):
        for j in range(len(h) - n + 1):
            if h[j] == first and list(h[j:j + n]) == list(needle):
                return i
    return None


def copy_spans(output: GenerationOutput, references: Sequence[Sequence[int]]) -> list[Span]:
    """The output split by forward pass, each copied run located in ``references`` (token ids)."""
    spans = []
    for source, tokens in output.steps():
        copied = max(len(tokens) - 1, 0) if source else 0
        spans.append(Span(source, tokens, copied, find_in(references, tokens[:copied]) if copied else None))
    return spans


def steps_html(output: GenerationOutput, tokenizer: Any, passages: Sequence[str]) -> str:
    """The answer with each run of accepted draft tokens highlighted by drafter, linked to
    the passage it appears in, followed by the passages themselves (anchors ``passage-N``)."""
    ref_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in passages]
    decode = lambda ids: html.escape(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    parts = []
    for s in copy_spans(output, ref_ids):
        if s.copied:
            where = f"passage {s.passage + 1}" if s.passage is not None else "not in the passages"
            body = decode(s.tokens[: s.copied])
            tip = f"{s.copied} tokens from {s.source}, {where}"
            span = (f'<span style="background:{COLORS.get(s.source, "#eee")};border-radius:3px" '
                    f'title="{tip}">{body}</span>')
            if s.passage is not None:
                span = f'<a href="#passage-{s.passage + 1}" style="color:inherit;text-decoration:none">{span}</a>'
            parts.append(span)
        parts.append(decode(s.tokens[s.copied:]))
    seen = {s.source for s in copy_spans(output, ref_ids) if s.copied}
    legend = " ".join(f'<span style="background:{COLORS.get(k, "#eee")};padding:0 4px">{k}</span>'
                      for k in sorted(seen, key=lambda k: list(COLORS).index(k) if k in COLORS else len(COLORS)))
    legend = legend or "(none accepted)"
    st = output.stats
    head = (f"<p><b>{st.new_tokens} tokens in {st.steps} forward passes ({st.tokens_per_step:.2f} tokens/step)</b>; "
            f"highlighted: accepted draft tokens by drafter {legend}; unhighlighted: one token per pass from the "
            "model itself. Hover for details, click to jump to the passage.</p>")
    body = f'<div style="line-height:1.8;font-family:sans-serif">{"".join(parts)}</div>'
    refs = "".join(f'<li id="passage-{i}"><small>{html.escape(p)}</small></li>' for i, p in enumerate(passages, 1))
    return head + body + f"<details><summary>passages</summary><ol>{refs}</ol></details>"
