"""The proposers' host work per step, replayed on the model's known answers: ours against vLLM's suffix decoding,
the same items, rows and steps, no forward.

    python benchmarks/experiments/host_replay.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --levels 1,16 --out benchmarks/results/host_replay_smollm2
    python benchmarks/experiments/host_replay.py ... --profile 1   # where ours spends it, at one in flight
    python benchmarks/experiments/host_replay.py --plot benchmarks/results/host_replay_smollm2.json

(in the vLLM virtualenv, arctic-inference installed). ``host_costs.py`` times the proposers inside a real engine
(one run per method, so other rows and other steps); this replays both on the same batches: ``--levels`` requests
in flight, a finished one replaced by the next item in its row, each row's step the draft's tokens up to the first
wrong one plus the model's own next token. Ours is :class:`~rag_accel.vllm.proposer.RagProposer` with its batch
view (:class:`~rag_accel.vllm.proposer.RowTracker`, fed vLLM's own ``BatchUpdate`` s), the passages as references;
suffix is vLLM's own ``SuffixDecodingProposer`` over a batch that holds what it reads. Timed per step: ours its
``update_state`` and ``propose``, suffix its ``propose``; reported per request (rows with a sampled token) per
step. The proposer's step clock is a virtual one that advances a modelled forward (``--step-ms`` plus 3% a draft
token), so its learnt costs and draft lengths are those of an engine, not of a replay that takes no time.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
K = 10
# The floors: ours with every request's drafting off (its per-row bookkeeping: the batch view, the stats, the step
# clock), and a proposer that reads each row's tokens and drafts nothing (the Python loop any proposer pays).
FLOOR_OURS, FLOOR_EMPTY = "ours, drafting off", "empty proposer"
# Ours with rag_accel.kernels' Python loops instead of their C build (rag_accel/_native.c): what the C build saves.
PYTHON_LOOPS = "ours, Python loops"


class VirtualClock:
    """``time.perf_counter`` as the proposer reads it: the forwards modelled so far (so its drafts are the same
    in every run: a change that should keep them shows that it did)."""

    def __init__(self) -> None:
        self.modelled = 0.0

    def perf_counter(self) -> float:
        return self.modelled


def _config(k: int, vocab: int) -> Any:
    mc = SimpleNamespace(max_model_len=8192, get_vocab_size=lambda: vocab, tokenizer="unused")
    spec = SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1,
                           suffix_decoding_max_cached_requests=10000)
    return SimpleNamespace(speculative_config=spec, model_config=mc, parallel_config=None)


class Batch:
    """``level`` rows, each a request on its known answer; a finished row takes the next item."""

    def __init__(self, prepared: list[tuple], level: int, width: int) -> None:
        self.queue = list(prepared)
        self.tokens = np.zeros((level, width), dtype=np.int32)  # (vLLM's token_ids_cpu)
        self.rows: list[dict | None] = [None] * level
        self.next_id = 0

    def fill(self) -> list[tuple[int, dict]]:
        """Empty rows take the next items: (row, its request) of the rows that started."""
        started = []
        for i, row in enumerate(self.rows):
            if row is None and self.queue:
                item_id, prompt, refs, target = self.queue.pop(0)
                row = {"id": f"r{self.next_id}", "prompt": list(prompt), "refs": refs, "target": target,
                       "n": len(prompt), "out": 0, "new": [target[0]]}
                self.next_id += 1
                self.tokens[i, :len(prompt)] = prompt
                self.tokens[i, len(prompt)] = target[0]
                row["n"] += 1
                row["out"] = 1
                self.rows[i] = row
                started.append((i, row))
        return started

    def advance(self, drafts: list[list[int]]) -> list[int]:
        """Each row's step on its draft; the rows that finished (emptied)."""
        done = []
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            target, out = row["target"], row["out"]
            if out >= len(target):
                self.rows[i] = None
                done.append(i)
                continue
            draft = drafts[i] if i < len(drafts) else []
            acc = 0
            while acc < len(draft) and out + acc < len(target) - 1 and draft[acc] == target[out + acc]:
                acc += 1
            new = list(target[out:out + acc + 1])
            self.tokens[i, row["n"]:row["n"] + len(new)] = new
            row["n"] += len(new)
            row["out"] += len(new)
            row["new"] = new
            row["sent"] = len(draft)
        return done

    def live(self) -> bool:
        return any(r is not None for r in self.rows) or bool(self.queue)


@contextmanager
def python_loops():
    """Within it, rag_accel.kernels runs its Python loops instead of their C build."""
    import rag_accel.kernels as kernels

    native, kernels._native = kernels._native, None
    try:
        yield
    finally:
        kernels._native = native


