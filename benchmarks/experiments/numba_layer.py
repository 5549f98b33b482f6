"""vLLM's n-gram speculation under numba's default threading layer and under its workqueue layer, side by side.

    python benchmarks/experiments/numba_layer.py --out benchmarks/results/numba_layer_vllm_cpu_smollm2

(in the vLLM virtualenv, with the bench environment: ``VLLM_CPU_OMP_THREADS_BIND=0-1``,
``LD_PRELOAD=$VIRTUAL_ENV/lib/libiomp5.so``). vLLM's n-gram proposer runs a numba ``parallel=True`` loop
every step; numba picks its threading layer when its engine process first runs one, from
``NUMBA_THREADING_LAYER`` (default: the first of tbb, omp, workqueue that loads; omp here). Why the
benchmarks set ``NUMBA_THREADING_LAYER=workqueue`` for their engines (``rag_accel.methods.PEER_ENVIRONMENT``):
this measures both in one process, on the same items, so that the difference is the layer's.

Engines, one process each, all alive together, float32, eager, prefix caching off, 10 draft tokens at most:
``vllm-greedy``; ``vllm-ngram (numba default)``, started with ``NUMBA_THREADING_LAYER`` unset;
``vllm-ngram (workqueue)``, started with it set to ``workqueue``; ``vllm-ours`` (no numba: a control, started
in the default). A spare plain engine is built and closed first (none timed is the process's first). Levels
of 1 and 4 requests in flight, each on its own items of the sample's last ones, the methods' order rotating per
group (``inflight_bench.run_levels``); every output compared with vllm-greedy's, token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LAYER = "NUMBA_THREADING_LAYER"
# engine name -> (speculation, NUMBA_THREADING_LAYER when it starts; None: unset)
ENGINES = {"vllm-greedy": ("off", None), "vllm-ngram (numba default)": ("ngram", None),
           "vllm-ngram (workqueue)": ("ngram", "workqueue"), "vllm-ours": ("ours", None)}
LEVELS = (1, 4)


def build(model: str, k: int, max_model_len: int) -> dict:
    from rag_accel.bench.harness import spare_engine
    from rag_accel_lab.inflight import ngram_config
    from rag_accel.vllm import VllmDecoder

    common = dict(max_draft_tokens=k, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
                  enable_prefix_caching=False)
    old = os.environ.pop(LAYER, None)
    engines: dict = {}
    try:
        spare_engine(model, **common)
        for name, (speculation, layer) in ENGINES.items():
            os.environ.pop(LAYER, None)
            if layer is not None:
                os.environ[LAYER] = layer
            spec = {"speculative_config": ngram_config(k)} if speculation == "ngram" else {}
            print(f"starting {name} ...", flush=True)
            engines[name] = VllmDecoder.from_pretrained(model, speculation=speculation, **common, **spec)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    finally:
        os.environ.pop(LAYER, None)
        if old is not None:
            os.environ[LAYER] = old
    return engines


def plot(path: Path) -> None:
    """Tokens/s against vllm-greedy per engine and level, next to the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    summary, names = run["summary"], [n for n in ENGINES if n != "vllm-greedy"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + width * i for x in range(len(LEVELS))], [summary[f"{name}@{c}"]["vs_greedy"] for c in LEVELS],
               width, label=name, color=f"C{i}")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(LEVELS))], [f"{c} in flight" for c in LEVELS])
    ax.set_ylabel("tokens/s against vllm-greedy")
    ax.set_title(f"vLLM n-gram speculation by numba threading layer ({run['environment']['date']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--items", default="12,16", help="items for 1 and 4 in flight (the sample's last ones)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/numba_layer_vllm_cpu_smollm2"))
    ap.add_argument("--plot", type=Path, default=None,
                    help="draw a run's plot from its JSON (matplotlib), and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import VLLM_ENV_RECORDED
    from rag_accel_lab.inflight import run_levels, summarize, table, take_prompts
    from rag_accel.rag.msmarco import load_msmarco_sample

    load_before = os.getloadavg()
    t_start = time.time()
    n_items = dict(zip(LEVELS, (int(x) for x in args.items.split(","))))
    items = load_msmarco_sample()[-sum(n_items.values()):]
    dec = ReferenceDecoder.from_pretrained(args.model)  # (the prompts' tokenizer; no model work)
    prompts, refs, ids = take_prompts(items, n_items, dec)
    engines = build(args.model, args.k, args.max_model_len)
    try:
        rows = run_levels(engines, prompts, refs, args.new)
    finally:
        for e in engines.values():
            e.close()
    summary = summarize(rows)
    for r in rows:
        r.pop("token_ids")
    import torch
    import vllm

    env = {"model": args.model, "device": platform.processor() or platform.machine(), "vllm": vllm.__version__,
           "torch": torch.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "load_before": load_before, "load_after": os.getloadavg(), "minutes": (time.time() - t_start) / 60,
           "vllm_env": {k: os.environ[k] for k in VLLM_ENV_RECORDED if k in os.environ}, "k": args.k,
           "new_tokens": args.new,
           "engines": {n: {"speculation": s, LAYER: layer} for n, (s, layer) in ENGINES.items()}}
    command = f"python benchmarks/experiments/numba_layer.py --items {args.items} --new {args.new} --out {args.out}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "command": command, "items": ids, "summary": summary, "rows": rows}, indent=1))
    lines = [f"# vLLM's n-gram speculation under numba's threading layers: {env['model']} float32, {env['device']}, "
             f"{env['date']}", "",
             f"- command: `{command}` (in the vLLM virtualenv)",
             f"- vLLM {env['vllm']}, torch {env['torch']}, {args.k} draft tokens at most, {args.new} new tokens a "
             f"request, env {env['vllm_env']}; a spare plain engine built and closed first",
             "- engines, all alive together: " + "; ".join(
                 f"{n}: {LAYER}={layer or 'unset'}" for n, (_, layer) in ENGINES.items()),
             f"- machine load (1/5/15 min) before {tuple(round(x, 2) for x in load_before)}, after "
             f"{tuple(round(x, 2) for x in env['load_after'])}; {env['minutes']:.0f} minutes in all",
             f"- items: the sample's last {sum(n_items.values())}, "
             + ", ".join(f"{n} for {c} in flight" for c, n in n_items.items())
             + " (each level its own); tokens/s: new tokens over the wall time of the level's groups", "",
             *table(summary, list(ENGINES), LEVELS), "",
             f"![tokens/s against vllm-greedy]({args.out.name}.png) (drawn by `--plot {args.out}.json`)"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
