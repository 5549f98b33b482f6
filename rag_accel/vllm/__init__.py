"""rag_accel inside vLLM: our drafters and draft-length policy as a speculative proposer.

- :mod:`~rag_accel.vllm.proposer`: :class:`RagProposer`, vLLM's ``custom_class`` proposer, called once per engine
  step with one row per request of its batch; each row gets its own
  :class:`~rag_accel.speculation.RequestDrafting` and goes through the transformers decoder's verbs (``account``,
  ``learn``, ``choose``). :class:`RowTracker`, a logits processor that never changes logits, tells it which request
  sits in which row (vLLM tells logits processors, not proposers) and refuses a bad request at admission.
- :mod:`~rag_accel.vllm.requests`: the engine's speculative config and the server's settings, under which a
  request's inputs (``extra_args`` / ``vllm_xargs``, one schema: :class:`rag_accel.wire.RequestArgs`) are read.
- :mod:`~rag_accel.vllm.costs`: :class:`BatchStepCosts`, what a draft token costs a batch, learnt from its steps.
- :mod:`~rag_accel.vllm.exact`: exact steps in the engine's CPU worker.
- :mod:`~rag_accel.vllm.patches`: every change to vLLM's internals, declared, applied once per process, checked
  against the installed vLLM by a test.
- :mod:`~rag_accel.vllm.launch`: where an engine rag_accel starts writes.
- :mod:`~rag_accel.vllm.decoder`: :class:`VllmDecoder`, :class:`~rag_accel.hf.decoder.ReferenceDecoder`'s surface on
  a ``vllm.LLM`` in this process.

Sampled requests stay lossless: vLLM verifies a draft without draft probabilities as a point mass, as for its own
n-gram proposer. Parallel layouts, the request schema over HTTP and what was run: ``docs/vllm-and-serving.md``.
"""

from typing import Any

from .requests import (
    PROPOSER_PATH,
    SERVE_MAX_REFERENCE_TOKENS,
    SPECULATION,
    TRACKER_PATH,
    RequestArgs,
    ServerSettings,
    check_extra_args,
    speculative_config,
)

__all__ = ["BatchStepCosts", "PROPOSER_PATH", "RagProposer", "RowTracker", "SERVE_MAX_REFERENCE_TOKENS",
           "SPECULATION", "TRACKER_PATH", "RequestArgs", "ServerSettings", "VllmDecoder", "check_extra_args",
           "speculative_config"]

# Imported on first use (PEP 562), so that reading a request's inputs (rag_accel.serving.remote, rag-accel serve)
# imports neither vLLM nor torch. vLLM resolves "rag_accel.vllm.RagProposer" and "rag_accel.vllm:RowTracker"
# with import + getattr, which lands here.
_LAZY = {"RagProposer": ".proposer", "RowTracker": ".proposer", "VllmDecoder": ".decoder",
         "BatchStepCosts": ".costs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
