"""Does one client's big reference stall the others? Latency of small requests through HTTP, alone and
while another client keeps sending the largest references the server accepts.

    python benchmarks/experiments/reference_stall_bench.py --python .venv-vllm/bin/python \\
        --out benchmarks/results/reference_stall_cpu_smollm2

One ``rag-accel serve`` server (our proposer, float32, ``--enforce-eager``, prefix caching off so that a
prompt repeated in a later phase is computed again, its default
``--max-reference-tokens`` 32,768). The small requests: MS-MARCO sample items (question + passages,
the passages as references), ``--new`` tokens, one at a time from one client. Phases:

1. ``alone``: the small requests with nothing else running (their median is the yardstick);
2. ``text``: the same, while a second client sends, back to back, requests whose reference is
   text of 8 x 32,768 = 262,144 characters (the most that passes admission; it tokenises to ~60k
   tokens, over the limit, so the worker drops it after tokenising: the worst work a client can make
   the server do per request);
3. ``ids``: the same, while the second client sends 32,768 reference token ids (the most accepted;
   indexed and used);
(and ``plain`` after ``alone``: the same second client without references, so that what concurrency
itself costs on 2 cores is told apart from what references cost);
4. ``alone_again``: as 1, after the loaded phases (the yardstick is both alone phases' mean median);
5. ``refused``: an 8 MB text reference is answered HTTP 400 (time to the refusal).

Target (issue 26): every small request under load takes at most 2x the unloaded median.
The second client's requests ask for 8 new tokens. Machine load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

MODEL = "smollm2-135m-instruct"
LIMIT = 32_768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter with vLLM (the server's)")
    ap.add_argument("--items", type=int, default=12)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import openai

    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
    from rag_accel.serving.server_process import Server

    items = load_msmarco_sample(limit=args.items)
    rng = random.Random(0)
    words = " ".join(it.passages[0] for it in load_msmarco_sample(limit=60)).split()
    big_text = ""
    while len(big_text) < 8 * LIMIT:
        big_text += " ".join(rng.sample(words, 200)) + " "
    big_text = big_text[:8 * LIMIT]
    big_ids = json.dumps([[rng.randrange(100, 40_000) for _ in range(LIMIT)]])
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
    load_before = [round(x, 2) for x in os.getloadavg()]
    result: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": MODEL,
                    "device": f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
                    "command": " ".join(["python", *sys.argv]), "items": args.items, "new_tokens": args.new,
                    "max_reference_tokens": LIMIT, "load_before": load_before, "phases": {}}
    with Server(MODEL, options=["--max-model-len", "4096"], vllm_args=["--enforce-eager", "--no-enable-prefix-caching"],
                python=args.python,
                env=env) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", timeout=600)

        def small(it):
            t0 = time.perf_counter()
            client.chat.completions.create(model=MODEL, messages=rag_messages(it.query, it.passages),
                                           max_tokens=args.new, temperature=0,
                                           extra_body={"vllm_xargs": {"references": it.passages}})
            return time.perf_counter() - t0

        def phase(name, xargs):
            stop, sent, big_s = threading.Event(), [0], []

            def hammer():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=8, temperature=0, extra_body={"vllm_xargs": xargs})
                    big_s.append(time.perf_counter() - t0)
                    sent[0] += 1

            worker = threading.Thread(target=hammer) if xargs else None
            if worker:
                worker.start()
                time.sleep(1.0)
            lat = [small(it) for it in items]
            stop.set()
            if worker:
                worker.join()
            result["phases"][name] = {"latency_s": [round(x, 3) for x in lat],
                                      "median_s": round(statistics.median(lat), 3), "max_s": round(max(lat), 3),
                                      "big_requests": sent[0],
                                      "big_median_s": round(statistics.median(big_s), 3) if big_s else None}
            print(name, result["phases"][name]["median_s"], result["phases"][name]["max_s"], sent[0], flush=True)

        small(items[0])  # warm-up (untimed)
        phase("alone", None)
        phase("plain", {"speculate": 1})  # the same second client without references: what concurrency alone costs
        phase("text", {"references": [big_text]})
        phase("ids", {"reference_ids": big_ids})
        phase("alone_again", None)  # brackets the loaded phases: drift of the machine shows here
        t0 = time.perf_counter()
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           extra_body={"vllm_xargs": {"references": ["x" * 8_000_000]}})
            refused = None
        except openai.BadRequestError as e:
            refused = {"status": 400, "seconds": round(time.perf_counter() - t0, 3), "message": str(e)[:300]}
        result["refused_8mb"] = refused
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    ph = result["phases"]
    alone = statistics.mean([ph[p]["median_s"] for p in ("alone", "alone_again")])
    result["alone_median_s"] = round(alone, 3)
    own = [statistics.mean(x) for x in zip(ph["alone"]["latency_s"], ph["alone_again"]["latency_s"])]
    for name in ("plain", "text", "ids"):
        ph[name]["worst_vs_alone_median"] = round(ph[name]["max_s"] / alone, 2)
        # each small request against its own unloaded time (the mean of its two alone runs)
        ph[name]["worst_vs_own_alone"] = round(max(t / o for t, o in zip(ph[name]["latency_s"], own)), 2)
    write(result, Path(args.out))


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    ph = result["phases"]
    lines = [f"# Small requests while another client sends the largest references ({result['date']})", "",
             f"{result['device']}, {result['model']} float32, `rag-accel serve` (ours, --max-reference-tokens "
             f"{result['max_reference_tokens']}), {result['items']} small requests x {result['new_tokens']} tokens, "
             f"one at a time. Load before/after: {result['load_before']} / {result['load_after']}.", "",
             f"Command: `{result['command']}`", "",
             "| phase | the other client sends | small requests: median s | max s | max / alone median (both alone "
             "phases' mean) | worst request / its own alone time | "
             "big requests sent |", "|---|---|---|---|---|---|---|"]
    what = {"alone": "nothing", "alone_again": "nothing (after the loaded phases)",
            "plain": "the same short requests without references (concurrency alone)", "text": "262,144-character text references (tokenised, then over the limit)",
            "ids": "32,768 reference token ids"}
    for name, p in ph.items():
        ratio = p.get("worst_vs_alone_median", "")
        lines.append(f"| {name} | {what[name]} | {p['median_s']} | {p['max_s']} | {ratio} | "
                     f"{p.get('worst_vs_own_alone', '')} | {p['big_requests']} |")
    ref = result.get("refused_8mb")
    lines += ["", f"An 8 MB text reference: {'HTTP 400 in ' + str(ref['seconds']) + ' s' if ref else 'NOT refused'}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.boxplot([p["latency_s"] for p in ph.values()], tick_labels=list(ph))
    ax.axhline(2 * result["alone_median_s"], ls="--", color="grey", label="2x alone median (target)")
    ax.set_ylabel("small request latency (s)")
    ax.set_title("Small requests beside the largest accepted references")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
