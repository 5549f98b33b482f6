"""What a batched verify step costs on a GPU, by rows in flight and tokens per row: the line the vLLM proposer
learns (``rag_accel.vllm.costs.BatchStepCosts``, ``t(T) = a + b T`` for ``T`` tokens scheduled), measured.

    python benchmarks/experiments/gpu_step_costs.py --device cuda --out benchmarks/results/gpu_step_costs_h200
    python benchmarks/experiments/gpu_step_costs.py --check          # here, on the CPU: the static step equals transformers
    python benchmarks/experiments/gpu_step_costs.py --report benchmarks/results/gpu_step_costs_h200.json \
        --repeat benchmarks/results/gpu_step_costs_h200_repeat.json          # its markdown and plot

vLLM's GPU wheel cannot reach the device machine (nothing can be fetched there, and the working tree that travels
is capped at 64 MiB), so this times the step itself, two ways, on decoder shapes users serve (random weights: a
step's time does not depend on their values):

- ``graph``: one decode/verify step of a Llama-shaped model written out in torch (the model's own weights, rotary
  tables and norms from transformers; grouped-query SDPA over a KV cache of ``--context`` tokens; logits for every
  scheduled token, then their argmax, as a verifier needs), captured once per shape as a CUDA graph and replayed:
  the GPU's own cost, as vLLM's CUDA-graph steps run it without the engine's CPU work. ``--check`` holds it to
  transformers' logits on a small model.
- ``eager``: transformers' own forward on a ``DynamicCache`` (cropped back after each step): kernel launches and
  Python included, as a plain transformers server pays them.

Each shape: ``rows`` rows of ``tokens_per_row`` tokens (1 = a plain step, 1 + k = a verify of ``k`` draft tokens) at
the same context; the median of ``--reps`` timed steps after warm-ups (CUDA events). The line ``a + b T`` is fitted
per number of rows and over all shapes; ``b / a`` is what ``BatchStepCosts`` prices a draft token by.
``benchmarks/experiments/batch_costs.py --measured`` replays the proposer's drafting at these step times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# Public configs' shapes (rope scaling left out: it changes no step's cost).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         tie_word_embeddings=False),
}
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)


def build_model(shape: dict[str, Any], dtype: Any, device: str, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


class StaticStep:
    """One step of ``rows`` x ``tokens`` new tokens at positions ``context ..``, over preallocated KV caches: every
    tensor it touches has a fixed address, so it can be captured as a CUDA graph. ``caches``: per layer ``(k, v)``,
    ``[rows, kv heads, >= context + tokens, head dim]``."""

    def __init__(self, model: Any, rows: int, context: int, tokens: int, caches: list) -> None:
        import torch

        self.model, self.rows, self.context, self.tokens, self.caches = model, rows, context, tokens, caches
        dev = model.lm_head.weight.device
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.ids = torch.zeros(rows, tokens, dtype=torch.long, device=dev)
        positions = torch.arange(context, context + tokens, device=dev)[None]
        probe = torch.zeros(1, tokens, cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=dev)
        self.cos, self.sin = (x[:, None] for x in model.model.rotary_emb(probe, positions))  # [1, 1, s, hd]
        span = context + tokens
        self.mask = (torch.arange(span, device=dev)[None] <= positions[0, :, None])[None, None]  # [1, 1, s, span]
        self.out: Any = None

    @staticmethod
    def _rotate(x: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    @staticmethod
    def _norm(x: Any, norm: Any) -> Any:
        import torch

        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    def logits(self) -> Any:
        import torch
        import torch.nn.functional as F

        b, s, c = self.rows, self.tokens, self.context
        h = self.model.model.embed_tokens(self.ids)
        for layer, (kc, vc) in zip(self.model.model.layers, self.caches):
            att = layer.self_attn
            x = self._norm(h, layer.input_layernorm)
            q = att.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k = att.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            v = att.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * self.cos + self._rotate(q) * self.sin
            k = k * self.cos + self._rotate(k) * self.sin
            kc[:, :, c:c + s] = k
            vc[:, :, c:c + s] = v
            o = F.scaled_dot_product_attention(q, kc[:, :, :c + s], vc[:, :, :c + s], attn_mask=self.mask,
                                               enable_gqa=self.heads != self.kv_heads)
            h = h + att.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            x = self._norm(h, layer.post_attention_layernorm)
            mlp = layer.mlp
            h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.model.lm_head(self._norm(h, self.model.model.norm))

    def step(self) -> Any:
        self.out = self.logits().argmax(-1)
        return self.out


def new_caches(model: Any, rows: int, length: int) -> list:
    import torch

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = model.lm_head.weight
    return [tuple(torch.randn(rows, cfg.num_key_value_heads, length, hd, dtype=w.dtype, device=w.device) * 0.1
                  for _ in range(2)) for _ in range(cfg.num_hidden_layers)]


def check(atol: float = 1e-4) -> dict[str, float]:
    """On the CPU, float32: the static step's logits equal transformers' for a whole sequence (context 0) and for
    the last tokens over a cache the static step filled (context > 0)."""
    import torch

    model = build_model(TINY, torch.float32, "cpu")
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (3, 11))
    with torch.no_grad():
        want = model(ids).logits
        caches = new_caches(model, 3, 11)
        whole = StaticStep(model, 3, 0, 11, caches)
        whole.ids.copy_(ids)
        got_whole = whole.logits()
        prefix = StaticStep(model, 3, 0, 8, caches)
        prefix.ids.copy_(ids[:, :8])
        prefix.logits()
        tail = StaticStep(model, 3, 8, 3, caches)
        tail.ids.copy_(ids[:, 8:])
        got_tail = tail.logits()
    err = {"whole": (got_whole - want).abs().max().item(), "tail": (got_tail - want[:, 8:]).abs().max().item()}
    if max(err.values()) > atol:
        raise AssertionError(f"the static step differs from transformers: {err}")
    return err


def timed(fn: Any, reps: int, warmup: int, device: str) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` ones (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def graph_step(step: StaticStep, device: str, pool: Any) -> Any:
    """The step as a replayable CUDA graph (on a CPU: the step itself)."""
    import torch

    if not device.startswith("cuda"):
        return step.step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step.step()
    return graph.replay


def eager_steps(model: Any, rows: int, context: int, tokens_list: list[int], reps: int, warmup: int,
                device: str) -> dict[int, list[float]]:
    """transformers' forward over a ``DynamicCache`` of ``context`` tokens, cropped back after each step."""
    import warnings

    import torch
    from transformers import DynamicCache

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")

    dev = model.lm_head.weight.device
    cache = DynamicCache()
    prompt = torch.randint(0, model.config.vocab_size, (rows, context), device=dev)
    model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for s in tokens_list:
        ids = torch.randint(0, model.config.vocab_size, (rows, s), device=dev)

        def step(ids: Any = ids) -> Any:
            r = model(ids, past_key_values=cache, use_cache=True).logits.argmax(-1)
            cache.crop(-len(ids[0]))  # (a negative length removes tokens in every transformers 5)
            return r

        out[s] = timed(step, reps, warmup, device)
        if cache.get_seq_length() != context:
            raise AssertionError(f"the cache holds {cache.get_seq_length()} tokens, not {context}")
    return out


