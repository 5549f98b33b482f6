from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def real_decoder():
    """The offline default model (SmolLM2-135M-Instruct), float32 on CPU: greedy outputs are exact.
    One per process (``shared_decoder``), so a run of every suite from the repository root loads it once."""
    from rag_accel import DEFAULT_MODEL
    from rag_accel.adapters import shared_decoder

    return shared_decoder(DEFAULT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def remote_server():
    """A `rag-accel serve` server (our proposer, the offline model, float32) started with the Python named
    by RAG_ACCEL_VLLM_PYTHON (a virtualenv with vLLM: it cannot share this one), one per test process.
    Skipped when that is unset, an error when RAG_ACCEL_REQUIRE_VLLM=1 (rag_accel.serving.server_process)."""
    from rag_accel.serving.server_process import shared_test_server

    return shared_test_server()
