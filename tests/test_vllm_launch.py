"""Where a vLLM engine started by rag_accel writes (rag_accel.vllm.launch): its caches under RAG_ACCEL_HOME, its
temporary files in a folder of its own, and the caller's environment as it was once the engine has started. No
vLLM needed: the launcher only sets what vLLM's processes read as they start."""

from __future__ import annotations

import getpass
import os
import tempfile

import pytest

from rag_accel.vllm.launch import (engine_environment, engine_temp_dir, home_environment, remove_temp_dir,
                                  torch_default_inductor_dir)


def test_the_caches_go_under_rag_accel_home_unless_the_caller_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path))
    assert home_environment({}) == {"VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
                                    "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "vllm" / "inductor")}
    assert home_environment({"VLLM_CACHE_ROOT": "/mine"}) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "vllm" / "inductor")}


def test_an_engine_start_sees_its_places_and_the_caller_gets_its_environment_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path / "home"))
    for name in ("TMPDIR", "VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/the/callers")
    before, tempdir_before = dict(os.environ), tempfile.tempdir
    temp = engine_temp_dir()
    assert temp.is_dir() and str(temp.parent) == tempfile.gettempdir() and len(str(temp)) + 37 <= 107  # (sockets)
    with engine_environment(home_environment(os.environ), temp):
        assert os.environ["TMPDIR"] == os.environ["VLLM_RPC_BASE_PATH"] == str(temp)
        assert tempfile.gettempdir() == str(temp)  # (this process's own temporary files too)
        assert os.environ["VLLM_CACHE_ROOT"] == "/the/callers"  # (a place the caller names stays)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home" / "vllm" / "inductor")
        (temp / "a-socket").write_text("")
    assert dict(os.environ) == before and tempfile.tempdir == tempdir_before
    other = engine_temp_dir()
    remove_temp_dir(temp)
    remove_temp_dir(other)
    assert other != temp and not temp.exists() and not other.exists()  # (one folder per engine, gone at close)


def test_a_callers_temporary_folder_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "callers"))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    tempdir_before = tempfile.tempdir
    with engine_environment({}, tmp_path / "engines"):
        assert os.environ["TMPDIR"] == str(tmp_path / "callers") and "VLLM_RPC_BASE_PATH" not in os.environ
        assert tempfile.tempdir == tempdir_before


def test_an_engine_that_fails_to_start_puts_the_environment_back(monkeypatch, tmp_path):
    monkeypatch.delenv("TMPDIR", raising=False)
    before = dict(os.environ)
    try:
        with engine_environment({"VLLM_CACHE_ROOT": str(tmp_path)}, tmp_path):
            raise RuntimeError("the engine did not start")
    except RuntimeError:
        pass
    assert dict(os.environ) == before


def _machine(root, siblings: dict[int, str], nodes: int = 1):
    """A fake /sys/devices/system: each core's hyperthread siblings, and ``nodes`` NUMA nodes."""
    for core, spec in siblings.items():
        (root / "cpu" / f"cpu{core}" / "topology").mkdir(parents=True)
        (root / "cpu" / f"cpu{core}" / "topology" / "thread_siblings_list").write_text(spec + "\n")
    for n in range(nodes):
        (root / "node" / f"node{n}").mkdir(parents=True)
    return root


def test_an_engines_threads_are_bound_to_the_free_cores_one_per_physical_core(tmp_path):
    """Where the user binds nothing, an engine of one rank computes on every core other processes leave free (vLLM's
    own binding keeps one back for its scheduler: on 2 cores, half the compute), one logical CPU of each physical
    core as vLLM takes them; on several NUMA nodes, or for several ranks, vLLM's own binding stays."""
    from rag_accel.machine import cpu_spec, free_core_list
    from rag_accel.vllm.launch import cpu_environment

    flat = _machine(tmp_path / "flat", {0: "0", 1: "1", 2: "2", 3: "3"})
    assert free_core_list({}, allowed={0, 1, 2, 3}, root=flat) == [0, 1, 2, 3]
    assert free_core_list({1: 0.95, 2: 0.3}, allowed={0, 1, 2, 3}, root=flat) == [0, 2, 3]  # (core 1 held)
    assert free_core_list({0: 0.9, 1: 0.9}, allowed={0, 1}, root=flat) == [0, 1]  # (all held: all)
    smt = _machine(tmp_path / "smt", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert free_core_list({}, allowed={0, 1, 2, 3}, root=smt) == [2, 3]  # (the last sibling of each)
    numa = _machine(tmp_path / "numa", {0: "0", 1: "1"}, nodes=2)
    assert free_core_list({}, allowed={0, 1}, root=numa) is None
    # the environment an engine gets: a binding in vLLM's list format, for one rank only, the user's own kept
    got = cpu_environment({}, busy={}, prefix="/nonexistent")
    expected = free_core_list({})
    assert got.get("VLLM_CPU_OMP_THREADS_BIND") == (None if expected is None else cpu_spec(expected))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_environment({}, ranks=2, busy={}, prefix="/nonexistent")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_environment({"VLLM_CPU_OMP_THREADS_BIND": "0"}, busy={},
                                                              prefix="/nonexistent")


def test_a_servers_ranks_are_read_from_its_vllm_options():
    from rag_accel.serving.serve import engine_ranks

    assert engine_ranks([]) == 1
    assert engine_ranks(["--tensor-parallel-size", "2"]) == 2
    assert engine_ranks(["-tp=2", "--data-parallel-size", "2", "--pipeline-parallel-size=1"]) == 4


def test_torchs_own_default_cache_folder_counts_as_unnamed(tmp_path, monkeypatch):
    # importing vLLM runs torch's cache_dir(), which writes its default into os.environ: an engine started after
    # that import must still keep its compiled files under RAG_ACCEL_HOME, not in the system's temporary folder
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path))
    default = torch_default_inductor_dir()
    assert default == os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    assert home_environment({"TORCHINDUCTOR_CACHE_DIR": default})["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "vllm" / "inductor")
    assert "TORCHINDUCTOR_CACHE_DIR" not in home_environment({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})


def test_the_default_cache_folder_is_torchs_own():
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    assert torch_default_inductor_dir() == cache_dir_utils.default_cache_dir()
