"""Retrieval capture: the nodes a query retrieved, handed to the LLM call that query makes, so that
``index.as_query_engine(llm=RagAccelLLM())`` drafts from them with the query engine unchanged.

An instrumentation handler on LlamaIndex's root dispatcher records the nodes of every
``RetrievalEndEvent`` under the spans that enclose that retrieval; an LLM call takes the nodes of its
nearest enclosing span that retrieved anything (:func:`captured_nodes`), so a query gets its own nodes
even when queries run concurrently, and the records are dropped when the spans end. A streaming
query calls the LLM only when its ``response_gen`` is iterated, after its spans ended: its
``response_gen`` is wrapped to hand over its ``source_nodes``. Wrong or stale references can only
cost speed: every output is the model's greedy output.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any


class RetrievalCapture:
    """Nodes of each retrieval, recorded under every span enclosing it, dropped when the span ends.

    ``nodes_for(span_id)`` walks up from an LLM call's span to the nearest
    ancestor that recorded a retrieval: for a query engine that is the query's
    own span, never another query's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parent: dict[str, str | None] = {}
        self._nodes: dict[str, list[Any]] = {}

    def _ancestors(self, span_id: str | None) -> Iterator[str]:
        seen = 0
        while span_id is not None and seen < 10_000:
            yield span_id
            span_id = self._parent.get(span_id)
            seen += 1

    def enter(self, span_id: str, parent_id: str | None) -> None:
        with self._lock:
            self._parent[span_id] = parent_id

    def leave(self, span_id: str) -> None:
        with self._lock:
            self._parent.pop(span_id, None)
            self._nodes.pop(span_id, None)

    def record(self, span_id: str | None, nodes: Sequence[Any]) -> None:
        with self._lock:
            for s in self._ancestors(span_id):
                self._nodes.setdefault(s, []).extend(nodes)

    def nodes_for(self, span_id: str | None) -> list[Any]:
        with self._lock:
            for s in self._ancestors(span_id):
                if s in self._nodes:
                    return list(self._nodes[s])
        return []

    def open_records(self) -> int:
        """Spans still holding nodes (0 once every query has finished)."""
        with self._lock:
            return len(self._nodes)


# The nodes of a streaming query whose LLM call runs lazily, when the caller iterates
# ``response.response_gen`` after the query's spans have ended (see _NodesWhileIterating).
_STREAM_NODES: ContextVar[list[Any] | None] = ContextVar("rag_accel_stream_nodes", default=None)


class _NodesWhileIterating:
    """Wraps a ``StreamingResponse.response_gen`` so that the LLM call it makes lazily
    sees that response's ``source_nodes`` (set only around each ``next``)."""

    def __init__(self, gen: Iterator[Any], nodes: list[Any]) -> None:
        self.gen, self.nodes = gen, nodes

    def __iter__(self) -> _NodesWhileIterating:
        return self

    def __next__(self) -> Any:
        token = _STREAM_NODES.set(self.nodes)
        try:
            return next(self.gen)
        finally:
            _STREAM_NODES.reset(token)

    def close(self) -> None:
        if hasattr(self.gen, "close"):
            self.gen.close()


def _attach_stream_nodes(result: Any) -> None:
    gen = getattr(result, "response_gen", None)
    nodes = getattr(result, "source_nodes", None)
    if gen is not None and nodes and not isinstance(gen, _NodesWhileIterating):
        result.response_gen = _NodesWhileIterating(gen, list(nodes))


_CAPTURE: RetrievalCapture | None = None
_INSTALL_LOCK = threading.Lock()


def retrieval_capture() -> RetrievalCapture:
    """The process-wide capture, registered on LlamaIndex's root dispatcher on first use."""
    global _CAPTURE
    with _INSTALL_LOCK:
        if _CAPTURE is None:
            from llama_index.core.instrumentation import get_dispatcher
            from llama_index.core.instrumentation.event_handlers import BaseEventHandler
            from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
            from llama_index.core.instrumentation.span_handlers import BaseSpanHandler

            capture = RetrievalCapture()

            class _Spans(BaseSpanHandler[Any]):
                def new_span(self, id_: str, bound_args: Any, instance: Any = None,
                             parent_span_id: str | None = None, tags: Any = None, **kw: Any) -> None:
                    capture.enter(id_, parent_span_id)
                    return None  # nothing kept by the base class

                def prepare_to_exit_span(self, id_: str, bound_args: Any, instance: Any = None,
                                         result: Any = None, **kw: Any) -> None:
                    capture.leave(id_)
                    _attach_stream_nodes(result)  # a streaming query's LLM call is still to come
                    return None

                def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None,
                                         err: BaseException | None = None, **kw: Any) -> None:
                    capture.leave(id_)
                    return None

                @classmethod
                def class_name(cls) -> str:
                    return "RagAccelSpans"

            class _Retrievals(BaseEventHandler):
                def handle(self, event: Any, **kw: Any) -> None:
                    if isinstance(event, RetrievalEndEvent):
                        capture.record(event.span_id, event.nodes)

                @classmethod
                def class_name(cls) -> str:
                    return "RagAccelRetrievals"

            root = get_dispatcher()
            root.add_span_handler(_Spans())
            root.add_event_handler(_Retrievals())
            _CAPTURE = capture
        return _CAPTURE


def _active_span() -> str | None:
    from llama_index_instrumentation.span import active_span_id

    return active_span_id.get()


def captured_nodes() -> list[Any]:
    """The nodes an LLM call made now takes as its references when it was given none: those of the
    streaming response being iterated, else those of its nearest enclosing span that retrieved
    anything (``[]`` when none did)."""
    nodes = _STREAM_NODES.get()
    if nodes is None:
        nodes = retrieval_capture().nodes_for(_active_span())
    return nodes
