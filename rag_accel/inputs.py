"""A request's inputs checked and encoded, the same way for every engine.

Prompts (text, chat messages, token ids), references, stop strings and lengths
are checked here, before any work, so a bad request is refused with a clear
error and never reaches a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list (one string, a list of them, or ``None``)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return stops


def encode_prompt(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    """Prompt as token ids: a string (encoded as is), chat messages (the
    tokenizer's chat template, with the generation prompt), or token ids."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for i, m in enumerate(prompt):
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat messages given but the tokenizer has no chat template; pass a string")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise TypeError(
            "prompt must be a string, a list of chat messages ({'role', 'content'}) or a list of token ids, "
            f"got {type(prompt).__name__}"
        )
    if len(ids) == 0:
        raise ValueError("empty prompt: nothing to condition on (give at least one token)")
    check_ids(ids, "prompt", vocab_size)
    return ids


def encode_references(tokenizer: Any, references: Any, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """References as token-id lists: strings are encoded without special tokens."""
    if references is None:
        return []
    if isinstance(references, str):
        references = [references]
    if not isinstance(references, Sequence):
        raise TypeError(
            f"references must be a list of strings or token-id lists, got {type(references).__name__}"
        )
    out: list[list[int]] = []
    for i, ref in enumerate(references):
        if isinstance(ref, str):
            out.append(tokenizer(ref, add_special_tokens=False)["input_ids"] if ref else [])
        elif isinstance(ref, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in ref):
            check_ids(ref, f"reference {i}", vocab_size)
            out.append(list(ref))
        else:
            hint = " (pass its .page_content / .text)" if hasattr(ref, "page_content") or hasattr(ref, "text") else ""
            raise TypeError(
                f"reference {i} must be a string or a list of token ids, got {type(ref).__name__}{hint}"
            )
    total = sum(len(r) for r in out)
    if total > max_tokens:
        raise ValueError(
            f"references hold {total} tokens, more than max_reference_tokens={max_tokens}; "
            "pass fewer or raise the limit in DecoderConfig"
        )
    return out


def check_ids(ids: Sequence[int], what: str, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} has token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def check_lengths(prompt_len: int, max_new_tokens: int, context_window: int | None) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if context_window is not None and prompt_len + max_new_tokens > context_window:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's context window of {context_window} tokens; "
            "shorten the prompt/references or lower max_new_tokens"
        )
