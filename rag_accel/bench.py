"""Side-by-side benchmark: plain greedy, Hugging Face prompt lookup, and ours.

All methods run in one process on the same items, interleaved item by item
(the order rotates per item) after a warm-up, so machine noise hits all alike.
Forward passes are counted with a hook on the model, the same way for every
method, so "tokens per step" is comparable.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from .data import RagItem, rag_messages
from .decoder import ReferenceDecoder

# name -> DecoderConfig changes
OUR_METHODS: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours-fixed": {"adaptive": False, "max_draft_tokens": 10},
    "ours-ref": {"drafters": ("reference",)},
    "ours-pld": {"drafters": ("prompt_lookup",)},
    "ours-ngram": {"drafters": ("ngram",)},
}
BASELINES = ("greedy", "hf-pld")
ALL_METHODS = (*BASELINES, *OUR_METHODS)


@dataclass
class Run:
    method: str
    item: str
    seconds: float
    new_tokens: int
    steps: int
    identical: bool
    token_ids: list[int] = field(repr=False, default_factory=list)


class _ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def _runner(dec: ReferenceDecoder, method: str, max_new_tokens: int) -> Callable[[list[int], RagItem], list[int]]:
    model = dec.model
    if method in BASELINES:
        extra = {"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}

        def run_hf(ids: list[int], item: RagItem) -> list[int]:
            x = torch.tensor([ids], device=dec.device)
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=max_new_tokens, **extra)
            return out[0, len(ids):].tolist()

        return run_hf
    if method not in OUR_METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(ALL_METHODS)}")
    cfg = dec.config.replace(**OUR_METHODS[method])

    def run_ours(ids: list[int], item: RagItem) -> list[int]:
        return dec.generate(ids, references=item.passages, max_new_tokens=max_new_tokens, config=cfg).token_ids

    return run_ours


def run_benchmark(
    dec: ReferenceDecoder,
    items: Sequence[RagItem],
    methods: Sequence[str],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> list[Run]:
    if "greedy" not in methods:
        methods = ["greedy", *methods]
    runners = {m: _runner(dec, m, max_new_tokens) for m in methods}
    prompts = [dec.encode_prompt(rag_messages(it.query, it.passages)) for it in items]
    # Warm-up on the first item, untimed (also measures our cost curve once, outside the timings).
    for m in methods:
        runners[m](prompts[0], items[0])
    counter = _ForwardCounter(dec.model)
    runs: list[Run] = []
    try:
        for i, (item, ids) in enumerate(zip(items, prompts)):
            order = list(methods[i % len(methods):]) + list(methods[: i % len(methods)])
            greedy_ids: list[int] | None = None
            item_runs = []
            for m in order:
                counter.count = 0
                t0 = time.perf_counter()
                out_ids = runners[m](ids, item)
                if dec.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                item_runs.append(Run(m, item.id, dt, len(out_ids), counter.count, False, out_ids))
                if m == "greedy":
                    greedy_ids = out_ids
            for r in item_runs:
                r.identical = r.token_ids == greedy_ids
            runs.extend(sorted(item_runs, key=lambda r: list(methods).index(r.method)))
            if progress:
                progress(f"item {i + 1}/{len(items)} " + " ".join(
                    f"{r.method}={r.seconds:.2f}s" for r in item_runs))
    finally:
        counter.close()
    return runs


def summarize(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    greedy = {r.item: r for r in by_method["greedy"]}
    out = {}
    for m, rs in by_method.items():
        speedups = [greedy[r.item].seconds / r.seconds for r in rs]
        out[m] = {
            "items": len(rs),
            "median_latency_s": statistics.median(r.seconds for r in rs),
            "tokens_per_s": sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs),
            "speedup_geomean": math.exp(sum(math.log(s) for s in speedups) / len(speedups)),
            "speedup_total_time": sum(greedy[r.item].seconds for r in rs) / sum(r.seconds for r in rs),
            "speedup_worst": min(speedups),
            "worst_item": rs[speedups.index(min(speedups))].item,
            "tokens_per_step": sum(r.new_tokens for r in rs) / sum(r.steps for r in rs),
            "identical_rate": sum(r.identical for r in rs) / len(rs),
        }
    return out


def environment(dec: ReferenceDecoder) -> dict[str, Any]:
    dev = dec.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    import transformers

    return {
        "device": f"{dev.type}: {name}",
        "cpu_threads": torch.get_num_threads(),
        "model": getattr(dec.model.config, "_name_or_path", "") or type(dec.model).__name__,
        "dtype": str(dec.model.dtype).replace("torch.", ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| method | speed-up (geo-mean) | worst item | tokens/step | tokens/s | median latency (s) | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, s in summary.items():
        lines.append(
            f"| {m} | {s['speedup_geomean']:.2f}x | {s['speedup_worst']:.2f}x | {s['tokens_per_step']:.2f} | "
            f"{s['tokens_per_s']:.1f} | {s['median_latency_s']:.2f} | {s['identical_rate']:.0%} |"
        )
    return "\n".join(lines)
