"""`rag-accel serve` (vLLM's OpenAI-compatible server with our proposer) and RemoteDecoder, with real parts.

One server for the module, started as a user would (`python -m rag_accel.cli serve ...` in a
subprocess, on a free loopback port), called with the real `openai` client and with
RemoteDecoder; its outputs are compared token for token with vLLM's greedy output in this
process (VllmDecoder, speculation off: the run's engine, tests/conftest.py). CPU,
float32, SmolLM2-135M-Instruct, a few MS-MARCO items, 32 new tokens.

Without vLLM installed the module is skipped, unless RAG_ACCEL_REQUIRE_VLLM=1 (CI), where that
is an error (as tests/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()

import openai  # noqa: E402 - a dependency of vLLM

from rag_accel.serving import serve  # noqa: E402
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages  # noqa: E402
from rag_accel.serving.remote import RemoteDecoder, RemoteError  # noqa: E402
from rag_accel.serving.server_process import Server, group_processes  # noqa: E402
from rag_accel.vllm.requests import MIDDLEWARE_PATH  # noqa: E402
from rag_accel.wire import WORKER_BASE, RequestArgs  # noqa: E402
from rag_accel.vllm import (  # noqa: E402
    PROPOSER_PATH,
    TRACKER_PATH,
    check_extra_args,
    speculative_config,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")

MODEL = "smollm2-135m-instruct"
N_ITEMS = 3
MAX_NEW = 32
MAX_MODEL_LEN = 2048
MAX_REF = 20_000  # --max-reference-tokens: "too large" is cheap to send
# (text certainly over it: SmolLM2's tokens cover at most 81 characters, so 20 * MAX_REF words of 5 characters)
READY_TIMEOUT = float(os.environ.get("RAG_ACCEL_SERVE_TIMEOUT", "900"))  # a busy 2-core machine


# --------------------------------------------------------------------------- pieces, no server
def test_serve_command_per_speculation_mode():
    ours = serve.serve_command("/m", port=8001, dtype="float32", max_model_len=2048, speculation="ours",
                               max_draft_tokens=7, served_model_name="m", extra=["--enforce-eager"])
    args = ours[ours.index("serve"):]
    assert args[:4] == ["serve", "/m", "--host", "127.0.0.1"] and args[-1] == "--enforce-eager"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 7}
    assert args[args.index("--logits-processors") + 1] == TRACKER_PATH
    assert args[args.index("--served-model-name") + 1] == "m"
    ngram = serve.serve_command("/m", speculation="ngram")
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == speculative_config("ngram", 10)
    assert "--logits-processors" not in ngram
    off = serve.serve_command("/m", speculation="off")
    assert "--speculative-config" not in off and "--logits-processors" not in off
    for cmd in (ours, ngram, off):  # Predicted Outputs in every mode (refused where nothing drafts from them)
        assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE_PATH
    with pytest.raises(ValueError, match="--speculation"):
        serve.serve_command("/m", extra=["--speculative-config", "{}"])
    with pytest.raises(ValueError, match="speculation"):
        serve.serve_command("/m", speculation="eagle")
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:  # vLLM's suffix decoding: say what it needs
        with pytest.raises(ImportError, match="pip install arctic-inference"):
            serve.serve_command("/m", speculation="suffix")
    else:
        suffix = serve.serve_command("/m", speculation="suffix", max_draft_tokens=12)
        assert json.loads(suffix[suffix.index("--speculative-config") + 1]) == {"method": "suffix",
                                                                                "num_speculative_tokens": 12}
        assert "--logits-processors" not in suffix


def _settings(line: str):
    """The server settings a `rag-accel serve --dry-run` command line carries (its one RAG_ACCEL_SERVER, no other
    variable of ours: the engine's exact mode goes in its config, --additional-config)."""
    import shlex

    from rag_accel.vllm.requests import SETTINGS_ENV, ServerSettings

    values = [w.split("=", 1)[1] for w in shlex.split(line) if w.startswith(SETTINGS_ENV + "=")]
    others = [w.split("=", 1)[0] for w in shlex.split(line) if w.startswith("RAG_ACCEL_") and
              not w.startswith(SETTINGS_ENV + "=")]
    assert len(values) == 1 and others == [], line
    return ServerSettings.from_json(values[0])


def test_cli_serve_dry_run_prints_the_command():
    from typer.testing import CliRunner

    from rag_accel.cli import app

    res = CliRunner().invoke(app, ["serve", "some/model", "--port", "9", "--max-reference-tokens", "5", "--dry-run",
                                   "--", "--tensor-parallel-size", "2"])
    assert res.exit_code == 0, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("RAG_ACCEL_SERVER=") and " serve some/model " in line
    assert _settings(line).max_reference_tokens == 5 and "max_reference_tokens=5" in res.output
    assert line.endswith("--tensor-parallel-size 2") and "rag_accel.vllm.RagProposer" in line
    res = CliRunner().invoke(app, ["serve", "--", "--enforce-eager"])
    assert res.exit_code == 2 and "before `--`" in res.output


def test_cli_serve_defaults_for_untrusted_clients_and_refuses_pipeline_parallelism(tmp_path):
    """An untrusted client gets at most 32,768 reference tokens by default, and reference ids are
    checked against the served model's vocabulary at admission (read from its config.json)."""
    from typer.testing import CliRunner

    from rag_accel.cli import app

    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 1234}')
    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dry-run"])
    assert res.exit_code == 0, res.output
    line = res.output.strip().splitlines()[-1]
    # the memory of answers: on, and no default scope (a request that names none neither reads nor writes it)
    settings = _settings(line)
    assert (settings.max_reference_tokens, settings.answer_memory_tokens, settings.vocab_size,
            settings.memory_scope) == (32768, 100000, 1234, None)
    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dry-run", "--answer-memory-tokens", "0",
                                   "--memory-scope", "one-tenant"])
    assert res.exit_code == 0, res.output
    settings = _settings(res.output.strip().splitlines()[-1])
    assert (settings.answer_memory_tokens, settings.memory_scope) == (0, "one-tenant")
    assert "answer_memory_tokens=0, memory_scope='one-tenant'" in res.output  # (printed, typed)
    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dry-run", "--memory-scope", "x" * 257])
    assert res.exit_code == 2 and "--memory-scope: memory_scope must be a string of 1 to 256" \
        in res.output
    for pp in (["--pipeline-parallel-size", "2"], ["-pp=2"]):
        res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dry-run", "--", *pp])
        assert res.exit_code != 0 and "pipeline parallelism" in res.output, res.output
    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dry-run", "--speculation", "off", "--", "-pp", "2"])
    assert res.exit_code == 0 and res.output.strip().endswith("-pp 2")


