"""Saved index and cache files: every byte checked, strict contents, no stale temporary files, modes kept,
errors that name the file. A tiny deterministic embedder keeps these fast (no model is loaded)."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import zlib

import faiss
import numpy as np
import pytest

from rag_accel.rag.cache import ResponseCache
from rag_accel.rag.retrieval import VectorIndex
from rag_accel.rag.storage import CorruptFileError


class FakeEmbedder:
    """Unit vectors drawn from a seed that is the text's CRC: same text, same vector."""

    name, dim = "fake-8", 8

    def embed_passages(self, texts, show_progress=False):
        rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim) for t in texts]
        vecs = np.array(rows, dtype=np.float32).reshape(len(texts), self.dim)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)

    embed_queries = embed_passages


EMB = FakeEmbedder()
DOCS = ["alpha passage", "beta passage", "gamma passage"]


def _index(kind="flat", **kw):
    index = VectorIndex(EMB, kind, **kw)
    index.add(DOCS, ids=["a", "b", "c"])
    return index


def _cache(path):
    cache = ResponseCache(EMB, path, min_score=-1.0)
    for i in range(5):
        cache.put(f"question {i}", f"answer {i}")
    cache.lookup("question 1", k=1)
    return cache


def _save(what, path):
    """Save a small object of the kind ``what`` to ``path``; returns a function that loads it back."""
    if what == "cache":
        _cache(path).save()
        return lambda: ResponseCache(EMB, path)
    kind, _, nprobe = what.partition("-nprobe")
    _index(kind, nlist=2, nprobe=int(nprobe or 1), m=4).save(path)
    return lambda: VectorIndex.load(path, EMB)


