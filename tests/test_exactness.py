"""Output token ids equal model.generate(do_sample=False), exactly, float32 on CPU.

Three architectures of tiny randomly initialised models, each with drafts
that are always right, always wrong, and a random mix; many prompts each.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model

import rag_accel.speculation as speculation
from rag_accel import DecoderConfig, Draft, ReferenceDecoder
from rag_accel.policy import DraftLengthPolicy

ARCHS = ["llama", "qwen2", "gpt2", "gemma3"]  # gemma3: an 8-token sliding window, crossed by every prompt
N_PROMPTS = 6
MAX_NEW = 40


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tokenizer):
    model = tiny_model(request.param, vocab_size=len(tokenizer))
    return ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8))


def test_the_tiny_qwen2_has_the_traits_of_the_deployed_model_class(tokenizer):
    """The Qwen2-shaped model of this suite stands for Qwen2.5 (issue 63): grouped KV heads (4 query heads over
    2), biases on q/k/v and none on o, an output head of its own (untied)."""
    model = tiny_model("qwen2", vocab_size=len(tokenizer))
    attn = model.model.layers[0].self_attn
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads == 4
    assert all(getattr(attn, f"{p}_proj").bias is not None for p in "qkv") and attn.o_proj.bias is None
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.mark.parametrize("mode, seed", [("right", 101), ("wrong", 202), ("mix", 303)])
def test_oracle_drafts(tiny, mode, seed):
    for i, prompt in enumerate(_prompts(N_PROMPTS, tiny.vocab_size, seed=seed)):  # fixed: a failure reproduces
        want = hf_greedy(tiny.model, prompt, MAX_NEW)
        out = tiny.generate(prompt, max_new_tokens=MAX_NEW,
                            drafters=[OracleDrafter(want, len(prompt), mode, tiny.vocab_size, seed=i)])
        assert out.token_ids == want
        s = out.stats
        assert s.drafted > 0
        if mode == "right":
            assert s.accepted == s.drafted and s.tokens_per_step > 4
        if mode == "wrong":
            assert s.accepted == 0 and s.steps == MAX_NEW


def test_real_drafters_with_references(tiny):
    rng = random.Random(1)
    for prompt in _prompts(N_PROMPTS, tiny.vocab_size, seed=2):
        want = hf_greedy(tiny.model, prompt, MAX_NEW)
        noise = [rng.randrange(tiny.vocab_size) for _ in range(50)]
        # references holding the answer (drafts right), noise (drafts mostly absent/wrong), and a corrupted copy
        corrupted = [t if rng.random() < 0.7 else rng.randrange(tiny.vocab_size) for t in want]
        for refs in ([prompt[-3:] + want], [noise], [corrupted, noise], None):
            out = tiny.generate(prompt, references=refs, max_new_tokens=MAX_NEW)
            assert out.token_ids == want, refs


def test_adaptive_policy_is_exact_too(tiny):
    cfg = DecoderConfig(cost_curve=tuple(1.0 + 0.1 * i for i in range(33)))
    for prompt in _prompts(3, tiny.vocab_size, seed=3):
        want = hf_greedy(tiny.model, prompt, MAX_NEW)
        out = tiny.generate(prompt, references=[want[5:30]], max_new_tokens=MAX_NEW, config=cfg)
        assert out.token_ids == want


def test_loss_budget_is_charged_the_timed_verify_cost(tiny, monkeypatch):
    """The curve says verifying is free; the verify steps really take 20 plain steps. The
    budget must see the real time: one failed draft, then only plain steps (still exact).
    The decoder's clock is a fake one that only a verify step advances: 1 s for a plain step,
    20 s for a step with a draft, so the test does not depend on the machine's speed."""
    sent = []

    class Recording(DraftLengthPolicy):
        def record(self, n, accepted, timed_cost=None):
            if n:
                sent.append(timed_cost)
            super().record(n, accepted, timed_cost)

    now = [0.0]
    verify = tiny._verify

    def timed_verify(req, draft_tokens):
        now[0] += 20.0 if draft_tokens else 1.0
        return verify(req, draft_tokens)

    class WrongAfterThree(OracleDrafter):  # plain steps first, so this request knows its plain-step time
        def propose(self, context, max_len):
            return Draft() if len(context) - self.prompt_len < 3 else super().propose(context, max_len)

    monkeypatch.setattr(speculation, "DraftLengthPolicy", Recording)
    monkeypatch.setattr(tiny, "_verify", timed_verify)
    monkeypatch.setattr(tiny, "clock", lambda: now[0])
    tiny.reset_learning()
    cfg = DecoderConfig(cost_curve=(1.0,) * 9, max_draft_tokens=8)  # modelled loss of a failed draft: 0
    prompt = _prompts(1, tiny.vocab_size, seed=7)[0]
    want = hf_greedy(tiny.model, prompt, MAX_NEW)
    out = tiny.generate(prompt, max_new_tokens=MAX_NEW, config=cfg,
                        drafters=[WrongAfterThree(want, len(prompt), "wrong", tiny.vocab_size)])
    assert out.token_ids == want
    assert sent == [20.0]  # one draft, charged its timed cost; then the budget allows none
    tiny.reset_learning()


