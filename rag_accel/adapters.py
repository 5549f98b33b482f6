"""What the framework adapters share (``langchain-rag-accel``, ``llama-index-llms-rag-accel``):
their fields, validators and engine (:func:`adapter_base`), one loaded decoder per (model, device,
dtype), the decoder check, per-call options, and framework documents turned into reference texts.
No framework imports here (pydantic, which both frameworks bring, only inside :func:`adapter_base`).

Public so that the adapter distributions (and adapters for other frameworks) need no
third top-level package; an adapter takes any decoder object with ``generate`` and
``stream`` (:class:`rag_accel.ReferenceDecoder`, :class:`rag_accel.vllm.VllmDecoder`, ...).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

from .config import DecoderConfig
from .prediction import as_prediction

__all__ = [
    "BACKENDS",
    "DECODER_METHODS",
    "adapter_base",
    "adapter_engine",
    "answer_texts",
    "check_decoder",
    "close_shared_decoders",
    "iterate_in_thread",
    "max_new_tokens_option",
    "merge_max_tokens",
    "merged_decoder_config",
    "reference_texts",
    "sampling_options",
    "shared_decoder",
    "start_generation",
    "stats_metadata",
]

# What an adapter calls on a decoder: stream() for every accelerated call (generate() is the
# same call, whole); generate_greedy() only with accelerate=False.
DECODER_METHODS = ("generate", "stream")

# Where an adapter's model runs: "hf" (transformers, in process), "vllm" (a vLLM engine in process),
# "remote" (a `rag-accel serve` server at base_url, through RemoteDecoder).
BACKENDS = ("hf", "vllm", "remote")

_DECODERS: dict[tuple[str, str | None, str | None, str], Any] = {}
_ENGINE_OPTIONS: dict[tuple[str, str | None, str | None, str], dict[str, Any]] = {}  # what each vLLM engine got
_LOAD_LOCK = threading.Lock()
_DONE = object()


def shared_decoder(model_name: str, device: str | None = None, dtype: str | None = None, backend: str = "hf",
                   **engine_options: Any) -> Any:
    """The decoder for this model, loaded once per process: several adapter instances (and
    threads) share the weights. ``backend="hf"``: a :class:`rag_accel.ReferenceDecoder` (calls
    are serialised on it); ``"vllm"``: a :class:`rag_accel.vllm.VllmDecoder` (float32 unless
    ``dtype`` says otherwise; calls from several threads share its batch).

    ``engine_options`` (``"vllm"`` only) go to ``VllmDecoder.from_pretrained`` (``max_model_len``,
    ``tensor_parallel_size``, ``enforce_eager``, ...): the first load decides them. A later load
    without options gets that engine (an adapter made with ``backend="vllm"`` uses the engine the
    application configured); one that names other options is refused (one engine per model in a
    process: two would hold the model's memory twice) until :func:`close_shared_decoders`.

    >>> shared_decoder("m", backend="hf", max_model_len=2048)
    Traceback (most recent call last):
    ...
    TypeError: engine options ['max_model_len'] are vLLM's (backend='vllm'); the transformers backend takes device and dtype
    """
    if backend not in ("hf", "vllm"):
        raise ValueError(f"shared_decoder loads in process: backend 'hf' or 'vllm', got {backend!r}")
    if engine_options and backend != "vllm":
        raise TypeError(f"engine options {sorted(engine_options)} are vLLM's (backend='vllm'); the transformers "
                        "backend takes device and dtype")
    key = (model_name, device, dtype, backend)
    with _LOAD_LOCK:
        if key not in _DECODERS:
            if backend == "vllm":
                from .vllm import VllmDecoder

                _DECODERS[key] = VllmDecoder.from_pretrained(model_name, dtype=dtype or "float32", **engine_options)
                _ENGINE_OPTIONS[key] = dict(engine_options)
            else:
                from .hf.decoder import ReferenceDecoder

                _DECODERS[key] = ReferenceDecoder.from_pretrained(model_name, device=device, dtype=dtype)
        elif engine_options and engine_options != _ENGINE_OPTIONS.get(key):
            raise ValueError(f"this process already runs a vLLM engine for {model_name!r} with options "
                             f"{_ENGINE_OPTIONS.get(key)}, not {engine_options}: load it without options to "
                             "share it, or close_shared_decoders() first")
        return _DECODERS[key]


def close_shared_decoders() -> None:
    """Close and forget the decoders :func:`shared_decoder` loaded (a vLLM engine's processes and
    memory); the next adapter call loads again."""
    with _LOAD_LOCK:
        decoders = list(_DECODERS.values())
        _DECODERS.clear()
        _ENGINE_OPTIONS.clear()
    for dec in decoders:
        close = getattr(dec, "close", None)
        if callable(close):
            close()

def adapter_engine(model_name: str, *, backend: str | None = None, base_url: str | None = None,
                   device: str | None = None, dtype: str | None = None, api_key: str | None = None,
                   timeout: float | None = None, max_retries: int | None = None, memory_scope: str | None = None,
                   **engine_options: Any) -> Any:
    """The decoder an adapter's options choose (one obvious option: ``backend``, or ``base_url``).

    - ``base_url`` (a ``rag-accel serve`` server; ``backend`` ``None`` or ``"remote"``): a
      :class:`rag_accel.serving.remote.RemoteDecoder` for ``model_name`` as the server names it, with
      ``api_key`` / ``timeout`` / ``max_retries`` / ``memory_scope``. ``device`` / ``dtype`` are the
      server's (``rag-accel serve --dtype``): giving them here is an error.
    - ``backend="vllm"``: the process's shared :class:`rag_accel.vllm.VllmDecoder` for ``model_name``;
      ``engine_options`` go to its engine, ``memory_scope`` too (see :func:`shared_decoder`).
    - ``backend="hf"`` (or ``None``): the process's shared :class:`rag_accel.ReferenceDecoder`
      (no memory of earlier answers: ``memory_scope`` is an error).

    Example:
        >>> adapter_engine("m", backend="remote")
        Traceback (most recent call last):
        ...
        ValueError: backend='remote' needs base_url (the server, e.g. 'http://127.0.0.1:8000/v1')
        >>> adapter_engine("m", base_url="http://127.0.0.1:8000/v1", tensor_parallel_size=2)
        Traceback (most recent call last):
        ...
        TypeError: engine options ['tensor_parallel_size'] are for an engine in this process (backend='vllm'); a server's are rag-accel serve's
        >>> adapter_engine("m", memory_scope="tenant-1")
        Traceback (most recent call last):
        ...
        ValueError: memory_scope: the memory of earlier answers is a vLLM engine's (backend='vllm') or a rag-accel serve server's (base_url=); the transformers backend has none
    """
    check_engine_options(backend, base_url, device, dtype)
    if engine_options and base_url is not None:
        raise TypeError(f"engine options {sorted(engine_options)} are for an engine in this process "
                        "(backend='vllm'); a server's are rag-accel serve's")
    if base_url is not None:
        from .serving.remote import RemoteDecoder

        return RemoteDecoder(base_url, model=model_name, api_key=api_key or "EMPTY",
                             timeout=600.0 if timeout is None else timeout,
                             max_retries=2 if max_retries is None else max_retries, memory_scope=memory_scope)
    if memory_scope is not None:
        if backend != "vllm":
            raise ValueError("memory_scope: the memory of earlier answers is a vLLM engine's (backend='vllm') or "
                             "a rag-accel serve server's (base_url=); the transformers backend has none")
        engine_options["memory_scope"] = memory_scope
    return shared_decoder(model_name, device, dtype, backend or "hf", **engine_options)


@functools.cache
def adapter_base() -> type:
    """The pydantic model every framework adapter subclasses beside its framework's base class
    (``class ChatRagAccel(adapter_base(), BaseChatModel)``): the fields they share, each checked once
    here (stops, temperature, ``decoder_config``, a ready ``decoder``, the engine options together, one
    of ``max_new_tokens`` / its alias), and :attr:`engine`, the decoder they choose (loaded on first use
    through :func:`adapter_engine`, as :func:`rag_accel.load`). An adapter adds only what its framework needs, and may re-declare
    ``model_name`` or ``max_new_tokens`` with its framework's alias (``MAX_TOKENS_KEY`` names the one
    its callers use). Built on first call: pydantic is imported here, not when rag_accel is."""
    from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

    from .inputs import check_stops
    from .models import DEFAULT_MODEL

    class AdapterFields(BaseModel):
        #: the key of the new-token limit in an adapter's own spelling (see :func:`merge_max_tokens`)
        MAX_TOKENS_KEY: ClassVar[str] = "max_new_tokens"
        model_config = ConfigDict(protected_namespaces=(), arbitrary_types_allowed=True)

        model_name: str = Field(default=DEFAULT_MODEL)
        backend: str | None = None
        base_url: str | None = None
        api_key: str | None = Field(default=None, exclude=True, repr=False)
        timeout: float | None = None
        max_retries: int | None = None
        memory_scope: str | None = None
        device: str | None = None
        dtype: str | None = None
        decoder: Any = Field(default=None, exclude=True)
        max_new_tokens: int = Field(default=256, ge=1)
        stop: list[str] | None = None
        decoder_config: dict[str, Any] | None = None
        accelerate: bool = True
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        seed: int | None = None

        _decoder: Any = PrivateAttr(default=None)

        @model_validator(mode="before")
        @classmethod
        def _one_max_tokens(cls, data: Any) -> Any:
            return merge_max_tokens(data, cls.MAX_TOKENS_KEY)

        @field_validator("stop")
        @classmethod
        def _valid_stop(cls, v: list[str] | None) -> list[str] | None:
            return v if v is None else check_stops(v)

        @field_validator("temperature")
        @classmethod
        def _valid_temperature(cls, v: float | None) -> float | None:
            if v is not None and not v >= 0:
                raise ValueError(f"temperature must be >= 0 (0: greedy decoding), got {v}")
            return v

        @field_validator("decoder_config")
        @classmethod
        def _valid_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
            return None if v is None else merged_decoder_config({}, v)

        @field_validator("decoder")
        @classmethod
        def _valid_decoder(cls, v: Any) -> Any:
            return check_decoder(v)

        @model_validator(mode="after")
        def _valid_engine(self) -> Any:
            check_engine_options(self.backend, self.base_url, self.device, self.dtype, self.decoder)
            if self.decoder is None and self.base_url is None:  # (a server's model is the server's to name)
                from .models import check_model_name

                check_model_name(self.model_name)  # a misspelt name at construction, not at the first call
            return self

        @property
        def engine(self) -> Any:
            """The decoder: ``decoder`` if given, else the one ``backend`` / ``base_url`` choose (made on first
            use, shared by adapters of the same model, device, dtype and backend)."""
            if self.decoder is not None:
                return self.decoder
            if self._decoder is None:
                self._decoder = adapter_engine(self.model_name, backend=self.backend, base_url=self.base_url,
                                               device=self.device, dtype=self.dtype, api_key=self.api_key,
                                               timeout=self.timeout, max_retries=self.max_retries,
                                               memory_scope=self.memory_scope)
            return self._decoder

    AdapterFields.__module__, AdapterFields.__qualname__ = __name__, "AdapterFields"
    return AdapterFields


def check_engine_options(backend: str | None, base_url: str | None, device: str | None = None,
                         dtype: str | None = None, decoder: Any = None) -> None:
    """Refuse engine options that contradict each other (an adapter checks them at construction)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if decoder is not None and (backend is not None or base_url is not None):
        raise ValueError("give decoder= or backend= / base_url=, not both: a ready decoder is its own engine")
    if backend == "remote" and base_url is None:
        raise ValueError("backend='remote' needs base_url (the server, e.g. 'http://127.0.0.1:8000/v1')")
    if base_url is not None:
        if backend not in (None, "remote"):
            raise ValueError(f"base_url is a server (backend 'remote'); backend={backend!r} runs the model in "
                             "this process: give one of them")
        given = [k for k, v in (("device", device), ("dtype", dtype)) if v is not None]
        if given:
            raise ValueError(f"{given} belong to the server (rag-accel serve --dtype ...), not to a remote client")


