"""rag_accel: lossless decoding acceleration for retrieval-augmented generation.

Greedy outputs identical to ``model.generate(do_sample=False)``, faster, by
copying drafts from the retrieved documents (LLMA), the prompt (prompt
lookup), n-gram tables (ANPD) or a small draft model, each verified in one
forward pass.
"""

from .config import DecoderConfig
from .decoder import GenerationOutput, GenerationStats, GenerationStream, ReferenceDecoder
from .drafters import (
    NO_DRAFT,
    Draft,
    Drafter,
    DrafterChain,
    NgramDrafter,
    PromptLookupDrafter,
    ReferenceDrafter,
    build_drafters,
)
from .draft_models import ModelDrafter, UniversalDrafter
from .models import DEFAULT_MODEL
from .protocol import Decoder


def load(model: str = DEFAULT_MODEL, *, backend: str | None = None, base_url: str | None = None,
         device: str | None = None, dtype: str | None = None, **options: object) -> Decoder:
    """A :class:`~rag_accel.protocol.Decoder` for ``model``, the one way the adapters get theirs:
    ``backend="hf"`` (default; transformers in process, loaded once per process and shared),
    ``"vllm"`` (a vLLM engine in process, shared likewise), or ``base_url=`` (a ``rag-accel serve``
    server; ``options``: ``api_key``, ``timeout``, ``max_retries``). Each has the same calls.

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
