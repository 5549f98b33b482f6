"""The transformers engine: :class:`~rag_accel.hf.decoder.ReferenceDecoder` runs the decode loop in this process.

- :mod:`~rag_accel.hf.decoder`: the loop (prefill, then per step: choose a draft, verify it in one forward pass,
  accept the longest greedy-equal prefix plus the model's own token, roll the KV cache back).
- :mod:`~rag_accel.hf.kv`: the model's KV cache as the loop uses it (make, roll back, the window).
- :mod:`~rag_accel.hf.attention`, :mod:`~rag_accel.hf.linears`: faster forwards on a CPU, same numbers
  up to float rounding (packed grouped-query attention; each projection's few-row products in the layout
  measured fastest for its weight).
- :mod:`~rag_accel.hf.draft_models`: small transformers models as drafters (same or another tokenizer).

What both engines share (drafters, matching kernels, the draft-length policy, a request's drafting verbs) sits
one level up; the vLLM engine is :mod:`rag_accel.vllm`. ``from rag_accel import ReferenceDecoder`` is the usual
way in.
"""