def _temps(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# --- files forged with a valid checksum, in the format of the file they start from ----------------------------

def _split(data):
    """(format version, header, parts) of a saved file."""
    version = data[14:15]
    n = int.from_bytes(data[16:24], "little")
    header = json.loads(data[24 : 24 + n])
    payload = data[24 + n :] if version == b"1" else data[24 + n : -32]
    parts, offset = {}, 0
    for name, size in header["parts"]:
        parts[name], offset = payload[offset : offset + size], offset + size
    return version, header, parts


def _pack(version, header, payload, length=None):
    if version == b"1":
        header = json.dumps({**header, "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    elif not isinstance(header, bytes):
        header = json.dumps(header).encode()
    body = b"RAG-ACCEL-FILE" + version + b"\n" + (len(header) if length is None else length).to_bytes(8, "little")
    body += header + payload
    return body if version == b"1" else body + hashlib.sha256(body).digest()


def _forge(path, edit):
    """Rewrite ``path`` with ``edit(header, parts)`` applied, checksum valid ("parts" sizes follow the parts)."""
    version, header, parts = _split(path.read_bytes())
    header.pop("sha256", None)
    header["parts"] = "AUTO"
    edit(header, parts)
    if header.get("parts") == "AUTO":
        header["parts"] = [[name, len(blob)] for name, blob in parts.items()]
    path.write_bytes(_pack(version, header, b"".join(parts.values())))


def _meta(key, value):
    def edit(h, p):
        if value is KeyError:
            del h["meta"][key]
        else:
            h["meta"][key] = value
    return edit


def _part(name, value):
    def edit(h, p):
        p[name] = value if isinstance(value, bytes) else json.dumps(value).encode()
    return edit


def _faiss(index):
    return _part("faiss", faiss.serialize_index(index).tobytes())


def _flat(dim=8, n=3, cls=faiss.IndexFlatIP):
    index = cls(dim)
    index.add(EMB.embed_passages(DOCS[:n]) if dim == 8 else np.zeros((n, dim), dtype=np.float32))
    return index


def _idmap(ids):
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(8))
    index.add_with_ids(EMB.embed_passages([f"q{i}" for i in ids]), np.array(ids, dtype=np.int64))
    return index


def _set(key, value):
    def edit(h, p):
        if value is KeyError:
            del h[key]
        else:
            h[key] = value
    return edit


HEADER_EDITS = {
    "no kind": _set("kind", KeyError), "kind a list": _set("kind", ["vector-index"]),
    "meta a list": _set("meta", []), "no parts": _set("parts", KeyError), "extra key": _set("extra", 1),
    "parts an object": _set("parts", {"faiss": 1}), "part size negative": _set("parts", [["faiss", -5], ["x", 5]]),
    "part size huge": _set("parts", [["faiss", 10**20]]), "part size a float": _set("parts", [["faiss", 1.5]]),
    "part names swapped": lambda h, p: h.update(parts=[[n, len(b)] for n, b in reversed(p.items())]),
    "part a string": _set("parts", ["faiss"]), "part sizes off by one": lambda h, p: h.update(
        parts=[[n, len(b) + (1 if i == 0 else -1)] for i, (n, b) in enumerate(p.items())]),
}

INDEX_EDITS = {
    "dim a string": _meta("dim", "8"), "dim a float": _meta("dim", 8.0), "dim true": _meta("dim", True),
    "dim 0": _meta("dim", 0), "no nprobe": _meta("nprobe", KeyError), "extra meta": _meta("colour", "red"),
    "nprobe 0": _meta("nprobe", 0), "nprobe a string": _meta("nprobe", "2"), "nprobe null": _meta("nprobe", None),
    "kind lsh": _meta("kind", "lsh"), "kind a number": _meta("kind", 3), "kind hnsw (stored: flat)": _meta("kind", "hnsw"),
    "count -1": _meta("count", -1), "count 2 (stored: 3)": _meta("count", 2), "embedder null": _meta("embedder", None),
    "docs not json": _part("docs", b"{not json"), "docs a list": _part("docs", []),
    "docs without texts": _part("docs", {"ids": ["a", "b", "c"]}),
    "docs with an extra key": _part("docs", {"ids": ["a", "b", "c"], "texts": DOCS, "x": 1}),
    "ids numbers": _part("docs", {"ids": [1, 2, 3], "texts": DOCS}),
    "texts short": _part("docs", {"ids": ["a", "b", "c"], "texts": DOCS[:2]}),
    "texts an object": _part("docs", {"ids": ["a", "b", "c"], "texts": {"0": "x"}}),
    "faiss garbage": _part("faiss", b"garbage!"), "faiss empty": _part("faiss", b""),
    "faiss L2": _faiss(_flat(cls=faiss.IndexFlatL2)), "faiss 4-dim": _faiss(_flat(dim=4)),
    "faiss 2 vectors": _faiss(_flat(n=2)), "faiss hnsw": _faiss(faiss.IndexHNSWFlat(8, 4, faiss.METRIC_INNER_PRODUCT)),
}

CACHE_EDITS = {
    "next_id a string": _meta("next_id", "5"), "clock -1": _meta("clock", -1), "no clock": _meta("clock", KeyError),
    "max_entries 0": _meta("max_entries", 0), "count 4 (stored: 5)": _meta("count", 4),
    "next_id 3 (ids 0-4)": _meta("next_id", 3), "max_entries 2 (5 stored)": _meta("max_entries", 2),
    "entries a list": _part("entries", [["q", "a", 1]]),
    "entry key x": _part("entries", {"x": ["q", "a", 1], **{str(i): ["q", "a", 1] for i in range(1, 5)}}),
    "entry key -1": _part("entries", {"-1": ["q", "a", 1], **{str(i): ["q", "a", 1] for i in range(1, 5)}}),
    "entry key 01": _part("entries", {"01": ["q", "a", 1], **{str(i): ["q", "a", 1] for i in (0, 2, 3, 4)}}),
    "entry of two": _part("entries", {str(i): ["q", "a"] for i in range(5)}),
    "answer a number": _part("entries", {str(i): ["q", 5, 1] for i in range(5)}),
    "last use a string": _part("entries", {str(i): ["q", "a", "1"] for i in range(5)}),
    "last use past the clock": _part("entries", {str(i): ["q", "a", 10**6] for i in range(5)}),
    "faiss ids differ": _faiss(_idmap([0, 1, 2, 3, 7])), "faiss ids repeated": _faiss(_idmap([0, 1, 2, 3, 3])),
    "faiss not an id map": _faiss(_flat(n=3)), "faiss garbage": _part("faiss", b"garbage!"),
    "faiss id map over L2": lambda h, p: p.update(faiss=_l2_idmap()),
}


def _l2_idmap():
    index = faiss.IndexIDMap2(faiss.IndexFlatL2(8))
    index.add_with_ids(EMB.embed_passages([f"q{i}" for i in range(5)]), np.arange(5, dtype=np.int64))
    return faiss.serialize_index(index).tobytes()


def _check_corrupt(load, path):
    with pytest.raises(CorruptFileError) as info:
        load()
    assert str(path) in str(info.value)
    return str(info.value)


# --- defect 2: the header is covered by the checksum; every malformed file is a CorruptFileError ------------------

@pytest.mark.parametrize("what", ["flat", "ivf-nprobe2", "hnsw", "cache"])
def test_every_flipped_bit_and_every_truncation_is_a_corrupt_file_error(tmp_path, what):
    path = tmp_path / "x.bin"
    load = _save(what, path)
    good = path.read_bytes()
    load()  # the intact file loads
    assert len(good) < 4000, len(good)
    for i in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            path.write_bytes(bad)
            try:
                _check_corrupt(load, path)
            except BaseException as e:
                raise AssertionError(f"flipping bit {bit} of byte {i} of {len(good)}: {e!r}") from e
    for n in range(len(good)):
        path.write_bytes(good[:n])
        _check_corrupt(load, path)


def test_the_issue_examples_no_longer_load(tmp_path):
    path = tmp_path / "x.idx"
    _index("ivf", nlist=2, nprobe=2).save(path)
    path.write_bytes(path.read_bytes().replace(b'"nprobe": 2', b'"nprobe": 3'))  # one flipped bit: 0x32 -> 0x33
    _check_corrupt(lambda: VectorIndex.load(path, EMB), path)

    path = tmp_path / "cache.bin"
    cache = ResponseCache(EMB, path)
    for i in range(37):
        cache.put(f"question {i}", f"answer {i}")
    cache.save()
    assert b'"next_id": 37' in path.read_bytes()
    path.write_bytes(path.read_bytes().replace(b'"next_id": 37', b'"next_id": 27'))  # 0x33 -> 0x32
    _check_corrupt(lambda: ResponseCache(EMB, path), path)


@pytest.mark.parametrize("edit", list({**HEADER_EDITS, **INDEX_EDITS}), ids=str)
def test_an_index_with_a_valid_checksum_but_wrong_contents_is_a_corrupt_file_error(tmp_path, edit):
    path = tmp_path / "x.idx"
    _index().save(path)
    _forge(path, {**HEADER_EDITS, **INDEX_EDITS}[edit])
    _check_corrupt(lambda: VectorIndex.load(path, EMB), path)


@pytest.mark.parametrize("edit", list({**HEADER_EDITS, **CACHE_EDITS}), ids=str)
def test_a_cache_with_a_valid_checksum_but_wrong_contents_is_a_corrupt_file_error(tmp_path, edit):
    path = tmp_path / "cache.bin"
    _cache(path).save()
    _forge(path, {**HEADER_EDITS, **CACHE_EDITS}[edit])
    _check_corrupt(lambda: ResponseCache(EMB, path), path)


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"null", b'"vector-index"', b"[" * 100_000])
def test_an_unreadable_header_with_a_valid_checksum_is_a_corrupt_file_error(tmp_path, header):
    path = tmp_path / "x.idx"
    path.write_bytes(_pack(b"2", header, b""))
    _check_corrupt(lambda: VectorIndex.load(path, EMB), path)