def test_extra_args_as_the_server_delivers_them():
    """vllm_xargs holds strings, numbers and flat lists only; JSON booleans arrive as 0/1."""
    args = RequestArgs.read({"references": ["a", "b"], "reference_ids": "[[1, 2], [3]]", "speculate": 0,
                             "rag_accel": '{"max_loss": 0.1}'})
    assert args == RequestArgs(("a", "b", (1, 2), (3,)), (), False, WORKER_BASE.replace(max_loss=0.1))
    args = RequestArgs.read({"reference_ids": [5, 6, 7], "speculate": 1})
    assert (args.references, args.speculate, args.config) == (((5, 6, 7),), True, WORKER_BASE)
    assert RequestArgs.read({"answers": "an earlier answer", "answer_ids": "[[1, 2], [3]]"}).answers == \
        ("an earlier answer", (1, 2), (3,))
    assert RequestArgs.read({"references": ["a"]}).answers == () and RequestArgs.read(None) == RequestArgs()
    check_extra_args({"rag_accel": '{"max_loss": 0.1}'})
    for bad, match in (({"reference_ids": "[[1, 'x']]"}, "JSON"), ({"reference_ids": "[1, 2]"}, "list of token-id"),
                       ({"reference_ids": 5}, "reference_ids"), ({"speculate": 2}, "speculate"),
                       ({"rag_accel": "{bogus"}, "JSON"), ({"rag_accel": '{"bogus": 1}'}, "bogus"),
                       ({"reference_ids": "[[-1]]"}, "negative"), ({"memory_scope": 7}, "memory_scope"),
                       ({"memory_scope": ""}, "memory_scope"), ({"memory_scope": "x" * 257}, "257 characters"),
                       ({"answers": 5}, r"\['answers'\] must be"), ({"answer_ids": "[[-1]]"}, "negative"),
                       ({"answer_ids": "nope"}, r"\['answer_ids'\] is not valid JSON")):
        with pytest.raises(ValueError, match=match):
            check_extra_args(bad)
    check_extra_args({"memory_scope": "tenant-1"})


