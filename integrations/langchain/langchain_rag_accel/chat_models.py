"""LangChain chat model over :class:`rag_accel.ReferenceDecoder` (or another rag_accel decoder).

Install: ``pip install langchain-rag-accel`` (see this package's README).

Example::

    from langchain_rag_accel import ChatRagAccel, rag_chain
    llm = ChatRagAccel(max_tokens=128)             # the offline default model, loaded on first use
    chain = rag_chain(retriever, llm)              # any LangChain retriever
    chain.invoke("what is a corporation?")         # answer text; docs were the references
    llm.bind(references=docs).invoke(messages)     # or bind references yourself

The output is the model's greedy output, token for token; references only make
it faster. ``response_metadata["rag_accel"]`` holds the acceleration stats.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
    )
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        ChatMessage,
        HumanMessage,
        SystemMessage,
    )
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from pydantic import ConfigDict, Field
except ImportError as e:  # pragma: no cover - exercised only without langchain-core
    raise ImportError("langchain_rag_accel needs langchain-core: pip install langchain-core") from e

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
from rag_accel.models import DEFAULT_MODEL

CALL_OPTIONS = ("max_new_tokens", "max_tokens", "references", "answers", "decoder_config", "model", "temperature",
                "top_p", "top_k", "seed")
_COPY_SOURCES = ("references", "answers")  # bulky, and they never change the output
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class ChatRagAccel(adapter_base(), BaseChatModel):
    """A chat model decoded greedily and accelerated by copying from references (the retrieved
    documents), the prompt and n-grams: in this process (transformers or vLLM) or on a server.

    Args:
        model: HF name, local folder, or ``"smollm2-135m-instruct"`` (the offline default); with
            ``base_url``, the model as the server names it.
        backend: where the model runs: ``"hf"`` (default: transformers in this process), ``"vllm"``
            (a vLLM engine in this process: ``pip install 'rag-accel[vllm]'``), ``"remote"`` (implied
            by ``base_url``).
        base_url: a ``rag-accel serve`` server (``http://host:port/v1``): each call is one HTTP request
            with its references in ``vllm_xargs`` (:class:`rag_accel.serving.remote.RemoteDecoder`;
            ``pip install 'rag-accel[remote]'``); ``api_key``, ``timeout`` and ``max_retries`` apply to it.
            What the server cannot tell (steps, drafted / accepted) is ``None`` in the stats.
        decoder: a ready decoder to use instead of loading ``model``: a :class:`rag_accel.ReferenceDecoder`,
            or any object with its ``generate``/``stream`` methods (:class:`rag_accel.vllm.VllmDecoder`,
            :class:`rag_accel.serving.remote.RemoteDecoder`); not together with ``backend`` / ``base_url``.
        max_tokens: most new tokens per call (alias ``max_new_tokens``; giving both with
            different values is an error).
        stop: stop strings; a per-call ``stop`` replaces them (``[]``: none). An empty stop
            string is an error, alone (``stop=""``) or in a list: it would match before any text.
        decoder_config: changes to :class:`rag_accel.DecoderConfig` (e.g. ``{"max_draft_tokens": 16}``).
        accelerate: ``False`` runs the model's own ``generate(do_sample=False)``:
            the same answers, for a side-by-side comparison.
        temperature: ``0`` or ``None`` (default): greedy decoding, the model's exact greedy output.
            ``> 0``: lossless sampling (the model's own sampling distribution; drafts verified by
            speculative sampling), with ``top_p``, ``top_k`` and ``seed`` (reproducible runs).
        timeout / max_retries: for a server (``base_url``): seconds per request, retries on
            connection errors; a model in this process neither times out nor retries.
        memory_scope: on a server or a vLLM engine, this model's calls draft from the answers given
            earlier in this scope, and theirs join it (1 to 256 characters; ``None``: the server's
            default scope, if it has one, else no memory). The transformers backend has no memory.

    Per-call options (``invoke(..., **kw)`` or ``bind(**kw)``): ``references``
    (Documents, strings or token-id lists), ``answers`` (earlier answers to copy from, e.g. a
    cached answer to a similar question: ``AIMessage``s, strings or token-id lists; drafted as the
    server's memory of answers drafts, not as a passage), ``max_tokens``/``max_new_tokens`` (one of them,
    or both equal),
    ``decoder_config`` (DecoderConfig changes; ``config`` is LangChain's RunnableConfig),
    ``model`` (must name this model),
    ``temperature``, ``top_p``, ``top_k``, ``seed``. Anything else is an error.

    Loading is lazy (on the first call) and shared by instances with the same
    model, device, dtype and backend. Concurrent calls: serialised on a transformers model;
    sharing the batch on vLLM; separate requests (no lock) on a server, which batches them.

    No tool calling: :meth:`bind_tools` (and so ``with_structured_output``) raises
    ``NotImplementedError`` saying so.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True,
                              protected_namespaces=())

    MAX_TOKENS_KEY: ClassVar[str] = "max_tokens"  # LangChain's spelling; max_new_tokens is the field

    # The fields, validators and engine both adapters share are rag_accel.adapters.adapter_base()'s; these two
    # take LangChain's names as aliases (model=, max_tokens=), and streaming is LangChain's own.
    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    max_new_tokens: int = Field(default=256, alias="max_tokens", ge=1)
    streaming: bool = False

    # ----------------------------------------------------------- LangChain API
    @property
    def _llm_type(self) -> str:
        return "rag-accel"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "backend": self.backend or ("remote" if self.base_url else "hf"),
                "base_url": self.base_url, "max_new_tokens": self.max_new_tokens,
                "accelerate": self.accelerate, "decoder_config": self.decoder_config}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "rag_accel"
        params["ls_model_name"] = kwargs["model"] if isinstance(kwargs.get("model"), str) else self.model_name
        params["ls_max_tokens"] = int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_new_tokens)
        temperature = kwargs.get("temperature", self.temperature)
        params["ls_temperature"] = float(temperature or 0.0)
        if stop or self.stop:
            params["ls_stop"] = list(stop if stop is not None else self.stop)
        return params

    def _get_invocation_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        # References and answers are bulky and do not change the output (decoding is lossless): keep
        # them out of traces and of the LLM-cache key, record only how many there were.
        sources = {k: kwargs.pop(k) for k in _COPY_SOURCES if k in kwargs}
        params = super()._get_invocation_params(stop=stop, **kwargs)
        for key, given in sources.items():
            if given is not None:
                params[f"n_{key}"] = len(reference_texts(given))
        return params

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        for key in _COPY_SOURCES:
            kwargs.pop(key, None)
        return super()._get_llm_string(stop=stop, **kwargs)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ChatRagAccel does not support tool calling: it decodes a local model's plain text output "
            "(lossless greedy/sampled decoding, no tool-call parsing). Call it without tools (describe any tools "
            "in the prompt yourself), or use a chat model with tool calling for agents and structured output."
        )

    # ------------------------------------------------------------ decoding
    def _call_args(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for ChatRagAccel; per-call options are {list(CALL_OPTIONS)}")
        if kwargs.get("model") not in (None, self.model_name):
            raise ValueError(f"model={kwargs['model']!r}: this ChatRagAccel runs {self.model_name!r}; "
                             "make another instance for another model")
        max_new = max_new_tokens_option(kwargs, self.max_new_tokens)
        config = merged_decoder_config(self.decoder_config, kwargs.get("decoder_config"))
        stops = check_stops(stop if stop is not None else self.stop)  # here: before the model is loaded
        opts = {"max_new_tokens": max_new, "stop": stops, **self._sampling_options(kwargs)}
        answers = answer_texts(kwargs.get("answers"))
        if answers is not None:
            opts["answers"] = answers
        return to_chat_messages(messages), reference_texts(kwargs.get("references")), opts, config

    def _sampling_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        values = {k: kwargs.get(k, getattr(self, k)) for k in ("temperature", "top_p", "top_k", "seed")}
        return sampling_options(**values, accelerate=self.accelerate)

    def _run(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        """(text pieces, a function returning the GenerationOutput once they are consumed)."""
        chat, refs, opts, config = self._call_args(messages, stop, kwargs)
        return start_generation(self.engine, chat, refs, config=config, accelerate=self.accelerate,
                                **opts)  # inputs are checked here

    def _message_fields(self, out: Any) -> dict[str, Any]:
        s = out.stats
        return {
            "usage_metadata": {"input_tokens": s.prompt_tokens, "output_tokens": s.new_tokens,
                               "total_tokens": s.prompt_tokens + s.new_tokens},
            "response_metadata": {"model_name": self.model_name, "model_provider": "rag_accel",
                                  "finish_reason": _FINISH.get(s.finish_reason, s.finish_reason),
                                  "rag_accel": stats_metadata(s)},
        }

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        pieces, output, _ = self._run(messages, stop, kwargs)
        for _ in pieces:
            pass
        out = output()
        message = AIMessage(content=out.text, **self._message_fields(out))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        pieces, output, close = self._run(messages, stop, kwargs)
        try:
            for piece in pieces:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            close()  # a consumer that stops early frees the model here, in this thread
        yield ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last",
                                                         **self._message_fields(output())))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        # The model runs in a worker thread; the event loop stays free.
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as chat-template messages; tool messages and non-text content are refused."""
    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            role = "system"
        elif isinstance(m, HumanMessage):
            role = "user"
        elif isinstance(m, AIMessage):
            if m.tool_calls:
                raise NotImplementedError("ChatRagAccel has no tool calling: "
                                          "an AIMessage with tool_calls cannot be rendered")
            role = "assistant"
        elif isinstance(m, ChatMessage):
            role = m.role
        else:
            raise NotImplementedError(f"{type(m).__name__} is not supported by ChatRagAccel (no tool calling); "
                                      "use system, human, AI or chat messages")
        if isinstance(m.content, str):
            text = m.content
        else:
            kinds = {b.get("type") for b in m.content if isinstance(b, dict)} - {"text"}
            if kinds:
                raise NotImplementedError(f"ChatRagAccel takes text only; got content blocks of type {sorted(kinds)}")
            text = "".join(b if isinstance(b, str) else b.get("text", "") for b in m.content)
        out.append({"role": role, "content": text})
    return out