@pytest.mark.parametrize("length", [2**63, 10**6, 0])
def test_a_header_length_past_the_end_is_a_corrupt_file_error(tmp_path, length):
    path = tmp_path / "x.idx"
    path.write_bytes(_pack(b"2", {"kind": "vector-index"}, b"", length=length))
    _check_corrupt(lambda: VectorIndex.load(path, EMB), path)


def test_a_file_of_the_previous_format_is_a_clear_error(tmp_path):
    path = tmp_path / "x.idx"
    _index().save(path)
    _, header, parts = _split(path.read_bytes())
    path.write_bytes(_pack(b"1", header, b"".join(parts.values())))  # as saved by rag_accel's format 1
    message = _check_corrupt(lambda: VectorIndex.load(path, EMB), path)
    assert re.search(r"format 1\b.*reads format 2.*re-create", message), message


def test_the_other_kind_of_file_is_a_clear_error(tmp_path):
    _index().save(tmp_path / "x.idx")
    assert "not a 'response-cache'" in _check_corrupt(lambda: ResponseCache(EMB, tmp_path / "x.idx"), tmp_path / "x.idx")


def test_a_save_never_writes_a_file_that_would_not_load(tmp_path):
    index = _index()
    index.nprobe = 0
    with pytest.raises(ValueError, match=r"refusing to save .*x\.idx as a vector-index .*'nprobe' is 0"):
        index.save(tmp_path / "x.idx")
    assert list(tmp_path.iterdir()) == []


