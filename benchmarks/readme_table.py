"""Regenerate the results pages from the committed benchmark JSON.

    python benchmarks/readme_table.py

rewrites ``benchmarks/results/README.md`` between its results markers (the index of every committed run: its page
and what it answers, under the script that made it), ``benchmarks/results/notes.md`` between its summary markers (the
peers side by side, per request and in flight, cold and warm; the README's Results table quotes it by hand), and ``benchmarks/README.md`` and ``benchmarks/experiments/README.md`` between
their scripts markers (each script there, its purpose and the command of every committed run it made). Prose lines are wrapped: no line of the results
page is over 400 characters (tests/test_readme.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
from pathlib import Path
from typing import Any

from rag_accel_lab.inflight import first_vs_others, run_rates

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
SUMMARY_START, SUMMARY_END = "<!-- summary:start -->", "<!-- summary:end -->"
SCRIPTS_START, SCRIPTS_END = "<!-- scripts:start -->", "<!-- scripts:end -->"
RESULTS = ROOT / "benchmarks" / "results"
# every peer in one run, per request and in flight, on items no default was tuned on, a spare engine built first;
# ours with the default chain of the frequency drafter, suffix decoding at vLLM's defaults and tuned (vllm-suffix-f3),
# vLLM's engines under PEER_ENVIRONMENT (numba's workqueue layer; the runs before it understate vllm-ngram); the
# memory of answers drafting by counts (the run before it, bench_vllm_cpu_smollm2_last24_workqueue, had the n-gram memory)
PEERS = RESULTS / "bench_vllm_cpu_smollm2_last24_memory_counts.json"
# the memory of answers on and off on ONE engine, request by request: what the memory buys without the spread between
# engines (PEERS's memory engine was 13.5% slower a step than vllm-ours's, from the first item on)
# the cached-answer case, every item reworded, in one run: the server's memory only (vllm-ours-memory), the client's
# cached answer passed as answers= (vllm-ours), suffix decoding on the engine that answered the original (vllm-suffix)
# and on one that never did (vllm-suffix-elsewhere: another data-parallel engine, a restart). The runs before it
# passed the cached answer as a reference: bench_vllm_cpu_smollm2_last24_frequency_memory and _elsewhere.
REWORDED = RESULTS / "bench_vllm_cpu_smollm2_last24_answers.json"
MEMORY_AB = RESULTS / "config_ab_vllm_cpu_smollm2_memory.json"
MEMORY_AB_16 = RESULTS / "config_ab_vllm_cpu_smollm2_memory_16.json"  # the same, 16 requests in flight
SERVE = RESULTS / "serve_cpu_smollm2.json"
# cold: median of 5 runs per item (the run of 3 before it stays on the results page)
COLD, WARM = RESULTS / "bench_cpu_smollm2_last30x64_cold_r5.json", RESULTS / "bench_cpu_smollm2_last30x64_warm.json"
# the same items, vLLM engines, cold: median of 5 (the run of 3 before it stays on the results page)
VLLM_COLD = RESULTS / "bench_vllm_cpu_smollm2_last30x64_cold_r5.json"
VLLM_WARM = RESULTS / "bench_vllm_cpu_smollm2_last30x64_warm_r5.json"  # the same, one engine learning throughout
GPU = (RESULTS / "bench_cuda_h100_smollm2_last30x64_f32.json",  # transformers on a lent H100: warm, peers
       RESULTS / "bench_cuda_h100_smollm2_last30x64_f32_cold.json",  # the same items cold, one run each
       RESULTS / "bench_cuda_h100_smollm2_last20x64_f32_cold_r3.json")  # cold, median of 3, the last 20 of them
TRECDL_COLD = RESULTS / "bench_cpu_smollm2_trecdl30x64_cold.json"  # other queries and passages, cold
MISLEADING = RESULTS / "misleading_refs_cpu_smollm2.json"  # every draft rejected
# every peer in flight, each level on unseen items, twice on engines built afresh, the default chain of the frequency
# drafter, vLLM's engines under PEER_ENVIRONMENT (the earlier in-flight runs stay on the results page)
INFLIGHT = RESULTS / "inflight_vllm_cpu_smollm2_workqueue.json"
# vLLM's n-gram under numba's default threading layer and under workqueue, in one run (PEER_ENVIRONMENT's reason)
NUMBA_LAYER = RESULTS / "numba_layer_vllm_cpu_smollm2.json"
# suffix decoding and ours in flight with a spare engine built (and closed) first, so none timed is the process's first
INFLIGHT_SPARE = RESULTS / "inflight_vllm_cpu_smollm2_spare.json"
# suffix decoding tuned (max_spec_factor 3) in flight beside its defaults and ours with its memory
SUFFIX_F3_INFLIGHT = RESULTS / "inflight_vllm_cpu_smollm2_suffix_f3.json"
# a second engine configured as vllm-ours beside it in flight (the spread between engines): once, and twice on
# engines built afresh
INFLIGHT_CONTROL = (RESULTS / "inflight_vllm_cpu_smollm2_memory_control.json",
                    RESULTS / "inflight_vllm_cpu_smollm2_memory_repeats.json")
# identical vLLM engines built in turn in one process: is the first one slower?
ENGINE_ORDER = RESULTS / "engine_order_vllm_cpu_smollm2.json"
# suffix decoding and ours again in flight, twice on engines built afresh, a control engine beside them
INFLIGHT_PEERS_REPEATS = RESULTS / "inflight_vllm_cpu_smollm2_peers_repeats.json"
# the frequency drafter (the default chain since 2026-11-26) in flight beside suffix decoding, tuned and not
FREQUENCY_INFLIGHT = RESULTS / "inflight_vllm_cpu_smollm2_frequency.json"
# the long-document case (chunks in the prompt, the whole documents behind them as references) with the defaults,
# and again with the references drafted by counts (the A/B on one engine found the two choices level there)
LONG_DOCUMENTS = (RESULTS / "long_documents_vllm_cpu_smollm2_spare.json",
                  RESULTS / "long_documents_vllm_cpu_smollm2_counted_refs.json")
# a request's references set up beside its prefill: 2 torch threads (the CPU's cores), and 1 (a core left free,
# as a GPU leaves the host's)
SETUP, SETUP_FREE = RESULTS / "setup_cost_cpu_smollm2.json", RESULTS / "setup_cost_cpu_smollm2_1thread.json"


#: Prose lines are wrapped at this width; no line of the results page may pass LONGEST (tests/test_readme.py).
WIDTH, LONGEST = 118, 400
# a word that would open a markdown block (a list, quote, heading, rule, fence or HTML) if it began a line
_OPENS_A_BLOCK = re.compile(r"^(?:[-+*]|\d+[.)]|#{1,6}|=+|-+|`{3}.*|[><].*)$")


def wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with each prose line longer than ``width`` wrapped at spaces, a list item's continuation indented
    under its text; tables, headings, images and fenced code left as they are, and a ``Reproduce`` line kept whole
    (its command copied in one piece) unless it is longer than :data:`LONGEST`.

    Example:
        >>> print(wrap("- one two three - four", width=12))
        - one two
          three - four
    """
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if (fenced or line.startswith("```") or len(line) <= width or line.lstrip().startswith(("|", "#", "!["))
                or (line.startswith("Reproduce") and len(line) <= LONGEST)):
            out.append(line)
            continue
        lead = re.match(r"\s*(?:[-+*] |\d+[.)] )?", line).group(0)
        words = line[len(lead):].split(" ")
        current = lead + words[0]
        for word in words[1:]:
            if len(current) + 1 + len(word) > width and word and not _OPENS_A_BLOCK.match(word):
                out.append(current.rstrip())
                current = " " * len(lead) + word
            else:
                current += " " + word
        out.append(current)
    return "\n".join(out)


