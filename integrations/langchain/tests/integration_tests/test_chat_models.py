"""ChatRagAccel on the real offline model: a real RAG chain (E5 + FAISS over MS-MARCO) whose answers
equal plain greedy, concurrency, options and bad input. (LangChain's standard suites: test_standard.py.)"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_rag_accel import (
    ChatRagAccel,
    VectorIndexRetriever,
    default_rag_prompt,
    format_documents,
    rag_chain,
    to_chat_messages,
)

from rag_accel import DEFAULT_MODEL
from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.rag.retrieval import VectorIndex

MAX_NEW = 40


# --------------------------------------------------------------------------- a real RAG chain
@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(with_answers=True, limit=6)


@pytest.fixture(scope="module")
def retriever(e5, items):
    index = VectorIndex(e5)
    index.add([p for it in items for p in it.passages],
              ids=[f"{it.id}/{j}" for it in items for j in range(len(it.passages))])
    return VectorIndexRetriever(index=index, k=3)


@pytest.fixture(scope="module")
def llm(real_decoder):
    return ChatRagAccel(decoder=real_decoder, max_tokens=MAX_NEW)


def _greedy_answer(decoder, retriever, question):
    """Plain greedy decoding (model.generate) of the prompt the chain builds."""
    docs = retriever.invoke(question)
    prompt = default_rag_prompt().invoke({"context": format_documents(docs), "question": question})
    return decoder.generate_greedy(to_chat_messages(prompt.to_messages()), max_new_tokens=MAX_NEW).text


@pytest.fixture(scope="module")
def expected(real_decoder, retriever, items):
    return {it.query: _greedy_answer(real_decoder, retriever, it.query) for it in items[:3]}


def test_chain_invoke_equals_greedy_and_uses_the_retrieved_documents(llm, retriever, items, expected):
    # the plain chain (references first, no learnt choice between drafters) makes the copying visible
    chain = rag_chain(retriever, llm.bind(decoder_config={"adaptive": False}), parser=None)
    copied = 0
    for it in items[:3]:
        msg = chain.invoke(it.query)
        assert isinstance(msg, AIMessage)
        assert msg.content == expected[it.query]
        stats = msg.response_metadata["rag_accel"]
        assert msg.usage_metadata["output_tokens"] == stats["new_tokens"] > 0
        copied += stats["by_drafter"].get("reference", {}).get("accepted", 0)
    assert copied > 0  # the documents reached the decoder and were copied from


def test_chain_stream_batch_ainvoke_astream_give_the_same_answers(llm, retriever, items, expected):
    chain = rag_chain(retriever, llm)  # answer strings
    questions = [it.query for it in items[:3]]
    streamed = list(chain.stream(questions[0]))
    assert len(streamed) > 1 and "".join(streamed) == expected[questions[0]]
    assert chain.batch(questions, config={"max_concurrency": 3}) == [expected[q] for q in questions]

    async def run():
        a = await chain.ainvoke(questions[1])
        pieces = [p async for p in chain.astream(questions[2])]
        return a, pieces

    a, pieces = asyncio.run(run())
    assert a == expected[questions[1]]
    assert len(pieces) > 1 and "".join(pieces) == expected[questions[2]]


def test_last_stream_chunk_carries_usage_and_stats(llm, retriever, items):
    docs = retriever.invoke(items[0].query)
    chunks = list(llm.bind(references=docs).stream(items[0].query))
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.usage_metadata["output_tokens"] == last.response_metadata["rag_accel"]["new_tokens"]
    assert last.response_metadata["model_name"] == DEFAULT_MODEL
    assert last.response_metadata["finish_reason"] in ("stop", "length")


def test_concurrent_calls_on_one_model_each_get_their_own_greedy_answer(llm, real_decoder, items):
    """Threads and async tasks on one model: each output equals its own sequential greedy output."""
    prompts = [[SystemMessage("Answer briefly."), HumanMessage(f"{it.query}\n\n{it.passages[0]}")] for it in items]
    want = [real_decoder.generate_greedy(to_chat_messages(p), max_new_tokens=24).text for p in prompts]
    refs = [[Document(page_content=p) for p in it.passages] for it in items]
    # the references are deliberately crossed: item i gets item i+1's passages (a speed question only)
    crossed = refs[1:] + refs[:1]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: llm.invoke(prompts[i], references=crossed[i], max_tokens=24).content,
                            range(len(prompts))))
    assert got == want

    async def run():
        async def one(i):
            return "".join([c.content async for c in llm.astream(prompts[i], references=refs[i], max_tokens=24)])
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    assert asyncio.run(run()) == want


def test_a_cached_answer_passed_as_answers_drafts_as_the_memory_and_stays_greedy(llm, real_decoder, items):
    """A client's cached answer to a similar question (an AIMessage): exact output, copied by the memory drafter;
    the baseline (accelerate=False) takes the same call and ignores it."""
    prompt = [SystemMessage("Answer briefly."), HumanMessage(f"{items[1].query}\n\n{items[1].passages[0]}")]
    want = real_decoder.generate_greedy(to_chat_messages(prompt), max_new_tokens=MAX_NEW).text
    msg = llm.invoke(prompt, answers=[AIMessage(want)], decoder_config={"adaptive": False})
    assert msg.content == want
    stats = msg.response_metadata["rag_accel"]
    assert stats["new_tokens"] == MAX_NEW and stats["by_drafter"]["memory"]["accepted"] >= 30  # nearly all copied
    plain = ChatRagAccel(decoder=real_decoder, max_tokens=MAX_NEW, accelerate=False)
    assert plain.invoke(prompt, answers=[want]).content == want


def test_without_references_it_still_accelerates_from_the_prompt(llm, items):
    it = items[1]
    msg = llm.invoke([HumanMessage("Repeat this passage exactly:\n" + it.passages[0])], max_tokens=32)
    stats = msg.response_metadata["rag_accel"]
    assert "reference" not in stats["by_drafter"]
    assert stats["tokens_per_step"] > 1.5  # copied through prompt lookup / n-grams


def test_accelerate_false_is_plain_greedy_with_the_same_interface(real_decoder):
    fast = ChatRagAccel(decoder=real_decoder, max_tokens=16)
    plain = ChatRagAccel(decoder=real_decoder, max_tokens=16, accelerate=False)
    a, b = fast.invoke("Name three colours."), plain.invoke("Name three colours.")
    assert a.content == b.content
    assert b.response_metadata["rag_accel"]["tokens_per_step"] == 1.0
    assert "".join(c.content for c in plain.stream("Name three colours.")) == b.content


def test_stop_at_construction_and_per_call(real_decoder):
    llm = ChatRagAccel(decoder=real_decoder, max_tokens=24, stop=["assist"])
    out = llm.invoke("Hello")
    assert "assist" not in out.content and out.response_metadata["finish_reason"] == "stop"
    per_call = llm.invoke("Hello", stop=["!"])  # a per-call stop replaces the constructor's
    assert "!" not in per_call.content and per_call.content.startswith("Hello")


@pytest.mark.parametrize("kwargs, err, match", [
    ({"top_q": 0.9}, ValueError, "unknown option"),
    ({"temperature": -0.7}, ValueError, "temperature"),
    ({"top_p": 0.9}, ValueError, "set temperature > 0"),
    ({"temperature": 0.7, "top_p": 2.0}, ValueError, "top_p"),
    ({"model": "gpt-4"}, ValueError, "another instance"),
    ({"decoder_config": {"no_such_knob": 1}}, ValueError, "no_such_knob"),
    ({"decoder_config": [1]}, TypeError, "decoder_config"),
    ({"references": [object()]}, TypeError, "reference 0"),
    ({"answers": [object()]}, TypeError, "answer 0"),
    ({"answers": 5}, TypeError, "answer 0"),
    ({"max_tokens": 0}, ValueError, "max_new_tokens"),
])
def test_bad_call_options_are_clear_errors(llm, kwargs, err, match):
    with pytest.raises(err, match=match):
        llm.invoke("Hello", **kwargs)
    assert llm.invoke("Hi", max_tokens=4).content  # still usable afterwards


def test_bad_construction_and_unsupported_messages(real_decoder):
    with pytest.raises(ValueError, match="temperature"):
        ChatRagAccel(temperature=-0.5)
    with pytest.raises(ValueError, match="baseline"):
        ChatRagAccel(decoder=real_decoder, accelerate=False, temperature=0.7).invoke("hi")
    with pytest.raises(ValueError):
        ChatRagAccel(decoder_config={"no_such_knob": 1})
    with pytest.raises(ValueError):
        ChatRagAccel(unknown_field=1)
    with pytest.raises(TypeError, match="generate\\(\\) and stream\\(\\)"):
        ChatRagAccel(decoder="not a decoder")
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        ChatRagAccel(model="smollm2-135m-instructt")  # at construction, not at the first call
    llm = ChatRagAccel(decoder=real_decoder)
    with pytest.raises(NotImplementedError, match="tool"):
        llm.invoke([HumanMessage("hi"), ToolMessage("42", tool_call_id="1")])
    with pytest.raises(NotImplementedError, match="image"):
        llm.invoke([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])
    with pytest.raises(ValueError, match="context window"):
        llm.invoke("word " * 9000)


def test_temperature_samples_losslessly_and_a_seed_repeats(llm, retriever, items):
    """temperature > 0 samples (the decoder's speculative sampling, tested for its distribution in
    test_sampling.py); with a seed the same call gives the same answer, also through the chain."""
    chain = rag_chain(retriever, llm.bind(temperature=0.9, top_p=0.95, seed=3, max_tokens=24), parser=None)
    a, b = chain.invoke(items[0].query), chain.invoke(items[0].query)
    assert a.content == b.content and a.usage_metadata["output_tokens"] > 0
    other = [chain.invoke(items[0].query, config={"configurable": {}}).content]
    other += [rag_chain(retriever, llm.bind(temperature=0.9, top_p=0.95, seed=s, max_tokens=24)).invoke(items[0].query)
              for s in (4, 5, 6)]
    assert len(set(other)) > 1  # different seeds sample different answers
    assert llm._get_ls_params(temperature=0.9)["ls_temperature"] == 0.9


# --------------------------------------------------------------------------- options (from the hardening tests)
@pytest.fixture(scope="module")
def lc(real_decoder):
    return ChatRagAccel(decoder=real_decoder, max_tokens=4)


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""]])
def test_empty_stop_is_an_error_either_way(lc, stop):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        lc.invoke("Hello", stop=stop)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        type(lc)(decoder=lc.decoder, stop=stop if isinstance(stop, list) else [stop])
    assert lc.invoke("Hello", stop=[]).content == lc.invoke("Hello").content  # [] is no stop strings


def test_max_tokens_and_max_new_tokens_must_agree(lc):
    with pytest.raises(ValueError, match=r"max_tokens=3 and max_new_tokens=7"):
        lc.invoke("Hello", max_tokens=3, max_new_tokens=7)
    with pytest.raises(ValueError, match=r"max_tokens=3 and max_new_tokens=7"):
        ChatRagAccel(decoder=lc.decoder, max_tokens=3, max_new_tokens=7)
    assert lc.invoke("Hello", max_tokens=3, max_new_tokens=3).usage_metadata["output_tokens"] <= 3
    assert ChatRagAccel(decoder=lc.decoder, max_new_tokens=5).max_new_tokens == 5