# --- defect 5: temporary files of killed saves are removed by the next save or load ------------------------------

_WRITER = """
import os, sys, time, zlib
import numpy as np
from rag_accel.rag.retrieval import VectorIndex
{embedder}
index = VectorIndex(FakeEmbedder())
index.add([f"passage {{i}} " + "x" * 5000 for i in range(2000)])  # about 10 MB
index.save(sys.argv[1])  # a complete file ...
index.add(["one more passage"])
def hang(fd):
    print("writing", flush=True)
    time.sleep(600)
os.fsync = hang  # ... and a second save, held (and then killed) before the rename
index.save(sys.argv[1])
"""


_FOLDER_WRITER = """
import sys, time
from rag_accel.rag.storage import save_folder
def write(folder):
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    print("writing", flush=True)
    time.sleep(600)
save_folder(sys.argv[1], write, what="the model", marker="config.json")
"""


def _start_writer(path, script=None):
    script = script or _WRITER.format(embedder=inspect.getsource(FakeEmbedder))
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "writing\n", "the writer died"
    return proc


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("then", ["load", "save"])
def test_a_killed_save_s_temporary_file_is_removed_by_the_next_save_or_load(tmp_path, then):
    path = tmp_path / "x.idx"
    _kill(_start_writer(path))
    leftover = _temps(tmp_path)
    assert len(leftover) == 1 and leftover[0].startswith(".x.idx.")
    assert (tmp_path / leftover[0]).stat().st_size > 10_000_000
    index = VectorIndex.load(path, EMB) if then == "load" else _index().save(path) or VectorIndex.load(path, EMB)
    assert _temps(tmp_path) == []
    assert len(index) == (2000 if then == "load" else 3)  # the killed save changed nothing


def test_a_live_save_s_temporary_file_is_kept(tmp_path):
    path = tmp_path / "x.idx"
    proc = _start_writer(path)
    try:
        theirs = _temps(tmp_path)
        assert len(VectorIndex.load(path, EMB)) == 2000
        _index().save(tmp_path / "x.idx")
        assert _temps(tmp_path) == theirs  # the writer is alive: its temporary file is not stale
    finally:
        _kill(proc)
    VectorIndex.load(path, EMB)
    assert _temps(tmp_path) == []


