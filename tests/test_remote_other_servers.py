"""RemoteDecoder against an OpenAI-compatible server that is not ``rag-accel serve`` (here a minimal one on loopback
that answers as any such server does: text and usage, no token ids, our ``vllm_xargs`` ignored): the answer comes
back with one clear warning, and its token counts from the server's ``usage`` rather than zeros."""

from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("openai")

from rag_accel.serving.remote import RemoteDecoder  # noqa: E402

ANSWER = "Paris is the capital of France."


class _Plain(BaseHTTPRequestHandler):
    def log_message(self, *args):  # (quiet)
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "plain-model", "object": "model", "owned_by": "me"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        usage = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
        if self.path.endswith("/chat/completions"):
            choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": "stop", "text": ANSWER}
            kind = "text_completion"
        self._send({"id": "x", "object": kind, "created": 0, "model": request["model"], "choices": [choice],
                    "usage": usage})


@pytest.fixture()
def plain_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Plain)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_a_server_that_is_not_ours_is_named_once_and_counted_by_its_usage(plain_server):
    dec = RemoteDecoder(plain_server)
    with pytest.warns(RuntimeWarning, match="is not rag-accel serve.*drafts nothing from references"):
        out = dec.generate([{"role": "user", "content": "What is the capital of France?"}],
                           references=["Paris is the capital of France."], max_new_tokens=16)
    assert out.text == ANSWER and out.token_ids == []
    assert out.stats.new_tokens == 7 and out.stats.prompt_tokens == 12  # the server's usage, not zeros
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per server: the second answer warns no more
        again = dec.generate("The capital of France is", max_new_tokens=16)
    assert again.text == ANSWER and again.stats.new_tokens == 7