def test_remote_decoder_checks_inputs_before_sending():
    dec = RemoteDecoder("http://127.0.0.1:9", model="m")  # nothing listens there: nothing may be sent
    with pytest.raises(TypeError, match="reference 0"):
        dec.generate("hi", [3.5])
    with pytest.raises(ValueError, match="do_sample"):
        dec.generate("hi", temperature=0.5)
    with pytest.raises(TypeError, match="unexpected"):
        dec.generate("hi", bogus=1)
    with pytest.raises(ValueError, match="stop"):
        dec.stream("hi", stop="")
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([])
    with pytest.raises(ValueError, match="http"):
        RemoteDecoder("localhost:8000")
    assert RemoteDecoder("http://h:1").base_url == "http://h:1/v1"
    from rag_accel.protocol import Request

    call = dec._call(Request.of([{"role": "user", "content": "q"}], ["text", [1, 2]],
                                {"max_new_tokens": 8, "config": {"max_loss": 0.2}, "speculate": False}))
    xargs = call.kwargs["extra_body"]["vllm_xargs"]
    assert call.chat and RequestArgs.read(xargs) == RequestArgs(("text", (1, 2)), (), False,
                                                                WORKER_BASE.replace(max_loss=0.2))
    assert call.kwargs["temperature"] == 0.0 and call.kwargs["extra_body"]["return_token_ids"] is True


# --------------------------------------------------------------------------- one server, real requests
@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(limit=8)


@pytest.fixture(scope="module")
def started_server():
    """The module's server, started first: it loads in its own processes while the baseline engine runs here."""
    srv = Server(MODEL, options=["--max-model-len", str(MAX_MODEL_LEN), "--max-reference-tokens", str(MAX_REF)],
                 vllm_args=["--enforce-eager"])
    srv.start()
    pgid = srv.proc.pid
    try:
        yield srv
    finally:
        log = srv.log_path
        pids = group_processes(pgid)  # the server, its engine and its worker
        clean = srv.stop()
    # After the module's tests (none of them stops the shared server): SIGINT ends the server and its
    # engine in time, no process of its group is left, and a clean stop leaves no log file behind.
    assert clean, f"SIGINT did not end the server and its engine in time:\n{srv.log_tail()}"
    assert srv.proc.returncode is not None and group_processes(pgid) == []
    assert log is not None and not log.exists() and srv.log_path is None
    # Intel OpenMP (preloaded by the launcher) registers each process in /dev/shm; the server's exit removes the
    # files of its engine and worker, which vLLM ends by signal (issue 66: two were left at every stop)
    left = [f.name for p in pids for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{p}_*")]
    assert left == [], left


@pytest.fixture(scope="module")
def baseline(items, started_server, vllm_greedy):
    """vLLM's own greedy outputs in this process, speculation off (the run's engine, tests/conftest.py,
    at the server's MAX_MODEL_LEN): the reference for every comparison."""
    dec = vllm_greedy
    assert dec.context_window == MAX_MODEL_LEN
    msgs = [rag_messages(it.query, it.passages) for it in items[:N_ITEMS]]
    outs = [dec.generate(m, max_new_tokens=MAX_NEW) for m in msgs]
    text = dec.generate("The capital of France is", max_new_tokens=8)
    return SimpleNamespace(ids=[o.token_ids for o in outs], texts=[o.text for o in outs],
                           prompt_ids=[dec.encode_prompt(m) for m in msgs], msgs=msgs,
                           finish=[o.finish_reason for o in outs], text_prompt=text)


@pytest.fixture(scope="module")
def server(started_server, baseline):
    started_server.ready_s = started_server.wait_ready(READY_TIMEOUT)
    return started_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", timeout=600, max_retries=0)


def _accepted(server) -> tuple[float, float]:
    """The server's spec-decode totals from /metrics: (draft tokens, accepted tokens)."""
    return server.spec_decode_counters()


def _chat(client, msgs, xargs=None, **kw):
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_NEW, temperature=0,
                                       extra_body={"return_token_ids": True, "vllm_xargs": xargs or {}}, **kw)
    return r.choices[0]


