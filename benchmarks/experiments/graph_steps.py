"""What the transformers engine's steps cost on a GPU, eager against static steps replayed as CUDA graphs, and how
many of a verify's rows equal one-token steps there, bit for bit.

    python benchmarks/experiments/graph_steps.py --device cuda --out benchmarks/results/graph_steps_h200
    python benchmarks/experiments/graph_steps.py --device cpu --shapes tiny --dtypes float32 --reps 3 \
        --out /tmp/graph_steps                  # a smoke run on a CPU (static steps run eagerly there)

Per shape (``gpu_step_costs.py``'s public configs with random weights: a step's time does not hang on their values)
and dtype, on a ``--context``-token cache, each step as the decoder takes it: the token ids in, the argmax of its
rows back on the host (the sync acceptance needs), the host's work included:

- ``eager``: transformers' forward on a ``DynamicCache``, cropped back after each step (``static_steps=False``: what
  the engine ran on a GPU before);
- ``static``: the engine's static steps (:mod:`rag_accel.hf.static`, its default on a GPU): one preallocated cache,
  sizes 1, 2, 4, ..., 32, 33 tokens, replayed as CUDA graphs (run eagerly on a CPU);
- ``exact``: the same with ``exact=True``: only the sizes whose rows the probe (``exact_sizes``) finds bit for bit
  the largest size's (listed, with the probe's time; no such path where it keeps none). Its steps, timed and
  compared, hold at most its largest kept size (``-`` in the table above it), as the decoder's drafts on it do.

Times: the median of ``--reps`` steps after warm-ups, for ``1 + k`` tokens. ``rows``: for ``k`` = 1..32 at three cache
lengths, how many of a verify's ``k`` rows are ``torch.equal`` to the one-token steps at the same positions, for each
path: what exact steps must bring to all of them (the ``exact`` path must).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any



def _sibling(name: str) -> Any:
    """A script beside this one, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_costs = _sibling("gpu_step_costs")  # the public configs' shapes and their random-weight models
