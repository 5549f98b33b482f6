"""One reference set-up for both engines (rag_accel/references.py): one limit rule, one threshold, one component.

The transformers decoder's call checks, the vLLM server's admission and the set-up both engines run (tokenise,
count, index) apply the same rule to the same text with the same tokenizer: refused before any tokenising only
when certainly over the limit, counted exactly when tokenised.
"""

import threading

import pytest

from rag_accel.references import TokenCache, certain_tokens, check_references, text_bound
from rag_accel.references import WAITED_REFERENCE_SIZE, ReferenceSetUp
from rag_accel.serving.serve import model_text_bound
from rag_accel.vllm.requests import ServerSettings, check_extra_args, encode_text_bound

LIMIT = 2000
TEXTS = {
    "prose, certainly over": "word " * 40_000,  # 200,000 characters: over even at 81 characters a token
    "prose, over once tokenised": "word " * 3000,  # 3,000 tokens; 15,000 characters prove nothing
    "indented code": ("    " * 8 + "x\n") * 600,  # 20,400 characters, 1,202 tokens: fits
    "a run of spaces": " " * 20_000,  # 313 tokens: fits (a token per 8 characters refused it)
    "a short passage": "The cost of a flea treatment varies. " * 10,
}


def _refused(check) -> bool:
    try:
        check()
    except ValueError:
        return True
    return False


@pytest.fixture
def served_bound(default_model_dir, monkeypatch):
    """The admission's environment as `rag-accel serve --max-reference-tokens LIMIT` sets it for SmolLM2."""
    bound = model_text_bound(default_model_dir)
    assert bound is not None
    monkeypatch.setenv(*ServerSettings(max_reference_tokens=LIMIT, text_bound=bound).environment().popitem())
    return bound


def test_serve_hands_the_tokenizers_bound_to_admission(tokenizer, served_bound):
    assert ServerSettings.current().bound[0] == text_bound(tokenizer)[0] == 81
    assert encode_text_bound(ServerSettings.current().bound) == served_bound  # read back as written
    assert ServerSettings.current().bound[1].pattern == text_bound(tokenizer)[1].pattern


@pytest.mark.parametrize("name", list(TEXTS))
def test_one_limit_rule_on_both_engines(tokenizer, served_bound, name):
    """Before tokenising, the server's admission and the in-process call refuse the same texts: those
    certainly over the limit, never one that fits; the set-up both engines run counts the rest exactly."""
    text = TEXTS[name]
    exact = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    at_admission = _refused(lambda: check_extra_args({"references": [text]}))
    in_process = _refused(lambda: check_references(tokenizer, [text], len(tokenizer), LIMIT))
    assert at_admission == in_process
    assert not at_admission or exact > LIMIT  # never refuses what fits
    assert at_admission == (name == "prose, certainly over")
    setup = ReferenceSetUp([text], [], lambda: tokenizer, LIMIT)
    setup.run()
    if exact > LIMIT:
        with pytest.raises(ValueError, match=f"more than max_reference_tokens={LIMIT}"):
            setup.take()
    else:
        assert [d.name for d in setup.take()] == ["reference"]


