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

__all__ = [
    "DEFAULT_MODEL",
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
]

__version__ = "0.1.0"
