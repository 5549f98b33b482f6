"""Requests in flight on vLLM engines, for the benchmarks that time groups of them: the engines, the prompts,
the timed groups and their sums.

Used by ``benchmarks/inflight_bench.py``, ``benchmarks/long_documents.py``, ``benchmarks/config_ab.py``,
``benchmarks/readme_table.py`` and the experiments ``engine_order.py``, ``numba_layer.py`` and ``step_costs.py``.
vLLM only inside the functions that build engines (the vLLM virtualenv); the sums are plain Python.
"""

from __future__ import annotations

import time
from typing import Any

#: Our proposer's methods: the ones a group's references are passed to.
OURS = ("vllm-ours", "vllm-ours-memory", "vllm-ours-control")


def ngram_config(k: int, schedule: list[tuple[int, int, int]] | None = None) -> dict:
    """vLLM's n-gram speculation as the bench's vllm-ngram runs it, with a dynamic schedule if given."""
    from rag_accel.vllm.requests import speculative_config

    cfg = speculative_config("ngram", k)
    if schedule is not None:
        cfg["num_speculative_tokens_per_batch_size"] = [list(e) for e in schedule]
    return cfg


def make_engines(specs: dict[str, dict], model: str, k: int, max_model_len: int, spare_first: bool = False) -> dict:
    """One engine per spec, named by its key, in the peers' environment (:func:`rag_accel.bench.peer_environment`).
    ``spare_first``: a spare plain engine with the same settings built and closed before them
    (:func:`rag_accel.bench.spare_engine`), so none is the process's first."""
    from rag_accel.vllm import VllmDecoder
    from rag_accel.bench.harness import peer_environment, spare_engine

    common = dict(max_draft_tokens=k, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
                  enable_prefix_caching=False)
    peer_environment()
    if spare_first:
        spare_engine(model, **common)
    engines = {}
    for name, spec in specs.items():
        print(f"starting {name} ...", flush=True)
        engines[name] = VllmDecoder.from_pretrained(model, disable_log_stats=False, **common, **spec)
    return engines


def take_prompts(items: Any, n_by_level: dict[int, int], tokenizer_dec: Any) -> tuple[dict, dict, dict]:
    """``n_by_level[c]`` items for each level ``c`` in turn: their prompts (token ids of the RAG chat prompt),
    references (the passages) and ids, by level."""
    from rag_accel.rag.msmarco import rag_messages

    prompts, refs, ids, i = {}, {}, {}, 0
    for c, n in n_by_level.items():
        chunk = items[i:i + n]
        i += n
        prompts[c] = [tokenizer_dec.encode_prompt(rag_messages(it.query, it.passages)) for it in chunk]
        refs[c] = [list(it.passages) for it in chunk]
        ids[c] = [it.id for it in chunk]
    return prompts, refs, ids


def run_levels(engines: dict, prompts_by_level: dict[int, list], refs_by_level: dict[int, list], new: int) -> list[dict]:
    """One row per (method, level, group): seconds, new tokens, outputs, spec counters' deltas. A level's prompts
    go in groups of that size, one ``generate_batch`` per group and engine, the engines' order rotating per group;
    every output is compared with vllm-greedy's (which ``engines`` must hold)."""
    rows = []
    methods = list(engines)
    for c, prompts in prompts_by_level.items():
        for g, start in enumerate(range(0, len(prompts), c)):
            order = methods[g % len(methods):] + methods[:g % len(methods)]
            for m in order:
                refs = refs_by_level[c][start:start + c] if m in OURS else None
                t0 = time.perf_counter()
                outs = engines[m].generate_batch(prompts[start:start + c], refs, max_new_tokens=new)
                dt = time.perf_counter() - t0
                rows.append({"method": m, "in_flight": c, "group": g, "seconds": dt,
                             "new_tokens": sum(len(o.token_ids) for o in outs),
                             "steps": sum(o.stats.steps for o in outs), "token_ids": [o.token_ids for o in outs]})
            base = next(r for r in rows[-len(methods):] if r["method"] == "vllm-greedy")["token_ids"]
            for r in rows[-len(methods):]:
                r["identical"] = sum(a == b for a, b in zip(r["token_ids"], base))
            print(f"{c} in flight, group {g + 1}: " + " ".join(
                f"{r['method']}={r['new_tokens'] / r['seconds']:.1f}" for r in rows[-len(methods):]), flush=True)
    return rows


