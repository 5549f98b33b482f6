"""The package's layers, read from its source with ``ast`` (nothing is imported): an engine-free core, two engine
packages over it, a short list of edge modules, and no import circle (issue 55).

* The engines: ``rag_accel.hf`` (transformers) and ``rag_accel.vllm`` (vLLM), and the libraries themselves
  (``transformers``, ``vllm``; ``sentence_transformers`` loads transformers).
* The core, every other module, imports none of them, at the top or inside a function; a type under
  ``if TYPE_CHECKING:`` is no import.
* The edge, :data:`EDGE`: the product's entry points and loaders, which must reach an engine, and do so
  inside the functions that need it (``import rag_accel`` loads neither engine).
* Every import counts as an edge of the graph, a function's included (it only defers a circle), and so do
  the names a package's ``_LAZY`` table imports on first use (PEP 562).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PACKAGES = ("rag_accel.hf", "rag_accel.vllm")
ENGINES = (*ENGINE_PACKAGES, "transformers", "vllm", "sentence_transformers")

# module (``package.*``: each module of a package) -> why it may import an engine (inside its functions only)
EDGE = {
    "rag_accel": "the facade: ReferenceDecoder and the draft-model drafters on first use (_LAZY)",
    "rag_accel.adapters": "load(): the one factory that picks an engine for the adapters",
    "rag_accel.cli": "the command line runs either engine",
    "rag_accel.serving.serve": "rag-accel serve starts vLLM's server",
    "rag_accel.serving.server_process": "starts and checks a vLLM server process",
    "rag_accel.bench.*": "the bench (each of its modules) times both engines and transformers' prompt lookup",
    "rag_accel.models": "loads transformers models and tokenizers",
    "rag_accel.rag.e5_convert": "converts the E5 embedder with transformers",
    "rag_accel.rag.retrieval": "sentence-transformers embeds the passages",
}


def _module_files() -> dict[str, Path]:
    return {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted((ROOT / "rag_accel").rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(package: str, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = package
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{module}" if module else base


def imports_of(name: str, path: Path, files: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """``(module imported, inside a function, line)`` for each import of one module, those under
    ``if TYPE_CHECKING:`` left out; a name imported from a package is its submodule where there is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(package, node.level, node.module)
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.append((sub if sub in files else module, in_function, node.lineno))
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
              and isinstance(node.value, ast.Dict)):  # name -> module, imported by the package's __getattr__
            for v in node.value.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    spec = v.value
                    level = len(spec) - len(spec.lstrip("."))
                    found.append((_resolve(package, level, spec[level:] or None), True, node.lineno))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _edge_of(module: str) -> str | None:
    """The :data:`EDGE` entry ``module`` falls under, if any."""
    for edge in EDGE:
        if module == edge or (edge.endswith(".*") and _within(module, (edge[:-2],))):
            return edge
    return None


def _imports() -> dict[str, list[tuple[str, bool, int]]]:
    files = _module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}


# rag_accel's C builds (setup.py): modules that import nothing of rag_accel (not the package they sit in)
C_MODULES = {"rag_accel._native"}


def import_graph(imports: dict[str, list[tuple[str, bool, int]]]) -> dict[str, set[str]]:
    """rag_accel's modules and the rag_accel modules each imports (at the top, inside a function or lazily)."""
    graph: dict[str, set[str]] = {}
    for name, found in imports.items():
        deps = set()
        for target, _, _ in found:
            if target in C_MODULES:
                continue
            while target not in imports and "." in target:
                target = target.rpartition(".")[0]
            if target in imports:
                deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, and the modules that import
    themselves (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    """The reader itself, on the shapes it must see: a function's import, a lazy table, a relative one."""
    imports = _imports()
    graph = import_graph(imports)
    assert "rag_accel.vllm.patches" in graph["rag_accel.vllm.proposer"]  # from . import patches
    assert "rag_accel.vllm.patches" in graph["rag_accel.vllm.predictions"]  # inside a function
    assert {"rag_accel.hf.decoder", "rag_accel.hf.draft_models"} <= graph["rag_accel"]  # _LAZY
    assert ("transformers", True) in {(t.split(".")[0], f) for t, f, _ in imports["rag_accel.models"]}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]


def test_the_core_imports_no_engine():
    """No module outside the two engine packages imports an engine, except the edge's, inside functions."""
    imports = _imports()
    assert {e.removesuffix(".*") for e in EDGE} <= set(imports)
    wrong = []
    for name, found in sorted(imports.items()):
        if _within(name, ENGINE_PACKAGES):
            continue
        for target, in_function, line in found:
            if _within(target, ENGINES) and not (_edge_of(name) and in_function):
                where = "inside a function" if in_function else "at the top"
                wrong.append(f"{name}:{line} imports {target} {where}")
    assert wrong == [], "\n".join(dict.fromkeys(wrong))  # (once per line, not per name imported)


