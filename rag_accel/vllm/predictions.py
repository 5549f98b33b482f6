"""OpenAI's Predicted Outputs on vLLM's OpenAI server: ``prediction`` in, its counts in ``usage``.

vLLM's request models accept unknown fields and ignore them, ``prediction`` included. This ASGI
middleware (vLLM's public ``--middleware`` option; ``rag-accel serve`` adds it) makes it work:

1. **In.** A ``POST`` to ``/v1/chat/completions`` or ``/v1/completions`` whose JSON body has a
   ``prediction`` is rewritten before vLLM reads it: the prediction's text parts
   (:func:`rag_accel.prediction.prediction_parts`) become ``vllm_xargs["prediction"]``, references of
   that request beside any ``vllm_xargs`` ``references`` (the same admission limit, checked by
   :meth:`RowTracker.validate_params <rag_accel.vllm.RowTracker.validate_params>`), and the request gets a
   ``rag_accel_id`` to find its drafting statistics by. A malformed prediction becomes
   ``vllm_xargs["prediction_error"]``, which that same admission check refuses: HTTP 400 naming the
   field, after vLLM's own authentication, before any work, the engine serving on.
2. **Out.** The response's ``usage.completion_tokens_details`` gains ``accepted_prediction_tokens`` and
   ``rejected_prediction_tokens``, read from the proposer's own statistics of that request (the
   ``rag_accel_pop_stats`` call every worker has: :mod:`rag_accel.vllm.patches`): in the JSON of a
   non-streamed response, and in the final usage chunk of a stream with
   ``stream_options: {"include_usage": true}``. What they count: :mod:`rag_accel.prediction`.

A chat request with a role the library refuses (:func:`rag_accel.inputs.check_role`: ``"assistent"``, say) gets
HTTP 400 too, where vLLM's server would hand any role to the chat template.

On a server whose engine does not draft with :class:`~rag_accel.vllm.RagProposer` (``rag-accel serve
--speculation off|ngram|suffix``) nothing would draft from a prediction: such a request is refused with
HTTP 400 rather than served as if the prediction had been used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..inputs import check_role
from ..prediction import prediction_parts
from .requests import MIDDLEWARE_PATH, PROPOSER_PATH

__all__ = ["MIDDLEWARE_PATH", "PredictedOutputs", "chat_error", "prediction_xargs", "usage_with_counts"]

log = logging.getLogger("rag_accel.vllm")

_PATHS = ("/v1/chat/completions", "/v1/completions")
_MAX_BODY = 64 << 20  # bytes of a request body this middleware reads into memory; a larger one passes untouched

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def prediction_xargs(body: dict[str, Any]) -> str | None:
    """Move ``body["prediction"]`` into ``body["vllm_xargs"]`` (in place): its parts as ``prediction``, or
    the reason it is malformed as ``prediction_error``; and a fresh ``rag_accel_id``. Returns that id
    (``None``: the body had no prediction, and is unchanged).

    Example:
        >>> body = {"prompt": "x", "prediction": {"type": "content", "content": "It is 42."}}
        >>> key = prediction_xargs(body)
        >>> body["vllm_xargs"]["prediction"], body["vllm_xargs"]["rag_accel_id"] == key, "prediction" in body
        (['It is 42.'], True, False)
        >>> body = {"prompt": "x", "prediction": {"type": "content", "content": 7}}
        >>> _ = prediction_xargs(body); body["vllm_xargs"]["prediction_error"]
        'prediction.content must be a string or a list of text parts, got int'
    """
    if "prediction" not in body:
        return None
    prediction = body.pop("prediction")
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        xargs = body["vllm_xargs"] = {} if xargs is None else {"prediction_error": "vllm_xargs must be an object"}
    key = f"prediction-{uuid.uuid4().hex}"
    try:
        xargs["prediction"] = prediction_parts(prediction)
    except (TypeError, ValueError) as e:
        xargs["prediction_error"] = str(e)
    xargs["rag_accel_id"] = key
    return key


def usage_with_counts(usage: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, Any]:
    """``usage`` with OpenAI's prediction counts in its ``completion_tokens_details`` (the proposer's
    stats of the request; none found: both 0, as OpenAI reports a prediction nothing was drafted from).

    Example:
        >>> usage_with_counts({"completion_tokens": 9, "completion_tokens_details": None},
        ...                   {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2})
        {'completion_tokens': 9, 'completion_tokens_details': {'accepted_prediction_tokens': 6, 'rejected_prediction_tokens': 2}}
    """
    details = dict(usage.get("completion_tokens_details") or {})
    details["accepted_prediction_tokens"] = int((stats or {}).get("accepted_prediction_tokens") or 0)
    details["rejected_prediction_tokens"] = int((stats or {}).get("rejected_prediction_tokens") or 0)
    return {**usage, "completion_tokens_details": details}


def chat_error(body: dict[str, Any]) -> str | None:
    """Why a chat request's messages are refused (a role the library refuses: :func:`rag_accel.inputs.check_role`),
    or ``None``; what vLLM checks itself is left to it.

    Example:
        >>> chat_error({"messages": [{"role": "assistent", "content": "hi"}]})
        "chat message 0 has the role 'assistent'; a role is one of 'system', 'developer', 'user', 'assistant', 'tool'"
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    try:
        for i, m in enumerate(messages):
            if isinstance(m, dict) and "role" in m:
                check_role(i, m["role"])
    except ValueError as e:
        return str(e)
    return None


