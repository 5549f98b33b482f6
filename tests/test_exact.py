"""Exact steps (issue 64): in bfloat16 a verify's rows are bit for bit the one-token steps' at their positions.

A forward over k tokens does not compute the sums k one-token forwards do (other GEMM blocking, another attention
split), so in bfloat16 a verify's logits differ from plain decoding's by a little and a near tie flips. With
``exact`` on (the default in bfloat16 and float16) every projection takes an invariant plan (rag_accel/hf/linears.py)
and attention runs row by row as a one-token step runs it (rag_accel/hf/attention.py), for plain and verify steps
alike. These tests fail on one bit: logits ``torch.equal``, op by op and for whole models (the tiny Llama, Qwen2,
GPT-2 and Gemma 3 of the exactness suite, across Gemma's sliding window; the real Qwen2.5-Coder-0.5B), then outputs
with drafts always right, always wrong and mixed equal the same decoder's with drafting off, greedy and sampled.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import OracleDrafter, fresh_verdicts, needs_bf16_units, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import attention, linears
from rag_accel.hf.kv import rollback_cache
from rag_accel.invariant import EXACT_CANDIDATES, VERDICTS, ExactPlan, exact_linear, invariant_rows, is_invariant

ARCHS = ["llama", "qwen2", "qwen2-h128", "gpt2", "gemma3"]
SIZES = (2, 3, 4, 8, 16, 33)


def _rows(dec, context, seq):
    """(each token's logits as a one-token step, then the logits of forwards over its first k, k in SIZES)."""
    with torch.inference_mode():
        cache = dec.steps.new_cache()
        dec.steps.forward(context, cache, last_only=True)
        alone = [dec.steps.forward([t], cache, exact=True)[-1] for t in seq]
        rollback_cache(cache, len(seq))
        together = {}
        for k in SIZES:
            together[k] = dec.steps.forward(seq[:k], cache, exact=True)
            rollback_cache(cache, k)
    return alone, together


@pytest.fixture(scope="module", params=ARCHS)
def bf16(request, tokenizer):
    return ReferenceDecoder(tiny_model(request.param, vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer)


def test_exact_is_on_by_default_in_bfloat16_only(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    assert not ReferenceDecoder(model, tokenizer).exact  # float32: off (invariant products cost chunks of 3 rows)
    assert ReferenceDecoder(model.to(torch.bfloat16), tokenizer).exact
    assert not ReferenceDecoder(model, tokenizer, exact=False).exact
    with pytest.raises(TypeError, match="exact must be a bool"):
        ReferenceDecoder(model, tokenizer, exact="yes")


# 300: past Gemma's 8-token window, and many KV blocks; 500: rows on both sides of the 512-key block edge
@pytest.mark.parametrize("context_len", [12, 300, 500])
def test_every_verify_row_is_bit_equal_to_a_one_token_step(bf16, context_len):
    g = torch.Generator().manual_seed(context_len)
    context = torch.randint(0, bf16.vocab_size, (context_len,), generator=g).tolist()
    seq = torch.randint(0, bf16.vocab_size, (max(SIZES),), generator=g).tolist()
    alone, together = _rows(bf16, context, seq)
    for k, logits in together.items():
        for i in range(k):
            assert torch.equal(logits[i], alone[i]), (k, i, (logits[i].float() - alone[i].float()).abs().max())


@pytest.mark.parametrize("verdict", [False, True])
def test_each_attention_path_is_taken_where_the_probe_says_and_stays_exact(tokenizer, monkeypatch, verdict):
    """The probe's verdict picks the exact attention's path (a CPU whose kernel fails the block probe takes the row
    by row one, which this CPU may never take): with the verdict forced, the verify runs that path, and every row
    still equals a one-token step. (Forced True on Qwen2.5-1.5B's head shape, 6 query heads per key/value head,
    skipped on a CPU whose kernel fails the probe for it.)"""
    arch = "qwen2-h128"
    model = tiny_model(arch, vocab_size=len(tokenizer)).to(torch.bfloat16)
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if verdict and not attention.block_is_invariant(heads, kv, cfg.hidden_size // heads, torch.bfloat16):
        pytest.skip("this CPU's kernel fails the block probe for this head shape")
    monkeypatch.setattr(attention, "block_is_invariant", lambda *a, **k: verdict)
    taken = []
    for name in ("block_attention", "row_attention"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name,
                            lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k))
    dec = ReferenceDecoder(model, tokenizer)
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, dec.vocab_size, (40,), generator=g).tolist()
    seq = torch.randint(0, dec.vocab_size, (max(SIZES),), generator=g).tolist()
    alone, together = _rows(dec, context, seq)
    assert set(taken) == {"block_attention" if verdict else "row_attention"}
    for k, logits in together.items():
        for i in range(k):
            assert torch.equal(logits[i], alone[i]), (verdict, k, i)


def test_without_exact_steps_bfloat16_verify_rows_differ(tokenizer):
    """The contrast the mode removes (the library's kernels): not every row of a 16-token verify equals its step."""
    dec = ReferenceDecoder(tiny_model("qwen2", vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer, exact=False)
    g = torch.Generator().manual_seed(3)
    context, seq = (torch.randint(0, dec.vocab_size, (n,), generator=g).tolist() for n in (20, 16))
    with torch.inference_mode():
        cache = dec.steps.new_cache()
        dec.steps.forward(context, cache, last_only=True)
        alone = [dec.steps.forward([t], cache, pack_gqa=True)[-1] for t in seq]
        rollback_cache(cache, 16)
        logits = dec.steps.forward(seq, cache, pack_gqa=True)
    assert sum(torch.equal(logits[i], alone[i]) for i in range(16)) < 16


@pytest.mark.parametrize("mode", ["right", "wrong", "mix"])
def test_outputs_equal_drafting_off_with_every_kind_of_draft(bf16, mode):
    g = torch.Generator().manual_seed(7)
    cfg = DecoderConfig(adaptive=False, max_draft_tokens=8)
    for i in range(4):
        prompt = torch.randint(0, bf16.vocab_size, (int(torch.randint(5, 80, (1,), generator=g)),),
                               generator=g).tolist()
        want = bf16.generate(prompt, max_new_tokens=40, speculate=False).token_ids
        out = bf16.generate(prompt, max_new_tokens=40, config=cfg,
                            drafters=[OracleDrafter(want, len(prompt), mode, bf16.vocab_size, seed=i)])
        assert out.token_ids == want, (i, mode)
        if mode == "right":
            assert out.stats.accepted > 0


def test_sampled_outputs_equal_drafting_off(bf16):
    """The coupled sampler's draws are the same when the logits are: drafting on and off sample alike."""
    prompt = list(range(3, 40))
    sample = dict(max_new_tokens=30, do_sample=True, seed=11, temperature=0.8, top_p=0.9)
    want = bf16.generate(prompt, speculate=False, **sample).token_ids
    for mode in ("right", "mix"):
        out = bf16.generate(prompt, config=DecoderConfig(adaptive=False, max_draft_tokens=6),
                            drafters=[OracleDrafter(want, len(prompt), mode, bf16.vocab_size)], **sample)
        assert out.token_ids == want


def test_an_exact_plan_is_invariant_and_computes_the_product():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    x = torch.randn(20, 32, generator=g).bfloat16()
    for plan in EXACT_CANDIDATES:
        got = exact_linear(x, weight, bias, plan)
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, bias).float(), atol=0.1,
                                   rtol=0.05)
    assert is_invariant(weight, bias, ExactPlan(1, False, pad=1), rows=9)  # each row alone: by construction
    plan = linears.exact_plan([torch.nn.Linear(32, 48).bfloat16()])
    mod = torch.nn.Linear(32, 48).bfloat16()
    assert is_invariant(mod.weight, mod.bias, plan, rows=2 * plan.chunk + 1)  # chunks repeat it


def test_invariant_rows_finds_where_a_kernel_stops_being_invariant():
    """:func:`invariant_rows` gives the last row count up to which every row equals the row alone: here a kernel that
    computes up to 3 rows one by one, and from 4 on gets the last column of every row off by one bit."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g).bfloat16()

    def rows(x):
        out = torch.cat([x[i:i + 1] @ weight.t() for i in range(len(x))])
        if len(x) > 3:
            out[:, -1] = torch.nextafter(out[:, -1], out.new_full((1,), float("inf")))
        return out

    assert invariant_rows(rows, 256, torch.bfloat16, 12) == 3
    assert invariant_rows(lambda x: torch.cat([r[None] @ weight.t() for r in x]), 256, torch.bfloat16, 12) == 12


def test_invariant_rows_tries_more_than_one_input():
    """A kernel whose rows differ from 4 on only for some inputs (a changed order of additions flips a bfloat16
    rounding only where the data lets it): one input can miss it, the probe's several find it."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g).bfloat16()
    first = torch.randn(12, 256, generator=torch.Generator().manual_seed(0)).bfloat16()[0, 0]

    def rows(x):
        out = torch.cat([x[i:i + 1] @ weight.t() for i in range(len(x))])
        if len(x) > 3 and not torch.equal(x[0, 0], first):  # every input but the first probe's
            out[:, -1] = torch.nextafter(out[:, -1], out.new_full((1,), float("inf")))
        return out

    assert invariant_rows(rows, 256, torch.bfloat16, 12, trials=1) == 12
    assert invariant_rows(rows, 256, torch.bfloat16, 12) == 3


def test_row_attention_is_a_one_token_steps_attention_at_every_row():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 16, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 40, 16, generator=g).bfloat16() for _ in range(2))
    for window in (None, 8):
        rows = attention.row_attention(q, k, v, 0.25, window)
        for i in range(5):
            end = 40 - 5 + i + 1
            one = attention.row_attention(q[:, :, i:i + 1], k[:, :, :end].contiguous(), v[:, :, :end].contiguous(),
                                          0.25, window)
            assert torch.equal(rows[:, i:i + 1], one)
    # and it is attention: the library's, within rounding, under the causal mask
    mask = torch.ones(5, 40, dtype=torch.bool).tril(35)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[None, None],
                                                            scale=0.25, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attention.row_attention(q, k, v, 0.25).float(), want, atol=0.03, rtol=0.03)


