"""Running a ``rag-accel serve`` server from Python: for tests, notebooks and benchmarks.

:class:`Server` starts ``rag-accel serve`` as a subprocess in its own process group, waits until its
``/health`` answers, reads its spec-decode counters and stops it with everything it started
(:func:`group_processes` says what is left). :func:`shared_server` keeps one per process for test suites
that share a server across modules and packages.

The test suites' rule for vLLM lives here too, in one place: a test that needs vLLM (in this process,
:func:`import_vllm_or_skip`; or a server, :func:`vllm_python_or_skip`, :func:`shared_test_server`) is
skipped without it, and fails instead when ``RAG_ACCEL_REQUIRE_VLLM=1`` (CI's vLLM suite). Only those
functions import pytest.

The server itself (the ``vllm serve`` command line, vLLM's CLI) is :mod:`rag_accel.serving.serve`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Server", "free_port", "group_processes", "import_vllm_or_skip", "shared_server", "shared_test_server",
           "spec_decode_counters", "vllm_python_or_skip"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class Server:
    """``rag-accel serve`` as a subprocess, for tests, benchmarks and notebooks.

    Example:
        >>> with Server(options=["--max-model-len", "2048"], vllm_args=["--enforce-eager"]) as srv:  # doctest: +SKIP
        ...     RemoteDecoder(srv.base_url).generate("Hello", max_new_tokens=8)

    It runs in its own session (process group) with its output in ``log_path`` (default: a temporary
    file, removed when :meth:`stop` is clean, kept to read otherwise); :meth:`wait_ready`
    polls ``/health`` until it answers 200, the process dies (``RuntimeError`` with the log's tail)
    or ``timeout`` passes; :meth:`stop` sends SIGINT (vLLM shuts its engine down), then SIGTERM,
    then SIGKILL to the whole group, each after a bounded wait, and says whether the group is gone.

    Args:
        model: as ``rag-accel serve MODEL``.
        options: more ``rag-accel serve`` options (``--speculation off``, ``--max-reference-tokens`` ...).
        vllm_args: vLLM options (after ``--``).
        python: the interpreter with vLLM installed (default: this one).
        env: environment changes for the server (e.g. ``VLLM_CPU_OMP_THREADS_BIND``, ``LD_PRELOAD``).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", *, options: Sequence[str] = (),
                 vllm_args: Sequence[str] = (), python: str | None = None, host: str = "127.0.0.1",
                 port: int | None = None, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.cmd = [python or sys.executable, "-m", "rag_accel.cli", "serve", model, *options,
                    "--host", host, "--port", str(self.port)]
        if vllm_args:
            self.cmd += ["--", *vllm_args]
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self._own_log = False  # a temporary log made by start(): removed by a clean stop()
        self.proc: Any = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root (``.../v1``)."""
        return self.url + "/v1"

    def start(self) -> Server:
        import subprocess
        import tempfile

        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="rag-accel-serve-", suffix=".log")
            os.close(fd)
            self.log_path, self._own_log = Path(name), True
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def spec_decode_counters(self) -> tuple[float, float]:
        """The server's spec-decode totals from ``/metrics``: (draft tokens, accepted tokens); zeros
        on a server without speculation. Per-request counts are not served: take differences."""
        return spec_decode_counters(self.url)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Seconds until ``/health`` answered 200."""
        import urllib.request

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"the server was not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the server and everything it started; ``True`` if all of it ended by itself after
        SIGINT (no SIGTERM / SIGKILL was needed) and no process of its group is left."""
        import signal
        import subprocess

        if self.proc is None:
            return True
        clean = True
        pgid = self.proc.pid  # start_new_session: its own group
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                clean = False
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the server, then anything of its group left behind
            if not _group_alive(pgid):
                break
            if sig == signal.SIGTERM:
                deadline = time.monotonic() + 10  # engine processes may still be exiting after the server
                while _group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if not _group_alive(pgid):
                    break
            clean = False
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        clean = clean and not _group_alive(pgid)
        if clean and self._own_log:  # nothing to diagnose: leave no temporary file behind
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._own_log = None, False
        return clean

    def __enter__(self) -> Server:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def spec_decode_counters(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from a vLLM server's ``/metrics`` at ``url`` (``http://host:port``),
    summed over its engines (``vllm:spec_decode_num_draft_tokens_total`` / ``..._accepted_tokens_total``)."""
    import re
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=60) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M))

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