@pytest.mark.slow
def test_references_reach_the_proposer_in_the_servers_engine(server, client, baseline):
    """The build hook engaged in the server's engine process: drafts copied from a request's
    references are accepted (the server's own spec-decode counters), and the output is greedy's."""
    d0, a0 = _accepted(server)
    right = _chat(client, baseline.msgs[0], {"references": [baseline.texts[0]]})
    d1, a1 = _accepted(server)
    assert right.token_ids == baseline.ids[0] and right.message.content == baseline.texts[0]
    assert a1 - a0 >= 0.5 * MAX_NEW and a1 - a0 >= 0.8 * (d1 - d0), (d1 - d0, a1 - a0)
    off = _chat(client, baseline.msgs[0], {"references": [baseline.texts[0]], "speculate": False})
    d2, a2 = _accepted(server)
    assert off.token_ids == baseline.ids[0] and (d2, a2) == (d1, a1)  # speculate false: nothing drafted
    plain = _chat(client, baseline.msgs[1])  # no references: prompt lookup + n-grams
    assert plain.token_ids == baseline.ids[1] and plain.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_the_server_remembers_an_answer_in_its_scope_only(server, client, baseline):
    """The same question again in its memory scope copies the first answer (the server's own
    spec-decode counters); in another scope it does not. Every output is greedy's (issue 29)."""
    i = N_ITEMS - 1
    counts = [_accepted(server)]
    outs = []
    for scope in ("tenant-a", "tenant-a", "tenant-b"):
        outs.append(_chat(client, baseline.msgs[i], {"memory_scope": scope}))
        counts.append(_accepted(server))
    accepted = [counts[k + 1][1] - counts[k][1] for k in range(3)]
    assert all(o.token_ids == baseline.ids[i] for o in outs)
    assert accepted[1] >= accepted[0] + 0.5 * len(baseline.ids[i]), accepted  # the repeat copied the answer
    assert accepted[2] < accepted[1], accepted  # tenant-b was never given it
    remote = RemoteDecoder(server.base_url, memory_scope="tenant-c")  # the client's option: the same
    remote_accepted = []
    for _ in range(2):
        before = _accepted(server)[1]
        assert remote.generate(baseline.msgs[i], max_new_tokens=MAX_NEW).token_ids == baseline.ids[i]
        remote_accepted.append(_accepted(server)[1] - before)
    assert remote_accepted[1] >= remote_accepted[0] + 0.5 * len(baseline.ids[i]), remote_accepted


@pytest.mark.slow
def test_streaming_chat(client, baseline, items):
    stream = client.chat.completions.create(
        model=MODEL, messages=baseline.msgs[2], max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "vllm_xargs": {"references": items[2].passages}})
    text, ids, usage = "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            ids += getattr(c, "token_ids", None) or []  # (absent from chunks without tokens)
    assert ids == baseline.ids[2] and text == baseline.texts[2]
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(baseline.prompt_ids[2])


@pytest.mark.slow
def test_eight_concurrent_requests_each_with_its_references(client, baseline, items):
    """8 threads, 8 questions, each its own references (its passages, the right answer, wrong
    text, another question's passages): token for token what the same requests give with
    drafting off (also sent together), and for the first items vLLM's greedy in process."""
    kinds = ["passages", "right", "wrong", "other"] * 2

    def refs(i):
        kind = kinds[i]
        if kind == "right" and i < N_ITEMS:
            return [baseline.texts[i]]
        if kind == "wrong":
            return ["The quick brown fox jumps over the lazy dog. " * 8]
        if kind == "other":
            return items[(i + 3) % 8].passages
        return items[i].passages

    msgs = [rag_messages(it.query, it.passages) for it in items]

    def run(speculate):
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda i: _chat(client, msgs[i], {"references": refs(i), "speculate": speculate}),
                                 range(8)))

    t0 = time.perf_counter()
    on = run(True)
    t_on = time.perf_counter() - t0
    off = run(False)
    for i in range(8):
        assert on[i].token_ids == off[i].token_ids, f"request {i} ({kinds[i]} references) differs"
        if i < N_ITEMS:
            assert on[i].token_ids == baseline.ids[i]
    print(f"\n8 concurrent requests: {t_on:.1f} s with drafting")