def run_ours(prepared: list[tuple], level: int, step_s: float, profile: cProfile.Profile | None = None,
             speculate: bool = True) -> list:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    import rag_accel.vllm.proposer as module
    from rag_accel.vllm.proposer import RagProposer, RowTracker

    clock = VirtualClock()
    module.time = clock  # the proposer's step clock: a modelled forward between steps
    vocab = 1 + max(max(max(p), max(t), max((max(r) for r in refs), default=0)) for _, p, refs, t in prepared)
    proposer = RagProposer(_config(K, vocab))
    proposer.tracker = tracker = RowTracker(_config(K, vocab))
    proposer._tokenizer = object()  # references come as ids: no tokenizer is loaded
    batch = Batch(prepared, level, max(len(p) + len(t) for _, p, _, t in prepared) + K + 2)
    log, done, digest = [], [], hashlib.sha256()
    while batch.live():
        started = batch.fill()
        added = [(i, SamplingParams(temperature=0, max_tokens=len(r["target"]),
                                    extra_args={"references": r["refs"], "speculate": speculate}), r["prompt"], [])
                 for i, r in started]
        removed = [i for i in done if batch.rows[i] is None]  # (a row that takes a new request is replaced, as vLLM
        update = BatchUpdate(batch_size=level, removed=removed, moved=[], added=added) if (added or removed) else None
        #  reports it: an addition, not a removal)
        sampled = [r["new"] if r is not None else [] for r in batch.rows]
        counts = np.array([r["n"] if r is not None else 0 for r in batch.rows])
        if profile is not None:
            profile.enable()
        t = time.perf_counter()
        tracker.update_state(update)
        drafts = proposer.propose(sampled, counts, batch.tokens)
        dt = time.perf_counter() - t
        if profile is not None:
            profile.disable()
        rows = sum(1 for s in sampled if s)
        log.append((rows, dt, sum(len(d) for d in drafts)))
        digest.update(repr(drafts).encode())
        clock.modelled += step_s * (1 + 0.03 * sum(len(d) for d in drafts) / max(rows, 1))
        done = batch.advance(drafts)
    log.append(digest.hexdigest()[:12])  # (every draft of the replay: a change that should keep them, does)
    return log


def run_empty(prepared: list[tuple], level: int) -> list:
    """The least a proposer called per step does: read each row's new tokens and its length, return no draft."""
    batch = Batch(prepared, level, max(len(p) + len(t) for _, p, _, t in prepared) + K + 2)
    log = []

    def propose(sampled: list[list[int]], counts: Any, token_ids_cpu: Any) -> list[list[int]]:
        drafts = []
        for i, new in enumerate(sampled):
            _ = list(new), int(counts[i])  # (what a proposer reads of each row)
            drafts.append([])
        return drafts

    while batch.live():
        batch.fill()
        sampled = [r["new"] if r is not None else [] for r in batch.rows]
        counts = np.array([r["n"] if r is not None else 0 for r in batch.rows])
        t = time.perf_counter()
        drafts = propose(sampled, counts, batch.tokens)
        dt = time.perf_counter() - t
        log.append((sum(1 for s in sampled if s), dt, 0))
        batch.advance(drafts)
    log.append("")
    return log


def run_suffix(prepared: list[tuple], level: int) -> list:
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    proposer = SuffixDecodingProposer(_config(K, 0))
    batch = Batch(prepared, level, max(len(p) + len(t) for _, p, _, t in prepared) + K + 2)
    log = []
    prompt_lens = [0] * level
    while batch.live():
        for i, row in batch.fill():
            prompt_lens[i] = len(row["prompt"])
        live = {r["id"]: i for i, r in enumerate(batch.rows) if r is not None}
        view = SimpleNamespace(req_ids=[r["id"] if r is not None else None for r in batch.rows],
                               num_tokens_no_spec=np.array([r["n"] if r is not None else 0 for r in batch.rows]),
                               req_id_to_index=live, num_prompt_tokens=np.array(prompt_lens, dtype=np.int32),
                               token_ids_cpu=batch.tokens)
        sampled = [r["new"] if r is not None else [] for r in batch.rows]
        t = time.perf_counter()
        drafts = proposer.propose(K, view, sampled)
        dt = time.perf_counter() - t
        log.append((sum(1 for s in sampled if s), dt, sum(len(d) for d in drafts)))
        batch.advance(drafts)
    log.append("")
    return log


def summary(log: list) -> dict[str, Any]:
    *log, digest = log
    steps = [(rows, dt, sent) for rows, dt, sent in log if rows]
    per_request = [dt / rows for rows, dt, _ in steps]
    return {"steps": len(steps), "rows_median": statistics.median(r for r, _, _ in steps),
            "host_us_median": 1e6 * statistics.median(dt for _, dt, _ in steps),
            "host_us_p90": 1e6 * statistics.quantiles([dt for _, dt, _ in steps], n=10)[-1],
            "per_request_us_median": 1e6 * statistics.median(per_request),
            "per_request_us_mean": 1e6 * statistics.fmean(per_request),
            "sent_per_step": sum(s for _, _, s in steps) / sum(r for r, _, _ in steps), "drafts_sha256": digest}


