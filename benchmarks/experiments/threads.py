"""One thread or every core, on a quiet CPU and beside another job: what a decode step and an answer cost.

    python benchmarks/experiments/threads.py --out benchmarks/results/threads_cpu_smollm2

For each of quiet and busy (another process spinning on one core, as a developer's laptop has a build or a
browser), and each thread count (1 and every core), a fresh process loads the model (``from_pretrained``,
calibration remembered or not as the library does), times its one-token step (the median of 20) and answers
``--items`` of the sample's questions with their passages (our decoder, 32 new tokens), timed whole. The busy
job starts before the process, so the load sees it as it would.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads({threads})
t0 = time.perf_counter()
from rag_accel import ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
dec = ReferenceDecoder.from_pretrained({model!r})
load = time.perf_counter() - t0
ids = dec.encode_prompt("The capital of France is")
steps = []
with torch.inference_mode():
    for _ in range(22):
        cache = dec.steps.new_cache()
        dec.steps.forward(ids, cache, last_only=True)
        t = time.perf_counter(); dec.steps.forward([ids[-1]], cache); steps.append(time.perf_counter() - t)
answers = []
for it in load_msmarco_sample(with_answers=True)[-{items}:]:
    t = time.perf_counter()
    dec.generate(rag_messages(it.query, it.passages), it.passages, max_new_tokens=32)
    answers.append(time.perf_counter() - t)
print(json.dumps({{"load_s": load, "step_ms": 1e3 * statistics.median(steps[2:]), "answers_s": answers}}))
"""


def spin(stop) -> None:  # (another job: one core at 100%)
    x = 0
    while not stop.is_set():
        x += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per (load, threads)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from rag_accel_lab.machine import cpu_description

    cores = len(os.sched_getaffinity(0))
    rows = []
    for load in ("quiet", "busy"):
        stop = mp.Event()
        job = mp.Process(target=spin, args=(stop,)) if load == "busy" else None
        if job:
            job.start()
            time.sleep(2)
        try:
            for r in range(args.repeats):
                for threads in sorted({1, cores}, reverse=r % 2 == 1):
                    code = CHILD.format(threads=threads, model=args.model, items=args.items)
                    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
                    if out.returncode:
                        raise SystemExit(out.stderr[-3000:])
                    row = {"load": load, "threads": threads, **json.loads(out.stdout.strip().splitlines()[-1])}
                    rows.append(row)
                    print(load, threads, f"load {row['load_s']:.1f}s step {row['step_ms']:.1f}ms answers "
                          f"{sum(row['answers_s']):.1f}s", flush=True)
        finally:
            if job:
                stop.set()
                job.join()
    def median(key: str, load: str, threads: int) -> float:
        return statistics.median(r[key] if key != "answers_s" else sum(r[key]) for r in rows
                                 if (r["load"], r["threads"]) == (load, threads))

    summary = {f"{ld} {t}": {k: median(k, ld, t) for k in ("load_s", "step_ms", "answers_s")}
               for ld in ("quiet", "busy") for t in sorted({1, cores})}
    run = {"command": shlex.join(["python", "benchmarks/experiments/threads.py", *sys.argv[1:]]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {cpu_description()}, {cores} cores", "model": args.model,
           "summary": summary, "rows": rows}
    lines = [f"# One thread or every core: {args.model}, float32, {run['date'][:10]}", "",
             f"- command: `{run['command']}`", f"- machine: {run['machine']}; busy: another process spinning on "
             f"one core throughout; each row the median of {args.repeats} fresh processes", "",
             f"| machine | threads | load (`from_pretrained`) | one-token step | {args.items} answers (32 tokens) |",
             "|---|---|---|---|---|"]
    for key, s in summary.items():
        ld, t = key.split()
        lines.append(f"| {ld} | {t} | {s['load_s']:.1f} s | {s['step_ms']:.1f} ms | {s['answers_s']:.1f} s |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(run, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
