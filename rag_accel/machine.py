"""What other processes do with this machine's cores, read from ``/proc/stat`` (engine-free: no torch).

Where another job holds a core, a step computed on threads bound to it waits for it: the transformers engine's
torch threads (:mod:`rag_accel.hf.threads`) and vLLM's (``VLLM_CPU_OMP_THREADS_BIND``, hinted by ``rag-accel
serve``) alike: :func:`free_core_list` is the binding ``rag-accel serve`` and ``VllmDecoder`` give vLLM's threads
where the user sets none.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

__all__ = ["BUSY", "busy_by_core", "busy_cores", "cores", "cpu_identity", "cpu_list", "cpu_spec", "free_threads",
           "free_core_list"]

#: A core counts as held by another job from this much of its time on.
BUSY = 0.6
#: The vector and matrix units a CPU's kernels (and so what is measured on it) depend on.
_UNITS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_identity() -> str:
    """The CPU as what is measured on it depends on it (a calibration, an invariance verdict): its model name and
    the vector and matrix units it has.

    Example:
        >>> isinstance(cpu_identity(), str) and len(cpu_identity()) > 0
        True
    """
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "CPU part") and value.strip():
            name = value.strip()
        elif key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    return f"{name} [{' '.join(u for u in _UNITS if u in flags)}]"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _cpu_times() -> list[tuple[int, int]] | None:
    """(total, idle) ticks of each core so far, from ``/proc/stat`` (``None`` where there is none)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
        times = [[int(x) for x in parts[1:]] for parts in lines]
    except (OSError, ValueError):
        return None
    return [(sum(t), t[3] + (t[4] if len(t) > 4 else 0)) for t in times] or None  # idle + iowait


def _own_ticks() -> dict[int, tuple[int, int]]:
    """This process's threads: ticks of CPU time so far and the core each last ran on, by thread id."""
    out = {}
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # (from the state on: utime is the 12th, stime the
            # 13th, the core last run on the 37th)
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def busy_by_core(window_s: float = 0.25) -> dict[int, float]:
    """How busy other processes keep each core (0 to 1) over ``window_s``; empty where unknown. This thread is
    asleep meanwhile, and what the process's other threads did is taken out, so what is busy is someone else's."""
    before, own = _cpu_times(), _own_ticks()
    if before is None:
        return {}
    time.sleep(window_s)
    after, own_after = _cpu_times(), _own_ticks()
    if after is None or len(after) != len(before):
        return {}
    mine: dict[int, int] = {}
    for tid, (ticks, core) in own_after.items():
        mine[core] = mine.get(core, 0) + ticks - own.get(tid, (ticks, core))[0]
    out = {}
    for core, ((t0, i0), (t1, i1)) in enumerate(zip(before, after)):
        if t1 > t0:
            out[core] = max(0.0, min(1.0, 1 - (i1 - i0 + mine.get(core, 0)) / (t1 - t0)))
    return out


def busy_cores(window_s: float = 0.25) -> float:
    """How many of the machine's cores other processes keep busy, over ``window_s`` (0.0 where unknown); what this
    process's own threads did meanwhile (a thread of the program still at work, a spinning OpenMP thread) is
    taken out."""
    own = time.process_time()
    t0 = time.monotonic()
    busy = sum(busy_by_core(window_s).values())
    own = (time.process_time() - own) / max(time.monotonic() - t0, 1e-9)
    return max(0.0, busy - own)


def free_threads(busy: float, total: int | None = None) -> int:
    """The thread count that leaves ``busy`` of ``total`` cores (default: this process's) alone (at least one).

    Example:
        >>> free_threads(0.0, 2), free_threads(1.02, 2), free_threads(0.3, 2), free_threads(5.0, 4)
        (2, 1, 2, 1)
    """
    held = int(busy + (1 - BUSY))  # a core counts from BUSY of its time on
    return max(1, (total or cores()) - held)


def cpu_list(spec: str) -> set[int]:
    """The cores of a list such as ``0-1`` or ``0,2-3``.

    Example:
        >>> sorted(cpu_list("0,2-3"))
        [0, 2, 3]
    """
    out: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            out.update(range(int(lo), int(hi) + 1 if hi.isdigit() else int(lo) + 1))
    return out


def cpu_spec(ids: list[int] | set[int]) -> str:
    """The cores as a list such as ``0-1`` or ``0,2-3`` (:func:`cpu_list` reads it back).

    Example:
        >>> cpu_spec([3, 0, 2]), cpu_spec({0, 1})
        ('0,2-3', '0-1')
    """
    runs: list[list[int]] = []
    for c in sorted(ids):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def free_core_list(busy: dict[int, float] | None = None, allowed: set[int] | None = None,
                   root: Path = Path("/sys/devices/system")) -> list[int] | None:
    """The cores to bind an engine's compute threads to: one logical CPU of each physical core this process may
    run on (the last, as vLLM's own binding takes them), less those other processes keep busy (``busy``: as
    :func:`busy_by_core` reads it; every core where all are busy). ``None`` on a machine of several NUMA nodes,
    where vLLM's own binding keeps each rank on one node.

    Unlike vLLM's own binding, no core is kept back for its scheduler: on 2 cores that halves the compute.

    Example:
        >>> free_core_list({0: 0.05, 1: 0.98}, allowed={0, 1}, root=Path("/nonexistent"))
        [0]
        >>> free_core_list({0: 0.9, 1: 0.98}, allowed={0, 1}, root=Path("/nonexistent"))
        [0, 1]
    """
    if len(list((root / "node").glob("node[0-9]*"))) > 1:
        return None
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    physical: dict[str, int] = {}
    for c in sorted(allowed):
        try:
            siblings = (root / "cpu" / f"cpu{c}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(c)
        physical[siblings] = c  # (the last logical CPU of each physical core)
    usable = sorted(physical.values())
    if busy is None:  # (a core that looks held is watched again, longer: the binding lasts the engine's life)
        busy = busy_by_core()
        if any(busy.get(c, 0.0) >= BUSY for c in usable):
            again = busy_by_core(1.0)
            busy = {c: min(b, again.get(c, b)) for c, b in busy.items()}
    free = [c for c in usable if busy.get(c, 0.0) < BUSY]
    return free or usable
