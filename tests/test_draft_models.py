"""Draft-model drafters: greedy output ids equal model.generate(do_sample=False) exactly, for a
draft model with the same tokenizer and one with a different tokenizer (universal drafting),
with drafts that are always right and mostly wrong, on several architectures and on the real
model; the window policy; errors."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import hf_greedy, permuted_pair, tiny_model, trained_bpe_tokenizer

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import draft_models
from rag_accel.hf.draft_models import ModelDrafter, UniversalDrafter
from rag_accel.policy import DraftLengthPolicy

MAX_NEW = 32
FIXED = DecoderConfig(adaptive=False, max_draft_tokens=6, drafters=("draft_model",))


@pytest.fixture
def whole_windows(monkeypatch):
    """The decoder's draft models draft their whole window here (no confidence cut: DRAFT_CONFIDENCE 0), so
    that right and wrong drafts are long."""
    monkeypatch.setattr(draft_models, "DRAFT_CONFIDENCE", 0.0)


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("mode", ["right", "wrong"])
@pytest.mark.usefixtures("whole_windows")
def test_same_tokenizer_draft_model_is_exact(tokenizer, arch, mode):
    target = tiny_model(arch, len(tokenizer), seed=0)
    # "right": the target drafting for itself; "wrong": another random model of the same vocabulary.
    draft = target if mode == "right" else tiny_model("llama", len(tokenizer), seed=11)
    dec = ReferenceDecoder(target, tokenizer, FIXED, draft_model=draft)
    for prompt in _prompts(4, len(tokenizer), seed=3):
        want = hf_greedy(target, prompt, MAX_NEW)
        out = dec.generate(prompt, max_new_tokens=MAX_NEW)
        assert out.token_ids == want
        s = out.stats.by_drafter["draft_model"]
        if mode == "right":
            assert s["accepted"] == s["drafted"] > 0
            assert out.stats.steps < MAX_NEW // 3
        else:
            assert s["accepted"] < s["drafted"] // 4


def test_draft_model_cache_rolls_back_and_restarts_per_request(tokenizer):
    target = tiny_model("llama", len(tokenizer), seed=0)
    drafter = ModelDrafter(target, confidence=0.0)
    prompt = [5, 6, 7, 8]
    context = list(prompt)
    d = drafter.propose(context, 4)
    assert len(d.tokens) == 4 and drafter._cached == prompt + d.tokens[:3]
    context.extend(d.tokens[:1] + [9])  # one accepted, then a different token
    d2 = drafter.propose(context, 2)
    assert drafter._cached[:len(context)] == context  # the rejected tail was replaced
    # The same drafter on a new request (a new context list) starts over.
    fresh = ModelDrafter(target, confidence=0.0)
    assert drafter.propose([1, 2, 3], 3).tokens == fresh.propose([1, 2, 3], 3).tokens
    assert d2.tokens == ModelDrafter(target, confidence=0.0).propose(list(context), 2).tokens


@pytest.mark.usefixtures("whole_windows")
def test_a_draft_model_with_a_shorter_context_window_stops_drafting(tokenizer):
    """A GPT-2 draft with 48 positions for a target with 1024: drafting ends where the draft's window does."""
    from transformers import AutoModelForCausalLM, GPT2Config

    target = tiny_model("llama", len(tokenizer), seed=0)
    torch.manual_seed(0)
    short = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=48,
                                                        vocab_size=len(tokenizer))).eval()
    dec = ReferenceDecoder(target, tokenizer, FIXED, draft_model=short)
    prompt = _prompts(1, len(tokenizer), seed=9)[0][:30]
    out = dec.generate(prompt, max_new_tokens=40)
    assert out.token_ids == hf_greedy(target, prompt, 40)
    assert out.stats.drafted > 0
    done = 0  # tokens generated before each step; the draft model drafts only while the context fits in 48
    for source, n in out.stats.trace:
        if source == "draft_model":
            assert len(prompt) + done < 48
        done += n
    assert out.stats.trace[-1][0] == ""


def test_confidence_stops_the_draft_early(tokenizer):
    target = tiny_model("llama", len(tokenizer), seed=0)  # a random model: every probability is tiny
    assert len(ModelDrafter(target, confidence=0.5).propose([1, 2, 3], 6).tokens) == 1
    assert len(ModelDrafter(target, confidence=0.0).propose([1, 2, 3], 6).tokens) == 6


@pytest.fixture(scope="module")
def bpe(tokenizer):
    from rag_accel.rag.msmarco import load_msmarco_sample

    texts = [p for it in load_msmarco_sample(limit=40) for p in it.passages]
    return trained_bpe_tokenizer(texts, vocab_size=800)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.usefixtures("whole_windows")
