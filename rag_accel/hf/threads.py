"""How many threads torch computes on, where another job already holds some of the cores.

torch runs one thread per core, and a step waits for its slowest thread: where another job holds a core, the thread
that shares it runs at a fraction of its speed, and the step with it (the results page threads_cpu_smollm2 has the
numbers). So where cores are busy, fewer threads are faster.

Where the program has left torch's threads as torch sets them (``OMP_NUM_THREADS`` unset, one thread a core), the
library computes on the cores other processes leave free (:class:`FreeCores`): at a decoder's load, and again at a
call when the machine's load has changed since the last look. A program that sets its own count (``OMP_NUM_THREADS``,
``torch.set_num_threads`` before loading or between calls) keeps it: the library then only warns at load where its
threads outnumber the free cores. The ``rag-accel`` commands take the free cores at load and then hold that count
(:meth:`FreeCores.hold`: a benchmark times its methods on one count).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from ..machine import busy_cores, cores, free_threads

__all__ = ["FreeCores", "free_cores", "warn_if_oversubscribed"]

#: Seconds between two looks at the machine's load from a decoder's calls (a look waits :data:`LOOK_S`).
RECHECK_S = 10.0
#: How long a look at the load between calls watches the cores (this process idle meanwhile).
LOOK_S = 0.1


def warn_if_oversubscribed(threads: int | None = None) -> str | None:
    """One line on stderr (returned too) where torch's threads outnumber the cores other processes leave free;
    nothing changes."""
    import torch

    from ..models import announce

    threads = threads or torch.get_num_threads()
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


class FreeCores:
    """The library's hand on torch's threads in one process, where the program left them at torch's default:
    the cores other processes leave free, at :meth:`at_load` and again at :meth:`before_call` once
    :data:`RECHECK_S` have passed since the last look. From the moment the program sets a count of its own, the
    library leaves it alone. ``get`` / ``set`` / ``busy`` / ``clock``: torch's thread count and the machine's load
    (replaced in tests)."""

    def __init__(self, get: Callable[[], int] | None = None, set: Callable[[int], None] | None = None,  # noqa: A002
                 busy: Callable[[float], float] = busy_cores, clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        self._get, self._set = get or torch.get_num_threads, set or torch.set_num_threads
        self._busy, self._clock = busy, clock
        self._lock = threading.Lock()
        self.owned: bool | None = None  # None: not decided yet (the first load decides)
        self.threads: int | None = None  # the count the library set last
        self._looked = 0.0

    def at_load(self) -> None:
        """A decoder loads on a CPU: decide whether the library owns the count (once a process), then set it to
        the free cores, or only warn where the program's count outnumbers them."""
        with self._lock:
            if self.owned is None:
                self.owned = not os.environ.get("OMP_NUM_THREADS") and self._get() == cores()
            if not self._still_owned():
                warn_if_oversubscribed(self._get())
                return
            self._look(LOOK_S * 2.5)

    def before_call(self) -> None:
        """A call starts: where the library owns the count and :data:`RECHECK_S` have passed, look again."""
        if not self.owned or self._clock() - self._looked < RECHECK_S:
            return
        with self._lock:
            if self._still_owned() and self._clock() - self._looked >= RECHECK_S:
                self._look(LOOK_S)

    def hold(self) -> None:
        """Keep the count as it is now for the rest of the process (a benchmark times its methods on one)."""
        with self._lock:
            self.owned = False

    def _still_owned(self) -> bool:
        if self.owned and self.threads is not None and self._get() != self.threads:
            self.owned = False  # the program set its own count since: its word stands
        return bool(self.owned)

    def _look(self, window_s: float) -> None:
        from ..models import announce

        busy = self._busy(window_s)
        self._looked = self._clock()
        want = free_threads(busy)
        if want == (self.threads or self._get()):
            self.threads = want
            return
        self._set(want)
        self.threads = want
        held = f"other processes keep {busy:.1f} of {cores()} cores busy" if busy >= 0.5 else "the cores are free"
        announce(f"{held}: computing on {want} thread{'s' if want > 1 else ''} (OMP_NUM_THREADS or "
                 "torch.set_num_threads sets your own count)")


_FREE_CORES: FreeCores | None = None


def free_cores() -> FreeCores:
    """This process's :class:`FreeCores` (one: torch's thread count is the process's)."""
    global _FREE_CORES
    if _FREE_CORES is None:
        _FREE_CORES = FreeCores()
    return _FREE_CORES
