"""Requests in flight on vLLM against the strongest peers, each level on items no engine saw before.

    python benchmarks/inflight_bench.py --out benchmarks/results/inflight_vllm_cpu_smollm2

(in the vLLM virtualenv, arctic-inference installed for vllm-suffix). Levels of 1, 4, 16 and 32
requests in flight: a level's items in groups of that size, one ``generate_batch`` per group and
method, the methods' order rotating per group; throughput is new tokens over the wall time of a
level's groups. Each level has its own items, taken from the sample's last ones (no default was
tuned on them): vLLM's suffix decoding also copies from its engine's earlier answers, and here it
never meets an item twice (the README's in-flight table repeats the per-request items, so it sat out).

The peers, one engine each, float32, eager, prefix caching off, at most ``k`` = 10 draft tokens:

* ``vllm-greedy``: no speculation, the baseline each output is compared with, token for token;
* ``vllm-ngram``: vLLM's prompt lookup, ``k`` tokens, n-grams of 2 to 4;
* ``vllm-ngram-dynamic``: the same with vLLM's dynamic speculative decoding
  (``num_speculative_tokens_per_batch_size``), its schedule tuned on this machine first (below);
* ``vllm-suffix``: vLLM's suffix decoding (arctic-inference), vLLM's defaults but ``k`` tokens;
* ``vllm-suffix-f3`` (only with ``--methods``): the same with ``suffix_decoding_max_spec_factor`` 3 (a draft up
  to 3 times its match long), the best of 1-3 on the sample's first 50 answers replayed
  (``benchmarks/experiments/suffix_replay.py``): a stronger peer than vLLM's defaults;
* ``vllm-ours``: our proposer, each request with its own passages as references;
* ``vllm-ours-memory`` (only with ``--methods``): the same with every request in one memory scope, so that
  it also drafts from the engine's earlier answers, as suffix decoding's tree does by default;
* ``vllm-ours-control`` (only with ``--methods``): a second engine configured as ``vllm-ours``. Two engines
  of one configuration, in one process, on the same items, differed by -6% to +15% at 16 and 32 in flight
  on this 2-core CPU (``inflight_vllm_cpu_smollm2_memory_control`` and ``_repeats``); the gap between this
  one and ``vllm-ours`` is the run's own measure of that spread, and the markdown says so beside the table.

``--repeats N`` runs the judged levels N times on the same items, each time on engines built afresh (so
one engine's luck does not decide a method's number), in an order rotated by one method per run (the first
engine built in a process tends to be slower than identical ones: ``benchmarks/experiments/engine_order.py``); the
table sums all runs, and the markdown adds each run's ratios and build orders.

``--methods`` runs a subset (the tuning runs only for the n-gram methods, which need it).

Tuning the dynamic schedule (on the sample's FIRST items, which no level here is judged on): at
each level, vLLM's n-gram with 1, 2, 4 and 10 draft tokens and with none (vllm-greedy), interleaved
as above; the schedule gives each level the count with the highest throughput (0: none), and
batch sizes between two levels that of the nearer level (split at their geometric mean).
Tokens per step: new tokens over the engine steps that gave a request tokens (``VllmDecoder``
counts them for every kind of speculation; vLLM's Prometheus counters cannot tell them apart, since
each engine made in a process unregisters the earlier engines' collectors).

``--render FILE.json`` rewrites a run's markdown and plot from its JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rag_accel_lab.inflight import (  # noqa: E402 - (vLLM only inside its functions)
    make_engines,
    ngram_config,
    run_levels,
    run_rates,
    summarize,
    table,
    take_prompts,
)

LEVELS = (1, 4, 16, 32)
TUNE_KS = (1, 2, 4, 10)
METHODS = ("vllm-greedy", "vllm-ngram", "vllm-ngram-dynamic", "vllm-suffix", "vllm-suffix-f3", "vllm-ours",
           "vllm-ours-memory", "vllm-ours-control")
DEFAULT_METHODS = ("vllm-ngram", "vllm-ngram-dynamic", "vllm-suffix", "vllm-ours")


def schedule_from(tuning: dict[str, dict], levels: tuple[int, ...]) -> tuple[list[tuple[int, int, int]], dict]:
    """The best draft-token count per level (0: speculation off was fastest), as vLLM's schedule."""
    best = {}
    for c in levels:
        cands = {0: tuning[f"vllm-greedy@{c}"]["tokens_per_s"]}
        cands.update({k: tuning[f"ngram-k{k}@{c}"]["tokens_per_s"] for k in TUNE_KS})
        best[c] = max(cands, key=cands.get)
    bounds = [1] + [math.floor(math.sqrt(a * b)) + 1 for a, b in zip(levels, levels[1:])]
    ends = [b - 1 for b in bounds[1:]] + [1024]
    return [(lo, hi, best[c]) for lo, hi, c in zip(bounds, ends, levels)], best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--items", default="8,16,32,32", help="items per level (1, 4, 16, 32 in flight)")
    ap.add_argument("--tune-items", default="4,8,16,32", help="tuning items per level, from the sample's first")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/inflight_vllm_cpu_smollm2"))
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"from {','.join(METHODS)} (vllm-greedy always)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of the judged levels, each on engines built afresh (the same items)")
    ap.add_argument("--render", type=Path, default=None, help="rewrite a run's markdown and plot from its JSON")
    args = ap.parse_args()
    if args.render is not None:
        return render(args.render)
    methods = [m for m in METHODS if m == "vllm-greedy" or m in args.methods.split(",")]
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import VLLM_ENV_RECORDED
    from rag_accel.rag.msmarco import load_msmarco_sample
    from rag_accel.methods import SPECULATIVE_SETTINGS
    from rag_accel.vllm.requests import speculative_config

    load_before = os.getloadavg()
    n_judged = dict(zip(LEVELS, (int(x) for x in args.items.split(","))))
    n_tune = dict(zip(LEVELS, (int(x) for x in args.tune_items.split(","))))
    sample = load_msmarco_sample(with_answers=True)
    judged_items = sample[-sum(n_judged.values()):]
    tune_items = sample[:sum(n_tune.values())]
    dec = ReferenceDecoder.from_pretrained(args.model)  # (the prompts' tokenizer; no model work)
    tp, tr, _ = take_prompts(tune_items, n_tune, dec)
    jp, jr, jids = take_prompts(judged_items, n_judged, dec)
    t_start = time.time()
    tune = any(m in methods for m in ("vllm-ngram", "vllm-ngram-dynamic"))
    # 1. tune the dynamic schedule on the first items (for the n-gram methods)
    specs = {"vllm-greedy": {"speculation": "off"}}
    if tune:
        specs.update({f"ngram-k{k}": {"speculation": "ngram", "speculative_config": ngram_config(k)}
                      for k in TUNE_KS})
    engines = make_engines(specs, args.model, args.k, args.max_model_len, spare_first=True)
    try:
        tuning_rows, tuning, schedule, best = [], {}, None, {}
        if tune:
            tuning_rows = run_levels(engines, tp, tr, args.new)
            tuning = summarize(tuning_rows)
            schedule, best = schedule_from(tuning, LEVELS)
            print("tuned schedule:", schedule, flush=True)
            for name in [n for n in engines if n.startswith("ngram-k") and n != f"ngram-k{args.k}"]:
                engines.pop(name).close()
            ngram = engines.pop(f"ngram-k{args.k}")
            if "vllm-ngram" in methods:
                engines["vllm-ngram"] = ngram
            else:
                ngram.close()
        # 2. the peers on the last items, each level its own; each further repeat on engines built afresh
        more = {"vllm-greedy": lambda: {"speculation": "off"},
                "vllm-ngram": lambda: {"speculation": "ngram", "speculative_config": ngram_config(args.k)},
                "vllm-ngram-dynamic": lambda: {"speculation": "ngram",
                                               "speculative_config": ngram_config(args.k, schedule)},
                "vllm-suffix": lambda: {"speculation": "suffix",
                                        "speculative_config": speculative_config("suffix", args.k)},
                "vllm-suffix-f3": lambda: {"speculation": "suffix", "speculative_config": {
                    **speculative_config("suffix", args.k), **SPECULATIVE_SETTINGS["vllm-suffix-f3"]}},
                "vllm-ours": lambda: {"speculation": "ours"},
                "vllm-ours-memory": lambda: {"speculation": "ours", "memory_scope": "bench"},
                "vllm-ours-control": lambda: {"speculation": "ours"}}  # (built only if asked: suffix needs arctic)
        rows, build_orders = [], []
        for repeat in range(args.repeats):
            if repeat:
                for e in engines.values():
                    e.close()
                engines = {}
            # each run builds its engines in an order rotated by one method: the first engine built in a process
            # tends to be slower than identical ones built after it (results/engine_order_vllm_cpu_smollm2.md)
            shift = repeat % len(methods)
            build = [m for m in methods[shift:] + methods[:shift] if m not in engines]
            build_orders.append([*engines, *build])
            engines.update(make_engines({m: more[m]() for m in build}, args.model, args.k, args.max_model_len))
            engines = {m: engines[m] for m in methods}  # (the rotation's order: the methods')
            rows += [{**r, "repeat": repeat} for r in run_levels(engines, jp, jr, args.new)]
    finally:
        for e in engines.values():
            e.close()
    summary = summarize(rows)
    import torch
    import vllm

    env = {"model": args.model, "device": platform.processor() or platform.machine(), "vllm": vllm.__version__,
           "torch": torch.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "load_before": load_before, "load_after": os.getloadavg(), "minutes": (time.time() - t_start) / 60,
           "vllm_env": {k: os.environ[k] for k in VLLM_ENV_RECORDED
                        if k in os.environ}, "k": args.k, "new_tokens": args.new, "spare_engine_first": True}
    command = (f"python benchmarks/inflight_bench.py --items {args.items} --tune-items {args.tune_items} "
               f"--new {args.new} --out {args.out}")
    if args.repeats != 1:
        command += f" --repeats {args.repeats}"
    if methods != ["vllm-greedy", *DEFAULT_METHODS]:
        command += f" --methods {','.join(m for m in methods if m != 'vllm-greedy')}"
    for r in rows + tuning_rows:
        r.pop("token_ids")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "command": command, "schedule": schedule, "best_k_per_level": best,
         "tuning": tuning, "summary": summary, "items": jids, "n_judged": n_judged, "n_tune": n_tune,
         "rows": rows, "tuning_rows": tuning_rows, "build_orders": build_orders}, indent=1))
    render(args.out.with_suffix(".json"))


