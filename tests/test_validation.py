"""Hardening: bounded, typed config; request checks that happen early and say what was wrong.

Every bad request here is refused before any model work, with a ValueError/TypeError naming the
input, and the decoder stays usable. Runs on a tiny random model with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from helpers import hf_greedy, tiny_model, trained_bpe_tokenizer

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.references import encode_references

PROMPT = [5, 6, 7, 8]
# The documented bounds (rag_accel.config.MAX_*).
MAX_DRAFT_TOKENS, MAX_REFERENCE_TOKENS = 256, 16_000_000


@pytest.fixture(scope="module")
def dec(tokenizer):
    return ReferenceDecoder(tiny_model("gpt2", len(tokenizer), seed=3), tokenizer, DecoderConfig(adaptive=False))


@functools.lru_cache
def greedy(dec, n=6):
    return hf_greedy(dec.model, PROMPT, n)


def still_works(dec):
    assert dec.generate(PROMPT, max_new_tokens=6).token_ids == greedy(dec)


class CountingTokenizer:
    """The real tokenizer, counting how many texts it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, text, **kw):
        self.calls += 1
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


# ------------------------------------------------------------------ 3. config bounds
INT_FIELDS = {
    "max_draft_tokens": MAX_DRAFT_TOKENS,
    "max_reference_tokens": MAX_REFERENCE_TOKENS,
}