def check_decoder(decoder: Any) -> Any:
    """A ready decoder given to an adapter: ``None``, or any object with the decoder surface
    (callable ``generate`` and ``stream``, as :class:`rag_accel.ReferenceDecoder` and
    :class:`rag_accel.vllm.VllmDecoder` have). Checked by duck typing, so other engines plug in.

    >>> check_decoder("gpt2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: decoder must be a rag_accel decoder (...); str has no generate(), stream()
    """
    if decoder is None:
        return None
    missing = [f"{m}()" for m in DECODER_METHODS if not callable(getattr(decoder, m, None))]
    if missing:
        raise TypeError("decoder must be a rag_accel decoder (an object with generate() and stream(), e.g. "
                        "rag_accel.ReferenceDecoder or rag_accel.vllm.VllmDecoder); "
                        f"{type(decoder).__name__} has no {', '.join(missing)}")
    return decoder


def start_generation(decoder: Any, prompt: Any, references: list[Any], *, config: Any, accelerate: bool,
                     **options: Any) -> tuple[Any, Any, Any]:
    """Start one call: ``(text pieces, output() -> GenerationOutput once the pieces are consumed,
    close())``. Inputs are checked here, before any model work. ``accelerate=False`` runs the
    engine's plain greedy baseline (``generate_greedy``) behind the same interface."""
    if not accelerate:
        options.pop("answers", None)  # copy sources, like the references: the baseline has no use for them
        greedy = getattr(decoder, "generate_greedy", None)
        if not callable(greedy):
            raise TypeError(f"accelerate=False runs decoder.generate_greedy(), which {type(decoder).__name__} "
                            "does not have")
        out = greedy(prompt, **options)
        return iter([out.text] if out.text else []), lambda: out, lambda: None
    remote = sys.modules.get("rag_accel.serving.remote")  # (not imported: the decoder is not a RemoteDecoder)
    if remote is not None and isinstance(decoder, remote.RemoteDecoder) and options.get("prediction") is None:
        # to a server, the documents travel as OpenAI's prediction, one text part each (token ids as references)
        texts = [r for r in references if isinstance(r, str)]
        if texts:
            references = [r for r in references if not isinstance(r, str)]
            options["prediction"] = as_prediction(texts)
    stream = decoder.stream(prompt, references, config=config, **options)
    return iter(stream), lambda: stream.output, stream.close


