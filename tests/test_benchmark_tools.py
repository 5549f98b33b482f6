"""The parts of the benchmarks that a committed result rests on and that can be checked here, without the
machine that timed it: the GPU step-cost benchmark's static step (it must be the model's own forward, or its
timings price something else)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_step_costs_static_step_is_the_models_forward():
    """The CUDA-graph step written out in torch gives transformers' logits in float32, for a whole sequence and
    for the last tokens over the KV cache it filled itself (rotary positions, grouped-query attention, mask)."""
    pytest.importorskip("transformers")
    errors = load("gpu_step_costs").check(atol=1e-4)
    assert set(errors) == {"whole", "tail"}
    assert max(errors.values()) <= 1e-4
