"""RAG around the decoder: where references come from. Retrieval (:mod:`~rag_accel.rag.retrieval`: FAISS over E5 or
MiniLM embeddings, :mod:`~rag_accel.rag.e5_convert` for the offline E5), the response cache of earlier answers
(:mod:`~rag_accel.rag.cache`), conversations whose turns are references (:mod:`~rag_accel.rag.conversation`), the
bundled MS-MARCO sample and its prompt (:mod:`~rag_accel.rag.msmarco`), and the checksummed files they are stored in
(:mod:`~rag_accel.rag.storage`)."""
