"""The README's LangChain chain on a quiet machine and beside a job spinning on one core: seconds per generated token.

    python benchmarks/experiments/busy_langchain.py --questions 4 --out benchmarks/results/busy_langchain_cpu_smollm2
    python benchmarks/experiments/busy_langchain.py --plot benchmarks/results/busy_langchain_cpu_smollm2.json

Each condition is a fresh Python process that builds the chain as the README's LangChain block does (``ChatRagAccel``
with its defaults, our FAISS + E5 index over the sample's first 20 items, ``rag_chain``), answers one question to
load and warm up, then times ``--questions`` questions (``rag_chain(..., parser=None)``, so each answer's
``usage_metadata`` counts its tokens). Busy: another process spins on one core for the whole run, as a user's other
job would; the library then computes on the free core (``rag_accel.hf.threads``), where torch's own default would
put a thread on the busy one too. The machine's load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CHILD = """
import json, sys, time
from langchain_rag_accel import ChatRagAccel, VectorIndexRetriever, rag_chain
from rag_accel.rag.msmarco import load_msmarco_sample
from rag_accel.rag.retrieval import Embedder, VectorIndex

if __name__ == "__main__":
    n = int(sys.argv[1])
    items = load_msmarco_sample(limit=20)
    index = VectorIndex(Embedder("multilingual-e5-small"))
    index.add([p for it in items for p in it.passages])
    llm = ChatRagAccel(max_tokens=64)
    chain = rag_chain(VectorIndexRetriever(index=index, k=3), llm, parser=None)
    chain.invoke(items[0].query)  # (loads the model, warms up)
    rows = []
    for it in items[1:1 + n]:
        t = time.perf_counter()
        msg = chain.invoke(it.query)
        rows.append({"seconds": time.perf_counter() - t, "tokens": msg.usage_metadata["output_tokens"],
                     "tokens_per_step": msg.response_metadata["rag_accel"].get("tokens_per_step")})
    import torch
    print("ROWS", json.dumps({"rows": rows, "threads": torch.get_num_threads()}), flush=True)
"""


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def run(questions: int, busy: bool) -> dict:
    stop = job = None
    if busy:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        job = ctx.Process(target=_spin, args=(stop,), daemon=True)
        job.start()
        time.sleep(1.0)
    try:
        load = os.getloadavg()
        done = subprocess.run([sys.executable, "-c", CHILD, str(questions)], capture_output=True, text=True,
                              timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROWS ")), None)
        if done.returncode or line is None:
            raise RuntimeError(f"the chain failed ({done.returncode}): {done.stderr[-2000:]}")
        got = json.loads(line[5:])
        tokens = sum(r["tokens"] for r in got["rows"])
        return {"busy": busy, "load_before": load, "load_after": os.getloadavg(), "threads": got["threads"],
                "rows": got["rows"], "tokens": tokens,
                "seconds_per_token": sum(r["seconds"] for r in got["rows"]) / tokens}
    finally:
        if stop is not None:
            stop.set()
            job.join(10)


def plot(path: Path) -> None:
    """Seconds per generated token, quiet and busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(4.5, 3.0))
    values = [result[k]["seconds_per_token"] * 1e3 for k in ("quiet", "busy")]
    ax.bar(["quiet", "one core spinning"], values, color=["C0", "C1"])
    ax.axhline(1.5 * values[0], ls="--", c="grey", lw=1, label="1.5x quiet")
    ax.set_ylabel("ms per generated token")
    ax.set_title("The README's LangChain chain", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.out is None:
        ap.error("--out is required")
    from rag_accel_lab.machine import cpu_description

    quiet, busy = run(args.questions, False), run(args.questions, True)
    ratio = busy["seconds_per_token"] / quiet["seconds_per_token"]
    result = {"command": "python benchmarks/experiments/busy_langchain.py " + shlex.join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores",
              "quiet": quiet, "busy": busy, "busy_over_quiet": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["# The README's LangChain chain, quiet and beside a job spinning on one core: SmolLM2, seconds per "
             "generated token", "", f"- command: `{result['command']}`", f"- machine: {result['machine']}; "
             f"{args.questions} questions timed in each condition after one that loads and warms up; each a fresh "
             "process; no OMP_NUM_THREADS (the library chooses torch's threads)", "",
             "| condition | torch threads | tokens | seconds per token | tokens per step | load before | load after |",
             "|---|---|---|---|---|---|---|"]
    for name, r in (("quiet", quiet), ("busy (one core spinning)", busy)):
        tps = [x["tokens_per_step"] for x in r["rows"] if x["tokens_per_step"]]
        lines.append(f"| {name} | {r['threads']} | {r['tokens']} | {r['seconds_per_token'] * 1e3:.1f} ms | "
                     f"{sum(tps) / len(tps):.2f} | {' '.join(f'{x:.2f}' for x in r['load_before'])} | "
                     f"{' '.join(f'{x:.2f}' for x in r['load_after'])} |")
    lines += ["", f"- busy over quiet, per generated token: **{ratio:.2f}x** (the target: at most 1.5x)"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
