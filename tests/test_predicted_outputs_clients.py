"""Stock clients send OpenAI's Predicted Outputs to `rag-accel serve` unchanged (issue 54).

A real server on loopback (the adapters' shared test server: SmolLM2-135M-Instruct, float32, our
proposer), called by LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike` as their users call them,
with no rag_accel import on the client side: each answer equals the same server's answer without a
prediction, and the prediction's counts come back where each framework puts the usage. (The openai
SDK itself, sync, async and streamed, against vLLM's greedy in process: tests/test_serve.py.)

Skipped without a Python with vLLM (RAG_ACCEL_VLLM_PYTHON), as the adapters' remote tests are.
"""

from __future__ import annotations

import pytest

from rag_accel.serving.server_process import shared_test_server

MODEL = "smollm2-135m-instruct"
MAX_NEW = 32
# The prediction is the answer itself (an earlier answer to the same question, as a client caching answers
# would send it), never in the prompt: only the prediction's reference can draft it, so its counts show.
QUESTION = "Where is the Eiffel Tower, and how tall is it? Answer in one sentence."


def prediction(text: str) -> dict:
    return {"type": "content", "content": text}


# the slow mark; and one test process runs every module that uses the shared server (pyproject's --dist loadgroup),
# so a run with two workers starts it once (rag_accel.serving.server_process.shared_test_server)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rag-accel-serve")]


@pytest.fixture(scope="module")
def server():
    return shared_test_server()


def test_langchain_chat_openai_sends_a_prediction(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="EMPTY", temperature=0,
                                      max_tokens=MAX_NEW, max_retries=0)
    plain = llm.invoke(QUESTION)
    predicted = llm.invoke(QUESTION, prediction=prediction(plain.content))
    assert predicted.content == plain.content and predicted.content
    details = predicted.response_metadata["token_usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0, details
    assert isinstance(details["rejected_prediction_tokens"], int)
    streamed = list(llm.bind(prediction=prediction(plain.content)).stream(QUESTION))
    assert "".join(c.content for c in streamed) == plain.content


def test_llamaindex_openai_like_sends_a_prediction(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    def llm(**extra):
        return openai_like.OpenAILike(model=MODEL, api_base=server.base_url, api_key="EMPTY", temperature=0,
                                      max_tokens=MAX_NEW, is_chat_model=True, context_window=2048, max_retries=0,
                                      additional_kwargs=extra)

    msgs = [ChatMessage(role="user", content=QUESTION)]
    plain = llm().chat(msgs)
    predicted = llm(prediction=prediction(plain.message.content)).chat(msgs)
    assert predicted.message.content == plain.message.content and plain.message.content
    usage = predicted.raw.usage
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0, usage


def _readme_block(first_line: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("\n```", 1)[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if first_line in b)


@pytest.mark.parametrize("first_line", ["from openai import OpenAI", "from langchain_openai import ChatOpenAI"])
def test_the_readmes_prediction_examples_print_what_they_promise(server, first_line, capsys):
    """Issue 66: run as written (the server's address put in), each README example prints the answer and a count
    of accepted prediction tokens above 0, though its documents are in the prompt too."""
    if "langchain" in first_line:
        pytest.importorskip("langchain_openai")
    code = _readme_block(first_line).replace("http://127.0.0.1:8000/v1", server.base_url)
    exec(compile(code, f"README.md ({first_line})", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.strip()
    answer, accepted = printed.rsplit(" ", 1)
    assert answer.strip() and int(accepted) > 0, printed
