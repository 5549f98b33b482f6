"""What a verify forward costs on the first two offline models, with and without the transposed output head.

    python benchmarks/experiments/head_cost_curves.py --out benchmarks/results/head_cost_curves_cpu

For each model, :meth:`rag_accel.ReferenceDecoder.cost_curve` (the curve the draft-length policy prices
drafts with, measured at load) over up to 16 draft tokens, with the fast layouts on (the default; ``fast_head`` when this ran, the output head alone; since issue 63
``fast_linears``, every projection, rag_accel.hf.linears) and off:
entry n is a forward over n + 1 tokens on a 256-token context, over a one-token forward. Gemma 3 270M's
262,144-token head is most of its weights, so the head's path matters more there than on SmolLM2 (49k).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import ReferenceDecoder
from rag_accel.models import DEFAULT_MODEL, GEMMA_MODEL

MAX_DRAFT = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    curves = {}
    for name in (DEFAULT_MODEL, GEMMA_MODEL):
        dec = ReferenceDecoder.from_pretrained(name, device="cpu", dtype="float32", calibrate=False)
        curves[name] = {f"fast_head={on}": [round(c, 3) for c in dec.cost_curve(MAX_DRAFT, fast_linears=on)]
                        for on in (True, False)}
        del dec
    env = {"date": datetime.now(timezone.utc).date().isoformat(), "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
           "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "max_draft": MAX_DRAFT, "curves": curves},
                                                   indent=1))
    lines = [f"# Verify cost curves per offline model, float32, cpu ({env['cpu_threads']} threads), {env['date']}", "",
             f"- command: `python benchmarks/experiments/head_cost_curves.py --out {args.out}`",
             f"- torch {env['torch']}; machine load (1/5/15 min) before {load_before}, after {env['load_after']}",
             "- entry n: a forward over n + 1 tokens (n draft tokens) over a one-token forward, 256-token context", "",
             "| model | fast_head | " + " | ".join(str(n) for n in (1, 2, 4, 8, 16)) + " |",
             "|---|---|" + "---|" * 5]
    for name, by in curves.items():
        for key, c in by.items():
            lines.append(f"| {name} | {key.split('=')[1]} | " + " | ".join(f"{c[n]:.2f}" for n in (1, 2, 4, 8, 16)) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