def test_a_fresh_request_whose_drafts_all_fail_loses_at_most_its_budget(tiny, monkeypatch):
    """A fresh process's first request (nothing learnt), every draft wrong on strong evidence (an
    8-token match: the cold rates say draft), verifying cheap enough that drafting stays worth it
    on the rates. On a fake clock (prefill 2 plain steps, a verify of L draft tokens ``curve[L]``
    plain steps), its time may exceed greedy's by ``max_loss`` of greedy's, plus at most the one
    draft that crosses the budget: no free exploration comes on top of the budget."""
    curve = tuple(1.0 + 0.025 * i for i in range(9))
    now = [0.0]
    prefill, verify = tiny._prefill, tiny._verify

    def timed_prefill(req):
        now[0] += 2.0
        return prefill(req)

    def timed_verify(req, draft_tokens):
        now[0] += curve[len(draft_tokens)]
        return verify(req, draft_tokens)

    class StrongButWrong(OracleDrafter):  # a new source each time: nothing it learns holds it back
        calls = 0

        def propose(self, context, max_len):
            self.calls += 1
            return Draft(super().propose(context, max_len).tokens, 8, f"strong{self.calls}")

    monkeypatch.setattr(tiny, "_prefill", timed_prefill)
    monkeypatch.setattr(tiny, "_verify", timed_verify)
    monkeypatch.setattr(tiny, "clock", lambda: now[0])
    tiny.reset_learning()
    cfg = DecoderConfig(cost_curve=curve, max_draft_tokens=8)
    prompt = _prompts(1, tiny.vocab_size, seed=11)[0]
    want = hf_greedy(tiny.model, prompt, 16)  # a short answer: 3% of it is less than one plain step
    out = tiny.generate(prompt, max_new_tokens=16, config=cfg,
                        drafters=[StrongButWrong(want, len(prompt), "wrong", tiny.vocab_size)])
    assert out.token_ids == want
    greedy_time = 2.0 + (len(want) - 1)  # the prefill gives the first token, a plain step each other one
    lost = now[0] - greedy_time
    assert out.stats.drafted > 0 and lost > 0  # it did try: the cold rates trust an 8-token match
    assert lost <= cfg.max_loss * greedy_time + (curve[-1] - 1.0) + 1e-9
    tiny.reset_learning()


def test_references_are_set_up_during_the_prefill(tiny, monkeypatch):
    """The request's references are tokenised and indexed on another thread while the prefill
    runs (a long reference list costs its first token nothing up to the prefill's length): the
    prefill here waits for the set-up to have started, which a set-up run after it never would."""
    import rag_accel.references as references

    started, seen = threading.Event(), {}
    tokenize, prefill = references.tokenize_references, tiny._prefill

    def tokenize_and_tell(tokenizer, refs, max_tokens, stop=None, cache=None):
        seen["setup_thread"] = threading.current_thread().name
        started.set()
        return tokenize(tokenizer, refs, max_tokens, stop, cache)

    def prefill_waiting(req):
        seen["setup_started_during_prefill"] = started.wait(timeout=30)
        seen["prefill_thread"] = threading.current_thread().name
        return prefill(req)

    monkeypatch.setattr(references, "tokenize_references", tokenize_and_tell)
    monkeypatch.setattr(tiny, "_prefill", prefill_waiting)
    prompt = _prompts(1, tiny.vocab_size, seed=13)[0]
    want = hf_greedy(tiny.model, prompt, MAX_NEW)
    out = tiny.generate(prompt, references=[prompt[-3:] + want, "some text as well"], max_new_tokens=MAX_NEW)
    assert out.token_ids == want and out.stats.accepted > 0  # the references were there to draft from
    assert seen["setup_started_during_prefill"]
    assert seen["setup_thread"] != seen["prefill_thread"]
    assert out.stats.setup_s > 0 and 0 <= out.stats.setup_wait_s <= out.stats.time_s