def test_no_core_module_reaches_an_engine_package():
    """Nor through other modules, at any depth (an edge module the core uses, such as retrieval.py, may
    import sentence-transformers, but neither engine package)."""
    graph = import_graph(_imports())

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    core = [m for m in graph if not _within(m, ENGINE_PACKAGES) and _edge_of(m) is None]
    assert "rag_accel.speculation" in core and "rag_accel.protocol" in core
    wrong = {m: sorted(r for r in reaches(m) if _within(r, ENGINE_PACKAGES)) for m in core}
    assert {m: r for m, r in wrong.items() if r} == {}


def test_every_edge_module_needs_its_place():
    """The edge list stays short and honest: each module on it does import an engine."""
    imports = _imports()
    idle = [edge for edge in EDGE if not any(_within(t, ENGINES) for name, found in imports.items()
                                             if _edge_of(name) == edge for t, _, _ in found)]
    assert idle == [], f"on the edge list without importing an engine: {idle}"


def test_no_import_circle_in_rag_accel():
    """No module of rag_accel reaches itself through its imports, a function's included (vllm/patches.py and
    vllm/proposer.py imported each other; protocol.py imported vllm/requests.py, which imports protocol.py)."""
    found = circles(import_graph(_imports()))
    assert found == [], f"import circles: {found}"


# The package's rooms (issue 65): the decoding core at the top, beside it the two engines, the bench (what
# ``rag-accel bench`` runs), the RAG helpers and serving. A module at the top is core; a new one is added here on
# purpose, with its reason, or goes into a room.
ROOMS = {
    "hf": "the transformers engine",
    "vllm": "the vLLM engine",
    "bench": "what rag-accel bench and demo time",
    "rag": "where references come from: retrieval, the embedder's conversion, the response cache, conversations, "
           "the bundled sample, a folder of the user's own documents, the files they are stored in",
    "serving": "rag-accel serve, a server process, the HTTP client",
}
TOP = {  # the decoding core, the command line and the adapters' factory
    "__init__", "_context", "adapters", "cli", "config", "drafters", "inputs", "kernels", "memory", "methods",
    "models", "outputs", "policy", "prediction", "protocol", "references", "speculation", "stopping", "viz", "wire",
    # engine-free, shared by both engines: row-invariant products (torch only), what other processes do with the cores
    "invariant", "machine",
}


def test_the_top_level_holds_the_core_and_the_rooms():
    package = ROOT / "rag_accel"
    modules = {p.stem for p in package.glob("*.py")}
    folders = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert modules == TOP, f"a new top-level module is core (add it to TOP) or belongs in a room: {modules ^ TOP}"
    assert folders == set(ROOMS)
    named_like_a_folder = {p.stem for p in package.rglob("*.py")} & {p.name for p in package.rglob("*") if p.is_dir()}
    assert named_like_a_folder == set(), named_like_a_folder


def test_only_serving_reaches_serving():
    """The core, the engines and the RAG helpers run without a server: nothing outside ``serving`` (and the
    command line and adapters, which start or call one) imports it."""
    graph = import_graph(_imports())
    allowed = ("rag_accel.serving", "rag_accel.cli", "rag_accel.adapters")
    wrong = {m: sorted(d for d in deps if _within(d, ("rag_accel.serving",)))
             for m, deps in graph.items() if not _within(m, allowed)}
    assert {m: d for m, d in wrong.items() if d} == {}


def _private_uses(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """The private names (``_x``, not ``__x__``) a module defines (functions, classes, methods, attributes set on
    ``self``), and those it imports from another module or calls as ``something._x(...)`` on another object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute)}
    used = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            used += [(n.lineno, f"imports {n.module}.{a.name}") for a in n.names if private(a.name)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and private(n.func.attr):
            owner = n.func.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) and n.func.attr not in defined:
                used.append((n.lineno, f"calls {ast.unparse(n.func)}"))
    return {d for d in defined if private(d)}, used


def test_no_module_uses_another_modules_private_names(tmp_path: Path):
    """Issue 65: a private name is its module's own. No module of rag_accel (or the benchmarks' lab) imports
    another's private name or calls another class's private method; within a module, its classes may call each
    other's (``UniversalDrafter`` drives its own ``ModelDrafter``)."""
    files = [*sorted((ROOT / "rag_accel").rglob("*.py")), *sorted((ROOT / "benchmarks" / "rag_accel_lab").glob("*.py"))]
    wrong = [f"{f.relative_to(ROOT)}:{line} {what}" for f in files for line, what in _private_uses(f)[1]]
    assert wrong == [], "\n".join(wrong)
    probe = tmp_path / "probe.py"  # the reader itself: what it flags and what it lets be
    probe.write_text("from x import _hidden\nclass A:\n    def _own(self): self._own()\n"
                     "def f(a, b):\n    a._own()\n    b._theirs()\n")
    assert [what for _, what in _private_uses(probe)[1]] == ["imports x._hidden", "calls b._theirs"]
    assert _private_uses(ROOT / "rag_accel" / "hf" / "draft_models.py")[0] >= {"_forward", "_start"}


