"""LlamaIndex LLM for rag_accel: lossless decoding that drafts from the query's retrieved nodes.

``pip install llama-index-llms-rag-accel``; ``from llama_index.llms.rag_accel import RagAccelLLM``.
"""

from llama_index.llms.rag_accel.base import RagAccelLLM
from llama_index.llms.rag_accel.capture import retrieval_capture
from llama_index.llms.rag_accel.query_engine import RagAccelQueryEngine
from llama_index.llms.rag_accel.retrieval import e5_embedding, faiss_vector_index

__all__ = ["RagAccelLLM", "RagAccelQueryEngine", "e5_embedding", "faiss_vector_index", "retrieval_capture"]
