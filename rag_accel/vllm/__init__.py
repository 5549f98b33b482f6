"""rag_accel inside vLLM: our drafters and draft-length policy as a speculative proposer.

The pieces, each in its own module:

- :mod:`~rag_accel.vllm.proposer`: :class:`RagProposer`, vLLM's ``custom_class`` proposer
  (``speculative_config={"method": "custom_class", "model": "rag_accel.vllm.RagProposer"}``).
  The runner calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` once per
  engine step with one row per request of its persistent batch; each row gets its own
  :class:`~rag_accel.speculation.RequestDrafting` and goes through the same verbs as the HF
  decoder: ``account`` (the last verify), ``learn`` (its new tokens), ``choose`` (the next draft).
  :class:`RowTracker` (``logits_processors=["rag_accel.vllm:RowTracker"]``), a logits processor
  that never changes logits, tells it which request sits in which row (vLLM tells logits
  processors, not proposers), and its ``validate_params`` refuses one bad request at admission
  (HTTP 400 on the server) while the engine serves the others.
- :mod:`~rag_accel.vllm.requests`: the engine's speculative config and the server's settings, under which a
  request's inputs (``extra_args`` / ``vllm_xargs``, one schema: :class:`rag_accel.wire.RequestArgs`) are read and
  checked.
- :mod:`~rag_accel.vllm.costs`: :class:`BatchStepCosts`, what a draft token costs a batch, learnt
  from the engine's steps.
- :mod:`~rag_accel.vllm.patches`: the two changes to vLLM's internals, declared, applied once per
  process (vLLM's plugin entry point), and checked against the installed vLLM by a test.
- :mod:`~rag_accel.vllm.decoder`: :class:`VllmDecoder`, :class:`~rag_accel.hf.decoder.ReferenceDecoder`'s
  surface (``generate`` / ``stream`` / ``generate_batch``, the same outputs and stats) on a
  ``vllm.LLM`` in this process.

Per-request inputs travel in ``SamplingParams.extra_args`` (the OpenAI server fills it
from ``vllm_xargs``), in one versioned schema (:class:`rag_accel.wire.RequestArgs` writes and reads it)::

    {"rag_accel_schema": 1,                          # its version (our clients write it; absent: 1)
     "references": ["passage text", [12, 34, 56]],   # strings or token-id lists
     "answers": ["a cached answer to a similar question"],  # earlier answers: drafted as the memory's
     "speculate": False,                               # this request: no drafting
     "rag_accel": {"max_loss": 0.05}}                  # DecoderConfig changes

Over HTTP (``vllm_xargs`` allows only strings, numbers and flat lists of them) token-id
references travel as ``"reference_ids": "[[12, 34, 56]]"`` (a JSON string; answers as ``"answer_ids"``),
``rag_accel`` as a JSON string, and ``speculate`` arrives as ``0``/``1``: :meth:`RequestArgs.read <rag_accel.wire.RequestArgs.read>` reads both shapes.

Cost of a draft at batch size ``B``: the engine learns its step time as a line in the tokens it
schedules (:class:`~rag_accel.vllm.costs.BatchStepCosts`), each step timed as the whole engine
cycle (one ``propose`` call to the next); ``L`` draft tokens on one row slow all ``B`` rows, so a
busy, compute-bound batch drafts less.

Sampled requests (``temperature > 0``) stay lossless: vLLM verifies a draft without
draft probabilities as a point mass (accept with the target probability, else sample
the rest of the distribution), as for its own n-gram proposer.

Tensor parallel (every rank drafts the same) and data parallel (each engine its own proposer) layouts run the
proposer where vLLM samples; pipeline parallelism is refused before an engine starts (vLLM runs no speculative
decoding with it: :data:`~rag_accel.vllm.requests.PIPELINE_REFUSED`). See docs/vllm-and-serving.md, "Beyond one
machine", for what was run.
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
