"""LlamaIndex adapter on real parts: FAISS vector store, E5 through HuggingFaceEmbedding,
the offline model. Answers equal the same engine on plain greedy; references are the
query's own nodes, also under concurrency; stale or wrong references cost only speed."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from llama_index.core.base.llms.types import ChatMessage, CompletionResponse
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.rag_accel import (
    RagAccelLLM,
    RagAccelQueryEngine,
    e5_embedding,
    faiss_vector_index,
    retrieval_capture,
)
from llama_index.llms.rag_accel.base import MAX_REFERENCE_IDS

from rag_accel.rag.msmarco import load_msmarco_sample

MAX_NEW = 40
_LOCK = threading.Lock()


class ChatEnds(BaseEventHandler):
    """Every LLM chat response, as the instrumentation reports it."""

    responses: list = []

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            with _LOCK:
                self.responses.append(event.response)

    @classmethod
    def class_name(cls):
        return "ChatEnds"


@pytest.fixture(scope="module")
def chat_ends():
    h = ChatEnds(responses=[])
    get_dispatcher().add_event_handler(h)
    yield h
    get_dispatcher().event_handlers.remove(h)


@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(with_answers=True, limit=6)


@pytest.fixture(scope="module")
def index(items):
    nodes = [TextNode(text=p, id_=f"{it.id}/{j}") for it in items for j, p in enumerate(it.passages)]
    return faiss_vector_index(nodes, e5_embedding())


@pytest.fixture(scope="module")
def llm(real_decoder):
    return RagAccelLLM(decoder=real_decoder, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def greedy_llm(real_decoder):
    return RagAccelLLM(decoder=real_decoder, max_new_tokens=MAX_NEW, accelerate=False)


def _ids(response):
    return [n.node.node_id for n in response.source_nodes]


def _stats_for(chat_ends, text):
    hits = [r.additional_kwargs["rag_accel"] for r in chat_ends.responses if r.message.content == text]
    assert hits, f"no LLM response with text {text[:40]!r}"
    return hits[-1]


def test_metadata_is_the_models(llm, real_decoder):
    meta = llm.metadata
    assert meta.context_window == real_decoder.context_window == 8192
    assert meta.num_output == MAX_NEW and meta.is_chat_model and meta.model_name == "smollm2-135m-instruct"


def test_query_engine_unchanged_code_gets_the_querys_nodes(index, llm, greedy_llm, items, chat_ends):
    q = items[1].query
    want = index.as_query_engine(llm=greedy_llm, similarity_top_k=3).query(q)
    got = index.as_query_engine(llm=llm, similarity_top_k=3).query(q)
    assert str(got) == str(want) and _ids(got) == _ids(want)
    stats = _stats_for(chat_ends, str(got))
    assert stats["reference_ids"] == _ids(got)
    assert retrieval_capture().open_records() == 0  # nothing kept once the query is over


def test_streaming_query_and_aquery(index, llm, greedy_llm, items, chat_ends):
    q = items[2].query
    want = str(index.as_query_engine(llm=greedy_llm, similarity_top_k=3).query(q))
    streaming = index.as_query_engine(llm=llm, similarity_top_k=3, streaming=True).query(q)
    pieces = list(streaming.response_gen)  # the LLM runs now, after the query's spans ended
    assert len(pieces) > 1 and "".join(pieces) == want
    assert _stats_for(chat_ends, want)["reference_ids"] == _ids(streaming)

    q3 = items[3].query
    want3 = str(index.as_query_engine(llm=greedy_llm, similarity_top_k=3).query(q3))
    got3 = asyncio.run(index.as_query_engine(llm=llm, similarity_top_k=3).aquery(q3))
    assert str(got3) == want3
    assert _stats_for(chat_ends, want3)["reference_ids"] == _ids(got3)
    assert retrieval_capture().open_records() == 0


def test_chat_engine(index, llm, greedy_llm, items, chat_ends):
    q = items[4].query
    want = str(index.as_chat_engine(chat_mode="context", llm=greedy_llm, similarity_top_k=3).chat(q))
    got = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=3).chat(q)
    assert str(got) == want
    assert _stats_for(chat_ends, want)["reference_ids"] == _ids(got)


def test_explicit_query_engine_sync_streaming_async(index, llm, greedy_llm, items):
    retriever = index.as_retriever(similarity_top_k=3)
    q = items[0].query
    want = RagAccelQueryEngine(retriever=retriever, llm=greedy_llm).query(q)
    got = RagAccelQueryEngine(retriever=retriever, llm=llm).query(q)
    assert str(got) == str(want) and _ids(got) == _ids(want)
    assert got.metadata["rag_accel"]["reference_ids"] == _ids(got)
    # With the plain chain (references first, no learnt choice between drafters) the copying is visible.
    chain_llm = RagAccelLLM(decoder=llm.engine, max_new_tokens=MAX_NEW, decoder_config={"adaptive": False})
    plain_chain = RagAccelQueryEngine(retriever=retriever, llm=chain_llm).query(q)
    assert str(plain_chain) == str(want)
    assert plain_chain.metadata["rag_accel"]["by_drafter"]["reference"]["accepted"] > 0

    stream = RagAccelQueryEngine(retriever=retriever, llm=llm, streaming=True).query(q)
    assert "".join(stream.response_gen) == str(want)
    assert stream.metadata["rag_accel"]["new_tokens"] > 0  # stats arrive with the last chunk
    got_async = asyncio.run(RagAccelQueryEngine(retriever=retriever, llm=llm).aquery(q))
    assert str(got_async) == str(want)


def test_concurrent_queries_get_their_own_nodes(index, llm, greedy_llm, items, chat_ends):
    qs = [items[1].query, items[5].query]
    want = [str(index.as_query_engine(llm=greedy_llm, similarity_top_k=3).query(q)) for q in qs]
    assert want[0] != want[1]
    engine = index.as_query_engine(llm=llm, similarity_top_k=3)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(engine.query, qs))
    assert [str(g) for g in got] == want
    for g in got:
        assert _stats_for(chat_ends, str(g))["reference_ids"] == _ids(g)

    async def both():
        return await asyncio.gather(*(engine.aquery(q) for q in qs))

    got = asyncio.run(both())
    assert [str(g) for g in got] == want
    for g in got:
        assert _stats_for(chat_ends, str(g))["reference_ids"] == _ids(g)
    assert retrieval_capture().open_records() == 0


def test_wrong_or_stale_references_cost_only_speed(index, llm, greedy_llm, items):
    messages = [ChatMessage(role="user", content=f"{items[0].passages[0]}\n\nQuestion: {items[0].query}")]
    want = greedy_llm.chat(messages).message.content
    other_nodes = index.as_retriever(similarity_top_k=3).retrieve(items[5].query)  # another question's nodes
    garbage = ["zzz qqq " * 50, items[0].passages[0][::-1]]
    for refs in (other_nodes, garbage, []):
        assert llm.chat(messages, references=refs).message.content == want


def test_a_cached_answer_passed_as_answers_drafts_as_the_memory(llm, greedy_llm, items):
    """An earlier ChatResponse to a similar question, passed as answers: exact output, copied by the memory
    drafter; the baseline takes the same call and ignores it."""
    messages = [ChatMessage(role="user", content=f"{items[3].passages[0]}\n\nQuestion: {items[3].query}")]
    earlier = greedy_llm.chat(messages)
    got = llm.chat(messages, answers=[earlier], decoder_config={"adaptive": False})
    assert got.message.content == earlier.message.content
    assert got.additional_kwargs["rag_accel"]["by_drafter"]["memory"]["accepted"] >= 20
    assert greedy_llm.chat(messages, answers=[earlier]).message.content == earlier.message.content
    completed = llm.complete(f"{items[3].passages[0]}\nSummary:", max_new_tokens=24)
    again = llm.complete(f"{items[3].passages[0]}\nSummary:", max_new_tokens=24, answers=completed)
    assert again.text == completed.text and "memory" in again.additional_kwargs["rag_accel"]["by_drafter"]


def test_complete_streaming_usage_and_token_counting(real_decoder, items):
    counter = TokenCountingHandler(tokenizer=real_decoder.tokenizer.encode)
    llm = RagAccelLLM(decoder=real_decoder, max_new_tokens=24, callback_manager=CallbackManager([counter]))
    prompt = f"{items[0].passages[0]}\nSummary:"
    whole = llm.complete(prompt, references=items[0].passages)
    assert whole.raw["usage"]["completion_tokens"] == whole.additional_kwargs["rag_accel"]["new_tokens"] > 0
    chunks = list(llm.stream_complete(prompt, references=items[0].passages))
    assert chunks[-1].text == whole.text == "".join(c.delta for c in chunks)
    assert chunks[-1].raw["usage"] == whole.raw["usage"]  # usage also when streaming
    assert counter.completion_llm_token_count > 0 and counter.prompt_llm_token_count > 0

    async def run():
        a = await llm.acomplete(prompt)
        pieces = [c.delta async for c in await llm.astream_complete(prompt)]
        return a, pieces

    a, pieces = asyncio.run(run())
    assert isinstance(a, CompletionResponse) and a.text == whole.text == "".join(pieces)


def test_async_calls_do_not_block_the_event_loop(llm):
    """While a generation runs in its worker thread, other tasks keep running."""
    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        await llm.acomplete("Write a long story about a dragon.", max_new_tokens=24)
        t.cancel()
        return ticks

    assert asyncio.run(run()) >= 3


def test_bad_input_is_a_clear_error(real_decoder, llm):
    with pytest.raises(ValueError, match="unknown option"):
        llm.complete("hi", top_q=0.7)
    with pytest.raises(ValueError, match="set temperature > 0"):
        llm.complete("hi", seed=1)
    with pytest.raises(NotImplementedError, match="tool"):
        llm.chat([ChatMessage(role="tool", content="42")])
    with pytest.raises(TypeError, match="reference 0"):
        llm.complete("hi", references=[3.5])
    with pytest.raises(TypeError, match="answer 0"):
        llm.complete("hi", answers=[3.5])
    with pytest.raises(ValueError, match="context window"):
        llm.complete("word " * 9000)
    with pytest.raises(ValueError):
        RagAccelLLM(decoder=real_decoder, decoder_config={"no_such_knob": 1})
    with pytest.raises(TypeError, match=r"generate\(\) and stream\(\)"):
        RagAccelLLM(decoder=object())
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        RagAccelLLM(model_name="smollm2")  # at construction, not at the first call
    assert llm.complete("Hi", max_new_tokens=4).text  # still usable


def test_temperature_samples_and_a_seed_repeats(index, llm, items):
    engine = index.as_query_engine(llm=RagAccelLLM(decoder=llm.engine, max_new_tokens=24, temperature=0.9, seed=11),
                                   similarity_top_k=3)
    a, b = str(engine.query(items[0].query)), str(engine.query(items[0].query))
    assert a == b and a
    answers = {llm.complete(items[0].query, temperature=0.9, seed=s, max_new_tokens=24).text for s in (1, 2, 3)}
    assert len(answers) > 1


def test_metadata_lists_a_count_and_the_first_node_ids_not_hundreds(index, llm, items, chat_ends):
    """A query may pass hundreds of nodes (one had 249): the metadata keeps their count and the
    ids of the first MAX_REFERENCE_IDS distinct ones (the best-ranked), in order."""
    retriever = index.as_retriever(similarity_top_k=30)
    nodes = retriever.retrieve(items[0].query)
    assert len(nodes) == 30
    r = llm.chat([ChatMessage(role="user", content=items[0].query)], references=nodes + nodes[:5], max_new_tokens=4)
    meta = r.additional_kwargs["rag_accel"]
    assert meta["reference_count"] == 35
    assert meta["reference_ids"] == [n.node.node_id for n in nodes[:MAX_REFERENCE_IDS]]
    # a query engine with a large top-k: the same summary, through the captured nodes
    got = index.as_query_engine(llm=llm, similarity_top_k=30).query(items[0].query)
    stats = _stats_for(chat_ends, str(got))
    assert stats["reference_count"] == 30 and stats["reference_ids"] == _ids(got)[:MAX_REFERENCE_IDS]
    # strings and duplicates: counted, but only distinct node ids are listed
    texts = llm.complete("Hi", references=["a passage", NodeWithScore(node=TextNode(text="b", id_="n1")),
                                           TextNode(text="b", id_="n1")], max_new_tokens=2)
    assert texts.additional_kwargs["rag_accel"]["reference_count"] == 3
    assert texts.additional_kwargs["rag_accel"]["reference_ids"] == ["n1"]


# --------------------------------------------------------------------------- options (from the hardening tests)
@pytest.fixture(scope="module")
def li(real_decoder):
    return RagAccelLLM(decoder=real_decoder, max_new_tokens=4, capture_retrievals=False)


def test_max_tokens_is_an_alias_that_must_agree(li):
    assert RagAccelLLM(decoder=li.decoder, max_tokens=3, capture_retrievals=False).max_new_tokens == 3
    with pytest.raises(ValueError, match=r"max_tokens=3 and max_new_tokens=7"):
        RagAccelLLM(decoder=li.decoder, max_tokens=3, max_new_tokens=7, capture_retrievals=False)
    with pytest.raises(ValueError, match=r"max_tokens=3 and max_new_tokens=7"):
        li.complete("Hello", max_tokens=3, max_new_tokens=7)
    out = li.complete("Hello", max_tokens=2)
    assert out.raw["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("stop", ["", [""]])
def test_empty_stop_is_an_error_either_way(li, stop):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        li.complete("Hello", stop=stop)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        RagAccelLLM(decoder=li.decoder, stop=[""], capture_retrievals=False)
    assert li.complete("Hello", stop=[]).text == li.complete("Hello").text
