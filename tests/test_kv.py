"""The KV cache helpers: the cache goes to ``forward`` under the name the installed transformers
takes (``cache`` from 5.24 on, ``past_key_values`` before), and hooks find it under either."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers
from helpers import tiny_model
from packaging.version import Version

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf.draft_models import ModelDrafter
from rag_accel.hf.kv import cache_kwarg, cache_of, new_cache, rollback_cache


def test_cache_of_reads_either_name():
    cache = object()
    assert cache_of({"cache": cache}) is cache
    assert cache_of({"past_key_values": cache}) is cache
    assert cache_of({"cache": None, "past_key_values": cache}) is cache
    assert cache_of({"input_ids": 1}) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gemma3"])
def test_cache_kwarg_is_a_parameter_of_the_models_forward(arch):
    model = tiny_model(arch, vocab_size=64)
    name = cache_kwarg(model)
    assert name in inspect.signature(model.forward).parameters
    # renamed in transformers 5.24.0 (its modeling_llama.py: 5.23.0 takes past_key_values, 5.24.0 cache)
    assert name == ("cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values")


def _deprecation_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if "past_key_values" in str(w.message)]


def test_decoder_and_draft_model_pass_the_cache_under_the_current_name(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    x = torch.arange(3, 13)[None]
    if cache_kwarg(model) == "cache":
        # The check can fail: the deprecated name does warn on this transformers.
        with torch.inference_mode():
            assert _deprecation_warnings(lambda: model(x, past_key_values=new_cache(model), use_cache=True))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(max_draft_tokens=4))
    drafter = ModelDrafter(tiny_model("llama", vocab_size=len(tokenizer), seed=1), confidence=0.0)
    prompt = list(range(3, 40))
    assert not _deprecation_warnings(lambda: dec.generate(prompt, references=[prompt], max_new_tokens=8))
    assert not _deprecation_warnings(lambda: drafter.propose(prompt, 3))


def test_a_sliding_window_cache_rolls_back_past_its_window_and_keeps_only_the_window():
    """Gemma-style layers (an 8-token window beside a full-attention layer): after a verify forward that
    passed the window, the rejected tokens are dropped and what the window layer keeps is its window
    again, so memory stays bounded; the logits after a rollback are those of a cache that never saw the
    rejected tokens (to float32 rounding: the kept draft tokens were computed in a 5-token forward there)."""
    model = tiny_model("gemma3", vocab_size=64)
    window, full = new_cache(model).layers
    assert window.is_sliding and not getattr(full, "is_sliding", False)

    def forward(ids, cache):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), **{cache_kwarg(model): cache}).logits[0]

    prompt, draft, rejected = list(range(1, 21)), [30, 31, 32, 33, 34], 3
    cache = new_cache(model)
    forward(prompt, cache)
    rollback_cache(cache, 0)  # nothing rejected: the window layer is trimmed back all the same
    assert cache.layers[0].keys.shape[-2] == 7 and cache.layers[1].keys.shape[-2] == 20
    forward(draft, cache)
    rollback_cache(cache, rejected)
    assert cache.get_seq_length() == 22 and cache.layers[0].keys.shape[-2] == 7
    after = forward([40], cache)
    fresh = new_cache(model)
    forward(prompt + draft[:-rejected], fresh)
    assert torch.allclose(after, forward([40], fresh), rtol=0, atol=1e-6)
    unrolled = new_cache(model)  # (without the rollback: the rejected tokens would be attended to)
    forward(prompt + draft, unrolled)
    assert not torch.allclose(after, forward([40], unrolled), rtol=0, atol=1e-6)
