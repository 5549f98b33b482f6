"""Where a vLLM engine that rag_accel starts writes: its caches under ``$RAG_ACCEL_HOME/vllm`` (kept, so a second
start compiles less), its temporary files (the sockets its processes meet at, the file their process group starts
from) in a folder of its own in the system's temporary folder, removed when the engine closes (vLLM alone leaves
them there at every start). No vLLM import here.

vLLM and torch read these places from the environment as the engine's processes start, and from
:func:`tempfile.gettempdir` in this process; they have no configuration field. So the one launcher that starts an
engine in the caller's process, :meth:`rag_accel.vllm.VllmDecoder.from_pretrained`, sets them for the time the engine
takes to start (:func:`engine_environment`) and puts everything back afterwards; ``rag-accel serve`` hands the caches'
places to the server's process (:func:`rag_accel.serving.serve.home_environment`). A place the caller's environment
names is left as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["engine_environment", "engine_temp_dir", "home_environment", "remove_temp_dir"]

#: The temporary folder, as Python (``TMPDIR``) and vLLM (``VLLM_RPC_BASE_PATH``: its processes' sockets) read it.
TEMP_VARIABLES = ("TMPDIR", "VLLM_RPC_BASE_PATH")


def home_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The caches an engine keeps, under ``$RAG_ACCEL_HOME/vllm``, where ``env`` does not name them: vLLM's
    (``VLLM_CACHE_ROOT``, else ``~/.cache/vllm``) and torch inductor's (``TORCHINDUCTOR_CACHE_DIR``, else a folder in
    the system's temporary folder)."""
    from ..models import cache_home

    root = cache_home() / "vllm"
    return {k: v for k, v in (("VLLM_CACHE_ROOT", str(root)), ("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")))
            if k not in env}


def engine_temp_dir() -> Path:
    """A fresh folder for one engine's temporary files, in the system's temporary folder: a short path, as the
    sockets in it must be (a socket's path holds at most 107 characters, which a deep ``RAG_ACCEL_HOME`` passes)."""
    return Path(tempfile.mkdtemp(prefix="rag-accel-vllm-"))


def remove_temp_dir(path: Path | None) -> None:
    """An engine's temporary folder, gone (what it holds is the closed engine's own)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def engine_environment(changes: Mapping[str, str], temp_dir: Path | None) -> Iterator[None]:
    """Within: ``os.environ`` has ``changes``, and ``temp_dir`` (unless ``None``) is this process's and its new
    processes' temporary folder (``TMPDIR``, ``VLLM_RPC_BASE_PATH``, :data:`tempfile.tempdir`) where the caller's
    environment names none; afterwards all of it is as it was."""
    updates = dict(changes)
    if temp_dir is not None and "TMPDIR" not in os.environ:
        updates.update({k: str(temp_dir) for k in TEMP_VARIABLES if k not in os.environ})
    saved = {k: os.environ.get(k) for k in updates}
    saved_tempdir = tempfile.tempdir
    os.environ.update(updates)
    if "TMPDIR" in updates:
        tempfile.tempdir = updates["TMPDIR"]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        tempfile.tempdir = saved_tempdir
