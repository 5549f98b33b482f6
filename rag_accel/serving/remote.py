"""``RemoteDecoder``: :class:`~rag_accel.hf.decoder.ReferenceDecoder`'s surface on a server.

The server is ``rag-accel serve`` (vLLM's OpenAI-compatible server with our proposer); any
vLLM server answers it too, it then simply does not draft from the references. Each call is
one HTTP request through the ``openai`` client (``pip install 'rag-accel[remote]'``): its
references travel in the body's ``vllm_xargs`` (text as ``references``, token ids as
``reference_ids``, a JSON string: vLLM's schema allows no nested lists), and it asks for the
output's token ids (vLLM's ``return_token_ids``), so ``token_ids`` are the server's, not a
re-tokenisation of the text.

Prompts: chat messages go to ``/v1/chat/completions`` (the server applies the model's chat
template, as :func:`~rag_accel.inputs.encode_prompt` does in process); a string or token ids go
to ``/v1/completions``. Stop strings are the server's (vLLM's rule: the text ends before the
first stop string, the token ids with the token that completed it).

What the server cannot tell is ``None`` in the stats, never invented: an OpenAI response has
no per-request steps or draft counts, so ``steps``, ``drafted``, ``accepted``,
``tokens_per_step``, ``acceptance_rate``, ``prefill_s`` and ``draft_s`` are ``None`` and
``by_drafter`` / ``trace`` are empty. A call that sends a ``prediction`` (OpenAI's Predicted Outputs)
gets the server's counts of it, ``usage.completion_tokens_details``, as ``accepted_prediction_tokens`` /
``rejected_prediction_tokens`` (``None`` otherwise). The server's totals over all requests are on its
``/metrics`` page (``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``). ``time_s`` is the call's wall time here.

Calls from many threads run concurrently (one connection pool, no lock): the server batches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..inputs import check_chat, check_lengths, check_text, is_chat, token_ids
from ..references import check_reference
from ..memory import check_scope
from ..outputs import GenerationOutput, GenerationStats, GenerationStream
from ..prediction import prediction_parts
from ..protocol import CallOptions, Request, batch_arguments, call_config
from ..wire import WORKER_BASE, RequestArgs

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AsyncGenerationStream", "RemoteDecoder", "RemoteError"]

_INSTALL_HINT = "RemoteDecoder needs the openai client: pip install 'rag-accel[remote]' (or pip install openai)"
_ANY_VOCAB = 1 << 62  # the client does not know the vocabulary: the server checks ids (off-vocab: no drafting)


class RemoteError(ValueError):
    """The server refused the request (HTTP 400: bad ``vllm_xargs``, a prompt too long, ...)."""


def _v1(base_url: str) -> str:
    """``http://host:port`` and ``http://host:port/v1`` both mean the server's ``/v1`` API."""
    if not isinstance(base_url, str) or urlsplit(base_url).scheme not in ("http", "https"):
        raise ValueError(f"base_url must be an http(s) URL such as 'http://127.0.0.1:8000/v1', got {base_url!r}")
    url = base_url.rstrip("/")
    return url if urlsplit(url).path else url + "/v1"


def _finish(reason: str | None, stop_reason: Any) -> str:
    """vLLM's finish_reason / stop_reason in our words: "eos" | "stop" | "length" (others as given)."""
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"  # a stop string, else EOS / a stop token
    return reason or ""


