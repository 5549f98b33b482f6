"""What does the README's ``VllmDecoder`` block gain from the environment rag_accel now gives its engine on a CPU
(its threads bound to the free cores, Intel OpenMP), against vLLM's own binding (a core kept back for the scheduler)?

    python benchmarks/experiments/vllm_decoder_env.py --out benchmarks/results/vllm_decoder_env_cpu_smollm2
    python benchmarks/experiments/vllm_decoder_env.py --plot benchmarks/results/vllm_decoder_env_cpu_smollm2.json

(in the vLLM virtualenv). Each condition is a fresh process running the README's block
(``VllmDecoder.from_pretrained("smollm2-135m-instruct", max_model_len=4096)``) on the sample's last 8 questions,
64 tokens each with the passages as references, the conditions alternating ``--repeats`` times: ``rag_accel``
(nothing set: the library's binding and Intel OpenMP) and ``vllm-binding`` (``VLLM_CPU_OMP_THREADS_BIND=auto``,
vLLM's own binding; Intel OpenMP as well). Reported: the start, the answers' tokens per second (prefill included),
vLLM's binding, and whether the answers are the same token for token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

CHILD = """
import json
import time

from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.vllm import VllmDecoder

if __name__ == "__main__":
    items = load_msmarco_sample()[-8:]
    t0 = time.perf_counter()
    dec = VllmDecoder.from_pretrained("smollm2-135m-instruct", max_model_len=4096)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = [dec.generate(rag_messages(it.query, it.passages), references=it.passages, max_new_tokens=64).token_ids
            for it in items]
    gen_s = time.perf_counter() - t0
    dec.close()
    print("REPORT", json.dumps({"start_s": start_s, "gen_s": gen_s, "outputs": outs}), flush=True)
"""

CONDITIONS = {"rag_accel": {}, "vllm-binding": {"VLLM_CPU_OMP_THREADS_BIND": "auto"}}


def run_once(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=1200,
                          env={**env, "HF_HUB_OFFLINE": "1", **extra})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"the block failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(line[7:])
    log = done.stdout + done.stderr
    bind = re.search(r"VLLM_CPU_OMP_THREADS_BIND=('[^']*')", log)
    cores = re.search(r"core ids=(\[[^]]*\])", log)
    tokens = sum(len(o) for o in report["outputs"])
    digest = hashlib.sha256(json.dumps(report["outputs"]).encode()).hexdigest()[:12]
    return {"start_s": round(report["start_s"], 1), "gen_s": round(report["gen_s"], 2), "tokens": tokens,
            "tokens_per_s": round(tokens / report["gen_s"], 2), "outputs": digest,
            "binding": f"{bind[1] if bind else '?'}, cores {cores[1] if cores else '?'}",
            "iomp_warning": "without Intel OpenMP" in log}


def write_page(result: dict, path: Path) -> None:
    runs, median = result["runs"], result["median_tokens_per_s"]
    lines = ["# The README's VllmDecoder block: rag_accel's CPU environment against vLLM's own binding (SmolLM2)", "",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']}; load (1/5/15 min) before {' '.join(map(str, result['load_before']))}, "
             f"after {' '.join(map(str, result['load_after']))}",
             "- the sample's last 8 questions, 64 tokens each, passages as references, float32 (the CPU default); "
             "each run a fresh process, the conditions alternating; tokens/s with the prefill included", "",
             "| condition | run | start | tokens/s | outputs | Intel OpenMP warning | vLLM's binding |",
             "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        lines += [f"| {name} | {i + 1} | {x['start_s']} s | {x['tokens_per_s']} | {x['outputs']} | "
                  f"{'yes' if x['iomp_warning'] else 'no'} | {x['binding']} |" for i, x in enumerate(rs)]
    ratio = median["rag_accel"] / median["vllm-binding"]
    lines += ["", f"- median tokens/s: rag_accel {median['rag_accel']:.2f}, vLLM's binding "
                  f"{median['vllm-binding']:.2f}: **{ratio:.2f}x**; every answer the same token for token: "
                  f"{'yes' if result['outputs_identical'] else 'NO'}"]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(path: Path) -> None:
    """Tokens per second of each run, by condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(5.5, 3))
    for i, (name, runs) in enumerate(result["runs"].items()):
        ax.scatter([i] * len(runs), [r["tokens_per_s"] for r in runs], label=name)
    ax.set_xticks(range(len(result["runs"])), list(result["runs"]))
    ax.set_ylabel("tokens/s (prefill included)")
    ax.set_ylim(bottom=0)
    ax.set_title("The README's VllmDecoder block: SmolLM2, 8 answers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.out is None:
        ap.error("--out is required")
    from importlib.metadata import version

    from rag_accel_lab.machine import cpu_description

    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in CONDITIONS}
    for r in range(args.repeats):
        for name, extra in (CONDITIONS.items() if r % 2 == 0 else reversed(CONDITIONS.items())):
            runs[name].append(run_once(extra))
            print(name, runs[name][-1], flush=True)
    median = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in runs.items()}
    same = len({x["outputs"] for rs in runs.values() for x in rs}) == 1
    result = {"command": "python benchmarks/experiments/vllm_decoder_env.py " + shlex.join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, "
                         f"vllm {version('vllm-cpu')}",
              "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
              "runs": runs, "median_tokens_per_s": median, "outputs_identical": same}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    write_page(result, args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
