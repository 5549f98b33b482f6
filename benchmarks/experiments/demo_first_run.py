"""A new user's first `rag-accel demo` on a busy machine: how long is the screen silent, and what does it say?

    python benchmarks/experiments/demo_first_run.py --out benchmarks/results/demo_first_run_cpu_busy

Runs the README's main job as a new user's first run does (an empty ``RAG_ACCEL_HOME``: the embedder and the model
converted, the passages embedded, the decoder calibrated), with another process spinning on one core throughout
(``--quiet``: without it), and records every silence of the screen (stdout and stderr together) over 5 s, where
it fell (the line before it) and the demo's own verdicts (forward passes, identical answers, timing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def spin(stop) -> None:  # (another job: one core at 100%)
    x = 0
    while not stop.is_set():
        x += 1


def watch(cmd: list[str], env: dict[str, str], gap_s: float) -> tuple[int, str, float, list[dict]]:
    """Run ``cmd``; its output, wall time and every silence longer than ``gap_s`` (after which output line)."""
    t0 = last = time.perf_counter()
    out, gaps = bytearray(), []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    while chunk := os.read(proc.stdout.fileno(), 4096):
        now = time.perf_counter()
        if now - last > gap_s:
            before = out.decode("utf-8", "replace").replace("\r", "\n").rstrip("\n").rsplit("\n", 1)[-1]
            gaps.append({"at_s": round(last - t0, 1), "silent_s": round(now - last, 1), "after": before[-160:]})
        last = now
        out += chunk
    return proc.wait(), out.decode("utf-8", "replace"), time.perf_counter() - t0, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quiet", action="store_true", help="no other job on the machine")
    ap.add_argument("--gap", type=float, default=5.0, help="silences longer than this are recorded (seconds)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from rag_accel_lab.machine import cpu_description

    stop = mp.Event()
    job = None if args.quiet else mp.Process(target=spin, args=(stop,))
    with tempfile.TemporaryDirectory(prefix="rag-accel-first-run-") as home:
        env = {**os.environ, "RAG_ACCEL_HOME": home, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [str(Path(sys.executable).with_name("rag-accel")), "demo"]
        if job:
            job.start()
            time.sleep(2)
        try:
            rc, text, wall, gaps = watch(cmd, env, args.gap)
        finally:
            if job:
                stop.set()
                job.join()
    if rc:
        raise SystemExit(text[-3000:])
    verdicts = [line.strip() for line in text.splitlines()
                if re.match(r"\s*(forward passes:|All \d+ questions:|ours [\d.]+ s = )", line)]
    run = {"command": shlex.join(["python", "benchmarks/experiments/demo_first_run.py", *sys.argv[1:]]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores",
           "load": "quiet" if args.quiet else "another process spinning on one core throughout",
           "wall_s": round(wall, 1), "longest_silence_s": max((g["silent_s"] for g in gaps), default=0.0),
           "silences": gaps, "verdicts": verdicts, "output": text}
    lines = [f"# A first `rag-accel demo`, {'quiet' if args.quiet else 'busy'}: {run['date'][:10]}", "",
             f"- command: `{run['command']}`", f"- machine: {run['machine']}; {run['load']}",
             f"- a fresh `RAG_ACCEL_HOME` (everything converted, embedded and calibrated); {wall:.0f} s in all; "
             f"longest silence {run['longest_silence_s']:.1f} s", "",
             f"Silences over {args.gap:g} s:", "", "| at | silent for | after |", "|---|---|---|"]
    lines += [f"| {g['at_s']:.0f} s | {g['silent_s']:.1f} s | `{g['after']}` |" for g in gaps] or ["| - | - | - |"]
    lines += ["", "The demo's verdicts:", "", *[f"- {v}" for v in verdicts]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(run, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
