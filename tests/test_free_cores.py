"""The library's hand on torch's threads (rag_accel/hf/threads.FreeCores) on a fake machine of four cores: where
the program left torch's count as torch sets it, the free cores at load and after the load changes; a count of the
program's own never overruled; a held count kept. Nothing here reads this machine's load."""

from __future__ import annotations

import pytest

from rag_accel import machine
from rag_accel.hf import threads


class Machine:
    """Four cores, a load set by the test, a clock it moves, and torch's thread count."""

    def __init__(self, count: int = 4) -> None:
        self.count, self.load, self.now, self.sets = count, 0.0, 100.0, []

    def policy(self) -> threads.FreeCores:
        return threads.FreeCores(get=lambda: self.count, set=self.set, busy=lambda window: self.load,
                                 clock=lambda: self.now)

    def set(self, n: int) -> None:
        self.count = n
        self.sets.append(n)


@pytest.fixture(autouse=True)
def four_cores(monkeypatch):
    monkeypatch.setattr(machine, "cores", lambda: 4)
    monkeypatch.setattr(threads, "cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda window_s=0.25: pytest.fail("read this machine's load"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_the_free_cores_at_load_and_again_when_the_load_changes(capsys):
    m = Machine()
    m.load = 2.0  # another job holds two cores
    policy = m.policy()
    policy.at_load()
    assert policy.owned and m.count == 2
    assert "keep 2.0 of 4 cores busy: computing on 2 threads" in capsys.readouterr().err
    m.load, m.now = 0.0, m.now + threads.RECHECK_S / 2
    policy.before_call()
    assert m.count == 2  # (too soon to look again)
    m.now += threads.RECHECK_S
    policy.before_call()
    assert m.count == 4 and "the cores are free: computing on 4 threads" in capsys.readouterr().err
    m.load, m.now = 3.0, m.now + threads.RECHECK_S
    policy.before_call()
    assert m.sets == [2, 4, 1]


def test_a_count_the_program_set_is_never_overruled(monkeypatch):
    m = Machine(count=3)  # set before loading (not one a core)
    m.load = 2.0
    policy = m.policy()
    monkeypatch.setattr(threads, "warn_if_oversubscribed", lambda n: None)
    policy.at_load()
    assert not policy.owned and m.sets == []
    m = Machine()
    policy = m.policy()
    policy.at_load()  # owned: four free cores, four threads
    m.count = 2  # the program sets its own count between calls
    m.load, m.now = 0.0, m.now + 2 * threads.RECHECK_S
    policy.before_call()
    policy.at_load()  # (another decoder loads)
    assert not policy.owned and m.count == 2 and m.sets == []
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    m = Machine()
    m.load = 3.0
    policy = m.policy()
    policy.at_load()
    assert not policy.owned and m.sets == []


def test_a_held_count_stays_whatever_the_load(capsys):
    m = Machine()
    m.load = 1.0
    policy = m.policy()
    policy.at_load()
    policy.hold()
    m.load, m.now = 0.0, m.now + 2 * threads.RECHECK_S
    policy.before_call()
    assert m.count == 3 and m.sets == [3]


def test_a_cores_reading_leaves_out_this_processs_own_threads(monkeypatch):
    """Over a look, core 1 ran 100 ticks, all of them a thread of this process (a tokenizer, an import): it is not
    another job's; core 0's 60 ticks were someone else's."""
    stats = iter([[(1000, 500), (1000, 500)], [(1100, 540), (1100, 500)]])  # (total, idle) per core, before, after
    own = iter([{7: (10, 1)}, {7: (110, 1)}])  # thread 7: its ticks so far, the core it last ran on
    monkeypatch.setattr(machine, "_cpu_times", lambda: next(stats))
    monkeypatch.setattr(machine, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(machine.time, "sleep", lambda s: None)
    assert machine.busy_by_core() == {0: pytest.approx(0.6), 1: 0.0}


def test_an_engines_binding_looks_again_before_leaving_a_core_out(monkeypatch):
    """A core busy in the first short look but free in a longer second one (a moment's work) stays in the binding,
    which lasts the engine's life; one busy in both looks is left out."""
    looks = iter([{0: 0.0, 1: 0.9}, {0: 0.0, 1: 0.1}])
    monkeypatch.setattr(machine, "busy_by_core", lambda window_s=0.25: next(looks))
    assert machine.free_core_list(allowed={0, 1}, root=machine.Path("/nonexistent")) == [0, 1]
    looks = iter([{0: 0.0, 1: 0.9}, {0: 0.0, 1: 0.95}])
    assert machine.free_core_list(allowed={0, 1}, root=machine.Path("/nonexistent")) == [0]
