"""``rag-accel serve``: vLLM's OpenAI-compatible server with our proposer configured.

The command is vLLM's own ``vllm serve`` with our options added, nothing else changed: the proposer
(``--speculative-config '{"method": "custom_class", "model": "rag_accel.vllm.RagProposer", ...}'``), its row tracker
(``--logits-processors rag_accel.vllm:RowTracker``), OpenAI's Predicted Outputs
(``--middleware rag_accel.vllm.predictions.PredictedOutputs``) and the engine's exact mode
(``--additional-config``). Every vLLM option passes through after ``--``. The process then *becomes* that server
(``exec``): signals reach vLLM directly.

A request's documents travel as a prediction or in the body's ``vllm_xargs`` (:class:`rag_accel.wire.RequestArgs`;
``docs/vllm-and-serving.md`` shows a client); bad ones are refused for that request with HTTP 400 and the server
serves on. ``--speculation ngram``, ``suffix`` and ``off`` start the same server with vLLM's own proposers, or none,
for comparison. Running such a server from Python is :mod:`rag_accel.serving.server_process`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..config import VLLM_DRAFT_TOKENS

__all__ = ["cpu_backend", "cpu_hints", "engine_ranks", "vllm_bind_hint", "default_dtype", "exec_server", "home_environment",
           "model_vocab_size",
           "resolve_model", "serve_command", "shell_line", "speculative_options", "vllm_cli", "vllm_executable",
           "vllm_installed"]


def resolve_model(model: str) -> tuple[str, str | None]:
    """(what vLLM loads, the name clients use or ``None`` for vLLM's default): an offline model
    (``smollm2-135m-instruct``, ``gemma-3-270m``) becomes its local float32 folder (converted on first
    use), served under that short name; anything else (a Hugging Face name, a folder) goes to vLLM as is."""
    from ..models import OFFLINE_MODELS, local_model

    if model in OFFLINE_MODELS:
        return local_model(model), model
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


def kv_cache_options(model: str, dtype: str, max_model_len: int | None, extra: Sequence[str],
                     env: Mapping[str, str], available: int | None = None) -> list[str]:
    """The server's KV cache on a CPU, where neither ``VLLM_CPU_KVCACHE_SPACE`` nor ``--kv-cache-memory-bytes``
    sizes it: a ``VllmDecoder``'s (:func:`rag_accel.vllm.requests.default_kv_cache_bytes`: room for 32,768 tokens, at
    least one whole sequence, at most a quarter of the memory available). vLLM's own default takes most of the
    machine's memory, and the start spends many seconds filling it. ``[]`` where the model's layout cannot be
    read here (vLLM then sizes it)."""
    if "VLLM_CPU_KVCACHE_SPACE" in env or _given(extra, "--kv-cache-memory-bytes"):
        return []
    from ..vllm.requests import default_kv_cache_bytes

    size = default_kv_cache_bytes(model, dtype, max_model_len or _option_value(extra, ("--max-model-len",)), available)
    return [] if size is None else ["--kv-cache-memory-bytes", str(size)]


def model_text_bound(model: str) -> tuple[int, str | None] | None:
    """:attr:`~rag_accel.vllm.requests.ServerSettings.text_bound` for ``model``'s tokenizer: the lower bound on the
    tokens of text
    (:func:`rag_accel.references.text_bound`) by which the server's admission counts text references
    against ``--max-reference-tokens`` before any tokenising, read from the model folder's
    ``tokenizer.json``; ``None`` where there is none here or it has no certain bound (text then counts
    when the worker tokenises it)."""
    from ..references import tokenizer_json_bound
    from ..vllm.requests import encode_text_bound

    try:
        spec = json.loads((Path(model) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a hub name, no fast tokenizer here: no bound
        return None
    return encode_text_bound(tokenizer_json_bound(spec))


def speculative_options(speculation: str, max_draft_tokens: int = VLLM_DRAFT_TOKENS) -> list[str]:
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
    from ..vllm.requests import TRACKER_PATH, speculative_config  # (no vLLM import)

    spec = speculative_config(speculation, max_draft_tokens)
    if spec is None:
        return []
    options = ["--speculative-config", json.dumps(spec)]
    if speculation == "ours":
        options += ["--logits-processors", TRACKER_PATH]
    return options


def vllm_executable() -> list[str]:
    """How to start vLLM's CLI from this Python: the ``vllm`` script beside it; where only
    ``vllm-cpu`` is installed, ``python -m rag_accel.serving.serve`` (:func:`vllm_cli`, the same CLI)."""
    if _distribution_version("vllm") is None:
        return [sys.executable, "-m", "rag_accel.serving.serve"]
    script = Path(sys.executable).parent / "vllm"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def vllm_installed() -> bool:
    """Whether this Python has vLLM (``vllm`` or the CPU build ``vllm-cpu``), found without importing it."""
    return _distribution_version("vllm") is not None or _distribution_version("vllm-cpu") is not None


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
    from ..vllm.patches import answer_vllm_version_as_vllm_cpu

    if _distribution_version("vllm") is None and _distribution_version("vllm-cpu") is not None:
        answer_vllm_version_as_vllm_cpu()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def _given(extra: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in extra)


def _option_text(extra: Sequence[str], names: Sequence[str]) -> tuple[int, int, str] | None:
    """Where the first of ``names`` is given in ``extra`` (``--x v`` or ``--x=v``): (its index, the arguments it
    takes, its value); ``None``: not given."""
    for i, a in enumerate(extra):
        for name in names:
            if a == name and i + 1 < len(extra):
                return i, 2, extra[i + 1]
            if a.startswith(name + "="):
                return i, 1, a.split("=", 1)[1]
    return None


def _option_value(extra: Sequence[str], names: Sequence[str]) -> int | None:
    """The integer value of the first of ``names`` given in ``extra`` (``--x 2`` or ``--x=2``)."""
    found = _option_text(extra, names)
    try:
        return None if found is None else int(found[2])
    except ValueError:
        return None  # vLLM's own parser says what is wrong


def serve_command(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str | None = None,
                  max_model_len: int | None = None, speculation: str = "ours",
                  max_draft_tokens: int = VLLM_DRAFT_TOKENS, served_model_name: str | None = None,
                  exact: str = "auto", extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line (argv) for these options; ``exact``: the workers' exact mode
    (:func:`rag_accel.vllm.requests.exact_mode`), in the engine's ``--additional-config`` (merged with one in
    ``extra``); ``extra``: more vLLM options, as given.

    Example:
        >>> cmd = serve_command("/models/x", port=8001, dtype="float32", speculation="off", extra=["--seed", "1"])
        >>> cmd[cmd.index("serve"):]  # doctest: +NORMALIZE_WHITESPACE
        ['serve', '/models/x', '--host', '127.0.0.1', '--port', '8001', '--dtype', 'float32',
         '--middleware', 'rag_accel.vllm.predictions.PredictedOutputs', '--additional-config',
         '{"rag_accel_exact": "auto"}', '--seed', '1']
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    for option in ("--speculative-config", "--logits-processors"):
        if speculation != "off" and _given(extra, option):
            raise ValueError(f"{option} is set by --speculation; pass --speculation off to give your own")
    if speculation == "ours":
        from ..vllm.requests import check_layout

        check_layout(_option_value(extra, ("--pipeline-parallel-size", "-pp")) or 1)
    cmd = [*vllm_executable(), "serve", model, "--host", host, "--port", str(port)]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if served_model_name and not _given(extra, "--served-model-name"):
        cmd += ["--served-model-name", served_model_name]
    cmd += speculative_options(speculation, max_draft_tokens)
    # OpenAI's Predicted Outputs (rag_accel.vllm.predictions), in every mode: with another mode than ours a
    # prediction is refused (HTTP 400), never silently ignored
    from ..vllm.requests import MIDDLEWARE_PATH  # (no vLLM import)

    cmd += ["--middleware", MIDDLEWARE_PATH]
    from ..vllm.requests import exact_config

    extra = list(extra)
    found = _option_text(extra, ("--additional-config",))
    given = None
    if found is not None:  # (the caller's own keys go in one option with the mode)
        at, taken, given = found
        del extra[at:at + taken]
    try:
        cmd += ["--additional-config", json.dumps(exact_config(exact, given))]
    except json.JSONDecodeError as e:
        raise ValueError(f"--additional-config is not JSON: {e}") from None
    return cmd + extra


def cpu_backend() -> bool:
    """Whether vLLM here runs on its CPU backend, decided without importing torch (the server imports it itself,
    later): vLLM's CPU build installed means a CPU; otherwise a GPU driver present (NVIDIA's, or ROCm's
    ``/dev/kfd``) means a GPU."""
    if _distribution_version("vllm-cpu") is not None:
        return True
    return not any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd"))


def default_dtype() -> str:
    """float32 on a CPU (the outputs of the transformers engine's greedy; vLLM's CPU default would be bfloat16),
    else vLLM's ``auto``."""
    return "float32" if cpu_backend() else "auto"