def merged_decoder_config(base: dict[str, Any] | None, per_call: Any = None) -> dict[str, Any] | None:
    """The adapter's ``decoder_config`` with a call's changes on top, checked against
    :class:`rag_accel.DecoderConfig` (unknown keys raise here, not mid-generation)."""
    if per_call is None:
        return base  # (checked when the adapter was made: its field's validator calls this with it alone)
    if not isinstance(per_call, dict):
        raise TypeError(f"decoder_config must be a dict of DecoderConfig changes, got {type(per_call).__name__}")
    merged = {**(base or {}), **per_call}
    DecoderConfig().replace(**merged)  # (before the engine loads; the decoder builds the call's config once)
    return merged


def max_new_tokens_option(options: Mapping[str, Any], default: Any) -> Any:
    """``max_new_tokens`` from options that may give it as ``max_tokens`` (the alias the
    frameworks use) too. Both given with different values is an error naming both; ``None``
    counts as not given."""
    given = {k: options[k] for k in ("max_tokens", "max_new_tokens") if options.get(k) is not None}
    if len(given) == 2 and given["max_tokens"] != given["max_new_tokens"]:
        raise ValueError(f"max_tokens={given['max_tokens']!r} and max_new_tokens={given['max_new_tokens']!r} "
                         "disagree: they are one option (max_tokens is an alias of max_new_tokens); give one")
    return next(iter(given.values()), default)


