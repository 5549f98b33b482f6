"""Threads beside another job (rag_accel/hf/threads.py): a spinning process is seen, the commands compute on the
cores it leaves, the library only warns, and OMP_NUM_THREADS is never overruled."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from rag_accel import machine
from rag_accel.hf import threads
from rag_accel.serving.serve import vllm_bind_hint


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@pytest.fixture()
def another_job():
    stop = mp.get_context("spawn").Event()
    job = mp.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True)
    job.start()
    time.sleep(1.0)  # (spawned and spinning)
    yield
    stop.set()
    job.join(10)


@pytest.fixture()
def all_cores():
    before = torch.get_num_threads()
    torch.set_num_threads(machine.cores())
    yield machine.cores()
    torch.set_num_threads(before)


@pytest.mark.skipif(machine._cpu_times() is None, reason="no /proc/stat here")
def test_a_spinning_job_is_seen_and_its_core_left_alone(another_job, all_cores, monkeypatch, capsys):
    assert machine.busy_cores() >= 0.8
    line = threads.warn_if_oversubscribed()
    if all_cores == 1:
        assert line is None
        return
    assert line is not None and "torch.set_num_threads(" in capsys.readouterr().err
    assert torch.get_num_threads() == all_cores  # the library only warns
    monkeypatch.setenv("OMP_NUM_THREADS", str(all_cores))
    assert threads.use_free_cores() is None and torch.get_num_threads() == all_cores  # the user's word stands
    monkeypatch.delenv("OMP_NUM_THREADS")
    chosen = threads.use_free_cores()
    assert chosen is not None and chosen < all_cores and torch.get_num_threads() == chosen
    assert "computing on" in capsys.readouterr().err


@pytest.mark.skipif(machine._cpu_times() is None or machine.cores() < 2, reason="needs /proc/stat and 2 cores")
def test_the_server_hint_names_the_free_cores(another_job):
    """A core the spinning job holds, inside the binding vLLM's threads would take, gets a binding without it."""
    busy = machine.busy_by_core()
    held = [c for c, b in busy.items() if b >= machine.BUSY]
    assert held
    everything = ",".join(map(str, sorted(busy)))
    hint = vllm_bind_hint(everything, busy)
    if len(held) == len(busy):  # (every core busy: nothing better to bind)
        assert hint is None
        return
    assert hint is not None and f"VLLM_CPU_OMP_THREADS_BIND={everything}" in hint
    free = hint.rsplit("VLLM_CPU_OMP_THREADS_BIND=", 1)[1].split()[0]
    assert not set(machine.cpu_list(free)) & set(held)