def test_a_concurrent_save_in_another_thread_keeps_its_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "x.idx"
    index = _index()
    index.save(path)
    writing, release, errors = threading.Event(), threading.Event(), []
    real_fsync = os.fsync

    def fsync(fd):
        if threading.current_thread() is thread:
            writing.set()
            release.wait(30)
        real_fsync(fd)

    def save():
        try:
            index.save(path)
        except Exception as e:  # noqa: BLE001  # pragma: no cover
            errors.append(e)

    monkeypatch.setattr(os, "fsync", fsync)
    thread = threading.Thread(target=save)
    thread.start()
    try:
        assert writing.wait(30)
        theirs = _temps(tmp_path)
        assert len(theirs) == 1
        VectorIndex.load(path, EMB)
        _index().save(tmp_path / "x.idx")
        assert _temps(tmp_path) == theirs
    finally:
        release.set()
        thread.join()
    assert errors == [] and _temps(tmp_path) == [] and len(VectorIndex.load(path, EMB)) == 3


def test_a_killed_folder_save_s_temporary_folder_is_removed_by_the_next_one(tmp_path):
    from rag_accel.rag.storage import save_folder

    _kill(_start_writer(tmp_path / "model", _FOLDER_WRITER))
    leftover = list(tmp_path.iterdir())
    assert len(leftover) == 1 and leftover[0].name.startswith(".model.") and (leftover[0] / "weights.bin").is_file()
    save_folder(tmp_path / "model", lambda folder: (folder / "config.json").write_text("{}"), what="the model",
                marker="config.json")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_other_files_beside_the_target_are_left_alone(tmp_path):
    path = tmp_path / "x.idx"
    others = [".x.idx.tmp", ".x.idx2.somehost-999999999.abcdefgh.tmp", ".y.idx.abcdefgh.tmp", "x.idx.abcdefgh.tmp",
              ".x.idx.bak", ".x.idx.another_host-999999999.abcdefgh.tmp"]  # the last: a save on another machine
    for name in others:
        (tmp_path / name).write_bytes(b"keep me")
        os.utime(tmp_path / name, (0, 0))  # old, too
    _index().save(path)
    VectorIndex.load(path, EMB)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others + ["x.idx"])


def test_an_old_temporary_file_without_a_pid_is_removed(tmp_path):
    path = tmp_path / "x.idx"
    old, recent = tmp_path / ".x.idx.abcd_123.tmp", tmp_path / ".x.idx.zyxw_987.tmp"  # as rag_accel's format 1 named them
    old.write_bytes(b"left by a killed save")
    recent.write_bytes(b"maybe being written by an older rag_accel")
    os.utime(old, (0, 0))
    _index().save(path)
    assert not old.exists() and recent.exists()


# --- defect 6: saves keep the file's mode; a new file gets the umask's -------------------------------------------

@pytest.mark.parametrize("what", ["index", "cache"])
def test_a_save_keeps_the_file_mode(tmp_path, what):
    path = tmp_path / "x.bin"
    save = _index().save if what == "index" else _cache(None).save
    umask = os.umask(0o027)
    try:
        save(path)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # as open() would make it
    for mode in (0o644, 0o604, 0o600):
        os.chmod(path, mode)
        save(path)
        assert stat.S_IMODE(path.stat().st_mode) == mode


# --- defect 7: a full disk (or any other OSError) names the file being written ----------------------------------

@pytest.mark.parametrize("what", ["vector index", "response cache"])
def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, what):
    path = tmp_path / "x.bin"
    save = _index().save if what == "vector index" else _cache(None).save
    save(path)
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"could not save the {what} to {re.escape(str(path))}: No space left on "
                                      r"device; free some space there or save it elsewhere") as info:
        save(path)
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and _temps(tmp_path) == []


def test_a_save_into_a_file_names_the_target(tmp_path):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "x.idx"
    with pytest.raises(OSError, match=rf"could not save the vector index to {re.escape(str(target))}: ") as info:
        _index().save(target)
    assert info.value.errno in (errno.EEXIST, errno.ENOTDIR)
