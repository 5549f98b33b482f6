"""Static steps (rag_accel.hf.static): one preallocated KV cache, steps padded to a few sizes, captured as CUDA graphs
on a GPU. Here, on a CPU, the same code runs eagerly (``static_steps=True``): its outputs must be greedy's token for
token, its padding must never change an accepted token, and its steps must read nothing back from the device (what
a graph capture forbids). The capture itself needs a GPU; its fallback is tested here, where capture fails."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import static
from rag_accel.hf.static import StaticLease, step_sizes
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

MAX_NEW = 40


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def tiny(request, tokenizer):
    model = tiny_model(request.param, vocab_size=len(tokenizer))
    return ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)


@pytest.fixture
def steps_run(monkeypatch):
    """How many steps of each size ran on the static cache (the real steps, counted)."""
    sizes: list[int] = []
    original = static.StaticSteps.step

    def counted(self, ids, size):
        sizes.append(size)
        return original(self, ids, size)

    monkeypatch.setattr(static.StaticSteps, "step", counted)
    return sizes


def test_step_sizes():
    assert step_sizes(0) == (1,)
    assert step_sizes(1) == (1, 2)
    assert step_sizes(8) == (1, 2, 4, 8, 9)
    assert step_sizes(10) == (1, 2, 4, 8, 11)
    assert step_sizes(15) == (1, 2, 4, 8, 16)
    assert static.size_for(5, (1, 2, 4, 8, 9)) == 8 and static.size_for(10, (1, 2, 4, 8, 9)) is None


@pytest.mark.parametrize("mode, seed", [("right", 11), ("wrong", 22), ("mix", 33)])
def test_static_steps_equal_greedy(tiny, mode, seed, steps_run):
    """Drafts always right, always wrong and mixed: token for token ``model.generate``'s, the steps padded (a
    3-token verify in a 4-token step, 5 to 7 in an 8-token one) on the static cache."""
    assert tiny.static_steps
    for i, prompt in enumerate(_prompts(4, tiny.vocab_size, seed)):
        want = hf_greedy(tiny.model, prompt, MAX_NEW)
        out = tiny.generate(prompt, max_new_tokens=MAX_NEW,
                            drafters=[OracleDrafter(want, len(prompt), mode, tiny.vocab_size, seed=i)])
        assert out.token_ids == want
    assert steps_run and set(steps_run) <= {1, 2, 4, 8, 9}
    if mode == "right":
        assert 9 in steps_run  # whole drafts
    if mode == "mix":
        assert {4, 8} & set(steps_run)  # (odd lengths ran padded: the oracle's drafts are cut at random points)


def test_sampled_output_is_the_same_on_static_steps(tokenizer):
    """Sampling reads the same logits: a seeded sample equals the dynamic path's."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    cfg = DecoderConfig(adaptive=False, max_draft_tokens=6)
    outs = []
    for flag in (False, True):
        dec = ReferenceDecoder(model, tokenizer, cfg, static_steps=flag)
        prompt = _prompts(1, dec.vocab_size, 5)[0]
        outs.append(dec.generate(prompt, [prompt[:30]], max_new_tokens=30, do_sample=True, temperature=0.8,
                                 seed=3).token_ids)
    assert outs[0] == outs[1]


