"""OpenAI's Predicted Outputs, the same word on every decoder and on the server.

A prediction is text the answer is expected to repeat: the document being edited, an earlier answer,
the passages a RAG pipeline retrieved. It has OpenAI's shape::

    prediction={"type": "content", "content": "the text"}
    prediction={"type": "content", "content": [{"type": "text", "text": "passage one"},
                                               {"type": "text", "text": "passage two"}]}

Each part becomes one reference of that request (so a RAG client sends its documents as parts), beside
any references given otherwise. The output never depends on it: every draft is verified, so a wrong
prediction costs time, never a token.

What the counts mean (OpenAI's ``usage.completion_tokens_details``, and
:attr:`~rag_accel.outputs.GenerationStats.accepted_prediction_tokens` in process): draft tokens copied
from the request's references that verification kept (``accepted_prediction_tokens``) or threw away
(``rejected_prediction_tokens``). The request's references are the prediction's parts and any references
given beside them (``references=``, ``vllm_xargs`` ``references``); drafts copied from the prompt, the
output so far or the memory of earlier answers count only where the references hold the same tokens
(``RequestDrafting.credited``), so ``accepted + rejected`` is at most what the request drafted in all. No engine is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PREDICTION_SHAPE", "REFERENCE_SOURCE", "as_prediction", "prediction_parts", "with_prediction"]

PREDICTION_SHAPE = ('{"type": "content", "content": "<text>"} or {"type": "content", "content": '
                    '[{"type": "text", "text": "<text>"}, ...]}')
# The drafter whose drafts copy from a request's references (rag_accel.drafters.reference_drafter): its
# drafts are what GenerationStats counts as prediction tokens.
REFERENCE_SOURCE = "reference"


def prediction_parts(prediction: Any, field: str = "prediction") -> list[str]:
    """The texts of an OpenAI prediction, one per part (``None``: none). Raises ``TypeError`` /
    ``ValueError`` naming ``field`` and what is wrong (the server answers them with HTTP 400).

    Example:
        >>> prediction_parts({"type": "content", "content": "It is 42."})
        ['It is 42.']
        >>> prediction_parts({"type": "content", "content": [{"type": "text", "text": "a"},
        ...                                                  {"type": "text", "text": "b"}]})
        ['a', 'b']
        >>> prediction_parts(None)
        []
        >>> prediction_parts({"type": "content", "content": [{"type": "image_url", "image_url": {}}]})
        Traceback (most recent call last):
        ...
        ValueError: prediction.content[0] has type 'image_url': a prediction's parts must be text ({"type": "text", "text": "<text>"})
    """
    if prediction is None:
        return []
    if not isinstance(prediction, Mapping):
        raise TypeError(f"{field} must be an object {PREDICTION_SHAPE}, got {type(prediction).__name__}")
    unknown = sorted(set(prediction) - {"type", "content"})
    if unknown:
        raise ValueError(f"{field} has unknown keys {unknown}; it is {PREDICTION_SHAPE}")
    if prediction.get("type") != "content":
        raise ValueError(f"{field}.type must be 'content' (the only kind of prediction), got {prediction.get('type')!r}")
    if "content" not in prediction:
        raise ValueError(f"{field} has no content; it is {PREDICTION_SHAPE}")
    content = prediction["content"]
    if isinstance(content, str):
        return [_text(content, f"{field}.content")]
    if isinstance(content, (bytes, bytearray)) or not isinstance(content, Sequence):
        raise TypeError(f"{field}.content must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for i, part in enumerate(content):
        where = f"{field}.content[{i}]"
        if not isinstance(part, Mapping):
            raise TypeError(f"{where} must be a text part {{\"type\": \"text\", \"text\": \"<text>\"}}, "
                            f"got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"{where} has type {part.get('type')!r}: a prediction's parts must be text "
                             '({"type": "text", "text": "<text>"})')
        if "text" not in part:
            raise ValueError(f"{where} has no text")
        parts.append(_text(part["text"], f"{where}.text"))
    return parts


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a string, got {type(value).__name__}")
    from .inputs import check_text  # (no torch at import: rag_accel.inputs imports it)

    check_text(value, where)
    return value


def with_prediction(references: Any, prediction: Any) -> Any:
    """A call's references with its prediction's parts after them (``references`` as given when there is
    no prediction, so its own errors stay as they were).

    Example:
        >>> with_prediction(["doc"], {"type": "content", "content": "It is 42."})
        ['doc', 'It is 42.']
        >>> with_prediction("doc", None)
        'doc'
    """
    parts = prediction_parts(prediction)
    if prediction is None:
        return references
    if references is None:
        return parts
    if isinstance(references, str):
        return [references, *parts]
    if isinstance(references, Sequence) and not isinstance(references, (bytes, bytearray)):
        return [*references, *parts]
    return references  # (not a list: the decoder's own check says so)


def as_prediction(texts: Sequence[str]) -> dict[str, Any]:
    """Texts (retrieved documents) as an OpenAI prediction, one text part each.

    Example:
        >>> as_prediction(["a", "b"])
        {'type': 'content', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]}
    """
    return {"type": "content", "content": [{"type": "text", "text": t} for t in texts]}
