"""Static steps (rag_accel.hf.static): one preallocated KV cache, steps padded to a few sizes, captured as CUDA graphs
on a GPU. Here, on a CPU, the same code runs eagerly (``static_steps=True``): its outputs must be greedy's token for
token, its padding must never change an accepted token, and its steps must read nothing back from the device (what
a graph capture forbids). The capture itself needs a GPU; its fallback is tested here, where capture fails."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import OracleDrafter, bf16_units, hf_greedy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import static
from rag_accel.hf.static import StaticLease, step_sizes
from rag_accel.invariant import cancelling_rows
from rag_accel.machine import cpu_identity
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
    assert dec.steps.static.sizes == (1, 2, 4, 8, 13)
    item = load_msmarco_sample(limit=1)[0]
    ids = dec.encode_prompt(rag_messages(item.query, item.passages))
    rng = random.Random(0)
    with torch.inference_mode():
        for length in (len(ids) // 3, len(ids) // 2, len(ids)):
            lease, dynamic = dec.steps.new_cache(len(ids) + 64), real_decoder.steps.new_cache()
            assert isinstance(lease, StaticLease)
            try:
                dec.steps.forward(ids[:length], lease, last_only=True)
                real_decoder.steps.forward(ids[:length], dynamic, last_only=True)
                for n in range(1, 14):
                    tokens = [rng.randrange(dec.vocab_size) for _ in range(n)]
                    got = dec.steps.forward(tokens, lease).argmax(-1)
                    want = real_decoder.steps.forward(tokens, dynamic).argmax(-1)
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
        lease = dec.steps.new_cache(200)
        try:
            dec.steps.forward(list(range(10, 50)), lease, last_only=True)
            with reads:
                for n in (1, 3, 8, 9):
                    dec.steps.forward(list(range(60, 60 + n)), lease)
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
    dec.steps.static.capture = True
    for prompt in _prompts(2, dec.vocab_size, 7):
        want = hf_greedy(model, prompt, MAX_NEW)
        assert dec.generate(prompt, [prompt], max_new_tokens=MAX_NEW).token_ids == want
    failed = [w for w in recwarn if "could not capture the steps as CUDA graphs" in str(w.message)]
    assert len(failed) == 1 and "run eagerly on the static cache" in str(failed[0].message)
    assert dec.steps.static.capture is False and dec.steps.static.graphs == {}


def test_a_second_request_in_flight_takes_a_dynamic_cache(tokenizer):
    """One static cache, one request at a time: a stream started while another holds it runs on a dynamic cache;
    both are greedy's, and once both end the static cache is free again."""
    model = tiny_model("qwen2", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=8), static_steps=True)
    a, b = _prompts(2, dec.vocab_size, 9)
    sa, sb = dec.stream(a, [a], max_new_tokens=MAX_NEW), dec.stream(b, [b], max_new_tokens=MAX_NEW)
    ia = iter(sa)
    first = next(ia)  # a holds the static cache
    assert dec.steps.static._busy.locked()
    rest_b = "".join(sb)
    rest_a = first + "".join(ia)
    assert sa.output.token_ids == hf_greedy(model, a, MAX_NEW) and sb.output.token_ids == hf_greedy(model, b, MAX_NEW)
    assert rest_a == sa.output.text and rest_b == sb.output.text
    lease = dec.steps.new_cache(100)
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
    lease = dec.steps.new_cache(100)
    assert isinstance(lease, StaticLease) and lease.get_seq_length() == 0
    lease.release()
    assert not isinstance(dec.steps.new_cache(10 ** 6), StaticLease)  # more than it holds: a dynamic cache


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
    assert not dec.steps.static._busy.locked()
    lease = dec.steps.new_cache(100)
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
    with pytest.raises(TypeError, match="static_steps must be a bool"):
        ReferenceDecoder(llama, tokenizer, static_steps="yes")
    assert not ReferenceDecoder(llama, tokenizer).static_steps  # a CPU's default: the dynamic cache


