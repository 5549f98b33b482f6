"""A RAG chain: question -> retriever -> prompt -> chat model, with the retrieved documents
bound as that call's references (copy sources for the decoder)."""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from rag_accel.rag.msmarco import SYSTEM_PROMPT


def format_documents(docs: Sequence[Any]) -> str:
    """Numbered passages, as :func:`rag_accel.rag.msmarco.rag_prompt` writes them."""
    return "\n\n".join(f"Passage {i}: {d.page_content}" for i, d in enumerate(docs, 1))


def default_rag_prompt() -> Any:
    """System prompt, then the numbered passages and the question (the demo's prompt)."""
    from langchain_core.prompts import ChatPromptTemplate

    return ChatPromptTemplate.from_messages(
        [("system", SYSTEM_PROMPT), ("human", "{context}\n\nQuestion: {question}")]
    )


def rag_chain(retriever: Any, llm: Any, prompt: Any = None, *, parser: Any = "str",
              format_docs: Any = format_documents) -> Any:
    """question -> retriever -> prompt -> ``llm`` with the retrieved documents bound as references.

    Args:
        retriever: any LangChain retriever (a Runnable from a question to Documents).
        llm: a :class:`ChatRagAccel`, or one with options bound (``llm.bind(max_tokens=64)``).
        prompt: a prompt with ``{context}`` and ``{question}`` (default :func:`default_rag_prompt`).
        parser: ``"str"`` (answer text), ``None`` (the AIMessage, with the stats) or an output parser.
        format_docs: Documents -> the ``{context}`` text.

    The documents are bound per call (a dynamic bind inside the chain), so
    ``invoke``, ``stream``, ``batch``, ``ainvoke`` and ``astream`` each use their
    own question's documents.
    """
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    prompt = prompt if prompt is not None else default_rag_prompt()
    tail = StrOutputParser() if parser == "str" else parser

    def answer(x: dict[str, Any]) -> Any:
        step = prompt | llm.bind(references=x["docs"])
        return step | tail if tail is not None else step

    return (
        {"question": RunnablePassthrough()}
        | RunnablePassthrough.assign(docs=itemgetter("question") | retriever)
        | RunnablePassthrough.assign(context=lambda x: format_docs(x["docs"]))
        | RunnableLambda(answer)
    )
