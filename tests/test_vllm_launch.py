"""Where a vLLM engine started by rag_accel writes (rag_accel.vllm.launch): its caches under RAG_ACCEL_HOME, its
temporary files in a folder of its own, and the caller's environment as it was once the engine has started. No
vLLM needed: the launcher only sets what vLLM's processes read as they start."""

from __future__ import annotations

import os
import tempfile

from rag_accel.vllm.launch import engine_environment, engine_temp_dir, home_environment, remove_temp_dir


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