def current(text: str) -> str:
    """``text`` with each ``benchmarks/NAME.py`` of a script that has since moved to ``benchmarks/experiments/``
    named where it is now (a run's JSON and page keep the command as it was run)."""
    return re.sub(r"benchmarks/(\w+)\.py", lambda m: f"benchmarks/experiments/{m[1]}.py"
                  if (ROOT / "benchmarks" / "experiments" / f"{m[1]}.py").is_file() else m[0], text)


def _replace(path: Path, start: str, end: str, body: str, wrapped: bool = True) -> None:
    """``body`` between ``path``'s ``start`` and ``end`` markers, its prose :func:`wrap`-ped unless not ``wrapped``
    and its scripts named where they are now (:func:`current`)."""
    body = current(body)
    text = path.read_text()
    a, b = text.index(start) + len(start), text.index(end)
    path.write_text(text[:a] + "\n" + (wrap(body) if wrapped else body) + "\n" + text[b:])


def suffix_section(peers: dict) -> str:
    """Ours against vLLM's suffix decoding, case by case, from the runs that put them side by side: what a
    user choosing between its one flag and our plug-in asks first."""
    rows = []

    def row(case: str, ours: Any, suffix: Any, runs: Any, ours_name: str = "vllm-ours", sep: str = "; ") -> None:
        """One case: a speed-up each (or one per run / level, joined by ``sep``), their ratio, the runs."""
        ours, suffix = ([x] if isinstance(x, float) else list(x) for x in (ours, suffix))
        runs = [runs] if isinstance(runs, Path) else runs

        def fmt(xs: Any) -> str:
            return sep.join(f"{x:.2f}x" for x in xs)

        links = ", ".join(f"[run](benchmarks/results/{r.with_suffix('.md').name})" for r in runs)
        rows.append(f"| {case} | {ours_name} {fmt(ours)} | {fmt(suffix)} | "
                    f"**{fmt(o / x for o, x in zip(ours, suffix))}** | {links} |")

    def vs(summary: dict, m: str) -> float:
        return summary[m]["speedup_vs_vllm_greedy_geomean"]

    sm = peers["summary"]
    row(f"per request, {peers['items']} new questions", vs(sm, "vllm-ours"), vs(sm, "vllm-suffix"), PEERS)
    row("the same, ours copying from earlier answers too, as suffix does", vs(sm, "vllm-ours-memory"),
        vs(sm, "vllm-suffix"), PEERS, "vllm-ours-memory")
    if REWORDED.is_file():  # the cached-answer case, every item reworded; suffix also on an engine that never saw it
        rr = json.loads(REWORDED.read_text())
        rw = rr["reworded_summary"]
        case = f"a question asked again, reworded ({rr['reworded']} items)"
        row(case + ": the server's memory only", vs(rw, "vllm-ours-memory"), vs(rw, "vllm-suffix"), REWORDED,
            "vllm-ours-memory")
        row(case + ": the client passes its cached answer (`answers=`)", vs(rw, "vllm-ours"), vs(rw, "vllm-suffix"),
            REWORDED)
        row("the same, the reworded question served by another engine than the original (data parallel, a restart)",
            vs(rw, "vllm-ours"), vs(rw, "vllm-suffix-elsewhere"), REWORDED)
    if INFLIGHT.is_file():
        fl = json.loads(INFLIGHT.read_text())["summary"]
        levels = sorted({v["in_flight"] for v in fl.values()})

        def at(m: str) -> list[float]:
            return [fl[f"{m}@{c}"]["vs_greedy"] for c in levels]

        row(f"{' / '.join(map(str, levels))} in flight (tokens/s, 2 runs; the table below)", at("vllm-ours"),
            at("vllm-suffix"), INFLIGHT, sep=" / ")
    runs = [json.loads(path.read_text()) for path in LONG_DOCUMENTS if path.is_file()]
    if runs:  # (the second run with the references by counts: level with LLMA's choice on one engine there)
        items = len({row["item"] for row in runs[0]["rows"] if not row.get("warm_up")})
        row(f"long documents: chunks in the prompt, the whole documents as references ({items} items, {len(runs)} "
            "runs, the second with the references by counts)",
            [run["summary"]["vllm-ours-documents"]["vs_greedy_geomean"] for run in runs],
            [run["summary"]["vllm-suffix"]["vs_greedy_geomean"] for run in runs],
            [path for path in LONG_DOCUMENTS if path.is_file()])
    loaded = []  # ours and tuned suffix against greedy at 16 and 32 in flight, in the in-flight runs this page names
    for path in (INFLIGHT, FREQUENCY_INFLIGHT, INFLIGHT_SPARE, INFLIGHT_PEERS_REPEATS, SUFFIX_F3_INFLIGHT):
        if path.is_file():
            loaded.append(json.loads(path.read_text())["summary"])
    under_load = {m: [run[f"{m}@{c}"]["vs_greedy"] for run in loaded for c in (16, 32) if f"{m}@{c}" in run]
                  for m in ("vllm-ours", "vllm-suffix-f3")}
    runs_with = {m: sum(f"{m}@16" in run for run in loaded) for m in under_load}
    said = ""
    if MEMORY_AB.is_file():  # the memory row's engines against the memory itself on one engine
        ab = json.loads(MEMORY_AB.read_text())["summary"]
        off, on, diff = ab["null"], ab['"bench"'], ab["b_over_a"]
        said = (f"On ONE engine, the memory on against off request by request ([run](benchmarks/results/"
                f"{MEMORY_AB.with_suffix('.md').name}), the sample's last {diff['groups']} items): "
                f"{diff['geo_mean']:.3f}x (faster on {diff['b_faster']} of {diff['groups']}; "
                f"{on['tokens_per_step']:.2f} against {off['tokens_per_step']:.2f} tokens/step)")
        if MEMORY_AB_16.is_file():
            ab = json.loads(MEMORY_AB_16.read_text())
            diff = ab["summary"]["b_over_a"]
            said += (f"; with {ab['in_flight']} in flight ([run](benchmarks/results/{MEMORY_AB_16.with_suffix('.md').name})) "
                     f"{diff['geo_mean']:.3f}x (faster in {diff['b_faster']} of {diff['groups']} groups)")
        said += (", so where the memory's row falls below vllm-ours it is the spread between engines on this CPU "
                 "(below), not the memory's cost.")
    return "\n".join([
        "### Against suffix decoding, case by case", "",
        "Against vLLM's suffix decoding (its one flag, at vLLM's defaults), case by case; speed-ups against "
        "vllm-greedy, per request unless said (geo-mean over the same items, so their ratio is ours over suffix's "
        "per item):", "", "| case | ours | vllm-suffix | ours / suffix | run |", "|---|---|---|---|---|", *rows, "",
        *([f"- {said}"] if said else []),
        "- Where they tie, both copy from the same places: the prompt, the answer so far, the engine's earlier "
        "answers; suffix decoding at `max_spec_factor` 3 "
        f"(vllm-suffix-f3) was {vs(sm, 'vllm-suffix-f3') / vs(sm, 'vllm-suffix'):.2f}x its defaults per request in "
        "the peer table's run, and under load "
        f"{min(under_load['vllm-suffix-f3']):.2f}x-{max(under_load['vllm-suffix-f3']):.2f}x vllm-greedy's tokens/s "
        f"at 16 and 32 in flight, ours {min(under_load['vllm-ours']):.2f}x-{max(under_load['vllm-ours']):.2f}x "
        f"({runs_with['vllm-suffix-f3']} and {runs_with['vllm-ours']} committed in-flight runs).",
        "- What ours adds: references that are not in the prompt (a cached answer, whole documents, an earlier turn) "
        "and reach whichever engine serves the request, where suffix decoding's tree (like our memory) holds only "
        "what its own engine answered since it started; a memory scoped per tenant; drafts cut to what the batch "
        "can afford.",
        "- On these items the model answers from its prompt, where suffix decoding's tree finds as much "
        "as our drafters do; no match choice tried here (a learned score, suffix's own tree, counts over the "
        "references) moved real timing by more than ~1% ([benchmarks/results](benchmarks/results/README.md)).",
        *([f"- {copy_ceiling_clause().strip()}"] if copy_ceiling_clause() else [])])