class _Call:
    """One request ready to send: which endpoint and its arguments; the answer accumulated."""

    __slots__ = ("chat", "kwargs", "ids", "parts", "finish", "prompt_tokens", "completion_tokens", "t0", "predicted",
                 "server")

    def __init__(self, chat: bool, kwargs: dict[str, Any], server: str = "") -> None:
        self.chat, self.kwargs, self.server = chat, kwargs, server
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.finish = ""
        self.prompt_tokens = 0
        self.completion_tokens: int | None = None  # (the server's usage: what a server without token ids tells)
        self.t0 = time.perf_counter()
        self.predicted: tuple[int | None, int | None] = (None, None)  # the server's prediction counts

    def take(self, response: Any) -> str:
        """Fold one response (or stream chunk) in; returns its text."""
        prompt_ids = getattr(response, "prompt_token_ids", None)
        if prompt_ids:
            self.prompt_tokens = len(prompt_ids)
        usage = getattr(response, "usage", None)
        if usage is not None and usage.prompt_tokens is not None:
            self.prompt_tokens = usage.prompt_tokens
        if usage is not None and getattr(usage, "completion_tokens", None) is not None:
            self.completion_tokens = usage.completion_tokens
        details = getattr(usage, "completion_tokens_details", None) if usage is not None else None
        if details is not None and getattr(details, "accepted_prediction_tokens", None) is not None:
            self.predicted = (details.accepted_prediction_tokens, details.rejected_prediction_tokens)
        text = ""
        for choice in response.choices or ():
            if self.chat:
                msg = getattr(choice, "delta", None) or getattr(choice, "message", None)
                piece = (msg.content if msg is not None else None) or ""
            else:
                piece = choice.text or ""
            self.ids.extend(getattr(choice, "token_ids", None) or ())
            if choice.finish_reason:
                self.finish = _finish(choice.finish_reason, getattr(choice, "stop_reason", None))
            text += piece
        self.parts.append(text)
        return text

    def output(self) -> GenerationOutput:
        text = "".join(self.parts)
        new_tokens = len(self.ids)
        if not self.ids and text:  # a server that sends no token ids: not rag-accel serve (vLLM's)
            _not_ours(self.server)
            new_tokens = self.completion_tokens or 0
        stats = GenerationStats(prompt_tokens=self.prompt_tokens, new_tokens=new_tokens, steps=None,
                                drafted=None, accepted=None, finish_reason=self.finish,
                                time_s=time.perf_counter() - self.t0, prefill_s=None, draft_s=None,
                                setup_s=None, setup_wait_s=None, accepted_prediction_tokens=self.predicted[0],
                                rejected_prediction_tokens=self.predicted[1])
        return GenerationOutput(text=text, token_ids=list(self.ids), stats=stats)


_WARNED: set[str] = set()


def _not_ours(server: str) -> None:
    """Warn once per server that sends answers without their token ids: it is not ``rag-accel serve``."""
    if server in _WARNED:
        return
    _WARNED.add(server)
    warnings.warn(f"the server at {server or '?'} answered without token ids: it is not rag-accel serve (vLLM with "
                  "rag_accel's proposer), so it drafts nothing from references, answers or predictions; outputs "
                  "carry no token_ids, and their token counts are its usage's", RuntimeWarning, stacklevel=3)


class AsyncGenerationStream:
    """:class:`~rag_accel.outputs.GenerationStream` for ``async for``: text pieces, then ``.output``."""

    def __init__(self, gen: AsyncIterator[str], call: _Call) -> None:
        self._gen, self._call = gen, call
        self.output: GenerationOutput | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        async for piece in self._gen:
            yield piece
        self.output = self._call.output()

    async def aclose(self) -> None:
        await self._gen.aclose()


