"""Where predictions pay most: editing a text, and refreshing an answer, on vLLM, peers side by side.

    python benchmarks/predicted_outputs.py --out benchmarks/results/predicted_outputs_vllm_cpu_smollm2

(in the vLLM virtualenv; arctic-inference installed for vllm-suffix). One engine per peer, one after the other,
SmolLM2-135M-Instruct in float32, ``enforce_eager``, prefix caching off, a warm-up request per engine first. Levels
of 1, 4 and 16 requests in flight, each level on its own items (suffix decoding also copies from its engine's
earlier answers: no engine meets an item twice): level 1 one request at a time, the others a level's items in
groups of that size (one ``generate_batch`` each), throughput over the wall time of its groups.

* ``vllm-greedy``: no speculation (every output is compared with it);
* ``vllm-ngram``: vLLM's prompt lookup (k=10, n-grams 2-4);
* ``vllm-suffix``: vLLM's suffix decoding (k=10, its defaults);
* ``vllm-ours``: our proposer, no prediction; ``vllm-ours+prediction``: the same engine, the prediction
  (OpenAI's Predicted Outputs shape) passed with each request;
* ``vllm-ours+prediction-control``: a second engine configured alike, the run's own measure of the spread
  between two engines of one configuration.

Items (from the bundled TREC-DL sample, which no default was tuned on):

* ``edit``: the model rewrites a passage with a small change (fix planted typos, replace a word, reformat
  as a list, drop the last sentence); the prediction is the passage as given. The text is in the prompt too,
  so prompt-copying peers see it as well.
* ``refresh``: the question is answered over its passages (vllm-greedy, not timed); then one passage is edited
  slightly (a number changed) and the question asked again, the earlier answer as the prediction and NOT in the
  prompt. vLLM's suffix decoding on the engine that gave the earlier answers (``vllm-suffix``: it asked the
  originals first, its suffix tree holds their answers) and on a fresh one (``vllm-suffix-elsewhere``: another
  replica, a restart).

Reported per task and level: at 1, the speed-up against vllm-greedy per request (geo-mean, worst item); at 4
and 16, throughput (new tokens / wall time) against vllm-greedy's; tokens per step and the identical-output
rate (against vllm-greedy at the same level) at each. Load (``uptime``) is recorded before and after each engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
K = 10
ENGINES = {"vllm-greedy": "off", "vllm-ngram": "ngram", "vllm-suffix": "suffix", "vllm-suffix-elsewhere": "suffix",
           "vllm-ours": "ours", "vllm-ours+prediction-control": "ours"}  # name: speculation


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


# --------------------------------------------------------------------------- items
def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def _passage(text: str, chars: int) -> str:
    """The passage's first sentences, up to ``chars`` characters."""
    out = ""
    for s in _sentences(text):
        if out and len(out) + len(s) + 1 > chars:
            break
        out = f"{out} {s}".strip()
    return out


def _typos(text: str, n: int = 3) -> str:
    """``n`` words of 6+ letters with two inner letters swapped."""
    words = text.split(" ")
    done = 0
    for i, w in enumerate(words):
        if done < n and len(w) >= 6 and w.isalpha() and i % 4 == 1:
            words[i] = w[0] + w[2] + w[1] + w[3:]
            done += 1
    return " ".join(words)


def edit_items(items: list[Any], n: int, chars: int) -> list[dict[str, Any]]:
    out = []
    kinds = ("typos", "replace", "list", "shorten")
    for i, it in enumerate(items[:n]):
        text = _passage(it.passages[0], chars)
        kind = kinds[i % len(kinds)]
        if kind == "typos":
            given = _typos(text)
            ask = "Fix the spelling mistakes in this text. Reply with the corrected text only."
        elif kind == "replace":
            given = text
            word = max((w for w in re.findall(r"[A-Za-z]{5,}", text)), key=text.count, default="the")
            ask = f"Rewrite this text with the word '{word}' replaced by 'it'. Reply with the rewritten text only."
        elif kind == "list":
            given = text
            ask = "Rewrite this text as a bulleted list, one sentence per line, each starting with '- '."
        else:
            given = text
            ask = "Rewrite this text without its last sentence. Reply with the rewritten text only."
        out.append({"id": f"{it.id}/{kind}", "kind": kind, "messages": [{"role": "user",
                                                                         "content": f"{ask}\n\n{given}"}],
                    "prediction": given})
    return out


def _changed_number(passages: list[str]) -> list[str] | None:
    """The passages with the first number of the first passage that has one changed (``None``: none has)."""
    for j, p in enumerate(passages):
        m = re.search(r"\d+", p)
        if m:
            value = int(m.group())
            new = str(value + 1 if value < 1900 else value - 1)
            return [*passages[:j], p[:m.start()] + new + p[m.end():], *passages[j + 1:]]
    return None