def _refusal(message: str, param: str = "prediction") -> bytes:
    """vLLM's own error body (``ErrorResponse``) for an HTTP 400."""
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


class PredictedOutputs:
    """The ASGI middleware (``vllm serve --middleware rag_accel.vllm.predictions.PredictedOutputs``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self._ours: bool | None = None  # whether the engine drafts with RagProposer (read once)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in _PATHS:
            return await self.app(scope, receive, send)
        raw, more = await _read_body(receive)
        chat = scope.get("path") == _PATHS[0]
        # (vLLM parses the body itself: parse it here only where a prediction or chat roles may be in it)
        # (off the event loop: a request with megabytes of references must not stall the server's other requests)
        body = await asyncio.to_thread(_json_object, raw) if not more and (chat or b'"prediction"' in raw) else None
        wrong = chat_error(body) if chat and body is not None else None
        if wrong is not None:  # (vLLM's chat server renders any role its template takes; the library refuses it)
            return await _send_400(send, wrong, "messages")
        key = prediction_xargs(body) if body is not None else None
        if key is None:  # no prediction: the request as it came
            return await self.app(scope, _replay(raw, more, receive), send)
        if not self._drafts_with_ours(scope):
            spec = getattr(self._vllm_config(scope), "speculative_config", None)
            mode = "off" if spec is None else getattr(spec, "method", "?")
            return await _send_400(send, f"prediction: this server's speculation ({mode}) does not draft from "
                                         "predictions; rag-accel serve with --speculation ours (the default) does")
        new = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(new)).encode())]}
        await self.app(scope, _replay(new, False, receive), _CountingSend(send, scope, key))

    def _vllm_config(self, scope: Scope) -> Any:
        app = scope.get("app")
        return getattr(getattr(app, "state", None), "vllm_config", None)

    def _drafts_with_ours(self, scope: Scope) -> bool:
        if self._ours is None:
            spec = getattr(self._vllm_config(scope), "speculative_config", None)
            self._ours = (spec is not None and getattr(spec, "method", None) == "custom_class"
                          and getattr(spec, "model", None) == PROPOSER_PATH)
        return self._ours


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request body (up to :data:`_MAX_BODY` bytes) and whether more follows unread."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # a disconnect: nothing more comes
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False
        if size > _MAX_BODY:
            return b"".join(chunks), True


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None  # vLLM says what is wrong with it
    return body if isinstance(body, dict) else None


def _replay(raw: bytes, more: bool, receive: Receive) -> Receive:
    """A ``receive`` that gives ``raw`` first, then (if ``more``) the rest of the original stream."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": more}
        return await receive()

    return replay


async def _send_400(send: Send, message: str, param: str = "prediction") -> None:
    body = _refusal(message, param)
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _CountingSend:
    """The response of a request with a prediction, its usage given the prediction counts: a JSON body is
    held until complete and rewritten; a stream (server-sent events) passes event by event, its final usage
    event (``choices: []`` with ``usage``) rewritten."""

    def __init__(self, send: Send, scope: Scope, key: str) -> None:
        self.send, self.scope, self.key = send, scope, key
        self.start: Message | None = None  # a JSON response's start, held until its body is rewritten
        self.mode = "pass"  # "json" | "stream" once a 200 response starts; "pass": an error, as it is
        self.buffer = b""

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            if message.get("status") != 200:
                self.mode = "pass"
            elif headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                self.mode = "stream"
            else:
                self.mode, self.start = "json", message
                return None
            return await self.send(message)
        if kind != "http.response.body" or self.mode == "pass":
            return await self.send(message)
        self.buffer += message.get("body", b"")
        more = message.get("more_body", False)
        if self.mode == "stream":  # complete events go on at once, the usage event rewritten
            done, sep, self.buffer = self.buffer.rpartition(b"\n\n")
            data = b"".join([await self._event(e) + sep for e in done.split(sep)]) if sep else b""
            if not more:
                data, self.buffer = data + self.buffer, b""
            if data or not more:
                await self.send({"type": "http.response.body", "body": data, "more_body": more})
            return None
        if more:
            return None
        body = await self._json_body(self.buffer)
        start = self.start or {"type": "http.response.start", "status": 200, "headers": []}
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await self.send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _json_body(self, raw: bytes) -> bytes:
        data = _json_object(raw)
        if data is None or not isinstance(data.get("usage"), dict):
            return raw
        data["usage"] = usage_with_counts(data["usage"], await self._stats())
        return json.dumps(data).encode()

    async def _event(self, event: bytes) -> bytes:
        """One server-sent event; the final usage chunk gets the counts."""
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        data = _json_object(event[len(b"data: "):])
        if data is None or data.get("choices") or not isinstance(data.get("usage"), dict):
            return event
        data["usage"] = usage_with_counts(data["usage"], await self._stats())
        return b"data: " + json.dumps(data).encode()

    async def _stats(self) -> dict[str, Any] | None:
        """This request's drafting statistics, fetched from (and forgotten by) the worker that drafts."""
        from .patches import pop_request_stats

        app = self.scope.get("app")
        client = getattr(getattr(app, "state", None), "engine_client", None)
        try:
            return await pop_request_stats(client, self.key)
        except Exception as e:  # noqa: BLE001 - counts are reporting: the answer itself is never lost
            log.warning("rag_accel: prediction counts of a request not found: %r", e)
            return None