@pytest.mark.parametrize("name, value", [
    ("max_draft_tokens", 8192), ("max_draft_tokens", 100_000), ("max_reference_tokens", 10**12),
])
def test_config_integers_have_an_upper_bound(dec, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= \d+ and <= {INT_FIELDS[name]} \(.+\), got"):
        DecoderConfig(**{name: value})
    with pytest.raises(ValueError, match=rf"{name} must be an integer"):  # per call too, before any work
        dec.generate(PROMPT, max_new_tokens=2, config={name: value})
    still_works(dec)


def test_config_bounds_themselves_are_accepted():
    cfg = DecoderConfig(max_draft_tokens=MAX_DRAFT_TOKENS, max_reference_tokens=MAX_REFERENCE_TOKENS,
                        max_loss=1.0, cost_curve=(1.0,) * (MAX_DRAFT_TOKENS + 1))
    assert cfg.max_draft_tokens == MAX_DRAFT_TOKENS and len(cfg.cost_curve) == MAX_DRAFT_TOKENS + 1


@pytest.mark.parametrize("changes, match", [
    ({"max_loss": math.inf}, r"max_loss must be a number in \[0, 1\]"),
    ({"max_loss": math.nan}, r"max_loss must be a number in \[0, 1\]"),
    ({"max_loss": 5.0}, r"max_loss must be a number in \[0, 1\]"),
    ({"max_loss": -0.1}, r"max_loss must be a number in \[0, 1\]"),
    ({"max_loss": True}, r"max_loss must be a number"),
    ({"max_loss": "0.1"}, r"max_loss must be a number"),
    ({"adaptive": 1}, r"adaptive must be a bool"),
    ({"cost_curve": (1.0,) * (MAX_DRAFT_TOKENS + 2)}, rf"cost_curve has {MAX_DRAFT_TOKENS + 2} entries.*at most"),
    ({"cost_curve": (1.0,) * 32 + (math.inf,)}, r"cost_curve entries must be finite numbers > 0"),
    ({"cost_curve": (1.0,) * 32 + (math.nan,)}, r"cost_curve entries must be finite numbers > 0"),
    ({"cost_curve": ("1",) * 33}, r"cost_curve entries must be finite numbers > 0, got '1'"),
    ({"cost_curve": "1" * 33}, r"cost_curve must be a sequence of numbers"),
])
def test_config_floats_are_finite_and_bounded(changes, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**changes)


# ------------------------------------------------------------------ 4. checks that happened too late
@pytest.mark.parametrize("name", sorted(INT_FIELDS))
@pytest.mark.parametrize("value", [2.5, 3.0, True, "3", None])
def test_every_int_field_must_be_a_real_int(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer"):
        DecoderConfig(**{name: value})


@pytest.mark.parametrize("name", ["min_gain", "pool_misses", "reference_choice", "frequency_factor", "pack_gqa",
                                  "fast_head", "draft_confidence", "ngram_max_n", "reference_min_match"])
def test_settings_that_left_the_config_are_refused_by_name(dec, name):
    """Issue 55: the settings no user had a reason to tune are constants now; asking for one is an error that
    names it, not a silent no-op, per decoder and per call (a vLLM request's extra_args likewise)."""
    from rag_accel.wire import request_config

    with pytest.raises(TypeError, match=name):
        DecoderConfig(**{name: 1})
    with pytest.raises(ValueError, match=rf"unknown decoder option\(s\) \['{name}'\]"):
        dec.generate(PROMPT, max_new_tokens=2, config={name: 1})
    with pytest.raises(ValueError, match=rf"keys \['{name}'\] a request cannot change"):
        request_config(DecoderConfig(), {name: 1})
    still_works(dec)


def test_numpy_integers_in_the_config_become_ints():
    cfg = DecoderConfig(max_draft_tokens=np.int64(8), max_reference_tokens=np.int32(6), max_loss=np.float32(0.5))
    assert type(cfg.max_draft_tokens) is int and cfg.max_draft_tokens == 8
    assert type(cfg.max_reference_tokens) is int and type(cfg.max_loss) is float


def test_a_single_drafter_name_is_one_drafter():
    assert DecoderConfig(drafters="reference").drafters == ("reference",)
    with pytest.raises(ValueError, match="drafters must be"):
        DecoderConfig(drafters=3)


@pytest.mark.parametrize("prompt", [
    torch.tensor(PROMPT), torch.tensor([PROMPT]), torch.tensor(PROMPT, dtype=torch.int32),
    np.array(PROMPT), np.array([PROMPT], dtype=np.uint16), [np.int64(t) for t in PROMPT],
])
def test_integer_tensors_arrays_and_numpy_ids_are_prompts(dec, prompt):
    assert dec.generate(prompt, max_new_tokens=6).token_ids == greedy(dec)


@pytest.mark.parametrize("prompt, err, match", [
    (torch.tensor([5.0, 6.0]), TypeError, r"prompt is a tensor of dtype torch.float32; token ids must be integers"),
    (torch.tensor([5.7, 6.2]), TypeError, "token ids must be integers"),
    (np.array([5.0, 6.0]), TypeError, r"prompt is an array of dtype float64; token ids must be integers"),
    (torch.tensor([True, False]), TypeError, "token ids must be integers"),
    (torch.tensor([[5, 6], [7, 8]]), ValueError, r"prompt has shape \(2, 2\).*one prompt"),
    (np.ones((1, 2, 3), dtype=np.int64), ValueError, r"prompt has shape \(1, 2, 3\)"),
    (torch.tensor(5), ValueError, r"prompt has shape \(\)"),
    ([5.0, 6.0], TypeError, r"prompt: token ids must be integers, got float 5.0 at position 0"),
    ([5, np.float32(6.0)], TypeError, r"token ids must be integers, got float32 6.0 at position 1"),
    (["hello", "world"], TypeError, r"prompt must be a string, .* item 0 is str"),
    (b"hello", TypeError, r"prompt is bytes; decode it to a string first"),
])
def test_bad_tensor_and_id_prompts_are_refused(dec, prompt, err, match):
    with pytest.raises(err, match=match):
        dec.generate(prompt, max_new_tokens=2)
    still_works(dec)


def test_numpy_and_float_reference_ids(dec):
    refs = [np.array([9, 8, 7]), [np.int64(1), np.int64(2)]]
    assert dec.generate(PROMPT, refs, max_new_tokens=6).token_ids == greedy(dec)
    assert dec.encode_references(refs) == [[9, 8, 7], [1, 2]]
    with pytest.raises(TypeError, match=r"reference 1: token ids must be integers, got float 2.0 at position 1"):
        dec.generate(PROMPT, [[1], [1, 2.0]], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"reference 0 is a tensor of dtype torch.float32; token ids must be integers"):
        dec.generate(PROMPT, [torch.tensor([1.0])], max_new_tokens=2)


def test_text_certainly_over_the_limit_is_refused_without_tokenising(tokenizer):
    counting = CountingTokenizer(tokenizer)
    with pytest.raises(ValueError, match=r"references hold 1000000 characters of text: at least \d+ tokens.*"
                                         r"more than max_reference_tokens=1000"):
        encode_references(counting, ["word " * 200_000], len(tokenizer), 1000)
    assert counting.calls == 0


def test_references_are_tokenised_one_at_a_time_up_to_the_limit(tokenizer):
    counting = CountingTokenizer(tokenizer)
    doc = "hello world, this is a passage. " * 10  # ~80 tokens, far below the character bound
    with pytest.raises(ValueError, match=r"references hold at least 1\d{3} tokens, more than max_reference_tokens="):
        encode_references(counting, [doc] * 100, len(tokenizer), 1000)
    assert 0 < counting.calls < 20  # stopped as soon as the running total passed the limit


def test_a_reference_text_that_comes_back_is_tokenised_once(tokenizer):
    dec = ReferenceDecoder(tiny_model("gpt2", len(tokenizer), seed=3), tokenizer, DecoderConfig(adaptive=False))
    dec.tokenizer = counting = CountingTokenizer(tokenizer)
    passage = "the same passage, retrieved again for the next turn of a conversation. " * 4
    expected = hf_greedy(dec.model, PROMPT, 6)
    calls = counting.calls
    for _ in range(2):
        assert dec.generate(PROMPT, [passage, "another one"], max_new_tokens=6).token_ids == expected
    assert counting.calls == calls + 2  # each text once
    assert dec.reference_tokens.get(passage) == tokenizer(passage, add_special_tokens=False)["input_ids"]
    dec.reset_learning()  # a fresh process's decoder: nothing cached
    assert dec.generate(PROMPT, [passage], max_new_tokens=6).token_ids == expected
    assert counting.calls == calls + 3


def test_the_token_cache_keeps_the_latest_texts_within_its_bound():
    from rag_accel.references import TokenCache

    cache = TokenCache(max_tokens=10)
    cache.put("a", [1] * 4)
    cache.put("b", [2] * 4)
    assert cache.get("a") == [1] * 4  # now the latest used
    cache.put("c", [3] * 4)  # 12 > 10: "b", the least recently used, goes
    assert cache.get("b") is None and cache.get("a") == [1] * 4 and cache.get("c") == [3] * 4
    assert cache.tokens == 8
    cache.put("d", [4] * 11)  # more than the whole cache: not kept, nothing evicted for it
    assert cache.get("d") is None and cache.tokens == 8


@pytest.mark.parametrize("text", [
    "#" * 80_000, "\n" + " " * 100_000, "=" * 50_000, "é" * 10_000, "😀" * 5000, "漢字" * 4000,
    "word " * 10_000, "e\u0301" * 10_000,
    # SmolLM2 has no symbol for 6 control characters: they encode as nothing, and a token
    # merges across them ("#\x14" * 80: one token of 80 "#" covering 160 characters).
    "\x14" * 100_000, "#\x14" * 40_000, "a\x04" * 20_000, "\U00045678" * 1000,
])
def test_the_early_bound_never_refuses_text_that_fits(tokenizer, text):
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(encode_references(tokenizer, [text], len(tokenizer), max(n, 1))[0]) == n
    if n > 1:
        with pytest.raises(ValueError, match="max_reference_tokens"):
            encode_references(tokenizer, [text], len(tokenizer), n - 1)


def test_max_chars_per_token_only_where_it_is_certain(tokenizer):
    from tokenizers.pre_tokenizers import ByteLevel

    from rag_accel.references import _BYTE_SYMBOLS, max_chars_per_token

    assert set(_BYTE_SYMBOLS) == set(ByteLevel.alphabet())
    assert max_chars_per_token(tokenizer) == 81  # the longest SmolLM2 token: a newline and 80 spaces
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = trained_bpe_tokenizer(["some text to train on, twice", "some more text"], vocab_size=300)
    longest = max(max_chars_per_token(bpe), 1)
    assert longest == max(len(t) for t in bpe.get_vocab())
    bpe.backend_tokenizer.normalizer = normalizers.NFC()  # composes up to 4 code points into one
    assert max_chars_per_token(bpe) == 4 * longest
    bpe.backend_tokenizer.normalizer = normalizers.Strip()  # drops text: no bound
    assert max_chars_per_token(bpe) is None
    bpe.backend_tokenizer.normalizer = None
    bpe.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace: no bound
    assert max_chars_per_token(bpe) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))  # [UNK] covers a word
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=wordpiece)) is None
    assert max_chars_per_token(object()) is None  # not a fast tokenizer


