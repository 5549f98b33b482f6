"""The long-document case: the prompt holds chunks, the references the whole documents behind them.

    python benchmarks/long_documents.py --out benchmarks/results/long_documents_vllm_cpu_smollm2
    python benchmarks/long_documents.py --plot benchmarks/results/long_documents_vllm_cpu_smollm2.json

(the first in the vLLM virtualenv, arctic-inference installed for vllm-suffix). A RAG application that splits long
documents into chunks puts the retrieved chunks in the prompt; with rag_accel it can also pass the whole
documents behind them as references, which vLLM's suffix decoding, copying from the prompt and its earlier
answers, never sees. Here each passage of an item is a document and its first ``--chunk`` share of words the
chunk in the prompt (the question and the chunks, the chat prompt of the other benchmarks).

One engine per method, float32, eager, prefix caching off, at most 10 draft tokens a step; each item once
per method (suffix decoding also copies from its earlier answers: no prompt twice, an untimed warm-up item
first), one request at a time, the methods' order rotating per item:

* ``vllm-greedy``: no speculation, the baseline every output is compared with, token for token;
* ``vllm-suffix``: vLLM's suffix decoding, vLLM's defaults but 10 tokens;
* ``vllm-ours-chunks``: our proposer with the chunks as references (what the prompt holds);
* ``vllm-ours-documents``: our proposer with the whole documents as references.

Judged on the sample's last items (no default was tuned on them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = ("vllm-greedy", "vllm-suffix", "vllm-ours-chunks", "vllm-ours-documents")


def chunk(passage: str, share: float) -> str:
    """The first ``share`` of a passage's words (at least one)."""
    words = passage.split()
    return " ".join(words[:max(1, math.ceil(share * len(words)))])


def plot(path: Path) -> None:
    """The run's per-item speed-up against vllm-greedy and tokens per step, next to its JSON
    (``--plot``, in a virtualenv with matplotlib: the vLLM one has none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    rows = [r for r in run["rows"] if not r["warm_up"]]
    greedy_s = {r["item"]: r["seconds"] for r in rows if r["method"] == "vllm-greedy"}
    methods = [m for m in METHODS if m != "vllm-greedy"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, m in enumerate(methods):
        sp = [greedy_s[r["item"]] / r["seconds"] for r in rows if r["method"] == m]
        a.scatter([i + (j % 7 - 3) * 0.03 for j in range(len(sp))], sp, s=10, alpha=0.6)
        a.hlines(run["summary"][m]["vs_greedy_geomean"], i - 0.3, i + 0.3, colors="k")
    a.set_xticks(range(len(methods)), methods, rotation=20, ha="right")
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_ylabel("speed-up vs vllm-greedy (per item; bar = geo-mean)")
    b.bar(list(METHODS), [run["summary"][m]["tokens_per_step"] for m in METHODS])
    b.set_xticks(range(len(METHODS)), METHODS, rotation=20, ha="right")
    b.set_ylabel("tokens per verification step")
    fig.suptitle(f"long documents: {len(greedy_s)} items, {run['environment']['model']} float32, "
                 f"{run['environment']['date']}")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--chunk", type=float, default=0.5, help="the share of each passage's words in the prompt")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/long_documents_vllm_cpu_smollm2"))
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    from rag_accel import ReferenceDecoder
    from rag_accel.bench.harness import VLLM_ENV_RECORDED
    from rag_accel_lab.inflight import make_engines
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.vllm.requests import speculative_config

    load_before = os.getloadavg()
    items = load_msmarco_sample(with_answers=True)[-(args.items + 1):]  # the first: suffix's untimed warm-up
    dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct", calibrate=False)  # (the tokenizer only)
    cases = []
    for it in items:
        chunks = [chunk(p, args.chunk) for p in it.passages]
        cases.append({"id": it.id, "prompt": dec.encode_prompt(rag_messages(it.query, chunks)),
                      "refs": {"vllm-ours-chunks": chunks, "vllm-ours-documents": list(it.passages)}})
    specs = {"vllm-greedy": {"speculation": "off"},
             "vllm-suffix": {"speculation": "suffix", "speculative_config": speculative_config("suffix", 10)},
             "vllm-ours-chunks": {"speculation": "ours"}, "vllm-ours-documents": {"speculation": "ours"}}
    engines = make_engines(specs, "smollm2-135m-instruct", 10, 4096, spare_first=True)
    rows = []
    try:
        for i, case in enumerate(cases):
            order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]
            got = {}
            for m in order:
                refs = case["refs"].get(m)
                t0 = time.perf_counter()
                out = engines[m].generate(case["prompt"], references=refs, max_new_tokens=args.new)
                got[m] = (time.perf_counter() - t0, out)
            base = got["vllm-greedy"][1].token_ids
            for m, (seconds, out) in got.items():
                rows.append({"item": case["id"], "method": m, "warm_up": i == 0, "seconds": seconds,
                             "new_tokens": len(out.token_ids), "steps": out.stats.steps,
                             "accepted": out.stats.accepted, "identical": out.token_ids == base})
            print(f"{i}/{len(cases) - 1} " + " ".join(f"{m}={got[m][0]:.2f}s" for m in METHODS), flush=True)
    finally:
        for e in engines.values():
            e.close()
    judged = [r for r in rows if not r["warm_up"]]
    greedy_s = {r["item"]: r["seconds"] for r in judged if r["method"] == "vllm-greedy"}
    summary = {}
    for m in METHODS:
        rs = [r for r in judged if r["method"] == m]
        ratios = [greedy_s[r["item"]] / r["seconds"] for r in rs]
        worst = min(range(len(rs)), key=ratios.__getitem__)
        summary[m] = {"vs_greedy_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                      "worst": ratios[worst], "worst_item": rs[worst]["item"],
                      "tokens_per_step": sum(r["new_tokens"] for r in rs) / sum(max(1, r["steps"]) for r in rs),
                      "identical": sum(r["identical"] for r in rs) / len(rs)}
    import torch
    import vllm

    env = {"model": "smollm2-135m-instruct", "device": platform.processor() or platform.machine(),
           "vllm": vllm.__version__, "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "load_before": load_before,
           "load_after": os.getloadavg(),
           "vllm_env": {k: os.environ[k] for k in VLLM_ENV_RECORDED
                        if k in os.environ}, "spare_engine_first": True}
    command = (f"python benchmarks/long_documents.py --items {args.items} --chunk {args.chunk} --new {args.new} "
               f"--out {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command,
                                                         "summary": summary, "rows": rows}, indent=1))
    lines = [f"# The long-document case: chunks in the prompt, whole documents as references ({args.items} items)",
             "", f"- command: `{command}`",
             f"- {env['model']} float32 on {env['device']}, vLLM {env['vllm']}, torch {env['torch']}, {env['date']}; "
             f"env {env['vllm_env']}; machine load (1/5/15 min) before {load_before}, after {env['load_after']}; "
             "a spare plain engine built and closed before the timed ones (none timed is the process's first)",
             f"- the prompt: the question and the first {args.chunk:.0%} of each passage's words; the documents: "
             f"the whole passages; {args.new} new tokens, one request at a time, each item once per method", "",
             "| method | vs vllm-greedy (geo-mean) | worst item | tokens/step | identical to vllm-greedy |",
             "|---|---|---|---|---|"]
    lines += [f"| {m} | {v['vs_greedy_geomean']:.2f}x | {v['worst']:.2f}x ({v['worst_item']}) | "
              f"{v['tokens_per_step']:.2f} | {v['identical']:.0%} |" for m, v in summary.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
