"""What a request pays before its first token for its references, and whether a 10-token answer is slower.

    python benchmarks/setup_cost.py --out benchmarks/results/setup_cost_cpu_smollm2

For references of 1k, 10k and 100k tokens (MS-MARCO sample passages joined as text, as a RAG
application passes them): the time to tokenise them (``encode_references``) and to build the
request's drafters (reference suffix array, prompt-lookup and n-gram indexes over a ~1,300-token
RAG prompt), each the median of 5, in milliseconds and in plain decoding steps of that prompt.
Then, end to end, a 10-token answer of that prompt: ``generate_greedy`` (the model's own
``generate``), ours without references, and ours with each reference size, median of 5
interleaved runs in one process (warm: the cost curve was measured at load). The decoder tokenises
and indexes references on a thread while the prefill runs; the last column is what the first token
still waited for them after the prefill (median). Each reference is new to the decoder (its cache of
tokenised texts emptied before the run), and "seen before" the same text again (an earlier request
passed it: the next turn of a conversation, a document many questions retrieve): tokenised once.

Then the first token of a short prompt (the question alone): a prefill far shorter than the
references' set-up, as on a GPU. Time to the first streamed piece and to the end, greedy (the
model's own ``generate`` streamed) against ours with each reference size. ``--threads 1`` leaves
the second core to the set-up thread, as a GPU leaves the host's cores free.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from rag_accel import ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.drafters import build_drafters


def _median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--new", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/setup_cost"))
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    dec = ReferenceDecoder.from_pretrained(args.model)
    items = load_msmarco_sample(with_answers=True)
    item = items[-1]  # an item the defaults were not tuned on
    prompt = dec.encode_prompt(rag_messages(item.query, item.passages))
    pool = [p for it in items for p in it.passages]
    refs: dict[int, str] = {}
    for n in (int(s) for s in args.sizes.split(",")):
        text, k = "", 0
        while len(dec.tokenizer(text, add_special_tokens=False)["input_ids"]) < n:
            text += " ".join(pool[k % len(pool)] for k in range(k, k + 50)) + " "
            k += 50
        ids = dec.tokenizer(text, add_special_tokens=False)["input_ids"][:n]
        refs[n] = dec.tokenizer.decode(ids)
    # a plain step at this prompt: greedy's time per later token, from a 1-token and a 17-token run
    t1 = _median_ms(lambda: dec.generate_greedy(prompt, max_new_tokens=1), 3)
    t17 = _median_ms(lambda: dec.generate_greedy(prompt, max_new_tokens=17), 3)
    step_ms = (t17 - t1) / 16
    rows = []
    for n, text in refs.items():
        encode_ms = _median_ms(lambda: dec.encode_references([text]), args.repeats)  # (uncached)
        ref_ids = dec.encode_references([text])
        build_ms = _median_ms(lambda: build_drafters(dec.config, list(prompt), ref_ids), args.repeats)
        rows.append({"reference_tokens": sum(len(r) for r in ref_ids), "encode_ms": encode_ms,
                     "build_drafters_ms": build_ms, "in_plain_steps": (encode_ms + build_ms) / step_ms})
    # end to end: a short answer
    runs: dict[str, list[float]] = {"greedy": [], "ours, no references": []}
    runs.update({f"ours, {n:,}-token reference{seen}": [] for n in refs for seen in ("", ", seen before")})
    waits: dict[str, list[float]] = {name: [] for name in runs if name != "greedy"}
    outputs: dict[str, list[int]] = {}
    for r in range(args.repeats):
        names = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in names:
            if ", seen before" in name:  # an earlier request passed the same text (untimed)
                dec.generate(prompt, references=[refs[_size(name)]], max_new_tokens=1)
            elif name != "greedy":
                dec.reference_tokens.clear()
            t0 = time.perf_counter()
            if name == "greedy":
                out = dec.generate_greedy(prompt, max_new_tokens=args.new)
            elif name == "ours, no references":
                out = dec.generate(prompt, max_new_tokens=args.new)
            else:
                out = dec.generate(prompt, references=[refs[_size(name)]], max_new_tokens=args.new)
            runs[name].append(time.perf_counter() - t0)
            if name in waits:
                waits[name].append(out.stats.setup_wait_s)
            outputs.setdefault(name, out.token_ids)
    first = _first_token(dec, dec.encode_prompt([{"role": "user", "content": item.query}]), refs, args)
    greedy_s = statistics.median(runs["greedy"])
    e2e = [{"method": m, "median_s": statistics.median(v), "vs_greedy": greedy_s / statistics.median(v),
            "identical": outputs[m] == outputs["greedy"],
            "setup_wait_ms": 1000 * statistics.median(waits[m]) if m in waits else None} for m, v in runs.items()]
    env = {"model": args.model, "device": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "load_before": load_before,
           "load_after": os.getloadavg(), "prompt_tokens": len(prompt), "item": item.id, "plain_step_ms": step_ms}
    threads = "" if args.threads is None else f" --threads {args.threads}"
    command = f"python benchmarks/setup_cost.py --sizes {args.sizes} --new {args.new} --repeats {args.repeats}" \
              f"{threads} --out {args.out}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command, "setup": rows,
                                                         "short_answer": e2e, "short_prompt": first}, indent=1))
    lines = [f"# Per-request set-up against reference size, and a {args.new}-token answer", "",
             f"- command: `{command}`",
             f"- {env['model']} float32 on {env['device']} ({env['threads']} threads), torch {env['torch']}, "
             f"{env['date']}; machine load (1/5/15 min) before {load_before}, after {env['load_after']}",
             f"- prompt: item {item.id}, {len(prompt)} tokens; a plain step there: {step_ms:.1f} ms", "",
             "| reference tokens | tokenise (ms) | build drafters (ms) | together, in plain steps |",
             "|---|---|---|---|"]
    lines += [f"| {r['reference_tokens']:,} | {r['encode_ms']:.1f} | {r['build_drafters_ms']:.1f} | "
              f"{r['in_plain_steps']:.2f} |" for r in rows]
    lines += ["", f"A {args.new}-token answer, end to end (median of {args.repeats} interleaved runs):", "",
              "| method | median (s) | vs greedy | identical to greedy | first token waited for set-up (ms) |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['median_s']:.3f} | {r['vs_greedy']:.3f}x | {r['identical']} | "
              + ("-" if r["setup_wait_ms"] is None else f"{r['setup_wait_ms']:.1f}") + " |" for r in e2e]
    lines += ["", f"A short prompt ({first['prompt_tokens']} tokens: the question alone), a {args.new}-token answer "
              f"(median of {args.repeats} interleaved runs):", "",
              "| method | first token (s) | first token vs greedy | end (s) | end vs greedy | identical | "
              "waited for set-up (ms) |", "|---|---|---|---|---|---|---|"]
    g = first["rows"][0]
    lines += [f"| {r['method']} | {r['first_s']:.3f} | {g['first_s'] / r['first_s']:.3f}x | {r['end_s']:.3f} | "
              f"{g['end_s'] / r['end_s']:.3f}x | {r['identical']} | "
              + ("-" if r["setup_wait_ms"] is None else f"{r['setup_wait_ms']:.1f}") + " |" for r in first["rows"]]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _size(method: str) -> int:
    """The reference size a method's name gives ("ours, 1,000-token reference[, seen before]")."""
    return int(method.split(", ")[1].split("-")[0].replace(",", ""))


