"""MS-MARCO loaders: the bundled sample and the official TSV formats."""

from __future__ import annotations

import pytest

from rag_accel.rag.msmarco import (
    load_collection,
    load_msmarco_sample,
    load_qrels,
    load_queries,
    load_top1000,
    rag_messages,
)


def test_bundled_sample():
    items = load_msmarco_sample()
    assert len(items) == 300
    answered = load_msmarco_sample(with_answers=True)
    assert len(answered) == 244 and all(it.answers for it in answered)
    assert load_msmarco_sample(limit=3)[0].query == "what is cost of sales"
    msgs = rag_messages("q?", ["p1", "p2"])
    assert msgs[1]["content"] == "Passage 1: p1\n\nPassage 2: p2\n\nQuestion: q?"


def test_malformed_sample_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "query": "q", "passages": ["p"], "answers": []}\n{"id": "2", "query": "q"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not an MS-MARCO RAG record"):
        load_msmarco_sample(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_msmarco_sample(tmp_path / "missing.jsonl")


def test_official_files(tmp_path):
    (tmp_path / "collection.tsv").write_text("0\tThe first passage.\n1\tThe second passage.\n")
    (tmp_path / "queries.dev.tsv").write_text("1048585\twhat is paula deen's brother\n")
    (tmp_path / "qrels.dev.tsv").write_text("1048585\t0\t1\t1\n1048585 0 0 0\n")
    (tmp_path / "top1000.dev.tsv").write_text(
        "1048585\t1\twhat is paula deen's brother\tThe second passage.\n"
        "1048585\t0\twhat is paula deen's brother\tThe first passage.\n"
        "7\t0\tother\tThe first passage.\n")
    assert load_collection(tmp_path / "collection.tsv") == {"0": "The first passage.", "1": "The second passage."}
    assert load_collection(tmp_path / "collection.tsv", limit=1) == {"0": "The first passage."}
    assert load_queries(tmp_path / "queries.dev.tsv") == {"1048585": "what is paula deen's brother"}
    assert load_qrels(tmp_path / "qrels.dev.tsv") == {"1048585": {"1": 1, "0": 0}}
    top = load_top1000(tmp_path / "top1000.dev.tsv")
    assert top["1048585"] == [("1", "The second passage."), ("0", "The first passage.")]
    assert list(load_top1000(tmp_path / "top1000.dev.tsv", limit_queries=1)) == ["1048585"]
    (tmp_path / "broken.tsv").write_text("only-one-column\n")
    with pytest.raises(ValueError, match=r"broken.tsv:1: expected 2 columns in a collection file, got 1"):
        load_collection(tmp_path / "broken.tsv")
