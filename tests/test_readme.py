"""The README's and docs/'s Python blocks run exactly as written, each on its own (as a new user pastes
one into a script), their links resolve, and the results tables name only methods that exist.

Every ```python block in README.md and docs/*.md runs here, in a fresh namespace with ``__name__ == "__main__"`` and
a temporary working folder. A block that cannot run here says so on the line right before it, visibly:
``<!-- not run in the tests: REASON -->`` (e.g. one that needs the vLLM virtualenv). A block with
neither the marker nor a clean run fails this test, so a block added later is covered too.

The blocks share one loaded model: ``ReferenceDecoder.from_pretrained`` returns the session's decoder
for the offline default model (the blocks and the adapters, which load through it, all ask for it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # what a reader follows from the README
RESULTS_PAGE = ROOT / "benchmarks" / "results" / "README.md"
NOTES_PAGE = ROOT / "benchmarks" / "results" / "notes.md"  # the story of the runs, which the results page indexes
SKIP_MARK = re.compile(r"^<!--\s*not run in the tests:\s*(?P<reason>\S.*?)\s*-->$")


def python_blocks(text: str) -> list[dict]:
    """Each ```python block: its first line number, the heading it sits under, its code, and the
    reason given by a skip marker on the nearest non-blank line before it (None if unmarked)."""
    lines = text.splitlines()
    blocks, heading, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = SKIP_MARK.match(before)
            blocks.append({"line": i + 1, "heading": heading, "code": "\n".join(lines[i + 1:j]),
                           "skip": mark["reason"] if mark else None})
            i = j
        i += 1
    return blocks


BLOCKS = [{**b, "page": page} for page in PAGES for b in python_blocks(page.read_text(encoding="utf-8"))]


def _block_id(b: dict) -> str:
    return f"{b['page'].stem}-line{b['line']}-{re.sub(r'[^a-z0-9]+', '-', b['heading'].lower()).strip('-')}"


def test_the_readme_has_blocks_and_every_marker_gives_a_reason():
    assert sum(b["page"] == README for b in BLOCKS) >= 4
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = [ln for ln in text.splitlines() if ln.strip().startswith("<!-- not run in the tests")]
        assert len(markers) == sum(b["skip"] is not None for b in BLOCKS if b["page"] == page), \
            f"{page.name}: a marker that is not right before a block"


def test_the_readme_reads_in_ten_minutes_and_every_link_resolves():
    """Under 300 lines (the rest lives in docs/ and benchmarks/results/), and every relative link of the
    README, docs/ and the results page points at a file that exists (text moved between pages keeps
    working links); an anchor into another page names one of its headings."""
    assert len(README.read_text(encoding="utf-8").splitlines()) < 300
    for page in [*PAGES, RESULTS_PAGE, NOTES_PAGE]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve()
            assert dest.exists(), f"{page.relative_to(ROOT)}: link to a missing {target}"
            if anchor and dest.suffix == ".md":
                slugs = {re.sub(r"[^a-z0-9 -]", "", h.lstrip("#").strip().lower()).replace(" ", "-")
                         for h in dest.read_text(encoding="utf-8").splitlines() if h.startswith("#")}
                assert anchor in slugs, f"{page.relative_to(ROOT)}: no heading #{anchor} in {path}"


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs: runs of lines between blank lines, code blocks, tables, headings and list items."""
    paras, cur, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        breaks = fenced or line.startswith("```") or not line.strip() or line.startswith(("|", "#", "- ", "!["))
        if breaks and cur:
            paras.append(" ".join(cur))
            cur = []
        if not breaks or line.startswith("- "):
            cur.append(line)
    return paras + ([" ".join(cur)] if cur else [])


def test_the_readme_is_a_front_door():
    """Issue 56: no paragraph (or list item) over 80 words; the Results section 30 lines at most, the caveats on
    the results page beside their runs."""
    text = README.read_text(encoding="utf-8")
    long = [p[:60] for p in _paragraphs(text) if len(p.split()) > 80]
    assert not long, f"README paragraphs over 80 words: {long}"
    results = text[text.index("## Results"):text.index("\n## ", text.index("## Results") + 1)]
    assert len(results.strip().splitlines()) <= 30


def test_block_parser_sees_markers_and_only_python_blocks():
    text = "# A\n```python\nx = 1\n```\n```bash\nls\n```\n## B\n<!-- not run in the tests: needs a GPU -->\n\n" \
           "```python\ny = 2\n```\n"
    got = python_blocks(text)
    assert [(b["line"], b["heading"], b["code"], b["skip"]) for b in got] == [
        (2, "A", "x = 1", None), (11, "B", "y = 2", "needs a GPU")]


@pytest.fixture(scope="module")
def shared_model(real_decoder):
    """``from_pretrained`` of the offline default model, as the blocks call it, returns one decoder."""
    from rag_accel import DEFAULT_MODEL, ReferenceDecoder

    original = ReferenceDecoder.from_pretrained.__func__

    def from_pretrained(cls, name_or_path, *, device=None, dtype=None, config=None,
                        draft_model=None, **model_kwargs):
        if (name_or_path == DEFAULT_MODEL and device in (None, "auto", "cpu")
                and dtype in (None, "auto", "float32") and config is None and draft_model is None
                and not model_kwargs):
            return real_decoder
        return original(cls, name_or_path, device=device, dtype=dtype, config=config,
                        draft_model=draft_model, **model_kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(ReferenceDecoder, "from_pretrained", classmethod(from_pretrained))
    yield real_decoder
    mp.undo()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_readme_block_runs_as_written(block, shared_model, tmp_path, monkeypatch):
    if block["skip"] is not None:
        pytest.skip(f"{block['page'].name} line {block['line']}: not run in the tests: {block['skip']}")
    monkeypatch.chdir(tmp_path)  # files a block writes (an index, a cache) land here
    code = compile(block["code"], f"{block['page'].relative_to(ROOT)}:{block['line']}", "exec")
    exec(code, {"__name__": "__main__"})  # raises (and fails the test) on any error in the block


def test_reproduce_lines_name_existing_methods():
    """A results table's "Reproduce:" command must run on the current code; one that needs an older
    commit says so ("Reproduce (at commit ...)") and checks that commit out first."""
    from rag_accel.methods import ALL_METHODS

    lines = [ln for page in [*PAGES, RESULTS_PAGE, NOTES_PAGE]
             for ln in page.read_text(encoding="utf-8").splitlines()]
    assert any(ln.startswith("Reproduce") for ln in lines)
    for line in lines:
        if not line.startswith("Reproduce") or "rag-accel bench " not in line:
            continue
        m = re.search(r"--methods (\S+)", line)
        if m is None:
            continue
        unknown = [x for x in m[1].strip("`").split(",") if x not in ALL_METHODS]
        assert not unknown or "git checkout" in line, f"{unknown} in: {line}"
