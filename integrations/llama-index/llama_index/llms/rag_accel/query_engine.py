"""The explicit route: a query engine that passes the nodes it retrieved to the LLM as references."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.query_engine import CustomQueryEngine


class RagAccelQueryEngine(CustomQueryEngine):
    """Retrieve, fill the QA prompt, and call the LLM with the retrieved nodes as references.

    Returns a ``Response`` (``StreamingResponse`` with ``streaming=True``) with
    ``source_nodes`` and ``metadata["rag_accel"]`` (the stats; when streaming,
    once the stream has been consumed). Context is not compacted or refined:
    keep ``similarity_top_k`` within the model's context window.
    """

    retriever: Any
    llm: Any
    qa_prompt: Any = Field(default=CHAT_TEXT_QA_PROMPT)
    streaming: bool = False

    def _messages(self, query_str: str, nodes: list[Any]) -> list[ChatMessage]:
        context = "\n\n".join(n.node.get_content() for n in nodes)
        return self.qa_prompt.format_messages(context_str=context, query_str=query_str)

    def custom_query(self, query_str: str) -> Any:
        nodes = self.retriever.retrieve(query_str)
        messages = self._messages(query_str, nodes)
        if not self.streaming:
            r = self.llm.chat(messages, references=nodes)
            return Response(r.message.content, source_nodes=nodes, metadata=dict(r.additional_kwargs))
        chunks = self.llm.stream_chat(messages, references=nodes)
        meta: dict[str, Any] = {}  # filled by the last chunk

        def deltas() -> Iterator[str]:
            for r in chunks:
                meta.update(r.additional_kwargs)
                if r.delta:
                    yield r.delta

        return StreamingResponse(response_gen=deltas(), source_nodes=nodes, metadata=meta)

    async def acustom_query(self, query_str: str) -> Any:
        nodes = await self.retriever.aretrieve(query_str)
        r = await self.llm.achat(self._messages(query_str, nodes), references=nodes)
        return Response(r.message.content, source_nodes=nodes, metadata=dict(r.additional_kwargs))
