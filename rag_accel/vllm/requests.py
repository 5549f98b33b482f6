"""A request's rag_accel inputs on vLLM: the ``extra_args`` keys, how they are read and checked.

Pure Python (no vLLM import): the frontend's admission check (:meth:`RowTracker.validate_params
<rag_accel.vllm.RowTracker.validate_params>`, HTTP 400 on the server), the worker's rows and
:mod:`rag_accel.serving.remote` read requests through these functions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import MAX_REFERENCE_TOKENS, SERVE_MAX_REFERENCE_TOKENS, VLLM_MAX_DRAFT_TOKENS, DecoderConfig  # (the second re-exported)
from ..references import TextBound, certain_tokens
from ..memory import DEFAULT_MAX_TOKENS, check_scope
from ..protocol import REQUEST_FIELDS, WORKER_BASE, request_config  # (re-exported: the worker's names for them)

__all__ = ["MIDDLEWARE_PATH", "PROPOSER_PATH", "REQUEST_FIELDS", "SERVE_MAX_REFERENCE_TOKENS", "SETTINGS_ENV",
           "SPECULATION", "TRACKER_PATH", "PIPELINE_REFUSED", "WORKER_BASE", "ServerSettings", "check_extra_args",
           "check_layout", "encode_text_bound", "read_request", "request_answers", "request_config", "request_inputs",
           "request_scope", "speculative_config"]

PROPOSER_PATH = "rag_accel.vllm.RagProposer"  # speculative_config={"method": "custom_class", "model": ...}
TRACKER_PATH = "rag_accel.vllm:RowTracker"  # logits_processors=[...] (vLLM's FQCN form)
MIDDLEWARE_PATH = "rag_accel.vllm.predictions.PredictedOutputs"  # vllm serve --middleware ... (Predicted Outputs)
# How an engine speculates: our proposer, vLLM's own n-gram lookup (the peer users would pick), vLLM's suffix
# decoding (needs arctic-inference; a suffix tree over the prompt and the engine's earlier outputs), or not at all.
SPECULATION = ("ours", "ngram", "suffix", "off")
_SUFFIX_HINT = ("speculation='suffix' is vLLM's suffix decoding, which needs arctic-inference: pip install "
                "arctic-inference (on a CPU it builds from source: pip wheel --no-build-isolation in an environment "
                "with torch, ninja, cmake, nanobind==2.9.2, protobuf==5.29.6 and grpcio-tools, a few minutes)")


def speculative_config(speculation: str, max_draft_tokens: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``"ours"`` (:class:`RagProposer`, up to ``k`` tokens a
    step), ``"ngram"`` (vLLM's prompt lookup: ``k`` tokens, n-grams of 2 to 4, as benchmarked),
    ``"suffix"`` (vLLM's suffix decoding, up to ``k`` tokens, its other settings vLLM's defaults:
    it also copies from the engine's earlier outputs; ImportError without arctic-inference)
    or ``"off"`` (``None``). ``"ours"`` also needs ``logits_processors=[TRACKER_PATH]``."""
    if speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {list(SPECULATION)}, got {speculation!r}")
    k = max_draft_tokens  # vLLM's num_speculative_tokens: named so here only, where vLLM's API takes it
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= VLLM_MAX_DRAFT_TOKENS:
        raise ValueError(f"max_draft_tokens must be an int in [1, {VLLM_MAX_DRAFT_TOKENS}] on a vLLM engine, got {k!r}")
    if speculation == "ours":
        return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": k}
    if speculation == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if speculation == "suffix":
        import importlib.util

        if importlib.util.find_spec("arctic_inference") is None:
            raise ImportError(_SUFFIX_HINT)
        return {"method": "suffix", "num_speculative_tokens": k}
    return None