#: Modules that may change this process's environment: the launchers, which start engines in it.
ENVIRONMENT_WRITERS = ("rag_accel.serving", "rag_accel.cli", "rag_accel.bench.harness",
                       "rag_accel.vllm.launch")  # (VllmDecoder's engine start, put back once it has started)


def _environment_writes(path: Path) -> list[int]:
    """The lines of a module that change ``os.environ`` (an item set or deleted, ``setdefault``, ``update``,
    ``pop``, ``clear``) or call ``os.putenv`` / ``os.unsetenv``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    environ = lambda n: ast.unparse(n) in ("os.environ", "environ")  # noqa: E731
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
            lines += [n.lineno for t in targets if isinstance(t, ast.Subscript) and environ(t.value)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if (environ(n.func.value) and n.func.attr in ("setdefault", "update", "pop", "clear", "__setitem__")
                    or ast.unparse(n.func) in ("os.putenv", "os.unsetenv")):
                lines.append(n.lineno)
    return lines


def test_only_the_launchers_change_the_environment(tmp_path: Path):
    """A setting is passed to what needs it (an engine's mode in its config), never left in the environment for
    another module to find: only the launchers (``rag-accel serve``, the command line, the bench's peers) set the
    environment an engine starts in."""
    wrong = {m: lines for m, f in _module_files().items() if not _within(m, ENVIRONMENT_WRITERS)
             and (lines := _environment_writes(f))}
    assert wrong == {}
    probe = tmp_path / "probe.py"  # the reader itself
    probe.write_text("import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\nx = os.environ.get('C')\n"
                     "del os.environ['A']\nos.putenv('D', '3')\n")
    assert sorted(_environment_writes(probe)) == [2, 3, 5, 6]


#: The transformers engine's rooms beside its decoder: what the decoder checks and loads when it is built, the
#: forwards (cache, forward path, plans, probes, cost curves), one request's state and set-up.
HF_ROOMS = {"loading": "check_model", "steps": "Steps", "request": "RequestState"}
#: The decode loop's verbs, in the order a step calls them (0. ``_begin``, the prefill and the set-up, before it).
LOOP_VERBS = ["_emit", "_learn", "_draft", "_verify", "_accept", "_account"]


def test_the_transformers_decoder_is_its_api_and_its_loop():
    """``rag_accel/hf/decoder.py`` keeps the API and a loop that reads as named verbs, each a call; the rest lives in
    the rooms of :data:`HF_ROOMS`, which the decoder imports."""
    path = ROOT / "rag_accel" / "hf" / "decoder.py"
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 400
    tree = ast.parse(source)
    decode = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_decode")
    assert decode.end_lineno - decode.lineno < 50, "the loop fits on a screen"
    loop = next(n for n in ast.walk(decode) if isinstance(n, ast.While))
    calls = [n.func.attr for n in sorted((n for n in ast.walk(loop) if isinstance(n, ast.Call)),
                                         key=lambda n: (n.lineno, n.col_offset))
             if isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    assert [c for c in calls if c in LOOP_VERBS] == LOOP_VERBS
    assert any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "_begin" for n in ast.walk(decode))
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    for room, name in HF_ROOMS.items():
        assert (room, name) in imported, f"decoder.py takes {name} from hf/{room}.py"
        assert (ROOT / "rag_accel" / "hf" / f"{room}.py").is_file()


#: Where a bit-for-bit comparison of tensors may be made in the library: the one probe
#: (``rag_accel.invariant.rows_agree``); the static steps' graph check compares argmaxes, not rows' bits.
BIT_COMPARERS = {"rag_accel.invariant": 1, "rag_accel.hf.static": 1}


def test_every_probe_asks_the_one_probe_function():
    """Every invariance probe (products, the attention kernels, the static sizes, vLLM's pieces) asks
    ``rows_agree`` whether a call gives each row the bits a reference gives it; no other module compares bits itself,
    and the verdicts live in one table, ``rag_accel.invariant.VERDICTS``."""
    counts = {m: n for m, f in _module_files().items()
              if (n := sum(isinstance(c, ast.Call) and ast.unparse(c.func) == "torch.equal"
                           for c in ast.walk(ast.parse(f.read_text(encoding="utf-8")))))}
    assert counts == BIT_COMPARERS
    users = {m for m, f in _module_files().items() if "rows_agree(" in f.read_text(encoding="utf-8")}
    assert users >= {"rag_accel.invariant", "rag_accel.hf.static", "rag_accel.hf.attention", "rag_accel.vllm.exact"}
    tables = {m for m, f in _module_files().items() if "VERDICTS.get(" in f.read_text(encoding="utf-8")}
    assert tables == {"rag_accel.hf.attention", "rag_accel.vllm.exact"}


def test_the_c_modules_are_setup_pys_extensions():
    """The import checks take C_MODULES as leaves: they must be what setup.py builds, each from a source here."""
    built = set(re.findall(r'Extension\("([\w.]+)", \["([\w/.]+)"\]', (ROOT / "setup.py").read_text(encoding="utf-8")))
    assert {name for name, _ in built} == C_MODULES
    assert all((ROOT / source).is_file() for _, source in built)
