"""What a vLLM step costs by the draft tokens it verifies, timed inside the worker (one request in flight).

    python benchmarks/experiments/step_costs.py --items 24 --out benchmarks/results/step_costs_vllm_cpu_smollm2
    python benchmarks/experiments/step_costs.py --plot benchmarks/results/step_costs_vllm_cpu_smollm2.json

(the first in the vLLM virtualenv with arctic-inference installed, the second in one with matplotlib). Three
engines (vllm-greedy, vllm-suffix, vllm-ours: float32, eager, prefix caching off, at most 10 draft tokens, a
spare plain engine built and closed first) decode the sample's last ``--items`` items, 128 new tokens, one
request at a time, the engines' order rotating per item. A wrapper installed in each worker (through
``collective_rpc`` with a pickled function: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set for this process
only) times every step's forward (``execute_model``), its sampling, verification and drafting
(``sample_tokens``) and the proposer's ``propose`` alone, with the draft tokens the step verified. The gap
between one step's start and the next is the step's wall time (the engine core's scheduling included).

The curve, ``t(L) / t(0)`` for a step verifying ``L`` draft tokens, is what the draft-length policy trades
accepted tokens against; ``benchmarks/experiments/memory_replay.py`` replays drafting at this curve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = {"vllm-greedy": {"speculation": "off"}, "vllm-suffix": {"speculation": "suffix"},
           "vllm-ours": {"speculation": "ours"}}
K = 10


def timer(worker: object) -> list:
    """Runs in the worker: the first call wraps the model runner's step methods (and its drafter's
    ``propose``); each later call returns the steps timed since the call before and forgets them. A
    step: (tokens scheduled, rows, draft tokens verified, forward s, sampling + drafting s, propose s,
    start time)."""
    import time

    runner = worker.model_runner  # type: ignore[attr-defined]
    log = getattr(runner, "_rag_accel_step_log", None)
    if log is not None:
        out = list(log)
        log.clear()
        return out
    log = runner._rag_accel_step_log = []
    state: dict = {}
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    def timed_execute_model(scheduler_output, *args, **kwargs):
        t = time.perf_counter()
        result = execute_model(scheduler_output, *args, **kwargs)
        spec = sum(len(v) for v in (scheduler_output.scheduled_spec_decode_tokens or {}).values())
        state["forward"] = (scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens),
                            spec, time.perf_counter() - t, t)
        return result

    def timed_sample_tokens(*args, **kwargs):
        t = time.perf_counter()
        result = sample_tokens(*args, **kwargs)
        tokens, rows, spec, forward, start = state.pop("forward", (0, 0, 0, 0.0, t))
        log.append((tokens, rows, spec, forward, time.perf_counter() - t, state.pop("propose", 0.0), start))
        return result

    runner.execute_model, runner.sample_tokens = timed_execute_model, timed_sample_tokens
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        propose = drafter.propose

        def timed_propose(*args, **kwargs):
            t = time.perf_counter()
            result = propose(*args, **kwargs)
            state["propose"] = state.get("propose", 0.0) + time.perf_counter() - t
            return result

        drafter.propose = timed_propose
    return []


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool adjacent violators).

    Example:
        >>> monotone([1.0, 1.2, 1.1, 1.3], [1, 1, 1, 1])
        [1.0, 1.15, 1.15, 1.3]
    """
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [round(v, 10) for v, _, n in blocks for _ in range(int(n))]


