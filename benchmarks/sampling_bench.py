"""Sampling with copy drafts on the MS-MARCO sample: speed against the model's own sampling.

    python benchmarks/sampling_bench.py --items 20 --max-new-tokens 128 --temperature 0.7 --top-p 0.9 \
        --out benchmarks/results/sampling_cpu_smollm2

Per item, after a warm-up, in rotating order:

* ``hf-sample``: ``model.generate(do_sample=True, temperature, top_p)``, what a user runs today;
* ``plain``: our sampler with no drafts and seed = item index;
* ``ours``: our sampler with the passages as references, same seed.

``ours`` and ``plain`` must give the same tokens (a seeded output does not depend on the
drafts), so their times compare directly; ``hf-sample`` draws its own random numbers and its
answers have other lengths, so it is compared by time per token (prefill included).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from rag_accel import DEFAULT_MODEL, ReferenceDecoder
from rag_accel.bench.harness import environment
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sampling_cpu_smollm2"))
    a = ap.parse_args()
    dec = ReferenceDecoder.from_pretrained(DEFAULT_MODEL, device="cpu", dtype="float32")
    items = load_msmarco_sample(with_answers=True, limit=a.items)
    settings = {"temperature": a.temperature, "top_p": a.top_p, "top_k": 50}  # top_k: generate()'s default, explicit

    def hf(ids, seed, item):
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = dec.model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                     max_new_tokens=a.max_new_tokens, **settings)
        return out[0, len(ids):].tolist(), None

    def ours(drafts):
        def run(ids, seed, item):
            out = dec.generate(ids, references=item.passages if drafts else None, drafters=None if drafts else [],
                               max_new_tokens=a.max_new_tokens, do_sample=True, seed=seed,
                               **settings)
            return out.token_ids, out.stats
        return run

    methods = {"hf-sample": hf, "plain": ours(False), "ours": ours(True)}

    def per_token(r, baseline):
        """Time per token of ``baseline`` over ours: HF samples other tokens, so lengths differ."""
        return (r[f"{baseline}_s"] / r[f"{baseline}_tokens"]) / (r["ours_s"] / r["ours_tokens"])
    prompts = [dec.encode_prompt(rag_messages(it.query, it.passages)) for it in items]
    for m in methods.values():  # warm-up (and the cost curve)
        m(prompts[0], 0, items[0])
    rows = []
    for i, (it, ids) in enumerate(zip(items, prompts)):
        names = list(methods)[i % 3:] + list(methods)[: i % 3]
        got = {}
        for name in names:
            t0 = time.perf_counter()
            toks, stats = methods[name](ids, i, it)
            got[name] = (toks, stats, time.perf_counter() - t0)
        rows.append({"id": it.id, **{f"{n}_s": got[n][2] for n in methods},
                     **{f"{n}_tokens": len(got[n][0]) for n in methods},
                     "new_tokens": len(got["ours"][0]), "steps": got["ours"][1].steps,
                     "identical_to_plain": got["ours"][0] == got["plain"][0]})
        print(f"{i + 1}/{len(items)} {it.id}: {per_token(rows[-1], 'hf-sample'):.2f}x per token vs HF sampling, "
              f"{rows[-1]['new_tokens'] / rows[-1]['steps']:.2f} tokens/step", file=sys.stderr)

    def geo(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    summary = {
        "per_token_speedup_vs_hf_sample_geomean": geo([per_token(r, "hf-sample") for r in rows]),
        "per_token_speedup_vs_hf_sample_worst": min(per_token(r, "hf-sample") for r in rows),
        "speedup_vs_plain_geomean": geo([r["plain_s"] / r["ours_s"] for r in rows]),  # same tokens: time ratio
        "speedup_vs_plain_worst": min(r["plain_s"] / r["ours_s"] for r in rows),
        "tokens_per_step": sum(r["new_tokens"] for r in rows) / sum(r["steps"] for r in rows),
        "identical_to_plain_rate": sum(r["identical_to_plain"] for r in rows) / len(rows),
    }
    cmd = "python benchmarks/sampling_bench.py " + shlex.join(sys.argv[1:])
    env = environment(dec, DEFAULT_MODEL)
    result = {"environment": env, "command": cmd, "items": len(items), "max_new_tokens": a.max_new_tokens,
              "settings": settings, "summary": summary, "per_item": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    s = summary
    md = (f"# Sampling with copy drafts ({env['device']}, {env['model']}, {env['dtype']}, {env['date']})\n\n"
          f"{len(items)} MS-MARCO items, {a.max_new_tokens} new tokens, "
          f"temperature {a.temperature}, top-p {a.top_p}, top-k 50.\n\n"
          "| measure | value |\n|---|---|\n"
          f"| time per token: HF `generate(do_sample=True)` / ours (geo-mean) | "
          f"{s['per_token_speedup_vs_hf_sample_geomean']:.2f}x |\n"
          f"| same, worst item | {s['per_token_speedup_vs_hf_sample_worst']:.2f}x |\n"
          f"| speed-up vs our sampler without drafts (same seed, same tokens; geo-mean) | "
          f"{s['speedup_vs_plain_geomean']:.2f}x |\n"
          f"| same, worst item | {s['speedup_vs_plain_worst']:.2f}x |\n"
          f"| tokens per forward pass | {s['tokens_per_step']:.2f} |\n"
          f"| same tokens as without drafts (same seed) | {s['identical_to_plain_rate']:.0%} |\n\n"
          f"Command: `{cmd}`\n")
    a.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
