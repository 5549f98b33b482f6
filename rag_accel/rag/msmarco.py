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
from typing import Any

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


def rag_prompt(question: str, passages: list[str]) -> str:
    """The user turn of a RAG prompt: numbered passages, then the question."""
    if not passages:
        return question
    context = "\n\n".join(f"Passage {i}: {p}" for i, p in enumerate(passages, 1))
    return f"{context}\n\nQuestion: {question}"


def rag_completion(question: str, passages: list[str]) -> str:
    """A RAG prompt for a base model (one without a chat template, e.g. ``gemma-3-270m``): numbered
    passages, the question, then ``Answer:`` for the model to continue."""
    return f"{rag_prompt(question, passages)}\nAnswer:"


def rag_input(tokenizer: Any, query: str, passages: list[str],
              system: str = SYSTEM_PROMPT) -> list[dict[str, str]] | str:
    """What to ask ``tokenizer``'s model: :func:`rag_messages` where it has a chat template (an instruct
    model), :func:`rag_completion` where it has none (a base model, e.g. ``gemma-3-270m``)."""
    if getattr(tokenizer, "chat_template", None):
        return rag_messages(query, passages, system)
    return rag_completion(query, passages)


def rag_messages(query: str, passages: list[str], system: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages: a system prompt, then numbered passages and the question."""
    return [{"role": "system", "content": system}, {"role": "user", "content": rag_prompt(query, passages)}]


# --------------------------------------------------------------------------- official MS-MARCO files
def _tsv_rows(path: str | Path, ncols: int, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            cols = line.split("\t") if "\t" in line or ncols == 1 else line.split()
            if len(cols) != ncols:
                raise ValueError(f"{path}:{lineno}: expected {ncols} columns in a {what} file, got {len(cols)}")
            yield cols


def load_collection(path: str | Path, limit: int | None = None) -> dict[str, str]:
    """``collection.tsv``: ``pid<TAB>passage`` -> {pid: passage}."""
    out: dict[str, str] = {}
    for pid, text in _tsv_rows(path, 2, "collection"):
        out[pid] = text
        if limit is not None and len(out) >= limit:
            break
    return out


def load_queries(path: str | Path) -> dict[str, str]:
    """``queries.*.tsv``: ``qid<TAB>query`` -> {qid: query}."""
    return {qid: q for qid, q in _tsv_rows(path, 2, "queries")}


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """``qrels.*.tsv`` (TREC format: ``qid 0 pid grade``) -> {qid: {pid: grade}}."""
    out: dict[str, dict[str, int]] = {}
    for qid, _, pid, grade in _tsv_rows(path, 4, "qrels"):
        out.setdefault(qid, {})[pid] = int(grade)
    return out


def load_top1000(path: str | Path, limit_queries: int | None = None) -> dict[str, list[tuple[str, str]]]:
    """``top1000.*.tsv``: ``qid<TAB>pid<TAB>query<TAB>passage`` -> {qid: [(pid, passage), ...]} in file order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for qid, pid, _query, passage in _tsv_rows(path, 4, "top1000"):
        if qid not in out and limit_queries is not None and len(out) >= limit_queries:
            break
        out.setdefault(qid, []).append((pid, passage))
    return out
