"""The LlamaHub checks: the class is a LlamaIndex LLM (BaseLLM in its MRO) and the public names import;
plus what RagAccelLLM checks without loading a model."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.schema import NodeWithScore, TextNode

import llama_index.llms.rag_accel
from llama_index.llms.rag_accel import RagAccelLLM
from llama_index.llms.rag_accel.base import MAX_REFERENCE_IDS, reference_summary


def test_llm_class():
    names_of_base_classes = [b.__name__ for b in RagAccelLLM.__mro__]
    assert BaseLLM.__name__ in names_of_base_classes
    assert issubclass(RagAccelLLM, BaseLLM)


def test_all_imports():
    assert sorted(llama_index.llms.rag_accel.__all__) == [
        "RagAccelLLM", "RagAccelQueryEngine", "e5_embedding", "faiss_vector_index", "retrieval_capture"]


class FakeDecoder:
    """Any object with the decoder surface (generate/stream) is accepted, e.g. rag_accel.vllm.VllmDecoder."""

    def generate(self, prompt, references=None, **kw):
        raise AssertionError("not called here")

    def stream(self, prompt, references=None, **kw):
        raise AssertionError("not called here")


def test_decoder_is_checked_by_its_methods():
    fake = FakeDecoder()
    assert RagAccelLLM(decoder=fake, capture_retrievals=False).engine is fake
    with pytest.raises(TypeError, match=r"generate\(\) and stream\(\).*object has no generate\(\), stream\(\)"):
        RagAccelLLM(decoder=object(), capture_retrievals=False)
    with pytest.raises(TypeError, match=r"generate_greedy\(\), which FakeDecoder does not have"):
        RagAccelLLM(decoder=fake, accelerate=False, capture_retrievals=False).complete("hi")


def test_reference_summary_counts_all_and_lists_the_first_distinct_ids():
    nodes = [NodeWithScore(node=TextNode(text=f"passage {i}", id_=f"n{i}"), score=1.0) for i in range(249)]
    assert reference_summary(nodes) == {"reference_count": 249,
                                        "reference_ids": [f"n{i}" for i in range(MAX_REFERENCE_IDS)]}
    mixed = ["text", [1, 2, 3], TextNode(text="a", id_="x"), nodes[0], TextNode(text="a", id_="x")]
    assert reference_summary(mixed) == {"reference_count": 5, "reference_ids": ["x", "n0"]}
    assert reference_summary([]) == {"reference_count": 0, "reference_ids": []}


def test_answers_are_the_texts_of_llama_index_responses_and_nodes():
    from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse
    from llama_index.core.base.response.schema import Response

    from rag_accel.adapters import answer_texts

    given = [ChatResponse(message=ChatMessage(role="assistant", content="chat said")),
             CompletionResponse(text="completed"), Response(response="the query's answer"),
             ChatMessage(role="assistant", content="a message"), TextNode(text="a node", id_="n"),
             NodeWithScore(node=TextNode(text="scored node"), score=1.0), "text", [1, 2, 3]]
    assert answer_texts(given) == ["chat said", "completed", "the query's answer", "a message", "a node",
                                   "scored node", "text", [1, 2, 3]]
    assert answer_texts(CompletionResponse(text="one")) == ["one"]