def warm_gpu(seconds: float) -> None:
    import torch

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()


def least_squares(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``t = a + b T`` through ``(T, t)`` points (the same as
    :func:`rag_accel_lab.replay.least_squares`, repeated: this script needs only torch and transformers, so that
    it runs on a machine where rag_accel is not installed)."""
    n = len(points)
    mt, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    b = sum((p[0] - mt) * (p[1] - my) for p in points) / var if var > 0 else 0.0
    return my - b * mt, b


def fit_line(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """:func:`least_squares` over ``(T, ms)`` points, with ``b / a``: a draft token's price."""
    a, b = least_squares(points)
    return {"a_ms": a, "b_ms": b, "b_over_a": b / a if a > 0 else float("nan")}


def measure(name: str, dtype_name: str, modes: list[str], rows_list: list[int], tokens_list: list[int],
            context: int, reps: int, warmup: int, device: str) -> dict[str, Any]:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    t0 = time.perf_counter()
    model = build_model(SHAPES[name], dtype, device)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"model": name, "dtype": dtype_name, "params": params, "context": context,
                              "build_s": round(time.perf_counter() - t0, 1), "modes": {}}
    with torch.inference_mode():
        for mode in modes:
            shapes = []
            for rows in rows_list:
                if mode == "graph":
                    caches = new_caches(model, rows, context + max(tokens_list))
                    pool = torch.cuda.graph_pool_handle() if device.startswith("cuda") else None
                    times = {}
                    for s in tokens_list:
                        fn = graph_step(StaticStep(model, rows, context, s, caches), device, pool)
                        times[s] = timed(fn, reps, warmup, device)
                    del caches, fn
                else:
                    times = eager_steps(model, rows, context, tokens_list, reps, warmup, device)
                for s, ms in times.items():
                    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
                    shapes.append({"rows": rows, "tokens_per_row": s, "tokens": rows * s,
                                   "ms_median": statistics.median(ms), "ms_p10": q[0], "ms_p90": q[-1],
                                   "cv": statistics.pstdev(ms) / statistics.mean(ms)})
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                print(name, dtype_name, mode, rows, [round(x["ms_median"], 3) for x in shapes if x["rows"] == rows],
                      flush=True)
            lines = {str(r): fit_line([(x["tokens"], x["ms_median"]) for x in shapes if x["rows"] == r])
                     for r in rows_list}
            lines["all"] = fit_line([(x["tokens"], x["ms_median"]) for x in shapes])
            result["modes"][mode] = {"shapes": shapes, "lines": lines}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def ratios(shapes: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """``(rows, tokens per row)`` -> the step's time over a plain step of as many rows."""
    plain = {x["rows"]: x["ms_median"] for x in shapes if x["tokens_per_row"] == 1}
    return {(x["rows"], x["tokens_per_row"]): x["ms_median"] / plain[x["rows"]] for x in shapes}


def repeat_spread(run: dict[str, Any], repeat: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per mode: (median, largest) relative difference of a shape's median step time between two runs."""
    out = {}
    for mode in ("graph", "eager"):
        diffs = []
        for ra, rb in zip(run["runs"], repeat["runs"]):
            if mode in ra["modes"] and mode in rb["modes"]:
                diffs += [abs(x["ms_median"] / y["ms_median"] - 1) for x, y in
                          zip(ra["modes"][mode]["shapes"], rb["modes"][mode]["shapes"])]
        if diffs:
            out[mode] = (statistics.median(diffs), max(diffs))
    return out


def report(path: Path, repeat_path: Path | None) -> None:
    data = json.loads(path.read_text())
    runs = data["runs"]
    rows_list = sorted({x["rows"] for x in runs[0]["modes"]["graph"]["shapes"]})
    tokens_list = sorted({x["tokens_per_row"] for x in runs[0]["modes"]["graph"]["shapes"]})
    lines = [f"# What a batched verify step costs on a GPU ({data['device']}), {data['date'][:10]}", "",
             f"- command: `{data['command']}` (on the device machine; {data['seconds']} s)",
             f"- torch {data['torch']}, transformers {data['transformers']}; {data['cpus']} CPU cores, load "
             f"{data['load_before'][0]:.2f} before and {data['load_after'][0]:.2f} after (1-minute average); "
             "the machine ran nothing else",
             f"- each row's KV cache holds {runs[0]['context']} tokens (a RAG prompt and the answer so far); random "
             "weights of the public configs' shapes", ""]
    spread = {}
    if repeat_path is not None:
        repeat = json.loads(repeat_path.read_text())
        spread = repeat_spread(data, repeat)
        lines += [f"Repeatability: the same grid run earlier on the same machine ([{repeat_path.name}]"
                  f"({repeat_path.name}), {repeat['date'][11:16]} UTC, no GPU warm-up, 15 steps a shape) against "
                  "this run: " + "; ".join(f"{m} steps' medians differ by {a:.1%} at the median shape, "
                                           f"{b:.1%} at most" for m, (a, b) in spread.items()) + ".", ""]
    lines += ["**CUDA-graph steps** (`graph`: the GPU's own cost, as vLLM's graph-captured steps run it, the engine's "
              "CPU work left out). A step of `B` rows verifying `k` draft tokens each, over a plain step of `B` "
              "rows (`1 + k` tokens per row); the plain step's time in brackets:", ""]
    head = "| model | rows | plain step | " + " | ".join(f"k = {s - 1}" for s in tokens_list[1:]) + " |"
    lines += [head, "|---|---|---|" + "---|" * (len(tokens_list) - 1)]
    for run in runs:
        r = ratios(run["modes"]["graph"]["shapes"])
        plain = {x["rows"]: x["ms_median"] for x in run["modes"]["graph"]["shapes"] if x["tokens_per_row"] == 1}
        for rows in rows_list:
            lines.append(f"| {run['model']} {run['dtype']} | {rows} | {plain[rows]:.2f} ms | "
                         + " | ".join(f"{r[(rows, s)]:.2f}x" for s in tokens_list[1:]) + " |")
    lines += ["", "The line the proposer learns, `t(T) = a + b T` over `T` tokens scheduled: `b / a` (a draft "
              "token's share of a step) fitted per number of rows and over all shapes. The proposer's prior is "
              "0.03 (this project's 2-core CPU) and its floor half that, 0.015, until ~1,000 steps place the slope "
              "lower:", "",
              "| model | mode | " + " | ".join(f"{r} rows" for r in rows_list) + " | all |",
              "|---|---|" + "---|" * (len(rows_list) + 1)]
    for run in runs:
        for mode, m in run["modes"].items():
            lines.append(f"| {run['model']} {run['dtype']} | {mode} | "
                         + " | ".join(f"{m['lines'][str(r)]['b_over_a']:.4f}" for r in rows_list)
                         + f" | {m['lines']['all']['b_over_a']:.4f} |")
    lines += ["", "`eager` (transformers' own forward, launches and Python included) is launch-bound at these sizes: "
              "its steps take about the same time whatever they verify"
              + (f", and they vary between runs by up to {spread['eager'][1]:.0%}" if "eager" in spread else "")
              + "; its lines are not a basis for pricing.", ""]
    out = path.with_suffix(".md")
    out.write_text("\n".join(lines) + "\n")
    plot(runs, rows_list, path.with_suffix(".png"), data)
    print(out.read_text())


def plot(runs: list[dict[str, Any]], rows_list: list[int], path: Path, data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), sharey=True)
    for ax, run in zip(axes, runs):
        r = ratios(run["modes"]["graph"]["shapes"])
        for rows in rows_list:
            ks = sorted(s for (b, s) in r if b == rows)
            ax.plot([s - 1 for s in ks], [r[(rows, s)] for s in ks], marker="o", ms=3, label=f"{rows} rows")
        ax.set_title(f"{run['model']} {run['dtype']}", fontsize=9)
        ax.set_xlabel("draft tokens per row (k)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step time / plain step (same rows)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"A verify step's cost on {data['device']} (CUDA graphs), {data['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="smollm2-135m:float32,smollm2-135m:bfloat16,llama-3.2-1b:bfloat16,"
                                        "llama-3.1-8b:bfloat16")
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", default="1,2,3,5,9,11,17", help="tokens per row (1 + draft tokens)")
    ap.add_argument("--context", type=int, default=768, help="tokens already in each row's KV cache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_step_costs"))
    ap.add_argument("--warm-gpu", type=float, default=5.0, metavar="S",
                    help="seconds of matrix products before timing: an idle GPU's clocks take a while to rise")
    ap.add_argument("--report", type=Path, help="only: markdown and plot of a run's JSON")
    ap.add_argument("--repeat", type=Path, help="with --report: an earlier run of the same grid, for repeatability")
    ap.add_argument("--check", action="store_true", help="only: the static step against transformers (CPU)")
    args = ap.parse_args()
    if args.report is not None:
        report(args.report, args.repeat)
        return
    if args.check:
        print("static step vs transformers, max |logit difference|:", check())
        return
    import torch
    import transformers

    started, load_before = time.perf_counter(), os.getloadavg()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    if args.device.startswith("cuda"):
        warm_gpu(args.warm_gpu)
    runs: list[dict[str, Any]] = []
    for spec in args.models.split(","):
        name, dtype_name = spec.split(":")
        runs.append(measure(name, dtype_name, args.modes.split(","), [int(x) for x in args.rows.split(",")],
                            [int(x) for x in args.tokens.split(",")], args.context, args.reps, args.warmup,
                            args.device))
        result = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_name,
                  "torch": torch.__version__, "transformers": transformers.__version__, "cpus": os.cpu_count(),
                  "load_before": load_before, "load_after": os.getloadavg(),
                  "seconds": round(time.perf_counter() - started), "runs": runs}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))  # after each model: a cut run keeps some
    for run in runs:
        for mode, m in run["modes"].items():
            print(run["model"], run["dtype"], mode, {k: round(v["b_over_a"], 4) for k, v in m["lines"].items()})


if __name__ == "__main__":
    main()
