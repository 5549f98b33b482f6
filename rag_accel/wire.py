"""A request's JSON form: the one schema in which a request's rag_accel inputs travel to a vLLM engine.

:class:`RequestArgs` is written by :class:`~rag_accel.vllm.VllmDecoder` (``SamplingParams.extra_args``, in
process) and :class:`~rag_accel.serving.remote.RemoteDecoder` (the body's ``vllm_xargs``, over HTTP), and read back,
checked, by the server's admission and the worker's rows (:meth:`rag_accel.vllm.requests.ServerSettings.read`).
The schema is versioned (:data:`SCHEMA_VERSION`, under :data:`SCHEMA_KEY`): a reader refuses a request written for
another. Pure Python, no engine: the HTTP client needs it without vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import COPY_DRAFTERS, DEFAULT_COPY_DRAFTERS, MAX_REFERENCE_TOKENS, DecoderConfig
from .memory import check_scope
from .references import TextBound, certain_tokens

__all__ = ["REQUEST_FIELDS", "SCHEMA_KEY", "SCHEMA_KEYS", "SCHEMA_VERSION", "WORKER_BASE", "RequestArgs",
           "request_config"]


# DecoderConfig fields one request may change (read from extra_args["rag_accel"]); the others are the engine's.
# (cost_curve is the transformers decoder's: a vLLM engine learns its step costs as it runs.)
REQUEST_FIELDS = frozenset({"drafters", "adaptive", "max_loss", "max_reference_tokens", "max_draft_tokens"})
# The config every row of a vLLM engine starts from; a request's changes are relative to it, so a client's
# decoder-level config travels as its differences from this (RequestArgs.changes).
WORKER_BASE = DecoderConfig(drafters=DEFAULT_COPY_DRAFTERS)


def request_config(base: DecoderConfig, changes: Any) -> DecoderConfig:
    """``base`` with one request's changes (a dict of :data:`REQUEST_FIELDS`), checked; ``ValueError``
    naming what is wrong (a server answers it with HTTP 400).

    Example:
        >>> request_config(WORKER_BASE, {"max_loss": 0.1}).max_loss
        0.1
    """
    if changes is None:
        return base
    if not isinstance(changes, Mapping):
        raise ValueError(f"extra_args['rag_accel'] must be a dict of DecoderConfig changes, "
                         f"got {type(changes).__name__}")
    _check_changes(changes, changes.get("drafters"), "extra_args['rag_accel']")
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_args['rag_accel']: {e}") from e


def _check_changes(changed: Any, drafters: Any, what: str) -> None:
    """Refuse changes a request cannot make: fields outside :data:`REQUEST_FIELDS`, and a draft model."""
    unknown = sorted(set(changed) - REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"{what} has keys {unknown} a request cannot change (a vLLM engine's rows share them); "
                         f"choose from {sorted(REQUEST_FIELDS)}")
    if "draft_model" in (drafters or ()):
        raise ValueError(f"the vLLM proposer has no draft model: drafters may be "
                         f"{', '.join(map(repr, COPY_DRAFTERS))}")


#: The request schema: the keys below, in ``SamplingParams.extra_args`` (in process) and the body's ``vllm_xargs``
#: (over HTTP). Our writers (:meth:`RequestArgs.extra_args`) put its version under :data:`SCHEMA_KEY`; a reader
#: refuses another version, and takes a request without one (a hand-written ``vllm_xargs``) as this version.
SCHEMA_KEY = "rag_accel_schema"
SCHEMA_VERSION = 1
# Every key of the schema. (``prediction`` and ``prediction_error`` are written by the server's Predicted Outputs
# middleware, rag_accel.vllm.predictions; ``rag_accel_id`` is a request's id in an engine of this process.)
SCHEMA_KEYS = frozenset({SCHEMA_KEY, "references", "reference_ids", "answers", "answer_ids", "prediction",
                         "prediction_error", "speculate", "rag_accel", "memory_scope", "rag_accel_id"})


@dataclass(frozen=True)
class RequestArgs:
    """A request's rag_accel inputs as they travel to a vLLM engine, in one schema (:data:`SCHEMA_VERSION`):
    written by :meth:`extra_args` (in process) or :meth:`extra_args(http=True) <extra_args>` (the body's
    ``vllm_xargs``, whose values may only be strings, numbers and flat lists of them), read back from either, and
    checked, by :meth:`read`: the server's admission and the worker's rows read a request through it, once each.

    - ``references``: strings or token-id lists, in order (over HTTP the ids travel as ``reference_ids``, a JSON
      string of id lists, after the strings); a request's ``prediction`` (its text parts) joins them on reading;
    - ``answers``: earlier answers the request brings, alike (``answers`` / ``answer_ids``);
    - ``speculate``: ``False``: no drafting for this request (``0``/``1`` over HTTP read alike);
    - ``config``: the row's :class:`DecoderConfig`: :data:`WORKER_BASE` with the request's changes
      (``rag_accel``: the :data:`REQUEST_FIELDS` that differ, a dict, or over HTTP a JSON string of one);
    - ``memory_scope``: the scope whose earlier answers it drafts from and joins (read: the server's default
      scope, ``rag-accel serve --memory-scope``, where a request names none).

    Example:
        >>> args = RequestArgs(("a passage", (5, 6)), speculate=False, config=WORKER_BASE.replace(max_loss=0.1))
        >>> xargs = args.extra_args(http=True)
        >>> xargs["reference_ids"], xargs["rag_accel"]
        ('[[5,6]]', '{"max_loss":0.1}')
        >>> RequestArgs.read(xargs) == RequestArgs.read(args.extra_args()) == args
        True
        >>> RequestArgs.read({"refrences": ["a"]})
        Traceback (most recent call last):
        ...
        ValueError: extra_args has the key 'refrences', which rag_accel does not read: did you mean 'references'?
    """

    references: tuple[str | tuple[int, ...], ...] = ()
    answers: tuple[str | tuple[int, ...], ...] = ()
    speculate: bool = True
    config: DecoderConfig = WORKER_BASE
    memory_scope: str | None = None

    def __post_init__(self) -> None:
        for name in ("references", "answers"):
            object.__setattr__(self, name, tuple(r if isinstance(r, str) else tuple(r) for r in getattr(self, name)))
        _check_changes(self.changes(), self.config.drafters, "the request's config")

    def changes(self) -> dict[str, Any]:
        """``config``'s differences from :data:`WORKER_BASE`: what travels as ``rag_accel`` (JSON-ready)."""
        changes = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                   if getattr(self.config, f.name) != getattr(WORKER_BASE, f.name)}
        if "drafters" in changes:
            changes["drafters"] = list(changes["drafters"])
        return changes

    def extra_args(self, http: bool = False) -> dict[str, Any]:
        """This request in the schema: ``SamplingParams(extra_args=...)``'s dict, or with ``http`` the body's
        ``vllm_xargs`` (JSON values only: strings, numbers, flat lists)."""
        out: dict[str, Any] = {SCHEMA_KEY: SCHEMA_VERSION, "speculate": self.speculate}
        for key, given in (("references", self.references), ("answers", self.answers)):
            if not given:
                continue
            if not http:
                out[key] = [r if isinstance(r, str) else list(r) for r in given]
                continue
            texts = [r for r in given if isinstance(r, str)]
            ids = [list(r) for r in given if not isinstance(r, str)]
            if texts:
                out[key] = texts
            if ids:
                out[f"{key[:-1]}_ids"] = json.dumps(ids, separators=(",", ":"))
        changes = self.changes()
        if changes:
            out["rag_accel"] = json.dumps(changes, separators=(",", ":")) if http else changes
        if self.memory_scope is not None:
            out["memory_scope"] = self.memory_scope
        return out

    @classmethod
    def read(cls, extra_args: Any, vocab_size: int | None = None, max_reference_tokens: int = MAX_REFERENCE_TOKENS,
             bound: TextBound | None = None, default_scope: str | None = None) -> RequestArgs:
        """A request's inputs from its ``extra_args`` (in process) or ``vllm_xargs`` (over HTTP), checked in one
        pass: ``ValueError`` naming what is wrong (the server answers HTTP 400 with it). A server reads them under
        its settings (:meth:`rag_accel.vllm.requests.ServerSettings.read`, which passes the three last arguments).

        Size: references, prediction and answers together hold at most ``max_reference_tokens`` tokens, the rule
        of :mod:`rag_accel.references`: here, before any tokenising, token ids count as they are and text by the
        tokenizer's lower bound ``bound``; the worker counts exactly, off its step loop, and drafts without
        references over the limit. With ``vocab_size``, ids outside ``[0, vocab_size)`` are refused.
        ``default_scope``: the memory scope of a request that names none."""
        if extra_args is None:
            return cls(memory_scope=default_scope)
        if not isinstance(extra_args, Mapping):
            raise ValueError(f"extra_args must be a dict, got {type(extra_args).__name__}")
        version = extra_args.get(SCHEMA_KEY, SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"extra_args['{SCHEMA_KEY}'] is {version!r}: this server reads rag_accel's request "
                             f"schema {SCHEMA_VERSION}; run the same rag_accel release on the client and the server")
        _refuse_near_misses(extra_args)
        if extra_args.get("prediction_error") is not None:  # (rag_accel.vllm.predictions: a malformed prediction)
            raise ValueError(str(extra_args["prediction_error"]))
        limit = max_reference_tokens
        refs, total = _sources(extra_args, "references", "reference_ids", vocab_size, limit, bound)
        answers, answer_total = _sources(extra_args, "answers", "answer_ids", vocab_size, limit, bound)
        if total > limit:
            raise ValueError(f"extra_args['references'] hold over {limit} tokens")
        parts = _prediction(extra_args)
        if parts:
            refs.extend(parts)
            total += certain_tokens(parts, bound)
            if total > limit:
                raise ValueError(f"prediction (with extra_args['references']) holds over {limit} tokens, the most "
                                 "a request's references may hold here")
        if total + answer_total > limit:
            raise ValueError(f"extra_args['references'] and extra_args['answers'] hold over {limit} tokens")
        spec = extra_args.get("speculate", True)
        if isinstance(spec, int) and not isinstance(spec, bool) and spec in (0, 1):
            spec = bool(spec)  # JSON true/false through vllm_xargs
        if not isinstance(spec, bool):
            raise ValueError(f"extra_args['speculate'] must be true or false, got {spec!r}")
        if parts and not spec:
            raise ValueError("prediction given with speculate false: nothing would draft from it")
        changes = extra_args.get("rag_accel")
        if isinstance(changes, str):
            try:
                changes = json.loads(changes)
            except ValueError as e:
                raise ValueError(f"extra_args['rag_accel'] is not valid JSON: {e}") from None
        scope = extra_args.get("memory_scope")
        scope = default_scope if scope is None else check_scope(scope, "extra_args['memory_scope']")
        return cls(tuple(refs), tuple(answers), spec, request_config(WORKER_BASE, changes), scope)