def test_padding_never_changes_an_accepted_token(real_decoder):
    """SmolLM2: a verify of ``n`` tokens, run in its padded size on the static cache, gives the argmax of the
    unpadded verify on a dynamic cache at every one of its rows, for every ``n`` from 1 to 13 at three lengths."""
    dec = ReferenceDecoder(real_decoder.model, real_decoder.tokenizer, DecoderConfig(max_draft_tokens=12),
                           static_steps=True)
    assert dec._static.sizes == (1, 2, 4, 8, 13)
    item = load_msmarco_sample(limit=1)[0]
    ids = dec.encode_prompt(rag_messages(item.query, item.passages))
    rng = random.Random(0)
    with torch.inference_mode():
        for length in (len(ids) // 3, len(ids) // 2, len(ids)):
            lease, dynamic = dec._new_cache(len(ids) + 64), real_decoder._new_cache()
            assert isinstance(lease, StaticLease)
            try:
                dec._forward(ids[:length], lease, last_only=True)
                real_decoder._forward(ids[:length], dynamic, last_only=True)
                for n in range(1, 14):
                    tokens = [rng.randrange(dec.vocab_size) for _ in range(n)]
                    got = dec._forward(tokens, lease).argmax(-1)
                    want = real_decoder._forward(tokens, dynamic).argmax(-1)
                    assert torch.equal(got, want), (length, n)
                    lease.crop(-n)
                    dynamic.crop(-n)
                    assert lease.get_seq_length() == length
            finally:
                lease.release()


def test_real_model_with_references_equals_greedy(real_decoder):
    """SmolLM2 over MS-MARCO items, the passages as references, the default (adaptive) drafting and whole drafts:
    ``model.generate``'s tokens."""
    dec = ReferenceDecoder(real_decoder.model, real_decoder.tokenizer, static_steps=True)
    for it in load_msmarco_sample(limit=3):
        ids = dec.encode_prompt(rag_messages(it.query, it.passages))
        want = hf_greedy(dec.model, ids, 32)
        for config in ({}, {"adaptive": False, "max_draft_tokens": 12}):
            out = dec.generate(ids, references=it.passages, max_new_tokens=32, config=config)
            assert out.token_ids == want, (it.id, config)


class _HostReads(TorchDispatchMode):
    """The ops that read a tensor's value back to the host (``.item()``, ``bool(t)``, ``nonzero``): each one a
    device sync, which a CUDA graph capture refuses."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.nonzero.default)

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_static_step_reads_nothing_back_from_the_device(tokenizer, arch):
    """What a graph replays must not depend on a value read on the host: a step on the static cache, of any size,
    performs no such read (the positions come from the cache's own length tensor). A host read is seen (control)."""
    dec = ReferenceDecoder(tiny_model(arch, vocab_size=len(tokenizer)), tokenizer, DecoderConfig(max_draft_tokens=8),
                           static_steps=True)
    reads = _HostReads()
    with torch.inference_mode():
        lease = dec._new_cache(200)
        try:
            dec._forward(list(range(10, 50)), lease, last_only=True)
            with reads:
                for n in (1, 3, 8, 9):
                    dec._forward(list(range(60, 60 + n)), lease)
                    lease.crop(-n)
        finally:
            lease.release()
        assert reads.seen == []
        with reads:
            torch.tensor(3).item()
    assert reads.seen and set(reads.seen) <= {str(op) for op in _HostReads.READS}


def test_a_failed_capture_leaves_eager_steps(tokenizer, recwarn):
    """Capture asked for where it cannot run (no CUDA here): one warning, the steps eager on the static cache, the
    output greedy's."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)
    dec._static.capture = True
    for prompt in _prompts(2, dec.vocab_size, 7):
        want = hf_greedy(model, prompt, MAX_NEW)
        assert dec.generate(prompt, [prompt], max_new_tokens=MAX_NEW).token_ids == want
    failed = [w for w in recwarn if "could not capture the steps as CUDA graphs" in str(w.message)]
    assert len(failed) == 1 and "run eagerly on the static cache" in str(failed[0].message)
    assert dec._static.capture is False and dec._static.graphs == {}


def test_a_second_request_in_flight_takes_a_dynamic_cache(tokenizer):
    """One static cache, one request at a time: a stream started while another holds it runs on a dynamic cache;
    both are greedy's, and once both end the static cache is free again."""
    model = tiny_model("qwen2", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)
    a, b = _prompts(2, dec.vocab_size, 9)
    sa, sb = dec.stream(a, [a], max_new_tokens=MAX_NEW), dec.stream(b, [b], max_new_tokens=MAX_NEW)
    ia = iter(sa)
    first = next(ia)  # a holds the static cache
    assert dec._static._busy.locked()
    rest_b = "".join(sb)
    rest_a = first + "".join(ia)
    assert sa.output.token_ids == hf_greedy(model, a, MAX_NEW) and sb.output.token_ids == hf_greedy(model, b, MAX_NEW)
    assert rest_a == sa.output.text and rest_b == sb.output.text
    lease = dec._new_cache(100)
    assert isinstance(lease, StaticLease)
    lease.release()


def test_a_dropped_or_failed_request_hands_the_static_cache_back(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)
    prompt = _prompts(1, dec.vocab_size, 4)[0]
    stream = dec.stream(prompt, max_new_tokens=MAX_NEW)
    next(iter(stream))
    stream.close()  # dropped half-read
    del stream
    done = threading.Event()

    def other() -> None:
        dec.generate(prompt, max_new_tokens=4)
        done.set()

    threading.Thread(target=other).start()
    assert done.wait(60)
    lease = dec._new_cache(100)
    assert isinstance(lease, StaticLease) and lease.get_seq_length() == 0
    lease.release()
    assert not isinstance(dec._new_cache(10 ** 6), StaticLease)  # more than it holds: a dynamic cache


def test_a_request_that_fails_mid_answer_hands_the_static_cache_back(tokenizer):
    """A drafter that raises after a few steps: the error reaches the caller, the static cache is free and empty,
    and the next request on it is greedy's."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)
    prompt = _prompts(1, dec.vocab_size, 6)[0]
    want = hf_greedy(model, prompt, MAX_NEW)

    class FailsOnThird(OracleDrafter):
        calls = 0

        def propose(self, context, max_len):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("drafter broke")
            return super().propose(context, max_len)

    with pytest.raises(RuntimeError, match="drafter broke"):
        dec.generate(prompt, max_new_tokens=MAX_NEW,
                     drafters=[FailsOnThird(want, len(prompt), "right", dec.vocab_size)])
    assert not dec._static._busy.locked()
    lease = dec._new_cache(100)
    assert isinstance(lease, StaticLease) and lease.get_seq_length() == 0
    lease.release()
    assert dec.generate(prompt, max_new_tokens=MAX_NEW).token_ids == want


def test_the_cost_curve_prices_the_step_sizes(tokenizer):
    """Timed on the static steps, ``L`` draft tokens cost the size that holds ``L + 1``: one price per size."""
    dec = ReferenceDecoder(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, DecoderConfig(max_draft_tokens=8),
                           static_steps=True)
    curve = dec.cost_curve(8)
    assert len(curve) == 9 and curve[0] == 1.0
    assert curve[4] == curve[5] == curve[6] == curve[7]  # 5..8 tokens: the 8-token step
    assert curve[2] <= curve[3] <= curve[4] <= curve[8]
    assert dec.cost_curve(8) is curve  # measured once


def test_static_steps_are_refused_where_they_cannot_run(tokenizer):
    gemma = tiny_model("gemma3", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="sliding-window"):
        ReferenceDecoder(gemma, tokenizer, static_steps=True)
    llama = tiny_model("llama", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="exact steps"):
        ReferenceDecoder(llama, tokenizer, exact=True, static_steps=True)
    with pytest.raises(TypeError, match="static_steps must be a bool"):
        ReferenceDecoder(llama, tokenizer, static_steps="yes")
    assert not ReferenceDecoder(llama, tokenizer).static_steps  # a CPU's default: the dynamic cache