def _first_token(dec: ReferenceDecoder, prompt: list[int], refs: dict[int, str], args: argparse.Namespace) -> dict:
    """Time to the first streamed piece and to the end of a short prompt's answer, greedy against
    ours with each reference size (interleaved, median of ``args.repeats``)."""
    from threading import Thread

    from transformers import TextIteratorStreamer

    def greedy() -> tuple[float, float, list[int], None]:
        streamer = TextIteratorStreamer(dec.tokenizer, skip_prompt=True)
        x = torch.tensor([prompt])
        box: dict = {}
        t0 = time.perf_counter()
        th = Thread(target=lambda: box.update(out=dec.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.new, streamer=streamer)))
        th.start()
        first = None
        for piece in streamer:
            if piece and first is None:
                first = time.perf_counter() - t0
        th.join()
        return first, time.perf_counter() - t0, box["out"][0, len(prompt):].tolist(), None

    def ours(text: str) -> tuple[float, float, list[int], float]:
        dec.reference_tokens.clear()  # (new to the decoder)
        t0 = time.perf_counter()
        stream = dec.stream(prompt, references=[text], max_new_tokens=args.new)
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        return first, time.perf_counter() - t0, stream.output.token_ids, stream.output.stats.setup_wait_s

    methods = {"greedy": greedy, **{f"ours, {n:,}-token reference": (lambda t=t: ours(t)) for n, t in refs.items()}}
    got: dict[str, list] = {m: [] for m in methods}
    for r in range(args.repeats):
        for m in (list(methods) if r % 2 == 0 else list(reversed(methods))):
            got[m].append(methods[m]())
    want = got["greedy"][0][2]
    rows = [{"method": m, "first_s": statistics.median(g[0] for g in v), "end_s": statistics.median(g[1] for g in v),
             "identical": all(g[2] == want for g in v),
             "setup_wait_ms": None if m == "greedy" else 1000 * statistics.median(g[3] for g in v)}
            for m, v in got.items()]
    return {"prompt_tokens": len(prompt), "rows": rows}


if __name__ == "__main__":
    main()
