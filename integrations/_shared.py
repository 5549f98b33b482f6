"""What both adapters need: one loaded decoder per (model, device, dtype), and
framework documents turned into reference texts. No framework imports here."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

_DECODERS: dict[tuple[str, str | None, str | None], Any] = {}
_LOAD_LOCK = threading.Lock()


def shared_decoder(model_name: str, device: str | None = None, dtype: str | None = None) -> Any:
    """The :class:`rag_accel.ReferenceDecoder` for this model, loaded once per
    process: several adapter instances (and threads) share the weights, and the
    decoder serialises calls on them."""
    key = (model_name, device, dtype)
    with _LOAD_LOCK:
        if key not in _DECODERS:
            from rag_accel import ReferenceDecoder

            _DECODERS[key] = ReferenceDecoder.from_pretrained(model_name, device=device, dtype=dtype)
        return _DECODERS[key]


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
