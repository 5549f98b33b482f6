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
from rag_accel.hf.kv import cache_kwarg, cache_of, new_cache


def test_cache_of_reads_either_name():
    cache = object()
    assert cache_of({"cache": cache}) is cache
    assert cache_of({"past_key_values": cache}) is cache
    assert cache_of({"cache": None, "past_key_values": cache}) is cache
    assert cache_of({"input_ids": 1}) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
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