def summarize(rows: list[dict]) -> dict[str, dict]:
    """:func:`run_levels`' rows summed per ``method@level``: tokens/s, tokens per step, identical outputs, and
    tokens/s against vllm-greedy's at that level."""
    out: dict[str, dict] = {}
    for r in rows:
        s = out.setdefault(f"{r['method']}@{r['in_flight']}", {"method": r["method"], "in_flight": r["in_flight"],
                                                                "seconds": 0.0, "new_tokens": 0, "steps": 0,
                                                                "identical": 0, "requests": 0})
        for key in ("seconds", "new_tokens", "steps", "identical"):
            s[key] += r[key]
        s["requests"] += len(r["token_ids"])
    for s in out.values():
        s["tokens_per_s"] = s["new_tokens"] / s["seconds"]
        s["tokens_per_step"] = s["new_tokens"] / max(1, s["steps"])
        base = out[f"vllm-greedy@{s['in_flight']}"]
        s["vs_greedy"] = s["tokens_per_s"] / (base["new_tokens"] / base["seconds"])
    return out


def run_rates(rows: list[dict]) -> dict[tuple[str, int, int], float]:
    """Tokens/s per (method, level, repeat) from a run's rows (a run without repeats: repeat 0).

    Example:
        >>> run_rates([{"method": "m", "in_flight": 4, "new_tokens": 10, "seconds": 2.0},
        ...            {"method": "m", "in_flight": 4, "new_tokens": 20, "seconds": 2.0, "repeat": 0}])
        {('m', 4, 0): 7.5}
    """
    sums: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        s = sums.setdefault((r["method"], r["in_flight"], r.get("repeat", 0)), [0.0, 0.0])
        s[0] += r["new_tokens"]
        s[1] += r["seconds"]
    return {key: tokens / seconds for key, (tokens, seconds) in sums.items()}


def table(summary: dict[str, dict], methods: list[str], levels: tuple[int, ...]) -> list[str]:
    """The markdown table of :func:`summarize`'s sums: a row per method, a column per level."""
    steps = all("tokens_per_step" in s for s in summary.values())  # (the first run counted no steps)
    what = "tokens/s (vs vllm-greedy; tokens/step)" if steps else "tokens/s (vs vllm-greedy)"
    lines = ["| method | " + " | ".join(f"{c} in flight: {what}" for c in levels)
             + " | identical |", "|---|" + "---|" * (len(levels) + 1)]
    for m in methods:
        cells, ident, total = [], 0, 0
        for c in levels:
            s = summary[f"{m}@{c}"]
            cells.append(f"{s['tokens_per_s']:.1f} ({s['vs_greedy']:.2f}x"
                         + (f"; {s['tokens_per_step']:.2f})" if steps else ")"))
            ident, total = ident + s["identical"], total + s["requests"]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {ident}/{total} |")
    return lines


def engine_seconds(run: dict) -> dict[str, float]:
    """Seconds per timed engine over an engine-order run's groups, in the order the engines were built
    (``benchmarks/experiments/engine_order.py``)."""
    return {m: sum(g[m] for g in run["groups"]) for m in run["groups"][0]}


def first_vs_others(run: dict) -> float:
    """How much longer the first engine built took than the mean of the others (-0.05: 5% less).

    Example:
        >>> round(first_vs_others({"groups": [{"g0": 11.0, "g1": 10.0, "g2": 10.0}]}), 3)
        0.1
    """
    seconds = list(engine_seconds(run).values())
    return seconds[0] / (sum(seconds[1:]) / len(seconds[1:])) - 1
