"""Cache-assisted generation: answers to similar past queries as references.

The LLMA paper's second scenario: a service that answers many similar
questions can copy from its own earlier answers. :class:`ResponseCache` keeps
(query, answer) pairs with a FAISS index over the query embeddings; for a new
query it returns the answers of the most similar past queries, which the
decoder then copies drafts from (``answers=``; only speed is at stake: the output is the
model's own greedy answer whatever the cache returns).

* Bounded: at most ``max_entries`` pairs; when full, the least recently used
  pair (stored or returned) is evicted.
* Safe with concurrent readers and writers in one process (one lock; the
  embedding, the slow part, runs outside it).
* Persistent and crash-safe: :meth:`save` writes one checksummed file and
  replaces the old one atomically, so a save killed midway leaves the previous
  cache loadable; a corrupted file raises :class:`~rag_accel.rag.storage.CorruptFileError`
  instead of silently starting empty.
"""

from __future__ import annotations

import json
import reprlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .retrieval import Embedder
from .storage import (
    Format,
    corrupt,
    faiss_part,
    json_part,
    load_container,
    save_container,
)

_ID = range(2**63)  # FAISS ids are int64
_FORMAT = Format("response-cache", {"dim": range(1, 2**31), "embedder": str, "count": _ID, "next_id": _ID,
                                    "clock": _ID, "max_entries": range(1, 2**63)}, ("faiss", "entries"))


@dataclass(frozen=True)
class CacheHit:
    query: str
    answer: str
    score: float


class ResponseCache:
    """Past (query, answer) pairs, searchable by query similarity.

    Args:
        embedder: embeds queries (E5's ``"query: "`` prefix on both sides).
        path: file to load from (if it exists) and save to.
        max_entries: capacity; least recently used pairs are evicted beyond it.
        min_score: cosine similarity below which a past query does not count.
        autosave: save after every :meth:`put` (needs ``path``).
    """

    def __init__(self, embedder: Embedder, path: str | Path | None = None, *, max_entries: int = 10_000,
                 min_score: float = 0.8, autosave: bool = False) -> None:
        import faiss

        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        if autosave and path is None:
            raise ValueError("autosave needs a path")
        self.embedder, self.path = embedder, Path(path) if path is not None else None
        self.max_entries, self.min_score, self.autosave = max_entries, min_score, autosave
        self._lock = threading.RLock()
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(embedder.dim))
        self._entries: dict[int, list] = {}  # id -> [query, answer, last_used]
        self._next_id = 0
        self._clock = 0
        if self.path is not None and self.path.exists():
            self._load()

    def __len__(self) -> int:
        return len(self._entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def put(self, query: str, answer: str) -> None:
        """Store a pair (evicting the least recently used one when full)."""
        if not isinstance(query, str) or not isinstance(answer, str):
            raise TypeError(f"query and answer must be strings, got {type(query).__name__}, {type(answer).__name__}")
        vec = self.embedder.embed_queries([query])
        with self._lock:
            eid = self._next_id
            self._next_id += 1
            self._index.add_with_ids(vec, np.array([eid], dtype=np.int64))
            self._entries[eid] = [query, answer, self._tick()]
            if len(self._entries) > self.max_entries:
                victims = sorted(self._entries, key=lambda i: self._entries[i][2])[: len(self._entries) - self.max_entries]
                self._index.remove_ids(np.array(victims, dtype=np.int64))
                for v in victims:
                    del self._entries[v]
            if self.autosave:
                self.save()

    def lookup(self, query: str, k: int = 3, min_score: float | None = None) -> list[CacheHit]:
        """The pairs whose queries are most similar to ``query`` (at least ``min_score``)."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a string, got {type(query).__name__}")
        threshold = self.min_score if min_score is None else min_score
        vec = self.embedder.embed_queries([query])
        with self._lock:
            if not self._entries:
                return []
            scores, ids = self._index.search(vec, min(k, len(self._entries)))
            hits = []
            for s, i in zip(scores[0], ids[0]):
                if i < 0 or s < threshold or int(i) not in self._entries:
                    continue
                entry = self._entries[int(i)]
                entry[2] = self._tick()  # a hit counts as a use
                hits.append(CacheHit(entry[0], entry[1], float(s)))
            return hits

    def references(self, query: str, k: int = 3) -> list[str]:
        """Answers of similar past queries, ready to pass as ``answers=`` (drafted as the model's earlier
        answers are; as ``references=`` they would draft as passages do)."""
        return [h.answer for h in self.lookup(query, k)]

    def save(self, path: str | Path | None = None) -> None:
        import faiss

        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("no path to save to: pass one here or when creating the cache")
        with self._lock:
            meta = {"dim": self.embedder.dim, "embedder": self.embedder.name, "count": len(self._entries),
                    "next_id": self._next_id, "clock": self._clock, "max_entries": self.max_entries}
            parts = {"faiss": faiss.serialize_index(self._index).tobytes(),
                     "entries": json.dumps({str(k): v for k, v in self._entries.items()}).encode()}
            save_container(target, _FORMAT, meta, parts)

    def _load(self) -> None:
        import faiss

        meta, parts = load_container(self.path, _FORMAT)
        if meta["dim"] != self.embedder.dim:
            raise ValueError(f"cache {self.path} holds {meta['dim']}-dimensional query vectors "
                             f"(embedder {meta['embedder']!r}); the embedder given makes {self.embedder.dim}")
        index = faiss_part(self.path, parts["faiss"], "IndexIDMap2", meta["dim"], meta["count"])
        entries = _read_entries(self.path, parts["entries"], meta)
        ids = faiss.vector_to_array(index.id_map).tolist()
        if type(faiss.downcast_index(index.index)).__name__ != "IndexFlatIP" or sorted(ids) != sorted(entries):
            raise corrupt(self.path, "the FAISS index does not hold one inner-product vector per entry id")
        self._index, self._entries = index, entries
        self._next_id, self._clock = meta["next_id"], meta["clock"]


def _read_entries(path: Path, blob: bytes, meta: dict) -> dict[int, list]:
    """The stored entries (id -> [query, answer, last use]), checked against the header's counters."""
    raw = json_part(path, blob, "entry list")
    if type(raw) is not dict or len(raw) != meta["count"] or meta["count"] > meta["max_entries"]:
        raise corrupt(path, f"the entry list is not an object of {meta['count']} entries "
                            f"(at most max_entries, {meta['max_entries']})")
    entries = {}
    for key, value in raw.items():
        eid = int(key) if key.isascii() and key.isdigit() and str(int(key)) == key else -1
        if not (0 <= eid < meta["next_id"] and type(value) is list and len(value) == 3
                and type(value[0]) is str and type(value[1]) is str
                and type(value[2]) is int and 0 <= value[2] <= meta["clock"]):
            raise corrupt(path, f"entry {reprlib.repr(key)}: {reprlib.repr(value)} is not [query, answer, last use] "
                                f"with an id below next_id ({meta['next_id']}) and a last use up to the clock "
                                f"({meta['clock']})")
        entries[eid] = value
    return entries
