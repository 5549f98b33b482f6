"""Response cache (persistent, bounded, concurrent, crash-safe) and multi-turn references."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import hf_greedy

from rag_accel.rag.cache import ResponseCache
from rag_accel.rag.conversation import Conversation
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.rag.retrieval import OFFLINE_MINILM, Embedder, VectorIndex
from rag_accel.rag.storage import CorruptFileError


@pytest.fixture(scope="module")
def emb():
    return Embedder(OFFLINE_MINILM)


def test_lookup_finds_similar_past_queries(emb):
    cache = ResponseCache(emb, min_score=0.5)
    cache.put("what is the cost of sales", "The cost of sales is the direct cost of producing goods sold.")
    cache.put("how tall is mount everest", "Mount Everest is 8,849 metres tall.")
    hits = cache.lookup("what does cost of sales mean")
    assert hits[0].answer.startswith("The cost of sales") and hits[0].score > 0.5
    assert all("Everest" not in h.answer for h in hits)
    assert cache.lookup("completely unrelated knitting patterns", min_score=0.9) == []


def test_bounded_with_least_recently_used_eviction(emb):
    cache = ResponseCache(emb, max_entries=3, min_score=0.0)
    for q in ["alpha question", "beta question", "gamma question"]:
        cache.put(q, q.upper())
    cache.lookup("alpha question", k=1)  # alpha used recently: beta is now the oldest
    cache.put("delta question", "DELTA")
    assert len(cache) == 3
    answers = {h.answer for h in cache.lookup("question", k=3)}
    assert answers == {"ALPHA QUESTION", "GAMMA QUESTION", "DELTA"}


def test_persistence_round_trip_and_corruption(tmp_path, emb):
    path = tmp_path / "cache.bin"
    cache = ResponseCache(emb, path, min_score=0.5)
    cache.put("what is cost of sales", "direct costs of goods sold")
    cache.save()
    again = ResponseCache(emb, path, min_score=0.5)
    assert len(again) == 1 and again.references("cost of sales meaning") == ["direct costs of goods sold"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        ResponseCache(emb, path)  # never silently empty
    with pytest.raises(TypeError):
        again.put("q", None)
    assert len(again) == 1


def test_concurrent_readers_and_writers(emb):
    cache = ResponseCache(emb, max_entries=50, min_score=0.0)
    errors = []

    def writer(w):
        try:
            for i in range(10):
                cache.put(f"question {w}-{i}", f"answer {w}-{i}")
        except Exception as e:  # pragma: no cover
            errors.append(e)

    def reader():
        try:
            for _ in range(10):
                for h in cache.lookup("question 1-3", k=5):
                    assert h.answer == "answer " + h.query.split()[1]
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 40


def test_a_save_killed_midway_leaves_a_loadable_cache(tmp_path, emb):
    path = tmp_path / "cache.bin"
    script = textwrap.dedent(f"""
        import sys
        from rag_accel.rag.cache import ResponseCache
        from rag_accel.rag.retrieval import Embedder
        cache = ResponseCache(Embedder({OFFLINE_MINILM!r}), {str(path)!r}, min_score=0.0)
        i = len(cache)
        while True:
            cache.put(f"question number {{i}} " + "padding " * 2000, f"answer {{i}}")
            cache.save()
            print(i, flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # wait until a few saves have completed
            assert proc.stdout.readline(), "the writer died"
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # most likely in the middle of a put or a save
    finally:
        proc.wait()
    cache = ResponseCache(emb, path, min_score=0.0)
    assert len(cache) >= 3
    for h in cache.lookup("question number 1", k=len(cache)):
        assert h.answer == "answer " + h.query.split()[2]


@pytest.mark.slow
def test_cache_hit_feeds_references_and_output_stays_greedy(real_decoder, emb):
    item = load_msmarco_sample(with_answers=True, limit=1)[0]
    messages = rag_messages(item.query, item.passages)
    ids = real_decoder.encode_prompt(messages)
    want = hf_greedy(real_decoder.model, ids, 40)
    cache = ResponseCache(emb, min_score=0.6)
    cache.put(item.query, real_decoder.tokenizer.decode(want, skip_special_tokens=True))
    refs = cache.references("Please tell me: " + item.query)
    assert len(refs) == 1
    out = real_decoder.generate(messages, references=refs, max_new_tokens=40, config={"adaptive": False})
    assert out.token_ids == want
    assert out.stats.by_drafter["reference"]["accepted"] >= 20


@pytest.mark.slow
def test_cache_hit_passed_as_answers_drafts_as_the_memory_and_output_stays_greedy(real_decoder, emb):
    item = load_msmarco_sample(with_answers=True, limit=1)[0]
    messages = rag_messages(item.query, item.passages)
    want = hf_greedy(real_decoder.model, real_decoder.encode_prompt(messages), 40)
    cache = ResponseCache(emb, min_score=0.6)
    cache.put(item.query, real_decoder.tokenizer.decode(want, skip_special_tokens=True))
    answers = cache.references("Please tell me: " + item.query)
    out = real_decoder.generate(messages, answers=answers, max_new_tokens=40, config={"adaptive": False})
    assert out.token_ids == want
    assert out.stats.by_drafter["memory"]["accepted"] >= 20
    with pytest.raises(TypeError, match="answers must be a list"):
        real_decoder.generate(messages, answers=5)
    with pytest.raises(ValueError, match="max_reference_tokens|hold"):
        real_decoder.generate(messages, references=["word " * 60], answers=["word " * 60],
                              config={"max_reference_tokens": 100})


@pytest.mark.slow
def test_conversation_uses_earlier_turns_and_stays_greedy(real_decoder, emb):
    items = load_msmarco_sample(with_answers=True, limit=3)
    index = VectorIndex(emb)
    index.add([p for it in items for p in it.passages])
    conv = Conversation(real_decoder, index=index, k=2, cache=ResponseCache(emb))
    turns = [items[0].query, "Repeat your previous answer word for word."]
    for i, question in enumerate(turns):
        msgs = conv.messages(question, [h.text for h in index.search(question, 2)])
        turn = conv.ask(question, max_new_tokens=32, config={"adaptive": False})
        assert turn.passages
        assert turn.output.token_ids == hf_greedy(real_decoder.model, real_decoder.encode_prompt(msgs), 32)
    assert conv.turns[0].answer in conv.references("next", [])
    assert len(conv.turns) == 2 and len(conv.cache) == 2
    assert "reference" in conv.turns[1].output.stats.by_drafter  # the follow-up copied from the history