def plot(path: Path) -> None:
    """Host time per request per step, by method and requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    levels = sorted({r["level"] for r in result["rows"]})
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    width = 0.76 / len(methods)
    for i, method in enumerate(methods):
        got = {r["level"]: r["per_request_us_median"] for r in result["rows"] if r["method"] == method}
        ax.bar([j + width * i for j in range(len(levels))], [got[lv] for lv in levels], width * 0.95, label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(levels))], [f"{lv} in flight" for lv in levels])
    ax.set_ylabel("host us per request per step")
    ax.set_title(f"Proposers' host work, replayed: {result['model']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=None, help="the model's greedy answers (rag-accel bench "
                    "--save-outputs)")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--step-ms", type=float, default=28.0, help="the modelled forward of a plain step")
    ap.add_argument("--repeats", type=int, default=3, help="each method and level, alternating; the median kept")
    ap.add_argument("--profile", type=int, default=None, help="profile ours at this level and print it, only")
    ap.add_argument("--floors", action="store_true", help=f"also time {FLOOR_OURS!r} and {FLOOR_EMPTY!r}")
    ap.add_argument("--python-loops", action="store_true", help=f"also time {PYTHON_LOOPS!r} (the kernels' C build "
                    "off)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.outputs is None:
        ap.error("--outputs is required")
    from rag_accel.rag.msmarco import load_msmarco_sample
    from rag_accel_lab.replay import PromptTokens, prepare

    saved = json.loads(args.outputs.read_text())
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    prepared = prepare(args.outputs, PromptTokens(saved["model"]), items)[-args.items:]
    if args.profile is not None:
        prof = cProfile.Profile()
        run_ours(prepared, args.profile, args.step_ms / 1e3, prof)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    load_before = os.getloadavg()
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        runs: dict[str, list] = {"ours": [], "suffix": []}
        if args.python_loops:
            runs[PYTHON_LOOPS] = []
        if args.floors:
            runs.update({FLOOR_OURS: [], FLOOR_EMPTY: []})
        for _ in range(args.repeats):
            runs["ours"].append(summary(run_ours(prepared, level, args.step_ms / 1e3)))
            runs["suffix"].append(summary(run_suffix(prepared, level)))
            if args.python_loops:
                with python_loops():
                    runs[PYTHON_LOOPS].append(summary(run_ours(prepared, level, args.step_ms / 1e3)))
            if args.floors:
                runs[FLOOR_OURS].append(summary(run_ours(prepared, level, args.step_ms / 1e3, speculate=False)))
                runs[FLOOR_EMPTY].append(summary(run_empty(prepared, level)))
        for method, got in runs.items():
            best = sorted(got, key=lambda s: s["per_request_us_median"])[len(got) // 2]
            rows.append({"method": method, "level": level, **best,
                         "repeats_per_request_us": [round(s["per_request_us_median"], 1) for s in got]})
            if len({s["drafts_sha256"] for s in got}) > 1:
                raise SystemExit(f"{method}: the runs drafted differently ({[s['drafts_sha256'] for s in got]})")
            print(f"{method:7s} level {level:3d}: {best['per_request_us_median']:7.1f} us per request per step "
                  f"(runs {rows[-1]['repeats_per_request_us']}), {best['sent_per_step']:.2f} draft tokens a step, drafts {best['drafts_sha256'] or '-'}",
                  flush=True)
    if args.out is None:
        return
    import torch
    import vllm

    from rag_accel_lab.machine import cpu_description

    result = {"command": "python benchmarks/experiments/host_replay.py " + shlex.join(sys.argv[1:]),
              "model": saved["model"], "items": len(prepared), "date": datetime.now(timezone.utc).isoformat(),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores", "torch": torch.__version__, "vllm": vllm.__version__,
              "load_before": load_before, "load_after": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Host work per step, replayed: ours against vLLM's suffix decoding, {saved['model']}, "
             f"{len(prepared)} answers", "", f"- command: `{result['command']}`",
             f"- machine: {result['machine']}, torch {result['torch']}, vllm {result['vllm']}; load (1/5/15 min) "
             f"before {' '.join(f'{x:.2f}' for x in load_before)}, after "
             f"{' '.join(f'{x:.2f}' for x in result['load_after'])}",
             "- the same batches for both: a finished request's row takes the next answer; no forward (a modelled "
             f"one of {args.step_ms:g} ms on ours' step clock); each level {args.repeats} runs alternating, the "
             "median run kept", "",
             "| method | in flight | steps | requests a step (median) | host per step, median (p90) | per request "
             "per step (median) | draft tokens a step | runs (per request, us) | drafts (sha256) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['level']} | {r['steps']} | {r['rows_median']:g} | {r['host_us_median']:.0f} us "
              f"({r['host_us_p90']:.0f} us) | {r['per_request_us_median']:.0f} us | {r['sent_per_step']:.2f} | "
              f"{', '.join(f'{x:g}' for x in r['repeats_per_request_us'])} | {r['drafts_sha256'] or '-'} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
