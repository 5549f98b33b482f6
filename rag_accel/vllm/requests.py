"""How a vLLM engine takes rag_accel: its speculative config, the server's settings, and its requests' inputs.

Pure Python (no vLLM import). A request's inputs travel in one schema, :class:`rag_accel.wire.RequestArgs`
(re-exported here); the frontend's admission check (:meth:`RowTracker.validate_params
<rag_accel.vllm.RowTracker.validate_params>`, HTTP 400 on the server) and the worker's rows read them under the
server's settings (:meth:`ServerSettings.read`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import MAX_REFERENCE_TOKENS, SERVE_MAX_REFERENCE_TOKENS, VLLM_MAX_DRAFT_TOKENS, DecoderConfig  # (the second re-exported)
from ..references import TextBound
from ..memory import DEFAULT_MAX_TOKENS, check_scope
from ..wire import RequestArgs  # (re-exported: rag_accel.vllm names it)

__all__ = ["EXACT_KEY", "MIDDLEWARE_PATH", "PROPOSER_PATH", "SERVE_MAX_REFERENCE_TOKENS", "SETTINGS_ENV", "SPECULATION",
           "TRACKER_PATH", "PIPELINE_REFUSED", "RequestArgs", "ServerSettings", "check_extra_args", "check_layout",
           "default_kv_cache_bytes", "encode_text_bound", "exact_config", "exact_mode", "kv_cache_bytes",
           "model_kv_layout", "speculative_config"]

PROPOSER_PATH = "rag_accel.vllm.RagProposer"  # speculative_config={"method": "custom_class", "model": ...}
TRACKER_PATH = "rag_accel.vllm:RowTracker"  # logits_processors=[...] (vLLM's FQCN form)
MIDDLEWARE_PATH = "rag_accel.vllm.predictions.PredictedOutputs"  # vllm serve --middleware ... (Predicted Outputs)
# How an engine speculates: our proposer, vLLM's own n-gram lookup (the peer users would pick), vLLM's suffix
# decoding (needs arctic-inference; a suffix tree over the prompt and the engine's earlier outputs), or not at all.
SPECULATION = ("ours", "ngram", "suffix", "off")
_SUFFIX_HINT = ("speculation='suffix' is vLLM's suffix decoding, which needs arctic-inference: pip install "
                "arctic-inference (on a CPU it builds from source: pip wheel --no-build-isolation in an environment "
                "with torch, ninja, cmake, nanobind==2.9.2, protobuf==5.29.6 and grpcio-tools, a few minutes)")


#: The key of vLLM's ``additional_config`` that carries an engine's exact mode to its workers
#: (:mod:`rag_accel.vllm.exact`): "auto", "on" or "off"; an engine without it runs vLLM's own kernels.
EXACT_KEY = "rag_accel_exact"


def exact_mode(exact: bool | None) -> str:
    """The worker's mode for an ``exact`` argument: ``None`` "auto" (bfloat16 and float16 exact), ``True`` "on",
    ``False`` "off".

    Example:
        >>> exact_mode(None), exact_mode(True), exact_mode(False)
        ('auto', 'on', 'off')
    """
    if exact is not None and not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool or None, got {type(exact).__name__}")
    return "auto" if exact is None else ("on" if exact else "off")


def exact_config(mode: str, given: Any = None) -> dict[str, Any]:
    """vLLM's ``additional_config`` for an engine in exact ``mode``: ``given`` (the caller's own, a dict or its
    JSON text) with :data:`EXACT_KEY` added, which only the ``exact`` switch sets.

    Example:
        >>> exact_config("auto", {"other": 1})
        {'other': 1, 'rag_accel_exact': 'auto'}
    """
    extra = json.loads(given) if isinstance(given, str) else dict(given or {})
    if not isinstance(extra, dict):
        raise TypeError(f"additional_config must be a dict, got {type(extra).__name__}")
    if EXACT_KEY in extra:
        raise ValueError(f"additional_config's {EXACT_KEY!r} is set by the exact switch (exact=, --no-exact); "
                         "leave it out")
    return {**extra, EXACT_KEY: mode}


#: A vLLM engine's KV cache on a CPU where neither the caller (``kv_cache_memory_bytes``) nor
#: ``VLLM_CPU_KVCACHE_SPACE`` sizes it: room for this many tokens (at least two sequences of ``max_model_len``),
#: never more than :data:`KV_CACHE_SHARE` of the memory available at start (vLLM's own default takes most of it).
KV_CACHE_TOKENS = 32_768
KV_CACHE_SHARE = 0.25


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype: str, max_model_len: int,
                   available: int) -> int:
    """The KV cache :class:`~rag_accel.vllm.VllmDecoder` gives an engine on a CPU (see :data:`KV_CACHE_TOKENS`):
    keys and values of every layer, in ``dtype`` (``"auto"`` counts as float32), at least one whole sequence.

    Example:
        >>> mib = kv_cache_bytes(30, 3, 64, "bfloat16", 4096, available=64 << 30) >> 20  # SmolLM2
        >>> mib, kv_cache_bytes(30, 3, 64, "float32", 4096, available=1 << 30) >> 20     # (a quarter of 1 GiB)
        (720, 256)
    """
    width = 2 if str(dtype).replace("torch.", "") in ("bfloat16", "float16", "half") else 4
    per_token = 2 * layers * kv_heads * head_dim * width
    tokens = max(KV_CACHE_TOKENS, 2 * max_model_len)
    return max(per_token * max_model_len, min(per_token * tokens, int(available * KV_CACHE_SHARE)))


#: Config keys a model's context window may be read from (vLLM reads the same); the largest counts here.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def model_kv_layout(path: str) -> tuple[int, int, int, int] | None:
    """(layers, key/value heads, head size, context window) of the model in the local folder ``path``, from its
    ``config.json`` (a multimodal model's text config), the window scaled by a rope scaling's factor; ``None`` when
    that cannot be read here (a hub name). Read without transformers: a server's dry run imports neither it nor
    torch.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:  # (SmolLM2's config)
        ...     _ = (Path(folder) / "config.json").write_text('{"num_hidden_layers": 30, "num_attention_heads": 9, '
        ...         '"num_key_value_heads": 3, "hidden_size": 576, "max_position_embeddings": 8192}')
        ...     model_kv_layout(folder)
        (30, 3, 64, 8192)
    """
    try:
        data = json.loads((Path(path) / "config.json").read_text())
        text = data.get("text_config") or data
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        window = max(int(text[k]) for k in _LENGTH_KEYS if isinstance(text.get(k), int))
        scaling = text.get("rope_scaling") or {}
        factor = scaling.get("factor") if scaling.get("rope_type", scaling.get("type")) not in (
            "su", "longrope", "llama3") else None
        return int(text["num_hidden_layers"]), kv_heads, head_dim, int(window * (factor or 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def default_kv_cache_bytes(path: str, dtype: str, max_model_len: int | None,
                           available: int | None = None) -> int | None:
    """The KV cache an engine of the model at ``path`` gets on a CPU where the caller sizes none
    (:func:`kv_cache_bytes`, ``max_model_len`` ``None``: the model's own window; ``available``: the memory
    available now, by default read here); ``None`` where the model's layout cannot be read (vLLM then sizes it)."""
    layout = model_kv_layout(path)
    if layout is None:
        return None
    if available is None:
        try:
            import psutil  # (vLLM's dependency)

            available = int(psutil.virtual_memory().available)
        except ImportError:  # (a server's dry run without vLLM: the free memory, a lower bound)
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    layers, kv_heads, head_dim, window = layout
    return kv_cache_bytes(layers, kv_heads, head_dim, dtype, max_model_len or window, available)


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

    def read(self, extra_args: Any, vocab_size: int | None = None) -> RequestArgs:
        """A request's inputs as this server reads them (:meth:`RequestArgs.read`): references and answers up to
        ``max_reference_tokens``, text counted by ``text_bound``, ``memory_scope`` for a request naming none.

        Example:
            >>> ServerSettings(memory_scope="team").read({"references": ["a"], "speculate": 0})  # doctest: +ELLIPSIS
            RequestArgs(references=('a',), answers=(), speculate=False, config=..., memory_scope='team')
        """
        return RequestArgs.read(extra_args, vocab_size, self.max_reference_tokens, self.bound, self.memory_scope)

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


def check_extra_args(extra_args: Any, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` naming what is wrong with a request's rag_accel ``extra_args``
    (:class:`RequestArgs` says what they hold): vLLM's admission check.

    Example:
        >>> check_extra_args({"references": ["a passage", [1, 2, 3]], "speculate": True})
        >>> check_extra_args({"references": 5})
        Traceback (most recent call last):
        ...
        ValueError: extra_args['references'] must be a list of strings or token-id lists, got int
    """
    ServerSettings.current().read(extra_args, vocab_size)