def test_tokenising_a_big_reference_lets_the_prefill_run(tiny, monkeypatch):
    """The set-up thread's tokenising releases the GIL (the tokenizer's call encodes in Rust
    without it): the prefill starts while a ~100,000-token text is still being tokenised. A
    tokenizer that held the GIL (its backend's single ``encode`` does) would keep the prefill
    waiting until it finished: the prefill would start in the last part of the tokenising, not
    in its first half."""
    import time

    import rag_accel.references as references

    started, times = threading.Event(), {}
    tokenize, prefill = references.tokenize_references, tiny._prefill

    def timed_tokenize(tokenizer, refs, max_tokens, stop=None, cache=None):
        times["tokenise_start"] = time.perf_counter()
        started.set()
        try:
            return tokenize(tokenizer, refs, max_tokens, stop, cache)
        finally:
            times["tokenise_end"] = time.perf_counter()

    def prefill_after_tokenising_began(req):
        assert started.wait(timeout=60)
        time.sleep(0.02)  # (the set-up thread is inside the tokenizer by now)
        times["prefill_start"] = time.perf_counter()
        return prefill(req)

    monkeypatch.setattr(references, "tokenize_references", timed_tokenize)
    monkeypatch.setattr(tiny, "_prefill", prefill_after_tokenising_began)
    text = " ".join(f"passage {i} says the river rises in the hills near town {i % 97}." for i in range(9000))
    out = tiny.generate([5, 6, 7], references=[text], max_new_tokens=4)
    _join_set_up_threads()
    assert len(out.token_ids) == 4
    tokenising = times["tokenise_end"] - times["tokenise_start"]
    assert times["prefill_start"] < times["tokenise_start"] + 0.5 * tokenising, (times, tokenising)


def _join_set_up_threads():
    for t in threading.enumerate():
        if t.name == "rag-accel-setup":
            t.join(timeout=60)


def _held_tokenizing(monkeypatch):
    """``tokenize_references`` on the set-up thread held until the returned event is set."""
    import rag_accel.references as references

    release, calls = threading.Event(), []
    tokenize = references.tokenize_references

    def held(tokenizer, refs, max_tokens, stop=None, cache=None):
        calls.append(threading.current_thread().name)
        assert release.wait(timeout=60), "the decode loop waited for the references"
        return tokenize(tokenizer, refs, max_tokens, stop, cache)

    monkeypatch.setattr(references, "tokenize_references", held)
    return release, calls


def test_large_references_never_delay_the_first_token(tiny, monkeypatch):
    """References over WAITED_REFERENCE_SIZE are indexed off the loop and never waited for: with
    their tokenising held until the request is over, the request still completes, exactly greedy's,
    drafting from the prompt meanwhile (a loop that waited would block here for 60 s and fail)."""
    from rag_accel.references import WAITED_REFERENCE_SIZE

    release, calls = _held_tokenizing(monkeypatch)
    prompt = _prompts(1, tiny.vocab_size, seed=14)[0]
    want = hf_greedy(tiny.model, prompt, MAX_NEW)
    big = [random.Random(3).randrange(tiny.vocab_size) for _ in range(WAITED_REFERENCE_SIZE)] + prompt[-3:] + want
    try:
        out = tiny.generate(prompt, references=[big], max_new_tokens=MAX_NEW)
    finally:
        release.set()
        _join_set_up_threads()
    assert calls == ["rag-accel-setup"]
    assert out.token_ids == want
    assert "reference" not in out.stats.by_drafter  # it never joined: the request was over first


def test_large_references_join_the_request_when_ready(tiny, monkeypatch):
    """Held until the first token is out, then indexed: the reference drafter joins the request
    mid-way and its drafts (the answer itself) are accepted; the output stays greedy's."""
    from rag_accel.references import WAITED_REFERENCE_SIZE

    release, _ = _held_tokenizing(monkeypatch)
    prompt = _prompts(1, tiny.vocab_size, seed=15)[0]
    want = hf_greedy(tiny.model, prompt, MAX_NEW)
    big = [random.Random(4).randrange(tiny.vocab_size) for _ in range(WAITED_REFERENCE_SIZE)] + prompt[-3:] + want
    stream = tiny.stream(prompt, references=[big], max_new_tokens=MAX_NEW)
    pieces = iter(stream)
    try:
        next(pieces)
    finally:
        release.set()
        _join_set_up_threads()
    for _ in pieces:
        pass
    out = stream.output
    assert out.token_ids == want
    assert out.stats.by_drafter["reference"]["accepted"] > 0