_SHARED: dict[tuple[Any, ...], Server] = {}
_SHARED_LOCK = threading.Lock()


def shared_server(python: str | None = None, *, model: str = "smollm2-135m-instruct", options: Sequence[str] = (),
                  vllm_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                  timeout: float = 900.0) -> Server:
    """One :class:`Server` per process for these arguments: started (and waited for) on the first
    call, stopped when the process exits. For test suites that share one server across modules
    and packages (a start takes a minute or more on a CPU)."""
    import atexit

    key = (python, model, tuple(options), tuple(vllm_args), tuple(sorted((env or {}).items())))
    with _SHARED_LOCK:
        srv = _SHARED.get(key)
        if srv is not None and srv.proc is not None and srv.proc.poll() is None:
            return srv
        srv = Server(model, options=options, vllm_args=vllm_args, python=python, env=env)
        srv.start()
        try:
            srv.wait_ready(timeout)
        except BaseException:
            srv.stop()
            raise
        if not _SHARED:
            atexit.register(lambda: [s.stop() for s in list(_SHARED.values())])
        _SHARED[key] = srv
        return srv


def group_processes(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` (Linux ``/proc``; elsewhere ``[pgid]``
    while the group exists)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _group_alive(pgid: int) -> bool:
    return bool(group_processes(pgid))


# --------------------------------------------------------------------------- vLLM in the test suites
REQUIRE_VLLM = "RAG_ACCEL_REQUIRE_VLLM"  # "1": a missing vLLM is an error, not a skip (CI's vLLM suite)
VLLM_PYTHON = "RAG_ACCEL_VLLM_PYTHON"  # a Python with vLLM, for the server (a virtualenv of its own)


def _vllm_required() -> bool:
    """Whether ``RAG_ACCEL_REQUIRE_VLLM=1``: the tests that need vLLM fail without it instead of skipping."""
    return os.environ.get(REQUIRE_VLLM) == "1"


def import_vllm_or_skip() -> Any:
    """vLLM, for a test module that runs it in this process; without it the calling module is skipped,
    or, with ``RAG_ACCEL_REQUIRE_VLLM=1``, the import error is raised."""
    if _vllm_required():
        import vllm

        return vllm
    import pytest

    return pytest.importorskip("vllm")


def vllm_python_or_skip() -> str:
    """The absolute path of the Python named by ``RAG_ACCEL_VLLM_PYTHON`` (a virtualenv with vLLM: it
    cannot share the adapters' one), for a test that starts a server. Unset: the calling test is skipped,
    or fails with ``RAG_ACCEL_REQUIRE_VLLM=1``; without the openai client (the adapters' remote mode)
    it is skipped too, unless required."""
    import pytest

    python = os.environ.get(VLLM_PYTHON)
    if not python:
        if _vllm_required():
            pytest.fail(f"{REQUIRE_VLLM}=1 but {VLLM_PYTHON} is unset: name a Python with vLLM")
        pytest.skip(f"this test starts a rag-accel serve server: set {VLLM_PYTHON} to a Python with vLLM "
                    "(e.g. .venv-vllm/bin/python; README, 'Run the tests')")
    if not _vllm_required():
        pytest.importorskip("openai", reason="the adapters' remote mode needs the openai client: "
                                             "pip install 'rag-accel[remote]'")
    return os.path.abspath(python)  # not resolve(): a virtualenv's python is a symlink to the base interpreter


def shared_test_server() -> Server:
    """The adapters' test server: ``rag-accel serve`` with our proposer and the offline model in float32
    (2048 tokens, eager), started with :func:`vllm_python_or_skip`'s Python, one per test process
    (:func:`shared_server`; a test module that uses it is marked ``xdist_group("rag-accel-serve")``, so
    that under ``-n 2 --dist loadgroup`` one worker runs them all and starts one). ``VLLM_CPU_KVCACHE_SPACE`` (default
    2 GiB), ``VLLM_CPU_OMP_THREADS_BIND`` (default: cores 0-1, or 0 on one core) and
    ``RAG_ACCEL_SERVE_TIMEOUT`` (seconds to start, default 900) are read from the environment."""
    python = vllm_python_or_skip()
    bind = "0-1" if (os.cpu_count() or 1) >= 2 else "0"
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind)}
    return shared_server(python, options=["--max-model-len", "2048"], vllm_args=["--enforce-eager"], env=env,
                         timeout=float(os.environ.get("RAG_ACCEL_SERVE_TIMEOUT", "900")))
