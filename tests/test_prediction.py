"""OpenAI's Predicted Outputs without a server: its shape checked, its parts as references on the
transformers decoder (exact, counted), and the server middleware's rewriting over the ASGI protocol.

The same word against a real `rag-accel serve` server, with stock clients: tests/test_serve.py (the
openai SDK, vLLM's greedy as the reference) and tests/test_predicted_outputs_clients.py (LangChain,
LlamaIndex)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from rag_accel.prediction import as_prediction, prediction_parts, with_prediction
from rag_accel.protocol import batch_arguments
from rag_accel.vllm.predictions import PredictedOutputs, prediction_xargs, usage_with_counts
from rag_accel.vllm.requests import PROPOSER_PATH, check_extra_args
from rag_accel.wire import RequestArgs

# --------------------------------------------------------------------------- the shape


@pytest.mark.parametrize("bad, error, words", [
    ("text", TypeError, "prediction must be an object"),
    ({"content": "a"}, ValueError, "prediction.type must be 'content'"),
    ({"type": "content"}, ValueError, "has no content"),
    ({"type": "content", "content": None}, TypeError, "prediction.content must be a string or a list"),
    ({"type": "content", "content": b"a"}, TypeError, "prediction.content must be a string or a list"),
    ({"type": "content", "content": ["a"]}, TypeError, r"prediction.content\[0\] must be a text part"),
    ({"type": "content", "content": [{"type": "text"}]}, ValueError, r"content\[0\] has no text"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, TypeError, r"content\[0\].text must be a string"),
    ({"type": "content", "content": "a", "extra": 1}, ValueError, "unknown keys"),
    ({"type": "content", "content": "bad \ud800"}, ValueError, "lone surrogate"),
])
def test_a_malformed_prediction_is_refused_naming_the_field(bad, error, words):
    with pytest.raises(error, match=words):
        prediction_parts(bad)


def test_parts_join_the_references_after_them():
    doc = {"type": "content", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}
    assert with_prediction(None, doc) == ["p1", "p2"]
    assert with_prediction("r", doc) == ["r", "p1", "p2"]
    assert with_prediction(["r", [1, 2]], doc) == ["r", [1, 2], "p1", "p2"]
    assert with_prediction(["r"], None) == ["r"] and with_prediction(None, None) is None
    assert as_prediction(["p1", "p2"]) == doc


def test_generate_batch_takes_one_prediction_per_prompt():
    p = as_prediction(["x"])
    _, _, opts = batch_arguments(["a", "b"], None, {"prediction": [p, None]})
    assert [o["prediction"] for o in opts] == [p, None]
    with pytest.raises(ValueError, match="prediction in generate_batch: one entry per prompt"):
        batch_arguments(["a", "b"], None, {"prediction": p})


def test_the_servers_extra_args_carry_a_prediction_as_references(monkeypatch):
    body = {"messages": [], "prediction": as_prediction(["one", "two"]), "vllm_xargs": {"references": ["r"]}}
    key = prediction_xargs(body)
    assert "prediction" not in body and body["vllm_xargs"]["rag_accel_id"] == key
    args = RequestArgs.read(body["vllm_xargs"])
    assert args.references == ("r", "one", "two") and args.speculate
    bad = {"prediction": {"type": "content", "content": 5}}
    prediction_xargs(bad)
    with pytest.raises(ValueError, match="prediction.content must be"):
        check_extra_args(bad["vllm_xargs"])  # the admission check: HTTP 400 on the server
    with pytest.raises(ValueError, match="nothing would draft from it"):
        check_extra_args({"prediction": ["x"], "speculate": 0})
    from rag_accel.vllm.requests import ServerSettings

    # (rag-accel serve --max-reference-tokens 100, and its tokenizer's bound: 5 characters a token)
    monkeypatch.setenv(*ServerSettings(max_reference_tokens=100, text_bound=(5, None)).environment().popitem())
    check_extra_args({"prediction": ["word " * 100]})
    with pytest.raises(ValueError, match="prediction .with extra_args.'references'.. holds over 100 tokens"):
        check_extra_args({"prediction": ["word " * 200], "references": ["r"]})
    assert prediction_xargs({"messages": []}) is None


# --------------------------------------------------------------------------- the middleware, over ASGI
def _app(status=200, stream=False, usage=None, spec=PROPOSER_PATH, seen=None):
    """An ASGI app answering as vLLM's OpenAI server does (a JSON body, or server-sent events ending in a
    usage chunk), its state holding what the middleware reads; ``seen`` gets the body it was sent."""
    usage = usage or {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                      "completion_tokens_details": None}

    async def app(scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        if seen is not None:
            seen.append(json.loads(b"".join(chunks)))
        if stream:
            events = [{"choices": [{"delta": {"content": "Hi"}}], "usage": None},
                      {"choices": [], "usage": usage}]
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/event-stream")]})
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            for i in range(0, len(data), 7):  # events split across body messages
                await send({"type": "http.response.body", "body": data[i:i + 7], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body = json.dumps({"choices": [{"message": {"content": "Hi"}}], "usage": usage}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[:5], "more_body": True})
            await send({"type": "http.response.body", "body": body[5:], "more_body": False})

    class Engine:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            keys, _ = args
            return [{"proposer": True, "stats": [{"accepted_prediction_tokens": 6,
                                                  "rejected_prediction_tokens": 2} for _ in keys]}]

    app.state = SimpleNamespace(vllm_config=SimpleNamespace(
        speculative_config=None if spec is None else SimpleNamespace(method="custom_class", model=spec)),
        engine_client=Engine())
    return app


def _post(app, body, path="/v1/chat/completions"):
    sent = []
    raw = json.dumps(body).encode()
    messages = iter([{"type": "http.request", "body": raw[:10], "more_body": True},
                     {"type": "http.request", "body": raw[10:], "more_body": False}])

    async def receive():
        return next(messages)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "app": app,
             "headers": [(b"content-length", str(len(raw)).encode())]}
    asyncio.run(PredictedOutputs(app)(scope, receive, send))
    status = sent[0]["status"]
    headers = dict(sent[0]["headers"])
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, headers, body


def test_the_middleware_rewrites_the_request_and_adds_the_counts():
    seen = []
    prediction = as_prediction(["It is 42."])
    status, headers, body = _post(_app(seen=seen), {"messages": [], "prediction": prediction})
    assert status == 200 and int(headers[b"content-length"]) == len(body)
    assert json.loads(body)["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 6,
                                                                      "rejected_prediction_tokens": 2}
    assert seen[0]["vllm_xargs"]["prediction"] == ["It is 42."] and "prediction" not in seen[0]
    status, _, body = _post(_app(stream=True), {"prompt": "x", "prediction": prediction, "stream": True},
                            "/v1/completions")
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 3
    assert json.loads(events[0][6:])["usage"] is None  # only the final usage chunk changes
    assert json.loads(events[1][6:])["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 6


def test_the_middleware_leaves_other_requests_alone_and_refuses_where_nothing_drafts():
    seen = []
    status, _, body = _post(_app(seen=seen), {"messages": [], "vllm_xargs": {"references": ["r"]}})
    assert status == 200 and seen[0] == {"messages": [], "vllm_xargs": {"references": ["r"]}}
    assert json.loads(body)["usage"]["completion_tokens_details"] is None  # no prediction: vLLM's usage
    status, _, body = _post(_app(status=400), {"messages": [], "prediction": as_prediction(["x"])})
    assert status == 400  # vLLM's refusal passes as it is
    status, _, body = _post(_app(spec=None), {"messages": [], "prediction": as_prediction(["x"])})
    assert status == 400 and "does not draft from predictions" in json.loads(body)["error"]["message"]
    assert usage_with_counts({"completion_tokens_details": {"reasoning_tokens": 1}}, None) == {
        "completion_tokens_details": {"reasoning_tokens": 1, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0}}


# --------------------------------------------------------------------------- the transformers decoder
@pytest.mark.slow
def test_a_prediction_on_the_transformers_decoder_is_exact_and_counted(real_decoder):
    """Right, wrong and partly right predictions: the output is greedy's every time; the counts are the
    reference drafter's (the only drafter here), and a right prediction is mostly accepted."""
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    it = load_msmarco_sample(limit=2)[1]
    msgs = rag_messages(it.query, it.passages)
    greedy = real_decoder.generate_greedy(msgs, max_new_tokens=40)
    other = real_decoder.generate_greedy([{"role": "user", "content": "Name three colours."}], max_new_tokens=40)
    half = greedy.text[: len(greedy.text) // 2] + other.text
    for content in (greedy.text, [{"type": "text", "text": other.text}], [{"type": "text", "text": half}]):
        out = real_decoder.generate(msgs, max_new_tokens=40, config={"drafters": ("reference",)},
                                    prediction={"type": "content", "content": content})
        assert out.token_ids == greedy.token_ids
        ref = out.stats.by_drafter.get("reference", {"drafted": 0, "accepted": 0})
        assert (out.stats.accepted_prediction_tokens, out.stats.rejected_prediction_tokens) == (
            ref["accepted"], ref["drafted"] - ref["accepted"])
        if content is greedy.text:
            assert out.stats.accepted_prediction_tokens >= 0.5 * len(greedy.token_ids)
    with pytest.raises(TypeError, match="prediction must be an object"):
        real_decoder.generate(msgs, prediction="text")
