"""Serving: ``rag-accel serve`` (:mod:`~rag_accel.serving.serve`, vLLM's OpenAI server with our drafters), a server
process started and checked from Python (:mod:`~rag_accel.serving.server_process`), and the HTTP client that calls
one with the decoder's own calls (:mod:`~rag_accel.serving.remote`)."""
