"""rag_accel: lossless decoding acceleration for retrieval-augmented generation.

Greedy outputs identical to ``model.generate(do_sample=False)``, faster, by
copying drafts from the retrieved documents (LLMA), the prompt (prompt
lookup) and n-gram tables (ANPD), each verified in one forward pass.
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
from .models import DEFAULT_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "DecoderConfig",
    "Draft",
    "Drafter",
    "DrafterChain",
    "GenerationOutput",
    "GenerationStats",
    "GenerationStream",
    "NO_DRAFT",
    "NgramDrafter",
    "PromptLookupDrafter",
    "ReferenceDecoder",
    "ReferenceDrafter",
    "build_drafters",
]

__version__ = "0.1.0"
