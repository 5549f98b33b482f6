"""One surface for every decoder (rag_accel.protocol): the same methods and options, one sampling rule."""

from __future__ import annotations

import inspect

import pytest

from helpers import hf_greedy, tiny_model
from rag_accel import ReferenceDecoder
from rag_accel.protocol import CALL_OPTIONS, Decoder, batch_arguments, call_config, sampling_request
from rag_accel.serving.remote import RemoteDecoder
from rag_accel.vllm.decoder import VllmDecoder

DECODERS = (ReferenceDecoder, VllmDecoder, RemoteDecoder)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.__name__)
def test_every_decoder_has_the_surface_with_the_same_options_and_defaults(cls):
    for name in ("generate", "stream", "generate_batch", "generate_greedy", "encode_prompt", "close"):
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}"
    for method in ("generate", "stream", "generate_batch"):  # the options, declared once: **options
        params = inspect.signature(getattr(cls, method)).parameters
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD, (cls.__name__, method)
        assert params["options"].annotation == "Unpack[CallOptions]", (cls.__name__, method)
        assert not set(params) & set(CALL_OPTIONS), (cls.__name__, method, "spells out an option again")
    greedy = inspect.signature(cls.generate_greedy).parameters
    assert {"max_new_tokens", "stop"} <= set(greedy)


def test_a_calls_options_are_declared_once_and_checked_once():
    """Issue 65: CallOptions is the one declaration (CALL_OPTIONS holds its defaults); Request.of checks a call
    where it enters, and no internal hop of any decoder takes the options one by one again."""
    import ast
    from pathlib import Path

    from rag_accel.protocol import CallOptions, Request

    assert set(CallOptions.__annotations__) == set(CALL_OPTIONS)
    req = Request.of("q", ["r"], {"stop": ["\n\n"], "do_sample": True, "seed": 3, "max_new_tokens": 9})
    assert (req.stops, req.sampling, req.max_new_tokens, req.speculate) == (["\n\n"], {"seed": 3}, 9, True)
    with pytest.raises(TypeError, match="this call's name is references"):
        Request.of("q", None, {"documents": ["r"]})
    with pytest.raises(TypeError, match="speculate must be a bool"):
        Request.of("q", None, {"speculate": "no"})
    with pytest.raises(ValueError, match="only apply to sampling"):
        Request.of("q", None, {"temperature": 0.5})
    root = Path(__file__).resolve().parents[1] / "rag_accel"
    spelled = []
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
                # (the sampling rule takes its own five arguments; generate_greedy takes max_new_tokens and stop)
                if len(names & (set(CALL_OPTIONS) - {"do_sample", "temperature", "top_k", "top_p", "seed"})) >= 3:
                    spelled.append(f"{f.relative_to(root)}:{node.lineno} {node.name}")
    assert spelled == [], spelled


def test_the_rule_for_sampling_arguments():
    assert sampling_request(False) is None
    assert sampling_request(True) == {}  # nothing given: the model's generation config decides
    assert sampling_request(True, temperature=0.5, seed=3) == {"temperature": 0.5, "seed": 3}
    with pytest.raises(ValueError, match="only apply to sampling"):
        sampling_request(False, top_p=0.9)
    with pytest.raises(TypeError, match="do_sample"):
        sampling_request("yes")


def test_batch_arguments_and_a_calls_config_are_checked_before_any_work():
    from rag_accel import DecoderConfig

    with pytest.raises(TypeError, match="list of prompts"):
        batch_arguments("one prompt", None, {})
    with pytest.raises(ValueError, match="2 prompts but 1"):
        batch_arguments(["a", "b"], [["r"]], {})
    with pytest.raises(TypeError, match="unexpected keyword"):
        batch_arguments(["a"], None, {"max_tokens": 3})
    base = DecoderConfig(max_loss=0.2)
    assert call_config(None, base) is base
    assert call_config(DecoderConfig(max_loss=0.1), base) == DecoderConfig(max_loss=0.1)  # whole, as given
    assert call_config({"drafters": ("reference",)}, base) == base.replace(drafters=("reference",))
    for bad, error in (({"max_loss": 7}, ValueError), ({"frequency_factor": 2}, ValueError), ("fast", TypeError)):
        with pytest.raises(error):
            call_config(bad, base)


def test_the_in_process_decoder_is_a_decoder_and_its_batch_and_speculate_off_are_greedy(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer), seed=2)
    dec = ReferenceDecoder(model, tokenizer)
    assert isinstance(dec, Decoder)
    prompts = [list(range(5, 30)), list(range(40, 52))]
    want = [hf_greedy(model, p, 12) for p in prompts]
    outs = dec.generate_batch(prompts, [[w[2:]] for w in want], max_new_tokens=12)
    assert [o.token_ids for o in outs] == want and outs[0].stats.accepted > 0
    off = dec.generate(prompts[0], [want[0][2:]], max_new_tokens=12, speculate=False)
    assert off.token_ids == want[0] and off.stats.drafted == 0
    with pytest.raises(TypeError, match="speculate"):
        dec.generate(prompts[0], speculate="no")
    with pytest.raises(TypeError, match="unexpected keyword"):  # checked before any request runs
        dec.generate_batch(prompts, max_tokens=3)
    dec.close()


def test_the_remote_decoder_encodes_token_ids_without_the_server():
    dec = RemoteDecoder("http://127.0.0.1:9", model="m")  # nothing listens there: nothing may be sent
    assert dec.encode_prompt([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(ValueError, match="empty prompt"):
        dec.encode_prompt([])


def test_the_remote_decoder_sends_its_memory_scope_and_refuses_a_bad_one():
    """``memory_scope`` travels in every request's ``vllm_xargs``, as the server reads it; a bad one
    is refused when the client is made, as the server would refuse each request (HTTP 400)."""
    from rag_accel.adapters import adapter_engine
    from rag_accel.protocol import Request
    from rag_accel.wire import RequestArgs

    dec = RemoteDecoder("http://127.0.0.1:9", model="m", memory_scope="tenant-7")  # nothing listens: nothing sent
    for prompt in ("hi", [{"role": "user", "content": "q"}], [5, 6]):
        call = dec._call(Request.of(prompt, ["text"], {"max_new_tokens": 4}))
        assert RequestArgs.read(call.kwargs["extra_body"]["vllm_xargs"]).memory_scope == "tenant-7"
    none = RemoteDecoder("http://127.0.0.1:9", model="m")._call(Request.of("hi", None, {"max_new_tokens": 4}))
    assert "memory_scope" not in none.kwargs["extra_body"]["vllm_xargs"]  # the server's default, if any
    for bad, match in (("", "0 characters"), ("x" * 257, "257 characters"), (7, "int")):
        with pytest.raises(ValueError, match=f"memory_scope must be a string of 1 to 256 characters, got {match}"):
            RemoteDecoder("http://127.0.0.1:9", model="m", memory_scope=bad)
    remote = adapter_engine("m", base_url="http://127.0.0.1:9/v1", memory_scope="tenant-8")  # the adapters' way
    assert isinstance(remote, RemoteDecoder) and remote.memory_scope == "tenant-8"
    with pytest.raises(ValueError, match="the transformers backend has none"):
        adapter_engine("m", memory_scope="tenant-8")