def summary_section() -> str:
    """The README's results: the peers of one run side by side, the serving run, cold against warm."""
    from rag_accel.bench.results import concurrency_table, markdown_table

    r = json.loads(PEERS.read_text())
    env = r["environment"]
    judged = " (the sample's last, which no default was tuned on)" if r.get("last") else ""
    lines = ["### Per request, every peer in one run", "",
             f"Per request, {r['items']} MS-MARCO items{judged} x {r['max_new_tokens']} new tokens, {env['model']} "
             f"{env['dtype']} on a {env['cpu_threads']}-core CPU, vLLM {env['vllm']}, {env['date']} "
             f"([all of this run](benchmarks/results/{PEERS.with_suffix('.md').name})):", "",
             markdown_table(r["summary"], legend=False), "",
             "- Speed-up: per item, greedy's latency (the median of its runs) over the method's; geo-mean over the "
             "items; worst item: the lowest, named.",
             "- Tokens/step: new tokens per model forward pass, prefill included.",
             "- Identical: the runs whose token ids equal the item's greedy run on the method's engine (vllm-greedy for "
             "vllm-*), token for token; the last column against transformers' greedy.",
             "- Tokens/s: all runs together."]
    if ENGINE_ORDER.is_file():  # every vLLM bench builds vllm-greedy first: how far that can flatter its ratios
        first = [first_vs_others(run) for run in json.loads(ENGINE_ORDER.read_text())["runs"]
                 if not run["throwaway_first"]]
        slower, rest = [d for d in first if d > 0.02], [d for d in first if d <= 0.02]
        probes = (f"in {len(slower)} of {len(first)} probes the first engine built in a process was "
                  f"{min(slower):.0%}-{max(slower):.0%} slower than identical ones built after it, in the rest "
                  + ", ".join(f"{d:+.0%}" for d in rest) + " "
                  f"([probe](benchmarks/results/{ENGINE_ORDER.with_suffix('.md').name}))")
        if env.get("spare_engine_first"):
            lines.append("- The vLLM engines of a run share one process; a spare one is built and closed before them, "
                          f"so none timed is the process's first: {probes}. The runs before this one "
                          "built vllm-greedy first, which may have flattered their ratios against it by that much.")
        else:
            lines.append("- The vLLM engines of a run share one process, vllm-greedy built first; " + probes + ": "
                          "ratios against vllm-greedy may be flattered by that much, those between the other vllm-* "
                          "methods are not.")
    layer = env.get("vllm_env", {}).get("NUMBA_THREADING_LAYER")
    if layer is not None:  # (PEER_ENVIRONMENT: what the runs before it lacked)
        lines.append(f"- Its vLLM engines ran under numba's `{layer}` threading layer "
                      "(`rag_accel.methods.PEER_ENVIRONMENT`); the runs before it ran under numba's default OpenMP "
                      "layer, which spins beside torch's threads on this CPU: it slowed vllm-ngram and, from that idle engine, the transformers methods of the "
                      "same run (the run's note in [benchmarks/results](benchmarks/results/README.md)).")
    if r.get("concurrency_summary") and not INFLIGHT.is_file():  # (the in-flight run below has every peer, more levels)
        lines += ["", "In flight (vLLM, the same run):", "", concurrency_table(r["concurrency_summary"])]
    if SERVE.is_file():
        sv = json.loads(SERVE.read_text())
        off = sv["methods"].get("off", {})
        said = []
        for m in ("ngram", "ours"):
            got = sv["methods"].get(m, {})
            parts = [f"c={c} {got[f'c{c}']['tokens_per_s'] / off[f'c{c}']['tokens_per_s']:.2f}x"
                     for c in sv["args"]["concurrency"] if f"c{c}" in got and f"c{c}" in off]
            if parts:
                default_layer = m == "ngram" and "NUMBA_THREADING_LAYER" not in sv.get("server_env", {})
                label = f"{m} (under numba's default layer)" if default_layer else m
                said.append(f"{label} " + ", ".join(parts))
        lines.append(f"- Through HTTP (`rag-accel serve`, the sample's last {sv['items']} items, {sv['date'][:10]}; "
                      f"[table](benchmarks/results/{SERVE.with_suffix('.md').name})), tokens/s over the server "
                      "without speculation, c requests in flight: " + "; ".join(said) + ".")
    png = PEERS.with_suffix(".png")
    if png.is_file():
        lines += ["", f"![per-item speed-up and tokens per step](benchmarks/results/{png.name})"]
    lines += ["", f"Reproduce: `{r['command']}` (in the vLLM virtualenv)", "", suffix_section(r)]
    if COLD.is_file() and WARM.is_file():  # never slower from the first request: cold, warm, other queries
        cold, warm = json.loads(COLD.read_text()), json.loads(WARM.read_text())
        said = [f"{m} cold {c['speedup_geomean']:.2f}x (worst item {c['speedup_worst']:.2f}x), warm "
                f"{warm['summary'][m]['speedup_geomean']:.2f}x ({warm['summary'][m]['speedup_worst']:.2f}x)"
                for m, c in cold["summary"].items() if m != "greedy" and m in warm["summary"]]
        if VLLM_COLD.is_file() and VLLM_WARM.is_file():  # against its own engine's greedy: vllm-greedy
            vc = json.loads(VLLM_COLD.read_text())
            v, w = vc["summary"]["vllm-ours"], json.loads(VLLM_WARM.read_text())["summary"]["vllm-ours"]
            said.append(f"vllm-ours against vllm-greedy cold {v['speedup_vs_vllm_greedy_geomean']:.2f}x "
                        f"({v['speedup_vs_vllm_greedy_worst']:.2f}x; [run](benchmarks/results/"
                        f"{VLLM_COLD.with_suffix('.md').name}), median of {vc['repeats']}), warm "
                        f"{w['speedup_vs_vllm_greedy_geomean']:.2f}x ({w['speedup_vs_vllm_greedy_worst']:.2f}x; "
                        f"[run](benchmarks/results/{VLLM_WARM.with_suffix('.md').name}))")
        if TRECDL_COLD.is_file():  # queries and passages of another kind, never tuned on
            tc = json.loads(TRECDL_COLD.read_text())
            t = tc["summary"]["ours"]
            said.append(f"ours on the first {tc['items']} TREC DL 2019+2020 queries, BM25 top-10 passages, cold "
                        f"{t['speedup_geomean']:.2f}x ({t['speedup_worst']:.2f}x; [run](benchmarks/results/"
                        f"{TRECDL_COLD.with_suffix('.md').name}), median of {tc['repeats']})")
        replay = RESULTS / "cold_replay_smollm2_last100.json"
        if replay.is_file():  # the same without timing noise
            rs = json.loads(replay.read_text())["summary"]
            said.append("replayed without timing noise (each request's drafting against the model's answers to the "
                        "last 100 items, at the measured step costs; [replay](benchmarks/results/"
                        f"{replay.with_suffix('.md').name})) " + ", ".join(
                            f"{k.replace(', new policy', '')} {v['geomean']:.2f}x (worst {v['worst']:.2f}x)"
                            for k, v in rs.items() if k.endswith("new policy")))
        same = min(x["identical_rate"] for path in (COLD, WARM, VLLM_COLD, VLLM_WARM, TRECDL_COLD) if path.is_file()
                   for x in json.loads(path.read_text())["summary"].values())
        lines += ["", "### Never slower from the first request", "",
                  f"Cold, every request a fresh process's first "
                  f"([run](benchmarks/results/{COLD.with_suffix('.md').name})), against warm, the decoder keeping "
                  f"what earlier requests taught ([run](benchmarks/results/{WARM.with_suffix('.md').name})); "
                  f"transformers, the sample's last {cold['items']} items (no default was tuned on them) x "
                  f"{cold['max_new_tokens']} tokens, median of {cold['repeats']} runs per item, "
                  f"{cold['environment']['date']}; {same:.0%} identical:", "",
                  *(f"- {x}" for x in said)]
    if all(p.is_file() for p in GPU):
        lines += ["", "### On a GPU", "", gpu_paragraph(*GPU), "", GPU_CEILING]
    if MISLEADING.is_file():
        ms = json.loads(MISLEADING.read_text())["summary"]["ours-ref"]
        lines += ["", "### Every draft rejected", "", f"References built to match the output and continue it wrongly (cold, "
                      f"the sample's last items; [run](benchmarks/results/{MISLEADING.with_suffix('.md').name})): "
                      f"{ms['drafted']} draft tokens sent, none accepted; all items' time "
                      f"{ms['total_vs_greedy']:.3f}x greedy's speed and {ms['total_vs_plain']:.3f}x our loop's "
                      f"without drafting (worst item {ms['worst_vs_plain']:.3f}x)."]
    spread = ""
    if all(p.is_file() for p in INFLIGHT_CONTROL):  # how far two engines configured alike differ in flight
        ratios = []
        for path in INFLIGHT_CONTROL:
            rate = run_rates(json.loads(path.read_text())["rows"])
            ratios += [rate["vllm-ours-control", c, k] / rate["vllm-ours", c, k] - 1 for m, c, k in rate
                       if m == "vllm-ours"]
        spread = ("Two engines configured alike differ on this 2-core CPU: a second engine configured as vllm-ours "
                  "beside it (the same items in the same order) had tokens/s against it from "
                  f"{min(ratios):+.0%} to {max(ratios):+.0%} at 1-32 in flight over "
                  f"{sum(len(json.loads(p.read_text()).get('build_orders', [0])) for p in INFLIGHT_CONTROL)} runs ("
                  + ", ".join(f"[run](benchmarks/results/{p.with_suffix('.md').name})" for p in INFLIGHT_CONTROL)
                  + "), so a difference between methods smaller than that, from one run, is not told apart; the "
                  "in-flight runs with the memory of earlier answers, the engines' build order rotated and a spare "
                  "engine built first are on the [results page](benchmarks/results/README.md).")
    if INFLIGHT.is_file():  # suffix and a tuned dynamic n-gram in flight, on items they never saw
        fl = json.loads(INFLIGHT.read_text())
        sm, levels = fl["summary"], sorted({v["in_flight"] for v in fl["summary"].values()})
        methods = list(dict.fromkeys(v["method"] for v in sm.values()))
        lines += ["", "### In flight", "",
                  f"Every peer, each level on its own items of the sample's last "
                  f"{len(sum(fl['items'].values(), []))} (so suffix decoding never meets an item twice), "
                  f"{fl['environment']['new_tokens']} tokens a request, {fl['environment']['date']}"
                  + (f", {len(fl['build_orders'])} runs on engines built afresh (all runs' tokens over their time)"
                     if len(fl.get("build_orders", [])) > 1 else "") + " "
                  f"([run](benchmarks/results/{INFLIGHT.with_suffix('.md').name})). Tokens/s against vllm-greedy:", "",
                  "| method | " + " | ".join(f"{c} in flight" for c in levels) + " | identical |",
                  "|---|" + "---|" * (len(levels) + 1)]
        for m in methods:
            cells = [f"{sm[f'{m}@{c}']['vs_greedy']:.2f}x" for c in levels]
            same = sum(sm[f"{m}@{c}"]["identical"] for c in levels)
            total = sum(sm[f"{m}@{c}"]["requests"] for c in levels)
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {same / total:.0%} |")
        lines += ["", f"- vllm-ngram-dynamic: vLLM's dynamic speculative decoding with the schedule `{fl['schedule']}` "
                      "tuned first on the sample's first items."]
        if numba_clause(fl):
            lines.append("- " + numba_clause(fl).removeprefix("; ") + ".")
        if spread:
            lines.append("- " + spread)
    if SETUP.is_file() and SETUP_FREE.is_file():  # the first token of a short prompt with big references
        said = []
        for path, how in ((SETUP, "2 torch threads"), (SETUP_FREE, "1 thread, a core left free as a GPU leaves the host's")):
            st = json.loads(path.read_text())
            rows = st["short_prompt"]["rows"]
            g = rows[0]
            said.append(f"{how}: " + ", ".join(f"{r['method'].split(', ')[1]} {g['first_s'] / r['first_s']:.2f}x"
                                               for r in rows[1:]))
        lines += ["", "### First token with big references", "",
                  f"First token of a short prompt ({st['short_prompt']['prompt_tokens']} tokens) with big "
                  "references, against greedy's (transformers; the references are tokenised and indexed beside "
                  f"the prefill and never waited for; [run](benchmarks/results/{SETUP.with_suffix('.md').name}), "
                  f"[free core](benchmarks/results/{SETUP_FREE.with_suffix('.md').name})):", "",
                  *(f"- {x}." for x in said)]
        setup = json.loads(SETUP.read_text())
        e2e = {r["method"]: r for r in setup["short_answer"]}
        new = setup["command"].split("--new ")[1].split()[0]
        big = max((m for m in e2e if m.endswith("-token reference")), key=lambda m: int(
            m.split(", ")[1].split("-")[0].replace(",", "")), default=None)
        if big is not None and f"{big}, seen before" in e2e:  # the whole answer, a full RAG prompt, 2 threads
            lines.append(f"- A {new}-token answer to a {setup['environment']['prompt_tokens']}-token RAG prompt with the "
                          f"{big.split(', ')[1]}, 2 threads: {e2e[big]['vs_greedy']:.2f}x greedy new to the decoder, "
                          f"{e2e[big + ', seen before']['vs_greedy']:.2f}x seen before (its text tokenised once).")
    return "\n".join(lines)


