"""Stop strings (also spanning verify steps), streaming, and EOS with the real tokenizer."""

from __future__ import annotations

import pytest
from helpers import OracleDrafter, hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = tiny_model("llama", len(tokenizer), seed=11)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8))
    prompt = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    want = hf_greedy(model, prompt, 40)
    text = tokenizer.decode(want, skip_special_tokens=True)
    return dec, prompt, want, text


def _token_end_offsets(tokenizer, ids):
    return [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]


@pytest.mark.parametrize("drafts", ["none", "right"])
def test_stop_string_spanning_tokens_and_steps(setup, tokenizer, drafts):
    dec, prompt, want, text = setup
    ends = _token_end_offsets(tokenizer, want)
    # a stop string made of the last 2 characters of token 9 and the first 2 of token 10
    cut = ends[9]
    stop = text[cut - 2: cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2, "pick a unique span for this seed"
    drafters = None if drafts == "none" else [OracleDrafter(want, len(prompt), "right", dec.vocab_size)]
    stream = dec.stream(prompt, max_new_tokens=40, stop=["NEVER", stop], drafters=drafters)
    pieces = list(stream)
    out = stream.output
    assert out.text == text[: cut - 2]
    assert "".join(pieces) == out.text
    assert out.finish_reason == "stop"
    # ids end with the token that completed the stop string, as generate(stop_strings=...) does
    assert out.token_ids == want[: next(i for i, e in enumerate(ends) if e >= cut + 2) + 1]


def test_stream_concatenation_equals_text_without_stops(setup):
    dec, prompt, want, text = setup
    stream = dec.stream(prompt, max_new_tokens=40, references=[want])
    pieces = list(stream)
    assert "".join(pieces) == stream.output.text == text
    assert stream.output.token_ids == want
    assert len(pieces) > 1


def test_stop_string_at_the_very_start(setup):
    dec, prompt, want, text = setup
    out = dec.generate(prompt, max_new_tokens=40, stop=text[:3])
    assert out.text == "" and out.finish_reason == "stop"


def test_abandoned_stream_releases_the_model(setup):
    dec, prompt, want, text = setup
    stream = dec.stream(prompt, max_new_tokens=40)
    next(iter(stream))
    stream.close()
    assert dec.generate(prompt, max_new_tokens=5).token_ids == want[:5]


def test_generate_greedy_is_the_baseline_with_the_same_output_shape(setup, tokenizer):
    """generate_greedy() is model.generate(do_sample=False); with the same stop it ends where ours ends."""
    dec, prompt, want, text = setup
    plain = dec.generate_greedy(prompt, max_new_tokens=40)
    assert plain.token_ids == want
    assert plain.stats.steps == plain.stats.new_tokens == 40
    assert plain.finish_reason == "length" and plain.text == text
    ends = _token_end_offsets(tokenizer, want)
    stop = text[ends[11] - 3: ends[12]]  # ends inside token 12
    assert text.find(stop) == ends[11] - 3
    plain = dec.generate_greedy(prompt, max_new_tokens=40, stop=stop)
    ours = dec.generate(prompt, max_new_tokens=40, stop=stop)
    assert plain.finish_reason == ours.finish_reason == "stop"
    assert plain.token_ids == ours.token_ids == want[:13]
    assert plain.text == ours.text == text[: ends[11] - 3]
    with pytest.raises(ValueError, match="stop strings"):
        dec.generate_greedy(prompt, stop=[""])


def test_steps_split_the_output_by_forward_pass(setup):
    dec, prompt, want, text = setup
    out = dec.generate(prompt, max_new_tokens=40,
                       drafters=[OracleDrafter(want, len(prompt), "mix", dec.vocab_size, seed=3)])
    steps = out.steps()
    assert [t for _, tokens in steps for t in tokens] == out.token_ids == want
    assert len(steps) == out.stats.steps
    assert steps[0] == ("", want[:1])  # prefill produces one token
    assert {s for s, _ in steps[1:]} <= {"oracle", ""}
    assert sum(len(t) - 1 for s, t in steps[1:]) == out.stats.accepted  # each step: accepted + 1 own token


def test_reprs_stay_one_short_line(setup):
    dec, prompt, want, text = setup
    out = dec.generate(prompt, max_new_tokens=40,
                       drafters=[OracleDrafter(want, len(prompt), "mix", dec.vocab_size, seed=3)])
    r = repr(out)
    assert "\n" not in r and len(r) < 600, r  # not the whole per-step trace nor every token id
    assert f"token_ids=<{len(out.token_ids)} ids>" in r and f"trace=<{out.stats.steps} steps>" in r
    assert f"new_tokens={out.stats.new_tokens}" in repr(out.stats) and "tokens_per_step=" in repr(out.stats)
    assert len(out.stats.trace) == out.stats.steps  # the trace itself is all there


def test_copy_spans_locate_copied_runs_and_render(setup, tokenizer):
    from rag_accel import ReferenceDrafter
    from rag_accel.viz import copy_spans, steps_html

    dec, prompt, want, text = setup
    refs = [[7, 8, 9, 10], want[10:35]]  # the second one holds a stretch of the answer
    out = dec.generate(prompt, max_new_tokens=40, drafters=[ReferenceDrafter(refs, min_match=2)])
    assert out.token_ids == want
    spans = copy_spans(out, refs)
    copied = [s for s in spans if s.copied]
    assert copied and all(s.source == "reference" and s.passage == 1 for s in copied)
    assert [t for s in spans for t in s.tokens] == want
    page = steps_html(out, tokenizer, [tokenizer.decode(r) for r in refs])
    assert 'title="' in page and 'id="passage-2"' in page and "tokens/step" in page
    # the legend names the drafters whose tokens were accepted, in their colours (it once listed a fixed set that
    # had lost the frequency drafter and kept one the library no longer has by default)
    legend = page.split("by drafter ")[1].split("; unhighlighted")[0]
    assert ">reference</span>" in legend and "frequency" not in legend and "prompt_lookup" not in legend
