"""A request's inputs checked and encoded, the same way for every engine.

Prompts (text, chat messages, token ids), references, stop strings and lengths
are checked here, before any work, so a bad request is refused with a clear
error and never reaches a model.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def _arrays() -> tuple[type, ...]:
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
    if isinstance(value, _arrays()):
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


def check_chat(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages checked (each has ``role`` and ``content``; text encodable), as plain dicts."""
    out = []
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"chat message {i} {key!r}")
        out.append(dict(m))
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
    elif isinstance(prompt, (Sequence, *_arrays())):
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


def check_reference(ref: Any, i: int, vocab_size: int, what: str = "reference") -> str | list[int]:
    """One reference (or ``what``: an answer) checked: its text, or its token ids."""
    if isinstance(ref, str):
        check_text(ref, f"{what} {i}")
        return ref
    if isinstance(ref, (bytes, bytearray)):
        raise TypeError(f"{what} {i} is bytes; decode it to a string first (e.g. .decode('utf-8'))")
    if isinstance(ref, (Sequence, *_arrays())):
        ids = token_ids(ref, f"{what} {i}", "a string or a list of token ids")
        check_ids(ids, f"{what} {i}", vocab_size)
        return ids
    hint = " (pass its .page_content / .text)" if hasattr(ref, "page_content") or hasattr(ref, "text") else ""
    raise TypeError(f"{what} {i} must be a string or a list of token ids, got {type(ref).__name__}{hint}")


