"""The proposer and its batch view, both run by vLLM in the worker that samples.

- :class:`RowTracker`: which request sits in which row of vLLM's persistent batch, from the
  ``BatchUpdate`` s vLLM gives logits processors (never proposers); never changes logits.
- :class:`RagProposer`: one :class:`~rag_accel.speculation.RequestDrafting` per row, driven
  through the same verbs as the HF decoder (``account``, ``learn``, ``choose``).

A row's references are set up as the transformers decoder's are (:class:`~rag_accel.references.ReferenceSetUp`:
one limit, one threshold): those of up to :data:`~rag_accel.references.WAITED_REFERENCE_SIZE` characters or
ids in all in the step that starts it (about a millisecond), so a short prediction drafts from the first
step; larger ones on a background thread, never in the engine's step loop: until their index is ready
the row drafts from its prompt and output, and one big reference never stalls the other requests of the
batch. A row that leaves the batch first stops their set-up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..drafters import Drafter, chain_order
from ..references import TokenCache
from ..memory import AnswerMemory
from ..outputs import GenerationStats
from ..policy import AcceptanceStats
from ..references import ReferenceSetUp
from ..speculation import RequestDrafting
from . import patches
from .costs import BatchStepCosts
from .requests import ServerSettings, check_extra_args, check_layout

try:  # the module imports without vLLM (docs, doctests); using it needs vLLM
    from vllm.v1.sample.logits_processor import LogitsProcessor as _LogitsProcessor
except ImportError:  # pragma: no cover - exercised only without vLLM
    _LogitsProcessor = object  # type: ignore[assignment,misc]

__all__ = ["RagProposer", "RowTracker", "merged_stats"]

log = logging.getLogger("rag_accel.vllm")


class _Row:
    """One request in a batch row: its parameters, and its drafting once it has a first token."""

    __slots__ = ("config", "refs", "answers", "speculate", "greedy", "max_tokens", "prompt_len", "key", "scope",
                 "drafting", "context", "sent", "source", "stats", "error", "pending")

    def __init__(self, params: Any, prompt_ids: Sequence[int] | None, vocab_size: int | None) -> None:
        extra = params.extra_args or {}
        self.key = extra.get("rag_accel_id")
        # references, the earlier answers it brings (a cached answer), whether to draft, its config, its memory
        # scope (None: no memory of earlier answers): read once
        args = ServerSettings.current().read(extra, vocab_size)
        self.refs, self.answers = ([r if isinstance(r, str) else list(r) for r in given]
                                   for given in (args.references, args.answers))
        self.speculate, self.config, self.scope = args.speculate, args.config, args.memory_scope
        self.greedy = (params.temperature or 0.0) < 1e-5
        self.max_tokens = params.max_tokens
        self.prompt_len = len(prompt_ids) if prompt_ids is not None else None
        self.drafting: RequestDrafting | None = None
        self.context: list[int] = []
        self.sent, self.source = 0, ""
        self.stats = GenerationStats(prompt_tokens=self.prompt_len or 0)
        self.error: str | None = None
        self.pending: ReferenceSetUp | None = None  # its reference and answers drafters, until they join


class RowTracker(_LogitsProcessor):
    """Which request sits in which row of vLLM's batch; refuses bad ``extra_args`` per request.

    Never changes logits (argmax-invariant, ``apply`` returns them as they are). Built by
    vLLM (``logits_processors=[TRACKER_PATH]``: admission checks only) or, in the worker,
    by the declared ``build_logitsprocs`` patch (:mod:`rag_accel.vllm.patches`), which links
    it to the proposer.
    """

    def __init__(self, vllm_config: Any, device: Any = None, is_pin_memory: bool = False) -> None:
        self.rows: dict[int, _Row] = {}
        self.added = False  # a request joined this step (its prefill is in the step)
        self.finished: list[_Row] | None = None  # rows that left the batch, when the proposer collects them
        self.vocab_size = None
        try:
            self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        except Exception:  # noqa: BLE001 - a config without a model (tests)
            pass

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """vLLM's admission check (the server answers HTTP 400 with the message): the types,
        the size limit, token ids within the served model's vocabulary, and a prediction's shape."""
        check_extra_args(sampling_params.extra_args, ServerSettings.current().vocab_size)

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: Any) -> Any:
        return logits

    def _new_row(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        if params is None:
            return None
        try:
            return _Row(params, prompt_ids, self.vocab_size)
        except Exception as e:  # noqa: BLE001 - admission checks it; never fail the engine over one row
            log.warning("rag_accel: request not drafted: %s", e)
            return None

    def update_state(self, batch_update: Any) -> None:
        self.added = bool(batch_update and batch_update.added)
        if not batch_update:  # (most steps: the same rows as the last one)
            return
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        before = list(self.rows.values()) if self.finished is not None else None
        process_dict_updates(self.rows, batch_update, self._new_row)
        if before:  # finished, aborted or preempted (a replaced row is not in `removed`: compare)
            live = {id(r) for r in self.rows.values()}
            self.finished.extend(r for r in before if id(r) not in live)


class RagProposer:
    """vLLM ``custom_class`` proposer: reference copy and frequency drafts (prompt lookup, n-grams: opt-in) per
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
        check_layout(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1),
                     patches.vllm_version())
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.curve = BatchStepCosts.curve(self.k)  # scaled per step (set_batch)
        self.costs = BatchStepCosts()
        self.acceptance = {True: AcceptanceStats(), False: AcceptanceStats()}  # greedy, sampled
        self.memory = AnswerMemory(ServerSettings.current().answer_memory_tokens)  # earlier answers, per memory scope
        self.stats: OrderedDict[str, list[GenerationStats]] = OrderedDict()
        self.tracker: RowTracker | None = None
        self._tokenizer: Any = None
        self._tokenizer_name = vllm_config.model_config.tokenizer
        self._refs_pool: ThreadPoolExecutor | None = None  # sets up references too big to wait for
        self.reference_tokens = TokenCache()  # texts tokenised lately: a passage that comes back is tokenised once
        self._last_tokens: int | None = None  # tokens the step now running scheduled (None: not a decode step)
        self._last_t0: float | None = None  # when propose was last called
        self.draft_s = 0.0  # host time spent in propose, all rows
        patches.apply_worker_patches()
        patches.expect_tracker(vllm_config, self)

    @staticmethod
    def make_tracker(vllm_config: Any, device: Any, is_pin_memory: bool) -> RowTracker:
        """The batch view the declared ``build_logitsprocs`` patch builds for this proposer's runner."""
        return RowTracker(vllm_config, device, is_pin_memory)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load. vLLM's runners call this once their batch is built, so it is where a
        proposer without a batch view refuses to start (:func:`patches.require_tracker`). The tokenizer
        for text references starts loading here, on the references' thread: loaded on the first request
        instead, it kept that request's references (a prediction's parts) from drafting until the answer
        was nearly done."""
        patches.require_tracker(self)
        self._pool().submit(self._ensure_tokenizer)

    def _pool(self) -> ThreadPoolExecutor:
        if self._refs_pool is None:
            self._refs_pool = ThreadPoolExecutor(1, thread_name_prefix="rag-accel-references")
        return self._refs_pool

    def _ensure_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_name)
        return self._tokenizer

    # ---------------------------------------------------------------- references, off the step loop
    def _attach(self, row: _Row) -> None:
        """The row's references are set up (or failed): their drafters join the row's chain in their place."""
        setup, row.pending = row.pending, None
        try:
            drafters = setup.take() or []
        except Exception as e:  # noqa: BLE001 - bad references cost this request its reference drafts only
            log.warning("rag_accel: references of a request not used: %s", e)
            return
        for drafter in drafters:
            self._insert(row, drafter)

    @staticmethod
    def _insert(row: _Row, drafter: Drafter | None) -> None:
        """A reference or memory drafter joins the row's chain where the config's order puts it, the
        memory (and a request's answers, drafted as the memory) just after the references (the HF
        decoder's big references join the same way)."""
        if drafter is not None and row.drafting is not None:
            row.drafting.add_drafter(drafter, chain_order(row.config.drafters))

    # ---------------------------------------------------------------- the memory of answers
    def _remember(self, rows: Sequence[_Row]) -> None:
        """Rows that left the batch: each drafted row's output joins its scope's memory (a preempted
        row's output so far too: it is what the model said, and it comes back as a new row)."""
        for row in rows:
            if row.pending is not None:  # (its references are no longer needed)
                row.pending.stop()
            if row.scope is not None and row.drafting is not None and row.prompt_len is not None:
                self.memory.add(row.scope, row.context[row.prompt_len:])

    def _insert_memory(self, row: _Row) -> None:
        """Earlier answers of the row's scope, just after its references in its chain (a request that
        leaves out the reference drafter leaves out the memory too), drafting with the frequency drafter's
        settings."""
        if row.scope is not None and "reference" in row.config.drafters:
            self._insert(row, self.memory.drafter(row.scope))

    # ---------------------------------------------------------------- per row
    def _start(self, row: _Row, context: list[int]) -> None:
        """The row's first token is out: build its drafting over prompt + that token."""
        row.context = context
        if row.prompt_len is None:
            row.prompt_len = len(context) - 1
            row.stats.prompt_tokens = row.prompt_len
        if not row.speculate:
            return
        row.drafting = RequestDrafting.from_config(
            row.config, context, [], self.curve[:row.config.max_draft_tokens + 1],
            self.acceptance[row.greedy], self.costs)
        row.drafting.prefill_steps = self.costs.prefill_steps(row.prompt_len)
        self._insert_memory(row)  # (before the references: they go in front of it)
        given = [*row.refs, *row.answers]
        if "reference" in row.config.drafters and any(len(r) for r in given):
            setup = ReferenceSetUp(row.refs, row.answers, self._ensure_tokenizer, row.config.max_reference_tokens,
                                   self.reference_tokens)
            row.pending = setup
            texts_ready = self._tokenizer is not None or all(not isinstance(r, str) for r in given)
            if setup.waited and texts_ready:
                setup.run()
                self._attach(row)
            else:
                self._pool().submit(setup.run)
        if row.key is not None:
            self._keep_stats(row)

    def _keep_stats(self, row: _Row) -> None:
        """Keep the row's stats under its request's key for :meth:`pop_stats`. Several rows may share a key:
        the choices of one request (``n > 1``), the prompts of one ``/v1/completions`` call, a preempted
        request back in a new row; their stats are added up when popped."""
        rows = self.stats.setdefault(row.key, [])
        if not any(s is row.stats for s in rows):
            rows.append(row.stats)
        while len(self.stats) > 10_000:  # nobody collected them
            self.stats.popitem(last=False)

    def _step(self, row: _Row, new: list[int], n: int, token_ids_cpu: Any, i: int, dt: float | None) -> list[int]:
        stats = row.stats
        if row.drafting is None and not row.context:
            if row.key is not None and not row.speculate:
                self._keep_stats(row)
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
                if row.pending is not None:
                    row.pending.stop()
                row.drafting, row.context, row.pending = None, [], None
                self._start(row, token_ids_cpu[i, :n].tolist())
                if row.drafting is None:
                    return []
        if row.pending is not None and row.pending.done:
            self._attach(row)
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
        if tracker is None:
            patches.require_tracker(self)  # raises: drafting blind would lose the speed-up silently
        rows = tracker.rows
        if tracker.finished:
            done, tracker.finished = tracker.finished, []
            self._remember(done)
        elif tracker.finished is None and self.memory.max_tokens:
            tracker.finished = []  # from now on the tracker collects the rows that leave
        n_rows = len(sampled_token_ids)
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
                if row.pending is not None:
                    row.pending.stop()
                row.error, row.drafting, row.sent, row.pending = repr(e), None, 0, None
                drafts.append([])
        self._last_tokens = n_rows + sum(len(d) for d in drafts)
        self._last_t0 = t0
        self.draft_s += time.perf_counter() - t0
        return drafts

    def reset_learning(self) -> None:
        """Forget what earlier requests taught (acceptance rates, step costs, remembered answers): a
        fresh engine's proposer. Requests in flight keep their own state until they finish."""
        self.memory = AnswerMemory(self.memory.max_tokens)
        self.costs = BatchStepCosts()
        self.acceptance = {True: AcceptanceStats(), False: AcceptanceStats()}

    def pop_stats(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """The stats of these requests as dicts (``None``: unknown), forgotten here; the rows of one key
        added up (:func:`merged_stats`)."""
        out = []
        for key in keys:
            rows = self.stats.pop(key, None)
            out.append(None if not rows else merged_stats(rows))
        return out


_SUMMED = ("steps", "drafted", "accepted", "new_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")


def merged_stats(rows: Sequence[GenerationStats]) -> dict[str, Any]:
    """One request's stats as a dict, its rows' counts added up (one row: its stats as they are).

    Example:
        >>> a, b = GenerationStats(), GenerationStats()
        >>> a.record_step("reference", 4, 3); b.record_step("reference", 2, 0); b.record_step("", 0, 0)
        >>> d = merged_stats([a, b])
        >>> d["steps"], d["drafted"], d["by_drafter"]["reference"], d["rejected_prediction_tokens"]
        (3, 6, {'steps': 2, 'drafted': 6, 'accepted': 3}, 3)
    """
    first = dataclasses.asdict(rows[0])
    for other in rows[1:]:
        more = dataclasses.asdict(other)
        for name in _SUMMED:
            first[name] += more[name]
        first["trace"] += more["trace"]
        for source, counts in more["by_drafter"].items():
            mine = first["by_drafter"].setdefault(source, dict.fromkeys(counts, 0))
            for k, v in counts.items():
                mine[k] = mine.get(k, 0) + v
    first["trace"] = [list(t) for t in first["trace"]]
    return first