def test_universal_draft_model_with_another_vocabulary_is_exact(tokenizer, bpe, arch):
    target = tiny_model(arch, len(tokenizer), seed=0)
    draft = tiny_model("llama", len(bpe), seed=2)
    dec = ReferenceDecoder(target, tokenizer, FIXED, draft_model=draft, draft_tokenizer=bpe)
    prompts = [tokenizer(t)["input_ids"] for t in ("The capital of France is", "Passages about the ocean: ")]
    drafted = 0
    for prompt in prompts + _prompts(2, len(tokenizer), seed=4):
        want = hf_greedy(target, prompt, MAX_NEW)
        out = dec.generate(prompt, max_new_tokens=MAX_NEW)
        assert out.token_ids == want
        drafted += out.stats.drafted
    assert dec._universal and drafted > 0  # drafts made it through the text round trip and were verified


def test_universal_drafting_keeps_a_right_draft_right(real_decoder):
    """Real SmolLM2 and its copy with shuffled vocabulary ids: the draft's text is the model's own,
    so after the round trip through text the drafts are (almost) all accepted."""
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    other, other_tok = permuted_pair(real_decoder.model, real_decoder.tokenizer)
    dec = ReferenceDecoder(real_decoder.model, real_decoder.tokenizer,
                           DecoderConfig(adaptive=False, max_draft_tokens=8, drafters=("draft_model",)),
                           draft_model=other, draft_tokenizer=other_tok)
    assert dec._universal
    item = load_msmarco_sample(limit=1)[0]
    prompt = dec.encode_prompt(rag_messages(item.query, item.passages))
    want = real_decoder.generate_greedy(prompt, max_new_tokens=48).token_ids
    out = dec.generate(prompt, max_new_tokens=48)
    assert out.token_ids == want
    s = out.stats.by_drafter["draft_model"]
    assert s["accepted"] >= 0.8 * s["drafted"] and out.stats.tokens_per_step > 3


def test_real_model_with_int8_draft_and_hybrid_is_exact(real_decoder):
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.models import int8_draft_model

    dec = ReferenceDecoder(real_decoder.model, real_decoder.tokenizer, draft_model=int8_draft_model(real_decoder.model))
    for item in load_msmarco_sample(with_answers=True, limit=1):
        prompt = dec.encode_prompt(rag_messages(item.query, item.passages))
        want = real_decoder.generate_greedy(prompt, max_new_tokens=40).token_ids
        only = dec.generate(prompt, max_new_tokens=40, config={"drafters": ("draft_model",), "adaptive": False})
        hybrid = dec.generate(prompt, references=item.passages, max_new_tokens=40)  # the default chain + draft model
        assert only.token_ids == want and hybrid.token_ids == want
        assert only.stats.by_drafter["draft_model"]["accepted"] > 0
    # Sampling with the int8 draft: the seeded output is the model's own, draft or not.
    sample = dict(max_new_tokens=24, do_sample=True, seed=5, temperature=0.7, top_p=0.9)
    drafted = dec.generate(prompt, config={"drafters": ("draft_model",), "adaptive": False}, **sample)
    assert drafted.token_ids == real_decoder.generate(prompt, config={"drafters": ()}, **sample).token_ids
    assert drafted.stats.by_drafter["draft_model"]["accepted"] > 0


def test_window_policy():
    curve = [1.0 + 0.05 * i for i in range(17)]
    pol = DraftLengthPolicy(curve)
    # never observed: priced at the cold rates of a draft without copy evidence (0.5 a token): 1 token pays
    assert pol.model_window("draft_model", 0.25, 16) == 1
    assert pol.model_window("draft_model", None, 16) == 4  # cost not measured yet
    # ... but not when its first ask must catch up on a prompt of 24 plain steps for a 64-token answer
    assert pol.model_window("draft_model", 0.25, 16, catch_up=24.0, remaining=64) == 0
    assert pol.model_window("draft_model", 0.25, 16, catch_up=24.0, remaining=100_000) == 1
    from rag_accel.drafters import Draft

    d = Draft(list(range(8)), 0, "draft_model")
    for _ in range(30):  # always right: a longer window pays
        pol.observe(d, list(range(8)) + [99])
    long = pol.model_window("draft_model", 0.25, 16)
    assert long > 4
    for _ in range(200):  # always wrong: not worth asking, not even for a probe
        pol.observe(d, [99])
    assert pol.model_window("draft_model", 0.25, 16) == 0
    assert pol.model_window("draft_model", 0.25, 16, probe=True) == 0
    near, lately_wrong = DraftLengthPolicy(curve), DraftLengthPolicy(curve)
    for i in range(100):  # first token right 35% of the time: 1.35 tokens for 1.3 steps, 4% short of paying
        near.observe(d, [0, 99] if i % 20 % 3 == 0 and i % 20 < 19 else [99])  # (7 in 20, spread out)
        lately_wrong.observe(d, [0, 99] if i % 20 < 7 else [99])  # 7 in 20 too, but each 20 ends with 13 misses
    assert near.model_window("draft_model", 0.25, 16) == 0
    assert near.model_window("draft_model", 0.25, 16, probe=True) == 1  # close enough to probe
    # The request's factor weighs recent drafts most (policy.REQUEST_DECAY): after 13 misses, no probe either
    assert lately_wrong.model_window("draft_model", 0.25, 16, probe=True) == 0
    near.charge(10.0)  # the loss budget is spent: not even a probe
    assert near.model_window("draft_model", 0.25, 16, loss_budget=1.0, probe=True) == 0