def merge_max_tokens(data: Any, name: str) -> Any:
    """Constructor arguments with ``max_tokens`` / ``max_new_tokens`` folded into the field's
    key ``name`` (checked by :func:`max_new_tokens_option`); other input is left as it is."""
    if not isinstance(data, Mapping) or not {"max_tokens", "max_new_tokens"} & set(data):
        return data
    value = max_new_tokens_option(data, None)
    merged = {k: v for k, v in data.items() if k not in ("max_tokens", "max_new_tokens")}
    if value is not None:
        merged[name] = value
    return merged


def reference_texts(references: Any) -> list[Any]:
    """Copy sources as the decoder takes them (strings or token-id lists), from
    LangChain ``Document``s, LlamaIndex nodes / ``NodeWithScore``s, strings or
    token-id lists. Anything else is left for the decoder to reject with a clear error."""
    if references is None:
        return []
    if isinstance(references, str) or not isinstance(references, Sequence):
        references = [references]
    out: list[Any] = []
    for ref in references:
        if hasattr(ref, "page_content"):  # langchain_core.documents.Document
            out.append(ref.page_content)
        elif hasattr(ref, "node") and hasattr(ref.node, "get_content"):  # llama_index NodeWithScore
            out.append(ref.node.get_content())
        elif callable(getattr(ref, "get_content", None)):  # llama_index BaseNode
            out.append(ref.get_content())
        else:
            out.append(ref)
    return out


