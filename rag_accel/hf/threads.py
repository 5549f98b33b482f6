"""How many threads torch computes on, where another job already holds some of the cores.

torch runs one thread per core, and a step waits for its slowest thread: where another job holds a core, the thread
that shares it runs at a fraction of its speed and the step with it. Measured (benchmarks/results/threads_cpu_smollm2,
SmolLM2-135M float32, a 2-core CPU with another process spinning on one core): a one-token step took 599 ms on two
threads against 57 ms on one (quiet: 36 ms on two, 58 ms on one). So where cores are busy, fewer threads are faster.

:func:`rag_accel.machine.busy_cores` reads how many cores other processes keep busy now (``/proc/stat`` over a
fraction of a second); :func:`~rag_accel.machine.free_threads` is the thread count that leaves them alone. The
library only warns (:func:`warn_if_oversubscribed`, at a decoder's load: a program that set its own threads is not
overruled); the
``rag-accel`` commands, programs of their own, take the count (:func:`use_free_cores`) unless ``OMP_NUM_THREADS``
says otherwise.
"""

from __future__ import annotations

import os

from ..machine import busy_cores, cores, free_threads

__all__ = ["use_free_cores", "warn_if_oversubscribed"]


def warn_if_oversubscribed() -> str | None:
    """At a decoder's load on a CPU: one line on stderr (returned too) where torch's threads outnumber the cores
    other processes leave free; nothing changes."""
    import torch

    from ..models import announce

    threads = torch.get_num_threads()
    if threads == 1:  # (nothing to spare: no need to look)
        return None
    busy = busy_cores()
    free = free_threads(busy)
    if threads <= free:
        return None
    line = (f"other processes keep {busy:.1f} of {cores()} cores busy and torch computes on {threads} threads, "
            f"whose steps then wait for the busy cores (several times slower): torch.set_num_threads({free}) "
            f"(or OMP_NUM_THREADS={free}) before loading is faster while they run")
    announce(line)
    return line


def use_free_cores() -> int | None:
    """For the ``rag-accel`` commands: compute on the cores other processes leave free, unless ``OMP_NUM_THREADS``
    sets the count; says so in one line. Returns the count set, ``None`` where nothing changed."""
    import torch

    from ..models import announce

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    busy = busy_cores()
    free = free_threads(busy)
    if free >= torch.get_num_threads():
        return None
    torch.set_num_threads(free)
    announce(f"other processes keep {busy:.1f} of {cores()} cores busy: computing on {free} thread"
             f"{'s' if free > 1 else ''} (OMP_NUM_THREADS sets it)")
    return free