def test_the_draft_models_costs_are_measured_at_load_and_price_its_first_ask(tokenizer):
    """Issue 63: a fresh decoder knows what its draft model's token and its catch-up on a prompt cost before its
    first request asks it (measured with the cost curve; kept by reset_learning). Where catching up on the prompt
    costs more than its drafts could save in the answer, a first request never runs the draft model at all."""
    from rag_accel.speculation import StepCosts

    target, small = tiny_model("llama", len(tokenizer), seed=0), tiny_model("llama", len(tokenizer), seed=3)
    dec = ReferenceDecoder(target, tokenizer, DecoderConfig(drafters=("draft_model",), max_draft_tokens=8),
                           draft_model=small)
    dec.cost_curve(8)
    measured = dec.draft_costs
    assert measured.step_s > 0 and measured.draft_token_s > 0 and measured.catchup_token_s > 0
    assert (dec.step_costs.draft_token_s, dec.step_costs.catchup_token_s) == (measured.draft_token_s,
                                                                              measured.catchup_token_s)
    dec.reset_learning()
    assert dec.step_costs.catchup_token_s == measured.catchup_token_s  # a fresh process's decoder: measured at load
    calls = []
    small.register_forward_hook(lambda *_: calls.append(1))
    prompt, flat = list(range(5, 205)), (1.0,) * 9
    # a draft token a tenth of a step, but catching up on a prompt token a whole step: 200 steps to gain on 30
    dec.draft_costs = StepCosts(step_s=0.01, draft_token_s=0.001, catchup_token_s=0.01)
    dec.reset_learning()
    out = dec.generate(prompt, max_new_tokens=30, config={"cost_curve": flat})
    assert out.token_ids == hf_greedy(target, prompt, 30) and calls == [] and "draft_model" not in out.stats.by_drafter
    # the same draft model whose catch-up is cheap is asked from the first steps
    dec.draft_costs = StepCosts(step_s=0.01, draft_token_s=0.001, catchup_token_s=0.00001)
    dec.reset_learning()
    out = dec.generate(prompt, max_new_tokens=30, config={"cost_curve": flat})
    assert out.token_ids == hf_greedy(target, prompt, 30) and calls and out.stats.by_drafter["draft_model"]["drafted"]


def test_draft_model_errors(tokenizer, bpe):
    target = tiny_model("llama", len(tokenizer), seed=0)
    with pytest.raises(TypeError, match="draft_model must be"):
        ReferenceDecoder(target, tokenizer, draft_model="small")
    with pytest.raises(ValueError, match="draft_tokenizer"):  # another vocabulary without its tokenizer
        ReferenceDecoder(target, tokenizer, draft_model=tiny_model("llama", len(bpe)))
    with pytest.raises(TypeError, match="draft_tokenizer must be"):
        ReferenceDecoder(target, tokenizer, draft_model=target, draft_tokenizer=42)
    dec = ReferenceDecoder(target, tokenizer)
    with pytest.raises(ValueError, match="no draft model"):
        dec.generate([1, 2, 3], max_new_tokens=2, config={"drafters": ("draft_model",)})
    # A draft model given is a draft model asked for: the default chain then ends with it; a config that leaves
    # it out, or lists it without one, is refused (issue 55: no draft model kept pace unasked).
    assert ReferenceDecoder(target, tokenizer, draft_model=target).config.drafters == (
        "reference", "frequency", "draft_model")
    with pytest.raises(ValueError, match="a draft model was given but config.drafters"):
        ReferenceDecoder(target, tokenizer, DecoderConfig(), draft_model=target)
    with pytest.raises(ValueError, match="lists 'draft_model' but this decoder has no draft model"):
        dec.generate([1, 2, 3], max_new_tokens=2, config={"drafters": ("reference", "draft_model")})
    with pytest.raises(ValueError, match="look_behind"):
        UniversalDrafter(target, bpe, tokenizer, look_behind=0)
    # Without a draft model the default chain simply skips "draft_model".
    assert dec.generate([1, 2, 3], max_new_tokens=4).token_ids == hf_greedy(target, [1, 2, 3], 4)