def answer_texts(answers: Any) -> list[Any] | None:
    """A call's ``answers`` (earlier answers to copy from, e.g. a cached answer) as the decoder
    takes them: what :func:`reference_texts` takes, and the frameworks' answers themselves
    (a LangChain ``AIMessage``, a LlamaIndex ``ChatResponse`` / ``CompletionResponse`` /
    ``Response``), as their text. ``None`` stays ``None`` (the call passes none).

        >>> class Said:  # an object with string .content, as a chat message
        ...     content = "Paris is the capital."
        >>> answer_texts(["It is Paris.", Said()])
        ['It is Paris.', 'Paris is the capital.']
        >>> answer_texts(None) is None, answer_texts("one answer")
        (True, ['one answer'])
    """
    if answers is None:
        return None
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        answers = [answers]
    out = []
    for a in answers:
        message = getattr(a, "message", None)  # llama_index ChatResponse
        if isinstance(getattr(message, "content", None), str):
            a = message.content
        elif isinstance(getattr(a, "content", None), str):  # a chat message (LangChain, LlamaIndex)
            a = a.content
        elif isinstance(getattr(a, "text", None), str) and not callable(getattr(a, "get_content", None)):
            a = a.text  # llama_index CompletionResponse
        elif isinstance(getattr(a, "response", None), str):  # llama_index query engine Response
            a = a.response
        out.append(a)
    return reference_texts(out)


def sampling_options(temperature: Any, top_p: Any, top_k: Any, seed: Any, accelerate: bool) -> dict[str, Any]:
    """Decoder options for a call: greedy for temperature 0/None, otherwise lossless sampling."""
    if temperature is not None and not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy decoding), got {temperature}")
    extra = {k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("seed", seed)) if v is not None}
    if not temperature:
        if extra:
            raise ValueError(f"{sorted(extra)} apply to sampling: set temperature > 0 "
                             "(temperature 0 or None decodes greedily)")
        return {}
    if not accelerate:
        raise ValueError("accelerate=False is the plain greedy baseline; it does not sample")
    return {"do_sample": True, "temperature": temperature, **extra}


def stats_metadata(stats: Any) -> dict[str, Any]:
    """The acceleration stats a framework message carries (JSON-friendly). ``None``: the engine
    cannot tell (a remote server reports no per-request steps or draft counts; it reports the
    prediction counts of a call that sent its documents as a prediction)."""
    tokens_per_step = stats.tokens_per_step
    return {
        "steps": stats.steps,
        "new_tokens": stats.new_tokens,
        "tokens_per_step": None if tokens_per_step is None else round(tokens_per_step, 4),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "by_drafter": {k: dict(v) for k, v in stats.by_drafter.items()},
        "accepted_prediction_tokens": stats.accepted_prediction_tokens,
        "rejected_prediction_tokens": stats.rejected_prediction_tokens,
        "time_s": round(stats.time_s, 4),
    }


async def iterate_in_thread(make_iter: Any) -> AsyncIterator[Any]:
    """Run a blocking iterator in one worker thread (the decoder's lock is held by
    that thread for the whole generation) and hand its items to the event loop.
    Stopping early closes the iterator in its own thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def produce() -> None:
        it = None
        try:
            it = make_iter()
            for item in it:
                if cancelled.is_set():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, (item, None))
            loop.call_soon_threadsafe(queue.put_nowait, (_DONE, None))
        except BaseException as e:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, (_DONE, e))
        finally:
            if it is not None and hasattr(it, "close"):
                it.close()

    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            item, err = await queue.get()
            if err is not None:
                raise err
            if item is _DONE:
                break
            yield item
    finally:
        cancelled.set()
        await asyncio.shield(worker)
