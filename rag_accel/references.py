"""A request's references and answers, from what it gave to the drafters that copy from them: the reference rule
(checking, counting, the tokenizer's bounds, tokenising, the size limit) and one set-up, for both engines (the
transformers decoder and the vLLM proposer) and the server's admission.

- **One limit rule.** References and answers together hold at most ``max_reference_tokens``
  tokens: token ids count as they are, text as the tokens it encodes to. It is applied where it
  can first be told: before any tokenising, by :func:`certain_tokens` (ids counted,
  text by its tokenizer's lower bound), then exactly, as
  :func:`tokenize_references` counts. A call is refused; a request that a vLLM
  worker already runs is drafted without them (a warning says so).
- **One threshold, one unit.** References of up to :data:`WAITED_REFERENCE_SIZE` characters of
  text plus token ids are indexed before the request's first draft (a few milliseconds: less
  than a step); larger ones off the hot path, joining the request's drafting when ready.
- **One component**: :class:`ReferenceSetUp` tokenises (through a :class:`TokenCache`),
  counts and indexes, inline or on a thread the engine gives it, and hands the drafters over.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .drafters import Drafter, reference_drafter
from .inputs import array_types, check_ids, check_text, token_ids
from .memory import answers_drafter

__all__ = ["WAITED_REFERENCE_SIZE", "ReferenceSetUp", "TextBound", "TokenCache", "certain_tokens", "check_reference",
           "check_references", "check_request_references", "encode_references", "max_chars_per_token", "may_exceed",
           "min_tokens",            "reference_drafters", "text_bound", "tokenize_references", "tokenizer_json_bound"]

#: A request's references (and answers) of up to this many characters of text or token ids in all are
#: tokenised and indexed before its first draft, by either engine: a few milliseconds, less than a step.
#: Larger ones are indexed off the hot path and join the request's drafting when they are ready, so that
#: no token waits for them.
WAITED_REFERENCE_SIZE = 8192


# --- the reference rule: checking, counting, bounds, tokenising ---------------------------------------------

def check_reference(ref: Any, i: int, vocab_size: int, what: str = "reference") -> str | list[int]:
    """One reference (or ``what``: an answer) checked: its text, or its token ids."""
    if isinstance(ref, str):
        check_text(ref, f"{what} {i}")
        return ref
    if isinstance(ref, (bytes, bytearray)):
        raise TypeError(f"{what} {i} is bytes; decode it to a string first (e.g. .decode('utf-8'))")
    if isinstance(ref, (Sequence, *array_types())):
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


def check_request_references(tokenizer: Any, references: Any, answers: Any, vocab_size: int, max_tokens: int,
                             cache: TokenCache | None = None) -> tuple[list[str | list[int]], list[str | list[int]]]:
    """A request's references and earlier answers, checked (:func:`check_references`) and, where only tokenising
    tells whether together they pass ``max_tokens``, tokenised now so that the request is refused before it runs
    (other texts are tokenised while the prompt is prefilled)."""
    refs = check_references(tokenizer, references, vocab_size, max_tokens)
    given = check_references(tokenizer, answers, vocab_size, max_tokens, "answers")
    if may_exceed([*refs, *given], max_tokens):
        ids = tokenize_references(tokenizer, [*refs, *given], max_tokens, cache=cache)
        refs, given = ids[:len(refs)], ids[len(refs):]
    return refs, given


#: References past this many tokens in one request get a warning: they are accepted (up to
#: ``max_reference_tokens``), but tokenising and indexing them costs each request seconds.
LARGE_REFERENCE_TOKENS = 250_000


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
    if total > LARGE_REFERENCE_TOKENS:
        warnings.warn(f"references hold {total} tokens: tokenising and indexing them costs each request seconds "
                      "before drafting helps (retrieve fewer, shorter passages; a document the answer copies "
                      "from is usually a few thousand tokens)", stacklevel=3)
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


# --- the drafters a request's references and answers set up -----------------------------------------------------

def reference_drafters(ref_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]]) -> list[Drafter]:
    """A request's drafters over its references (:func:`~rag_accel.drafters.reference_drafter`) and
    the answers it brings (drafted as the memory of answers: :func:`~rag_accel.memory.answers_drafter`).

    Example:
        >>> [d.name for d in reference_drafters([[1, 2, 3]], [[4, 5, 6]])]
        ['reference', 'memory']
        >>> reference_drafters([[]], [])
        []
    """
    found = [reference_drafter(ref_ids) if any(ref_ids) else None, answers_drafter(answer_ids)]
    return [d for d in found if d is not None]


class ReferenceSetUp:
    """One request's references and answers (checked: :func:`~rag_accel.references.check_references`)
    tokenised, counted against ``max_tokens`` and indexed as its drafters.

    ``tokenizer``: called for the tokenizer when text needs one (a vLLM worker loads its own lazily).
    :attr:`waited`: small enough to run before the first draft (:data:`WAITED_REFERENCE_SIZE`);
    :meth:`run` does the work where it is called (the engine's set-up thread, its step when
    ``waited``); :meth:`take` hands the drafters over once, without waiting (``None`` before they are
    ready), raising what the work raised; :meth:`stop` tells the work the request needs it no more.

    Example:
        >>> setup = ReferenceSetUp([[1, 2, 3]], [], tokenizer=None, max_tokens=10)
        >>> setup.waited, setup.take()
        (True, None)
        >>> setup.run(); [d.name for d in setup.take()], setup.take()
        (['reference'], [])
    """

    def __init__(self, refs: Sequence[str | Sequence[int]], answers: Sequence[str | Sequence[int]],
                 tokenizer: Callable[[], Any] | None, max_tokens: int, cache: TokenCache | None = None) -> None:
        self.refs, self.answers = list(refs), list(answers)
        self.waited = sum(len(r) for r in [*self.refs, *self.answers]) <= WAITED_REFERENCE_SIZE
        self.seconds = 0.0  # the work's time
        self._tokenizer, self._max_tokens, self._cache = tokenizer, max_tokens, cache
        self._drafters: list[Drafter] | None = None
        self._error: BaseException | None = None
        self._done, self._stop = threading.Event(), threading.Event()

    @property
    def done(self) -> bool:
        """Whether :meth:`run` has finished (its drafters, or its error, are ready to take)."""
        return self._done.is_set()

    def run(self) -> None:
        """Tokenise (refusing more than ``max_tokens`` as soon as the running count passes it), then
        index; what it raises, :meth:`take` raises. Stops early, with no drafters, after :meth:`stop`."""
        t0 = time.perf_counter()
        try:
            texts = any(isinstance(r, str) and r for r in [*self.refs, *self.answers])
            tokenizer = self._tokenizer() if texts and self._tokenizer is not None else None
            ids = tokenize_references(tokenizer, [*self.refs, *self.answers], self._max_tokens, self._stop.is_set,
                                      self._cache)
            n = len(self.refs)
            self._drafters = [] if self._stop.is_set() else reference_drafters(ids[:n], ids[n:])
        except BaseException as e:  # noqa: BLE001 - handed to the engine by take()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`run` to finish (at most ``timeout`` seconds): whether it has."""
        return self._done.wait(timeout)

    def take(self) -> list[Drafter] | None:
        """The drafters, once they are ready (``[]`` after the first take); ``None`` before."""
        if not self._done.is_set():
            return None
        if self._error is not None:
            error, self._error = self._error, None
            self._drafters = []
            raise error
        drafters, self._drafters = self._drafters or [], []
        return drafters

    def stop(self) -> None:
        self._stop.set()
