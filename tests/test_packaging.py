"""What `pip install` puts on the path: rag_accel and the two adapter distributions, each depending on
rag-accel and its framework's core only; no top-level `integrations` package any more."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distribution

import pytest
from packaging.requirements import Requirement

ADAPTERS = {  # distribution -> (import name, the framework's core)
    "langchain-rag-accel": ("langchain_rag_accel", "langchain-core"),
    "llama-index-llms-rag-accel": ("llama_index.llms.rag_accel", "llama-index-core"),
}


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    """Run code in this venv from an empty folder: only installed packages are importable, not the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)


def test_no_integrations_package_is_installed(tmp_path):
    proc = _python("import integrations", tmp_path)
    assert proc.returncode != 0 and "No module named 'integrations'" in proc.stderr, proc.stderr
    proc = _python("from integrations.langchain import ChatRagAccel", tmp_path)
    assert proc.returncode != 0 and "No module named 'integrations'" in proc.stderr, proc.stderr


def test_the_adapters_import_under_their_ecosystem_names(tmp_path):
    code = ("import json, langchain_rag_accel, llama_index.llms.rag_accel as li, rag_accel.adapters; "
            "print(json.dumps([sorted(langchain_rag_accel.__all__), sorted(li.__all__)]))")
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lc_names, li_names = json.loads(proc.stdout)
    assert {"ChatRagAccel", "rag_chain", "VectorIndexRetriever"} <= set(lc_names)
    assert {"RagAccelLLM", "RagAccelQueryEngine"} <= set(li_names)


@pytest.mark.parametrize("dist", sorted(ADAPTERS))
def test_each_adapter_depends_on_rag_accel_and_its_framework_core_only(dist):
    reqs = [Requirement(r) for r in distribution(dist).requires or []]
    required = {r.name for r in reqs if r.marker is None or "extra" not in str(r.marker)}  # extras aside
    assert required == {"rag-accel", ADAPTERS[dist][1]}


def test_matplotlib_is_the_bench_extra_not_a_core_dependency():
    """One plot of `rag-accel bench` needs matplotlib: `[bench]` (and `[dev]`, for the tests) carries it, the core
    does not (the bench without it writes its JSON and markdown: tests/test_cli.py)."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {Requirement(r).name for r in reqs}

    assert "matplotlib" not in names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert names(extras["bench"]) == {"matplotlib"} and "matplotlib" in names(extras["dev"])


def test_the_adapters_share_their_fields_and_checks_from_one_definition():
    """Issue 65: the fields, validators and engine both adapters have are rag_accel.adapters.adapter_base()'s,
    declared once; each adapter adds only its framework's own (LangChain's aliases and streaming, LlamaIndex's
    capture). They had drifted: only LangChain refused a negative temperature."""
    import pydantic
    import pytest
    from langchain_rag_accel import ChatRagAccel
    from llama_index.llms.rag_accel import RagAccelLLM

    from rag_accel.adapters import adapter_base

    base = adapter_base()
    shared = set(base.model_fields)
    assert {"backend", "base_url", "decoder", "decoder_config", "stop", "temperature", "memory_scope"} <= shared
    for adapter, own in ((ChatRagAccel, {"streaming"}), (RagAccelLLM, {"capture_retrievals"})):
        assert issubclass(adapter, base)
        assert shared | own <= set(adapter.model_fields)
        # (the source of each adapter declares its own fields only, plus LangChain's two aliased ones)
        declared = set(adapter.__annotations__) - {"MAX_TOKENS_KEY", "model_config"}
        assert declared - own <= {"model_name", "max_new_tokens"}, declared
        assert adapter.engine is base.engine
        with pytest.raises(pydantic.ValidationError, match="temperature must be >= 0"):
            adapter(temperature=-1.0)
        with pytest.raises(pydantic.ValidationError, match="empty"):
            adapter(stop=[""])
    assert ChatRagAccel(max_tokens=7).max_new_tokens == RagAccelLLM(max_tokens=7).max_new_tokens == 7
