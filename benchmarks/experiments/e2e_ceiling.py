"""How far ahead of plain vLLM + suffix decoding can any copying drafter get, end to end with the prefill?

    python benchmarks/experiments/e2e_ceiling.py \\
        --outputs benchmarks/results/greedy_outputs_qwen15_bf16_last40x64.json \\
        --run benchmarks/results/rag_vllm_cpu_qwen15_last6_bf16_vs_plain.json \\
        --out benchmarks/results/e2e_ceiling_qwen15_last40

(in the vLLM virtualenv, arctic-inference installed: suffix decoding is replayed with it). A RAG answer's time is
its prefill (the time to its first token) plus its decoding steps. Speculation shortens only the second, so
the first bounds what any drafter can win. On the model's known greedy answers (``--outputs``) it counts the
decoding steps of

* the copy oracle (``rag_accel_lab.replay.copy_ceiling``, at most ``--k-oracle`` tokens a step): it knows the
  answer and copies, each step, the most tokens any match in the references, the prompt or the answer so far
  gets accepted; no drafter that copies from those sources takes fewer steps. Also with earlier answers as a
  source (what suffix decoding's global tree holds);
* ours (the default chain, the cost-aware policy) and suffix decoding (vLLM's defaults, its global tree of
  earlier answers), replayed as ``suffix_replay.py`` replays them, at most 10 draft tokens a step;

then prices them with what ``--run`` (an ``edit_bench.py --engine vllm`` run on the same model) measured: the
time to first token per prompt token of rag-accel's exact mode and of plain vLLM, and the time of a decoding step
of each method (its decode time over its steps after the first token). The oracle's step is priced as ours: a
bound, since its drafts are as long as ours or longer. What comes out: each method's modelled tokens/s end to end
against plain vLLM + suffix, and the tokens per step a drafter would need to reach a given ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from rag_accel_lab.replay import PromptTokens, copy_ceiling, prepare, replay

K = 10
TARGETS = (1.0, 1.1)


def measured_costs(run: dict, prompt_len: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per method of an edit_bench vLLM run (one request at a time): seconds of prefill per prompt token, seconds a
    decoding step, and its tokens per step."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for r in run["rows"]:
        if r.get("level", 1) == 1:
            rows[r["method"]].append(r)
    out = {}
    for method, rs in rows.items():
        first = sum(r["first_token_s"] for r in rs)
        out[method] = {"prefill_s_per_token": first / sum(prompt_len[r["item"]] for r in rs),
                       "step_s": sum(r["seconds"] - r["first_token_s"] for r in rs) / sum(r["steps"] - 1 for r in rs),
                       "tokens_per_step": sum(r["new_tokens"] for r in rs) / sum(r["steps"] for r in rs)}
    return out


def suffix_steps(prepared: list[tuple]) -> int:
    """Suffix decoding's steps (vLLM's defaults, its global tree), as ``suffix_replay.suffix_replay`` counts."""
    from suffix_replay import suffix_replay  # (a sibling script: python puts this folder on the path)

    tokens = sum(len(t) for *_, t in prepared)
    return round(tokens / suffix_replay(prepared, [1.0] * (K + 1))["tokens_per_step"])


def modelled(prefill: float, steps: int, items: int, step_s: float) -> float:
    """Seconds for the items' answers: the prefill, then every step after each item's first token."""
    return prefill + (steps - items) * step_s


def plot(path: Path) -> None:
    """Each drafting's modelled tokens/s against plain vLLM + suffix and plain greedy, beside the prefill's bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["vs_plain_suffix"] for r in rows], 0.4, label="vs plain vLLM + suffix")
    ax.bar([i + 0.2 for i in x], [r["vs_plain_greedy"] for r in rows], 0.4, label="vs plain vLLM greedy")
    ax.axhline(result["decoding_free"], ls="--", c="C0", lw=1, label="prefill alone (vs suffix)")
    ax.axhline(1.0, c="grey", lw=0.8)
    ax.set_xticks(list(x), [r["method"].replace(", ", ",\n") for r in rows], fontsize=8)
    ax.set_ylabel("modelled tokens/s ratio, end to end")
    ax.set_title(f"{result['model']}: {result['items']} RAG answers", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=None,
                    help="the model's greedy answers (default: --run's own vllm-greedy answers)")
    ap.add_argument("--run", type=Path, default=None, help="an edit_bench.py --engine vllm run (JSON)")
    ap.add_argument("--k-oracle", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.out is None or args.run is None:
        ap.error("--run and --out are required")
    from rag_accel.config import DEFAULT_COPY_DRAFTERS
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    run = json.loads(args.run.read_text())
    items = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    with tempfile.TemporaryDirectory() as folder:
        outputs = args.outputs
        if outputs is None:  # the run's own greedy answers
            outputs = Path(folder) / "outputs.json"
            outputs.write_text(json.dumps({"model": run["model"], "outputs": {
                r["item"]: r["token_ids"] for r in run["rows"]
                if r["method"] == "vllm-greedy" and r.get("level", 1) == 1}}))
        saved = json.loads(outputs.read_text())
        tok = PromptTokens(saved["model"])
        prepared = prepare(outputs, tok, items)
    run_items = {r["item"] for r in run["rows"]}
    prompt_len = {i: len(tok.encode_prompt(rag_messages(items[i].query, items[i].passages))) for i in run_items}
    costs = measured_costs(run, prompt_len)
    n, tokens = len(prepared), sum(len(t) for *_, t in prepared)
    prompt_tokens = sum(len(p) for _, p, _, _ in prepared)

    steps = {"oracle": n + sum(len(s) for s in copy_ceiling(prepared, args.k_oracle)),
             "oracle, earlier answers too": n + sum(len(s) for s in copy_ceiling(prepared, args.k_oracle, True)),
             "ours": round(tokens / replay(prepared, K, drafters=DEFAULT_COPY_DRAFTERS)["tokens_per_step"]),
             "suffix": suffix_steps(prepared)}
    ours, plain, greedy = costs["vllm-ours"], costs["plain-vllm-suffix"], costs["plain-vllm-greedy"]
    prefill_ours = ours["prefill_s_per_token"] * prompt_tokens
    base = modelled(plain["prefill_s_per_token"] * prompt_tokens, steps["suffix"], n, plain["step_s"])
    plain_greedy = modelled(greedy["prefill_s_per_token"] * prompt_tokens, tokens, n, greedy["step_s"])
    rows = []
    for name, s in steps.items():
        # the drafters' steps priced as ours (exact mode), suffix's as plain vLLM's own
        seconds = base if name == "suffix" else modelled(prefill_ours, s, n, ours["step_s"])
        rows.append({"method": name, "steps": s, "tokens_per_step": tokens / s, "seconds": seconds,
                     "vs_plain_suffix": base / seconds, "vs_plain_greedy": plain_greedy / seconds})
    zero = base / prefill_ours
    need = {t: tokens / (n + (base / t - prefill_ours) / ours["step_s"]) if base / t > prefill_ours else None
            for t in TARGETS}
    result = {"command": ("python benchmarks/experiments/e2e_ceiling.py"
                          + (f" --outputs {args.outputs}" if args.outputs else "") + f" --run {args.run} --out {args.out}"
                          + (f" --k-oracle {args.k_oracle}" if args.k_oracle != 64 else "")),
              "model": saved["model"], "machine": run["machine"], "date": run["date"], "items": n, "tokens": tokens, "prompt_tokens": prompt_tokens,
              "measured": costs, "rows": rows, "decoding_free": zero, "decoding_free_vs_greedy": plain_greedy / prefill_ours,
              "tokens_per_step_needed": {str(t): v for t, v in need.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# How far ahead of plain vLLM + suffix decoding any copying drafter can get: {saved['model']}, "
             f"{n} RAG answers, end to end", "",
             f"- command: `{result['command']}`",
             f"- answers: `{args.outputs or 'vllm-greedy of the run'}` (the model's greedy answers; {tokens} tokens, {prompt_tokens} prompt "
             f"tokens); costs measured by `{args.run}` ({run['machine']}; {run['date'][:10]}; vLLM's threads bound "
             f"to cores {run.get('env', {}).get('VLLM_CPU_OMP_THREADS_BIND', '?')}; load {run.get('load_before')} "
             f"before, {run.get('load_after')} after)",
             "- a model, not a timing: the replays count steps on the known answers, the run's measurements price "
             "them (this run's own tokens per step, replayed, against measured: see the rows ours and suffix)",
             f"- measured there, one request at a time: prefill {ours['prefill_s_per_token'] * 1e3:.2f} ms a prompt "
             f"token in exact mode, {plain['prefill_s_per_token'] * 1e3:.2f} ms in plain vLLM; a decoding step "
             f"{ours['step_s'] * 1e3:.0f} ms (ours, exact), {plain['step_s'] * 1e3:.0f} ms (plain suffix); tokens "
             f"per step there: ours {ours['tokens_per_step']:.2f}, plain suffix {plain['tokens_per_step']:.2f}", "",
             "| drafting (replayed on the answers) | decoding steps | tokens/step | modelled seconds | tokens/s vs "
             "plain vLLM + suffix | vs plain vLLM greedy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['steps']} | {r['tokens_per_step']:.2f} | {r['seconds']:.1f} | "
              f"{r['vs_plain_suffix']:.2f}x | {r['vs_plain_greedy']:.2f}x |" for r in rows]
    lines += ["", f"- plain vLLM greedy, modelled: {plain_greedy:.1f} s (its measured step "
              f"{greedy['step_s'] * 1e3:.0f} ms)",
              f"- decoding in no time at all (the prefill alone): {zero:.2f}x plain vLLM + suffix, "
              f"{plain_greedy / prefill_ours:.2f}x plain greedy"]
    lines += [f"- {t:.2f}x needs {v:.2f} tokens a step at ours' step cost" if v else
              f"- {t:.2f}x is out of reach even with free decoding" for t, v in need.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
