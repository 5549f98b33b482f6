"""rag_accel: lossless decoding acceleration for retrieval-augmented generation.

Greedy outputs identical to ``model.generate(do_sample=False)``, faster, by
copying drafts from the retrieved documents (LLMA), the prompt (prompt
lookup), n-gram tables (ANPD) or a small draft model, each verified in one
forward pass.

The names below are imported on first use (PEP 562): ``import rag_accel`` alone
loads neither torch nor transformers, so ``rag-accel serve`` and the command
line's help start without them; ``from rag_accel import ReferenceDecoder``
loads what that name needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .config import DecoderConfig
    from .hf.decoder import GenerationOutput, GenerationStats, GenerationStream, ReferenceDecoder
    from .hf.draft_models import ModelDrafter, UniversalDrafter
    from .drafters import (
        NO_DRAFT,
        Draft,
        Drafter,
        DrafterChain,
        FrequencyDrafter,
        NgramDrafter,
        PromptLookupDrafter,
        ReferenceDrafter,
        build_drafters,
    )
    from .protocol import Decoder

# name -> the module that defines it
_LAZY = {
    "DecoderConfig": ".config",
    "GenerationOutput": ".outputs", "GenerationStats": ".outputs", "GenerationStream": ".outputs",
    "ReferenceDecoder": ".hf.decoder",
    "NO_DRAFT": ".drafters", "Draft": ".drafters", "Drafter": ".drafters", "DrafterChain": ".drafters",
    "FrequencyDrafter": ".drafters", "NgramDrafter": ".drafters", "PromptLookupDrafter": ".drafters", "ReferenceDrafter": ".drafters",
    "build_drafters": ".drafters",
    "ModelDrafter": ".hf.draft_models", "UniversalDrafter": ".hf.draft_models",
    "Decoder": ".protocol",
}

from .models import DEFAULT_MODEL  # (no torch: rag_accel.models imports it inside its loaders)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load(model: str = DEFAULT_MODEL, *, backend: str | None = None, base_url: str | None = None,
         device: str | None = None, dtype: str | None = None, **options: object) -> Decoder:
    """A :class:`~rag_accel.protocol.Decoder` for ``model``, the one way the adapters get theirs:
    ``backend="hf"`` (default; transformers in process, loaded once per process and shared),
    ``"vllm"`` (a vLLM engine in process, shared likewise; ``options`` go to the engine, e.g.
    ``max_model_len``, ``tensor_parallel_size``: the first load decides them, a later load without
    options gets the same engine), or ``base_url=`` (a ``rag-accel serve`` server; ``options``:
    ``api_key``, ``timeout``, ``max_retries``). Each has the same calls.

    Example:
        >>> dec = load()  # doctest: +SKIP
        >>> dec.generate("The capital of France is", max_new_tokens=8).text  # doctest: +SKIP
    """
    from .adapters import adapter_engine

    return adapter_engine(model, backend=backend, base_url=base_url, device=device, dtype=dtype,
                          **options)  # type: ignore[arg-type]

__all__ = [
    "DEFAULT_MODEL",
    "Decoder",
    "DecoderConfig",
    "Draft",
    "Drafter",
    "DrafterChain",
    "FrequencyDrafter",
    "GenerationOutput",
    "GenerationStats",
    "GenerationStream",
    "ModelDrafter",
    "NO_DRAFT",
    "NgramDrafter",
    "PromptLookupDrafter",
    "ReferenceDecoder",
    "ReferenceDrafter",
    "UniversalDrafter",
    "build_drafters",
    "load",
]

__version__ = "0.1.0"