def gpu_paragraph(warm_path: Path, cold_path: Path, cold_r3_path: Path) -> str:
    """The transformers methods on a GPU: warm with the peers, cold (one run each, then median of 3)."""
    warm, cold, cold_r3 = (json.loads(p.read_text()) for p in (warm_path, cold_path, cold_r3_path))

    def said(r: dict, m: str, path: Path | None = None) -> str:
        v, where = r["summary"][m], f"; [run](benchmarks/results/{path.with_suffix('.md').name})" if path else ""
        return f"{v['speedup_geomean']:.2f}x (worst item {v['speedup_worst']:.2f}x{where})"

    env, names = warm["environment"], {"hf-pld": "Hugging Face prompt lookup"}
    ours_first = sorted((m for m in warm["summary"] if m != "greedy"), key=lambda m: not m.startswith("ours"))
    same = min(v["identical_rate"] for r in (warm, cold, cold_r3) for v in r["summary"].values())
    step_ms = {m: warm["summary"][m]["split"]["ms_per_later_step"] for m in ("greedy", "ours")}
    greedy_ms = [1000 * r["seconds"] / r["steps"] for r in warm["runs"] if r["method"] == "greedy"]
    return (f"On a GPU, transformers only (vLLM was not there), {env['device'].split(': ')[1]}, {env['dtype']}, the "
            f"sample's last {warm['items']} items x {warm['max_new_tokens']} tokens, {env['date']}: warm, one run per "
            f"item ([run](benchmarks/results/{warm_path.with_suffix('.md').name})), "
            + ", ".join(f"{names.get(m, m)} {said(warm, m)}" for m in ours_first) + "; "
            f"ours cold, one run per item, {said(cold, 'ours', cold_path)}, and cold, median of {cold_r3['repeats']} "
            f"runs, on the last {cold_r3['items']} items {said(cold_r3, 'ours', cold_r3_path)}; {same:.0%} identical. "
            f"A verifying pass cost about what a one-token step did ({step_ms['ours']:.1f} against "
            f"{step_ms['greedy']:.1f} ms a step after the prefill, most of it the host's Python for this 135M model), "
            f"so drafts pay more than on the CPU; greedy's own step took {min(greedy_ms):.0f}-{max(greedy_ms):.0f} ms "
            "from item to item on that host, so single items of a one-run table are noisy (the runs' notes)."
            + gpu_steps_clause())