def test_a_request_that_ends_stops_its_reference_indexing(tiny, monkeypatch):
    """A stream dropped half-read tells the set-up thread to stop: the texts not yet tokenised
    never are (each text asks before it is tokenised)."""
    import rag_accel.references as references

    release, started, asked = threading.Event(), threading.Event(), []
    tokenize = references.tokenize_references

    def held(tokenizer, refs, max_tokens, stop=None, cache=None):
        def stop_and_tell():
            started.set()
            assert release.wait(timeout=60)
            asked.append(stop())
            return asked[-1]
        return tokenize(tokenizer, refs, max_tokens, stop_and_tell, cache)

    monkeypatch.setattr(references, "tokenize_references", held)
    texts = ["word " * 1000] * 3  # 15,000 characters: not waited for
    stream = tiny.stream([5, 6, 7], references=texts, max_new_tokens=MAX_NEW)
    pieces = iter(stream)
    next(pieces)  # (a stream starts when it is first read)
    assert started.wait(timeout=60)
    pieces.close()  # the caller drops the stream
    release.set()
    _join_set_up_threads()
    assert asked == [True]  # asked once, told to stop: nothing was tokenised


def test_eos_inside_an_accepted_draft(tokenizer):
    model = tiny_model("llama", len(tokenizer), seed=5)
    prompt = list(range(100, 120))
    free = hf_greedy(model, prompt, 30)
    eos = free[12]
    first = free.index(eos)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=16))
    want = hf_greedy(model, prompt, 30)
    assert want == free[:first + 1]  # generate stops at (and keeps) the EOS
    out = dec.generate(prompt, max_new_tokens=30, drafters=[OracleDrafter(free, len(prompt), "right", dec.vocab_size)])
    assert out.token_ids == want and out.finish_reason == "eos"
    assert out.stats.steps < len(want)  # the EOS did arrive inside a multi-token step


def test_max_new_tokens_inside_a_draft(tokenizer):
    model = tiny_model("qwen2", len(tokenizer), seed=6)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=16))
    prompt = list(range(300, 340))
    full = hf_greedy(model, prompt, 40)
    for n in (1, 2, 5, 17):
        out = dec.generate(prompt, max_new_tokens=n, drafters=[OracleDrafter(full, len(prompt), "right", dec.vocab_size)])
        assert out.token_ids == full[:n] and out.finish_reason == "length"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_and_matches_generate(tokenizer, dtype):
    model = tiny_model("llama", len(tokenizer), seed=7).to(dtype)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False))
    prompt = list(range(500, 530))
    want = hf_greedy(model, prompt, 20)
    out = dec.generate(prompt, max_new_tokens=20, references=[want])
    # In half precision a multi-token forward may round differently from one-token steps (a
    # near-tie could flip); exactness is promised for float32. These seeds must still match.
    assert out.token_ids == want


def test_huge_reference_indexes_and_stays_exact(tokenizer):
    model = tiny_model("gpt2", len(tokenizer), seed=9)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False))
    prompt = list(range(1000, 1030))
    want = hf_greedy(model, prompt, 30)
    rng = random.Random(0)
    haystack = [rng.randrange(len(tokenizer)) for _ in range(300_000)]
    haystack[150_000:150_000] = prompt[-4:] + want  # the answer planted in the middle
    stream = dec.stream(prompt, references=[haystack], max_new_tokens=30)
    pieces = iter(stream)
    next(pieces)
    _join_set_up_threads()  # (its index is not waited for: the request goes on once it is ready)
    for _ in pieces:
        pass
    out = stream.output
    assert out.token_ids == want
    assert out.stats.by_drafter["reference"]["accepted"] >= 20


def test_frequency_drafts_are_exact(tiny):
    """The frequency drafter alone, its drafts sent whole (a draft needs the tail, the model's own tokens, to
    have occurred before): some drafts right, some wrong, the output ids those of ``generate`` either way."""
    cfg = DecoderConfig(adaptive=False, max_draft_tokens=8, drafters=("frequency",))
    drafted = accepted = 0
    for prompt in _prompts(N_PROMPTS, tiny.vocab_size, seed=17):
        # the prompt, then the model's answer to it, then the prompt again: its answer this time may follow
        # the first one (a draft right) or not (wrong)
        prompt = prompt + hf_greedy(tiny.model, prompt, MAX_NEW) + prompt
        want = hf_greedy(tiny.model, prompt, MAX_NEW)
        out = tiny.generate(prompt, max_new_tokens=MAX_NEW, config=cfg)
        assert out.token_ids == want
        assert set(out.stats.by_drafter) <= {"frequency"}
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    assert 0 < accepted < drafted