# Why RagProposer refuses pipeline parallelism (checked in vLLM 0.32's CPU build; 0.33's runner has the same code).
PIPELINE_REFUSED = (
    "rag_accel's proposer does not run with pipeline parallelism: vLLM {version} runs no speculative decoding "
    "with pipeline_parallel_size > 1 (its own n-gram speculation fails at engine start, 'CPUModelRunner' object "
    "has no attribute 'drafter'; with rag_accel's proposer made to start, outputs differed from speculation off "
    "from the third token). Use tensor parallelism (--tensor-parallel-size) or data parallelism "
    "(--data-parallel-size) with rag_accel, or pipeline parallelism with speculation off")


def check_layout(pipeline_parallel_size: Any, version: str = "0.32-0.33") -> None:
    """Refuse the parallel layouts our proposer cannot run in (see :data:`PIPELINE_REFUSED`).

    Example:
        >>> check_layout(1)
        >>> check_layout(2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: rag_accel's proposer does not run with pipeline parallelism: ...
    """
    if pipeline_parallel_size not in (None, 1):
        raise ValueError(PIPELINE_REFUSED.format(version=version))


_MAX_REFERENCE_TOKENS = DecoderConfig().max_reference_tokens


# --------------------------------------------------------------------------- per-request input checks
def _is_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


#: The one environment variable that carries :class:`ServerSettings` (JSON) to vLLM's API server and its workers.
SETTINGS_ENV = "RAG_ACCEL_SERVER"
_SETTINGS_VERSION = 1