# the transformers engine's ceiling on a GPU, replayed at measured step times (benchmarks/experiments/gpu_ceiling.py)
GPU_CEILING = (
    "What copying can reach on the transformers engine once its steps are graph-captured, replayed on SmolLM2's "
    "bfloat16 answers to the last 30 items at those H200 step times, padded to the static step sizes, with a 30 ms "
    "prefill ([run](benchmarks/results/gpu_ceiling_h200_smollm2_last30x64_bf16.md)): the copy oracle (each step "
    "copying the most that gets accepted, from the best place) 1.88x the engine's plain steps, our drafts sent at the "
    "oracle's lengths 1.59x, our drafting as it runs 1.45x (worst item 0.96x). The gap to the oracle is the choice of "
    "occurrence and length, as on the CPU.")


def gpu_steps_clause(path: Path = RESULTS / "gpu_step_costs_h200.json") -> str:
    """`` A CUDA-graph step ...``: what a verify of 10 draft tokens cost against a plain step on the GPU, by the
    step-cost run (bfloat16 shapes; one row and 32 rows), and where the proposer's replay at those times is."""
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())

    def ratio(run: dict, rows: int) -> float:
        times = {x["tokens_per_row"]: x["ms_median"] for x in run["modes"]["graph"]["shapes"] if x["rows"] == rows}
        return times[11] / times[1]

    bf16 = [r for r in data["runs"] if r["dtype"] == "bfloat16"]
    one = sorted((ratio(r, 1), r["model"]) for r in bf16)
    many = sorted(ratio(r, 32) for r in bf16)
    size = {r: r.split("-")[-1].upper() for _, r in one}
    return (f" A CUDA-graph step, as vLLM runs one, is not launch-bound: on an {data['device'].replace('NVIDIA ', '')}"
            f" a verify of 10 draft tokens on one row cost {one[0][0]:.2f}x (the {size[one[0][1]]} shape, bfloat16) to "
            f"{one[-1][0]:.2f}x ({size[one[-1][1]]}) a plain step, {many[0]:.1f}-{many[-1]:.1f}x at 32 rows "
            f"([run](benchmarks/results/{path.with_suffix('.md').name}); replayed through the vLLM proposer's pricing: "
            "[run](benchmarks/results/batch_costs_smollm2_last100_h200.md)).")


