"""One-file, checksummed, atomically replaced containers for indexes and caches.

Layout: ``MAGIC`` (16 bytes) | header length (8 bytes, little endian) | JSON
header | payload. The header records the kind, user metadata, the length of
each payload part and the SHA-256 of the payload. Saving writes a temporary
file in the same folder, fsyncs it and ``os.replace``-s it over the target, so
an interrupted save leaves the previous file intact; loading checks magic,
lengths and checksum and names the file in a clear error when any is off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAGIC = b"RAG-ACCEL-FILE1\n"


class CorruptFileError(ValueError):
    """A stored index or cache file is truncated, altered or not one of ours."""


def save_container(path: str | Path, kind: str, meta: dict[str, Any], parts: dict[str, bytes]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = b"".join(parts.values())
    header = json.dumps({
        "kind": kind,
        "meta": meta,
        "parts": [[name, len(data)] for name, data in parts.items()],
        "sha256": hashlib.sha256(payload).hexdigest(),
    }).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a mix
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save_folder(target: str | Path, write: Callable[[Path], None], *, what: str, marker: str) -> Path:
    """Make the folder ``target`` by calling ``write(tmp)`` on a temporary folder beside it, then renaming
    it into place: a half-written folder is never seen as ``target``, and a failed write (a full disk, say)
    leaves nothing behind and raises an ``OSError`` that names ``what``, the folder and the way out.
    ``marker`` is a file that exists in a finished folder: a concurrent writer that got there first wins."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        try:
            write(tmp)
        except Exception as e:
            # safetensors reports a full disk as its own error type ("I/O error: No space left on device")
            if not (isinstance(e, OSError) or "I/O error" in str(e)):
                raise
            raise OSError(f"could not save {what} under {target.parent}: {e}; free some space there "
                          "or set RAG_ACCEL_HOME to a folder with room") from e
        try:
            tmp.rename(target)  # atomic: a half-written copy is never seen as the cache
        except OSError:
            if not (target / marker).is_file():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_container(path: str | Path, kind: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise CorruptFileError(f"{path} is not a rag_accel {kind} file (bad magic)")
    try:
        n = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        header = json.loads(data[start : start + n])
        payload = data[start + n :]
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path} is corrupted: unreadable header ({e})") from e
    if header.get("kind") != kind:
        raise CorruptFileError(f"{path} holds a {header.get('kind')!r}, not a {kind!r}")
    expected = sum(size for _, size in header["parts"])
    if len(payload) != expected:
        raise CorruptFileError(f"{path} is corrupted: payload is {len(payload)} bytes, header says {expected}")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CorruptFileError(f"{path} is corrupted: checksum mismatch")
    parts, offset = {}, 0
    for name, size in header["parts"]:
        parts[name] = payload[offset : offset + size]
        offset += size
    return header["meta"], parts