def shell_line(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The command as one shell line, with the environment it adds in front."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def home_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Where the server writes, on any device, where ``env`` (the caller's environment) does not say: its caches
    under ``$RAG_ACCEL_HOME/vllm`` (:func:`rag_accel.vllm.launch.home_environment`) and its temporary files
    (``TMPDIR``, else ``/tmp``), among them the file its workers meet at, ``vllm_dist_<id>``, which vLLM 0.32 leaves
    behind at every engine start (``get_file_store_init_method``); under a home too deep for its sockets' paths, a
    folder of the user's own in the system's temporary folder. :func:`exec_server` makes the folder.
    """
    from ..models import cache_home
    from ..vllm.launch import home_environment as caches

    out = caches(env)
    if "TMPDIR" not in env:
        tmp = cache_home() / "vllm" / "tmp"
        if len(str(tmp)) > SOCKET_FOLDER_CHARS:  # (a deep home: its sockets' paths would be too long to bind)
            import tempfile

            tmp = Path(tempfile.gettempdir()) / f"rag-accel-serve-{os.getuid()}"
        out["TMPDIR"] = str(tmp)
    return out


#: The longest temporary folder the server's processes can make their sockets in: a socket's path holds at most 107
#: characters, and vLLM names each one by a 36-character id in that folder.
SOCKET_FOLDER_CHARS = 70


def vllm_bind_hint(bind: str | None, busy: dict[int, float] | None = None) -> str | None:
    """For ``rag-accel serve`` on a CPU: where other processes hold cores vLLM's threads are bound to
    (``VLLM_CPU_OMP_THREADS_BIND``, the user's or :func:`rag_accel.vllm.launch.cpu_environment`'s; unset: vLLM's own
    binding), the binding that leaves them out.

    Example:
        >>> vllm_bind_hint("0-1", {0: 0.05, 1: 0.98})
        'other processes keep core 1 busy, where VLLM_CPU_OMP_THREADS_BIND=0-1 binds vLLM threads that each step waits for: VLLM_CPU_OMP_THREADS_BIND=0 computes on the free ones'
        >>> vllm_bind_hint("0", {0: 0.05, 1: 0.98}) is None
        True
    """
    from ..machine import BUSY, busy_by_core, cpu_list

    busy = busy_by_core() if busy is None else busy
    held = sorted(c for c, b in busy.items() if b >= BUSY)
    if not held:
        return None
    bound = cpu_list(bind) if bind and bind != "auto" else set(busy)
    clash = sorted(set(held) & bound)
    free = sorted(c for c in busy if c not in held)
    if not clash or not free:
        return None
    cores = ", ".join(map(str, clash))
    return (f"other processes keep core{'s' if len(clash) > 1 else ''} {cores} busy, where "
            f"VLLM_CPU_OMP_THREADS_BIND={bind or '(unset: vLLM binds its own)'} binds vLLM threads that each step "
            f"waits for: VLLM_CPU_OMP_THREADS_BIND={','.join(map(str, free))} computes on the free ones")


def cpu_hints(env: Mapping[str, str], cmd: Sequence[str] = ()) -> list[str]:
    """Settings vLLM's CPU backend needs that are not set (printed, never set for the user); ``cmd``: the server's
    command line (a KV cache it sizes needs no hint)."""
    hints = []
    if "VLLM_CPU_KVCACHE_SPACE" not in env and not _given(cmd, "--kv-cache-memory-bytes"):
        hints.append("VLLM_CPU_KVCACHE_SPACE (GiB of KV cache; this model's layout could not be read here to size "
                     "it, and vLLM's own default reserves most of the memory): e.g. VLLM_CPU_KVCACHE_SPACE=2")
    return hints


def engine_ranks(extra: Sequence[str]) -> int:
    """The ranks a server's engine runs on one machine, from its vLLM options: tensor, pipeline and data parallel
    sizes multiplied (each 1 where not given)."""
    ranks = 1
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                  ("--data-parallel-size", "-dp")):
        ranks *= _option_value(extra, names) or 1
    return ranks


def exec_server(cmd: Sequence[str], env_changes: Mapping[str, str]) -> None:
    """Replace this process by the server (POSIX ``exec``): it keeps this PID, so a signal sent to
    ``rag-accel serve`` reaches vLLM itself. A ``TMPDIR`` it sets (:func:`home_environment`) is made first: Python
    would fall back to ``/tmp`` without saying so."""
    env = {**os.environ, **env_changes}
    if "TMPDIR" in env_changes:
        Path(env_changes["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], list(cmd), env)


def _remove_stale_openmp_files() -> None:
    """At the server's exit: the Intel OpenMP files of its engine's ended processes, gone."""
    from ..vllm.launch import remove_stale_openmp_files

    remove_stale_openmp_files()


if __name__ == "__main__":  # python -m rag_accel.serving.serve serve MODEL ...: the same as `vllm serve MODEL ...`
    import atexit

    atexit.register(_remove_stale_openmp_files)
    vllm_cli(sys.argv[1:])
