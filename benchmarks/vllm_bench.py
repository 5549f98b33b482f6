"""vLLM on this machine: plain greedy, vLLM's own n-gram speculation, and our proposer.

    python benchmarks/vllm_bench.py --out benchmarks/results/vllm_cpu_smollm2

Same MS-MARCO items (bundled sample), chat prompts of the retrieved passages, greedy,
``--new`` tokens, float32, ``enforce_eager``, prefix caching off (a repeated prompt must
not skip its prefill for one method and not another). One engine per method, one after
the other:

* ``vllm-greedy``: no speculation (the baseline every output is compared with);
* ``vllm-ngram``: ``{"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_min": 2,
  "prompt_lookup_max": 4}`` (drafts from the prompt only);
* ``vllm-ours``: :class:`rag_accel.vllm.RagProposer`, up to 10 tokens, the passages as references.

Measured: latency per request at concurrency 1; throughput (new tokens / wall time over all
requests) with 4 and 16 requests in flight (``generate_batch`` on groups of that size);
the identical-output rate against vllm-greedy (same concurrency); tokens per step
(new tokens / (new tokens - accepted draft tokens), per request: each step of a request
adds its accepted tokens and one of its own). Accepted counts: vLLM's spec-decode metrics.

``reworded``: the references are NOT in the prompt. Each question is answered once by
vllm-greedy (the cached answer), then asked reworded ("Could you tell me: <q>?"); vllm-ours
gets the passages and that cached answer as references, vLLM's n-gram sees only the prompt.

The machine is shared: ``uptime`` is recorded before and after each method.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

K = 10
METHODS = ("vllm-greedy", "vllm-ngram", "vllm-ours")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def spec_counters(llm) -> tuple[int, int]:
    found = {m.name: m.value for m in llm.get_metrics() if m.name in (
        "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
    return (int(found.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(found.get("vllm:spec_decode_num_accepted_tokens", 0)))


def make_decoder(method: str, max_model_len: int):
    from vllm import LLM

    from rag_accel.models import default_model_path
    from rag_accel.vllm import VllmDecoder

    engine = dict(max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=False,
                  disable_log_stats=False)
    if method == "vllm-ours":
        return VllmDecoder.from_pretrained("smollm2-135m-instruct", max_draft_tokens=K, **engine)
    spec = None
    if method == "vllm-ngram":
        spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(model=str(default_model_path()), dtype="float32", seed=0, speculative_config=spec, **engine)
    return VllmDecoder(llm)


def shutdown(dec) -> None:
    dec.close()
    del dec
    gc.collect()


def run_groups(dec, groups, new, ours):
    """``run_group`` over (prompts, refs) groups one after another: (outputs, times, drafted, accepted)."""
    outs, times, dr, ac = [], [], 0, 0
    for prompts, refs in groups:
        o, dt, d, a = run_group(dec, prompts, refs, new, ours)
        outs += o
        times.append(dt)
        dr, ac = dr + d, ac + a
    return outs, times, dr, ac


def run_group(dec, prompts, refs, new, ours):
    """One generate_batch; returns (outputs, wall seconds, drafted, accepted)."""
    d0, a0 = spec_counters(dec.llm)
    t0 = time.perf_counter()
    outs = dec.generate_batch(prompts, refs if ours else None, max_new_tokens=new)
    dt = time.perf_counter() - t0
    d1, a1 = spec_counters(dec.llm)
    return outs, dt, d1 - d0, a1 - a0


def summarise(outs, times, drafted, accepted, baseline):
    tokens = sum(len(o.token_ids) for o in outs)
    res = dict(requests=len(outs), new_tokens=tokens, wall_s=round(sum(times), 3),
               tokens_per_s=round(tokens / sum(times), 2) if sum(times) else None,
               drafted=drafted, accepted=accepted,
               tokens_per_step=round(tokens / max(1, tokens - accepted), 3))
    if baseline is not None:
        same = sum(o.token_ids == b for o, b in zip(outs, baseline))
        res["identical"] = f"{same}/{len(outs)}"
        res["identical_rate"] = same / len(outs)
    return res


def bench_method(method, items, args, baselines, cached):
    from rag_accel.rag.msmarco import rag_messages

    ours = method == "vllm-ours"
    r: dict = {"uptime_before": uptime()}
    t0 = time.perf_counter()
    dec = make_decoder(method, args.max_model_len)
    r["engine_start_s"] = round(time.perf_counter() - t0, 1)
    prompts = [rag_messages(it.query, it.passages) for it in items]
    refs = [it.passages for it in items]
    dec.generate(prompts[0], refs[0] if ours else None, max_new_tokens=8)  # warm-up
    out: dict = {}
    # concurrency 1: latency per request
    outs, times, dr, ac = run_groups(dec, [(prompts[i:i + 1], refs[i:i + 1]) for i in range(args.items_c1)],
                                     args.new, ours)
    s = summarise(outs, times, dr, ac, baselines.get("c1"))
    s["latency_s"] = round(sum(times) / len(times), 3)
    s["latency_per_request_s"] = [round(t, 3) for t in times]
    out["c1"] = s
    if method == "vllm-greedy":
        baselines["c1"] = [o.token_ids for o in outs]
        cached.extend(o.text for o in outs)
    print(method, "c1", s, flush=True)
    # throughput with C in flight
    for c in args.conc:
        n = args.items_c16 if c >= 16 else args.items_c4
        outs, times, dr, ac = run_groups(dec, [(prompts[g:g + c][:n - g], refs[g:g + c][:n - g])
                                               for g in range(0, n, c)], args.new, ours)
        key = f"c{c}"
        s = summarise(outs, times, dr, ac, baselines.get(key))
        out[key] = s
        if method == "vllm-greedy":
            baselines[key] = [o.token_ids for o in outs]
        print(method, key, s, flush=True)
    # references not in the prompt: a reworded question, the cached answer of the original
    if args.reworded:
        n = min(args.reworded, len(cached))
        rp = [rag_messages(f"Could you tell me: {it.query}?", it.passages) for it in items[:n]]
        rr = [list(it.passages) + [cached[i]] for i, it in enumerate(items[:n])]
        outs, times, dr, ac = run_groups(dec, [(rp[i:i + 1], rr[i:i + 1]) for i in range(n)], args.new, ours)
        s = summarise(outs, times, dr, ac, baselines.get("reworded"))
        s["latency_s"] = round(sum(times) / len(times), 3)
        out["reworded_c1"] = s
        if method == "vllm-greedy":
            baselines["reworded"] = [o.token_ids for o in outs]
        print(method, "reworded", s, flush=True)
    if ours:
        stats = dec.generate(prompts[0], refs[0], max_new_tokens=args.new).stats
        r["by_drafter_item0"] = stats.by_drafter
    shutdown(dec)
    r.update(out)
    r["uptime_after"] = uptime()
    return r


def write_md(res, path):
    rows = ["| method | latency c=1 (s) | tok/s c=1 | tok/s c=4 | tok/s c=16 | identical c=1 / c=4 / c=16 | "
            "tokens/step c=1 | reworded: latency (s) | reworded: tokens/step | reworded identical |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in res["methods"].items():
        c1, c4, c16, rw = (r.get(k, {}) for k in ("c1", "c4", "c16", "reworded_c1"))
        ident = " / ".join(x.get("identical", "-") for x in (c1, c4, c16))
        rows.append(f"| {m} | {c1.get('latency_s', '-')} | {c1.get('tokens_per_s', '-')} | {c4.get('tokens_per_s', '-')} | "
                    f"{c16.get('tokens_per_s', '-')} | {ident} | {c1.get('tokens_per_step', '-')} | "
                    f"{rw.get('latency_s', '-')} | {rw.get('tokens_per_step', '-')} | {rw.get('identical', '-')} |")
    loads = [f"- {m}: before `{r['uptime_before']}`, after `{r['uptime_after']}`" for m, r in res["methods"].items()]
    text = "\n".join([
        f"# vLLM on CPU: greedy vs vLLM n-gram vs rag_accel proposer ({res['model']})", "",
        f"- date: {res['date']}", f"- device: {res['device']}", f"- command: `{res['command']}`",
        f"- env: {json.dumps(res['env'])}",
        f"- items: c=1 {res['args']['items_c1']}, c=4 {res['args']['items_c4']}, c=16 {res['args']['items_c16']}, "
        f"reworded {res['args']['reworded']}; {res['args']['new']} new tokens, float32, greedy, prefix caching off",
        f"- status: {res['status']}", "", *rows, "",
        "Machine load (`uptime`; 2 shared cores: other engineers' jobs ran beside this, timings are busy-machine timings):",
        *loads, "", res.get("notes", ""), ""])
    Path(path).write_text(text)


def write_png(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ms = list(res["methods"])
    keys = [("c1", "tok/s c=1"), ("c4", "tok/s c=4"), ("c16", "tok/s c=16"), ("reworded_c1", "tok/s reworded c=1")]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / max(1, len(ms))
    for j, m in enumerate(ms):
        vals = [res["methods"][m].get(k, {}).get("tokens_per_s") or 0 for k, _ in keys]
        ax.bar([i + j * w for i in range(len(keys))], vals, w, label=m)
    ax.set_xticks([i + w * (len(ms) - 1) / 2 for i in range(len(keys))], [lbl for _, lbl in keys])
    ax.set_ylabel("new tokens / s")
    ax.set_title(f"vLLM CPU, {res['model']}, float32 ({res['status']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items-c1", type=int, default=6)
    ap.add_argument("--items-c4", type=int, default=8)
    ap.add_argument("--items-c16", type=int, default=16)
    ap.add_argument("--conc", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--reworded", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--out", default="benchmarks/results/vllm_cpu_smollm2")
    args = ap.parse_args()
    if args.methods[0] != "vllm-greedy":
        ap.error("vllm-greedy must run first (it is the baseline of the identical-output rates)")
    from rag_accel.bench.harness import VLLM_ENV_RECORDED, peer_environment
    from rag_accel.rag.msmarco import load_msmarco_sample

    peer_environment()  # (before the record below, and before make_decoder starts any engine)

    n = max(args.items_c1, args.items_c4, args.items_c16, args.reworded)
    items = load_msmarco_sample(limit=n)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
           "model": "SmolLM2-135M-Instruct float32",
           "command": "python " + " ".join(sys.argv),
           "env": {k: os.environ.get(k) for k in VLLM_ENV_RECORDED},
           "args": vars(args), "methods": {}, "status": "partial (running)"}
    baselines: dict = {}
    cached: list[str] = []
    for m in args.methods:
        res["methods"][m] = bench_method(m, items, args, baselines, cached)
        res["status"] = "partial: " + ", ".join(res["methods"]) + " done"
        Path(args.out + ".json").write_text(json.dumps(res, indent=1))
        write_md(res, args.out + ".md")
    res["status"] = "complete"
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    write_md(res, args.out + ".md")
    write_png(res, args.out + ".png")


if __name__ == "__main__":
    main()
