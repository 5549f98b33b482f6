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


def _import_graph() -> dict[str, set[str]]:
    """rag_accel's modules and the rag_accel modules each imports, at the top or inside a function (an import
    inside a function is a circle all the same: it only defers it)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (root / "rag_accel").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                module = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t not in files and "." in t:
                    t = t.rpartition(".")[0]
                if t in files and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_import_circle_in_rag_accel():
    """Issue 55: no module of rag_accel reaches itself through its imports (vllm/patches.py and
    vllm/proposer.py imported each other; protocol.py, the engine-free core, imported vllm/requests.py)."""
    graph = _import_graph()
    assert graph["rag_accel.vllm.proposer"] >= {"rag_accel.vllm.patches"}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    circles = sorted(m for m in graph if m in reaches(m))
    assert circles == [], f"modules that import themselves through others: {circles}"
    for core in ("rag_accel.protocol", "rag_accel.remote", "rag_accel.prediction", "rag_accel.outputs"):
        engines = {m for m in reaches(core) if m.startswith(("rag_accel.vllm", "rag_accel.hf"))}
        assert not engines, f"{core} reaches {sorted(engines)}"