def copy_ceiling_clause(path: Path = RESULTS / "suffix_replay_smollm2_last100.json") -> str:
    """`` What copying has left ...``: the suffix replay's ceiling of copying after matches of 2+ tokens (with
    earlier answers) and its length oracle (our drafts, each sent at its accepted length) against suffix
    decoding's defaults and ours with the memory, at this CPU's costs."""
    if not path.is_file():
        return ""
    run = json.loads(path.read_text())
    res = run["results"]["cpu"]
    oracle = res["ceiling: the oracle after matches of 2+ tokens only, earlier answers too"]
    suffix, ours = res["suffix decoding (vLLM's defaults)"], res["the default chain + memory of earlier answers"]
    exact = res["the default chain + memory, each draft sent at just its accepted length (an oracle)"]

    def vs_suffix(row: dict) -> str:
        return f"{row['modelled_speedup_decoding'] / suffix['modelled_speedup_decoding']:.2f}x"
    return (" What copying has left is bounded: an oracle that copies, after every match of 2+ tokens in the "
            "references, prompt, answer so far and earlier answers, just what gets accepted models "
            f"{vs_suffix(oracle)} suffix's defaults ({oracle['tokens_per_step']:.2f} tokens/step; ours with the memory "
            f"{ours['tokens_per_step']:.2f}, {vs_suffix(ours)}, and {vs_suffix(exact)} were each of its drafts sent at "
            f"just its accepted length) on the sample's last {run['items']} answers at this CPU's costs; the rest lies "
            "after 1-token matches, where only the answer says which of many places continues "
            f"([replay](benchmarks/results/{path.with_suffix('.md').name})).")


