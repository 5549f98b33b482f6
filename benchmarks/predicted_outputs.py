"""Where predictions pay most: editing a text, and refreshing an answer, on vLLM, peers side by side.

    python benchmarks/predicted_outputs.py --out benchmarks/results/predicted_outputs_vllm_cpu_smollm2

(in the vLLM virtualenv; arctic-inference installed for vllm-suffix). One engine per peer, one after the other,
SmolLM2-135M-Instruct in float32, ``enforce_eager``, one request at a time, a warm-up request per engine first:

* ``vllm-greedy``: no speculation (every output is compared with it);
* ``vllm-ngram``: vLLM's prompt lookup (k=10, n-grams 2-4);
* ``vllm-suffix``: vLLM's suffix decoding (k=10, its defaults);
* ``vllm-ours``: our proposer, no prediction; ``vllm-ours+prediction``: the same engine, the prediction
  (OpenAI's Predicted Outputs shape) passed with each request.

Items (from the bundled TREC-DL sample, which no default was tuned on):

* ``edit``: the model rewrites a passage with a small change (fix planted typos, replace a word, reformat
  as a list, drop the last sentence); the prediction is the passage as given. The text is in the prompt too,
  so prompt-copying peers see it as well.
* ``refresh``: the question is answered over its passages (vllm-greedy, not timed); then one passage is edited
  slightly (a number changed) and the question asked again, the earlier answer as the prediction and NOT in the
  prompt. vLLM's suffix decoding on the engine that gave the earlier answers (``vllm-suffix``: it asked the
  originals first, its suffix tree holds their answers) and on a fresh one (``vllm-suffix-elsewhere``: another
  replica, a restart).

Reported per task: speed-up against vllm-greedy per request (geo-mean, worst item), tokens per step, and the
identical-output rate. Load (``uptime``) is recorded before and after each engine.
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
def run_engine(dec: Any, requests: list[dict[str, Any]], max_new: int, with_prediction: bool) -> list[dict]:
    out = []
    for r in requests:
        prediction = {"type": "content", "content": r["prediction"]} if with_prediction else None
        kw = {"prediction": prediction} if prediction is not None else {}
        t0 = time.perf_counter()
        o = dec.generate(r["messages"], max_new_tokens=max_new, **kw)
        dt = time.perf_counter() - t0
        st = o.stats
        out.append({"id": r["id"], "token_ids": o.token_ids, "time_s": dt, "steps": st.steps,
                    "new_tokens": st.new_tokens, "accepted_prediction_tokens": st.accepted_prediction_tokens,
                    "rejected_prediction_tokens": st.rejected_prediction_tokens})
    return out


def summarise(runs: dict[str, list[dict]], baseline: str = "vllm-greedy") -> dict[str, Any]:
    base = {r["id"]: r for r in runs[baseline]}
    summary = {}
    for m, rows in runs.items():
        ratios = [base[r["id"]]["time_s"] / r["time_s"] for r in rows]
        worst = min(range(len(rows)), key=lambda i: ratios[i])
        steps = sum(r["steps"] for r in rows if r["steps"])
        summary[m] = {
            "speedup_geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
            "speedup_worst": ratios[worst], "worst_item": rows[worst]["id"],
            "tokens_per_step": sum(r["new_tokens"] for r in rows) / steps if steps else None,
            "identical": sum(r["token_ids"] == base[r["id"]]["token_ids"] for r in rows) / len(rows),
            "new_tokens": sum(r["new_tokens"] for r in rows),
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path without extension: writes .json, .md and .png")
    ap.add_argument("--items", type=int, default=8, help="items per task")
    ap.add_argument("--new", type=int, default=128, help="new tokens per answer, at most")
    ap.add_argument("--chars", type=int, default=400, help="characters of passage an edit item rewrites")
    args = ap.parse_args()

    from rag_accel.data import load_msmarco_sample, rag_messages
    from rag_accel.vllm import VllmDecoder

    trec = load_msmarco_sample(Path(__file__).resolve().parents[1] / "rag_accel" / "data" /
                               "msmarco_trecdl_rag.jsonl")
    edits = edit_items(trec, args.items, args.chars)
    pool = [(it, _changed_number(it.passages)) for it in trec[args.items:]]
    chosen = [(it, p) for it, p in pool if p is not None][: args.items]
    originals = [{"id": it.id, "messages": rag_messages(it.query, it.passages), "prediction": ""}
                 for it, _ in chosen]
    engine = dict(max_model_len=4096, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False)
    runs: dict[str, dict[str, list[dict]]] = {"edit": {}, "refresh": {}}
    loads: dict[str, list[str]] = {}
    t_all = time.perf_counter()

    def warm(dec: Any) -> None:
        dec.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=8)

    # vllm-greedy first: the baseline, and the earlier answers of the refresh task
    for name, speculation in (("vllm-greedy", "off"), ("vllm-ngram", "ngram"), ("vllm-suffix", "suffix"),
                              ("vllm-suffix-elsewhere", "suffix"), ("vllm-ours", "ours")):
        loads[name] = [uptime()]
        try:
            dec = VllmDecoder.from_pretrained(MODEL, speculation=speculation, num_speculative_tokens=K, **engine)
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        try:
            warm(dec)
            if name == "vllm-greedy":
                earlier = [o.text for o in (dec.generate(r["messages"], max_new_tokens=args.new) for r in originals)]
                refresh = [{"id": it.id, "messages": rag_messages(it.query, edited), "prediction": answer}
                           for (it, edited), answer in zip(chosen, earlier)]
            if name == "vllm-suffix":  # the engine that gave the earlier answers: it asks the originals first
                for r in originals:
                    dec.generate(r["messages"], max_new_tokens=args.new)
            if name != "vllm-suffix-elsewhere":
                runs["edit"][name] = run_engine(dec, edits, args.new, False)
            runs["refresh"][name] = run_engine(dec, refresh, args.new, False)
            if name == "vllm-ours":
                runs["edit"]["vllm-ours+prediction"] = run_engine(dec, edits, args.new, True)
                runs["refresh"]["vllm-ours+prediction"] = run_engine(dec, refresh, args.new, True)
        finally:
            dec.close()
            del dec
            gc.collect()
        loads[name].append(uptime())
        print(f"{name}: done ({time.perf_counter() - t_all:.0f} s)", flush=True)

    result = {
        "command": "python benchmarks/predicted_outputs.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or '?'}; {subprocess.getoutput('nproc')} cores",
        "model": MODEL, "dtype": "float32", "k": K, "items_per_task": args.items, "max_new_tokens": args.new,
        "load": loads,
        "summary": {task: summarise(r) for task, r in runs.items()},
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
             f"- {result['items_per_task']} items per task, up to {result['max_new_tokens']} new tokens, one request "
             f"at a time, k={result['k']}; speed-up: vllm-greedy's time / the method's, per request", ""]
    for task, summary in result["summary"].items():
        lines += [f"## {task}", "", "| method | speed-up (geo-mean) | worst item | tokens/step | identical |",
                  "|---|---|---|---|---|"]
        for m, s in summary.items():
            tps = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "-"
            lines.append(f"| {m} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x ({s['worst_item']}) | "
                         f"{tps} | {s['identical']:.0%} |")
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
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.2))
    for ax, task in zip(axes, tasks):
        summary = result["summary"][task]
        names = list(summary)
        ax.barh(names, [summary[m]["speedup_geomean"] for m in names], color="tab:blue")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{task}: speed-up vs vllm-greedy (geo-mean)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
