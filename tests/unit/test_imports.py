"""The package's layers, read from its source: no import cycles, and nothing below the tools imports them.

Every import statement counts wherever it stands (a function's body too: an import deferred to break a cycle at run
time still ties the two modules together for a reader), but those under `if TYPE_CHECKING:`, names for annotations.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.runs import REPO

ROOTS = {"monarch_plugin": REPO / "monarch_plugin", "monarch_plugin.integrations": REPO / "integrations"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package that `module` imports (`from pkg import name` counts `pkg.name` if that is a
    module, else `pkg`)."""
    out = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) in
                   ("TYPE_CHECKING", "typing.TYPE_CHECKING") for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_module_imports_one_that_imports_it_back():
    # A package imports its own modules (`__init__` re-exporting) and they it: that pair is not a layer's cycle.
    graph = {m: {w for w in deps if not (_is_within(m, w) or _is_within(w, m))} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_tools_sit_on_top_only_the_front_ends_read_a_runs_summary_from_them():
    above = ("monarch_plugin.tools", "monarch_plugin.__main__", "monarch_plugin.integrations")
    users = {m: sorted(w for w in deps if _is_within(w, "monarch_plugin.tools"))
             for m, deps in _graph().items() if not any(_is_within(m, a) for a in above)}
    assert {m: deps for m, deps in users.items() if deps} == {}


def test_the_wire_storage_and_data_layers_import_neither_side():
    sides = ("monarch_plugin.controller", "monarch_plugin.procs", "monarch_plugin.worker", "monarch_plugin.tools",
             "monarch_plugin.integrations")
    low = ("monarch_plugin.wire", "monarch_plugin.storage", "monarch_plugin.data")
    graph = _graph()
    found = {m: sorted(w for w in graph[m] if any(_is_within(w, s) for s in sides))
             for m in graph if any(_is_within(m, layer) for layer in low)}
    assert {m: deps for m, deps in found.items() if deps} == {}


def test_the_check_sees_a_cycle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
