"""Issue 56: ``benchmarks/`` holds the benchmarks a user would rerun, the one-off investigations sit in
``benchmarks/experiments/`` behind an index, no script reaches another through ``sys.path``, and the results page
reads as a page: an index of findings first, headings, and no line a screen cannot hold."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
EXPERIMENTS = BENCH / "experiments"
RESULTS_PAGE = BENCH / "results" / "README.md"
NOTES = BENCH / "results" / "notes.md"


def test_the_top_level_holds_at_most_twelve_benchmarks_each_in_its_index():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert 0 < len(scripts) <= 12, scripts
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    assert [s for s in scripts if f"### `{s}`" not in index] == []  # (python benchmarks/readme_table.py)


def test_every_experiment_is_in_the_index_with_its_question_and_finding():
    index = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+\.py)` \|(.*)\|$", index, re.M)}
    scripts = sorted(p.name for p in EXPERIMENTS.glob("*.py"))
    assert scripts and sorted(rows) == scripts
    for script, cells in rows.items():
        question, finding, _runs = (c.strip() for c in cells.split(" | "))
        assert question.endswith("?") and finding, script


def test_no_benchmark_edits_sys_path():
    """Shared code lives in rag_accel.bench (what rag-accel bench runs) and rag_accel_lab (benchmarks/rag_accel_lab:
    replay, inflight, installed by the README's test command); a script imports at most a sibling script."""
    for script in [*BENCH.glob("*.py"), *EXPERIMENTS.glob("*.py")]:
        assert "sys.path" not in script.read_text(encoding="utf-8"), script.name


def test_the_lab_is_outside_the_wheel():
    """Issue 65: the replays' and in-flight kits live in benchmarks/rag_accel_lab, a package of its own that
    rag-accel's wheel does not hold; nothing in rag_accel imports it, and it is importable here by name."""
    import rag_accel_lab.inflight
    import rag_accel_lab.replay

    root = BENCH.parent
    assert Path(rag_accel_lab.replay.__file__).resolve().parent == BENCH / "rag_accel_lab"
    library = [p for p in (root / "rag_accel").rglob("*.py")]
    assert not [p for p in library if p.stem in ("replay", "inflight")]
    imports = re.compile(r"^\s*(from|import) rag_accel_lab\b", re.M)
    assert [p.name for p in library if imports.search(p.read_text(encoding="utf-8"))] == []
    assert 'include = ["rag_accel*"]' in (root / "pyproject.toml").read_text(encoding="utf-8")


def _slugs(page: Path) -> set[str]:
    return {re.sub(r"[^a-z0-9 -]", "", h.lstrip("#").strip().lower()).replace(" ", "-")
            for h in page.read_text(encoding="utf-8").splitlines() if re.match(r"#{1,4} ", h)}


def test_the_results_page_is_an_index_of_findings_and_every_run():
    """``benchmarks/results/README.md`` is an index a reader can find things in: at most 300 lines, its Findings
    first (their links reach headings of the page or of the notes, where the story of the runs lives), then every
    committed run's page, one line each (python benchmarks/readme_table.py); no line a screen cannot hold."""
    lines = RESULTS_PAGE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    headings = [ln for ln in lines if re.match(r"#{2,4} ", ln)]
    assert headings[0] == "## Findings" and "## Every committed run" in headings
    for page in (RESULTS_PAGE, NOTES):
        long = [(n, len(ln)) for n, ln in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if len(ln) > 400]
        assert long == [], f"{page.name}: lines over 400 characters (line, length): {long}"
    findings = "\n".join(lines[lines.index("## Findings") + 1:lines.index("## Every committed run")])
    anchors = re.findall(r"\]\((notes\.md)?#([^)]+)\)", findings)
    assert len(anchors) >= 8
    wrong = [a for page, a in anchors if a not in _slugs(NOTES if page else RESULTS_PAGE)]
    assert wrong == [], wrong
    index = "\n".join(lines[lines.index("## Every committed run"):])
    listed = re.findall(r"^- \[(\w+)\]\((\w+)\.md\)", index, re.M)
    assert all(a == b for a, b in listed)
    pages = {p.stem for p in RESULTS_PAGE.parent.glob("*.md")} - {"README", "notes"}
    assert sorted(a for a, _ in listed) == sorted(pages), "a run's page missing from the index, or listed twice"


def test_wrap_keeps_markdown_blocks_and_long_commands_whole():
    """The results generator's wrapping (benchmarks/readme_table.py): prose wrapped, a list item's continuation
    indented, no continuation line that would open a list, tables and short Reproduce lines untouched."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_table", BENCH / "readme_table.py")
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    text = "- " + " ".join(["word"] * 60) + " - 1. # x"
    wrapped = rt.wrap(text, width=40).splitlines()
    assert all(len(ln) <= 48 for ln in wrapped) and all(ln.startswith("  word") for ln in wrapped[1:])
    assert " ".join(" ".join(wrapped).split()) == " ".join(text.split())
    assert not any(re.match(r"\s*(-|\d+\.|#) ", ln) for ln in wrapped[1:])
    table, reproduce = "| " + "a | " * 80, "Reproduce: `" + "x " * 150 + "`"
    assert rt.wrap(table, 40) == table and rt.wrap(reproduce, 40) == reproduce