# ------------------------------------------------------------------ 7. clear messages
@pytest.mark.parametrize("call, match", [
    (lambda d: d.generate("ab\ud800cd", max_new_tokens=2),
     r"prompt has an unencodable character at index 2 \(lone surrogate U\+D800\)"),
    (lambda d: d.generate([{"role": "user", "content": "hi \udc80"}], max_new_tokens=2),
     r"chat message 0 'content' has an unencodable character at index 3"),
    (lambda d: d.generate(PROMPT, ["fine", "bad\udfff"], max_new_tokens=2),
     r"reference 1 has an unencodable character at index 3"),
    (lambda d: d.generate(PROMPT, stop=["ok", "\ud83d"], max_new_tokens=2), r"stop string 1 has an unencodable"),
    (lambda d: d.generate_greedy("x\ud800", max_new_tokens=2), r"prompt has an unencodable character at index 1"),
])
def test_lone_surrogates_name_the_input_and_the_place(dec, call, match):
    with pytest.raises(ValueError, match=match):
        call(dec)
    still_works(dec)


def test_a_chat_role_no_template_knows_is_refused(dec):
    """A misspelt or invented role ("wizard") was rendered by the chat template as it pleased, or dropped."""
    with pytest.raises(ValueError, match=r"chat message 1 has the role 'wizard'; a role is one of 'system'"):
        dec.generate([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}],
                     max_new_tokens=2)
    still_works(dec)


