"""What a speculative step's host work costs in vLLM's worker: our proposer against vLLM's suffix decoding and n-gram
lookup, per request per step, at several requests in flight.

    python benchmarks/experiments/host_costs.py --model smollm2-135m-instruct --levels 1,4,16,64 \\
        --out benchmarks/results/host_costs_vllm_cpu_smollm2
    python benchmarks/experiments/host_costs.py --methods ours,ours-python-loops,suffix ...  # the C build's share
    python benchmarks/experiments/host_costs.py --plot benchmarks/results/host_costs_vllm_cpu_smollm2.json

(in the vLLM virtualenv, arctic-inference installed). One engine per method (vLLM's own kernels, no exact steps:
the host work is the same either way; a suffix engine afresh at every level, its tree empty), the
sample's last ``--items`` answered questions (at one in flight the last ``--items-alone``), the passages in the
prompt and, for ours, as references; 64 new tokens, greedy, at most 10 draft tokens a step. A wrapper in the worker
(``collective_rpc`` with a pickled function: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, this process only) times each
call of the runner's drafter (``propose``; ours also its batch view's ``update_state``, which runs every step for
it) with the rows it drafted for. Reported per method and level: the median and 90th percentile of a step's host
time, and that time per request in the step; the share of the forward's time it is (``execute_model``'s median).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

K = 10
METHODS = ("ours", "suffix", "ngram")
# Ours with rag_accel.kernels' Python loops in the worker instead of their C build (rag_accel/_native.c).
PYTHON_LOOPS = "ours-python-loops"
# Ours with every request's drafting off (speculate=False): the proposer's call and per-row bookkeeping, no drafting.
# What ours would cost in the worker if its drafting took no time: the floor any faster drafting meets.
DRAFTING_OFF = "ours-drafting-off"
OURS = ("ours", PYTHON_LOOPS, DRAFTING_OFF)


def python_loops(worker: object) -> bool:
    """Runs in the worker: rag_accel.kernels runs its Python loops from here on; whether their C build was on."""
    import rag_accel.kernels as kernels

    was, kernels._native = kernels._native is not None, None
    return was


def timer(worker: object) -> list:
    """Runs in the worker: the first call wraps the drafter's ``propose`` (and a batch view's ``update_state``) and
    the runner's ``execute_model``; each later call returns what was timed since and forgets it: (kind, rows with a
    sampled token, seconds)."""
    import time

    runner = worker.model_runner  # type: ignore[attr-defined]
    log = getattr(runner, "_rag_accel_host_log", None)
    if log is not None:
        out = list(log)
        log.clear()
        return out
    log = runner._rag_accel_host_log = []
    drafter = runner.drafter

    def wrap(obj, name, kind, rows):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            result = original(*args, **kwargs)
            log.append((kind, rows(args, kwargs), time.perf_counter() - t))
            return result

        setattr(obj, name, timed)

    def sampled_rows(args, kwargs):
        for a in args:  # the list of each row's sampled tokens (its position differs by method)
            if isinstance(a, list):
                return sum(1 for s in a if s)
        return 0

    wrap(drafter, "propose", "propose", sampled_rows)
    tracker = getattr(drafter, "tracker", None)
    if tracker is not None:
        wrap(tracker, "update_state", "update_state", lambda a, k: 0)
    wrap(runner, "execute_model", "forward", lambda a, k: 0)
    return []


def summarise(log: list[tuple[str, int, float]]) -> dict:
    """Per step: the host time (propose + update_state before it), by rows drafted for; medians."""
    steps, pending = [], 0.0
    forwards = [s for kind, _, s in log if kind == "forward"]
    for kind, rows, sec in log:
        if kind == "update_state":
            pending += sec
        elif kind == "propose":
            if rows:
                steps.append((rows, sec + pending))
            pending = 0.0
    per_row = [s / r for r, s in steps]
    return {"steps": len(steps), "rows_median": statistics.median(r for r, _ in steps) if steps else 0,
            "host_us_median": 1e6 * statistics.median(s for _, s in steps) if steps else None,
            "host_us_p90": 1e6 * statistics.quantiles([s for _, s in steps], n=10)[-1] if len(steps) > 10 else None,
            "per_request_us_median": 1e6 * statistics.median(per_row) if per_row else None,
            "forward_ms_median": 1e3 * statistics.median(forwards) if forwards else None}


def markdown(run: dict) -> str:
    e = run["environment"]
    lines = [f"# Host work per speculative step in vLLM's worker: {e['model']}, {e['dtype']}, {e['date'][:10]}", "",
             f"- command: `{run['command']}`",
             f"- machine: {e['machine']}; load (1/5/15 min) before {e['load_before']}, after {e['load_after']}",
             f"- the sample's last {e['items']} answered questions ({e['items_alone']} at one in flight), 64 new "
             f"tokens, greedy, at most {K} draft tokens; vLLM's own kernels; one engine per method (suffix: per level)"
             + (f"; {e['rounds']} rounds of the methods, alternating, each figure over all rounds' steps"
                if e.get("rounds", 1) > 1 else ""),
             "- host time: a step's call of the drafter's `propose` (ours: with its batch view's `update_state`), "
             "steps where at least one request had a sampled token; forward: `execute_model`'s median", "",
             "| method | in flight | steps | requests a step (median) | host per step, median (p90) | "
             "per request per step | forward (median) | host / forward | rounds (per request, us) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, levels in run["summary"].items():
        for level, s in levels.items():
            if not s["steps"]:
                continue
            p90 = f" ({s['host_us_p90']:.0f} us)" if s["host_us_p90"] is not None else ""
            share = s["host_us_median"] / (1e3 * s["forward_ms_median"]) if s["forward_ms_median"] else None
            lines.append(f"| {method} | {level} | {s['steps']} | {s['rows_median']:.0f} | {s['host_us_median']:.0f} us"
                         f"{p90} | {s['per_request_us_median']:.0f} us | {s['forward_ms_median']:.1f} ms | "
                         + (f"{share:.1%}" if share is not None else "-") + " | "
                         + ", ".join(f"{x:.0f}" for x in s.get("rounds_per_request_us", []) if x is not None) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path) -> None:
    """The run's plot: host time per request per step, by requests in flight, each method a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, levels in run["summary"].items():
        shown = [(int(lv), s["per_request_us_median"]) for lv, s in levels.items() if s["steps"]]
        ax.plot([x for x, _ in shown], [y for _, y in shown], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("host time per request per step, us (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    e = run["environment"]
    ax.set_title(f"speculative host work in vLLM's worker: {e['model']}, {e['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--items", type=int, default=64, help="questions run at each level above one")
    ap.add_argument("--items-alone", type=int, default=12, help="questions run one at a time")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}, {PYTHON_LOOPS}, "
                    f"{DRAFTING_OFF}")
    ap.add_argument("--rounds", type=int, default=1, help="run the methods this many times, alternating (a shared "
                    "machine drifts): each figure is over all rounds' steps")
    ap.add_argument("--out", type=Path, default=None, help="path without suffix: writes .json and .md")
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON (in an environment "
                    "with matplotlib), and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    if args.out is None:
        ap.error("--out is required")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # (the timer goes to the workers pickled)
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.vllm import VllmDecoder
    from rag_accel_lab.machine import cpu_description

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    items = load_msmarco_sample(with_answers=True)[-args.items:]
    levels = [int(x) for x in args.levels.split(",")]
    logs: dict[str, dict[str, list]] = {}  # method -> level -> every round's timings
    rounds: dict[str, dict[str, list]] = {}  # method -> level -> each round's median per request per step
    for method in [m for _ in range(args.rounds) for m in args.methods.split(",")]:
        # (a suffix engine's tree keeps what it answered: a fresh one for each level)
        for run_levels in ([[lv] for lv in levels] if method == "suffix" else [levels]):
            ours = method in OURS
            dec = VllmDecoder.from_pretrained(args.model, dtype=args.dtype, exact=False,
                                              speculation="ours" if ours else method, max_draft_tokens=K,
                                              max_model_len=4096, enforce_eager=True, enable_prefix_caching=False)
            try:
                if method == PYTHON_LOOPS:
                    dec.llm.collective_rpc(python_loops)
                dec.generate("Hello", max_new_tokens=4)  # (warm-up)
                dec.llm.collective_rpc(timer)
                for level in run_levels:
                    dec.llm.collective_rpc(timer)  # (forget what ran before)
                    run = items[-args.items_alone:] if level == 1 else items
                    for start in range(0, len(run), level):
                        group = run[start:start + level]
                        dec.generate_batch([rag_messages(it.query, it.passages) for it in group],
                                           [list(it.passages) if ours else None for it in group],
                                           max_new_tokens=64,
                                           **({"speculate": False} if method == DRAFTING_OFF else {}))
                    got = dec.llm.collective_rpc(timer)[0]
                    logs.setdefault(method, {}).setdefault(str(level), []).extend(got)
                    this = summarise(got)
                    rounds.setdefault(method, {}).setdefault(str(level), []).append(this["per_request_us_median"])
                    print(method, level, this, flush=True)
            finally:
                dec.close()
    summary = {method: {level: {**summarise(log), "rounds_per_request_us": rounds[method][level]}
                        for level, log in by_level.items()} for method, by_level in logs.items()}
    import torch
    import vllm

    run = {"command": shlex.join(["python", "benchmarks/experiments/host_costs.py", *sys.argv[1:]]),
           "environment": {"model": args.model, "dtype": args.dtype, "items": args.items, "rounds": args.rounds,
                           "items_alone": args.items_alone,
                           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, torch "
                                      f"{torch.__version__}, vllm {vllm.__version__}",
                           "load_before": load_before,
                           "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())},
           "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(run, indent=1))
    args.out.with_suffix(".md").write_text(markdown(run))
    print(markdown(run))


if __name__ == "__main__":
    main()