def test_references_and_answers_count_together(tokenizer, served_bound):
    half = "word " * (LIMIT // 2 + 100)  # each under the limit, together over it
    setup = ReferenceSetUp([half], [half], lambda: tokenizer, LIMIT)
    setup.run()
    with pytest.raises(ValueError, match="more than max_reference_tokens"):
        setup.take()
    assert setup.take() == []  # raised once
    big = "word " * 20_000  # certainly over together (2 x 1,235 tokens at least), neither alone
    assert certain_tokens([big], ServerSettings.current().bound) < LIMIT
    with pytest.raises(ValueError, match="hold over"):
        check_extra_args({"references": [big], "answers": [big]})


def test_the_threshold_is_one_size_in_one_unit():
    ids = [[1] * (WAITED_REFERENCE_SIZE - 10)]
    assert ReferenceSetUp(ids, ["x" * 10], None, 10**6).waited
    assert not ReferenceSetUp(ids, ["x" * 11], None, 10**6).waited


def test_the_set_up_tokenises_each_text_once_through_the_cache(tokenizer):
    calls = []

    def counting():
        calls.append(1)
        return tokenizer

    cache = TokenCache()
    passage = "A passage retrieved again for the next question. " * 3
    for _ in range(2):
        setup = ReferenceSetUp([passage], [[5, 6, 7, 8]], counting, LIMIT, cache)
        setup.run()
        assert [d.name for d in setup.take()] == ["reference", "memory"]
    assert cache.get(passage) == tokenizer(passage, add_special_tokens=False)["input_ids"]
    assert cache.tokens == len(cache.get(passage))


def test_a_stopped_set_up_hands_over_no_drafters(tokenizer):
    """A request that ends (or leaves vLLM's batch) before its references are indexed stops their set-up."""
    started, release = threading.Event(), threading.Event()

    class Slow:
        def __call__(self, text, **kwargs):
            started.set()
            release.wait(5)
            return tokenizer(text, **kwargs)

    setup = ReferenceSetUp(["first passage", "second passage"], [], Slow, LIMIT)
    worker = threading.Thread(target=setup.run)
    worker.start()
    started.wait(5)
    assert setup.take() is None and not setup.done  # not ready: nothing to take, nothing waited for
    setup.stop()
    release.set()
    worker.join(5)
    assert setup.done and setup.take() == []


def test_a_text_reference_without_a_tokenizer_is_an_error_the_engine_sees():
    setup = ReferenceSetUp(["text"], [], None, LIMIT)
    setup.run()
    with pytest.raises(TypeError):
        setup.take()


def test_one_string_is_one_reference_on_every_way_in(tokenizer):
    """Issue 66: a single string as ``references`` means one reference (documented in ``stream`` and in
    ``ServerSettings.read``), never its characters nor nothing: in process, in ``vllm_xargs``, and drafted from."""
    from helpers import hf_greedy, tiny_model

    from rag_accel import ReferenceDecoder

    text = "the quick brown fox jumps over the lazy dog"
    assert check_references(tokenizer, text, len(tokenizer), 1000) == [text]
    read = ServerSettings.current().read
    assert read({"references": text}).references == (text,) == read({"references": [text]}).references
    model = tiny_model("llama", vocab_size=len(tokenizer))
    prompt = tokenizer(text)["input_ids"][:3]
    want = hf_greedy(model, prompt, 12)
    dec = ReferenceDecoder(model, tokenizer)
    answer = tokenizer.decode(want)
    one = dec.generate(prompt, references=answer, max_new_tokens=12)
    dec.reset_learning()  # (the second request starts from what the first did: a fresh decoder's state)
    listed = dec.generate(prompt, references=[answer], max_new_tokens=12)
    assert one.token_ids == listed.token_ids == want
    assert one.stats.by_drafter.get("reference") == listed.stats.by_drafter.get("reference")


def test_the_server_settings_travel_as_one_checked_variable(monkeypatch):
    """Issue 65: what rag-accel serve decides for the whole server is one typed object, read back in the server's
    processes from one variable; a damaged one is refused with its name, not read as defaults."""
    from rag_accel.vllm.requests import SETTINGS_ENV

    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    assert ServerSettings.current() == ServerSettings()  # an engine in process: the defaults
    settings = ServerSettings(max_reference_tokens=50, answer_memory_tokens=0, memory_scope="t", vocab_size=7,
                              text_bound=(5, "[\\x00]"))
    monkeypatch.setenv(*settings.environment().popitem())
    assert ServerSettings.current() == settings and ServerSettings.current().bound[1].pattern == "[\\x00]"
    with pytest.raises(ValueError, match="memory_scope must be a string of 1 to 256"):
        ServerSettings(memory_scope="")
    with pytest.raises(ValueError, match="max_reference_tokens must be an int >= 1"):
        ServerSettings(max_reference_tokens=0)
    for bad, why in (("{", "not JSON"), ('{"version": 2}', "version 1"),
                     ('{"version": 1, "max_draft": 3}', "unknown settings")):
        monkeypatch.setenv(SETTINGS_ENV, bad)
        with pytest.raises(ValueError, match=why):
            ServerSettings.current()