def encode_references(tokenizer: Any, references: Any, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """References as token-id lists: strings are encoded without special tokens.

    More than ``max_tokens`` in all is refused as early as can be told: text whose
    length in characters alone proves it too long (see :func:`max_chars_per_token`)
    before any tokenising, otherwise as soon as the running total passes the limit
    (references are encoded one at a time).
    """
    return tokenize_references(tokenizer, check_references(tokenizer, references, vocab_size, max_tokens),
                               max_tokens)


def check_references(tokenizer: Any, references: Any, vocab_size: int, max_tokens: int,
                     what: str = "references") -> list[str | list[int]]:
    """The checks of :func:`encode_references` that need no tokenising: each reference's type
    and ids, and text that is certainly too long. Returns the references, texts untokenised.
    ``what``: their name in errors (``"answers"``: a request's earlier answers, checked alike)."""
    if references is None:
        return []
    if isinstance(references, str):
        references = [references]
    if not isinstance(references, Sequence):
        raise TypeError(
            f"{what} must be a list of strings or token-id lists, got {type(references).__name__}"
        )
    refs = [check_reference(ref, i, vocab_size, what[:-1]) for i, ref in enumerate(references)]
    _refuse_certainly_too_long(tokenizer, refs, max_tokens)
    return refs


def may_exceed(refs: Sequence[str | list[int]], max_tokens: int) -> bool:
    """Whether tokenising ``refs`` (from :func:`check_references`) could still pass ``max_tokens``:
    when it cannot (a token covers at least one character), their tokenising may be deferred
    without deferring a refusal."""
    return sum(len(r) for r in refs) > max_tokens


class TokenCache:
    """The token ids of reference texts tokenised lately, by text: the last ``max_tokens`` tokens'
    worth, least recently used first out (int32, ~4 bytes a token). A passage that comes back (the
    next turn of a conversation, a document many questions retrieve) is tokenised once. Safe to
    share between threads.

    Example:
        >>> cache = TokenCache(max_tokens=3)
        >>> cache.put("a b", [5, 6]); cache.get("a b")
        [5, 6]
        >>> cache.put("c d", [7, 8]); cache.get("a b") is None   # over 3 tokens: the oldest is out
        True
    """

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0  # held now
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._items.get(text)
            if ids is None:
                return None
            self._items.move_to_end(text)
        return ids.tolist()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.tokens = 0

    def put(self, text: str, ids: Sequence[int]) -> None:
        if len(ids) > self.max_tokens:
            return
        arr = np.asarray(ids, dtype=np.int32)
        with self._lock:
            old = self._items.pop(text, None)
            self.tokens += len(arr) - (0 if old is None else len(old))
            self._items[text] = arr
            while self.tokens > self.max_tokens:
                self.tokens -= len(self._items.popitem(last=False)[1])


def tokenize_references(tokenizer: Any, refs: Sequence[str | list[int]], max_tokens: int,
                        stop: Callable[[], bool] | None = None,
                        cache: TokenCache | None = None) -> list[list[int]]:
    """Checked references (:func:`check_references`) as token-id lists, refusing more than
    ``max_tokens`` in all as soon as the running total passes it. ``stop``: asked before each
    text; when it says so, what was tokenised so far is returned (the request no longer needs it).
    ``cache``: texts tokenised before are taken from it, new ones go into it."""
    out: list[list[int]] = []
    total = 0
    for i, ref in enumerate(refs):
        if isinstance(ref, str):
            if stop is not None and stop():
                return out
            ids = cache.get(ref) if cache is not None and ref else None
            if ids is None:
                # (the tokenizer's call releases the GIL while Rust encodes, as encode_batch does; its
                # backend's single encode holds it, which would stop the prefill beside this thread)
                ids = tokenizer(ref, add_special_tokens=False)["input_ids"] if ref else []
                if cache is not None and ref:
                    cache.put(ref, ids)
        else:
            ids = ref
        out.append(ids)
        total += len(ids)
        if total > max_tokens:
            more = "at least " if i < len(refs) - 1 else ""
            raise ValueError(f"references hold {more}{total} tokens, more than max_reference_tokens={max_tokens}; "
                             "pass fewer or raise the limit in DecoderConfig")
    return out


def _refuse_certainly_too_long(tokenizer: Any, refs: Sequence[str | list[int]], max_tokens: int) -> None:
    """Refuse, before tokenising, text that certainly has more tokens than the room left."""
    id_tokens = sum(len(r) for r in refs if not isinstance(r, str))
    texts = [r for r in refs if isinstance(r, str)]
    chars = sum(len(t) for t in texts)
    if chars == 0 or chars <= max_tokens - id_tokens:  # a token covers >= 1 character: nothing proven
        return
    bound = text_bound(tokenizer)
    if bound is None:
        return
    at_least = certain_tokens(refs, bound)
    if at_least > max_tokens:
        ids = f" and {id_tokens} token ids" if id_tokens else ""
        raise ValueError(
            f"references hold {chars} characters of text{ids}: at least {at_least} tokens for this tokenizer "
            f"(a token covers at most {bound[0]} characters), more than max_reference_tokens={max_tokens}; "
            "pass fewer or raise the limit in DecoderConfig"
        )


TextBound = tuple[int, re.Pattern[str] | None]


def certain_tokens(refs: Sequence[str | Sequence[int]], bound: TextBound | None) -> int:
    """The tokens ``refs`` hold for certain, before any tokenising: token ids as they are, text by
    the tokenizer's lower bound (``bound``: :func:`text_bound`; ``None``, no bound known: text counts
    for nothing until it is tokenised). The one count both engines refuse by before tokenising
    (:mod:`rag_accel.references`).

    Example:
        >>> certain_tokens(["a" * 100, [1, 2, 3]], (10, None))
        13
        >>> certain_tokens(["a" * 100, [1, 2, 3]], None)
        3
    """
    return sum(len(r) if not isinstance(r, str) else (min_tokens(r, bound) if bound else 0) for r in refs)


def min_tokens(text: str, bound: TextBound) -> int:
    """A lower bound on the tokens of ``text`` (no special tokens), from :func:`text_bound`."""
    per_token, dropped = bound
    chars = len(text)
    if dropped is not None and dropped.search(text):
        chars -= sum(1 for _ in dropped.finditer(text))
    return -(-chars // per_token)


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input text one token covers (see :func:`text_bound`), or ``None``."""
    bound = text_bound(tokenizer)
    return None if bound is None else bound[0]


# How many input characters a normaliser may turn into one: NFC composes at most 4 code points
# (the longest canonical decomposition) into one; Prepend and Replace(" ", "▁") never shrink text.
_NFC_SHRINK = 4


def text_bound(tokenizer: Any) -> TextBound | None:
    """``(chars_per_token, dropped)``: every token covers at most ``chars_per_token``
    characters of the input, not counting characters matching ``dropped`` (those the
    tokenizer may encode as nothing; ``None``: none); so
    ``(len(text) - #dropped) / chars_per_token`` is a lower bound on the token count,
    whatever the text. ``None`` where no such bound is certain.

    Certain only for fast BPE tokenizers that cannot remove text or fold a run of it
    into one token: byte-level or with byte fallback, no normaliser other than NFC /
    Prepend / a non-shrinking Replace, no pre-tokenizer that removes text, and no added
    token that strips whitespace around it. A token then covers at most as many
    characters as its vocabulary string is long (a byte-level symbol is one byte, so at
    most one character), times the normaliser's shrink factor. Bytes missing from the
    vocabulary are dropped (SmolLM2 has no symbol for 6 control characters, and a token
    merges across them): characters holding one count for nothing.
    """
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    return tokenizer_json_bound(spec)


def tokenizer_json_bound(spec: Any) -> TextBound | None:
    """:func:`text_bound` from a fast tokenizer's specification (its ``tokenizer.json``, parsed), where no
    tokenizer is loaded (``rag-accel serve`` reads the served model's file: it loads neither torch nor
    transformers)."""
    try:
        model = spec["model"]
        shrink = _normalizer_shrink(spec.get("normalizer"))
        pre = _pre_tokenizer_types(spec.get("pre_tokenizer"))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    vocab = model.get("vocab")
    added = spec.get("added_tokens") or []
    if (model.get("type") != "BPE" or shrink is None or pre is None or not isinstance(vocab, dict) or not vocab
            or any(a.get("lstrip") or a.get("rstrip") for a in added)):
        return None
    if "ByteLevel" in pre:
        missing = {b for b, symbol in enumerate(_BYTE_SYMBOLS) if symbol not in vocab}
    elif model.get("byte_fallback"):
        missing = {b for b in range(256) if f"<0x{b:02X}>" not in vocab}
    else:
        return None
    dropped = _chars_with_bytes(missing)
    if dropped is None or (dropped and (shrink != 1 or "Metaspace" in pre)):
        return None  # text that changes before it is split: no cheap way to tell what is dropped
    longest = max(max(len(t) for t in vocab), max((len(a["content"]) for a in added), default=0))
    return shrink * longest, re.compile(f"[{dropped}]") if dropped else None


def _byte_symbols() -> list[str]:
    """The byte-level symbol of each byte 0..255 (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbols = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    return [symbols[b] for b in range(256)]


_BYTE_SYMBOLS = _byte_symbols()


def _chars_with_bytes(missing: set[int]) -> str | None:
    """A regex character class (without brackets; "" for none) of the characters whose UTF-8
    encoding holds a byte of ``missing``; ``None`` if a continuation byte is missing (too
    many scattered ranges)."""
    missing = {b for b in missing if not (b in (0xC0, 0xC1) or b >= 0xF5)}  # never in UTF-8
    if any(0x80 <= b <= 0xBF for b in missing):
        return None
    ranges = []
    for b in sorted(missing):
        if b < 0x80:
            lo, size = b, 1
        elif b < 0xE0:
            lo, size = (b & 0x1F) << 6, 1 << 6
        elif b < 0xF0:
            lo, size = (b & 0x0F) << 12, 1 << 12
        else:
            lo, size = (b & 0x07) << 18, 1 << 18
        ranges.append(f"\\U{lo:08x}-\\U{lo + size - 1:08x}")
    return "".join(ranges)


def _normalizer_shrink(spec: Any) -> int | None:
    if spec is None:
        return 1
    kind = spec["type"]
    if kind == "Sequence":
        factors = [_normalizer_shrink(s) for s in spec["normalizers"]]
        return None if None in factors else math.prod(factors)
    if kind == "NFC":
        return _NFC_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace" and "String" in spec["pattern"]:
        return 1 if len(spec["content"]) >= len(spec["pattern"]["String"]) else None
    return None


# Pre-tokenizers that split text without removing any of it.
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def _pre_tokenizer_types(spec: Any) -> set[str] | None:
    if spec is None:
        return set()
    kind = spec["type"]
    if kind == "Sequence":
        kinds = [_pre_tokenizer_types(s) for s in spec["pretokenizers"]]
        return None if None in kinds else set().union(*kinds)
    if kind not in _KEEPING or spec.get("behavior") == "Removed":
        return None
    return {kind}


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
