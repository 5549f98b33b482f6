"""What other processes do with this machine's cores, read from ``/proc/stat`` (engine-free: no torch).

Where another job holds a core, a step computed on threads bound to it waits for it: the transformers engine's
torch threads (:mod:`rag_accel.hf.threads`) and vLLM's (``VLLM_CPU_OMP_THREADS_BIND``, hinted by ``rag-accel
serve``) alike.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

__all__ = ["BUSY", "busy_by_core", "busy_cores", "cores", "cpu_identity", "cpu_list", "free_threads"]

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


def busy_by_core(window_s: float = 0.25) -> dict[int, float]:
    """How busy other processes keep each core (0 to 1) over ``window_s``; empty where unknown. This process is
    asleep meanwhile, so what is busy is someone else's."""
    before = _cpu_times()
    if before is None:
        return {}
    time.sleep(window_s)
    after = _cpu_times()
    if after is None or len(after) != len(before):
        return {}
    out = {}
    for core, ((t0, i0), (t1, i1)) in enumerate(zip(before, after)):
        if t1 > t0:
            out[core] = max(0.0, min(1.0, 1 - (i1 - i0) / (t1 - t0)))
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
