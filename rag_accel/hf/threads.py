"""How many threads torch computes on, where another job already holds some of the cores.

torch runs one thread per core, and a step waits for its slowest thread: where another job holds a core, the thread
that shares it runs at a fraction of its speed and the step with it. Measured (benchmarks/results/threads_cpu_smollm2,
SmolLM2-135M float32, a 2-core CPU with another process spinning on one core): a one-token step took 599 ms on two
threads against 57 ms on one (quiet: 36 ms on two, 58 ms on one). So where cores are busy, fewer threads are faster.

:func:`busy_cores` reads how many cores other processes keep busy now (``/proc/stat`` over a fraction of a second);
:func:`free_threads` is the thread count that leaves them alone. The library only warns
(:func:`warn_if_oversubscribed`, at a decoder's load: a program that set its own threads is not overruled); the
``rag-accel`` commands, programs of their own, take the count (:func:`use_free_cores`) unless ``OMP_NUM_THREADS``
says otherwise.
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["busy_cores", "free_threads", "use_free_cores", "warn_if_oversubscribed"]

#: A core counts as held by another job from this much of its time on.
BUSY = 0.6


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle


def busy_cores(window_s: float = 0.25) -> float:
    """How many of the machine's cores other processes keep busy, over ``window_s`` (0.0 where unknown)."""
    before = _cpu_times()
    if before is None:
        return 0.0
    start = time.process_time()
    time.sleep(window_s)
    after = _cpu_times()
    if after is None or after[0] <= before[0]:
        return 0.0
    total, idle = after[0] - before[0], after[1] - before[1]
    ticks = total / (os.cpu_count() or 1)  # a core's ticks in the window
    mine = (time.process_time() - start) * (ticks / window_s)  # (this process's own, in the same ticks)
    return max(0.0, (total - idle - mine) / ticks)


def free_threads(busy: float, cores: int | None = None) -> int:
    """The thread count that leaves ``busy`` cores alone (at least one).

    Example:
        >>> free_threads(0.0, 2), free_threads(1.02, 2), free_threads(0.3, 2), free_threads(5.0, 4)
        (2, 1, 2, 1)
    """
    cores = cores or _cores()
    held = int(busy + (1 - BUSY))  # a core counts from BUSY of its time on
    return max(1, cores - held)


def warn_if_oversubscribed() -> str | None:
    """At a decoder's load on a CPU: one line on stderr (returned too) where torch's threads outnumber the cores
    other processes leave free; nothing changes."""
    from ..models import announce

    threads = torch.get_num_threads()
    if threads == 1:  # (nothing to spare: no need to look)
        return None
    busy = busy_cores()
    free = free_threads(busy)
    if threads <= free:
        return None
    line = (f"other processes keep {busy:.1f} of {_cores()} cores busy and torch computes on {threads} threads, "
            f"whose steps then wait for the busy cores (several times slower): torch.set_num_threads({free}) "
            f"(or OMP_NUM_THREADS={free}) before loading is faster while they run")
    announce(line)
    return line


def use_free_cores() -> int | None:
    """For the ``rag-accel`` commands: compute on the cores other processes leave free, unless ``OMP_NUM_THREADS``
    sets the count; says so in one line. Returns the count set, ``None`` where nothing changed."""
    from ..models import announce

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    busy = busy_cores()
    free = free_threads(busy)
    if free >= torch.get_num_threads():
        return None
    torch.set_num_threads(free)
    announce(f"other processes keep {busy:.1f} of {_cores()} cores busy: computing on {free} thread"
             f"{'s' if free > 1 else ''} (OMP_NUM_THREADS sets it)")
    return free
