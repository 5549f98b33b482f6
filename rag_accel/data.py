"""The bundled MS-MARCO sample and the RAG prompt built from it.

``rag_accel/data/msmarco_rag.jsonl``: 300 MS-MARCO QnA items (query, the
original 3-10 Bing passages, human answers); provenance in
``rag_accel/data/PROVENANCE.md``. MS MARCO is released by Microsoft for
non-commercial research use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the passages."


@dataclass(frozen=True)
class RagItem:
    id: str
    query: str
    passages: list[str]
    answers: list[str]


def sample_path() -> Path:
    return Path(str(resources.files("rag_accel") / "data" / "msmarco_rag.jsonl"))


def load_msmarco_sample(path: str | Path | None = None, *, with_answers: bool = False,
                        limit: int | None = None) -> list[RagItem]:
    """Items of an MS-MARCO RAG jsonl file (default: the bundled sample).

    Each line: ``{"id", "query", "passages": [...], "answers": [...]}``.
    A malformed line is an error that names the file and line.
    """
    path = Path(path) if path is not None else sample_path()
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    items: list[RagItem] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                item = RagItem(str(rec["id"]), str(rec["query"]), [str(p) for p in rec["passages"]],
                               [str(a) for a in rec.get("answers", [])])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not an MS-MARCO RAG record ({e})") from e
            if with_answers and not item.answers:
                continue
            items.append(item)
            if limit is not None and len(items) >= limit:
                break
    return items


def rag_messages(query: str, passages: list[str], system: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages: numbered passages, then the question."""
    context = "\n\n".join(f"Passage {i}: {p}" for i, p in enumerate(passages, 1))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{context}\n\nQuestion: {query}"},
    ]