def numba_clause(run: dict) -> str:
    """``; ...``: a run's vLLM n-gram engines under numba's workqueue layer, and what the default layer cost
    them (NUMBA_LAYER's run); ``""`` for a run that did not record the layer."""
    layer = run["environment"].get("vllm_env", {}).get("NUMBA_THREADING_LAYER")
    if layer is None or not NUMBA_LAYER.is_file():
        return ""
    sm = json.loads(NUMBA_LAYER.read_text())["summary"]
    levels = sorted({v["in_flight"] for v in sm.values()})

    def at(name: str) -> str:
        return "/".join(f"{sm[f'{name}@{c}']['vs_greedy']:.2f}x" for c in levels)

    return (f"; vLLM's n-gram under numba's `{layer}` threading layer: under its default one, which spins beside "
            f"torch's threads here, it ran {at('vllm-ngram (numba default)')} vllm-greedy at "
            f"{'/'.join(str(c) for c in levels)} in flight against {at('vllm-ngram (workqueue)')} with `{layer}`, "
            "the same items, both engines alive together "
            f"([run](benchmarks/results/{NUMBA_LAYER.with_suffix('.md').name}))")


def recorded_command(path: Path) -> str | None:
    """The command a run's JSON records, else the one its markdown names (``- command: `...```)."""
    run = json.loads(path.read_text())
    if isinstance(run, dict) and run.get("command"):
        return run["command"]
    md = path.with_suffix(".md")
    m = re.search(r"command: `([^`]+)`", md.read_text()) if md.is_file() else None
    return m[1] if m else None


