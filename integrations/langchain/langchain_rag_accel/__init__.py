"""LangChain integration for rag_accel: a chat model whose greedy output is the model's own,
decoded faster by copying drafts from the retrieved documents.

``pip install langchain-rag-accel``; ``from langchain_rag_accel import ChatRagAccel, rag_chain``.
"""

from langchain_rag_accel.chains import default_rag_prompt, format_documents, rag_chain
from langchain_rag_accel.chat_models import ChatRagAccel, to_chat_messages
from langchain_rag_accel.retrievers import VectorIndexRetriever

__all__ = ["ChatRagAccel", "VectorIndexRetriever", "default_rag_prompt", "format_documents", "rag_chain",
           "to_chat_messages"]
