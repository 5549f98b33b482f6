"""Grouped-query attention without copying the cache (rag_accel.hf.attention)."""

from __future__ import annotations

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model

import rag_accel.hf.attention as attention
from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf.kv import cache_kwarg


def _reference(query, key, value, mask, scaling):
    """The copying way: every query head gets its own copy of its key/value head."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def _offset_causal(q, k, bool_mask):
    """Q new positions on top of K - Q cached ones, as in a verify step."""
    allowed = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]  # [Q, K]
    if bool_mask:
        return allowed[None, None]
    return torch.zeros(q, k).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("kernel_gqa", [False, True])
@pytest.mark.parametrize("bool_mask", [False, True])
@pytest.mark.parametrize("heads,kv_heads,q", [(4, 2, 5), (9, 3, 11), (6, 1, 2), (8, 8, 3)])
def test_packed_attention_equals_copied_heads(kernel_gqa, bool_mask, heads, kv_heads, q):
    if kernel_gqa and not attention._HAS_ENABLE_GQA:
        pytest.skip("this torch has no enable_gqa")
    g = torch.Generator().manual_seed(heads * 100 + q)
    k = 37
    query = torch.randn(2, heads, q, 16, generator=g)
    key, value = torch.randn(2, kv_heads, k, 16, generator=g), torch.randn(2, kv_heads, k, 16, generator=g)
    mask = _offset_causal(q, k, bool_mask)
    got = attention.pack_gqa_attention(query, key, value, mask, 0.25, kernel_gqa=kernel_gqa)
    want = _reference(query, key, value, mask, 0.25)
    assert got.shape == (2, q, heads, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_gqa", [False, True])
def test_per_head_mask_is_packed_with_its_heads(kernel_gqa):
    if kernel_gqa and not attention._HAS_ENABLE_GQA:
        pytest.skip("this torch has no enable_gqa")
    g = torch.Generator().manual_seed(7)
    query = torch.randn(1, 6, 4, 8, generator=g)
    key, value = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    mask = torch.rand(1, 6, 4, 9, generator=g) > 0.3
    mask[..., 0] = True  # every row attends somewhere
    got = attention.pack_gqa_attention(query, key, value, mask, None, kernel_gqa=kernel_gqa)
    torch.testing.assert_close(got, _reference(query, key, value, mask, None), rtol=1e-5, atol=1e-5)


class _Count:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = attention.pack_gqa_attention

        def counting(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(attention, "pack_gqa_attention", counting)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_verifies_with_packed_heads_and_stays_exact(arch, tokenizer, monkeypatch):
    model = tiny_model(arch, vocab_size=len(tokenizer))  # 4 query heads over 2 key/value heads
    count = _Count(monkeypatch)
    prompt = list(range(5, 45))
    want = hf_greedy(model, prompt, 30)
    assert count.calls == 0  # generate() outside the decoder's verify forwards: the model's own path
    for pack, mode in [(True, "right"), (True, "wrong"), (False, "mix")]:
        dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=6))
        dec.steps.pack_gqa = pack  # (a class constant; an experiment may set it on an instance)
        before = count.calls
        out = dec.generate(prompt, max_new_tokens=30, drafters=[OracleDrafter(want, len(prompt), mode, dec.vocab_size)])
        assert out.token_ids == want
        layers = model.config.num_hidden_layers
        if pack:  # every layer of every multi-token verify step, nothing else
            multi = sum(1 for src, _ in out.stats.trace if src)
            assert multi > 0 and count.calls - before == layers * multi
        else:
            assert count.calls == before


def test_packing_is_off_outside_the_decoder_and_in_other_threads(tokenizer, monkeypatch):
    import threading

    model = tiny_model("llama", vocab_size=len(tokenizer))
    ReferenceDecoder(model, tokenizer)  # installs the wrapper
    count = _Count(monkeypatch)
    x = torch.arange(3, 23)[None]
    with torch.inference_mode():
        out = model(x, use_cache=True)
        past = out.cache if cache_kwarg(model) == "cache" else out.past_key_values  # renamed with the argument
        model(torch.tensor([[7, 8, 9]]), **{cache_kwarg(model): past})  # multi-token, cached, masked
    assert count.calls == 0
    seen = []
    with attention.packed_gqa():
        t = threading.Thread(target=lambda: seen.append(attention._ACTIVE.get()))
        t.start()
        t.join()
        assert attention._ACTIVE.get()
    assert seen == [False] and not attention._ACTIVE.get()
