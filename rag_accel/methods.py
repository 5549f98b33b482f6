"""The benchmark's methods by name: what ``rag-accel bench --methods`` takes (no heavy imports, so the
command line can list them without loading torch)."""

from __future__ import annotations

from typing import Any

from .config import DEFAULT_COPY_DRAFTERS

# name -> DecoderConfig changes: our shipped configurations (A/B toggles of internals live in benchmarks/experiments/)
OUR_METHODS: dict[str, dict[str, Any]] = {
    "ours": {"drafters": DEFAULT_COPY_DRAFTERS},  # the default configuration (named: a decoder may hold a draft model)
    "ours-fixed": {"drafters": DEFAULT_COPY_DRAFTERS, "adaptive": False, "max_draft_tokens": 10},  # every draft sent whole, as LLMA / prompt lookup
    "ours-ref": {"drafters": ("reference",)},  # the references alone
    "ours-pld": {"drafters": ("prompt_lookup",)},  # the opt-in fallbacks, each alone
    "ours-ngram": {"drafters": ("ngram",)},
    # With a draft model (--draft-model): the draft model alone, and the copy drafters first, then the draft model.
    "ours-draft": {"drafters": ("draft_model",)},
    "ours-hybrid": {"drafters": (*DEFAULT_COPY_DRAFTERS, "draft_model")},
    # No drafting: our decoder's plain steps alone (on a CPU its projections take the planned layouts, hf/linears.py),
    # what of ours' lead over greedy is not the drafts'.
    "ours-plain": {"drafters": ()},
}
BASELINES = ("greedy", "hf-pld", "hf-assisted")
NEEDS_DRAFT_MODEL = ("ours-draft", "ours-hybrid", "hf-assisted")
# name -> the engine's speculation (rag_accel.vllm.SPECULATION); each runs on its own vLLM engine.
VLLM_METHODS = {"vllm-greedy": "off", "vllm-ngram": "ngram", "vllm-suffix": "suffix", "vllm-suffix-f3": "suffix",
                "vllm-suffix-elsewhere": "suffix", "vllm-ours": "ours", "vllm-ours-memory": "ours"}
# vLLM methods whose engine's speculative_config differs from that speculation's defaults: name -> the settings
# (vLLM's names). vllm-suffix-f3 is suffix decoding tuned: a draft up to 3 times its match long, the best
# max_spec_factor of 1-3 when its drafting was replayed on the sample's first 50 answers
# (benchmarks/results/suffix_replay_smollm2_first50.md); vLLM's default is 1.
SPECULATIVE_SETTINGS: dict[str, dict[str, Any]] = {"vllm-suffix-f3": {"suffix_decoding_max_spec_factor": 3.0}}
# Environment for the benchmarks' vLLM engines (set unless the caller set it; each run records it): what a user
# of vLLM's n-gram speculation on a CPU would set. Its proposer runs a numba parallel loop every step, and numba's
# default threading layer here is OpenMP, whose idle workers spin beside torch's threads on the same cores: on
# this 2-core CPU vllm-ngram ran 0.75x / 0.56x vLLM greedy at 1 / 4 in flight with it, 1.20x / 0.95x with numba's
# workqueue layer (benchmarks/experiments/numba_layer.py; results/numba_layer_vllm_cpu_smollm2.md). No other method runs numba.
PEER_ENVIRONMENT = {"NUMBA_THREADING_LAYER": "workqueue"}
# vLLM methods whose engine's requests share a memory scope (rag_accel.memory): this one.
MEMORY_SCOPE = {"vllm-ours-memory": "bench"}
# Methods whose engine copies from its own earlier outputs (vLLM's suffix decoding keeps a tree of past
# responses): run on a prompt it has answered before, it copies that answer. So the benchmark never shows
# them a prompt twice: the warm-up is an item that is not timed, one round per item, and they sit out the
# concurrency table (its levels repeat the items). In the reworded case they have the original question's
# answer in that tree, as a deployed engine would: the peer of our cached-answer reference. vllm-ours-memory is
# our proposer with the memory of earlier answers (one scope for all its requests): the same rules, and in the
# reworded case it gets the passages only, the cached answer being in its memory, as suffix's is in its tree.
REMEMBERS_OUTPUTS = ("vllm-suffix", "vllm-suffix-f3", "vllm-suffix-elsewhere", "vllm-ours-memory")
# Methods that run the reworded case only: vllm-suffix-elsewhere is vLLM's suffix decoding on another engine than
# the one that answered the questions first (another data-parallel engine, or the same server after a restart):
# its tree holds the reworded answers it gave before the item, never the original's, which the client's cached
# answer (vllm-ours's reference) still carries to whichever engine serves the request.
REWORDED_ONLY = ("vllm-suffix-elsewhere",)
ALL_METHODS = (*BASELINES, *OUR_METHODS, *VLLM_METHODS)
