"""A request's JSON form (issue 65): one versioned schema, written in process (``extra_args``) and over HTTP
(``vllm_xargs``), read back to the same request both ways; engine-free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rag_accel import DecoderConfig
from rag_accel.protocol import Request
from rag_accel.serving.remote import RemoteDecoder
from rag_accel.vllm.requests import ServerSettings, check_extra_args
from rag_accel.wire import SCHEMA_KEY, SCHEMA_KEYS, SCHEMA_VERSION, WORKER_BASE, RequestArgs

REQUESTS = [
    RequestArgs(),
    RequestArgs(("a passage",)),
    RequestArgs(((1, 2, 3),), speculate=False),
    RequestArgs(("text", (5, 6), "more text", (7,)), ("an earlier answer", (8, 9)),
                config=WORKER_BASE.replace(drafters=("reference",), max_loss=0.1, max_draft_tokens=4),
                memory_scope="tenant-1"),
    RequestArgs(answers=((1,),), config=WORKER_BASE.replace(adaptive=False, max_reference_tokens=100)),
]


def _json_values_only(xargs: dict) -> bool:
    """What vLLM's OpenAI server takes in ``vllm_xargs``: strings, numbers, booleans, flat lists of them."""
    scalar = (str, int, float, bool)
    return all(isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))
               for v in xargs.values())


@pytest.mark.parametrize("args", REQUESTS)
def test_a_request_reads_back_as_it_was_written_in_process_and_over_http(args):
    in_process = args.extra_args()
    http = json.loads(json.dumps(args.extra_args(http=True)))  # as it crosses the wire
    assert _json_values_only(http), http
    assert in_process[SCHEMA_KEY] == http[SCHEMA_KEY] == SCHEMA_VERSION
    assert set(in_process) <= SCHEMA_KEYS and set(http) <= SCHEMA_KEYS
    assert RequestArgs.read(in_process) == args
    # over HTTP a list holds strings or ids, not both: the texts travel first, then the ids
    texts_first = {k: tuple(sorted(getattr(args, k), key=lambda r: not isinstance(r, str)))
                   for k in ("references", "answers")}
    assert RequestArgs.read(http) == dataclasses.replace(args, **texts_first)


def test_the_schema_is_pinned_so_a_change_must_bump_its_version():
    """Version 1's HTTP form, written out: a change to the form without a new SCHEMA_VERSION fails here."""
    args = RequestArgs(("a", (1, 2)), ("b",), False, WORKER_BASE.replace(max_loss=0.1), "t")
    assert SCHEMA_VERSION == 1
    assert args.extra_args(http=True) == {
        "rag_accel_schema": 1, "speculate": False, "references": ["a"], "reference_ids": "[[1,2]]",
        "answers": ["b"], "rag_accel": '{"max_loss":0.1}', "memory_scope": "t"}
    assert args.extra_args() == {"rag_accel_schema": 1, "speculate": False, "references": ["a", [1, 2]],
                                 "answers": ["b"], "rag_accel": {"max_loss": 0.1}, "memory_scope": "t"}


def test_a_request_of_another_schema_or_with_a_misspelt_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"extra_args\['rag_accel_schema'\] is 2: this server reads rag_accel's "
                                         r"request schema 1"):
        check_extra_args({SCHEMA_KEY: 2, "references": ["a"]})
    for typo, ours in (("refrences", "references"), ("reference", "references"), ("answer_id", "answer_ids"),
                       ("memory-scope", "memory_scope")):
        with pytest.raises(ValueError, match=f"did you mean '{ours}'"):
            check_extra_args({typo: ["a"]})
    check_extra_args({"another_plugins_key": 1, "references": ["a"]})  # not ours, not near ours: passes
    assert RequestArgs.read({"references": ["a"]}) == RequestArgs(("a",))  # hand-written, no version: version 1


def test_what_a_request_cannot_carry_is_refused_when_it_is_built():
    with pytest.raises(ValueError, match=r"config has keys \['cost_curve'\] a request cannot change"):
        RequestArgs(config=WORKER_BASE.replace(max_draft_tokens=2, cost_curve=(1.0, 1.1, 1.2)))
    with pytest.raises(ValueError, match="no draft model"):
        RequestArgs(config=WORKER_BASE.replace(drafters=("draft_model",)))
    with pytest.raises(ValueError, match=r"keys \['cost_curve'\] a request cannot change"):
        RequestArgs.read({"rag_accel": {"cost_curve": [1.0, 1.1]}})


def test_a_server_reads_a_request_under_its_settings():
    settings = ServerSettings(max_reference_tokens=4, memory_scope="default-scope")
    assert settings.read({"references": [[1, 2]]}).memory_scope == "default-scope"
    assert settings.read({"references": [[1, 2]], "memory_scope": "mine"}).memory_scope == "mine"
    with pytest.raises(ValueError, match="over 4 tokens"):
        settings.read({"references": [[1, 2, 3, 4, 5]]})
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        settings.read({"reference_ids": "[[1, 99]]"}, vocab_size=50)


def test_the_http_client_writes_the_schema():
    """RemoteDecoder's body: the request's RequestArgs in the HTTP form (a dict config applies to the server's
    base, a DecoderConfig travels as its differences from it), nothing sent."""
    dec = RemoteDecoder("http://127.0.0.1:9", model="m", memory_scope="tenant-3")  # nothing listens there
    for config, want in (({"max_loss": 0.2}, WORKER_BASE.replace(max_loss=0.2)),
                         (DecoderConfig(drafters=("reference",)), WORKER_BASE.replace(drafters=("reference",)))):
        call = dec._call(Request.of("q", ["text", [1, 2], ""], {"max_new_tokens": 8, "config": config,
                                                                "answers": ["before"], "speculate": False}))
        xargs = call.kwargs["extra_body"]["vllm_xargs"]
        assert xargs == RequestArgs(("text", (1, 2)), ("before",), False, want, "tenant-3").extra_args(http=True)


def test_a_request_builds_its_config_once_in_each_process_it_enters(monkeypatch):
    """Issue 65: the client builds the call's DecoderConfig once, a server process once as it reads the request;
    nothing in between rebuilds it."""
    builds = []
    original = DecoderConfig.__post_init__

    def counted(self):
        builds.append(self)
        original(self)

    monkeypatch.setattr(DecoderConfig, "__post_init__", counted)
    dec = RemoteDecoder("http://127.0.0.1:9", model="m")  # nothing listens there: nothing is sent
    call = dec._call(Request.of("q", ["text"], {"max_new_tokens": 8, "config": {"max_loss": 0.2}}))
    assert len(builds) == 1  # the client
    args = ServerSettings.current().read(call.kwargs["extra_body"]["vllm_xargs"])
    assert len(builds) == 2 and args.config == builds[-1] == WORKER_BASE.replace(max_loss=0.2)  # the server
