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
    Skipped when that is unset, an error when RAG_ACCEL_REQUIRE_VLLM=1."""
    python = os.environ.get("RAG_ACCEL_VLLM_PYTHON")
    if not python:
        if os.environ.get("RAG_ACCEL_REQUIRE_VLLM") == "1":
            pytest.fail("RAG_ACCEL_REQUIRE_VLLM=1 but RAG_ACCEL_VLLM_PYTHON is unset: name a Python with vLLM")
        pytest.skip("remote mode needs a server: set RAG_ACCEL_VLLM_PYTHON to a Python with vLLM "
                    "(e.g. .venv-vllm/bin/python; README, 'Run the tests')")
    if os.environ.get("RAG_ACCEL_REQUIRE_VLLM") != "1":
        pytest.importorskip("openai", reason="remote mode needs the openai client: pip install 'rag-accel[remote]'")
    from rag_accel.server_process import shared_server

    bind = "0-1" if (os.cpu_count() or 1) >= 2 else "0"
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind)}
    return shared_server(python, options=["--max-model-len", "2048"], vllm_args=["--enforce-eager"], env=env,
                         timeout=float(os.environ.get("RAG_ACCEL_SERVE_TIMEOUT", "900")))
