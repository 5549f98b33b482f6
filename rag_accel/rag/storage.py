"""One-file, checksummed, atomically replaced containers for indexes and caches.

Layout (format 2): ``MAGIC`` (16 bytes) | header length (8 bytes, little endian) | JSON header | payload |
SHA-256 of all the bytes before it (32 bytes). The header holds the kind, the saver's metadata and the name
and length of each payload part. Loading checks the checksum first, then the header against the kind's
:class:`Format` (exact keys, types, ranges): a damaged or malformed file is a :class:`CorruptFileError`
naming it. Saving writes a temporary file beside the target (named after this host and process, so that a
later save or load can remove those of killed saves), gives it the target's mode, fsyncs it and
``os.replace``-s it over the target: an interrupted save leaves the previous file intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import reprlib
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 2
MAGIC_PREFIX = b"RAG-ACCEL-FILE"
MAGIC = MAGIC_PREFIX + b"%d\n" % VERSION
_LENGTH = len(MAGIC) + 8  # where the header starts
_DIGEST = 32
_HEADER = {"kind": str, "meta": dict, "parts": list}
_HOST = re.sub(r"\W", "_", socket.gethostname(), flags=re.ASCII)[:24] or "host"
_TEMP = r"\.{name}\.(?:(\w+)-(\d+)\.)?[a-z0-9_]{{8}}\.tmp"  # .NAME.HOST-PID.RANDOM.tmp (no HOST-PID: format 1)
_OLD_TEMP_STALE_S = 3600  # a format-1 temporary file (no pid in its name) untouched this long is stale


class CorruptFileError(ValueError):
    """A stored index or cache file is truncated, altered, not one of ours or of an older format."""


@dataclass(frozen=True)
class Format:
    """One kind of file: its name, its metadata schema and its payload parts, in order.

    A schema maps each key to ``str`` (or another exact type), a ``range`` of integers, or a tuple of
    allowed values."""

    kind: str
    meta: dict[str, Any]
    parts: tuple[str, ...]


def corrupt(path: str | Path, why: str) -> CorruptFileError:
    return CorruptFileError(f"{path} is corrupted: {why}; re-create it or restore a backup")


def _fits(value: Any, spec: Any) -> bool:
    if isinstance(spec, range):
        return type(value) is int and value in spec
    if isinstance(spec, tuple):
        return isinstance(value, str) and value in spec
    return type(value) is spec


def _expected(spec: Any) -> str:
    if isinstance(spec, range):
        return f"an integer in [{spec.start}, {spec.stop - 1}]"
    if isinstance(spec, tuple):
        return f"one of {list(spec)}"
    return f"a {spec.__name__}"


def _problem(obj: Any, schema: dict[str, Any], what: str) -> str | None:
    """What is wrong with ``obj`` against ``schema`` (exact keys, then each value), or None."""
    if type(obj) is not dict:
        return f"{what} is a {type(obj).__name__}, not an object"
    if obj.keys() != schema.keys():
        return f"{what} has the keys {sorted(obj)}, expected {sorted(schema)}"
    for key, spec in schema.items():
        if not _fits(obj[key], spec):
            return f"{what}: {key!r} is {reprlib.repr(obj[key])}, expected {_expected(spec)}"
    return None


def check_fields(path: str | Path, obj: Any, schema: dict[str, Any], what: str) -> None:
    """Raise :class:`CorruptFileError` unless ``obj`` is a dict matching ``schema`` exactly."""
    problem = _problem(obj, schema, what)
    if problem:
        raise corrupt(path, problem)


def json_part(path: str | Path, blob: bytes, what: str) -> Any:
    try:
        return json.loads(blob)
    except (ValueError, RecursionError) as e:
        raise corrupt(path, f"unreadable {what} ({e})") from e


def faiss_part(path: str | Path, blob: bytes, type_name: str, dim: int, count: int) -> Any:
    """The FAISS index in ``blob``, checked to be an inner-product ``type_name`` of ``dim`` dimensions holding
    ``count`` vectors."""
    import faiss

    try:
        index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
    except Exception as e:  # the checksum passed: a foreign or incompatible payload
        raise corrupt(path, f"unreadable FAISS index ({e})") from e
    got = (type(index).__name__, index.metric_type, index.d, index.ntotal)
    want = (type_name, faiss.METRIC_INNER_PRODUCT, dim, count)
    if got != want:
        describe = "{}, metric {}, {} dimensions, {} vectors".format
        raise corrupt(path, f"the FAISS index is {describe(*got)}; expected {describe(*want)}")
    return index


# --- saving -----------------------------------------------------------------------------------------------------

def save_container(path: str | Path, fmt: Format, meta: dict[str, Any], parts: dict[str, bytes]) -> None:
    """Write ``meta`` and ``parts`` as a ``fmt`` file at ``path``, atomically; an OSError names the file."""
    path = Path(path)
    problem = _problem(meta, fmt.meta, "meta") or (tuple(parts) != fmt.parts and f"parts {list(parts)}")
    if problem:
        raise ValueError(f"refusing to save {path} as a {fmt.kind} that could not be loaded: {problem}")
    header = json.dumps({"kind": fmt.kind, "meta": meta, "parts": [[n, len(b)] for n, b in parts.items()]}).encode()
    chunks = [MAGIC, len(header).to_bytes(8, "little"), header, *parts.values()]
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    _write_file(path, [*chunks, digest.digest()], f"the {fmt.kind.replace('-', ' ')}")


def _write_file(path: Path, chunks: Iterable[bytes], what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        mode = _mode(path)
        fd, tmp = _create_temp(path)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a mix
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        no_room = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise _save_error(e, f"{what} to {path}", "free some space there or save it elsewhere" if no_room
                          else "check that its folder can be written, or save it elsewhere") from e
    _fsync_dir(path.parent)


def _mode(path: Path) -> int | None:
    """The permission bits of the file ``path``, or None if there is none (a new file gets the umask's)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{_HOST}-{os.getpid()}."


def _create_temp(target: Path) -> tuple[int, Path]:
    """A new temporary file beside ``target``, with the mode ``open()`` would give (0666 less the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    while True:
        tmp = target.with_name(f"{_temp_prefix(target)}{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform allows)."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _save_error(e: Exception, what: str, hint: str) -> OSError:
    """``e`` as an OSError (same errno, so the same subclass) whose message names ``what`` and the way out."""
    code = getattr(e, "errno", None)
    reason = getattr(e, "strerror", None) or str(e)
    if getattr(e, "filename", None):
        reason += f": {e.filename}"
    message = f"could not save {what}: {reason}; {hint}"
    return OSError(code, message) if code else OSError(message)


def remove_stale_temps(target: Path) -> None:
    """Delete the temporary files (or folders) that killed saves of ``target`` left beside it.

    One is stale when the process named in it (on this host) is gone; a format-1 one, without a pid, when
    untouched for an hour. Those of live saves, in this process or another, are kept."""
    pattern = re.compile(_TEMP.format(name=re.escape(target.name)), re.ASCII)
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        try:
            if found and _is_stale(entry, *found.groups()):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        except OSError:
            pass  # gone already (another cleaner), or not ours to remove: not this save's problem


def _is_stale(entry: os.DirEntry, host: str | None, pid: str | None) -> bool:
    if host is None:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > _OLD_TEMP_STALE_S
    return host == _HOST and int(pid) != os.getpid() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # someone else's process, or no such number: keep its file
        return True
    return True


def save_folder(target: str | Path, write: Callable[[Path], None], *, what: str, marker: str) -> Path:
    """Make the folder ``target`` by calling ``write(tmp)`` on a temporary folder beside it, then renaming
    it into place: a half-written folder is never seen as ``target``, and a failed write (a full disk, say)
    leaves nothing behind and raises an ``OSError`` that names ``what``, the folder and the way out.
    ``marker`` is a file that exists in a finished folder: a concurrent writer that got there first wins."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent))
    try:
        try:
            write(tmp)
        except Exception as e:
            # safetensors reports a full disk as its own error type ("I/O error: No space left on device")
            if not (isinstance(e, OSError) or "I/O error" in str(e)):
                raise
            raise _save_error(e, f"{what} under {target.parent}",
                              "free some space there or set RAG_ACCEL_HOME to a folder with room") from e
        try:
            tmp.rename(target)  # atomic: a half-written copy is never seen as the cache
        except OSError:
            if not (target / marker).is_file():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- loading ----------------------------------------------------------------------------------------------------

def load_container(path: str | Path, fmt: Format) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The metadata and payload parts of the ``fmt`` file at ``path``, every byte checked."""
    path = Path(path)
    remove_stale_temps(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    header, payload = _unpack(path, path.read_bytes(), fmt.kind)
    check_fields(path, header, _HEADER, "the header")
    if header["kind"] != fmt.kind:
        raise CorruptFileError(f"{path} holds a {reprlib.repr(header['kind'])}, not a {fmt.kind!r}")
    check_fields(path, header["meta"], fmt.meta, "the header's meta")
    return header["meta"], _split(path, header["parts"], payload, fmt.parts)


def _unpack(path: Path, data: bytes, kind: str) -> tuple[Any, bytes]:
    """The parsed header and the payload of ``data``, after checking its magic, version and checksum."""
    if not data.startswith(MAGIC_PREFIX):
        raise CorruptFileError(f"{path} is not a rag_accel {kind} file (bad magic)")
    if not data.startswith(MAGIC):
        version = data[len(MAGIC_PREFIX) : len(MAGIC)].decode("ascii", "replace").strip()
        raise CorruptFileError(f"{path} is in rag_accel file format {version}, but this version reads format "
                               f"{VERSION} only; re-create it with this version")
    if len(data) < _LENGTH + _DIGEST or hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise corrupt(path, "checksum mismatch (the file is truncated or was altered)")
    n = int.from_bytes(data[len(MAGIC) : _LENGTH], "little")
    if n > len(data) - _LENGTH - _DIGEST:
        raise corrupt(path, f"the header length ({n} bytes) runs past the end of the file")
    try:
        header = json.loads(data[_LENGTH : _LENGTH + n])
    except (ValueError, RecursionError) as e:
        raise corrupt(path, f"unreadable header ({e})") from e
    return header, data[_LENGTH + n : -_DIGEST]


def _split(path: Path, sizes: list, payload: bytes, names: tuple[str, ...]) -> dict[str, bytes]:
    """The payload cut into its parts, after checking the header lists exactly ``names`` with sizes that add up."""
    if not (all(type(p) is list and len(p) == 2 and type(p[0]) is str and type(p[1]) is int and p[1] >= 0
                for p in sizes) and tuple(p[0] for p in sizes) == names):
        raise corrupt(path, f"the header lists the parts {reprlib.repr(sizes)}, expected {list(names)} with sizes")
    total = sum(size for _, size in sizes)
    if total != len(payload):
        raise corrupt(path, f"payload is {len(payload)} bytes, header says {total}")
    parts, offset = {}, 0
    for name, size in sizes:
        parts[name], offset = payload[offset : offset + size], offset + size
    return parts