@pytest.mark.parametrize("stop, err, match", [
    (123, TypeError, r"stop must be a string or a list of strings, got int"),
    (b"x", TypeError, r"stop must be a string or a list of strings, got bytes"),
    ([1], TypeError, r"stop string 0 must be a string, got int"),
    ("", ValueError, r"stop strings must be non-empty"),
    ([""], ValueError, r"stop strings must be non-empty"),
])
def test_bad_stops_are_clear(dec, stop, err, match):
    with pytest.raises(err, match=match):
        dec.generate(PROMPT, stop=stop, max_new_tokens=2)


def test_no_stops(dec):
    for stop in (None, [], ()):
        assert dec.generate(PROMPT, stop=stop, max_new_tokens=6).token_ids == greedy(dec)


def test_the_configuration_page_states_the_defaults_and_only_the_options():
    """docs/configuration.md's table of options is the config: the same names, the defaults it states are
    DecoderConfig()'s, and the vLLM draft tokens it names are the one constant every entry uses."""
    import dataclasses
    import re
    from pathlib import Path

    import inspect

    from rag_accel.config import VLLM_DRAFT_TOKENS
    from rag_accel.serving.serve import serve_command

    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    table = page.split("## What left")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
    cfg = DecoderConfig()
    assert set(rows) == {f.name for f in dataclasses.fields(cfg)}
    stated = {"drafters": str(cfg.drafters), "max_draft_tokens": str(cfg.max_draft_tokens),
              "adaptive": str(cfg.adaptive), "cost_curve": str(cfg.cost_curve), "max_loss": str(cfg.max_loss),
              "max_reference_tokens": f"{cfg.max_reference_tokens:,}"}
    for name, want in stated.items():
        assert want.replace("'", '"') in rows[name].replace("`", ""), (name, rows[name], want)
    assert f"`VLLM_DRAFT_TOKENS` = {VLLM_DRAFT_TOKENS}" in page
    assert inspect.signature(serve_command).parameters["max_draft_tokens"].default == VLLM_DRAFT_TOKENS


def test_the_draft_length_has_one_name_in_every_public_surface():
    """Issue 65: max_draft_tokens in the config, VllmDecoder, the command line and the result JSON; vLLM's own
    num_speculative_tokens only in the speculative_config handed to vLLM (rag_accel.vllm.requests)."""
    import ast
    import inspect
    from pathlib import Path

    from typer.testing import CliRunner

    from rag_accel.bench.harness import environment, vllm_engines
    from rag_accel.cli import app
    from rag_accel.serving.serve import serve_command, speculative_options
    from rag_accel.vllm.decoder import VllmDecoder
    from rag_accel.vllm.requests import speculative_config

    import dataclasses

    assert "max_draft_tokens" in {f.name for f in dataclasses.fields(DecoderConfig)}
    for fn in (VllmDecoder.from_pretrained, serve_command, speculative_options, speculative_config, vllm_engines,
               environment):
        assert "max_draft_tokens" in inspect.signature(fn).parameters, fn.__name__
    for command in ("serve", "bench"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--max-draft-tokens" in out and "speculative-tokens" not in out, command
    assert speculative_config("ours", 7)["num_speculative_tokens"] == 7  # (vLLM's name, in vLLM's config)
    with pytest.raises(TypeError, match="pass max_draft_tokens="):
        VllmDecoder.from_pretrained("m", num_speculative_tokens=4)
    # in the library's code (not its prose), vLLM's name is read or written only where vLLM's API has it
    root = Path(__file__).resolve().parents[1] / "rag_accel"
    users = set()
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            named = ((isinstance(node, ast.Attribute) and node.attr == "num_speculative_tokens")
                     or (isinstance(node, ast.keyword) and node.arg == "num_speculative_tokens")
                     or (isinstance(node, ast.arg) and node.arg == "num_speculative_tokens"))
            if named or (isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and
                                                            k.value == "num_speculative_tokens" for k in node.keys)):
                users.add(f.relative_to(root).as_posix())
    assert users == {"vllm/requests.py", "vllm/proposer.py"}, users
