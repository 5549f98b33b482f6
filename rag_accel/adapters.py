"""What the framework adapters share (``langchain-rag-accel``, ``llama-index-llms-rag-accel``):
one loaded decoder per (model, device, dtype), the decoder check, per-call options, and
framework documents turned into reference texts. No framework imports here.

Public so that the adapter distributions (and adapters for other frameworks) need no
third top-level package; an adapter takes any decoder object with ``generate`` and
``stream`` (:class:`rag_accel.ReferenceDecoder`, :class:`rag_accel.vllm.VllmDecoder`, ...).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from .config import DecoderConfig

__all__ = [
    "DECODER_METHODS",
    "check_decoder",
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

_DECODERS: dict[tuple[str, str | None, str | None], Any] = {}
_LOAD_LOCK = threading.Lock()
_DONE = object()


def shared_decoder(model_name: str, device: str | None = None, dtype: str | None = None) -> Any:
    """The :class:`rag_accel.ReferenceDecoder` for this model, loaded once per
    process: several adapter instances (and threads) share the weights, and the
    decoder serialises calls on them."""
    key = (model_name, device, dtype)
    with _LOAD_LOCK:
        if key not in _DECODERS:
            from .decoder import ReferenceDecoder

            _DECODERS[key] = ReferenceDecoder.from_pretrained(model_name, device=device, dtype=dtype)
        return _DECODERS[key]


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
        greedy = getattr(decoder, "generate_greedy", None)
        if not callable(greedy):
            raise TypeError(f"accelerate=False runs decoder.generate_greedy(), which {type(decoder).__name__} "
                            "does not have")
        out = greedy(prompt, **options)
        return iter([out.text] if out.text else []), lambda: out, lambda: None
    stream = decoder.stream(prompt, references, config=config, **options)
    return iter(stream), lambda: stream.output, stream.close


def merged_decoder_config(base: dict[str, Any] | None, per_call: Any = None) -> dict[str, Any] | None:
    """The adapter's ``decoder_config`` with a call's changes on top, checked against
    :class:`rag_accel.DecoderConfig` (unknown keys raise here, not mid-generation)."""
    if per_call is not None and not isinstance(per_call, dict):
        raise TypeError(f"decoder_config must be a dict of DecoderConfig changes, got {type(per_call).__name__}")
    merged = {**(base or {}), **(per_call or {})} if per_call is not None else base
    if merged is not None:
        DecoderConfig().replace(**merged)
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
    """The acceleration stats a framework message carries (JSON-friendly)."""
    return {
        "steps": stats.steps,
        "new_tokens": stats.new_tokens,
        "tokens_per_step": round(stats.tokens_per_step, 4),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "by_drafter": {k: dict(v) for k, v in stats.by_drafter.items()},
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