# ---------------------------------------------------------------- exact steps from fixed shapes (bfloat16)
EXACT_CFG = DecoderConfig(adaptive=False, max_draft_tokens=8)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def exact_bf16(request, tokenizer):
    model = tiny_model(request.param, vocab_size=len(tokenizer)).to(torch.bfloat16)
    return ReferenceDecoder(model, tokenizer, EXACT_CFG, exact=True, static_steps=True)


def _one_by_one_and_together(dec, context, seq):
    """(each token's logits from a plain step, the logits of one step over ``seq[:k]`` for every k) on the
    decoder's static cache."""
    lease = dec.steps.new_cache(len(context) + 2 * len(seq))
    assert isinstance(lease, StaticLease)
    try:
        dec.steps.forward(context, lease, last_only=True)
        alone = [dec.steps.forward([t], lease, exact=True)[-1] for t in seq]
        lease.crop(-len(seq))
        together = {}
        for k in range(1, len(seq) + 1):
            together[k] = dec.steps.forward(seq[:k], lease, exact=True)
            lease.crop(-k)
    finally:
        lease.release()
    return alone, together


@pytest.mark.parametrize("context_len", [7, 300, 700])
def test_exact_static_steps_compute_every_verify_row_as_a_plain_step(exact_bf16, context_len):
    """bfloat16: in the sizes the probe keeps, every row of a verify of 1..9 tokens is bit for bit the plain step's
    at its position, at three cache lengths (none of them the probe's)."""
    g = torch.Generator().manual_seed(context_len)
    context = torch.randint(0, exact_bf16.vocab_size, (context_len,), generator=g).tolist()
    seq = torch.randint(0, exact_bf16.vocab_size, (9,), generator=g).tolist()
    static.release(exact_bf16.steps.new_cache(len(context)))  # (the probe runs at the first lease)
    if not exact_bf16.static_steps:  # (the decoder's exact steps then run on the dynamic path: tests/test_exact.py)
        pytest.skip("on this CPU even the largest step size computes a row by its place among the rows")
    assert exact_bf16.steps.static.sizes[-1] == 9  # (the largest size is kept wherever any is)
    with torch.inference_mode():
        alone, together = _one_by_one_and_together(exact_bf16, context, seq)
    for k, logits in together.items():
        for i in range(k):
            assert torch.equal(logits[i], alone[i]), (exact_bf16.steps.static.sizes, k, i)


@pytest.mark.parametrize("mode", ["right", "wrong", "mix"])
def test_exact_static_steps_equal_drafting_off(exact_bf16, mode):
    """bfloat16, drafts always right, always wrong and mixed: token for token what the same decoder writes with
    drafting off (greedy in bfloat16 is not model.generate's: its one-token forwards are another shape)."""
    for i, prompt in enumerate(_prompts(4, exact_bf16.vocab_size, 9)):
        want = exact_bf16.generate(prompt, max_new_tokens=MAX_NEW, speculate=False).token_ids
        out = exact_bf16.generate(prompt, max_new_tokens=MAX_NEW,
                                  drafters=[OracleDrafter(want, len(prompt), mode, exact_bf16.vocab_size, seed=i)])
        assert out.token_ids == want, (i, mode)
        if mode == "right":
            assert out.stats.accepted > 0


def _perturbed_step(monkeypatch, where):
    """Static steps whose ``where(size, row)`` rows come out a little off (a kernel that depends on the shape)."""
    original = static.StaticSteps.step

    def step(self, ids, size):
        logits = original(self, ids, size).clone()
        for row in range(size):
            if where(size, row):
                logits[row] += 0.5
        return logits

    monkeypatch.setattr(static.StaticSteps, "step", step)