@pytest.mark.slow
def test_bad_references_get_400_and_the_server_serves_on(server, client, baseline):
    bad = [{"references": 5}, {"references": [[1, 2]]}, {"speculate": "yes"},
           {"references": ["word " * (20 * MAX_REF)]},  # over --max-reference-tokens
           {"reference_ids": "[[1, 2"}, {"rag_accel": '{"bogus": 1}'}, {"memory_scope": 5},
           {"memory_scope": "x" * 300}, {"answers": 5}, {"answer_ids": "[[1, 2"},
           {"answers": ["word " * (20 * MAX_REF)]},
           {"references": ["word " * (12 * MAX_REF)], "answers": ["word " * (12 * MAX_REF)]}]  # together over the limit
    for xargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, baseline.msgs[0], xargs)
        assert e.value.status_code == 400
    with pytest.raises(RemoteError, match="max_reference_tokens|hold over"):
        RemoteDecoder(server.base_url).generate(baseline.msgs[0], ["word " * (20 * MAX_REF)])
    with pytest.raises(RemoteError, match="hold over"):  # streamed: HTTP 200, then an error event (code 400)
        list(RemoteDecoder(server.base_url).stream(baseline.msgs[0], ["word " * (20 * MAX_REF)]))
    with pytest.raises(openai.BadRequestError, match="role 'assistent'") as e:  # a role the library refuses too
        client.chat.completions.create(model=MODEL, messages=[{"role": "assistent", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 400
    assert _chat(client, baseline.msgs[0], {"references": baseline.msgs[0][-1]["content"]}).token_ids == baseline.ids[0]
    assert RemoteDecoder(server.base_url).generate(baseline.msgs[0], answers=[baseline.msgs[0][-1]["content"]],
                                                   max_new_tokens=MAX_NEW).token_ids == baseline.ids[0]
    assert server.proc.poll() is None


@pytest.mark.slow
def test_a_client_leaving_mid_stream_leaves_the_server_serving(server, client, baseline, items):
    import httpx

    body = {"model": MODEL, "messages": baseline.msgs[1], "max_tokens": 400, "temperature": 0, "stream": True,
            "vllm_xargs": {"references": items[1].passages}}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", server.base_url + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # a few events, then hang up mid-answer
    assert any(line.startswith("data: {") for line in got)
    # Two more abandoned at once, one through the openai client.
    s = client.chat.completions.create(model=MODEL, messages=baseline.msgs[2], max_tokens=400, temperature=0,
                                       stream=True, extra_body={"vllm_xargs": {"references": items[2].passages}})
    next(iter(s))
    s.close()
    RemoteDecoder(server.base_url).stream(baseline.msgs[0], items[0].passages, max_new_tokens=400).close()
    assert _chat(client, baseline.msgs[1], {"references": items[1].passages}).token_ids == baseline.ids[1]
    assert urllib.request.urlopen(server.url + "/health", timeout=30).status == 200
    assert server.proc.poll() is None


@pytest.mark.slow
def test_remote_decoder_equals_greedy_in_process(server, baseline, items):
    dec = RemoteDecoder(server.base_url)
    assert dec.model == MODEL and dec.context_window == MAX_MODEL_LEN
    out = dec.generate(baseline.msgs[0], items[0].passages, max_new_tokens=MAX_NEW)
    assert out.token_ids == baseline.ids[0] and out.text == baseline.texts[0]
    assert out.finish_reason == baseline.finish[0] and out.stats.prompt_tokens == len(baseline.prompt_ids[0])
    st = out.stats  # what the server cannot tell is None, never invented
    assert (st.steps, st.drafted, st.accepted, st.tokens_per_step, st.acceptance_rate) == (None,) * 5
    assert st.new_tokens == len(out.token_ids) and st.by_drafter == {} and st.time_s > 0
    stream = dec.stream(baseline.msgs[1], items[1].passages, max_new_tokens=MAX_NEW)
    assert "".join(stream) == baseline.texts[1] and stream.output.token_ids == baseline.ids[1]
    ids = dec.generate(baseline.prompt_ids[2], [baseline.ids[2]], max_new_tokens=MAX_NEW)  # ids prompt + ids refs
    assert ids.token_ids == baseline.ids[2]
    # the server's encoding of a prompt (its /tokenize) is the in-process decoder's: the Decoder surface
    assert dec.encode_prompt(baseline.msgs[1]) == baseline.prompt_ids[1]
    assert dec.encode_prompt(baseline.prompt_ids[2]) == baseline.prompt_ids[2]
    text = dec.generate("The capital of France is", max_new_tokens=8)
    assert text.token_ids == baseline.text_prompt.token_ids and text.text == baseline.text_prompt.text
    word = baseline.texts[0].split()[3]
    cut = dec.generate(baseline.msgs[0], items[0].passages, max_new_tokens=MAX_NEW, stop=word)
    assert cut.finish_reason == "stop" and cut.text == baseline.texts[0][:baseline.texts[0].find(word)]
    assert cut.token_ids == baseline.ids[0][:len(cut.token_ids)]

    async def both():
        a = await dec.agenerate(baseline.msgs[2], items[2].passages, max_new_tokens=MAX_NEW)
        s = await dec.astream(baseline.msgs[2], items[2].passages, max_new_tokens=MAX_NEW)
        return a, "".join([p async for p in s]), s.output

    a, streamed, s_out = asyncio.run(both())
    assert a.token_ids == s_out.token_ids == baseline.ids[2] and streamed == baseline.texts[2]


@pytest.mark.slow
def test_remote_calls_from_threads_run_together(server, baseline):
    """No client-side lock: 4 threads' requests are in the server at the same time."""
    dec = RemoteDecoder(server.base_url)
    inside, peak, lock = 0, 0, threading.Lock()

    def one(i):
        nonlocal inside, peak
        s = dec.stream(baseline.msgs[i % N_ITEMS], max_new_tokens=MAX_NEW)
        it = iter(s)
        first = next(it)  # this request is running in the server
        with lock:
            inside += 1
            peak = max(peak, inside)
        rest = "".join(it)
        with lock:
            inside -= 1
        return first + rest, s.output.token_ids

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert peak >= 2, "requests from threads were serialised"
    for i, (text, ids) in enumerate(results):
        assert ids == baseline.ids[i % N_ITEMS] and text == baseline.texts[i % N_ITEMS]


# --------------------------------------------------------------------------- OpenAI's Predicted Outputs (issue 54)
def _prediction(*texts):
    return {"type": "content", "content": texts[0] if len(texts) == 1 else [{"type": "text", "text": t}
                                                                            for t in texts]}


def _settled_counters(server, before, timeout=10.0):
    """/metrics after a request: vLLM records a step's spec-decode counts beside its outputs, so read again
    until two reads agree (or ``timeout``)."""
    last = server.spec_decode_counters()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = server.spec_decode_counters()
        if now == last and now != before:
            break
        last = now
    return last


@pytest.mark.slow
def test_predicted_outputs_with_the_openai_sdk_sync_async_and_streamed(server, client, baseline, items):
    """The openai SDK's own `prediction=` (no rag_accel on the client): the output is vLLM's greedy whatever
    the prediction says; a right one is mostly accepted; its counts arrive in usage, streamed or not."""
    right = client.chat.completions.create(model=MODEL, messages=baseline.msgs[0], max_tokens=MAX_NEW, temperature=0,
                                           prediction=_prediction(baseline.texts[0]),
                                           extra_body={"return_token_ids": True})
    details = right.usage.completion_tokens_details
    assert right.choices[0].token_ids == baseline.ids[0] and right.choices[0].message.content == baseline.texts[0]
    assert details.accepted_prediction_tokens >= 0.5 * MAX_NEW, details
    wrong = client.chat.completions.create(model=MODEL, messages=baseline.msgs[0], max_tokens=MAX_NEW, temperature=0,
                                           prediction=_prediction(baseline.texts[1], "No. " * 40),
                                           extra_body={"return_token_ids": True})
    assert wrong.choices[0].token_ids == baseline.ids[0]
    stream = client.chat.completions.create(model=MODEL, messages=baseline.msgs[1], max_tokens=MAX_NEW, temperature=0,
                                            prediction=_prediction(*items[1].passages, baseline.texts[1]),
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == baseline.texts[1] and usage.completion_tokens_details.accepted_prediction_tokens > 0

    async def asynchronous():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", timeout=600, max_retries=0)
        try:
            return await aclient.chat.completions.create(model=MODEL, messages=baseline.msgs[2], max_tokens=MAX_NEW,
                                                         temperature=0, prediction=_prediction(baseline.texts[2]))
        finally:
            await aclient.close()

    a = asyncio.run(asynchronous())
    assert a.choices[0].message.content == baseline.texts[2]
    assert a.usage.completion_tokens_details.accepted_prediction_tokens >= 0.5 * MAX_NEW
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0, extra_body={"prediction": _prediction(baseline.text_prompt.text)})
    assert completion.choices[0].text == baseline.text_prompt.text
    assert completion.usage.completion_tokens_details.accepted_prediction_tokens is not None


@pytest.mark.slow
def test_prediction_counts_equal_the_servers_own_statistics(server, client, baseline):
    """With the reference drafter alone, every draft token of the request is a prediction token: its usage
    counts are exactly the server's own spec-decode totals over that request (/metrics)."""
    for i, text in ((0, baseline.texts[0]), (1, baseline.texts[1][: len(baseline.texts[1]) // 2] + " No.")):
        before = server.spec_decode_counters()
        r = client.chat.completions.create(model=MODEL, messages=baseline.msgs[i], max_tokens=MAX_NEW, temperature=0,
                                           prediction=_prediction(text), extra_body={
                                               "return_token_ids": True,
                                               "vllm_xargs": {"rag_accel": json.dumps({"drafters": ["reference"]})}})
        after = _settled_counters(server, before)
        d = r.usage.completion_tokens_details
        assert r.choices[0].token_ids == baseline.ids[i]
        assert d.accepted_prediction_tokens > 0
        assert (d.accepted_prediction_tokens, d.accepted_prediction_tokens + d.rejected_prediction_tokens) == (
            after[1] - before[1], after[0] - before[0]), (d, before, after)


@pytest.mark.slow
def test_malformed_predictions_get_400_while_other_requests_are_served(server, client, baseline, items):
    long = {}

    def good():
        long["out"] = _chat(client, baseline.msgs[1], {"references": items[1].passages})

    worker = threading.Thread(target=good)
    worker.start()
    bad = [("text", "prediction must be an object"), ({"type": "content", "content": 5}, "prediction.content must"),
           ({"type": "image", "content": "x"}, "prediction.type must be 'content'"),
           ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "must be text"),
           (_prediction("word " * (20 * MAX_REF)), "holds over")]
    for prediction, words in bad:
        with pytest.raises(openai.BadRequestError, match=words) as e:
            client.chat.completions.create(model=MODEL, messages=baseline.msgs[0], max_tokens=MAX_NEW, temperature=0,
                                           prediction=prediction)
        assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="nothing would draft from it"):
        _chat(client, baseline.msgs[0], {"speculate": False}, prediction=_prediction("x"))
    worker.join()
    assert long["out"].token_ids == baseline.ids[1]
    assert _chat(client, baseline.msgs[0], prediction=_prediction(baseline.texts[0])).token_ids == baseline.ids[0]
    assert server.proc.poll() is None


@pytest.mark.slow
def test_a_prediction_with_options_openai_refuses_stays_exact(server, client, baseline):
    """OpenAI refuses a prediction with n > 1, logprobs or penalties; verification keeps them exact here: each
    answer is the same request's answer with drafting off (speculate false), on the same engine."""
    def both(**kw):
        with_ = client.chat.completions.create(model=MODEL, messages=baseline.msgs[2], max_tokens=MAX_NEW,
                                               prediction=_prediction(baseline.texts[2]), **kw)
        off = client.chat.completions.create(model=MODEL, messages=baseline.msgs[2], max_tokens=MAX_NEW,
                                             extra_body={"vllm_xargs": {"speculate": False}}, **kw)
        return with_, off

    with_, off = both(temperature=0, presence_penalty=0.8, frequency_penalty=0.5)
    assert with_.choices[0].message.content == off.choices[0].message.content
    with_, off = both(temperature=0, logprobs=True, top_logprobs=2)
    assert [t.token for t in with_.choices[0].logprobs.content] == [t.token for t in off.choices[0].logprobs.content]
    for a, b in zip(with_.choices[0].logprobs.content, off.choices[0].logprobs.content):
        assert abs(a.logprob - b.logprob) < 1e-3
    with_, _ = both(temperature=1.0, n=2, seed=7)  # sampled: its distribution is kept, not its draws (served only)
    details = with_.usage.completion_tokens_details
    assert len(with_.choices) == 2 and all(c.message.content for c in with_.choices)
    assert isinstance(details.accepted_prediction_tokens, int) and isinstance(details.rejected_prediction_tokens, int)


@pytest.mark.slow
def test_remote_decoder_sends_a_prediction_and_reads_its_counts(server, baseline):
    dec = RemoteDecoder(server.base_url)
    out = dec.generate(baseline.msgs[0], max_new_tokens=MAX_NEW, prediction=_prediction(baseline.texts[0]))
    assert out.token_ids == baseline.ids[0] and out.stats.accepted_prediction_tokens >= 0.5 * MAX_NEW
    stream = dec.stream(baseline.msgs[0], max_new_tokens=MAX_NEW, prediction=_prediction(baseline.texts[0]))
    assert "".join(stream) == baseline.texts[0] and stream.output.stats.rejected_prediction_tokens is not None
    plain = dec.generate(baseline.msgs[0], max_new_tokens=MAX_NEW)
    assert plain.stats.accepted_prediction_tokens is None  # no prediction: the server does not tell


@pytest.mark.slow
def test_the_server_logs_to_its_own_temporary_file(server):
    """(Its clean shutdown is checked when the module's server fixture stops it.)"""
    log = server.log_path
    assert log.is_file() and log.name.startswith("rag-accel-serve-")
    assert server.proc.poll() is None and group_processes(server.proc.pid)


@pytest.mark.slow
def test_the_launcher_gives_vllms_cpu_backend_what_it_needs(server):
    """Issue 66: `rag-accel serve` on a CPU preloads Intel OpenMP (vllm-cpu installs it into the environment) and
    sets numba's workqueue layer, so vLLM starts without its "significant performance loss" warning, and vLLM's
    compile cache and temporary files go under RAG_ACCEL_HOME, not ~/.cache/vllm and /tmp (its workers' meeting file,
    vllm_dist_<id>, which vLLM leaves behind)."""
    import sys
    from pathlib import Path

    from rag_accel.models import cache_home

    log = server.log_path.read_text(errors="replace")
    assert "significant performance loss" not in log and "libiomp is not found in LD_PRELOAD" not in log
    assert (Path(sys.prefix) / "lib" / "libiomp5.so").is_file()  # (what it preloads: vllm-cpu's)
    first = log.splitlines()[0]  # the command it became, with the environment it set
    assert "libiomp5.so" in first and "NUMBA_THREADING_LAYER=workqueue" in first
    assert f"VLLM_CACHE_ROOT={cache_home() / 'vllm'}" in first
    if "TMPDIR" not in os.environ:  # (a TMPDIR of the user's own stays)
        assert f"TMPDIR={cache_home() / 'vllm' / 'tmp'}" in first
        assert list((cache_home() / "vllm" / "tmp").glob("vllm_dist_*"))  # (the server's own start left one there)
