"""Two values of one DecoderConfig option on ONE engine, request by request (A/B without the engine spread).

    python benchmarks/config_ab.py --option max_loss --values 0.03,0.1 --items 48 \\
        --out benchmarks/results/config_ab_vllm_cpu_smollm2_max_loss
    python benchmarks/config_ab.py --option cached_answer --values '"reference","answers"' --items 48 --reworded \\
        --out benchmarks/results/config_ab_vllm_cpu_smollm2_cached_answer
    python benchmarks/config_ab.py --option memory_scope --values 'null,"bench"' --items 48 \\
        --out benchmarks/results/config_ab_vllm_cpu_smollm2_memory
    python benchmarks/config_ab.py --option drafters \\
        --values '["reference","prompt_lookup","ngram"];["reference","frequency"]' --items 48 \\
        --out benchmarks/results/config_ab_vllm_cpu_smollm2_frequency
    python benchmarks/config_ab.py --plot benchmarks/results/config_ab_vllm_cpu_smollm2_memory.json

The committed ``min_gain`` and ``reference_choice`` runs were made with options that left DecoderConfig in issue 55
(commit 21143c8 still runs them).

(vLLM runs in the vLLM virtualenv, ``--engine hf`` and ``--plot`` in the main one: it has matplotlib). Two engines
built in one process on this 2-core CPU differ by up to 8% (``benchmarks/results/inflight_vllm_cpu_smollm2_memory_control.md``), more
than a policy change moves: comparing two values of an option on two engines measures the engines. Here one
``vllm-ours`` engine runs both values, the option passed per request (``config=``, what a client sends as
``extra_args["rag_accel"]``), the values' order alternating per item (``--in-flight N``: per group of N
requests, all N in flight with one value, then with the other). A ``vllm-greedy`` engine (a spare engine built
and closed first, so neither is the process's first) runs each item too: every output is compared with it,
token for token, and its time gives the ratios against greedy, the same for both values. The learnt acceptance
rates are the engine's, shared by both values' requests, as a server's are. ``--engine hf``: the same on
transformers, one :class:`~rag_accel.ReferenceDecoder` against ``model.generate(do_sample=False)``.
``--option memory_scope`` (vLLM only) is no DecoderConfig field but the request's memory scope
(``extra_args["memory_scope"]``): ``null`` drafts without the memory of earlier answers, a name with it,
the named scope holding that value's earlier answers only. ``--option cached_answer`` (with ``--reworded``) is
where the client puts its cached answer: ``"reference"`` among the references (drafted as a passage), ``"answers"``
in ``answers=`` (drafted as the memory of answers drafts).

Judged on the sample's last items (no default was tuned on them); per item, new tokens over wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_value(text: str) -> object:
    return json.loads(text)  # 0.02 -> float, 4 -> int, true -> bool, ["reference", "frequency"] -> a list


def split_values(text: str) -> list[object]:
    """``--values``: two JSON values, split at ``;`` if there is one (lists hold commas), else at ``,``.

    Example:
        >>> split_values("0.1,0.02")
        [0.1, 0.02]
        >>> split_values('["reference", "ngram"];["frequency"]')
        [['reference', 'ngram'], ['frequency']]
    """
    values = [parse_value(v) for v in text.split(";" if ";" in text else ",")]
    if len(values) != 2:
        raise SystemExit("--values takes two JSON values, separated by ',' (or ';' when they hold commas)")
    return values


def vllm_pair(args: argparse.Namespace):
    """``(encode, greedy(prompts), ours(prompts, refs, changes), close)`` on vLLM: two engines, a spare first."""
    from rag_accel_lab.inflight import make_engines

    engines = make_engines({"vllm-greedy": {"speculation": "off"}, "vllm-ours": {"speculation": "ours"}},
                           args.model, args.k, 4096, spare_first=True)
    greedy, ours = engines["vllm-greedy"], engines["vllm-ours"]

    def close() -> None:
        for e in engines.values():
            e.close()

    return (greedy.encode_prompt,
            lambda prompts: [o.token_ids for o in greedy.generate_batch(prompts, max_new_tokens=args.max_new_tokens)],
            lambda prompts, refs, changes: batch(scoped(ours, changes), *placed(prompts, refs, changes),
                                                 max_new_tokens=args.max_new_tokens, config=changes),
            close)


def batch(decoder, prompts: list, refs: list, answers: list, **kwargs):
    return decoder.generate_batch(prompts, refs, answers=answers, **kwargs)


def scoped(decoder, changes: dict):
    """``decoder`` with its requests in the memory scope ``changes`` names (``--option memory_scope``: the
    request's scope, not a config field, so it leaves ``changes``); any other option leaves it as it is."""
    if "memory_scope" in changes:
        from rag_accel.memory import check_scope

        scope = changes.pop("memory_scope")
        decoder.memory_scope = None if scope is None else check_scope(scope)
    return decoder


def placed(prompts: list, refs: list, changes: dict) -> tuple[list, list, list]:
    """``(prompts, references, answers)``: ``--option cached_answer`` (the reworded case) places each
    request's cached answer, the last of its references, among them (``"reference"``) or in ``answers=``
    (``"answers"``); it leaves ``changes``. Any other option leaves the references as they are."""
    where = changes.pop("cached_answer", "reference")
    if where == "reference":
        return prompts, refs, [None] * len(prompts)
    return prompts, [r[:-1] for r in refs], [r[-1:] for r in refs]


def hf_pair(args: argparse.Namespace):
    """The same on transformers in this process: ``model.generate(do_sample=False)`` and one
    :class:`~rag_accel.ReferenceDecoder` (its cost curve measured once), one request at a time."""
    import torch

    from rag_accel import DecoderConfig, ReferenceDecoder

    dec = ReferenceDecoder.from_pretrained(args.model, config=DecoderConfig(max_draft_tokens=args.k))

    def greedy(prompts):
        outs = []
        for ids in prompts:
            x = torch.tensor([ids], device=dec.device)
            with torch.inference_mode():
                out = dec.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                         max_new_tokens=args.max_new_tokens)
            outs.append(out[0, len(ids):].tolist())
        return outs

    def ours(prompts, refs, changes):
        return [dec.generate(p, r, answers=a, max_new_tokens=args.max_new_tokens, config=changes)
                for p, r, a in zip(*placed(prompts, refs, changes))]

    return dec.encode_prompt, greedy, ours, lambda: None