def scripts_section(folder: Path) -> str:
    """A folder's index of its scripts: each one's purpose (its docstring's first paragraph) and the command of every
    committed run it made, the run linked."""
    made: dict[str, list[tuple[Path, str]]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        if (command := recorded_command(path)) and (m := re.search(r"benchmarks/(?:experiments/)?(\w+)\.py", command)):
            made.setdefault(m[1], []).append((path, command))
    results = Path(os.path.relpath(RESULTS, folder)).as_posix()
    parts = []
    for script in sorted(folder.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        purpose = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
        runs = [f"- [{p.stem}]({results}/{p.with_suffix('.md').name if p.with_suffix('.md').is_file() else p.name}): "
                f"`{command}`" for p, command in made.get(script.stem, [])]
        parts.append(f"### `{script.name}`\n\n{purpose}" + ("\n\n" + "\n".join(runs) if runs else ""))
    return "\n\n".join(parts)


#: The scripts whose runs get a heading of their own in the index; every other script's runs are listed together.
MAIN_SCRIPTS = {"rag-accel bench": "`rag-accel bench`: the methods side by side",
                "edit_bench": "`edit_bench.py`: editing and RAG against plain vLLM",
                "inflight_bench": "`inflight_bench.py`: requests in flight on vLLM",
                "config_ab": "`config_ab.py`: one setting on and off, on one engine",
                "exact_costs": "`exact_costs.py`: what exact steps cost in vLLM's worker",
                "verify_costs": "`verify_costs.py`: a verify forward's cost on transformers"}


def run_index() -> str:
    """Every committed run (each page in the results folder), one line each under the script that made it: its page
    and what it answers (the page's title)."""
    groups: dict[str, list[str]] = {}
    for md in sorted(RESULTS.glob("*.md")):
        if md.name in ("README.md", "notes.md"):
            continue
        title = md.read_text().splitlines()[0].lstrip("# ").strip()
        js = md.with_suffix(".json")
        command = recorded_command(js) if js.is_file() else None
        m = re.search(r"(rag-accel bench)(?!-)|benchmarks/(?:experiments/)?(\w+)\.py", command or "")
        script = (m[1] or m[2]) if m else None
        group = script if script in MAIN_SCRIPTS else "others"
        name = f"`{script}.py`: " if group == "others" and script and script != "rag-accel bench" else ""
        groups.setdefault(group, []).append(f"- [{md.stem}]({md.name}): {name}{title}")
    parts = [f"### {MAIN_SCRIPTS[g]}\n\n" + "\n".join(groups[g]) for g in MAIN_SCRIPTS if g in groups]
    parts.append("### Every other script's runs\n\n" + "\n".join(groups.get("others", [])))
    return "\n\n".join(parts)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    _replace(RESULTS / "README.md", START, END, run_index(), wrapped=False)
    # (the README's Results table is written by hand and links to the notes; the summary's links are the README's,
    # from the root)
    summary = summary_section().replace("](benchmarks/results/README.md)", "](README.md#every-committed-run)")
    _replace(RESULTS / "notes.md", SUMMARY_START, SUMMARY_END, summary.replace("](benchmarks/results/", "]("))
    for folder in (ROOT / "benchmarks", ROOT / "benchmarks" / "experiments"):  # (each command whole, to copy)
        _replace(folder / "README.md", SCRIPTS_START, SCRIPTS_END, scripts_section(folder), wrapped=False)


if __name__ == "__main__":
    main()