def test_block_attention_is_attention_and_the_probe_holds_beyond_its_cases():
    """The probe's verdict, checked at cache lengths it never tried and at every row count a verify sends: where it
    finds batched rows invariant for a head shape, they are; where not, some row of its own cases differed (so row
    attention runs)."""
    g = torch.Generator().manual_seed(1)
    cases = ((77, 7), (530, 24)) + tuple((1400, q) for q in range(2, 34))  # every row count a verify sends
    for (heads, kv, dim), dtype in itertools.product(((12, 2, 128), (4, 1, 256), (9, 3, 64)),
                                                     (torch.bfloat16, torch.float32)):
        verdict = attention.block_is_invariant(heads, kv, dim, dtype)
        for t, q_len in cases:
            q = torch.randn(1, heads, q_len, dim, generator=g).to(dtype)
            k, v = (torch.randn(1, kv, t, dim, generator=g).to(dtype) for _ in range(2))
            rows = attention.block_attention(q, k, v, dim ** -0.5)
            mask = torch.ones(q_len, t, dtype=torch.bool).tril(t - q_len)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask[None, None], enable_gqa=True).transpose(1, 2)
            torch.testing.assert_close(rows.float(), want, atol=0.03, rtol=0.03)
            if verdict:
                for i in range(q_len):
                    end = t - q_len + i + 1
                    one = attention.block_attention(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], dim ** -0.5)
                    assert torch.equal(rows[:, i:i + 1], one), (heads, kv, dim, dtype, t, q_len, i)


