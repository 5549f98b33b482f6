"""Your own documents: a folder of text and Markdown files as passages to index and retrieve.

Each file is one item (its id: the path inside the folder) whose passages are its paragraphs, joined up to
:data:`PASSAGE_CHARS` characters; :func:`rag_accel.rag.retrieval.cached_index` indexes them as it indexes the
bundled sample (``rag-accel demo --docs FOLDER --question ...``), and any retriever can take the same passages.
"""

from __future__ import annotations

import re
from pathlib import Path

from .msmarco import RagItem

__all__ = ["PASSAGE_CHARS", "SUFFIXES", "document_files", "load_folder", "split_passages"]

#: The files read: plain text and Markdown (reStructuredText reads as text too).
SUFFIXES = (".txt", ".md", ".markdown", ".rst")
#: Most characters of one passage (about 250-300 tokens of English): a retrieved passage the model copies from,
#: a few per prompt.
PASSAGE_CHARS = 1200

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_passages(text: str, max_chars: int = PASSAGE_CHARS) -> list[str]:
    """``text`` as passages: its paragraphs (blank-line separated), consecutive ones joined while they fit in
    ``max_chars``; a longer paragraph cut at sentence ends, a longer sentence at spaces (a word longer than
    ``max_chars`` alone is cut).

    Example:
        >>> split_passages("One. Two.\\n\\nThree.\\n\\n\\nFour is longer than that.", max_chars=12)
        ['One. Two.', 'Three.', 'Four is', 'longer than', 'that.']
        >>> split_passages("A b. C d. E f g h i j k.\\n\\nZ.", max_chars=12)  # (a paragraph's parts rejoin by a space)
        ['A b. C d.', 'E f g h i j', 'k.\\n\\nZ.']
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[tuple[str, str]] = []  # (what joins it to the piece before: a paragraph's break or a space, text)
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        cut = [para] if len(para) <= max_chars else [
            line for sentence in _SENTENCE_END.split(para) for line in _cut(sentence, max_chars)]
        pieces += [("\n\n" if j == 0 else " ", line) for j, line in enumerate(cut)]
    passages: list[str] = []
    for sep, piece in pieces:  # (short neighbours share a passage, joined as the text joined them)
        if passages and len(passages[-1]) + len(sep) + len(piece) <= max_chars:
            passages[-1] = f"{passages[-1]}{sep}{piece}"
        else:
            passages.append(piece)
    return passages


def _cut(sentence: str, max_chars: int) -> list[str]:
    out, line = [], ""
    for word in sentence.split(" "):
        while len(word) > max_chars:  # (no space to cut at)
            if line:
                out.append(line)
                line = ""
            out.append(word[:max_chars])
            word = word[max_chars:]
        if line and len(line) + 1 + len(word) > max_chars:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out


def document_files(folder: str | Path, suffixes: tuple[str, ...] = SUFFIXES) -> list[Path]:
    """The files of ``folder`` (and its subfolders) with one of ``suffixes``, in sorted order; hidden ones left
    out. A folder that does not exist, or holds no such file, is an error saying so."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"documents folder {folder} does not exist (or is not a folder)")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise ValueError(f"documents folder {folder} holds no {', '.join(suffixes)} file")
    return files


def load_folder(folder: str | Path, max_chars: int = PASSAGE_CHARS,
                suffixes: tuple[str, ...] = SUFFIXES) -> list[RagItem]:
    """One item per document file of ``folder`` (:func:`document_files`): its id the path inside the folder, its
    passages :func:`split_passages` of the text; no question, no answer. A file that is not UTF-8 text is an
    error naming it; an empty one has no passages."""
    folder = Path(folder).expanduser()
    items = []
    for path in document_files(folder, suffixes):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): convert it, or move it "
                             "out of the folder") from None
        items.append(RagItem(path.relative_to(folder).as_posix(), "", split_passages(text, max_chars), []))
    return items
