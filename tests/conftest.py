from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir():
    from rag_accel.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def real_decoder():
    # shared_decoder: one per process, the same object the adapters' test suites use in a run from the root
    from rag_accel import DEFAULT_MODEL
    from rag_accel.adapters import shared_decoder

    return shared_decoder(DEFAULT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def e5():
    from rag_accel.rag.retrieval import OFFLINE_E5, Embedder

    return Embedder(OFFLINE_E5)


@pytest.fixture(scope="session")
def vllm_greedy():
    """vLLM's own greedy decoding, the vLLM suites' reference: the offline model in float32 on an engine
    without a speculative config (2048 tokens, eager). One engine for the run: tests/test_vllm.py and
    tests/test_serve.py compare with it (a start takes 40-140 s on this 2-core machine)."""
    from rag_accel.vllm import VllmDecoder

    dec = VllmDecoder.from_pretrained("smollm2-135m-instruct", speculation="off", max_model_len=2048,
                                      enforce_eager=True)
    yield dec
    dec.close()
