"""The Hugging Face KV cache as the decode loops use it: make one, roll it back, know the window.

Shared by the decoder and the draft-model drafters (which run their own small model).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _crop_takes_count(cache_type: type) -> bool:
    return "tokens_to_remove" in inspect.signature(cache_type.crop).parameters


def rollback_cache(cache: Any, remove: int) -> None:
    """Drop the last ``remove`` positions from a KV cache (``DynamicCache.crop``), after each verify step.

    A cache that records its past (:func:`new_cache`: one with sliding-window layers) is cropped after
    every step, ``remove == 0`` too: that also trims its window layers back to their window."""
    if remove < 0 or (remove == 0 and not _records_past(cache)):
        return
    if not hasattr(cache, "crop"):
        raise NotImplementedError(f"{type(cache).__name__} cannot be rolled back (no crop())")
    if _crop_takes_count(type(cache)):
        cache.crop(-remove)  # transformers >= 5: negative = tokens to remove
    else:
        cache.crop(cache.get_seq_length() - remove)  # older: crop(max_length)


def cache_kwarg(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` from transformers 5.24
    on (``past_key_values`` is deprecated there, to be removed in 5.40), ``past_key_values`` before."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(model_type: type) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(kwargs: dict[str, Any]) -> Any:
    """The KV cache among a forward call's keyword arguments, under either name (a hook sees
    what the caller passed: ``generate`` of transformers >= 5.24 passes ``cache``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def new_cache(model: Any) -> Any:
    """An empty KV cache for ``model`` (``DynamicCache``, configured from the model where supported).

    Sliding-window layers (Gemma 2/3, Mistral, ...) keep only their window: a token that leaves it is
    dropped, so a draft rejected past the window could not be rolled back. Their cache records its past
    instead (transformers' own assisted decoding does the same) until the next :func:`rollback_cache`,
    which drops the rejected tokens and trims the window. A transformers whose window layers cannot
    record is refused rather than allowed to verify a wrong token."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        if not hasattr(cache, "activate_past_recording"):
            import transformers

            raise NotImplementedError(
                f"{type(model).__name__} uses sliding-window attention, whose KV cache transformers "
                f"{transformers.__version__} cannot roll back after a rejected draft (its cache has no "
                "activate_past_recording()): upgrade transformers")
        cache.activate_past_recording()
    return cache


def _records_past(cache: Any) -> bool:
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ()))


def context_window(model: Any) -> int | None:
    """The most positions ``model`` takes, from its config (``None`` if it does not say)."""
    mc = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return next((getattr(mc, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
                 if isinstance(getattr(mc, k, None), int)), None)