class RemoteDecoder:
    """Generate on a ``rag-accel serve`` server: the same calls and outputs as in process.

    Example:
        >>> dec = RemoteDecoder("http://127.0.0.1:8000/v1")  # doctest: +SKIP
        >>> out = dec.generate([{"role": "user", "content": q}], references=passages)  # doctest: +SKIP
        >>> out.text, out.token_ids, out.stats.prompt_tokens  # doctest: +SKIP
        >>> out.stats.accepted is None  # the server does not tell  # doctest: +SKIP

    Args:
        base_url: the server, ``http://host:port`` or ``http://host:port/v1``.
        model: the served model name (default: the server's first, asked once).
        api_key: the server's ``--api-key`` if it has one.
        timeout: seconds for one request (connect, and each read while streaming).
        max_retries: the ``openai`` client's retries on connection errors and 5xx answers.
        memory_scope: this client's requests draft from the answers the server gave earlier in
            this scope, and theirs join it (``vllm_xargs`` ``memory_scope``, 1 to 256 characters;
            ``None``: the server's default scope, ``rag-accel serve --memory-scope``, else no memory).
            A gateway derives it from the authenticated tenant: a scope protects time, not text.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str = "EMPTY", timeout: float = 600.0,
                 *, max_retries: int = 2, memory_scope: str | None = None) -> None:
        try:
            import openai
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be a string, got {type(model).__name__}")
        self.base_url = _v1(base_url)
        self.memory_scope = check_scope(memory_scope) if memory_scope is not None else None
        self._openai = openai
        self._client_kwargs = dict(base_url=self.base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self.client = openai.OpenAI(**self._client_kwargs)
        self._aclients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # one per event loop
        self._model = model
        self._info: Any = None

    # ------------------------------------------------------------ the server
    def _model_info(self) -> Any:
        if self._info is None:
            models = self.client.models.list().data
            if self._model is not None:
                found = [m for m in models if m.id == self._model]
                if not found:
                    raise ValueError(f"the server at {self.base_url} serves {[m.id for m in models]}, "
                                     f"not {self._model!r}")
                self._info = found[0]
            elif not models:
                raise ValueError(f"the server at {self.base_url} serves no model")
            else:
                self._info = models[0]
        return self._info

    @property
    def model(self) -> str:
        """The served model name (asked from the server once if not given)."""
        return self._model if self._model is not None else self._model_info().id

    @property
    def context_window(self) -> int | None:
        """The server's ``max_model_len`` (vLLM lists it with the model), or ``None`` if not told."""
        value = getattr(self._model_info(), "max_model_len", None)
        return int(value) if value is not None else None

    def encode_prompt(self, prompt: Any) -> list[int]:
        """The prompt's token ids as the server encodes it for a request: token ids as they are
        (checked), text and chat messages through the server's ``/tokenize`` (text with the special
        tokens ``/v1/completions`` adds, chat messages with the chat template and its generation prompt)."""
        call = self._call(Request(prompt, max_new_tokens=1))
        args = call.kwargs
        if call.chat:
            body: dict[str, Any] = {"messages": args["messages"], "add_generation_prompt": True}
        elif isinstance(args["prompt"], str):
            body = {"prompt": args["prompt"], "add_special_tokens": True}
        else:
            return list(args["prompt"])
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        import httpx  # (the openai client's own HTTP library)

        try:
            r = httpx.post(f"{root}/tokenize", json={"model": self.model, **body},
                           headers={"Authorization": f"Bearer {self.client.api_key}"},
                           timeout=self._client_kwargs["timeout"])
        except Exception as e:  # noqa: BLE001 - a transport error, named
            raise RemoteError(f"{root}/tokenize failed: {e!r}") from e
        if r.status_code != 200:
            raise RemoteError(f"{root}/tokenize answered HTTP {r.status_code}: {r.text[:500]}")
        return [int(t) for t in r.json()["tokens"]]

    def _aclient(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:  # an httpx pool belongs to the event loop that opened its connections
            client = self._aclients[loop] = self._openai.AsyncOpenAI(**self._client_kwargs)
        return client

    # ------------------------------------------------------------ inputs
    def _call(self, req: Request) -> _Call:
        """Build one checked request's HTTP arguments (nothing is sent)."""
        prompt, max_new_tokens, stops = req.prompt, req.max_new_tokens, req.stops
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        refs, answers = self._references(req.references), self._references(req.answers, "answer")
        # the server's rows start from WORKER_BASE: a dict of changes applies to it
        args = RequestArgs(refs, answers, req.speculate, call_config(req.config, WORKER_BASE), self.memory_scope)
        xargs = args.extra_args(http=True)
        body: dict[str, Any] = {"vllm_xargs": xargs, "return_token_ids": True}
        if req.prediction is not None:  # OpenAI's field, as any client sends it (rag_accel.vllm.predictions)
            prediction_parts(req.prediction)  # (checked here, before anything is sent)
            body["prediction"] = req.prediction
        kwargs: dict[str, Any] = dict(max_tokens=max_new_tokens)
        if stops:
            kwargs["stop"] = stops
        given = req.sampling
        if given is None:
            kwargs["temperature"] = 0.0
        else:  # what is not given, the server fills from the model's generation config (as in process)
            kwargs.update({k: v for k, v in given.items() if k != "top_k"})
            if "top_k" in given:
                body["top_k"] = given["top_k"]
        kwargs["extra_body"] = body
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            if not prompt:
                raise ValueError("empty prompt: nothing to condition on (give at least one token)")
            return _Call(False, dict(kwargs, prompt=prompt), self.base_url)
        if isinstance(prompt, (bytes, bytearray)):
            raise TypeError("prompt is bytes; decode it to a string first (e.g. .decode('utf-8'))")
        if is_chat(prompt):
            return _Call(True, dict(kwargs, messages=check_chat(prompt)), self.base_url)
        try:
            prompt_ids = token_ids(prompt, "prompt", "a string, chat messages ({'role', 'content'}) or token ids")
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - not a sequence at all
            raise TypeError("prompt must be a string, a list of chat messages ({'role', 'content'}) or a list of "
                            f"token ids, got {type(prompt).__name__}") from None
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition on (give at least one token)")
        if any(t < 0 for t in prompt_ids):
            raise ValueError("prompt has a negative token id")
        check_lengths(len(prompt_ids), max_new_tokens, None)
        return _Call(False, dict(kwargs, prompt=prompt_ids), self.base_url)

    @staticmethod
    def _references(references: Any, what: str = "reference") -> tuple[str | list[int], ...]:
        """References (``what="answer"``: a request's answers) checked as in process (the vocabulary: by the
        server), empty ones left out."""
        if references is None:
            return ()
        if isinstance(references, str):
            references = [references]
        if not isinstance(references, Sequence):
            raise TypeError(f"{what}s must be a list of strings or token-id lists, got {type(references).__name__}")
        checked = (check_reference(ref, i, _ANY_VOCAB, what) for i, ref in enumerate(references))
        return tuple(r if isinstance(r, str) else [int(t) for t in r] for r in checked if len(r))

    # ------------------------------------------------------------ sending
    def _create(self, client: Any, call: _Call, stream: bool) -> Any:
        api = client.chat.completions if call.chat else client.completions
        extra = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
        return api.create(model=self.model, **call.kwargs, **extra)

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        """A refusal (HTTP 400, or a streamed error event with code 400) raised as :class:`RemoteError` with the
        server's message; any other error as it is."""
        try:
            yield
        except self._openai.APIError as e:
            body = getattr(e, "body", None)
            code = getattr(e, "code", None) or (body.get("code") if isinstance(body, Mapping) else None)
            if not isinstance(e, self._openai.BadRequestError) and str(code) != "400":
                raise
            msg = body.get("message") if isinstance(body, Mapping) else None
            raise RemoteError(f"the server refused the request: {msg or e}") from e

    # ------------------------------------------------------------ public
    def generate(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> GenerationOutput:
        """The output for ``prompt``, the server drafting from ``references``. Arguments as :meth:`stream`."""
        call = self._call(Request.of(prompt, references, options))
        with self._refusals():
            call.take(self._create(self.client, call, stream=False))
        return call.output()

    def stream(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> GenerationStream:
        """Stream the output as text pieces (``.output`` once the iteration ends), as
        :meth:`ReferenceDecoder.stream` does.

        Args:
            prompt: string, chat messages, or token ids.
            references: documents to copy drafts from: strings or token-id lists.
            answers: earlier answers to copy from (a cached answer; ``vllm_xargs`` ``answers`` /
                ``answer_ids``), drafted as the server's memory of answers drafts.
            prediction: OpenAI's Predicted Outputs (``{"type": "content", "content": ...}``), sent as
                the request body's ``prediction``; the server's counts of it land in
                ``stats.accepted_prediction_tokens`` / ``rejected_prediction_tokens``.
            max_new_tokens / stop: as there.
            config: DecoderConfig changes for this request (a dict, or a :class:`DecoderConfig`:
                its drafting fields that differ from the defaults).
            speculate: ``False``: the server drafts nothing for this request.
            do_sample, temperature, top_k, top_p, seed: sampling (lossless under speculation).

        Inputs are checked and the request is sent here, before any iteration. A request the
        server refuses raises :class:`RemoteError` at the first iteration: vLLM answers a
        streamed request ``200`` and then an error event (code 400), a non-streamed one HTTP 400.
        Closing the stream early (``.close()``, or dropping it) closes the connection; the
        server aborts that request and serves on.
        """
        call = self._call(Request.of(prompt, references, options))
        with self._refusals():
            response = self._create(self.client, call, stream=True)

        def pieces() -> Iterator[str]:
            with self._refusals(), contextlib.closing(response):
                for chunk in response:
                    piece = call.take(chunk)
                    if piece:
                        yield piece
            return call.output()

        return GenerationStream(pieces())

    def generate_batch(self, prompts: Sequence[Any], references: Sequence[Any] | None = None,
                       **options: Unpack[CallOptions]) -> list[GenerationOutput]:
        """Several requests at once, in flight together (``references[i]`` for ``prompts[i]``).
        Keywords as :meth:`stream`, the same for all but ``answers`` (``answers[i]`` for ``prompts[i]``).
        Every request is checked before any is sent."""
        prompts, refs, opts = batch_arguments(prompts, references, options)
        for p, r, o in zip(prompts, refs, opts):
            self._call(Request.of(p, r, o))
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            return list(pool.map(lambda pro: self.generate(pro[0], pro[1], **pro[2]), zip(prompts, refs, opts)))

    def generate_greedy(self, prompt: Any, *, max_new_tokens: int = 256,
                        stop: str | Sequence[str] | None = None) -> GenerationOutput:
        """The baseline on the same server: this request without drafting."""
        return self.generate(prompt, None, max_new_tokens=max_new_tokens, stop=stop, speculate=False)

    async def agenerate(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> GenerationOutput:
        """:meth:`generate` without blocking the event loop (the async ``openai`` client)."""
        call = self._call(Request.of(prompt, references, options))
        with self._refusals():
            call.take(await self._acreate(call, stream=False))
        return call.output()

    async def astream(self, prompt: Any, references: Any = None,
                      **options: Unpack[CallOptions]) -> AsyncGenerationStream:
        """:meth:`stream` for ``async for``: ``stream = await dec.astream(...)``; ``async for piece in
        stream``; then ``stream.output``. The request is sent by the ``await``; a refusal raises
        :class:`RemoteError` at the first iteration, as in :meth:`stream`."""
        call = self._call(Request.of(prompt, references, options))
        with self._refusals():
            response = await self._acreate(call, stream=True)

        async def pieces() -> AsyncIterator[str]:
            try:
                with self._refusals():
                    async for chunk in response:
                        piece = call.take(chunk)
                        if piece:
                            yield piece
            finally:
                await response.close()

        return AsyncGenerationStream(pieces(), call)

    async def _acreate(self, call: _Call, stream: bool) -> Any:
        client = self._aclient()
        if self._model is None and self._info is None:
            await asyncio.to_thread(self._model_info)  # once: the served model's name
        return await self._create(client, call, stream)

    def close(self) -> None:
        """Close the connection pools (the server is not affected)."""
        self.client.close()

    def __repr__(self) -> str:
        return f"RemoteDecoder({self.base_url!r}, model={self._model!r})"

