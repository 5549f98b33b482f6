"""Framework adapters (LangChain, LlamaIndex) over :class:`rag_accel.ReferenceDecoder`.

Each adapter lives in its own module and imports its framework lazily, so
``import integrations`` costs nothing when the framework is not installed.
"""
