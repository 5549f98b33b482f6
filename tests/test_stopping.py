"""Stop strings across chunks and incremental detokenisation with the real tokenizer."""

from __future__ import annotations

from rag_accel.stopping import IncrementalDetokenizer, StopStringMatcher


def test_stop_string_split_across_chunks_is_held_back_then_cut():
    m = StopStringMatcher(["</end>"])
    assert m.feed("answer </") == (None, len("answer "))
    assert m.feed("en") == (None, len("answer "))
    assert m.feed("d> tail") == (len("answer "), len("answer "))


def test_false_start_is_released():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("a\n") == (None, 1)
    assert m.feed("b") == (None, 3)


def test_first_of_several_stops_wins():
    m = StopStringMatcher(["XY", "B"])
    assert m.feed("aBcXY") == (1, 1)


def test_no_stops_releases_everything():
    assert StopStringMatcher([]).feed("abc") == (None, 3)


def test_incremental_detokenizer_concatenates_to_decode(tokenizer):
    text = "Café – naïve 東京 🚀 emoji, and\n\nnew paragraphs."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert all("\ufffd" not in p for p in pieces)
