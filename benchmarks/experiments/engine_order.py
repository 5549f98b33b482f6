"""Is the first vLLM engine built in a process slower than identical ones built after it?

    python benchmarks/experiments/engine_order.py --out benchmarks/results/engine_order_vllm_cpu_smollm2
    python benchmarks/experiments/engine_order.py --throwaway --out benchmarks/results/engine_order_vllm_cpu_smollm2

(in the vLLM virtualenv, with the bench environment: ``VLLM_CPU_OMP_THREADS_BIND=0-1``,
``LD_PRELOAD=$VIRTUAL_ENV/lib/libiomp5.so``). Every benchmark here builds its vLLM engines in one
process, ``vllm-greedy`` first (each engine core a process of its own, spawned: vLLM's CPU platform
sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whatever the environment says). This builds ``--engines``
identical ``vllm-greedy`` engines in turn (with ``--throwaway``, one more first, never timed), gives
each an untimed warm-up batch, then times
``--groups`` groups of 16 requests in flight x 64 tokens on each engine, the order rotating per group,
on the sample's items 100 on (none of the judged last ones). Each run is appended to the JSON; the
markdown is rewritten from all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rag_accel_lab.inflight import engine_seconds, first_vs_others  # noqa: E402

IN_FLIGHT, NEW = 16, 64


def measure(n_engines: int, n_groups: int, throwaway: bool, model: str) -> dict:
    from rag_accel import ReferenceDecoder
    from rag_accel_lab.inflight import make_engines, take_prompts
    from rag_accel.rag.msmarco import load_msmarco_sample

    items = load_msmarco_sample(with_answers=True)[100:100 + IN_FLIGHT * (n_groups + 1)]
    prompts = take_prompts(items, {IN_FLIGHT: len(items)}, ReferenceDecoder.from_pretrained(model))[0][IN_FLIGHT]
    specs = {"throwaway": {"speculation": "off"}} if throwaway else {}
    specs.update({f"g{i}": {"speculation": "off"} for i in range(n_engines)})
    load_before = os.getloadavg()
    engines = make_engines(specs, model, 10, 4096)
    try:
        for e in engines.values():  # untimed warm-up batch
            e.generate_batch(prompts[:IN_FLIGHT], None, max_new_tokens=16)
        timed = [m for m in engines if m != "throwaway"]
        groups = []
        for g in range(n_groups):
            batch = prompts[IN_FLIGHT * (g + 1):IN_FLIGHT * (g + 2)]
            seconds = {}
            for m in timed[g % len(timed):] + timed[:g % len(timed)]:
                t0 = time.perf_counter()
                engines[m].generate_batch(batch, None, max_new_tokens=NEW)
                seconds[m] = time.perf_counter() - t0
            groups.append({m: seconds[m] for m in timed})
            print(f"group {g + 1}: " + " ".join(f"{m}={s:.1f}s" for m, s in groups[-1].items()), flush=True)
    finally:
        for e in engines.values():
            e.close()
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "throwaway_first": throwaway,
            "groups": groups,
            "load_before": load_before, "load_after": os.getloadavg()}


def render(path: Path) -> None:
    """The markdown of every run in ``path``'s JSON."""
    runs = json.loads(path.read_text())["runs"]
    lines = ["# The first vLLM engine built in a process against identical ones built after it", "",
             f"- command: `python benchmarks/experiments/engine_order.py [--throwaway] --out {path.with_suffix('')}` (vLLM "
             "virtualenv, `VLLM_CPU_OMP_THREADS_BIND=0-1`, `LD_PRELOAD` libiomp5, `VLLM_CPU_KVCACHE_SPACE=2`)",
             f"- each engine: vllm-greedy, SmolLM2-135M float32 on the 2-core CPU; {IN_FLIGHT} requests in flight x "
             f"{NEW} tokens per group, the engines' order rotating per group; seconds per engine, all groups", "",
             "- runs noted *log* were taken by the probe this script was made from (the same procedure) and "
             "transcribed from its log, to 0.1 s; *load*: the 1-minute load average before the run where it was "
             "not quiet", "",
             "| run | engines built first to last: seconds | first built against the mean of the others |",
             "|---|---|---|"]
    for run in runs:
        how = "; ".join(([] if not run["throwaway_first"] else ["a throwaway engine built first"])
                        + ([run["note"]] if run.get("note") else []))
        lines.append(f"| {run['date']}{f' ({how})' if how else ''} | "
                     + " / ".join(f"{t:.1f}" for t in engine_seconds(run).values())
                     + f" | {first_vs_others(run):+.1%} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--throwaway", action="store_true", help="build one more engine first, never timed")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_order_vllm_cpu_smollm2"))
    args = ap.parse_args()
    if not 2 <= args.engines <= 4 or not 1 <= args.groups <= 8:
        ap.error("--engines 2-4 (each holds its KV cache), --groups 1-8")
    path = args.out.with_suffix(".json")
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs.append(measure(args.engines, args.groups, args.throwaway, args.model))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=1))
    render(path)


if __name__ == "__main__":
    main()
