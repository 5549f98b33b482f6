"""The LlamaHub checks: the class is a LlamaIndex LLM (BaseLLM in its MRO) and the public names import;
plus what RagAccelLLM checks without loading a model."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.base import BaseLLM

import llama_index.llms.rag_accel
from llama_index.llms.rag_accel import RagAccelLLM


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