def run(args: argparse.Namespace) -> dict:
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    values = split_values(args.values)
    if args.chunk is not None and (args.reworded or not 0 < args.chunk <= 1):
        raise SystemExit("--chunk takes a share of each passage's words in (0, 1], and not with --reworded "
                         "(its prompts hold the whole passages)")
    if args.option == "cached_answer" and (not args.reworded or any(v not in ("reference", "answers")
                                                                     for v in values)):
        raise SystemExit('--option cached_answer takes --reworded and the values "reference" and "answers"')
    if args.engine == "hf" and args.option == "memory_scope":
        raise SystemExit("--option memory_scope is vLLM's memory of earlier answers: the transformers decoder has none")
    if args.engine == "hf" and args.in_flight != 1:
        raise SystemExit("--engine hf runs one request at a time: --in-flight 1")
    items = load_msmarco_sample()[-args.items:]
    encode, greedy, ours, close = (vllm_pair if args.engine == "vllm" else hf_pair)(args)
    prompts = [encode(rag_messages(it.query, it.passages)) for it in items]
    refs: list[list] = [list(it.passages) for it in items]
    load = os.getloadavg()[0]
    rows = []
    try:
        greedy(prompts[:1])  # untimed: each engine's first request
        ours(prompts[:1], refs[:1], {})
        if args.chunk is not None:  # the long-document case: chunks in the prompt, the whole documents as references
            from long_documents import chunk  # benchmarks/long_documents.py, beside this script

            prompts = [encode(rag_messages(it.query, [chunk(p, args.chunk) for p in it.passages])) for it in items]
        if args.reworded:  # the cached-answer case: greedy's answers (untimed) passed with the reworded questions
            from rag_accel.bench.harness import REWORDED

            answers = [a for start in range(0, len(items), 8) for a in greedy(prompts[start:start + 8])]
            prompts = [encode(rag_messages(REWORDED.format(query=it.query.rstrip("?")), it.passages)) for it in items]
            refs = [list(it.passages) + [list(a)] for it, a in zip(items, answers)]
        for g, start in enumerate(range(0, len(items), args.in_flight)):
            sl = slice(start, start + args.in_flight)
            order = values if g % 2 == 0 else values[::-1]
            t0 = time.perf_counter()
            base = greedy(prompts[sl])
            base_s = time.perf_counter() - t0
            row = {"group": g, "items": [it.id for it in items[sl]], "greedy_s": base_s,
                   "new_tokens": sum(len(b) for b in base), "order": order, "values": {}}
            for v in order:
                t0 = time.perf_counter()
                outs = ours(prompts[sl], refs[sl], {args.option: v})
                row["values"][json.dumps(v)] = {
                    "seconds": time.perf_counter() - t0, "steps": sum(o.stats.steps for o in outs),
                    "new_tokens": sum(len(o.token_ids) for o in outs),
                    "identical": sum(o.token_ids == b for o, b in zip(outs, base))}
            rows.append(row)
            print(f"group {g}: greedy {base_s:.2f}s " + " ".join(
                f"{k}={r['seconds']:.2f}s/{r['steps']} steps" for k, r in row["values"].items()), flush=True)
    finally:
        close()
    return {"command": "python benchmarks/config_ab.py " + shlex.join(sys.argv[1:]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "option": args.option,
            "reworded": args.reworded, "chunk": args.chunk,
            "values": [json.dumps(v) for v in values], "engine": args.engine, "in_flight": args.in_flight,
            "k": args.k, "max_new_tokens": args.max_new_tokens, "model": args.model,
            "environment": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_before": load,
                            "vllm_cpu_kvcache_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                            "device": "cpu", "dtype": "float32", "spare_engine_first": args.engine == "vllm"},
            "rows": rows}


def summarize(result: dict) -> dict:
    a, b = result["values"]
    out = {}
    for v in (a, b):
        rs = result["rows"]
        out[v] = {"vs_greedy": statistics.geometric_mean([r["greedy_s"] / r["values"][v]["seconds"] for r in rs]),
                  "tokens_per_step": sum(r["values"][v]["new_tokens"] for r in rs) / sum(
                      r["values"][v]["steps"] for r in rs),
                  "identical": sum(r["values"][v]["identical"] for r in rs),
                  "requests": sum(len(r["items"]) for r in rs)}
    ratios = [r["values"][a]["seconds"] / r["values"][b]["seconds"] for r in result["rows"]]
    out["b_over_a"] = {"geo_mean": statistics.geometric_mean(ratios), "b_faster": sum(x > 1 for x in ratios),
                       "groups": len(ratios), "worst": min(ratios), "best": max(ratios)}
    return out


def write(result: dict, out: Path) -> None:
    s = summarize(result)
    a, b = result["values"]
    env = result["environment"]
    engine = {"vllm": "vLLM", "hf": "transformers"}[result.get("engine", "vllm")]
    lines = [f"# `{result['option']}` = {a} against {b} on one {engine} engine, request by request", "",
             f"- command: `{result['command']}`; the plot: `python benchmarks/config_ab.py --plot {out}.json`",
             f"- {result['date']}; {result['model']}, float32, CPU ({env['cpus']} cores), {engine}; at most "
             f"{result['k']} draft tokens a step; {result['max_new_tokens']} new tokens; {result['in_flight']} "
             f"request(s) in flight; 1-minute load average when timing began {env['load_before']:.2f} (the engines' "
             f"start included; nothing else ran)"
             + ("; a spare engine built first" if env.get("spare_engine_first") else ""),
             "- one engine of ours runs both values (the option per request), their order alternating per group; "
             "greedy decoding (" + ("a vllm-greedy engine" if engine == "vLLM" else "`model.generate`")
             + ") runs each group too: the baseline of the outputs and of the ratios"]
    if result.get("chunk") is not None:
        lines += [f"- the long-document case (`--chunk`): the prompt holds the question and the first "
                  f"{result['chunk']:.0%} of each passage's words, the references the whole passages "
                  "(`benchmarks/long_documents.py`)"]
    if result.get("reworded"):
        lines += ["- the cached-answer case (`--reworded`): each question reworded (`harness.REWORDED`), the "
                  "passages in the prompt; the references the passages and greedy's answer to the question as "
                  "first asked (token ids, generated untimed before), which the prompt does not hold"]
    lines += ["",
             "| value | tokens/s against greedy (geo-mean over groups) | tokens/step | outputs identical to greedy |",
             "|---|---|---|---|"]
    lines += [f"| {v} | {s[v]['vs_greedy']:.3f}x | {s[v]['tokens_per_step']:.2f} | "
              f"{s[v]['identical']}/{s[v]['requests']} |" for v in (a, b)]
    r = s["b_over_a"]
    lines += ["", f"{b} against {a}, per group on the same engine: {r['geo_mean']:.3f}x (geo-mean), faster in "
                  f"{r['b_faster']} of {r['groups']}, from {r['worst']:.3f}x to {r['best']:.3f}x.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**result, "summary": s}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot(path: Path) -> None:
    """Per group: each value's speed-up against greedy, next to the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(9, 4))
    for v in result["values"]:
        ax.plot([r["greedy_s"] / r["values"][v]["seconds"] for r in result["rows"]], marker="o", lw=1,
                label=f"{result['option']} = {v}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("group (the sample's last items, in order)")
    ax.set_ylabel("tokens/s against greedy")
    engine = {"vllm": "vLLM", "hf": "transformers"}[result.get("engine", "vllm")]
    ax.set_title(f"{result['option']}: two values on one {engine} engine, {result['in_flight']} in flight", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--option", default="max_loss")
    ap.add_argument("--values", default="0.1,0.02",
                    help="two JSON values, comma-separated (semicolon-separated when they hold commas: lists)")
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--chunk", type=float, default=None,
                    help="the long-document case: this share of each passage's words in the prompt, the whole "
                         "passages as references")
    ap.add_argument("--reworded", action="store_true",
                    help="the cached-answer case: reworded questions, greedy's earlier answer as a reference")
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm",
                    help="hf: transformers in this process (ReferenceDecoder against model.generate)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/config_ab"))
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    ap.add_argument("--render", type=Path, default=None, help="rewrite a run's markdown from its JSON")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    if args.render is not None:
        result = json.loads(args.render.read_text())
        result.pop("summary", None)
        write(result, args.render.with_suffix(""))
        return
    write(run(args), args.out)


if __name__ == "__main__":
    main()
