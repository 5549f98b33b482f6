"""``rag-accel demo`` and ``rag-accel bench``."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

from .bench import ALL_METHODS

# Plain help (no rich panels): this typer's panels show flags such as --help with a "<bool>" type and cut
# long defaults off with an ellipsis; click's own layout wraps them.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, context_settings={"max_content_width": 120},
                  help="Lossless reference decoding for RAG: see it work, and measure it against the peers.")
DEVICE_HELP = "cpu, cuda, cuda:1 ... (default: CUDA if available, else cpu)."
DTYPE_HELP = "float32, float16, bfloat16 (default: float32 on CPU; on CUDA bfloat16, or float16 where bf16 is unsupported)."


class CliError(Exception):
    """A problem with the user's arguments or files: printed as one line, exit code 2."""


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load_decoder(model: str, device: Optional[str], dtype: Optional[str], draft_model: Optional[str] = None):
    from .decoder import ReferenceDecoder

    return ReferenceDecoder.from_pretrained(model, device=device, dtype=dtype, draft_model=draft_model)


def _index_for(corpus_items, embedder_name: str, corpus_path: Path, progress: bool):
    """FAISS index over the corpus passages, cached on disk keyed by corpus + embedder."""
    from .models import cache_home
    from .retrieval import Embedder, VectorIndex

    emb = Embedder(embedder_name)
    passages, ids = {}, []
    for it in corpus_items:
        for j, p in enumerate(it.passages):
            pid = f"{it.id}#{j}"
            passages[pid] = p
            ids.append(pid)
    st = corpus_path.stat()
    key = hashlib.sha256(f"{corpus_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{len(ids)}|{emb.name}".encode())
    path = cache_home() / "indexes" / f"{key.hexdigest()[:16]}.idx"
    if path.is_file():
        try:
            return VectorIndex.load(path, emb)
        except ValueError:
            path.unlink()  # a stale or damaged cache file is rebuilt, never trusted
    index = VectorIndex(emb)
    index.add([passages[i] for i in ids], ids=ids, show_progress=progress)
    index.save(path)
    return index


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m-instruct", help="HF name, local folder, or the offline default."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    queries: int = typer.Option(3, min=1, help="How many sample questions to answer."),
    corpus: Optional[Path] = typer.Option(None, help="MS-MARCO RAG jsonl (default: the bundled sample)."),
    corpus_items: Optional[int] = typer.Option(None, min=1, help="Index only the first N corpus items."),
    embedder: str = typer.Option("multilingual-e5-small", help="sentence-transformers model for retrieval."),
    k: int = typer.Option(3, min=1, help="Passages retrieved per question."),
    max_new_tokens: int = typer.Option(128, min=1),
) -> None:
    """Index the MS-MARCO sample (FAISS + E5), answer sample questions with streaming,
    and compare each answer with plain greedy decoding of the same prompt."""

    from .data import load_msmarco_sample, rag_messages, sample_path

    try:
        corpus_path = Path(corpus) if corpus else sample_path()
        items = load_msmarco_sample(corpus_path, limit=corpus_items)
        if not items:
            raise CliError(f"corpus {corpus_path} has no items")
        typer.echo(f"Indexing {sum(len(i.passages) for i in items)} passages of {len(items)} items "
                   f"from {corpus_path.name} with {embedder} ...")
        index = _index_for(items, embedder, corpus_path, progress=True)
        dec = _load_decoder(model, device, dtype)
    except (FileNotFoundError, ValueError, TypeError, CliError) as e:
        _fail(str(e))
    typer.echo(f"Model {model} on {dec.device} ({str(dec.model.dtype).replace('torch.', '')}); "
               "measuring the verification cost curve once ...")
    dec.cost_curve(dec.config.max_draft_tokens)
    answered = [it for it in items if it.answers][:queries] or items[:queries]
    for it in answered:
        hits = index.search(it.query, k)
        passages = [h.text for h in hits]
        messages = rag_messages(it.query, passages)
        typer.secho(f"\nQ: {it.query}", bold=True)
        typer.echo("   retrieved: " + ", ".join(f"{h.doc_id} ({h.score:.3f})" for h in hits))
        typer.echo("A: ", nl=False)
        stream = dec.stream(messages, references=passages, max_new_tokens=max_new_tokens)
        for piece in stream:
            typer.echo(piece, nl=False)
        out = stream.output
        plain = dec.generate_greedy(messages, max_new_tokens=max_new_tokens)
        greedy_s = plain.stats.time_s
        s = out.stats
        typer.secho(f"\n   {s.new_tokens} tokens, {s.tokens_per_step:.2f} tokens/step, {s.time_s:.2f}s vs plain "
                    f"greedy {greedy_s:.2f}s: {greedy_s / s.time_s:.2f}x; identical to greedy: "
                    f"{plain.token_ids == out.token_ids}", fg=typer.colors.GREEN)


