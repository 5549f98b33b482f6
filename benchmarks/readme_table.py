"""Regenerate the results pages from the committed benchmark JSON.

    python benchmarks/readme_table.py

rewrites ``benchmarks/results/README.md`` between its results markers (every committed run) and the
README's summary between its summary markers (the peers side by side, per request and in flight, cold
and warm).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine_order import first_vs_others  # (this folder is on sys.path when run as a script)
from inflight_bench import run_rates

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
SUMMARY_START, SUMMARY_END = "<!-- summary:start -->", "<!-- summary:end -->"
RESULTS = ROOT / "benchmarks" / "results"
# every peer in one run, per request and in flight, on items no default was tuned on, a spare engine built first;
# ours with the default chain of the frequency drafter, suffix decoding at vLLM's defaults and tuned (vllm-suffix-f3),
# vLLM's engines under PEER_ENVIRONMENT (numba's workqueue layer; the runs before it understate vllm-ngram)
PEERS = RESULTS / "bench_vllm_cpu_smollm2_last24_workqueue.json"
SERVE = RESULTS / "serve_cpu_smollm2.json"
# cold: median of 5 runs per item (the run of 3 before it stays on the results page)
COLD, WARM = RESULTS / "bench_cpu_smollm2_last30x64_cold_r5.json", RESULTS / "bench_cpu_smollm2_last30x64_warm.json"
# the same items, vLLM engines, cold: median of 5 (the run of 3 before it stays on the results page)
VLLM_COLD = RESULTS / "bench_vllm_cpu_smollm2_last30x64_cold_r5.json"
VLLM_WARM = RESULTS / "bench_vllm_cpu_smollm2_last30x64_warm_r5.json"  # the same, one engine learning throughout
TRECDL_COLD = RESULTS / "bench_cpu_smollm2_trecdl30x64_cold.json"  # other queries and passages, cold
MISLEADING = RESULTS / "misleading_refs_cpu_smollm2.json"  # every draft rejected
# the server's memory against suffix's tree, the memory drafting by suffix decoding's counts (the n-gram memory before
# it: bench_vllm_cpu_smollm2_memory_last16x64, on the results page)
MEMORY = RESULTS / "bench_vllm_cpu_smollm2_last24_frequency_memory.json"
PEERS_NGRAM_MEMORY = True  # PEERS ran before the memory drafted by counts
# every peer in flight, each level on unseen items, twice on engines built afresh, the default chain of the frequency
# drafter, vLLM's engines under PEER_ENVIRONMENT (the earlier in-flight runs stay on the results page)
INFLIGHT = RESULTS / "inflight_vllm_cpu_smollm2_workqueue.json"
# vLLM's n-gram under numba's default threading layer and under workqueue, in one run (PEER_ENVIRONMENT's reason)
NUMBA_LAYER = RESULTS / "numba_layer_vllm_cpu_smollm2.json"
# the memory of earlier answers in flight, beside suffix decoding (and a repeat of ours with and without it)
INFLIGHT_MEMORY = (RESULTS / "inflight_vllm_cpu_smollm2_memory.json",
                   RESULTS / "inflight_vllm_cpu_smollm2_memory_r2.json")
# ... with a second engine configured as vllm-ours beside them (the spread between engines): once, and twice on
# engines built afresh
INFLIGHT_CONTROL = (RESULTS / "inflight_vllm_cpu_smollm2_memory_control.json",
                    RESULTS / "inflight_vllm_cpu_smollm2_memory_repeats.json")
# ours and its control against greedy in flight, the engines' build order rotated from run to run
INFLIGHT_ROTATED = RESULTS / "inflight_vllm_cpu_smollm2_rotated.json"
# suffix decoding and ours in flight with a spare engine built (and closed) first, so none timed is the process's first
INFLIGHT_SPARE = RESULTS / "inflight_vllm_cpu_smollm2_spare.json"
# identical vLLM engines built in turn in one process: is the first one slower?
ENGINE_ORDER = RESULTS / "engine_order_vllm_cpu_smollm2.json"
# suffix decoding and ours again in flight, twice on engines built afresh, a control engine beside them
INFLIGHT_PEERS_REPEATS = RESULTS / "inflight_vllm_cpu_smollm2_peers_repeats.json"
# the frequency drafter (the default chain since 2026-11-26): against the chain before it on one engine, per request
# (vLLM, transformers), and the in-flight levels against suffix decoding
FREQUENCY_AB = (RESULTS / "config_ab_vllm_cpu_smollm2_frequency.json", RESULTS / "config_ab_vllm_cpu_smollm2_frequency_16.json",
                RESULTS / "config_ab_hf_cpu_smollm2_frequency.json")
FREQUENCY_INFLIGHT = RESULTS / "inflight_vllm_cpu_smollm2_frequency.json"
# a request's references set up beside its prefill: 2 torch threads (the CPU's cores), and 1 (a core left free,
# as a GPU leaves the host's)
SETUP, SETUP_FREE = RESULTS / "setup_cost_cpu_smollm2.json", RESULTS / "setup_cost_cpu_smollm2_1thread.json"


def levels_vs_greedy(summary: dict, methods: tuple[str, ...], levels: list[int]) -> str:
    """An in-flight run's ratios against vllm-greedy per level, with tokens/step, for each method.

    Example:
        >>> levels_vs_greedy({"m@1": {"vs_greedy": 1.2, "tokens_per_step": 1.5}}, ("m",), [1])
        'm 1.20x (1.50 tokens/step)'
    """
    return "; ".join(f"{m} " + "/".join(f"{summary[f'{m}@{c}']['vs_greedy']:.2f}x" for c in levels)
                     + " (" + "/".join(f"{summary[f'{m}@{c}']['tokens_per_step']:.2f}" for c in levels)
                     + " tokens/step)" for m in methods)


def levels_ratio(summary: dict, method: str, other: str, levels: list[int]) -> str:
    """``method``'s tokens/s over ``other``'s per level, all runs: ``1.00x/1.02x``."""
    return "/".join(f"{summary[f'{method}@{c}']['tokens_per_s'] / summary[f'{other}@{c}']['tokens_per_s']:.2f}x"
                    for c in levels)


def engine_section(path: Path) -> str:
    r = json.loads(path.read_text())
    env, s = r["environment"], r["summary"]
    repeats = f", median of {r['repeats']} runs per item" if r.get("repeats", 1) > 1 else ""
    lines = [
        f"**{env['model'].split('/')[-1]}, {env['dtype']}, {env['device']} ({env['cpu_threads']} threads), "
        f"{r['items']} MS-MARCO items, {r['max_new_tokens']} new tokens"
        f"{', target-forced: ' + r['target_forced'] if r.get('target_forced') else ''}"
        f"{', draft model: ' + env['draft_model'] if env.get('draft_model') else ''}"
        f"{repeats}, {env['date']}** "
        f"([json]({path.name}))",
        "",
        "| method | speed-up vs greedy (geo-mean) | worst item | tokens/step | tokens/s | identical to greedy |",
        "|---|---|---|---|---|---|",
    ]
    for m, v in s.items():
        lines.append(f"| {m} | {v['speedup_geomean']:.2f}x | {v['speedup_worst']:.2f}x | "
                     f"{v['tokens_per_step']:.2f} | {v['tokens_per_s']:.1f} | {v['identical_rate']:.0%} |")
    if env.get("vllm"):  # the vLLM methods beside the transformers ones: the bench's own tables
        from rag_accel.bench import concurrency_table, markdown_table

        lines[2:] = [f"vLLM {env['vllm']}, {env['num_speculative_tokens']} draft tokens per step, env "
                     f"`{env.get('vllm_env', {})}`; machine load (1/5/15 min, 2 cores) before {env.get('load_before')}, "
                     f"after {env.get('load_after')}.", "", markdown_table(s)]
        if r.get("reworded_summary"):
            lines += ["", f"Cached-answer case ({r['reworded']} items): the question reworded, greedy's answer to the "
                          "original as an extra reference that is not in the prompt:", "",
                      markdown_table(r["reworded_summary"], legend=False)]
        if r.get("concurrency_summary"):
            lines += ["", "Throughput with several requests in flight (vLLM; the transformers methods run one "
                          "request at a time):", "", concurrency_table(r["concurrency_summary"])]
    png = path.with_suffix(".png")
    if png.is_file():
        lines += ["", f"![per-item speed-up and tokens per step]({png.name})"]
    if r.get("code_commit"):  # a run of code that is no longer on the branch: say where it runs
        lines += ["", f"Reproduce (at commit {r['code_commit']}: {r['reproduce_note']}): "
                      f"`git checkout {r['code_commit']} && {r['command']}`"]
    else:
        lines += ["", f"Reproduce: `{r['command']}`"]
    if r.get("note"):
        lines += ["", f"Note: {r['note']}"]
    return "\n".join(lines)


def propose_section(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [
        f"**Drafting cost against reference size** ({r['environment']['device']}, {r['environment']['date']}; "
        f"[json]({path.name})): one `propose` of the reference drafter, a fresh search and a "
        "followed span, against transformers' prompt lookup (`PromptLookupCandidateGenerator`) on the same tokens.",
        "",
        "| reference tokens | index build | index peak memory | propose: search (median / p99) | propose: followed span | HF prompt lookup |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['reference_tokens']:,} | {x['index_build_s']:.3f} s | {x['index_peak_mem_mb']:.0f} MiB | "
                     f"{x['propose_search_us_median']:.0f} / {x['propose_search_us_p99']:.0f} µs | "
                     f"{x['propose_follow_us_median']:.0f} µs | {x['hf_prompt_lookup_us_median']:.0f} µs |")
    lines += ["", f"Reproduce: `{r['command']}`"]
    return "\n".join(lines)


def retrieval_section(path: Path) -> str:
    r = json.loads(path.read_text())
    lines = [f"**Retrieval quality**: reranking the BM25 top-10 of the {r['queries']} TREC-DL 2019+2020 sample "
             f"queries, nDCG@10 (ranx) against NIST grades ({r['date']}; [json]({path.name}))", "",
             "| order | nDCG@10 |", "|---|---|"]
    lines += [f"| {name} | {v:.3f} |" for name, v in r["ndcg@10"].items()]
    lines += ["", f"Reproduce: `{r['command']}`"]
    return "\n".join(lines)


def cache_section(path: Path) -> str:
    r = json.loads(path.read_text())
    env = r["environment"]
    ok, total = r["identical"]
    lines = [f"**Cached answers and earlier turns as references** ({r['items']} MS-MARCO items, {env['device']}, "
             f"{env['date']}; outputs identical to greedy {ok}/{total}; [json]({path.name}))", "",
             "| scenario / decoder / references | tokens per step |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in r["tokens_per_step"].items()]
    lines += ["", f"Reproduce: `{r['command']}`"]
    return "\n".join(lines)


def integrations_section(path: Path) -> str:
    r = json.loads(path.read_text())
    env = r["environment"]
    lines = [f"**Framework adapters end to end** ({env['model']}, {env['dtype']}, {env['device']}, {env['date']}; "
             f"{r['items']} MS-MARCO questions, top-{r['k']} of {r['corpus_passages']} passages, "
             f"{r['max_new_tokens']} new tokens; [json]({path.name})): the LangChain chain and the "
             "LlamaIndex query engine against the same chain / engine with `accelerate=False` (the model's own "
             "`generate(do_sample=False)`); the whole call is timed, retrieval included.", "",
             "| framework | speed-up (geo-mean) | worst question | tokens/step | identical answers |",
             "|---|---|---|---|---|"]
    for name, v in r["results"].items():
        s = v["summary"]
        lines.append(f"| {name} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x | "
                     f"{s['tokens_per_step']:.2f} | {s['identical_rate']:.0%} |")
    lines += ["", f"Reproduce: `{r['command']}`"]
    return "\n".join(lines)


def coupling_section(path: Path) -> str:
    r = json.loads(path.read_text())
    return "\n".join([
        f"**Draft-model acceptance under sampling** ({r['model']} with {r['draft_model']} as draft, {r['device']}, "
        f"temperature {r['temperature']}, top-p {r['top_p']}, {r['positions']} positions of {r['items']} MS-MARCO "
        f"answers, {r['date']}; [json]({path.name}))",
        "",
        "| verification rule | acceptance per draft token |",
        "|---|---|",
        f"| accept/resample (Leviathan et al.), 1 - TV | {r['accept_resample_acceptance']:.3f} |",
        f"| Gumbel coupling (ours: seeded output independent of the drafts) | {r['gumbel_coupling_acceptance']:.3f} |",
        "",
        f"Reproduce: `{r['command']}`",
    ])


def vllm_section(path: Path) -> str:
    r = json.loads(path.read_text())
    a = r["args"]
    lines = [f"**On vLLM** ({r['model']}, {r['device']}, {r['date'][:10]}; requests of {a.get('new', 128)} new tokens; "
             f"status: {r['status']}; [json]({path.name})): latency per request at concurrency 1, "
             "throughput (tokens/s over all requests) with 4 and 16 in flight, identical-output rate against "
             "vllm-greedy, and a reworded question with the cached answer of the original as its reference "
             "(not in the prompt).", "",
             "| method | latency c=1 | tok/s c=4 | tok/s c=16 | identical c=1 / c=4 / c=16 | tokens/step c=1 | "
             "reworded: latency | reworded: tokens/step |", "|---|---|---|---|---|---|---|---|"]
    runs = dict(r["methods"])
    if r.get("greedy_rerun"):
        runs["vllm-greedy (rerun)"] = r["greedy_rerun"]
    for name, m in runs.items():
        c1, c4, c16, rw = (m.get(k, {}) for k in ("c1", "c4", "c16", "reworded_c1"))
        same = " / ".join(str(c.get("identical", "-")) for c in (c1, c4, c16))
        lines.append(f"| {name} | {c1.get('latency_s', float('nan')):.2f} s | {c4.get('tokens_per_s', float('nan')):.1f} | "
                     f"{c16.get('tokens_per_s', float('nan')):.1f} | {same} | {c1.get('tokens_per_step', float('nan')):.2f} | "
                     f"{rw.get('latency_s', float('nan')):.2f} s | {rw.get('tokens_per_step', float('nan')):.2f} |")
    lines += ["", f"Reproduce: `{r['command']}`"]
    if r.get("notes"):
        lines += ["", r["notes"].replace("## Reading it (labelled honestly)", "Reading it:").strip()]
    return "\n".join(lines)


def serve_section(path: Path) -> str:
    from serve_bench import table  # benchmarks/serve_bench.py (this folder is on sys.path when run as a script)

    r = json.loads(path.read_text())
    a = r["args"]
    return "\n".join([
        f"**Serving through HTTP** ({r['model']}, {r['device']}, {r['vllm']}, {r['date'][:10]}; {r['label']}; "
        f"[json]({path.name})): `rag-accel serve` with `--speculation off | ngram | ours`, one server "
        f"after the other, the same {r['items']} MS-MARCO items ({a['new']} new tokens, greedy, the passages in the "
        "prompt and as `vllm_xargs` references) sent by the real `openai` client with c requests in flight: "
        "tokens/s over all requests, request latency p50 / p99, outputs identical to the off server's, tokens per "
        "step from the server's spec-decode counters.", "", *table(r), "", f"Reproduce: `{r['command']}`"])


def _replace(path: Path, start: str, end: str, body: str) -> None:
    text = path.read_text()
    a, b = text.index(start) + len(start), text.index(end)
    path.write_text(text[:a] + "\n" + body + "\n" + text[b:])


def frequency_paragraph() -> str:
    """What the frequency drafter changed: the A/B runs of the default chain against the one before it, on one
    engine request by request, and the in-flight levels against suffix decoding."""
    said = []
    for path in FREQUENCY_AB:
        if path.is_file():
            ab = json.loads(path.read_text())
            s, (a, b) = ab["summary"], ab["values"]
            engine = {"vllm": "vLLM", "hf": "transformers"}[ab["engine"]]
            unit = "items" if ab["in_flight"] == 1 else f"groups of {ab['in_flight']} in flight"
            engine += f" ({ab['max_new_tokens']} tokens" + ("" if ab["in_flight"] == 1 else f", {ab['in_flight']} in flight") + ")"
            said.append(f"{engine} {s['b_over_a']['geo_mean']:.3f}x (faster on {s['b_over_a']['b_faster']} of "
                        f"{s['b_over_a']['groups']} {unit}; {s[b]['tokens_per_step']:.2f} against "
                        f"{s[a]['tokens_per_step']:.2f} tokens/step; {s[b]['vs_greedy']:.2f}x greedy; "
                        f"[run](benchmarks/results/{path.with_suffix('.md').name}))")
    text = ("The `frequency` drafter (suffix decoding's choice over prompt and output, its drafts valued by their "
            "per-token probabilities) is in the default chain the table's `ours` rows ran (references, then it); "
            "the chain before it was references, prompt lookup, n-grams")
    if said:
        text += ("; against that chain on one engine, request by request on the sample's last items: "
                 + "; ".join(said))
    if FREQUENCY_INFLIGHT.is_file():
        run = json.loads(FREQUENCY_INFLIGHT.read_text())
        sm = run["summary"]
        levels = sorted({int(k.split("@")[1]) for k in sm})
        methods = list(dict.fromkeys(k.split("@")[0] for k in sm if not k.startswith("vllm-greedy@")))
        text += (f". In flight, one run, each level on its own items ([run](benchmarks/results/"
                 f"{FREQUENCY_INFLIGHT.with_suffix('.md').name})), tokens/s against vllm-greedy at "
                 f"{'/'.join(map(str, levels))}: {levels_vs_greedy(sm, tuple(methods), levels)}")
    return text + "."


def summary_section() -> str:
    """The README's results: the peers of one run side by side, the serving run, cold against warm."""
    from rag_accel.bench import concurrency_table, markdown_table

    r = json.loads(PEERS.read_text())
    env = r["environment"]
    judged = " (the sample's last, which no default was tuned on)" if r.get("last") else ""
    lines = [f"Per request, {r['items']} MS-MARCO items{judged} x {r['max_new_tokens']} new tokens, {env['model']} "
             f"{env['dtype']} on a {env['cpu_threads']}-core CPU, vLLM {env['vllm']}, {env['date']} "
             f"([all of this run](benchmarks/results/{PEERS.with_suffix('.md').name})):", "",
             markdown_table(r["summary"], legend=False), "",
             "Speed-up: per item, greedy's latency (the median of its runs) over the method's; geo-mean over the items; "
             "worst item: the lowest, named. Tokens/step: new tokens per model forward pass, prefill included. Identical: "
             "the runs whose token ids equal the item's greedy run on the method's engine (vllm-greedy for vllm-*), token "
             "for token; the last column against transformers' greedy. Tokens/s: all runs together."]
    if ENGINE_ORDER.is_file():  # every vLLM bench builds vllm-greedy first: how far that can flatter its ratios
        first = [first_vs_others(run) for run in json.loads(ENGINE_ORDER.read_text())["runs"]
                 if not run["throwaway_first"]]
        slower, rest = [d for d in first if d > 0.02], [d for d in first if d <= 0.02]
        probes = (f"in {len(slower)} of {len(first)} probes the first engine built in a process was "
                  f"{min(slower):.0%}-{max(slower):.0%} slower than identical ones built after it, in the rest "
                  + ", ".join(f"{d:+.0%}" for d in rest) + " "
                  f"([probe](benchmarks/results/{ENGINE_ORDER.with_suffix('.md').name}))")
        if env.get("spare_engine_first"):
            lines[-1] += (" The vLLM engines of a run share one process; a spare one is built and closed before them, "
                          f"so none timed is the process's first: {probes}. The runs before this one "
                          "built vllm-greedy first, which may have flattered their ratios against it by that much.")
        else:
            lines[-1] += (" The vLLM engines of a run share one process, vllm-greedy built first; " + probes + ": "
                          "ratios against vllm-greedy may be flattered by that much, those between the other vllm-* "
                          "methods are not.")
    layer = env.get("vllm_env", {}).get("NUMBA_THREADING_LAYER")
    if layer is not None:  # (PEER_ENVIRONMENT: what the runs before it lacked)
        lines[-1] += (f" Its vLLM engines ran under numba's `{layer}` threading layer "
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
        lines[-1] += (f" Through HTTP (`rag-accel serve`, the sample's last {sv['items']} items, {sv['date'][:10]}; "
                      f"[table](benchmarks/results/{SERVE.with_suffix('.md').name})), tokens/s over the server "
                      "without speculation, c requests in flight: " + "; ".join(said) + ".")
    if any(p.is_file() for p in FREQUENCY_AB) or FREQUENCY_INFLIGHT.is_file():
        lines += ["", frequency_paragraph()]
    if COLD.is_file() and WARM.is_file():
        cold, warm = json.loads(COLD.read_text()), json.loads(WARM.read_text())
        lines += ["", f"Cold against warm (transformers, the sample's last {cold['items']} items, which no default "
                      f"was tuned on, x {cold['max_new_tokens']} tokens, median of {cold['repeats']} runs per item, "
                      f"{cold['environment']['date']}): cold, every request is a fresh process's first "
                      "([run](benchmarks/results/" + COLD.with_suffix('.md').name + ")); warm, the decoder keeps "
                      "what earlier requests taught ([run](benchmarks/results/" + WARM.with_suffix('.md').name + ")).",
                  "", "| method | cold: speed-up (geo-mean) | cold: worst item | warm: speed-up (geo-mean) | "
                      "warm: worst item | identical |", "|---|---|---|---|---|---|"]
        for m, c in cold["summary"].items():
            w = warm["summary"].get(m)
            if w is None or m == "greedy":
                continue
            lines.append(f"| {m} | {c['speedup_geomean']:.2f}x | {c['speedup_worst']:.2f}x | "
                         f"{w['speedup_geomean']:.2f}x | {w['speedup_worst']:.2f}x | "
                         f"{min(c['identical_rate'], w['identical_rate']):.0%} |")
        if VLLM_COLD.is_file():  # against its own engine's greedy: vllm-greedy
            vc = json.loads(VLLM_COLD.read_text())
            v = vc["summary"]["vllm-ours"]
            w = json.loads(VLLM_WARM.read_text())["summary"]["vllm-ours"] if VLLM_WARM.is_file() else None
            warm_cells = (f"{w['speedup_vs_vllm_greedy_geomean']:.2f}x ([run](benchmarks/results/"
                          f"{VLLM_WARM.with_suffix('.md').name})) | {w['speedup_vs_vllm_greedy_worst']:.2f}x"
                          if w else "- | -")
            same = min(v["identical_rate"], w["identical_rate"]) if w else v["identical_rate"]
            lines.append(f"| vllm-ours, against vllm-greedy ([run](benchmarks/results/{VLLM_COLD.with_suffix('.md').name}), "
                         f"median of {vc['repeats']}) | {v['speedup_vs_vllm_greedy_geomean']:.2f}x | "
                         f"{v['speedup_vs_vllm_greedy_worst']:.2f}x | {warm_cells} | {same:.0%} |")
        if TRECDL_COLD.is_file():  # queries and passages of another kind, never tuned on
            tc = json.loads(TRECDL_COLD.read_text())
            t = tc["summary"]["ours"]
            lines.append(f"| ours, the first {tc['items']} TREC DL 2019+2020 queries, BM25 top-10 passages "
                         f"([run](benchmarks/results/{TRECDL_COLD.with_suffix('.md').name}), median of "
                         f"{tc['repeats']}) | {t['speedup_geomean']:.2f}x | {t['speedup_worst']:.2f}x | - | - | "
                         f"{t['identical_rate']:.0%} |")
    if MISLEADING.is_file():
        ms = json.loads(MISLEADING.read_text())["summary"]["ours-ref"]
        lines += ["", f"Every draft rejected (references built to match the output and continue it wrongly, cold, "
                      f"the sample's last items; [run](benchmarks/results/{MISLEADING.with_suffix('.md').name})): "
                      f"{ms['drafted']} draft tokens sent, none accepted; all items' time "
                      f"{ms['total_vs_greedy']:.3f}x greedy's speed and {ms['total_vs_plain']:.3f}x our loop's "
                      f"without drafting (worst item {ms['worst_vs_plain']:.3f}x)."]
    if MEMORY.is_file():  # the cached-answer case with nothing from the client: our memory against suffix's tree
        mm = json.loads(MEMORY.read_text())
        said = []
        for case, key in (("new questions", "summary"), ("the same questions reworded", "reworded_summary")):
            got = mm.get(key) or {}
            said.append(f"{case}: " + ", ".join(
                f"{m} {got[m]['speedup_vs_vllm_greedy_geomean']:.2f}x ({got[m]['tokens_per_step']:.2f} tokens/step)"
                for m in ("vllm-ours-memory", "vllm-suffix", "vllm-ours") if m in got))
        lines += ["", f"The server's memory of earlier answers (vLLM, the sample's last {mm['items']} items x "
                      f"{mm['max_new_tokens']} tokens, {mm['environment']['date']}; "
                      f"[run](benchmarks/results/{MEMORY.with_suffix('.md').name})), per request against vllm-greedy; "
                      "vllm-ours-memory gets the passages only, its memory holding the earlier answers as suffix "
                      "decoding's tree does, and drafting from them as suffix decoding does (the continuation most "
                      "of them share, with its probabilities); in the reworded case vllm-ours gets the cached answer "
                      "from the client: " + "; ".join(said) + "."
                      + (" The peer table's vllm-ours-memory row ran the memory before it (the latest answer "
                         "continuing the longest 2-4-token n-gram)." if PEERS_NGRAM_MEMORY else "")]
    if INFLIGHT.is_file():  # suffix and a tuned dynamic n-gram in flight, on items they never saw
        fl = json.loads(INFLIGHT.read_text())
        sm, levels = fl["summary"], sorted({v["in_flight"] for v in fl["summary"].values()})
        methods = list(dict.fromkeys(v["method"] for v in sm.values()))
        lines += ["", f"In flight against every peer, each level on its own items of the sample's last "
                      f"{len(sum(fl['items'].values(), []))} (so suffix decoding never meets an item twice), "
                      f"{fl['environment']['new_tokens']} tokens a request, {fl['environment']['date']}"
                      + (f", {len(fl['build_orders'])} runs on engines built afresh (all runs' tokens over their time)"
                         if len(fl.get("build_orders", [])) > 1 else "") + " "
                      f"([run](benchmarks/results/{INFLIGHT.with_suffix('.md').name}); vllm-ngram-dynamic: vLLM's "
                      f"dynamic speculative decoding with the schedule `{fl['schedule']}` tuned first on the sample's "
                      "first items" + numba_clause(fl) + "): tokens/s against vllm-greedy:", "",
                  "| method | " + " | ".join(f"{c} in flight" for c in levels) + " | identical |",
                  "|---|" + "---|" * (len(levels) + 1)]
        for m in methods:
            cells = [f"{sm[f'{m}@{c}']['vs_greedy']:.2f}x" for c in levels]
            same = sum(sm[f"{m}@{c}"]["identical"] for c in levels)
            total = sum(sm[f"{m}@{c}"]["requests"] for c in levels)
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {same / total:.0%} |")
    if all(p.is_file() for p in INFLIGHT_MEMORY):  # our memory in flight, as suffix's tree is on by default
        said = []
        for path in INFLIGHT_MEMORY:
            sm = json.loads(path.read_text())["summary"]
            levels = sorted({v["in_flight"] for v in sm.values()})
            methods = [m for m in ("vllm-ours-memory", "vllm-suffix", "vllm-ours") if f"{m}@{levels[0]}" in sm]
            said.append(", ".join(f"{m} " + "/".join(f"{sm[f'{m}@{c}']['vs_greedy']:.2f}x" for c in levels)
                                  for m in methods) + f" ([run](benchmarks/results/{path.with_suffix('.md').name}))")
        lines += ["", "With the memory of earlier answers on (vllm-ours-memory: every request in one scope, as suffix "
                      "decoding's tree holds every answer), the same items in runs of their own, tokens/s against "
                      f"vllm-greedy at {'/'.join(str(c) for c in levels)} in flight: " + "; again: ".join(said) + "."]
    if all(p.is_file() for p in INFLIGHT_MEMORY + INFLIGHT_CONTROL):  # (said after the memory: how far two engines differ)
        def ratios(path: Path, method: str) -> list[dict[int, float]]:
            """Per run (repeat) of ``path``: ``method``'s tokens/s over vllm-ours's, per level."""
            rate = run_rates(json.loads(path.read_text())["rows"])
            repeats, levels = sorted({k for _, _, k in rate}), sorted({c for _, c, _ in rate})
            return [{c: rate[method, c, k] / rate["vllm-ours", c, k] for c in levels} for k in repeats]

        control = [(ratios(path, "vllm-ours-control"), path) for path in INFLIGHT_CONTROL]
        levels = sorted(control[0][0][0])
        said = [" and ".join("/".join(f"{run[c] - 1:+.0%}" for c in levels) for run in runs)
                + f" ([run](benchmarks/results/{path.with_suffix('.md').name}))" for runs, path in control]
        memory = [run[16] - 1 for path in INFLIGHT_MEMORY + INFLIGHT_CONTROL for run in ratios(path, "vllm-ours-memory")]
        lines[-1] += (" Two engines of one configuration differ as much on this 2-core CPU. A second engine configured "
                      "as vllm-ours beside them (vllm-ours-control, the same items in the same order) had tokens/s "
                      f"against vllm-ours at {'/'.join(str(c) for c in levels)} in flight of " + "; in two runs on "
                      "engines built afresh, ".join(said) + f". So the memory's gap at 16 in flight ({len(memory)} "
                      f"runs: {min(memory):+.0%} to {max(memory):+.0%}, {sum(memory) / len(memory):+.0%} on average) "
                      "is not told apart from that spread: a cost of a few per cent there is possible, not shown. "
                      "Nor is any in-flight difference between methods of that size, from one run with one engine each.")
    if INFLIGHT_PEERS_REPEATS.is_file() and all(p.is_file() for p in INFLIGHT_MEMORY):  # (after the spread)
        run = json.loads(INFLIGHT_PEERS_REPEATS.read_text())
        sm, rate = run["summary"], run_rates(run["rows"])
        levels = sorted({c for _, c, _ in rate})
        repeats = sorted({k for _, _, k in rate})
        both = levels_vs_greedy(sm, ("vllm-suffix", "vllm-ours", "vllm-ours-control"), levels)
        ours_vs = levels_ratio(sm, "vllm-ours", "vllm-suffix", levels)
        control = " and ".join("/".join(f"{rate['vllm-ours-control', c, k] / rate['vllm-ours', c, k] - 1:+.0%}"
                                        for c in levels) for k in repeats)
        lines[-1] += (f" Suffix decoding and ours again, {len(repeats)} runs on engines built afresh, a control engine "
                      f"beside them ([run](benchmarks/results/{INFLIGHT_PEERS_REPEATS.with_suffix('.md').name}), the "
                      f"table's items), all runs' tokens/s against vllm-greedy at {'/'.join(map(str, levels))} in "
                      f"flight: {both}. Ours against suffix: {ours_vs}, while the control against ours was {control} in the "
                      "runs: in flight the two are tied within the spread between engines. At 16 and 32 in flight, "
                      "where a verify's draft tokens cost this CPU nearly their full share, neither beats greedy; "
                      "ours drafts less there, suffix as much as alone.")
    if INFLIGHT_ROTATED.is_file() and INFLIGHT_PEERS_REPEATS.is_file() and all(p.is_file() for p in INFLIGHT_MEMORY):
        run = json.loads(INFLIGHT_ROTATED.read_text())
        rate = run_rates(run["rows"])
        levels, repeats = sorted({c for _, c, _ in rate}), sorted({k for _, _, k in rate})
        ours = ("vllm-ours", "vllm-ours-control")

        def vs_greedy(m: str, c: int, k: int) -> float:
            return rate[m, c, k] / rate["vllm-greedy", c, k]

        said = []
        for k, order in zip(repeats, run["build_orders"]):
            where = "first" if order[0] == "vllm-greedy" else "last" if order[-1] == "vllm-greedy" else "in between"
            said.append(f"vllm-greedy built {where}: " + ", ".join(
                f"{m} " + "/".join(f"{vs_greedy(m, c, k):.2f}x" for c in levels) for m in ours))
        lines[-1] += (" With the engines' build order rotated from run to run ([run](benchmarks/results/"
                      f"{INFLIGHT_ROTATED.with_suffix('.md').name})), tokens/s against vllm-greedy at "
                      f"{'/'.join(map(str, levels))} in flight: " + "; ".join(said) + "; both runs: " + ", ".join(
                          f"{m} " + "/".join(f"{run['summary'][f'{m}@{c}']['vs_greedy']:.2f}x" for c in levels)
                          for m in ours)
                      + ".")
        orders = run["build_orders"]
        if len(repeats) == 2 and orders[0][0] == "vllm-greedy" and orders[1][-1] == "vllm-greedy":
            moved = {m: [vs_greedy(m, c, repeats[1]) / vs_greedy(m, c, repeats[0]) - 1 for c in levels] for m in ours}
            lines[-1] += (" From vllm-greedy built first to built last, those ratios moved by "
                          + ", ".join(f"{m} {min(d):+.0%} to {max(d):+.0%}" for m, d in moved.items())
                          + ": a bias of that size is not told apart from the spread in one pair of runs.")
    if INFLIGHT_SPARE.is_file() and INFLIGHT_PEERS_REPEATS.is_file() and all(p.is_file() for p in INFLIGHT_MEMORY):
        run = json.loads(INFLIGHT_SPARE.read_text())
        sm, rate = run["summary"], run_rates(run["rows"])
        levels, repeats = sorted({c for _, c, _ in rate}), sorted({k for _, _, k in rate})
        peers = ("vllm-suffix", "vllm-ours")
        each = "; ".join(f"run {k + 1}: " + ", ".join(
            f"{m} " + "/".join(f"{rate[m, c, k] / rate['vllm-greedy', c, k]:.2f}x" for c in levels) for m in peers)
            for k in repeats)
        lines[-1] += (" Then with a spare engine built and closed before the timed ones, so that none is the process's "
                      f"first, {len(repeats)} runs, the build order rotated ([run](benchmarks/results/"
                      f"{INFLIGHT_SPARE.with_suffix('.md').name})), tokens/s against vllm-greedy at "
                      f"{'/'.join(map(str, levels))} in flight, all runs: {levels_vs_greedy(sm, peers, levels)}; "
                      f"ours against suffix {levels_ratio(sm, 'vllm-ours', 'vllm-suffix', levels)} ({each}).")
    if SETUP.is_file() and SETUP_FREE.is_file():  # the first token of a short prompt with big references
        said = []
        for path, how in ((SETUP, "2 torch threads"), (SETUP_FREE, "1 thread, a core left free as a GPU leaves the host's")):
            st = json.loads(path.read_text())
            rows = st["short_prompt"]["rows"]
            g = rows[0]
            said.append(f"{how}: " + ", ".join(f"{r['method'].split(', ')[1]} {g['first_s'] / r['first_s']:.2f}x"
                                               for r in rows[1:]))
        lines += ["", f"First token of a short prompt ({st['short_prompt']['prompt_tokens']} tokens) with big "
                      "references, against greedy's (transformers; the references are tokenised and indexed beside "
                      f"the prefill and never waited for; [run](benchmarks/results/{SETUP.with_suffix('.md').name}), "
                      f"[free core](benchmarks/results/{SETUP_FREE.with_suffix('.md').name})): " + "; ".join(said) + "."]
        setup = json.loads(SETUP.read_text())
        e2e = {r["method"]: r for r in setup["short_answer"]}
        new = setup["command"].split("--new ")[1].split()[0]
        big = max((m for m in e2e if m.endswith("-token reference")), key=lambda m: int(
            m.split(", ")[1].split("-")[0].replace(",", "")), default=None)
        if big is not None and f"{big}, seen before" in e2e:  # the whole answer, a full RAG prompt, 2 threads
            lines[-1] += (f" A {new}-token answer to a {setup['environment']['prompt_tokens']}-token RAG prompt with the "
                          f"{big.split(', ')[1]}, 2 threads: {e2e[big]['vs_greedy']:.2f}x greedy new to the decoder, "
                          f"{e2e[big + ', seen before']['vs_greedy']:.2f}x seen before (its text tokenised once).")
    replay = RESULTS / "cold_replay_smollm2_last100.json"
    if replay.is_file():
        rs = json.loads(replay.read_text())["summary"]
        said = "; ".join(f"{k.replace(', new policy', '')} {v['geomean']:.2f}x, worst {v['worst']:.2f}x"
                         for k, v in rs.items() if k.endswith("new policy"))
        lines += ["", "The same without timing noise (each request's drafting replayed against the model's answers to "
                      "the last 100 items, at the measured step costs; "
                      f"[replay](benchmarks/results/{replay.with_suffix('.md').name}), the policy before and "
                      f"after there): {said}."]
    png = PEERS.with_suffix(".png")
    if png.is_file():
        lines += ["", f"![per-item speed-up and tokens per step](benchmarks/results/{png.name})"]
    lines += ["", f"Reproduce: `{r['command']}` (in the vLLM virtualenv)"]
    return "\n".join(lines)


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


def main() -> None:
    res = RESULTS
    parts = [engine_section(p) for p in sorted(res.glob("bench_*.json"))]
    parts += [propose_section(p) for p in sorted(res.glob("propose_*.json"))]
    parts += [retrieval_section(p) for p in sorted(res.glob("retrieval_*.json"))]
    parts += [integrations_section(p) for p in sorted(res.glob("integrations_*.json"))]
    parts += [cache_section(p) for p in sorted(res.glob("cache_multiturn_*.json"))]
    parts += [coupling_section(p) for p in sorted(res.glob("coupling_*.json"))]
    parts += [vllm_section(p) for p in sorted(res.glob("vllm_cpu_*.json")) if not p.stem.endswith("_rerun")]
    # the busy smoke run shows the script works, its speeds compare nothing (its own note says so)
    parts += [serve_section(p) for p in sorted(res.glob("serve_*.json")) if not p.stem.endswith("_busy")]
    _replace(RESULTS / "README.md", START, END, "\n\n".join(parts))
    _replace(ROOT / "README.md", SUMMARY_START, SUMMARY_END, summary_section())


if __name__ == "__main__":
    main()