SHAPES = {**_costs.SHAPES, "tiny": _costs.TINY}
build_model = _costs.build_model
KS = (0, 1, 3, 7, 15, 31, 32)  # draft tokens: each 1 + k a static step's size (step_sizes(32))
EXTRA = (0, 64, 160)  # the verify rows' check: context on top of the prompt


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(fn: Any, reps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()  # (ends with .tolist(): the host has the step's argmax)
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def measure(name: str, dtype_name: str, context: int, reps: int, warmup: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache

    from rag_accel.hf.kv import cache_kwarg
    from rag_accel.hf.static import StaticSteps, step_sizes

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = build_model(SHAPES[name], dtype, device)
    kw = cache_kwarg(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    dev = torch.device(device)
    sizes = step_sizes(max(KS))
    capacity = context + EXTRA[-1] + 2 * max(sizes) + 8
    steps = StaticSteps(model, kw, sizes, capacity, capture=device.startswith("cuda"))
    exact = StaticSteps(model, kw, sizes, capacity, capture=device.startswith("cuda"), exact=True)
    result: dict[str, Any] = {"model": name, "dtype": dtype_name, "context": context,
                              "params": sum(p.numel() for p in model.parameters()), "ms": {}, "rows": {}}
    with torch.inference_mode():
        lease, exact_lease = steps.lease(capacity), exact.lease(capacity)
        assert lease is not None and exact_lease is not None
        t0 = time.perf_counter()
        found = exact.probe()  # (its sizes: the ones that compute every row as the largest does; none: no path)
        result["exact_sizes"] = list(exact.sizes) if found else []
        result["probe_s"] = round(time.perf_counter() - t0, 2)
        print(name, dtype_name, "exact sizes", exact.sizes, f"(probe {result['probe_s']} s)", flush=True)
        dynamic = DynamicCache(config=model.config)
        lease.forward(prompt, True, dev)
        exact_lease.forward(prompt, True, dev)
        model(input_ids=torch.tensor([prompt], device=dev), **{kw: dynamic}, use_cache=True, logits_to_keep=1)

        def static_step(ids: list[int], lease: Any = lease) -> Any:
            return lease.forward(ids, False, dev)

        def eager_step(ids: list[int]) -> Any:
            return model(input_ids=torch.tensor([ids], device=dev), **{kw: dynamic}, use_cache=True).logits[0]

        paths = {"eager": (eager_step, dynamic), "static": (static_step, lease)}
        if found:
            paths["exact"] = (lambda ids: static_step(ids, exact_lease), exact_lease)
        # (the exact path's steps hold at most its largest kept size: the decoder drafts no more on it)
        most = {"exact": exact.sizes[-1]} if found else {}
        for path, (step, cache) in paths.items():
            result["ms"][path] = {}
            for k in (k for k in KS if k + 1 <= most.get(path, k + 1)):
                ids = torch.randint(0, vocab, (k + 1,), generator=gen).tolist()

                def one(ids: list[int] = ids, step: Any = step, cache: Any = cache) -> None:
                    step(ids).argmax(-1).tolist()
                    cache.crop(-len(ids))

                result["ms"][path][str(k)] = _median_ms(one, reps, warmup, device)
            print(name, dtype_name, path, {k: round(v, 3) for k, v in result["ms"][path].items()}, flush=True)
        for path, (step, cache) in paths.items():
            equal = total = 0
            for extra in EXTRA:  # three cache lengths: the prompt, then more context on top
                ctx = torch.randint(0, vocab, (extra,), generator=gen).tolist()
                if ctx:
                    step(ctx)
                for k in range(1, min(32, most.get(path, 32)) + 1):
                    ids = torch.randint(0, vocab, (k,), generator=gen).tolist()
                    alone = []
                    for t in ids:
                        alone.append(step([t])[-1].clone())
                    cache.crop(-k)
                    together = step(ids)
                    cache.crop(-k)
                    equal += sum(torch.equal(together[i], alone[i]) for i in range(k))
                    total += k
                if ctx:
                    cache.crop(-len(ctx))
            result["rows"][path] = {"equal": equal, "total": total}
            print(name, dtype_name, path, f"verify rows equal to one-token steps: {equal} of {total}", flush=True)
        lease.release()
        exact_lease.release()
    del model, steps, lease, exact, exact_lease, dynamic
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def report(path: Path) -> None:
    data = json.loads(path.read_text())
    lines = [f"# The transformers engine's steps on {data['device']}: eager against static (CUDA graphs), "
             f"{data['date'][:10]}", "",
             f"- command: `{data['command']}` ({data['seconds']} s)",
             f"- torch {data['torch']}, transformers {data['transformers']}; {data['cpus']} CPU cores, load "
             f"{data['load_before'][0]:.2f} before and {data['load_after'][0]:.2f} after (1-minute average)",
             f"- random weights of the public configs' shapes; a cache of {data['runs'][0]['context']} tokens; each "
             "step's argmax read back on the host (host work included); medians of "
             f"{data['reps']} steps", "",
             "| model | path | plain step | " + " | ".join(f"k = {k}" for k in KS[1:]) + " | verify rows equal |",
             "|---|---|---|" + "---|" * len(KS)]
    lines_exact: list[str] = []
    for run in data["runs"]:
        kept = ", ".join(map(str, run["exact_sizes"])) or "none (no exact path: the steps run on a dynamic cache)"
        lines_exact.append(f"- {run['model']} {run['dtype']}: exact sizes {kept} (probe {run['probe_s']} s)")
        for p, ms in run["ms"].items():
            rows = run["rows"][p]
            lines.append(f"| {run['model']} {run['dtype']} | {p} | {ms['0']:.2f} ms | "
                         + " | ".join(f"{ms[str(k)] / ms['0']:.2f}x" if str(k) in ms else "-" for k in KS[1:])
                         + f" | {rows['equal']} of {rows['total']} |")
    lines += ["", "- k: draft tokens verified in one step (`1 + k` tokens), over the same path's plain step.",
              "- verify rows equal: rows of verifies of k = 1..32 at three cache lengths that are bit for bit the "
              "one-token steps' at their positions (exact steps need every one; the exact path's up to its largest "
              "size).",
              "- exact: static steps in the sizes the probe keeps (a step runs in the smallest kept size that holds "
              "it):", *lines_exact]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        plot(data, path.with_suffix(".png"))
    except ImportError:
        print("plot skipped: matplotlib is not installed")
    print(path.with_suffix(".md").read_text())


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in data["runs"]:
        for p, style in (("eager", "--"), ("static", "-"), ("exact", ":")):
            if p not in run["ms"]:
                continue
            ks = [k for k in KS if str(k) in run["ms"][p]]
            ax.plot(ks, [run["ms"][p][str(k)] for k in ks], style, marker="o", ms=3,
                    label=f"{run['model']} {run['dtype']} {p}")
    ax.set_xlabel("draft tokens verified (k)")
    ax.set_ylabel("ms per step (host work included)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"Steps on {data['device']}, {data['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b", help=f"of {sorted(SHAPES)}")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: .json, .md and .png are written")
    a = ap.parse_args()
    import torch
    import transformers

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    runs = [measure(s, d, a.context, a.reps, a.warmup, a.device) for s in a.shapes.split(",")
            for d in a.dtypes.split(",")]
    cpu = f"CPU ({platform.processor() or 'x86_64'})"
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else cpu
    data = {"device": device, "date": datetime.now(timezone.utc).isoformat(), "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__, "transformers": transformers.__version__, "cpus": os.cpu_count(),
            "load_before": load_before, "load_after": os.getloadavg(), "seconds": round(time.perf_counter() - t0),
            "reps": a.reps, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    report(a.out.with_suffix(".json"))


if __name__ == "__main__":
    main()