def render(path: Path) -> None:
    """A run's markdown and plot from its JSON."""
    run = json.loads(path.read_text())
    env, summary, schedule = run["environment"], run["summary"], run["schedule"]
    n_judged = {int(c): len(ids) for c, ids in run["items"].items()}
    n_tune = {int(c): int(n) for c, n in run.get("n_tune", dict(zip(LEVELS, (4, 8, 16, 32)))).items()}
    methods = [m for m in METHODS if f"{m}@{LEVELS[0]}" in summary]
    lines = [f"# In flight on vLLM, each level on items no engine saw before: {env['model']} float32, "
             f"{env['device']}, {env['date']}", "",
             f"- command: `{run['command']}` (in the vLLM virtualenv)",
             f"- vLLM {env['vllm']}, torch {env['torch']}, {env['k']} draft tokens at most, {env['new_tokens']} new "
             f"tokens a request, env {env['vllm_env']}"
             + ("; a spare plain engine built and closed before the timed ones (none timed is the process's first)"
                if env.get("spare_engine_first") else ""),
             f"- machine load (1/5/15 min) before {tuple(round(x, 2) for x in env['load_before'])}, after "
             f"{tuple(round(x, 2) for x in env['load_after'])}; {env['minutes']:.0f} minutes in all",
             f"- items: the sample's last {sum(n_judged.values())}, "
             + ", ".join(f"{n} for {c} in flight" for c, n in n_judged.items())
             + " (each level its own); tokens/s: new tokens over the wall time of the level's groups",
             "", *table(summary, methods, LEVELS)]
    if "vllm-ours-memory" in methods:
        lines += ["", "vllm-ours-memory: our proposer with all its requests in one memory scope (`memory_scope`), so "
                      "that it also drafts from the engine's earlier answers, as vllm-suffix's tree does by default; "
                      "both engines met the same items in the same order."]
    if "vllm-ours-control" in methods and "vllm-ours" in methods:
        spread = [summary[f"vllm-ours-control@{c}"]["tokens_per_s"] / summary[f"vllm-ours@{c}"]["tokens_per_s"] - 1
                  for c in LEVELS]
        lines += ["", "vllm-ours-control: a second engine configured as vllm-ours"
                      + ("" if run.get("build_orders") else " (built after the others)") + ". Its "
                      "tokens/s against vllm-ours at " + "/".join(str(c) for c in LEVELS) + " in flight: "
                      + "/".join(f"{d:+.1%}" for d in spread) + ". That is this run's spread between two engines "
                      "of one configuration: a difference between methods no larger than it is not told apart "
                      "from it."]
    repeats = sorted({r.get("repeat", 0) for r in run["rows"]})
    if len(repeats) > 1:  # the same items on engines built afresh: how far one run's ratios are from another's
        built = ""  # (runs before the rotation built vllm-greedy first every time and did not record it)
        if run.get("build_orders"):
            built = " (engines built in the order " + "; ".join(
                f"run {k + 1}: {', '.join(order)}" for k, order in enumerate(run["build_orders"])) + ")"
        lines += ["", f"Each of the {len(repeats)} runs on its own engines (the table above: all runs' tokens over all "
                      f"runs' time), tokens/s against vllm-greedy{built}:", "",
                  "| method | " + " | ".join(f"{c} in flight, run " + "/".join(str(k + 1) for k in repeats)
                                           for c in LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
        rate = run_rates(run["rows"])
        for m in methods[1:]:
            cells = [" / ".join(f"{rate[m, c, k] / rate['vllm-greedy', c, k]:.2f}x" for k in repeats) for c in LEVELS]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if schedule is not None:
        lines += ["", "The dynamic n-gram schedule, tuned first on the sample's first "
                  f"{sum(n_tune.values())} items ({', '.join(f'{n} at {c}' for c, n in n_tune.items())} in flight): "
                  f"`num_speculative_tokens_per_batch_size={schedule}` "
                  "(the best draft-token count per level; 0: speculation off was fastest):", "",
                  *table(run["tuning"], ["vllm-greedy"] + [f"ngram-k{k}" for k in TUNE_KS], LEVELS)]
    if run.get("note"):
        lines += ["", run["note"]]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for m in methods:
            ax.plot(LEVELS, [summary[f"{m}@{c}"]["vs_greedy"] for c in LEVELS], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(LEVELS, [str(c) for c in LEVELS])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("tokens/s vs vllm-greedy")
        ax.set_title(f"{env['model']}, {env['device']}, each level on unseen items")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
