"""What copying can reach at best on a GPU whose steps are graph-captured, and what our drafting would reach there:
the ceiling of the transformers engine's static steps, from measured GPU step times, before any GPU run of it.

    python benchmarks/experiments/gpu_ceiling.py --out benchmarks/results/gpu_ceiling_h200_smollm2_last30x64_bf16

The model's answers (``--outputs``: a ``rag-accel bench --save-outputs`` file, ``--method``'s outputs: our plain
steps, what drafting must reproduce) fix every step's outcome. A step of ``1 + L`` tokens costs what ``--costs``
(``gpu_step_costs.py``: one row, CUDA graphs, the GPU's time alone) measured for the static step size that holds it
(:func:`rag_accel.hf.static.step_sizes`: padded up to 1, 2, 4, ..., 32 or 33 tokens; linear between measured sizes,
past the last at its slope), plus ``--host-ms`` of the engine's host work per step (unmeasured there: each value a
row). Per item, a whole request: a prefill of ``--prefill-ms`` (the same for every method), then its steps:

- ``oracle``: :func:`rag_accel_lab.replay.copy_ceiling`: each step copies the most tokens that get accepted from the
  references, the prompt or the answer so far (at most ``--k``): no copy drafter takes fewer steps;
- ``ours, oracle lengths``: our drafts (:func:`rag_accel_lab.replay.replay`, the default chain of copy drafters),
  each sent at just the length that gets accepted: what the policy's choice of lengths leaves;
- ``ours``: the real drafting pricing its drafts with that curve (its loss budget counting the prefill as that many
  plain steps), one decoder learning across the items (warm).

Each as plain steps' time over its own (geo-mean over items, and the worst item); a plot of the three by host work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from rag_accel.config import DecoderConfig
from rag_accel_lab.replay import copy_ceiling, replay

RESULTS = Path(__file__).resolve().parents[1] / "results"


def graph_ms(costs: dict[str, Any], model: str, dtype: str) -> dict[int, float]:
    """One-row graph step times (ms) by tokens, from a ``gpu_step_costs.py`` JSON."""
    run = next(r for r in costs["runs"] if r["model"] == model and r["dtype"] == dtype)
    return {s["tokens"]: s["ms_median"] for s in run["modes"]["graph"]["shapes"] if s["rows"] == 1}


def step_ms(ms: dict[int, float], tokens: int, sizes: Sequence[int]) -> float:
    """A static step's time for ``tokens`` tokens: the smallest size that holds them, linear between the measured
    token counts (past the last, at the last two's slope).

    Example:
        >>> step_ms({1: 2.0, 3: 3.0, 5: 3.5}, 2, (1, 2, 4)), step_ms({1: 2.0, 3: 3.0, 5: 3.5}, 4, (1, 2, 4))
        (2.5, 3.25)
        >>> step_ms({1: 2.0, 3: 3.0, 5: 3.5}, 6, (1, 2, 4, 7))  # 7 tokens: past 5 at 0.25 ms a token
        4.0
    """
    n = next(s for s in sizes if s >= tokens)
    known = sorted(ms)
    lo = max((t for t in known if t <= n), default=known[0])
    hi = min((t for t in known if t >= n), default=known[-1])
    if lo == hi and n > known[-1]:
        lo, hi = known[-2], known[-1]
    if lo == hi:
        return ms[lo]
    return ms[lo] + (ms[hi] - ms[lo]) * (n - lo) / (hi - lo)


def geo(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def ceilings(prepared: Sequence[tuple], ms: dict[int, float], k: int, host_ms: float,
             prefill_ms: float) -> dict[str, Any]:
    """Whole requests' speed-ups over plain steps (a prefill of ``prefill_ms``, then the decoding steps) at
    ``host_ms`` of host work a step: the copy oracle's, our drafting's with the oracle's lengths, our drafting's."""
    from rag_accel.hf.static import step_sizes

    sizes = step_sizes(k)
    cost = [step_ms(ms, 1 + L, sizes) + host_ms for L in range(k + 1)]  # ms of a step sending L draft tokens
    plain = [prefill_ms + (len(t) - 1) * cost[0] for *_, t in prepared]
    tokens = sum(len(t) for *_, t in prepared)
    oracle_steps = copy_ceiling(prepared, k)
    oracle = [p / (prefill_ms + sum(cost[L] for L in steps)) for p, steps in zip(plain, oracle_steps)]
    row: dict[str, Any] = {"host_ms": host_ms, "plain_ms": round(cost[0], 3), "prefill_ms": prefill_ms,
                           "oracle": round(geo(oracle), 3), "oracle_worst": round(min(oracle), 3),
                           "oracle_tokens_per_step": round(tokens / sum(len(s) + 1 for s in oracle_steps), 2)}
    curve = [c / cost[0] for c in cost]
    per_token = prefill_ms / cost[0] / statistics.fmean(len(p) for _, p, _, _ in prepared)  # (the loss budget's)
    for name, exact in (("ours_oracle_lengths", True), ("ours", False)):
        r = replay(prepared, k, curve, drafters=DecoderConfig().drafters, exact_lengths=exact,
                   prefill_per_token=per_token)
        ratios = [p / (prefill_ms + c * cost[0]) for p, c in zip(plain, r["costs"])]
        row |= {name: round(geo(ratios), 3), f"{name}_worst": round(min(ratios), 3),
                f"{name}_tokens_per_step": round(r["tokens_per_step"], 2)}
    return row


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    hosts = [r["host_ms"] for r in data["rows"]]
    for i, (name, label) in enumerate((("oracle", "copy oracle"), ("ours_oracle_lengths", "ours, oracle lengths"),
                                       ("ours", "ours"))):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(hosts))], [r[name] for r in data["rows"]], 0.25, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(hosts)), [f"{h:g} ms" for h in hosts])
    ax.set_xlabel("the engine's host work a step")
    ax.set_ylabel("speed-up over plain steps")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Copying's ceiling, {data['device']} graph steps, {data['dtype']}, {data['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", type=Path, default=RESULTS / "outputs_smollm2_last30x64_bf16_quiet.json")
    ap.add_argument("--method", default="ours-plain", help="whose outputs of --outputs are the answers")
    ap.add_argument("--costs", type=Path, default=RESULTS / "gpu_step_costs_h200.json")
    ap.add_argument("--shape", default="smollm2-135m", help="the --costs model whose step times price the steps")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the model of --outputs (its tokenizer)")
    ap.add_argument("--k", type=int, default=32, help="most draft tokens a step (the decoder's max_draft_tokens)")
    ap.add_argument("--host-ms", default="0,0.25,0.5,1", help="the engine's host work per step, ms (comma-separated)")
    ap.add_argument("--prefill-ms", type=float, default=30.0,
                    help="a request's prefill, ms (default: about the H200's eager first forward for this model)")
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    a = ap.parse_args()
    from rag_accel import ReferenceDecoder
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    saved = json.loads(a.outputs.read_text())
    answers = saved["by_method"][a.method] if a.method in saved.get("by_method", {}) else saved["outputs"]
    dec = ReferenceDecoder.from_pretrained(a.model, calibrate=False)  # (its tokenizer: the prompts' ids)
    items = {it.id: it for it in load_msmarco_sample()}
    prepared = [(i, dec.encode_prompt(rag_messages(items[i].query, items[i].passages)),
                 dec.encode_references(list(items[i].passages)), answer) for i, answer in answers.items()]
    del dec
    costs = json.loads(a.costs.read_text())
    ms = graph_ms(costs, a.shape, saved["dtype"])
    rows = [ceilings(prepared, ms, a.k, float(h), a.prefill_ms) for h in a.host_ms.split(",")]
    command = "python " + " ".join(sys.argv)
    data = {"date": datetime.now(timezone.utc).isoformat(), "command": command, "outputs": str(a.outputs),
            "method": a.method, "costs": str(a.costs), "device": costs["device"], "shape": a.shape,
            "dtype": saved["dtype"], "k": a.k, "items": len(prepared), "load": os.getloadavg(), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    lines = [f"# Copying's ceiling on {costs['device']}'s graph-captured steps: {a.model} {saved['dtype']}, "
             f"{len(prepared)} answers, {data['date'][:10]}", "",
             f"- command: `{command}`",
             f"- answers: `{a.outputs.name}` ({a.method}'s); step times: `{a.costs.name}` ({a.shape} {saved['dtype']}, "
             f"one row, CUDA graphs, the GPU's time), each step padded to the static size that holds it; at most "
             f"{a.k} draft tokens a step",
             f"- speed-ups over plain steps on the same engine, whole requests (a prefill of {a.prefill_ms:g} ms, "
             "then the decoding steps), geo-mean over items (worst item); tokens per step count the prefill's",
             "- copy oracle: each step copies the most that gets accepted, from the best place; ours, oracle lengths: "
             "our drafts, each sent at just its accepted length; ours: our drafting as it runs (modelled)", "",
             "| host work a step | plain step | copy oracle | tokens/step | ours, oracle lengths | tokens/step "
             "| ours | tokens/step | ours / oracle |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['host_ms']:.2f} ms | {r['plain_ms']:.2f} ms | "
                     + " | ".join(f"{r[n]:.2f}x ({r[n + '_worst']:.2f}x) | {r[n + '_tokens_per_step']:.2f}"
                                  for n in ("oracle", "ours_oracle_lengths", "ours"))
                     + f" | {r['ours'] / r['oracle']:.2f} |")
    lines += ["", f"![the three by host work]({a.out.name}.png)"]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(data, a.out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
