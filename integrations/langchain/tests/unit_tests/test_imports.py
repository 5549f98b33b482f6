"""The public names, and what the chat model checks without loading a model."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document

import langchain_rag_accel
from langchain_rag_accel import ChatRagAccel

EXPECTED_ALL = ["ChatRagAccel", "VectorIndexRetriever", "default_rag_prompt", "format_documents", "rag_chain",
                "to_chat_messages"]


def test_all_imports():
    assert sorted(langchain_rag_accel.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(langchain_rag_accel, name)


class FakeDecoder:
    """Any object with the decoder surface (generate/stream) is accepted, e.g. rag_accel.vllm.VllmDecoder."""

    def generate(self, prompt, references=None, **kw):
        raise AssertionError("not called here")

    def stream(self, prompt, references=None, **kw):
        raise AssertionError("not called here")


def test_decoder_is_checked_by_its_methods():
    fake = FakeDecoder()
    assert ChatRagAccel(decoder=fake).engine is fake
    with pytest.raises(TypeError, match=r"generate\(\) and stream\(\).*str has no generate\(\), stream\(\)"):
        ChatRagAccel(decoder="smollm2-135m-instruct")

    class GenerateOnly:
        def generate(self, prompt):
            return None

    with pytest.raises(TypeError, match=r"GenerateOnly has no stream\(\)"):
        ChatRagAccel(decoder=GenerateOnly())
    with pytest.raises(TypeError, match=r"generate_greedy\(\), which FakeDecoder does not have"):
        ChatRagAccel(decoder=fake, accelerate=False).invoke("hi")


def test_references_and_answers_stay_out_of_traces_and_cache_key():
    llm = ChatRagAccel(decoder=FakeDecoder())
    docs = [Document(page_content="x" * 1000)]
    answers = ["y" * 1000, "z" * 1000]
    params = llm._get_invocation_params(stop=None, references=docs, answers=answers)
    assert "references" not in params and params["n_references"] == 1
    assert "answers" not in params and params["n_answers"] == 2
    key = llm._get_llm_string(stop=None, references=docs, answers=answers)
    assert "xxxx" not in key and "yyyy" not in key
    assert "n_answers" not in llm._get_invocation_params(stop=None)


def test_bind_tools_says_what_to_do():
    with pytest.raises(NotImplementedError, match=r"ChatRagAccel does not support tool calling.*"):
        ChatRagAccel(decoder=FakeDecoder()).bind_tools(
            [{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_answers_are_the_texts_of_messages_and_documents():
    from langchain_core.messages import AIMessage

    from rag_accel.adapters import answer_texts

    assert answer_texts([AIMessage("said before"), Document(page_content="a doc"), "text", [1, 2]]) == [
        "said before", "a doc", "text", [1, 2]]
    assert answer_texts(AIMessage("one")) == ["one"]
