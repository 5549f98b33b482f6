"""Threads beside a real job spinning on a core (rag_accel/hf/threads.py, rag_accel/machine.py): the job is seen on
the core it runs on, its core left alone where the library owns torch's threads, and OMP_NUM_THREADS never
overruled. The job is pinned to one core, and what each test asserts holds whatever else keeps the machine busy.
(The policy's every branch on a fake machine: tests/test_free_cores.py.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from rag_accel import machine
from rag_accel.hf import threads
from rag_accel.serving.serve import vllm_bind_hint

#: The core the job spins on: this process's last.
JOB_CORE = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _spin(stop, core) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        pass


@pytest.fixture()
def another_job():
    stop = mp.get_context("spawn").Event()
    job = mp.get_context("spawn").Process(target=_spin, args=(stop, JOB_CORE), daemon=True)
    job.start()
    time.sleep(1.0)  # (spawned and spinning)
    yield JOB_CORE
    stop.set()
    job.join(10)


NEEDS = pytest.mark.skipif(machine._cpu_times() is None or machine.cores() < 2 or JOB_CORE is None,
                           reason="needs /proc/stat, 2 cores and CPU affinity")


@NEEDS
def test_a_spinning_job_is_seen_and_its_core_left_alone(another_job, monkeypatch, capsys):
    """A real job spinning on a core: seen by the machine's reading on that core, its core left out where the
    library owns torch's threads (a count the test holds, not torch's), and only a warning where the program set its
    own."""
    assert machine.busy_by_core()[another_job] >= machine.BUSY
    assert machine.busy_cores() >= 0.8
    count = [machine.cores()]
    policy = threads.FreeCores(get=lambda: count[0], set=lambda n: count.__setitem__(0, n))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    policy.at_load()
    assert policy.owned and count[0] < machine.cores() and "computing on" in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", str(machine.cores()))
    mine = threads.FreeCores(get=lambda: machine.cores(), set=lambda n: pytest.fail("overruled OMP_NUM_THREADS"))
    mine.at_load()
    assert not mine.owned and "torch.set_num_threads(" in capsys.readouterr().err  # warned, nothing changed


@NEEDS
def test_the_server_hint_names_the_free_cores(another_job):
    """The core the spinning job holds, inside the binding vLLM's threads would take, gets a binding without it.
    The job's core is read from the machine; the others count as free, so another process's load elsewhere cannot
    change what is checked."""
    busy = machine.busy_by_core()
    assert busy[another_job] >= machine.BUSY
    reading = {c: (busy[c] if c == another_job else 0.0) for c in busy}
    everything = ",".join(map(str, sorted(busy)))
    hint = vllm_bind_hint(everything, reading)
    assert hint is not None and f"VLLM_CPU_OMP_THREADS_BIND={everything}" in hint
    free = hint.rsplit("VLLM_CPU_OMP_THREADS_BIND=", 1)[1].split()[0]
    assert machine.cpu_list(free) == set(busy) - {another_job}
