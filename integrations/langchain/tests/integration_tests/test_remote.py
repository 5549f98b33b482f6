"""ChatRagAccel in remote mode (``base_url``): a real `rag-accel serve` server (started with the Python named
by RAG_ACCEL_VLLM_PYTHON; see conftest.py), inside ``rag_chain``. Answers equal the same server with drafting
off (``accelerate=False``: vLLM's greedy), token for token; each call's retrieved documents reach the server
as that request's references (the server's own spec-decode counters: a retriever returning the answer itself
gets its drafts accepted); stream, batch (threads, no lock), async, usage, stops; stats the server cannot
give are None."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_rag_accel import ChatRagAccel, rag_chain

from rag_accel.rag.msmarco import load_msmarco_sample

MAX_NEW = 32
MODEL = "smollm2-135m-instruct"
pytestmark = pytest.mark.xdist_group("rag-accel-serve")  # one test process runs the shared server's modules


class SampleRetriever(BaseRetriever):
    """Each sample question's own passages (retrieval quality is not what is tested here)."""

    docs: dict[str, list[Document]]

    def _get_relevant_documents(self, query, *, run_manager):
        return list(self.docs[query])


@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(limit=3)


@pytest.fixture(scope="module")
def retriever(items):
    return SampleRetriever(docs={it.query: [Document(page_content=p) for p in it.passages] for it in items})


@pytest.fixture(scope="module")
def greedy(remote_server, retriever, items):
    """The server's answers with drafting off, one call at a time: the reference for every comparison."""
    off = ChatRagAccel(base_url=remote_server.base_url, model=MODEL, max_tokens=MAX_NEW, accelerate=False)
    chain = rag_chain(retriever, off, parser=None)
    return {it.query: chain.invoke(it.query) for it in items}


@pytest.mark.slow
def test_rag_chain_on_a_server_equals_greedy_and_sends_the_documents(remote_server, retriever, items, greedy):
    llm = ChatRagAccel(base_url=remote_server.base_url, model=MODEL, max_tokens=MAX_NEW)
    q = items[0].query
    msg = rag_chain(retriever, llm, parser=None).invoke(q)
    ref = greedy[q]
    assert msg.content == ref.content and msg.usage_metadata == ref.usage_metadata
    assert msg.usage_metadata["output_tokens"] > 0 and msg.usage_metadata["input_tokens"] > 100
    meta = msg.response_metadata
    assert meta["model_name"] == MODEL and meta["finish_reason"] in ("stop", "length")
    stats = meta["rag_accel"]  # what the server cannot give is None, never a made-up number
    assert stats["drafted"] is None and stats["accepted"] is None and stats["tokens_per_step"] is None
    assert stats["steps"] is None and stats["new_tokens"] == msg.usage_metadata["output_tokens"]
    assert llm._identifying_params["backend"] == "remote"
    # The retrieved documents are this request's references: a retriever whose document is the
    # answer itself gets the answer's tokens drafted and accepted in the server's engine.
    answer = SampleRetriever(docs={q: [Document(page_content=ref.content)]})
    d0, a0 = remote_server.spec_decode_counters()
    copied = rag_chain(answer, llm, parser=None).invoke(q)
    d1, a1 = remote_server.spec_decode_counters()
    n = copied.usage_metadata["output_tokens"]
    assert a1 - a0 >= 0.5 * n and a1 - a0 >= 0.8 * (d1 - d0), (d1 - d0, a1 - a0, n)
    # (the prompt now holds the answer as its only passage: its greedy answer may differ from ref)
    off = ChatRagAccel(base_url=remote_server.base_url, model=MODEL, max_tokens=MAX_NEW, accelerate=False)
    assert copied.content == rag_chain(answer, off, parser=None).invoke(q).content


@pytest.mark.slow
def test_a_cached_answer_reaches_the_server_as_answers(remote_server, retriever, items, greedy):
    """The chain's earlier answer to the question passed back with ``answers=`` (a client's cached answer): the
    same output, and most of its tokens accepted in the server's engine, where the passages alone got few
    (no memory scope: only the call brings the answer; 26 and 6 of 32 when this test was written)."""
    llm = ChatRagAccel(base_url=remote_server.base_url, model=MODEL, max_tokens=MAX_NEW)
    q = items[2].query
    cached = greedy[q]
    accepted = []
    for bound in (llm, llm.bind(answers=[cached])):
        _, a0 = remote_server.spec_decode_counters()
        again = rag_chain(retriever, bound, parser=None).invoke(q)
        _, a1 = remote_server.spec_decode_counters()
        assert again.content == cached.content
        accepted.append(a1 - a0)
    assert accepted[1] >= 0.6 * again.usage_metadata["output_tokens"] > accepted[0], accepted


@pytest.mark.slow
def test_stream_batch_async_and_stops_on_a_server(remote_server, retriever, items, greedy):
    llm = ChatRagAccel(base_url=remote_server.base_url, model=MODEL, max_tokens=MAX_NEW)
    chain = rag_chain(retriever, llm)
    qs = [it.query for it in items]
    pieces = list(chain.stream(qs[1]))
    assert len(pieces) > 1 and "".join(pieces) == greedy[qs[1]].content
    assert chain.batch(qs, config={"max_concurrency": 3}) == [greedy[q].content for q in qs]  # threads at once

    async def both():
        a = await chain.ainvoke(qs[2])
        s = [p async for p in chain.astream(qs[2])]
        return a, "".join(s)

    a, s = asyncio.run(both())
    assert a == s == greedy[qs[2]].content
    words = greedy[qs[0]].content.split()
    word = words[min(3, len(words) - 1)]
    cut = rag_chain(retriever, llm.bind(stop=[word]), parser=None).invoke(qs[0])
    assert cut.content == greedy[qs[0]].content[:greedy[qs[0]].content.find(word)]
    assert cut.response_metadata["finish_reason"] == "stop"


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="base_url"):
        ChatRagAccel(backend="remote")
    with pytest.raises(ValueError, match="server"):
        ChatRagAccel(base_url="http://127.0.0.1:9/v1", dtype="float32")
    with pytest.raises(ValueError, match="backend"):
        ChatRagAccel(base_url="http://127.0.0.1:9/v1", backend="hf")
    with pytest.raises(ValueError, match="backend must be"):
        ChatRagAccel(backend="tgi")
    with pytest.raises(ValueError, match="not both"):
        ChatRagAccel(backend="vllm", decoder=object.__new__(type("D", (), {"generate": len, "stream": len})))
