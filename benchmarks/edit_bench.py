"""Code editing through Predicted Outputs, and RAG answers on engines that cannot share the machine: peers side by side.

    python benchmarks/edit_bench.py --engine transformers --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --items 12 --out benchmarks/results/edits_cpu_qwen15
    python benchmarks/edit_bench.py --engine vllm --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --items 12 --out benchmarks/results/edits_vllm_cpu_qwen15

(the vLLM line in the vLLM virtualenv, arctic-inference installed for vllm-suffix.)

Items (``--task edit``): real code edits, an instruction and the whole file before (``../shared/data/edits`` when this
checkout has it, else the MIT-licensed ones bundled in ``benchmarks/data/edits_mit.jsonl``; provenance beside them),
``--items`` of those whose file is at most ``--max-chars`` long, drawn with a fixed seed. The model is asked to apply
the instruction and reply with the whole file in one code block; the file as it was is the request's ``prediction``
(OpenAI's Predicted Outputs), and it is in the prompt too, where prompt-copying peers (prompt lookup, vLLM's n-gram
and suffix decoding) find it. At most ``1.5 x`` the file's tokens + 64 new tokens (a rewrite that grows, ends).
``--task rag``: the bundled MS-MARCO sample's last ``--items`` answered items, the passages as references, 64 tokens.

Methods, every output compared token for token with its engine's greedy:

* transformers, all in one process, interleaved item by item (the order rotating): ``greedy``
  (``model.generate``), ``hf-pld`` (``prompt_lookup_num_tokens=10``), ``hf-assisted`` (``assistant_model``: the draft
  model), ``ours`` (the prediction, or the passages, as references), ``ours-plain`` (the same decoder, drafting off:
  the exactness baseline in bfloat16, where exact steps and ``model.generate`` use other kernels), ``ours-noref``
  (neither: the prompt and the answer only), ``ours-hybrid`` (with the draft model behind the copy drafters);
* vLLM, one engine after another (a 1.5B model's engines do not fit this machine's memory side by side), each
  warmed up on a request of its own: ``vllm-greedy``, ``vllm-ngram``, ``vllm-suffix``, ``vllm-draft`` (vLLM's own
  ``draft_model`` method with the draft model), ``vllm-ours`` (no prediction) and ``vllm-ours+prediction`` (the same
  engine), all as rag_accel runs them (exact steps where ``--exact`` and the dtype say so); ``plain-vllm-greedy``,
  ``plain-vllm-ngram`` and ``plain-vllm-suffix``: vLLM as its users run it, its own kernels (no exact steps), with
  or without its own speculation. One request at a time, then each of ``--in-flight`` at once (groups of that
  many, one ``generate_batch`` each). A suffix engine starts afresh for each level: its tree keeps the answers it
  gave, and the items of one level must not be primed by the same items of another.

Reported: per request the speed-up over the engine's greedy (geo-mean, worst item), against ``--versus`` (the peer
users would run instead), tokens per step, tokens/s end to end (prefill included), the median time to first token,
the identical rate (plain vLLM's methods against ``plain-vllm-greedy``, the others against rag_accel's greedy); in
flight, throughput against greedy's and ``--versus``'s; machine load before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rag_accel_lab.machine import cpu_description

ROOT = Path(__file__).resolve().parents[1]
SHARED_EDITS = ROOT.parent / "shared" / "data" / "edits" / "edits_dev.jsonl"
BUNDLED_EDITS = ROOT / "benchmarks" / "data" / "edits_mit.jsonl"
SYSTEM = ("You are a careful coding assistant. Apply the requested change to the file and reply with the whole "
          "updated file in one fenced code block, nothing else.")
K = 10  # draft tokens a vLLM step verifies at most, by default (rag_accel.config.VLLM_DRAFT_TOKENS)
HF_METHODS = ("greedy", "hf-pld", "hf-assisted", "ours", "ours-plain", "ours-noref", "ours-hybrid")
VLLM_METHODS = ("vllm-greedy", "vllm-ngram", "vllm-suffix", "vllm-draft", "vllm-ours", "plain-vllm-greedy",
                "plain-vllm-ngram", "plain-vllm-suffix")
PLAIN = "plain-vllm-"  # vLLM as its users run it: its own kernels, never exact steps


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- items
def edit_items(path: Path, n: int, max_chars: int, tokenizer: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    meta_path = path.with_name(path.stem + "_meta.jsonl")
    langs = {}
    if meta_path.is_file():
        langs = {m["id"]: m.get("language", "") for m in map(json.loads, meta_path.read_text().splitlines()) if m}
    rows = [r for r in rows if len(r["before"]) <= max_chars]
    random.Random(0).shuffle(rows)
    out = []
    for r in rows[:n]:
        lang = langs.get(r["id"], r.get("language", ""))
        user = f"{r['instruction']}\n\n```{lang}\n{r['before']}\n```"
        limit = int(1.5 * len(tokenizer(r["before"])["input_ids"])) + 64
        out.append({"id": r["id"], "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "references": [r["before"]], "prediction": r["before"], "max_new_tokens": limit})
    return out


def rag_items(n: int, tokenizer: Any) -> list[dict[str, Any]]:
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_input

    return [{"id": it.id, "messages": rag_input(tokenizer, it.query, it.passages), "references": list(it.passages),
             "prediction": None, "max_new_tokens": 64} for it in load_msmarco_sample(with_answers=True)[-n:]]


# --------------------------------------------------------------------------- transformers
def run_transformers(args: argparse.Namespace, methods: list[str]) -> tuple[dict, list[dict]]:
    import torch

    from rag_accel import ReferenceDecoder

    dec = ReferenceDecoder.from_pretrained(args.model, dtype=args.dtype, draft_model=args.draft_model)
    items = (edit_items(args.data, args.items, args.max_chars, dec.tokenizer) if args.task == "edit"
             else rag_items(args.items, dec.tokenizer))
    copy_only = {"drafters": ("reference", "frequency")}

    def run(method: str, item: dict, ids: list[int]) -> dict:
        n = item["max_new_tokens"]
        t0 = time.perf_counter()
        if method in ("greedy", "hf-pld", "hf-assisted"):
            extra = {"hf-pld": {"prompt_lookup_num_tokens": 10}, "hf-assisted": {"assistant_model": dec.draft_model},
                     "greedy": {}}[method]
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = dec.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                         **extra)
            tokens, steps, stats = out[0, len(ids):].tolist(), None, None
        else:
            refs = None if method == "ours-noref" else (None if item["prediction"] else item["references"])
            pred = ({"type": "content", "content": item["prediction"]}
                    if item["prediction"] and method != "ours-noref" else None)
            cfg = {"ours-hybrid": None, "ours-plain": {"drafters": ()}}.get(method, copy_only)
            o = dec.generate(ids, references=refs, prediction=pred, max_new_tokens=n, config=cfg)
            tokens, steps, stats = o.token_ids, o.stats.steps, o.stats
        row = {"method": method, "item": item["id"], "seconds": time.perf_counter() - t0, "token_ids": tokens,
               "new_tokens": len(tokens), "steps": steps}
        if stats is not None:
            row.update(accepted_prediction_tokens=stats.accepted_prediction_tokens,
                       by_drafter={k: dict(v) for k, v in stats.by_drafter.items()})
        return row

    rows = []
    warm = items[-1]
    for m in methods:  # a warm-up of every method on the last item, not timed
        run(m, warm, dec.encode_prompt(warm["messages"]))
    for i, item in enumerate(items[:-1] if len(items) > 1 else items):
        ids = dec.encode_prompt(item["messages"])
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in order:
            rows.append(run(m, item, ids))
        print(f"{item['id']}: " + ", ".join(f"{r['method']} {r['seconds']:.1f}s" for r in rows[-len(methods):]),
              flush=True)
    info = {"dtype": str(dec.model.dtype).replace("torch.", ""), "cost_curve": [round(c, 3) for c in dec.cost_curve(
        dec.config.max_draft_tokens)][:17]}
    return info, rows


# --------------------------------------------------------------------------- vLLM
def run_vllm(args: argparse.Namespace, methods: list[str]) -> tuple[dict, list[dict]]:
    from transformers import AutoTokenizer

    from rag_accel.models import local_model

    tokenizer = AutoTokenizer.from_pretrained(local_model(args.model))
    items = (edit_items(args.data, args.items, args.max_chars, tokenizer) if args.task == "edit"
             else rag_items(args.items, tokenizer))
    warm, timed = items[-1], items[:-1] if len(items) > 1 else items
    k = args.max_draft_tokens
    common = dict(max_draft_tokens=k, dtype=args.dtype, max_model_len=args.max_model_len,
                  enforce_eager=not args.compiled, enable_prefix_caching=False)
    engines = {"vllm-greedy": {"speculation": "off"}, "vllm-ngram": {"speculation": "ngram"},
               "vllm-suffix": {"speculation": "suffix"}, "vllm-ours": {"speculation": "ours"},
               "vllm-draft": {"speculation": "off", "speculative_config": {
                   "method": "draft_model", "model": local_model(args.draft_model), "num_speculative_tokens": k}}}
    engines.update({PLAIN + m: {**engines["vllm-" + m], "exact": False} for m in ("greedy", "ngram", "suffix")})
    rows, loads, exact = [], {}, {}
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # (rag_accel.methods.PEER_ENVIRONMENT)
    levels = [1, *args.in_flight]
    for name in ["vllm-greedy", *[m for m in methods if m != "vllm-greedy"]]:
        # a suffix engine's tree keeps every answer it gave: a fresh engine for each level
        for run_levels in ([[lv] for lv in levels] if name.endswith("suffix") else [levels]):
            if not run_vllm_engine(args, name, {**common, "exact": None if args.exact else False, **engines[name]},
                                   run_levels, warm, timed, rows, loads, exact):
                break
    return {"dtype": args.dtype, "load": loads, "in_flight": args.in_flight, "exact": exact,
            "compilation": "compiled" if args.compiled else "eager"}, rows


def run_vllm_engine(args: argparse.Namespace, name: str, kwargs: dict, levels: list[int], warm: dict,
                    timed: list[dict], rows: list[dict], loads: dict, exact: dict) -> bool:
    """One engine of ``name`` through ``levels``; rows appended. False where it could not start (recorded)."""
    from rag_accel.vllm import VllmDecoder

    loads.setdefault(name, []).append(loadavg())
    try:
        dec = VllmDecoder.from_pretrained(args.model, **kwargs)
    except Exception as e:  # (arctic-inference missing, or an engine this vLLM build cannot start): recorded
        print(f"{name}: skipped ({type(e).__name__}: {e})", flush=True)
        loads[name].append(f"skipped: {type(e).__name__}: {str(e)[:300]}")
        return False
    try:
        exact[name] = dec.exact
        arms = [(name, False), (name + "+prediction", True)] if name == "vllm-ours" else [(name, False)]
        dec.generate(warm["messages"], max_new_tokens=8)
        for method, with_pred in arms:
            for level in levels:
                for start in range(0, len(timed), level):
                    group = timed[start:start + level]
                    preds = [{"type": "content", "content": it["prediction"]} if with_pred and it["prediction"]
                             else None for it in group]
                    refs = [it["references"] if with_pred and not it["prediction"] else None for it in group]
                    t0 = time.perf_counter()
                    outs = dec.generate_batch([it["messages"] for it in group], refs, prediction=preds,
                                              max_new_tokens=max(it["max_new_tokens"] for it in group))
                    dt = time.perf_counter() - t0
                    for it, o in zip(group, outs):
                        rows.append({"method": method, "level": level, "group": start // level,
                                     "item": it["id"], "seconds": dt, "token_ids": o.token_ids,
                                     "new_tokens": len(o.token_ids), "steps": o.stats.steps,
                                     "first_token_s": o.stats.prefill_s,
                                     "accepted_prediction_tokens": o.stats.accepted_prediction_tokens})
                done = [r for r in rows if r["method"] == method and r["level"] == level]
                print(f"{method}, {level} in flight: {sum({r['group']: r['seconds'] for r in done}.values()):.0f} s",
                      flush=True)
    finally:
        dec.close()
        del dec
        gc.collect()
    loads[name].append(loadavg())
    return True


# --------------------------------------------------------------------------- report
def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(map(math.log, xs)))


def summarise(rows: list[dict], baseline: str, level: int | None = None, versus: str | None = None
              ) -> dict[str, dict]:
    """Per method: identical rate (plain vLLM's methods against ``plain-vllm-greedy``, the rest against
    ``baseline``), tokens per step; one at a time the per-item speed-up over ``baseline`` and ``versus`` (geo-mean,
    worst item), the median time to first token; in flight, throughput against theirs; tokens/s end to end."""
    rows = [r for r in rows if level is None or r.get("level", 1) == level]
    by_method = {m: {r["item"]: r for r in rows if r["method"] == m} for m in dict.fromkeys(r["method"] for r in rows)}
    base = by_method[baseline]

    def wall(mine: list[dict]) -> float:
        return sum({r["group"]: r["seconds"] for r in mine}.values())

    out = {}
    for m in by_method:
        mine = [r for r in by_method[m].values() if r["item"] in base]
        same = by_method.get(PLAIN + "greedy", base) if m.startswith(PLAIN) else base
        steps = [r["steps"] for r in mine if r["steps"]]
        s = {"identical": statistics.fmean(r["token_ids"] == same[r["item"]]["token_ids"] for r in mine
                                           if r["item"] in same),
             "tokens_per_step": sum(r["new_tokens"] for r in mine) / sum(steps) if len(steps) == len(mine) else None,
             "new_tokens": sum(r["new_tokens"] for r in mine)}
        peers = {"": base, "_vs": by_method.get(versus)} if versus in by_method else {"": base}
        if level in (None, 1):
            for suffix, peer in peers.items():
                ratios = [peer[r["item"]]["seconds"] / r["seconds"] for r in mine]
                worst = min(range(len(mine)), key=lambda i: ratios[i])
                s.update({"speedup" + suffix: geomean(ratios), "worst" + suffix: ratios[worst],
                          "worst_item" + suffix: mine[worst]["item"]})
            s["tokens_per_s"] = s["new_tokens"] / sum(r["seconds"] for r in mine)
            first = [r["first_token_s"] for r in mine if r.get("first_token_s") is not None]
            s["first_token_s"] = statistics.median(first) if first else None
        else:
            s["tokens_per_s"] = s["new_tokens"] / wall(mine)
            for suffix, peer in peers.items():
                s["throughput" + suffix] = s["tokens_per_s"] / (sum(r["new_tokens"] for r in peer.values())
                                                                / wall(list(peer.values())))
        if "ours-plain" in {r["method"] for r in rows}:
            plain = {r["item"]: r["token_ids"] for r in rows if r["method"] == "ours-plain"}
            s["identical_to_ours_plain"] = sum(r["token_ids"] == plain.get(r["item"]) for r in mine) / len(mine)
        if "accepted_prediction_tokens" in mine[0] and mine[0]["accepted_prediction_tokens"] is not None:
            s["accepted_prediction_tokens"] = sum(r.get("accepted_prediction_tokens") or 0 for r in mine)
        out[m] = s
    return out


def markdown(result: dict) -> str:
    lines = [f"# {result['task']} items on {result['engine']}: {result['model']}, {result['info']['dtype']}, "
             f"{result['date'][:10]}", "", f"- command: `{result['command']}`",
             f"- machine: {result['machine']}; load (1/5/15 min) before {result['load_before']}, after {result['load_after']}"
             + (f"; environment: {', '.join(f'{k}={v}' for k, v in result['env'].items())}" if result.get("env") else ""),
             (f"- items: {result['items']} ({result['data']}); every output compared with {result['baseline']}'s"
              if result["task"] == "edit" else
              f"- items: the bundled MS-MARCO sample's last {result['items'] + 1} answered items but the last (it "
              f"warms the engine), 64 new tokens, the passages in the prompt; every output compared with "
              f"{result['baseline']}'s; \"+prediction\": no prediction here, the passages also sent as the "
              f"request's references")]
    if result.get("note"):
        lines.append(f"- {result['note']}")
    if any(m.endswith("suffix") for summary in result["summary"].values() for m in summary):
        lines.append("- suffix decoding: a fresh engine for each level (its tree keeps the answers it gave, across "
                     "requests, as in a server; never those of the same items at another level)")
    if result["info"].get("compilation"):
        lines.append(f"- vLLM engines: {result['info']['compilation']}"
                     + (" (as vLLM and rag-accel serve run them by default)" if result["info"]["compilation"]
                        == "compiled" else " (enforce_eager)"))
    if result["info"].get("exact"):
        on = [m for m, v in result["info"]["exact"].items() if v]
        lines.append(f"- exact steps in vLLM's CPU worker: {'on for ' + ', '.join(on) if on else 'off'}"
                     + ("" if len(on) in (0, len(result["info"]["exact"])) else " (off for the others)"))
    if any(m.startswith(PLAIN) for summary in result["summary"].values() for m in summary):
        lines.append(f"- {PLAIN}*: vLLM as its users run it (its own kernels); identical: against "
                     f"{PLAIN}greedy's outputs; the other methods' against {result['baseline']}'s")
    versus = result.get("versus")
    lines.append("")
    for level, summary in result["summary"].items():
        per_request = level == "1"
        has_vs = any("speedup_vs" in s or "throughput_vs" in s for s in summary.values())
        vs_head = f" | vs {versus}" + (" (worst)" if per_request else "") if has_vs else ""
        lines += [f"{'One request at a time' if per_request else level + ' requests in flight'}:", "",
                  "| method | " + ("speed-up (geo-mean) | worst item" if per_request else "throughput vs greedy")
                  + vs_head + " | tokens/step | tokens/s | " + ("first token (median) | " if per_request else "")
                  + "identical | identical to ours-plain | accepted prediction tokens |",
                  "|---|---|" + ("---|---|" if per_request else "") + ("---|" if has_vs else "")
                  + "---|---|---|---|---|"]
        for m, s in summary.items():
            tps = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "-"
            head = (f"{s['speedup']:.2f}x | {s['worst']:.2f}x ({s['worst_item']})" if per_request
                    else f"{s['throughput']:.2f}x")
            if has_vs:
                head += (f" | {s['speedup_vs']:.2f}x ({s['worst_vs']:.2f}x)" if per_request
                         else f" | {s['throughput_vs']:.2f}x")
            first = ""
            if per_request:
                first = f" {s['first_token_s'] * 1e3:.0f} ms |" if s.get("first_token_s") is not None else " - |"
            plain = f"{s['identical_to_ours_plain']:.0%}" if "identical_to_ours_plain" in s else "-"
            lines.append(f"| {m} | {head} | {tps} | {s['tokens_per_s']:.1f} |{first} {s['identical']:.0%} | {plain} | "
                         f"{s.get('accepted_prediction_tokens', '-')} |")
        lines.append("")
    if result.get("compared_to"):
        c = result["compared_to"]
        lines += [f"Identical to {c['baseline']}'s outputs in {c['run']} ({c['dtype']}): "
                  + ", ".join(f"{m} {v:.0%}" for m, v in c["identical"].items()), ""]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    summary = result["summary"]["1"]
    names = list(summary)
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(names) + 1.2))
    ax.barh(names, [summary[m]["speedup"] for m in names], color="tab:blue")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"speed-up over {result['baseline']} (geo-mean, one request at a time)")
    ax.set_title(f"{result['task']}: {result['model']} ({result['engine']}, {result['info']['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def engine_environment(engine: str) -> dict[str, str]:
    """The settings the run's engines started with: the caller's, and on vLLM's CPU backend what rag_accel adds
    where the caller sets none (Intel OpenMP; the binding to the cores free at each engine's start)."""
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "NUMBA_THREADING_LAYER")
    env = {k: os.environ[k] for k in names if k in os.environ}
    if engine == "vllm":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from rag_accel.vllm.launch import cpu_environment

            added = cpu_environment(os.environ, busy={})
            if "VLLM_CPU_OMP_THREADS_BIND" in added:
                added["VLLM_CPU_OMP_THREADS_BIND"] = "the cores free at each engine's start"
            env.update({k: v for k, v in added.items() if k in names})
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("transformers", "vllm"), required=True)
    ap.add_argument("--task", choices=("edit", "rag"), default="edit")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True, help="for hf-assisted, ours-hybrid and vllm-draft")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--items", type=int, default=12, help="items timed (one more, the warm-up, is not)")
    ap.add_argument("--max-chars", type=int, default=1500, help="edit items: the longest file before")
    ap.add_argument("--methods", default="", help="a subset (default: all of the engine's)")
    ap.add_argument("--in-flight", type=lambda v: [int(x) for x in v.split(",") if x], default=[4],
                    help="vLLM: requests in flight after one at a time, comma-separated levels (4,16)")
    ap.add_argument("--versus", default=PLAIN + "suffix", help="vLLM: the peer every method is also set against "
                    "(what its users would run instead), where it ran")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--compiled", action="store_true", help="vLLM: engines compiled as vLLM and rag-accel serve run "
                    "them by default (default: eager, as every committed run before it)")
    ap.add_argument("--max-draft-tokens", type=int, default=K, help="vLLM: every drafting method's most draft "
                    "tokens a step (num_speculative_tokens)")
    ap.add_argument("--data", type=Path, default=None, help="edit items (default: ../shared/data/edits when present, "
                    "else the bundled MIT-licensed ones)")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM: exact steps in the CPU worker where the dtype is bfloat16 or float16 (the library's "
                         "default); --no-exact: vLLM's own kernels")
    ap.add_argument("--compare-to", type=Path, default=None,
                    help="another run's JSON (the same items): each method's identical rate against its baseline's "
                         "outputs too (a float32 run's greedy, say)")
    ap.add_argument("--out", required=True, help="path without suffix: writes .json, .md and .png")
    args = ap.parse_args()
    args.data = args.data or (SHARED_EDITS if SHARED_EDITS.is_file() else BUNDLED_EDITS)
    everything = HF_METHODS if args.engine == "transformers" else VLLM_METHODS
    methods = [m for m in args.methods.split(",") if m] or list(everything)
    unknown = sorted(set(methods) - set(everything))
    if unknown:
        raise SystemExit(f"unknown methods {unknown} for {args.engine}; choose from {list(everything)}")
    args.items += 1  # the warm-up item
    load_before = loadavg()
    t0 = time.perf_counter()
    if args.engine == "transformers":
        info, rows = run_transformers(args, ["greedy", *[m for m in methods if m != "greedy"]])
        baseline, levels = "greedy", [1]
    else:
        info, rows = run_vllm(args, methods)
        baseline, levels = "vllm-greedy", [1, *args.in_flight]
    import torch
    import transformers

    command = shlex.join(["python", "benchmarks/edit_bench.py", *sys.argv[1:]])
    result = {"engine": args.engine, "task": args.task, "model": args.model, "draft_model": args.draft_model,
              "command": command,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores, torch "
                         f"{torch.__version__}, transformers {transformers.__version__}",
              "load_before": load_before, "load_after": loadavg(),
              "env": engine_environment(args.engine),
              "wall_s": round(time.perf_counter() - t0), "data": str(args.data.relative_to(ROOT.parent))
              if args.data.is_relative_to(ROOT.parent) else str(args.data),
              "items": args.items - 1, "baseline": baseline, "info": info,
              "versus": args.versus if args.engine == "vllm" else None,
              "summary": {str(lv): summarise(rows, baseline, lv if args.engine == "vllm" else None,
                                             args.versus if args.engine == "vllm" else None) for lv in levels},
              "rows": rows}
    if args.compare_to is not None:
        other = json.loads(args.compare_to.read_text())
        base = {r["item"]: r["token_ids"] for r in other["rows"]
                if r["method"] == other["baseline"] and r.get("level", 1) == 1}
        result["compared_to"] = {"run": args.compare_to.stem, "dtype": other["info"]["dtype"],
                                 "baseline": other["baseline"], "identical": {
                                     f"{m} ({lv} in flight)": statistics.fmean(
                                         r["token_ids"] == base[r["item"]] for r in rows
                                         if r["method"] == m and r.get("level", 1) == int(lv) and r["item"] in base)
                                     for lv, summary in result["summary"].items() for m in summary}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