def _refuse_near_misses(extra_args: Mapping[str, Any]) -> None:
    """A key that is not the schema's but close to one of its keys is a typo that would drop the request's
    documents silently: refused, naming ours. (Other keys pass: extra_args may carry other plugins' too.)"""
    import difflib

    for key in extra_args:
        if key not in SCHEMA_KEYS and isinstance(key, str):
            near = difflib.get_close_matches(key, SCHEMA_KEYS, n=1, cutoff=0.8)
            if near:
                raise ValueError(f"extra_args has the key {key!r}, which rag_accel does not read: "
                                 f"did you mean {near[0]!r}?")


def _prediction(extra_args: Mapping[str, Any]) -> list[str]:
    """``extra_args["prediction"]``: a request's prediction, its text parts (put there from the body's
    ``prediction`` by :mod:`rag_accel.vllm.predictions`, or given in ``vllm_xargs`` as a list of strings)."""
    parts = extra_args.get("prediction")
    if parts is None:
        return []
    if isinstance(parts, str):
        parts = [parts]
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, str) for p in parts):
        raise ValueError("extra_args['prediction'] must be a list of strings (a prediction's text parts)")
    return [p for p in parts if p]


def _sources(extra_args: Mapping[str, Any], key: str, ids_key: str, vocab_size: int | None,
             limit: int, bound: TextBound | None) -> tuple[list[str | list[int]], int]:
    """``extra_args[key]`` (strings; in process token-id lists too) and ``extra_args[ids_key]`` (token-id
    lists over HTTP) as one list, checked, and a lower bound of their tokens."""
    refs = extra_args.get(key)
    if refs is None:
        refs = []
    elif isinstance(refs, str):
        refs = [refs]
    elif not isinstance(refs, (list, tuple)):
        raise ValueError(f"extra_args['{key}'] must be a list of strings or token-id lists, "
                         f"got {type(refs).__name__}")
    refs = list(refs)
    ids = extra_args.get(ids_key)
    if ids is not None:
        if isinstance(ids, str):
            if len(ids) // 8 > limit:  # refused before parsing: an id takes at most ~8 characters
                raise ValueError(f"extra_args['{ids_key}'] hold over {limit} tokens")
            try:
                ids = json.loads(ids)
            except ValueError as e:
                raise ValueError(f"extra_args['{ids_key}'] is not valid JSON: {e}") from None
            if not isinstance(ids, list) or not all(_is_ids(r) for r in ids):
                raise ValueError(f"extra_args['{ids_key}'] must be a JSON list of token-id lists, "
                                 "e.g. '[[1, 2, 3], [4, 5]]'")
        elif _is_ids(ids):
            ids = [ids]
        else:
            raise ValueError(f"extra_args['{ids_key}'] must be a JSON string of token-id lists "
                             "or one list of token ids")
        refs.extend(list(r) for r in ids)
    total = 0
    for i, r in enumerate(refs):
        if isinstance(r, str):
            total += certain_tokens([r], bound)  # its tokens for certain; the worker counts exactly
        elif _is_ids(r):
            if r and min(r) < 0:
                raise ValueError(f"extra_args['{key}'][{i}] has a negative token id")
            if r and vocab_size is not None and max(r) >= vocab_size:
                raise ValueError(f"extra_args['{key}'][{i}] has token id {max(r)}, outside the model's "
                                 f"vocabulary (size {vocab_size})")
            total += len(r)
        else:
            raise ValueError(f"extra_args['{key}'][{i}] must be a string or a list of token ids, "
                             f"got {type(r).__name__}")
    return refs, total



def _is_ids(x: Any) -> bool:
    """A list or tuple of ints (no bools); its elements' types are checked once per type, not per element.

    Example:
        >>> _is_ids([1, 2, 3]), _is_ids((4,)), _is_ids([]), _is_ids([1, True]), _is_ids([1, 2.0]), _is_ids("12")
        (True, True, True, False, False, False)
    """
    return isinstance(x, (list, tuple)) and all(issubclass(t, int) and not issubclass(t, bool)
                                                for t in set(map(type, x)))
