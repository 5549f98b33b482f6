"""How long does a VllmDecoder take to be ready, the first time on a machine and the times after?

    python benchmarks/experiments/start_times.py --model smollm2-135m-instruct --dtypes bfloat16,float32 \\
        --starts 3 --out benchmarks/results/start_times_vllm_cpu_smollm2
    python benchmarks/experiments/start_times.py ... --serve --out benchmarks/results/start_times_serve_cpu_smollm2

(in the vLLM virtualenv). Each start is a fresh Python process that builds ``VllmDecoder.from_pretrained(model,
dtype=...)`` as the README's block does (compiled, vLLM's default) and answers one question, timed from the
process's start to the engine built (``ready``) and to the answer. The first start of each dtype gets empty
compile caches (vLLM's and torch inductor's, in a folder of this run's own: what a new machine has); the later
ones find what the first left there. ``--serve``: each start is ``rag-accel serve`` instead, ready when
``/v1/models`` answers, then asked one chat completion. The model's conversion and rag_accel's calibration (the exact mode's probes)
are the machine's own in every start: they are remembered under ``RAG_ACCEL_HOME`` after a first run, which this
does not repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time
t0 = float(sys.argv[3])
from rag_accel.vllm import VllmDecoder
dec = VllmDecoder.from_pretrained(sys.argv[1], dtype=sys.argv[2])
ready = time.time() - t0
out = dec.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=16)
answered = time.time() - t0
dec.close()
print("TIMES", ready, answered, len(out.token_ids), flush=True)
"""


def start(model: str, dtype: str, caches: Path, serve: bool = False) -> dict[str, float]:
    """One fresh process's start, its compile caches in ``caches``."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "HF_HUB_OFFLINE": "1"}
    if serve:
        return start_server(model, dtype, env)
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, model, dtype, repr(t0)], env=env, capture_output=True,
                          text=True, timeout=1200)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("TIMES")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"a start failed ({done.returncode}): {done.stderr[-2000:]}")
    _, ready, answered, tokens = line.split()
    return {"ready_s": float(ready), "answered_s": float(answered), "tokens": int(tokens)}


def start_server(model: str, dtype: str, env: dict[str, str], port: int = 8391) -> dict[str, float]:
    """``rag-accel serve``'s start: ready when ``/v1/models`` answers; then one chat completion."""
    import signal
    import urllib.request

    t0 = time.time()
    proc = subprocess.Popen(["rag-accel", "serve", model, "--dtype", dtype, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server stopped ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=2) as r:
                    served = json.loads(r.read())["data"][0]["id"]
                    break
            except OSError:
                time.sleep(0.5)
        ready = time.time() - t0
        body = json.dumps({"model": served, "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(f"{base}/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            tokens = json.loads(r.read())["usage"]["completion_tokens"]
        return {"ready_s": ready, "answered_s": time.time() - t0, "tokens": tokens}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def plot(path: Path) -> None:
    """Each start's time to ready, by dtype, the first on empty compile caches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels, values = [], []
    for dtype, rs in result["runs"].items():
        for i, r in enumerate(rs):
            labels.append(f"{dtype}\n{'first (empty caches)' if i == 0 else f'start {i + 1}'}")
            values.append(r["ready_s"])
    ax.bar(range(len(values)), values, color=["C0" if "first" in lb else "C1" for lb in labels])
    ax.axhline(60, ls="--", c="grey", lw=1, label="60 s")
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("seconds to ready")
    ax.set_title(f"{'rag-accel serve' if result.get('serve') else 'VllmDecoder'} start: {result['model']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--starts", type=int, default=3, help="starts per dtype, the first on empty compile caches")
    ap.add_argument("--serve", action="store_true", help="time rag-accel serve's start instead of a VllmDecoder's")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.out is None:
        ap.error("--out is required")
    import platform
    from importlib.metadata import version

    from rag_accel_lab.machine import cpu_description

    machine = (f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, torch {version('torch')}, "
               f"vllm {version('vllm-cpu')}")

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    runs: dict[str, list[dict]] = {}
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory(prefix="start-times-") as caches:
            runs[dtype] = [start(args.model, dtype, Path(caches), args.serve) for _ in range(args.starts)]
            print(dtype, runs[dtype], flush=True)
    command = (f"python benchmarks/experiments/start_times.py --model {args.model} --dtypes {args.dtypes} "
               f"--starts {args.starts}{' --serve' if args.serve else ''} --out {args.out}")
    result = {"command": command, "model": args.model, "serve": args.serve, "machine": machine, "date": time.strftime("%Y-%m-%d"),
              "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    what = "rag-accel serve" if args.serve else "a VllmDecoder"
    lines = [f"# How long {what} takes to be ready: {args.model}, first start and later", "",
             f"- command: `{command}`", f"- machine: {result['machine']}; load (1/5/15 min) before {load_before}, "
             f"after {result['load_after']}",
             "- each start a fresh process (compiled, vLLM's default); the first of each dtype on empty compile "
             "caches; the model's conversion and the exact mode's probes remembered from earlier runs in all", "",
             "| dtype | start | ready (s) | first answer (s) |", "|---|---|---|---|"]
    lines += [f"| {dtype} | {i + 1}{' (empty caches)' if i == 0 else ''} | {r['ready_s']:.1f} | {r['answered_s']:.1f} |"
              for dtype, rs in runs.items() for i, r in enumerate(rs)]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