def test_the_probe_answers_for_the_thread_count_it_ran_at(monkeypatch):
    """The kernel splits its work by the intra-op thread count, so a verdict found at one count is not reused at
    another: each count gets its own probe, each only once."""
    threads = torch.get_num_threads()
    probes = []
    monkeypatch.setattr(attention, "_probe", lambda *key: probes.append(key) or True)
    fresh_verdicts(monkeypatch, attention.VERDICT_KIND)
    for _ in range(2):
        attention.block_is_invariant(8, 2, 32, torch.bfloat16)
    assert len(probes) == 1
    try:
        torch.set_num_threads(threads + 1)
        attention.block_is_invariant(8, 2, 32, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert [p[-1] for p in probes] == [threads, threads + 1]
    VERDICTS.seed(attention.VERDICT_KIND, {(8, 2, 32, torch.bfloat16, "cpu", threads + 7): False})  # an earlier
    # process's
    torch.set_num_threads(threads + 7)
    try:
        assert attention.block_is_invariant(8, 2, 32, torch.bfloat16) is False and len(probes) == 2
    finally:
        torch.set_num_threads(threads)


def test_the_1_5b_shaped_heads_take_the_batched_path(tokenizer, monkeypatch):
    """The tiny model with Qwen2.5-1.5B's heads runs its exact steps' attention in one call per layer where this
    machine's kernel allows it (the bit-equality tests above then cover that path)."""
    if not attention.block_is_invariant(12, 2, 128, torch.bfloat16):
        pytest.skip("this machine's attention kernel does not reduce 12 x 128 heads on 2 key/value heads invariantly")
    dec = ReferenceDecoder(tiny_model("qwen2-h128", vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer)
    calls, real = [], attention.block_attention
    monkeypatch.setattr(attention, "block_attention", lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k))
    with torch.inference_mode():
        cache = dec.steps.new_cache()
        dec.steps.forward(list(range(5, 40)), cache, last_only=True)
        dec.steps.forward(list(range(40, 48)), cache, exact=True)
    assert calls == [8, 8]  # one call per layer, all 8 rows


@pytest.mark.slow
@needs_bf16_units
@pytest.mark.xdist_group("qwen")
def test_the_real_qwen_05b_in_bfloat16_verifies_exactly():
    """Qwen2.5-Coder-0.5B-Instruct in bfloat16: a verify's rows equal the one-token steps' on a 300-token context."""
    from rag_accel.models import QWEN_DRAFT_MODEL

    dec = ReferenceDecoder.from_pretrained(QWEN_DRAFT_MODEL, dtype="bfloat16", calibrate=False)
    assert dec.exact and next(dec.model.parameters()).dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    context, seq = (torch.randint(0, dec.vocab_size, (n,), generator=g).tolist() for n in (300, 33))
    alone, together = _rows(dec, context, seq)
    assert all(torch.equal(logits[i], alone[i]) for k, logits in together.items() for i in range(k))


def test_gpt2s_conv1d_projections_take_an_invariant_plan(tokenizer):
    """GPT-2's projections are transformers' ``Conv1D`` (weight [in, out]), not ``nn.Linear``: they take an invariant
    plan too (unwrapped, a 4-row MLP product differed from one row in the last bit on an AVX-512 CPU without bfloat16
    instructions), and compute what they computed before."""
    model = tiny_model("gpt2", vocab_size=len(tokenizer)).to(torch.bfloat16)
    conv = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        before = conv[0](x)
        assert conv and linears.install_exact(model, linears.exact_plans(model)) == len(conv) + 1  # (+ the head)
        assert all(m.__dict__.get("_rag_accel_exact") is not None for m in conv)
        assert torch.equal(conv[0](x), before)  # (outside exact steps: its own forward)
        with linears.exact_linears():
            torch.testing.assert_close(conv[0](x), before, atol=0.02, rtol=0.02)
            rows = conv[0](x)
            assert all(torch.equal(rows[:, i:i + 1], conv[0](x[:, i:i + 1])) for i in range(5))
