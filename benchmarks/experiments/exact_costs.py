"""What exact steps cost inside vLLM's CPU worker: a plain step, a verify of L draft tokens and a prefill, with
the mode on and off, one request at a time.

    python benchmarks/experiments/exact_costs.py --model smollm2-135m-instruct --dtype bfloat16 \\
        --out benchmarks/results/exact_costs_vllm_cpu_smollm2_bf16

(in the vLLM virtualenv; ``--plot RUN.json`` draws its plot where matplotlib is installed). Two engines of the
model (our proposer, at most 16 draft tokens a step, vLLM's default
compilation unless ``--eager``), exact mode on and off (``VllmDecoder.from_pretrained(exact=...)``), both built
first, then the sample's last ``--items`` questions taken in turn by each (the order of the engines alternating per
item): the answer with drafting off (plain steps), then the same request with its own answer as the reference
and a request's ``max_draft_tokens`` of each ``--lengths`` (every step a verify of up to that many draft tokens,
nearly all accepted). A wrapper in each worker (``collective_rpc`` with a pickled function:
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, this process only) times every step's forward (``execute_model``) with the
draft tokens it verified; a request's first step is its prefill.

Reported per engine: the median forward of a plain step, of a step verifying L draft tokens (by L), of a prefill;
and the ratios the targets name: the mode's plain step against vLLM's own, a verify against the same engine's
plain step.
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

K = 16


def timer(worker: object) -> list:
    """Runs in the worker: the first call wraps the model runner's ``execute_model``; each later call returns the
    steps timed since (tokens scheduled, draft tokens verified, forward seconds) and forgets them."""
    import time

    runner = worker.model_runner  # type: ignore[attr-defined]
    log = getattr(runner, "_rag_accel_cost_log", None)
    if log is not None:
        out = list(log)
        log.clear()
        return out
    log = runner._rag_accel_cost_log = []
    execute_model = runner.execute_model

    def timed(scheduler_output, *args, **kwargs):
        t = time.perf_counter()
        result = execute_model(scheduler_output, *args, **kwargs)
        spec = sum(len(v) for v in (scheduler_output.scheduled_spec_decode_tokens or {}).values())
        log.append((scheduler_output.total_num_scheduled_tokens, spec, time.perf_counter() - t))
        return result

    runner.execute_model = timed
    return []


def summarise(steps: list[list[tuple[int, int, float]]]) -> dict:
    """Medians (ms) of prefills (each request's first step), plain steps (no draft) and verifies by draft tokens."""
    prefill = [r[0][2] for r in steps if r]
    decode = [s for r in steps for s in r[1:]]
    by_len: dict[int, list[float]] = {}
    for _, spec, sec in decode:
        by_len.setdefault(spec, []).append(sec)
    return {"prefill_ms": 1e3 * statistics.median(prefill),
            "prefill_tokens": statistics.median(r[0][0] for r in steps if r),
            "by_draft_tokens": {n: {"steps": len(v), "forward_ms": 1e3 * statistics.median(v)}
                                for n, v in sorted(by_len.items())}}


def markdown(run: dict) -> str:
    e = run["environment"]
    on, off = run["summary"]["on"], run["summary"]["off"]
    lines = [f"# Exact steps' costs in vLLM's CPU worker: {e['model']}, {e['dtype']}, {e['date'][:10]}", "",
             f"- command: `{run['command']}`",
             f"- machine: {e['machine']}; load (1/5/15 min) before {e['load_before']}, after {e['load_after']}",
             f"- {e['items']} questions of the bundled sample, one request at a time, compilation: "
             f"{'eager' if e['eager'] else 'vLLM default'}; medians of each step's forward (`execute_model`)", "",
             "| | exact on | exact off (vLLM's kernels) | on / off |", "|---|---|---|---|",
             f"| prefill ({on['prefill_tokens']:.0f} tokens, median) | {on['prefill_ms']:.1f} ms | "
             f"{off['prefill_ms']:.1f} ms | {on['prefill_ms'] / off['prefill_ms']:.2f}x |"]
    lengths = sorted(set(on["by_draft_tokens"]) & set(off["by_draft_tokens"]), key=int)
    p_on, p_off = on["by_draft_tokens"]["0"]["forward_ms"], off["by_draft_tokens"]["0"]["forward_ms"]
    for n in lengths:
        a, b = on["by_draft_tokens"][n], off["by_draft_tokens"][n]
        what = "plain step" if n == "0" else f"verify of {n} draft tokens"
        lines.append(f"| {what} ({a['steps']} / {b['steps']} steps) | {a['forward_ms']:.1f} ms"
                     + ("" if n == "0" else f" ({a['forward_ms'] / p_on:.2f}x its plain step)")
                     + f" | {b['forward_ms']:.1f} ms" + ("" if n == "0" else f" ({b['forward_ms'] / p_off:.2f}x)")
                     + f" | {a['forward_ms'] / b['forward_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(path: Path) -> None:
    """The run's curves: each engine's median forward by draft tokens verified, and its plain step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    e = run["environment"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("on", "o-"), ("off", "s--")):
        rows = run["summary"][mode]["by_draft_tokens"]
        lengths = sorted((int(n) for n in rows if rows[n]["steps"] >= 3))
        ax.plot(lengths, [rows[str(n)]["forward_ms"] for n in lengths], style,
                label=f"exact {mode}" + (" (vLLM's kernels)" if mode == "off" else ""))
    ax.set_xlabel("draft tokens verified in the step (0: a plain step)")
    ax.set_ylabel("median forward, ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"vLLM CPU step cost: {e['model']} {e['dtype']}, {e['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--lengths", default="2,4,8,10,16", help="draft lengths a request may verify at most")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compilation)")
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
    lengths = [int(x) for x in args.lengths.split(",")]
    engines = {}
    for mode in ("on", "off"):
        engines[mode] = VllmDecoder.from_pretrained(args.model, dtype=args.dtype, exact=mode == "on",
                                                    max_draft_tokens=K, max_model_len=4096,
                                                    enforce_eager=args.eager, enable_prefix_caching=False)
        engines[mode].llm.collective_rpc(timer)
        engines[mode].generate("Hello", max_new_tokens=4)  # (warm-up)
    steps: dict[str, list] = {"on": [], "off": []}
    try:
        for i, it in enumerate(items):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                dec = engines[mode]
                dec.llm.collective_rpc(timer)  # (forget what ran before)
                messages = rag_messages(it.query, it.passages)
                plain = dec.generate(messages, max_new_tokens=args.new, speculate=False)
                steps[mode].append(dec.llm.collective_rpc(timer)[0])
                context = dec.encode_prompt(messages) + plain.token_ids
                for n in lengths:
                    dec.generate(messages, [context], max_new_tokens=args.new, config={"max_draft_tokens": n})
                    steps[mode].append(dec.llm.collective_rpc(timer)[0])
            print(f"{i + 1}/{len(items)}", flush=True)
    finally:
        for dec in engines.values():
            dec.close()
    import torch
    import vllm

    run = {"command": shlex.join(["python", "benchmarks/experiments/exact_costs.py", *sys.argv[1:]]),
           "environment": {"model": args.model, "dtype": args.dtype, "items": args.items, "eager": args.eager,
                           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, torch "
                                      f"{torch.__version__}, vllm {vllm.__version__}",
                           "load_before": load_before,
                           "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())},
           "summary": {m: summarise(s) for m, s in steps.items()}, "steps": steps}
    run = json.loads(json.dumps(run))  # (int keys as JSON's strings, as the page reads them)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(run, indent=1))
    args.out.with_suffix(".md").write_text(markdown(run))
    print(markdown(run))


if __name__ == "__main__":
    main()
