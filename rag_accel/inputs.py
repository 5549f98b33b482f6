"""A request's inputs checked and encoded, the same way for every engine.

Prompts (text, chat messages, token ids), stop strings and lengths are checked
here, before any work, so a bad request is refused with a clear error and never
reaches a model. References follow their own rule, in :mod:`rag_accel.references`.
"""

from __future__ import annotations

import numbers
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> None:
    """Refuse text a tokenizer cannot encode: a lone surrogate (e.g. from bytes decoded with
    ``errors="surrogateescape"``) is not a character of valid Unicode."""
    found = _SURROGATE.search(text)
    if found:
        raise ValueError(
            f"{what} has an unencodable character at index {found.start()} (lone surrogate "
            f"U+{ord(found.group()):04X}); pass valid Unicode text, e.g. text.encode('utf-8', 'replace').decode()"
        )


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list (one string, a list of them, or ``None``; ``[]`` is none).

    An empty stop string is an error whether it is given alone (``""``) or in a list:
    it would match before any text.
    """
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, Iterable) and not isinstance(stop, (bytes, bytearray, Mapping)):
        stops = list(stop)
    else:
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop string {i} must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must be non-empty strings (an empty one would match before any text), "
                             f"got {s!r}; pass stop=None or [] for no stop strings")
        check_text(s, f"stop string {i}")
    return stops


def array_types() -> tuple[type, ...]:
    """The array types token ids may come in: numpy's, and torch's tensor once torch is imported (a tensor
    exists only then; this module never imports torch: the server's admission and the remote client read
    requests without it)."""
    torch = sys.modules.get("torch")
    return (np.ndarray,) if torch is None else (torch.Tensor, np.ndarray)


def _is_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)  # numpy integers too; np.bool_ is not


def _array_ids(a: torch.Tensor | np.ndarray, what: str) -> list[int]:
    """A 1-D integer tensor/array, or a batch of one ([1, S]), as token ids."""
    if not isinstance(a, np.ndarray):  # a torch tensor
        kind, integer = "a tensor", not (a.is_floating_point() or a.is_complex() or str(a.dtype) == "torch.bool")
    else:
        kind, integer = "an array", np.issubdtype(a.dtype, np.integer)
    if not integer:
        raise TypeError(f"{what} is {kind} of dtype {a.dtype}; token ids must be integers (e.g. .long())")
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise ValueError(f"{what} has shape {tuple(a.shape)}; give one prompt's token ids: 1-D, or [1, S] "
                         "(a batch of several is not supported: call once per prompt)")
    return a.tolist()


def token_ids(value: Any, what: str, expected: str = "a list of token ids") -> list[int]:
    """Token ids from a list/tuple of integers (numpy integers too) or an integer tensor/array."""
    if isinstance(value, array_types()):
        return _array_ids(value, what)
    if all(type(t) is int for t in value):  # the common case, at C speed
        return list(value)
    for i, t in enumerate(value):
        if not _is_id(t):
            if isinstance(t, numbers.Number):
                raise TypeError(f"{what}: token ids must be integers, got {type(t).__name__} {t} at position {i}")
            raise TypeError(f"{what} must be {expected}; its item {i} is {type(t).__name__}")
    return [int(t) for t in value]


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


#: The chat roles a message may have (OpenAI's and the chat templates' own).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_role(i: int, role: Any) -> None:
    """Refuse chat message ``i``'s role unless it is one of :data:`CHAT_ROLES` (a server's requests too)."""
    if role not in CHAT_ROLES:
        raise ValueError(f"chat message {i} has the role {role!r}; a role is one of "
                         + ", ".join(map(repr, CHAT_ROLES)))


def check_chat(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages checked (each has ``role``, one of :data:`CHAT_ROLES`, and ``content``; text encodable), as
    plain dicts.

    Example:
        >>> check_chat([{"role": "wizard", "content": "hi"}])
        Traceback (most recent call last):
        ...
        ValueError: chat message 0 has the role 'wizard'; a role is one of 'system', 'developer', 'user', 'assistant', 'tool'
        >>> check_chat([{"role": "user", "content": " "}])
        Traceback (most recent call last):
        ...
        ValueError: empty chat: no message has any content, nothing to condition on (as an empty prompt)
    """
    out = []
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
        check_role(i, m["role"])
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"chat message {i} {key!r}")
        out.append(dict(m))
    if not any(m["content"].strip() if isinstance(m["content"], str) else m["content"] for m in out):
        raise ValueError("empty chat: no message has any content, nothing to condition on (as an empty prompt)")
    return out


def _encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    messages = check_chat(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat messages given but the tokenizer has no chat template; pass a string")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    check_text(text, "the chat messages as the chat template rendered them")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    """Prompt as token ids: a string (encoded as is), chat messages (the tokenizer's
    chat template, with the generation prompt), or token ids (a list of integers, or a
    1-D / [1, S] integer tensor or numpy array)."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt is bytes; decode it to a string first (e.g. .decode('utf-8'))")
    elif is_chat(prompt):
        ids = _encode_chat(tokenizer, prompt)
    elif isinstance(prompt, (Sequence, *array_types())):
        ids = token_ids(prompt, "prompt", "a string, chat messages ({'role', 'content'}) or token ids")
    else:
        raise TypeError(
            "prompt must be a string, a list of chat messages ({'role', 'content'}) or a list of token ids, "
            f"got {type(prompt).__name__}"
        )
    if len(ids) == 0:
        raise ValueError("empty prompt: nothing to condition on (give at least one token)")
    check_ids(ids, "prompt", vocab_size)
    return ids


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