@dataclass(frozen=True)
class ServerSettings:
    """What ``rag-accel serve`` decides once for the whole server, typed and checked when built (from the command
    line), carried to vLLM's API server and its workers as JSON in one environment variable (:data:`SETTINGS_ENV`,
    :meth:`environment`), read there by :meth:`current`; ``rag-accel serve --dry-run`` prints it. A process
    without it (an engine in this process) gets the defaults.

    - ``max_reference_tokens``: the most tokens a request's references and answers may hold (the server's
      default is :data:`SERVE_MAX_REFERENCE_TOKENS`; in process, DecoderConfig's);
    - ``answer_memory_tokens``: tokens of earlier answers each worker remembers (0: none);
    - ``memory_scope``: the scope of requests that name none (``None``: such requests have no memory);
    - ``vocab_size``: the served model's vocabulary, by which admission refuses reference ids outside it;
    - ``text_bound``: ``(characters a token at most, pattern of characters that encode to nothing)``, the served
      tokenizer's lower bound by which admission counts text references before any tokenising.

    Example:
        >>> s = ServerSettings(max_reference_tokens=100, vocab_size=49152)
        >>> ServerSettings.from_json(s.to_json()) == s
        True
        >>> ServerSettings(answer_memory_tokens=-1)
        Traceback (most recent call last):
        ...
        ValueError: answer_memory_tokens must be an int >= 0, got -1
    """

    max_reference_tokens: int = _MAX_REFERENCE_TOKENS
    answer_memory_tokens: int = DEFAULT_MAX_TOKENS
    memory_scope: str | None = None
    vocab_size: int | None = None
    text_bound: tuple[int, str | None] | None = None

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int | None = None, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                raise ValueError(f"{name} must be an int >= {low}{f' and <= {high}' if high else ''}, got {v!r}")

        integer("max_reference_tokens", 1, MAX_REFERENCE_TOKENS)
        integer("answer_memory_tokens", 0)
        integer("vocab_size", 1, optional=True)
        if self.memory_scope is not None:
            check_scope(self.memory_scope, "memory_scope")
        bound = self.text_bound
        if bound is not None:
            if (not isinstance(bound, (tuple, list)) or len(bound) != 2 or isinstance(bound[0], bool)
                    or not isinstance(bound[0], int) or bound[0] < 1 or not isinstance(bound[1], (str, type(None)))):
                raise ValueError(f"text_bound must be (characters a token >= 1, a pattern or None), got {bound!r}")
            re.compile(bound[1] or "")
            object.__setattr__(self, "text_bound", (bound[0], bound[1]))

    def to_json(self) -> str:
        return json.dumps({"version": _SETTINGS_VERSION, **dataclasses.asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ServerSettings:
        """The settings :meth:`to_json` wrote; a malformed value, another version or an unknown key is a
        ``ValueError`` naming :data:`SETTINGS_ENV`."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{SETTINGS_ENV} is not JSON: {e}") from None
        if not isinstance(data, dict) or data.pop("version", None) != _SETTINGS_VERSION:
            raise ValueError(f"{SETTINGS_ENV} must be a JSON object of version {_SETTINGS_VERSION} "
                             f"(rag-accel serve writes it), got {text[:80]!r}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{SETTINGS_ENV} has unknown settings {unknown}")
        if isinstance(data.get("text_bound"), list):
            data["text_bound"] = tuple(data["text_bound"])
        return cls(**data)

    def environment(self) -> dict[str, str]:
        """The environment variable that carries these settings to the server's processes."""
        return {SETTINGS_ENV: self.to_json()}

    @classmethod
    def current(cls) -> ServerSettings:
        """This process's settings: :data:`SETTINGS_ENV`'s, else the defaults (read once per value)."""
        return _settings(os.environ.get(SETTINGS_ENV) or "")

    @property
    def bound(self) -> TextBound | None:
        """``text_bound`` as :func:`~rag_accel.references.certain_tokens` takes it (its pattern compiled)."""
        if self.text_bound is None:
            return None
        per_token, dropped = self.text_bound
        return per_token, (re.compile(dropped) if dropped else None)


@functools.lru_cache(maxsize=8)
def _settings(text: str) -> ServerSettings:
    return ServerSettings.from_json(text) if text else ServerSettings()


def encode_text_bound(bound: TextBound | None) -> tuple[int, str | None] | None:
    """``bound`` as :attr:`ServerSettings.text_bound` holds it (its pattern as a string)."""
    return None if bound is None else (bound[0], bound[1].pattern if bound[1] else None)


def request_scope(extra_args: Any) -> str | None:
    """The memory scope of a request: ``extra_args["memory_scope"]``, a string of 1 to 256 characters
    (answers given in a scope draft for later requests of that scope only); a request without one
    takes the deployment's default, :attr:`ServerSettings.memory_scope` (``rag-accel serve --memory-scope``),
    and with neither it neither reads nor writes the memory (``None``).

    Example:
        >>> request_scope({"memory_scope": "tenant-42"})
        'tenant-42'
        >>> request_scope({"memory_scope": 42})
        Traceback (most recent call last):
        ...
        ValueError: extra_args['memory_scope'] must be a string of 1 to 256 characters, got int
    """
    scope = extra_args.get("memory_scope") if isinstance(extra_args, Mapping) else None
    if scope is None:
        return ServerSettings.current().memory_scope
    return check_scope(scope, "extra_args['memory_scope']")


def request_inputs(extra_args: Any, vocab_size: int | None = None) -> tuple[list[str | list[int]], bool, Any]:
    """A request's rag_accel inputs from its ``extra_args``: (references, speculate, DecoderConfig changes); its
    answers too, read in the same pass, by :func:`read_request` (which the worker's rows call, once).

    Two shapes arrive: ``SamplingParams(extra_args=...)`` in process (any Python values), and
    the OpenAI server's ``vllm_xargs`` (JSON values that are strings, numbers or flat lists of
    them: no nested lists, no dicts, and JSON ``true``/``false`` arrive as ``1``/``0``). So:

    - ``references``: a string or a list of strings (in process, token-id lists too);
    - ``reference_ids``: token-id references over HTTP: a JSON string of a list of id lists
      (``"[[1, 2, 3], [4, 5]]"``), or one flat list of ids (one reference);
    - ``answers`` / ``answer_ids``: the same for earlier answers the request brings (a cached
      answer to a similar question): :func:`request_answers` reads them;
    - ``prediction``: a prediction's text parts (OpenAI's ``prediction`` on the server:
      :mod:`rag_accel.vllm.predictions`), references of the request after ``references``;
    - ``speculate``: ``True``/``False`` or ``1``/``0``;
    - ``rag_accel``: DecoderConfig changes, a dict or a JSON string of one.

    Size: references and answers together hold at most :func:`max_reference_tokens` tokens, the rule
    of :mod:`rag_accel.references`: here, before any tokenising, token ids count as they are and text by
    the served tokenizer's lower bound (:attr:`ServerSettings.text_bound`); the worker counts exactly, off its
    step loop, and drafts without references and answers over the limit. With ``vocab_size``, ids outside
    ``[0, vocab_size)`` are refused.

    Raises ``ValueError`` naming what is wrong (vLLM answers it with HTTP 400).

    Example:
        >>> request_inputs({"references": "a", "reference_ids": "[[1, 2]]", "speculate": 0})
        (['a', [1, 2]], False, None)
    """
    refs, _, spec, changes = read_request(extra_args, vocab_size)
    return refs, spec, changes


def read_request(extra_args: Any, vocab_size: int | None = None) -> tuple[list[str | list[int]],
                                                                          list[str | list[int]], bool, Any]:
    """(references, answers, speculate, DecoderConfig changes) of a request's ``extra_args``, read and checked in
    one pass (:func:`request_inputs` says how)."""
    if extra_args is None:
        return [], [], True, None
    if not isinstance(extra_args, Mapping):
        raise ValueError(f"extra_args must be a dict, got {type(extra_args).__name__}")
    if extra_args.get("prediction_error") is not None:  # (rag_accel.vllm.predictions: a malformed prediction)
        raise ValueError(str(extra_args["prediction_error"]))
    limit = ServerSettings.current().max_reference_tokens
    refs, total = _sources(extra_args, "references", "reference_ids", vocab_size, limit)
    answers, answer_total = _sources(extra_args, "answers", "answer_ids", vocab_size, limit)
    if total > limit:
        raise ValueError(f"extra_args['references'] hold over {limit} tokens")
    parts = _prediction(extra_args)
    if parts:
        refs.extend(parts)
        total += certain_tokens(parts, ServerSettings.current().bound)
        if total > limit:
            raise ValueError(f"prediction (with extra_args['references']) holds over {limit} tokens, the most a "
                             "request's references may hold here")
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
    return refs, answers, spec, changes


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


def request_answers(extra_args: Any, vocab_size: int | None = None) -> list[str | list[int]]:
    """The earlier answers a request brings, ``extra_args["answers"]`` and ``["answer_ids"]``, read as
    :func:`request_inputs` reads references (which checks both; call it first). They draft as the memory
    of answers does (:func:`rag_accel.memory.answers_drafter`).

    Example:
        >>> request_answers({"answers": "It is 42.", "answer_ids": "[[7, 8]]"})
        ['It is 42.', [7, 8]]
    """
    return read_request(extra_args, vocab_size)[1] if isinstance(extra_args, Mapping) else []


def _sources(extra_args: Mapping[str, Any], key: str, ids_key: str, vocab_size: int | None,
             limit: int) -> tuple[list[str | list[int]], int]:
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
    total, bound = 0, ServerSettings.current().bound
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


def check_extra_args(extra_args: Any, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` naming what is wrong with a request's rag_accel ``extra_args``
    (see :func:`request_inputs` for the keys).

    Example:
        >>> check_extra_args({"references": ["a passage", [1, 2, 3]], "speculate": True})
        >>> check_extra_args({"references": 5})
        Traceback (most recent call last):
        ...
        ValueError: extra_args['references'] must be a list of strings or token-id lists, got int
    """
    _, _, changes = request_inputs(extra_args, vocab_size)
    request_scope(extra_args)
    if changes is not None:
        request_config(DecoderConfig(), changes)
