"""LlamaIndex LLM over :class:`rag_accel.ReferenceDecoder`, fed with the nodes the
query engine retrieved.

Install: ``pip install llama-index-llms-rag-accel`` (see this package's README).

Example::

    from llama_index.llms.rag_accel import RagAccelLLM, RagAccelQueryEngine, e5_embedding
    llm = RagAccelLLM(max_new_tokens=128)
    index = VectorStoreIndex(nodes, storage_context=faiss_storage, embed_model=e5_embedding())
    index.as_query_engine(llm=llm).query("what is a corporation?")  # unchanged code: the
        # nodes retrieved for this query become the decoder's references
    RagAccelQueryEngine(retriever=index.as_retriever(), llm=llm).query(q)  # the explicit route

References reach the decoder in two ways:

1. explicit: ``llm.chat(messages, references=nodes)`` / ``complete(..., references=...)``,
   or :class:`~llama_index.llms.rag_accel.query_engine.RagAccelQueryEngine`, which passes its
   retrieved nodes;
2. captured: a call given none takes the nodes its enclosing query retrieved
   (:mod:`llama_index.llms.rag_accel.capture`). Wrong or stale references can only cost speed:
   every output is the model's greedy output.

The package's other modules: ``capture`` (retrieval capture), ``query_engine`` (the explicit
route), ``retrieval`` (E5 embedding, FAISS index).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
except ImportError as e:  # pragma: no cover - exercised only without llama-index-core
    raise ImportError("llama_index.llms.rag_accel needs llama-index-core: pip install llama-index-core") from e

from rag_accel.adapters import (
    adapter_base,
    answer_texts,
    iterate_in_thread,
    max_new_tokens_option,
    merged_decoder_config,
    reference_texts,
    sampling_options,
    start_generation,
    stats_metadata,
)
from rag_accel.inputs import check_stops

from llama_index.llms.rag_accel.capture import captured_nodes, retrieval_capture

CALL_OPTIONS = ("references", "answers", "max_new_tokens", "max_tokens", "stop", "decoder_config", "temperature",
                "top_p", "top_k", "seed")
# additional_kwargs["rag_accel"] lists the ids of at most this many reference nodes (the first ones,
# i.e. the best-ranked of a retrieval) beside the count of all: a query can pass hundreds.
MAX_REFERENCE_IDS = 8


class RagAccelLLM(adapter_base(), CustomLLM):
    """A chat model decoded greedily and accelerated by copying from the query's retrieved nodes,
    the prompt and n-grams: in this process (transformers or vLLM) or on a server.

    Args:
        model_name: HF name, local folder, or ``"smollm2-135m-instruct"`` (the offline default); with
            ``base_url``, the model as the server names it.
        backend: where the model runs: ``"hf"`` (default: transformers in this process), ``"vllm"``
            (a vLLM engine in this process: ``pip install 'rag-accel[vllm]'``), ``"remote"`` (implied
            by ``base_url``).
        base_url: a ``rag-accel serve`` server (``http://host:port/v1``): each call is one HTTP request
            with its references in ``vllm_xargs`` (:class:`rag_accel.serving.remote.RemoteDecoder`;
            ``pip install 'rag-accel[remote]'``), with ``api_key``, ``timeout``, ``max_retries``.
            What the server cannot tell (steps, drafted / accepted) is ``None`` in the stats, and
            ``metadata.context_window`` is the server's ``max_model_len``.
        memory_scope: on a server or a vLLM engine, this LLM's calls draft from the answers given
            earlier in this scope, and theirs join it (1 to 256 characters; ``None``: the server's
            default scope, if it has one, else no memory). The transformers backend has no memory.
        decoder: a ready decoder instead of loading ``model_name``: a :class:`rag_accel.ReferenceDecoder`,
            or any object with its ``generate``/``stream`` methods (:class:`rag_accel.vllm.VllmDecoder`,
            :class:`rag_accel.serving.remote.RemoteDecoder`); not together with ``backend`` / ``base_url``.
        max_new_tokens: most new tokens per call (``metadata.num_output``); alias ``max_tokens``
            (giving both with different values is an error).
        stop: stop strings (a per-call ``stop`` replaces them; ``[]``: none). An empty stop
            string is an error, alone (``stop=""``) or in a list: it would match before any text.
        decoder_config: changes to :class:`rag_accel.DecoderConfig`.
        capture_retrievals: take the nodes of the enclosing query's retrieval as references
            when a call passes none (:mod:`llama_index.llms.rag_accel.capture`).
        accelerate: ``False`` runs the model's own ``generate(do_sample=False)``: the same
            answers, for a side-by-side comparison.
        temperature: ``0``/``None`` (default): greedy. ``> 0``: lossless sampling (the model's own
            sampling distribution), with ``top_p``, ``top_k`` and ``seed``.

    Per-call options: ``references`` (nodes, strings or token-id lists; ``[]`` for none),
    ``answers`` (earlier answers to copy from, e.g. a cached answer to a similar question:
    ``ChatResponse``, ``CompletionResponse`` or query ``Response`` objects, strings or token-id lists;
    drafted as the server's memory of answers drafts, not as a passage),
    ``max_new_tokens`` (or ``max_tokens``), ``stop``, ``decoder_config``, ``temperature``, ``top_p``,
    ``top_k``, ``seed``.
    Anything else is an error.
    ``raw["usage"]`` has the token counts (also on the last streamed response),
    ``additional_kwargs["rag_accel"]`` the acceleration stats, ``reference_count`` (the references
    the call passed) and ``reference_ids`` (the ids of the first ``MAX_REFERENCE_IDS`` distinct nodes).
    """

    # The fields, validators and engine both adapters share are rag_accel.adapters.adapter_base()'s.
    capture_retrievals: bool = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.capture_retrievals:
            retrieval_capture()

    @classmethod
    def class_name(cls) -> str:
        return "RagAccelLLM"

    @property
    def metadata(self) -> LLMMetadata:
        window = getattr(self.engine, "context_window", None) or 2048  # a decoder may not know it
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens, is_chat_model=True,
                           model_name=self.model_name)

    # ------------------------------------------------------------ one call
    def _prepare(self, prompt: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """Validate, resolve references (now, in the caller's span) and start the decoder.
        Returns (pieces, output(), what the metadata says of the references)."""
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for RagAccelLLM; per-call options are {list(CALL_OPTIONS)}")
        refs = kwargs.get("references")
        if refs is None and self.capture_retrievals:
            refs = captured_nodes()
        refs = reference_list(refs)
        about_refs = reference_summary(refs)
        config = merged_decoder_config(self.decoder_config, kwargs.get("decoder_config"))
        stop = check_stops(kwargs.get("stop", self.stop))  # here: before the model is loaded
        sampling = {k: kwargs.get(k, getattr(self, k)) for k in ("temperature", "top_p", "top_k", "seed")}
        opts = {"max_new_tokens": max_new_tokens_option(kwargs, self.max_new_tokens), "stop": stop,
                **sampling_options(**sampling, accelerate=self.accelerate)}
        answers = answer_texts(kwargs.get("answers"))
        if answers is not None:
            opts["answers"] = answers
        pieces, output, _ = start_generation(self.engine, prompt, reference_texts(refs), config=config,
                                             accelerate=self.accelerate, **opts)  # inputs checked here
        return pieces, output, about_refs

    @staticmethod
    def _extras(out: Any, about_refs: dict[str, Any]) -> dict[str, Any]:
        s = out.stats
        usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                 "total_tokens": s.prompt_tokens + s.new_tokens}
        stats = {**stats_metadata(s), "finish_reason": s.finish_reason, **about_refs}
        return {"raw": {"usage": usage, "finish_reason": s.finish_reason}, "additional_kwargs": {"rag_accel": stats}}

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        return prompt if formatted or self.completion_to_prompt is None else self.completion_to_prompt(prompt)

    @staticmethod
    def _completion_gen(pieces: Any, output: Any, about_refs: dict[str, Any]) -> CompletionResponseGen:
        text = ""
        try:
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
        finally:
            if hasattr(pieces, "close"):
                pieces.close()
        yield CompletionResponse(text=text, delta="", **RagAccelLLM._extras(output(), about_refs))

    @staticmethod
    def _chat_gen(pieces: Any, output: Any, about_refs: dict[str, Any]) -> ChatResponseGen:
        for r in RagAccelLLM._completion_gen(pieces, output, about_refs):
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text), delta=r.delta,
                               raw=r.raw, additional_kwargs=r.additional_kwargs)

    @staticmethod
    def _last(gen: Iterator[Any]) -> Any:
        last = None
        for last in gen:
            pass
        return last

    # ------------------------------------------------------------ completion API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._last(self._completion_gen(*self._prepare(self._completion_prompt(prompt, formatted), kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completion_gen(*self._prepare(self._completion_prompt(prompt, formatted), kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prepared = self._prepare(self._completion_prompt(prompt, formatted), kwargs)
        return await asyncio.to_thread(lambda: self._last(self._completion_gen(*prepared)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        prepared = self._prepare(self._completion_prompt(prompt, formatted), kwargs)
        return iterate_in_thread(lambda: self._completion_gen(*prepared))

    # ------------------------------------------------------------ chat API (the tokenizer's chat template)
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._last(self._chat_gen(*self._prepare(to_chat_messages(messages), kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chat_gen(*self._prepare(to_chat_messages(messages), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prepared = self._prepare(to_chat_messages(messages), kwargs)
        return await asyncio.to_thread(lambda: self._last(self._chat_gen(*prepared)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prepared = self._prepare(to_chat_messages(messages), kwargs)
        return iterate_in_thread(lambda: self._chat_gen(*prepared))


def reference_list(references: Any) -> list[Any]:
    """References as a list: ``None`` -> ``[]``, one string or node -> a list of one."""
    if references is None:
        return []
    if isinstance(references, (str, bytes)) or not isinstance(references, Sequence):
        return [references]
    return list(references)


def reference_summary(references: Sequence[Any], max_ids: int = MAX_REFERENCE_IDS) -> dict[str, Any]:
    """What the response metadata says of a call's references: how many there were, and the
    ids of the first ``max_ids`` distinct nodes among them (strings and token ids have none).
    A query engine passes its retrieval in rank order, so these are the best-ranked nodes."""
    ids: list[str] = []
    for r in references:
        i = getattr(getattr(r, "node", r), "node_id", None)
        if isinstance(i, str) and i not in ids:
            ids.append(i)
            if len(ids) == max_ids:
                break
    return {"reference_count": len(references), "reference_ids": ids}


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "chatbot": "assistant", "model": "assistant"}


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages as chat-template messages; tool/function messages are refused."""
    out = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        if role not in _ROLES:
            raise NotImplementedError(f"{role!r} messages are not supported by RagAccelLLM (no tool calling)")
        kinds = {type(b).__name__ for b in m.blocks} - {"TextBlock"}
        if kinds:
            raise NotImplementedError(f"RagAccelLLM takes text only; got {sorted(kinds)}")
        out.append({"role": _ROLES[role], "content": m.content or ""})
    return out