def _perturbed_decoder(tokenizer, monkeypatch, where, cfg=EXACT_CFG):
    """A tiny bfloat16 Llama's decoder on exact static steps whose ``where(size, row)`` rows come out off, every size
    passing the projections' and attention's probes (the model-level probe alone decides: on this CPU the op
    probes keep few sizes)."""
    # The premise: the sizes these tests bypass the projections' probe for compute rows as the largest size does, so
    # that the perturbation is all the model-level probe has to find. Not so where bfloat16 runs on AVX-512 without
    # bfloat16 instructions: there the probe (one thread, as the tests run) keeps 4, 8 and 9 of 1, 2, 4, 8, 9 tokens,
    # and drafting on 1 or 2 changes an output that the model-level probe's random tokens did not show.
    units = cpu_identity().rpartition("[")[2]
    if "avx512f" in units and not bf16_units():
        pytest.skip("bfloat16 on AVX-512 without bfloat16 instructions: small step sizes compute rows otherwise "
                    "(the projections' probe, which these tests bypass, drops them)")
    monkeypatch.setattr(static, "linear_sizes", lambda model, sizes: set(sizes))
    monkeypatch.setattr(static, "attention_sizes", lambda steps, sizes: set(sizes))
    _perturbed_step(monkeypatch, where)
    return ReferenceDecoder(tiny_model("llama", vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer, cfg,
                            exact=True, static_steps=True)


def test_the_probe_drops_a_size_whose_rows_differ(tokenizer, monkeypatch):
    """A size whose rows differ from the largest's (here the 2-token step's second row) is not used: its verifies
    run in the next size up, and outputs still equal drafting off."""
    dec = _perturbed_decoder(tokenizer, monkeypatch, lambda size, row: size == 2 and row == 1)
    prompt = _prompts(1, dec.vocab_size, 4)[0]
    want = dec.generate(prompt, max_new_tokens=MAX_NEW, speculate=False).token_ids
    assert dec.steps.static.sizes == (1, 4, 8, 9)
    out = dec.generate(prompt, max_new_tokens=MAX_NEW, drafters=[OracleDrafter(want, len(prompt), "mix",
                                                                                dec.vocab_size)])
    assert out.token_ids == want


def test_the_probe_drops_a_largest_size_whose_rows_depend_on_their_place(tokenizer, monkeypatch):
    """Where the largest size computes a row by its place (here the 9-token step's fourth row), the next size down
    becomes the largest: a step sends at most 7 draft tokens, and outputs still equal drafting off."""
    dec = _perturbed_decoder(tokenizer, monkeypatch, lambda size, row: size == 9 and row == 3)
    prompt = _prompts(1, dec.vocab_size, 6)[0]
    want = dec.generate(prompt, max_new_tokens=MAX_NEW, speculate=False).token_ids
    assert dec.steps.static.sizes == (1, 2, 4, 8)
    out = dec.generate(prompt, max_new_tokens=MAX_NEW, drafters=[OracleDrafter(want, len(prompt), "right",
                                                                                dec.vocab_size)])
    assert out.token_ids == want
    assert max(n for _, n in out.stats.trace) == 8  # (7 drafted and accepted, and the model's next token)


def test_the_probe_finds_a_row_that_depends_on_its_place(tokenizer, monkeypatch):
    """Where every size of two tokens or more computes a row by its place, no size is exact: the static cache closes
    with a warning and the exact steps run on a dynamic cache (row by row), outputs equal to drafting off."""
    dec = _perturbed_decoder(tokenizer, monkeypatch, lambda size, row: row >= 1)
    prompt = _prompts(1, dec.vocab_size, 5)[0]
    with pytest.warns(UserWarning, match="no step size computes its rows"):
        want = dec.generate(prompt, max_new_tokens=MAX_NEW, speculate=False).token_ids
    assert not dec.static_steps and isinstance(dec.steps.new_cache(10), type(dec.steps.new_cache()))
    out = dec.generate(prompt, max_new_tokens=MAX_NEW, drafters=[OracleDrafter(want, len(prompt), "mix",
                                                                                dec.vocab_size)])
    assert out.token_ids == want


def test_exact_static_cost_curve_prices_only_the_kept_sizes(tokenizer, monkeypatch):
    """The cost curve of exact static steps is timed after the probe, on the sizes it kept: with only the largest
    kept, every draft length costs one price (a plain step runs in the largest size too)."""
    dec = _perturbed_decoder(tokenizer, monkeypatch, lambda size, row: size < 9 and row == 0,
                             DecoderConfig(max_draft_tokens=8))
    curve = dec.cost_curve(8)
    assert dec.steps.static.sizes == (9,)
    assert curve == (1.0,) * 9


def test_the_attention_probe_drops_a_size_the_kernel_computes_otherwise(tokenizer, monkeypatch):
    """``static.attention_sizes`` replays the model's own attention call on probe values in every size: with a
    kernel that computes each query row alone (invariant by construction) it keeps every size; with the same kernel
    computing a 2-row call's rows otherwise (a blocking chosen by the row count), it drops size 2 and only that."""
    import torch.nn.functional as F

    attention_sizes = static.attention_sizes
    monkeypatch.setattr(static, "linear_sizes", lambda model, sizes: set(sizes))  # (the first lease's probe keeps
    monkeypatch.setattr(static, "attention_sizes", lambda steps, sizes: set(sizes))  # every size: the cache opens)
    dec = ReferenceDecoder(tiny_model("llama", vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer, EXACT_CFG,
                           exact=True, static_steps=True)
    static.release(dec.steps.new_cache(16))
    steps, sizes = dec.steps.static, dec.steps.static.sizes
    assert len(sizes) > 2 and 2 in sizes
    original = F.scaled_dot_product_attention

    def row_by_row(query, key, value, attn_mask=None, **kwargs):
        rows = [original(query[..., i:i + 1, :], key, value,
                         attn_mask=None if attn_mask is None else attn_mask[..., i:i + 1, :], **kwargs)
                for i in range(query.shape[-2])]
        return torch.cat(rows, dim=-2)

    def otherwise_at_two(query, key, value, attn_mask=None, **kwargs):
        out = row_by_row(query, key, value, attn_mask, **kwargs)
        return out + 0.5 if query.shape[-2] == 2 else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", row_by_row)
    assert attention_sizes(steps, sizes) == set(sizes)
    monkeypatch.setattr(F, "scaled_dot_product_attention", otherwise_at_two)
    assert attention_sizes(steps, sizes) == set(sizes) - {2}


def _rows_of(fn, x, sizes, top):
    """Which of ``sizes`` give ``fn`` (a function of [1, rows, in]) rows equal to the ``top``-row call's."""
    ref = fn(x[:, :top])
    return {s for s in sizes if torch.equal(fn(x[:, :s]), ref[:, :s])}


def test_cancelling_rows_reveal_an_order_of_additions_random_rows_hide():
    """A product that sums its input in another order for one row than for many (here: halves added apart when
    alone) differs from itself on the probe's cancelling rows, where random rows mostly give the same bfloat16
    bits; and a product that does not is kept at every size."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g).to(torch.bfloat16)

    def in_order(x, lo, hi):  # float32 sums over inputs lo..hi-1, added one after another: [1, rows, 16]
        acc = torch.zeros(*x.shape[:-1], w.shape[0])
        for j in range(lo, hi):
            acc = acc + x[..., j:j + 1].float() * w[:, j].float()
        return acc

    def split_when_alone(x):  # [1, rows, 64]
        if x.shape[1] > 1:
            return in_order(x, 0, 64).to(torch.bfloat16)
        return (in_order(x, 0, 32) + in_order(x, 32, 64)).to(torch.bfloat16)

    cancel = cancelling_rows(4, w, g).to(torch.bfloat16)[None]
    random_rows = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
    assert 1 not in _rows_of(split_when_alone, cancel, (1, 2, 4), 4)
    assert _rows_of(split_when_alone, random_rows, (1, 2, 4), 4) == {1, 2, 4}  # (what a random probe would say)
    # and the real probe, on a module that computes this way
    module = torch.nn.Linear(64, 16, bias=False).to(torch.bfloat16)
    module.weight.data.copy_(w)
    module.forward = split_when_alone
    assert static.linear_sizes(module, (1, 2, 4)) == {2, 4}