def summarize(steps_by_method: dict[str, list[list]]) -> dict:
    """Per method: mean forward / sampling / propose / wall per decode step; per draft length (the speculating
    engines pooled): median forward and sampling, and the curve."""
    out: dict = {"methods": {}, "by_draft_tokens": {}}
    overhead = []
    for m, items in steps_by_method.items():
        steps = [s for item in items for s in item[1:]]  # (each item's first step is its prefill)
        walls = [b[6] - a[6] for item in items for a, b in zip(item[1:], item[2:])]
        outside = statistics.fmean(walls) - statistics.fmean(s[3] + s[4] for s in steps[:-1])
        overhead.append(outside)
        out["methods"][m] = {"decode_steps": len(steps), "forward_ms": 1e3 * statistics.fmean(s[3] for s in steps),
                             "sampling_ms": 1e3 * statistics.fmean(s[4] for s in steps),
                             "propose_ms": 1e3 * statistics.fmean(s[5] for s in steps),
                             "wall_ms": 1e3 * statistics.fmean(walls), "outside_worker_ms": 1e3 * outside,
                             "draft_tokens_per_step": statistics.fmean(s[2] for s in steps)}
    spec = [s for m, items in steps_by_method.items() if m != "vllm-greedy" for item in items for s in item[1:]]
    outside = statistics.fmean(overhead)
    rows = {}
    for n in range(K + 1):
        at = [s for s in spec if s[2] == n]
        if at:
            rows[n] = {"steps": len(at), "forward_ms": 1e3 * statistics.median(s[3] for s in at),
                       "sampling_ms": 1e3 * statistics.median(s[4] for s in at),
                       "propose_ms": 1e3 * statistics.median(s[5] for s in at)}
    lengths = sorted(rows)
    raw = [(rows[n]["forward_ms"] + rows[n]["sampling_ms"] + 1e3 * outside) for n in lengths]
    fitted = monotone(raw, [rows[n]["steps"] for n in lengths])
    for n, r, f in zip(lengths, raw, fitted):
        rows[n]["step_ms"] = r
        rows[n]["curve"] = round(f / fitted[0], 3)
    out["by_draft_tokens"] = rows
    out["outside_worker_ms"] = 1e3 * outside
    return out


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    rows = run["summary"]["by_draft_tokens"]
    lengths = [int(n) for n in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(lengths, [rows[str(n)]["step_ms"] for n in lengths], "o-", label="median step (forward + sampling + engine)")
    a.plot(lengths, [rows[str(n)]["forward_ms"] for n in lengths], "s--", label="median forward")
    a.set_xlabel("draft tokens verified in the step")
    a.set_ylabel("ms")
    a.legend(fontsize=8)
    b.bar(lengths, [rows[str(n)]["steps"] for n in lengths])
    b.set_xlabel("draft tokens verified in the step")
    b.set_ylabel("steps (vllm-suffix and vllm-ours)")
    fig.suptitle(f"vLLM step cost by draft tokens, one request in flight: {run['environment']['model']} float32, "
                 f"{run['environment']['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step_costs_vllm_cpu_smollm2"))
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # (the timer goes to the workers pickled)
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import VLLM_ENV_RECORDED
    from rag_accel_lab.inflight import make_engines, take_prompts
    from rag_accel.rag.msmarco import load_msmarco_sample

    load_before = os.getloadavg()
    items = load_msmarco_sample(with_answers=True)[-args.items:]
    dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct", calibrate=False)  # (the prompts' tokenizer)
    prompts, refs, ids = take_prompts(items, {1: args.items}, dec)
    engines = make_engines(METHODS, "smollm2-135m-instruct", K, 4096, spare_first=True)
    steps: dict[str, list] = {m: [] for m in METHODS}
    seconds: dict[str, float] = dict.fromkeys(METHODS, 0.0)
    try:
        for e in engines.values():
            e.llm.collective_rpc(timer)
        methods = list(METHODS)
        for i, (prompt, ref) in enumerate(zip(prompts[1], refs[1])):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:
                t = time.perf_counter()
                engines[m].generate_batch([prompt], [ref] if m == "vllm-ours" else None, max_new_tokens=args.new)
                seconds[m] += time.perf_counter() - t
                steps[m].append(engines[m].llm.collective_rpc(timer)[0])
            print(f"{i + 1}/{len(ids[1])}", flush=True)
    finally:
        for e in engines.values():
            e.close()
    import torch
    import vllm

    summary = summarize(steps)
    env = {"device": platform.machine(), "cpu_threads": torch.get_num_threads(), "model": "smollm2-135m-instruct",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "vllm": vllm.__version__, "torch": torch.__version__,
           "vllm_env": {k: os.environ[k] for k in VLLM_ENV_RECORDED if k in os.environ},
           "load_before": load_before, "load_after": os.getloadavg()}
    command = f"python benchmarks/experiments/step_costs.py --items {args.items} --out {args.out}"
    args.out.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "command": command, "items": ids[1], "seconds": seconds, "summary": summary}, indent=1))
    lines = [f"# vLLM's step cost by draft tokens, one request in flight ({args.items} items)", "",
             f"- command: `{command}`; the plot: `python benchmarks/experiments/step_costs.py --plot {args.out}.json`",
             f"- {env['model']} float32 on {env['device']}, vLLM {env['vllm']}, torch {env['torch']}, {env['date']}; "
             f"env {env['vllm_env']}; machine load (1/5/15 min) before {tuple(round(x, 2) for x in load_before)}, "
             f"after {tuple(round(x, 2) for x in env['load_after'])}", "",
             "| method | seconds | decode steps | draft tokens/step | forward (ms) | sampling + drafting (ms) | "
             "propose (ms) | wall per step (ms) |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m} | {seconds[m]:.1f} | {s['decode_steps']} | {s['draft_tokens_per_step']:.2f} | "
              f"{s['forward_ms']:.2f} | {s['sampling_ms']:.2f} | {s['propose_ms']:.3f} | {s['wall_ms']:.2f} |"
              for m, s in summary["methods"].items()]
    lines += ["", f"Per draft length (vllm-suffix and vllm-ours pooled; medians; step = forward + sampling + "
              f"{summary['outside_worker_ms']:.2f} ms of the engine's own work per step; curve = step over a plain "
              "step's, made non-decreasing):", "",
              "| draft tokens | steps | forward (ms) | sampling (ms) | propose (ms) | step (ms) | curve |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['steps']} | {r['forward_ms']:.2f} | {r['sampling_ms']:.2f} | {r['propose_ms']:.3f} | "
              f"{r['step_ms']:.2f} | {r['curve']:.3f} |" for n, r in summary["by_draft_tokens"].items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
