"""A LangChain retriever over rag_accel's own FAISS + E5 index."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field


class VectorIndexRetriever(BaseRetriever):
    """A LangChain retriever over a :class:`rag_accel.rag.retrieval.VectorIndex` (FAISS + E5).

    Documents carry ``metadata={"id": passage id, "score": inner product}``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    index: Any  # rag_accel.rag.retrieval.VectorIndex
    k: int = Field(default=4, ge=1)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=h.text, metadata={"id": h.doc_id, "score": h.score})
                for h in self.index.search(query, self.k)]