# --------------------------------------------------------------------------- running
def run_engine(dec: Any, requests: list[dict[str, Any]], max_new: int, with_prediction: bool,
               level: int = 1) -> list[dict]:
    """The requests one at a time (``level`` 1) or in groups of ``level`` (one ``generate_batch`` each: the
    group's wall time is each of its rows' ``group_s``)."""
    out = []
    for start in range(0, len(requests), level):
        group = requests[start:start + level]
        predictions = [{"type": "content", "content": r["prediction"]} if with_prediction else None for r in group]
        t0 = time.perf_counter()
        if level == 1:
            outs = [dec.generate(group[0]["messages"], max_new_tokens=max_new, prediction=predictions[0])]
        else:
            outs = dec.generate_batch([r["messages"] for r in group], max_new_tokens=max_new, prediction=predictions)
        dt = time.perf_counter() - t0
        for r, o in zip(group, outs):
            st = o.stats
            out.append({"id": r["id"], "token_ids": o.token_ids, "time_s": dt, "steps": st.steps,
                        "new_tokens": st.new_tokens, "group": start // level,
                        "accepted_prediction_tokens": st.accepted_prediction_tokens,
                        "rejected_prediction_tokens": st.rejected_prediction_tokens})
    return out


def summarise(runs: dict[str, list[dict]], level: int, baseline: str = "vllm-greedy") -> dict[str, Any]:
    base = {r["id"]: r for r in runs[baseline]}
    base_wall = sum({r["group"]: r["time_s"] for r in runs[baseline]}.values())
    summary = {}
    for m, rows in runs.items():
        steps = sum(r["steps"] for r in rows if r["steps"])
        wall = sum({r["group"]: r["time_s"] for r in rows}.values())
        s = {"tokens_per_step": sum(r["new_tokens"] for r in rows) / steps if steps else None,
             "identical": sum(r["token_ids"] == base[r["id"]]["token_ids"] for r in rows) / len(rows),
             "new_tokens": sum(r["new_tokens"] for r in rows),
             "tokens_per_s": sum(r["new_tokens"] for r in rows) / wall,
             "throughput_vs_greedy": (sum(r["new_tokens"] for r in rows) / wall)
             / (sum(r["new_tokens"] for r in runs[baseline]) / base_wall)}
        if level == 1:
            ratios = [base[r["id"]]["time_s"] / r["time_s"] for r in rows]
            worst = min(range(len(rows)), key=lambda i: ratios[i])
            s.update(speedup_geomean=math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
                     speedup_worst=ratios[worst], worst_item=rows[worst]["id"])
        summary[m] = s
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path without extension: writes .json, .md and .png")
    ap.add_argument("--items", type=int, default=8, help="items per task at level 1 and at each level below 8")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="requests in flight")
    ap.add_argument("--new", type=int, default=128, help="new tokens per answer, at most")
    ap.add_argument("--chars", type=int, default=400, help="characters of passage an edit item rewrites")
    ap.add_argument("--tasks", default="edit,refresh", help="edit, refresh or both")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"a subset of {','.join(ENGINES)} "
                    "(vllm-greedy always runs: the baseline)")
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    engines = ["vllm-greedy", *[e for e in args.engines.split(",") if e != "vllm-greedy"]]
    unknown = sorted(set(engines) - set(ENGINES)) + sorted(set(tasks) - {"edit", "refresh"})
    if unknown:
        raise SystemExit(f"unknown engines or tasks {unknown}")

    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.vllm import VllmDecoder

    trec = load_msmarco_sample(Path(__file__).resolve().parents[1] / "rag_accel" / "data" /
                               "msmarco_trecdl_rag.jsonl")
    sizes = {level: max(args.items, level) for level in args.levels}  # each level its own items
    n_edit = sum(sizes.values())
    all_edits = edit_items(trec, n_edit, args.chars)
    pool = [(it, _changed_number(it.passages)) for it in trec[n_edit:]]
    all_chosen = [(it, p) for it, p in pool if p is not None]
    if len(all_edits) < n_edit or len(all_chosen) < n_edit:
        raise SystemExit(f"the TREC-DL sample has too few items for levels {args.levels} x {args.items} items")
    edits, chosen, at = {}, {}, 0
    for level, n in sizes.items():
        edits[level], chosen[level], at = all_edits[at:at + n], all_chosen[at:at + n], at + n
    originals = {level: [{"id": it.id, "messages": rag_messages(it.query, it.passages), "prediction": ""}
                         for it, _ in chosen[level]] for level in args.levels}
    engine = dict(max_model_len=4096, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False)
    runs: dict[str, dict[int, dict[str, list[dict]]]] = {t: {lv: {} for lv in args.levels} for t in tasks}
    loads: dict[str, list[str]] = {}
    refresh: dict[int, list[dict[str, Any]]] = {}
    t_all = time.perf_counter()

    def warm(dec: Any) -> None:
        dec.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=8)

    # vllm-greedy first: the baseline, and the earlier answers of the refresh task
    for name in engines:
        speculation = ENGINES[name]
        loads[name] = [uptime()]
        try:
            dec = VllmDecoder.from_pretrained(MODEL, speculation=speculation, max_draft_tokens=K, **engine)
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        try:
            warm(dec)
            for level in args.levels:
                if name == "vllm-greedy":
                    earlier = [dec.generate(r["messages"], max_new_tokens=args.new).text for r in originals[level]]
                    refresh[level] = [{"id": it.id, "messages": rag_messages(it.query, edited), "prediction": answer}
                                      for (it, edited), answer in zip(chosen[level], earlier)]
                if name == "vllm-suffix":  # the engine that gave the earlier answers: it asks the originals first
                    for r in originals[level]:
                        dec.generate(r["messages"], max_new_tokens=args.new)
                plans = {"vllm-suffix-elsewhere": [("refresh", name, False)],
                         "vllm-ours": [(t, m, p) for t in ("edit", "refresh")
                                       for m, p in (("vllm-ours", False), ("vllm-ours+prediction", True))],
                         "vllm-ours+prediction-control": [(t, name, True) for t in ("edit", "refresh")]}
                for task, method, with_prediction in plans.get(name, [("edit", name, False), ("refresh", name, False)]):
                    if task not in tasks:
                        continue
                    requests = edits[level] if task == "edit" else refresh[level]
                    runs[task][level][method] = run_engine(dec, requests, args.new, with_prediction, level)
        finally:
            dec.close()
            del dec
            gc.collect()
        loads[name].append(uptime())
        print(f"{name}: done ({time.perf_counter() - t_all:.0f} s)", flush=True)

    result = {
        "command": "python benchmarks/predicted_outputs.py " + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}; {subprocess.getoutput('nproc')} cores; nothing else running (the load "
                   "below is the benchmark's own: its engine computes on both cores)",
        "model": MODEL, "dtype": "float32", "k": K, "items": sizes, "max_new_tokens": args.new,
        "load": loads,
        "summary": {task: {level: summarise(r, level) for level, r in by_level.items()}
                    for task, by_level in runs.items()},
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Predicted outputs on vLLM: editing and answer refresh ({result['model']}, {result['dtype']})", "",
             f"- command: `{result['command']}`", f"- date: {result['date']}; machine: {result['machine']}",
             f"- items per level (each level its own): {result['items']}; up to {result['max_new_tokens']} new "
             f"tokens, k={result['k']}",
             "- 1 in flight: speed-up = vllm-greedy's time / the method's, per request (geo-mean, worst item); "
             "4 and 16 in flight: throughput (new tokens / wall time of the level's groups) against vllm-greedy's",
             "- identical: outputs equal to vllm-greedy's at the same level, token for token", ""]
    for task, by_level in result["summary"].items():
        lines += [f"## {task}", ""]
        for level, summary in by_level.items():
            if str(level) == "1":
                lines += ["1 in flight:", "", "| method | speed-up (geo-mean) | worst item | tokens/step | identical |",
                          "|---|---|---|---|---|"]
                for m, s in summary.items():
                    tps = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "-"
                    lines.append(f"| {m} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x "
                                 f"({s['worst_item']}) | {tps} | {s['identical']:.0%} |")
            else:
                lines += [f"{level} in flight:", "", "| method | throughput vs vllm-greedy | tokens/s | tokens/step | "
                          "identical |", "|---|---|---|---|---|"]
                for m, s in summary.items():
                    tps = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "-"
                    lines.append(f"| {m} | {s['throughput_vs_greedy']:.2f}x | {s['tokens_per_s']:.1f} | {tps} | "
                                 f"{s['identical']:.0%} |")
            lines.append("")
    lines += ["## Load (uptime before, after each engine)", ""]
    lines += [f"- {m}: {' / '.join(v)}" for m, v in result["load"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    tasks = list(result["summary"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        by_level = result["summary"][task]
        levels = list(by_level)
        names = list(by_level[levels[0]])
        width = 0.8 / len(levels)
        for j, level in enumerate(levels):
            key = "speedup_geomean" if str(level) == "1" else "throughput_vs_greedy"
            ax.barh([i + j * width for i in range(len(names))],
                    [by_level[level].get(m, {}).get(key, 0) for m in names], height=width, label=f"{level} in flight")
        ax.set_yticks([i + width * (len(levels) - 1) / 2 for i in range(len(names))], names)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{task}: against vllm-greedy")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