@app.command()
def bench(
    model: str = typer.Option("smollm2-135m-instruct", help="HF name, local folder, offline default, or "
                              "random:<tiny|llama-1b|llama-8b> (random weights; use with --target-forced)."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    items: int = typer.Option(50, min=1, help="Answered sample items to run."),
    max_new_tokens: int = typer.Option(128, min=1, help="Most new tokens per answer."),
    methods: str = typer.Option("greedy,hf-pld,ours,ours-fixed,ours-ref,ours-pld,ours-ngram",
                                help="Comma-separated, from: " + ", ".join(ALL_METHODS) + " (see the README's "
                                "Command line section). greedy always runs (it is the reference)."),
    corpus: Optional[Path] = typer.Option(None, help="MS-MARCO RAG jsonl (default: the bundled sample)."),
    target_forced: Optional[str] = typer.Option(
        None, help="'human': force every method to decode the item's human answer; 'saved:FILE': force the "
                   "token ids saved by --save-outputs (e.g. SmolLM2's own answers)."),
    save_outputs: Optional[Path] = typer.Option(None, help="Write greedy's token ids per item (JSON) here."),
    draft_model: Optional[str] = typer.Option(
        None, help="A draft model for ours-draft, ours-hybrid and hf-assisted: a model path/name (its own "
                   "tokenizer; a different one means universal drafting), or 'int8': an int8 copy of the model (CPU)."),
    repeats: int = typer.Option(1, min=1, help="Rounds of all methods per item; an item's latency is the "
                                "median of its rounds (less machine noise in per-item speed-ups)."),
    out: Path = typer.Option(Path("benchmarks/results/bench"), help="Output prefix: .json, .md, .png"),
) -> None:
    """Run greedy, Hugging Face prompt lookup and our configurations side by side on the same items."""
    from .bench import ALL_METHODS, environment, markdown_table, plot, run_benchmark, summarize
    from .data import load_msmarco_sample

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in method_list if m not in ALL_METHODS]
    if unknown:
        _fail(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    if model.startswith("random:") and target_forced is None:
        _fail("a random-weight model only makes sense with --target-forced (its own outputs copy nothing)")
    try:
        want_answers = target_forced == "human"
        sample = load_msmarco_sample(corpus, with_answers=True, limit=items)
        if not sample:
            raise CliError("no answered items in the corpus")
        dec = _load_decoder(model, device, dtype, draft_model)
        targets = None
        if target_forced is not None:
            if want_answers:
                targets = {it.id: dec.tokenizer(it.answers[0], add_special_tokens=False)["input_ids"][:max_new_tokens]
                           for it in sample}
            elif target_forced.startswith("saved:"):
                saved = json.loads(Path(target_forced[6:]).read_text())
                targets = {k: v[:max_new_tokens] for k, v in saved["outputs"].items()}
            else:
                raise CliError(f"--target-forced must be 'human' or 'saved:FILE', got {target_forced!r}")
        runs = run_benchmark(dec, sample, method_list, max_new_tokens, targets=targets, repeats=repeats,
                             progress=lambda s: typer.echo(s, err=True))
    except (FileNotFoundError, ValueError, TypeError, CliError, json.JSONDecodeError, KeyError) as e:
        _fail(str(e))
    summary = summarize(runs)
    env = environment(dec, model)
    if draft_model is not None:
        env["draft_model"] = draft_model
    command = "rag-accel bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    table = markdown_table(summary)
    typer.echo(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": env, "command": command, "items": len(sample), "max_new_tokens": max_new_tokens,
              "repeats": repeats, "target_forced": target_forced, "cost_curve": {
                  f"{n}{'' if packed else '-unpacked'}{'' if head else '-nohead'}": v
                  for (n, packed, head), v in dec._cost_curves.items()},
              "summary": summary, "runs": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in runs]}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    title = (f"{env['model']} {env['dtype']} on {env['device']}, {len(sample)} MS-MARCO items, {max_new_tokens} "
             f"tokens{', target-forced: ' + target_forced if target_forced else ''}, {env['date']}")
    out.with_suffix(".md").write_text("\n".join([
        f"# {title}", "", f"- command: `{command}`", f"- torch {env['torch']}, transformers {env['transformers']}",
        *([f"- draft model: {draft_model}"] if draft_model else []),
        *([f"- per-item latency: median of {repeats} interleaved runs"] if repeats > 1 else []),
        "", table, "", f"![per-item speed-up]({out.with_suffix('.png').name})", ""]))
    plot(runs, out.with_suffix(".png"), title)
    if save_outputs is not None:
        save_outputs.write_text(json.dumps({"model": env["model"], "date": env["date"],
                                            "outputs": {r.item: r.token_ids for r in runs if r.method == "greedy"}}))
    typer.echo(f"wrote {out.with_suffix('.json')}, .md, .png")


@app.command("bench-drafting")
def bench_drafting(
    sizes: str = typer.Option("1000,100000,1000000", help="Reference sizes in tokens, comma-separated."),
    queries: int = typer.Option(300, min=1, help="Proposals timed per size."),
    out: Path = typer.Option(Path("benchmarks/results/propose_cpu"), help="Output prefix: .json, .md"),
) -> None:
    """Cost of one draft proposal against reference size: ours vs Hugging Face's prompt lookup."""
    import platform

    import torch

    from .bench import propose_cost, propose_table

    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
        if not size_list or min(size_list) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--sizes must be positive integers separated by commas, got {sizes!r}")
    rows = propose_cost(size_list, queries)
    table = propose_table(rows)
    typer.echo(table)
    env = {"device": f"cpu: {platform.processor() or platform.machine()}", "threads": torch.get_num_threads(),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": platform.python_version()}
    command = "rag-accel bench-drafting " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "command": command, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(f"# Drafting cost against reference size\n\n- {env['device']}, {env['date']}\n"
                                      f"- command: `{command}`\n\n{table}\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
