"""paratrain's modules import each other without cycles, counting what makes a cycle at run
time or to a reader: imports inside functions, type-only imports, and the ``__init__`` of
every package an import goes through (importing ``a.b.c`` runs ``a.b``'s). The root
package's ``__init__`` (the public API, which runs first for any import) is left out."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "paratrain"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + [base] * bool(base)
                    )
                submodules = [f"{base}.{a.name}" for a in node.names]
                targets = submodules if all(t in modules for t in submodules) else [base, *submodules]
            else:
                continue
            for target in filter(None, map(known, targets)):
                if target == name or target == "paratrain":
                    continue
                graph[name].add(target)
                parent = target.rpartition(".")[0]
                while "." in parent:  # the packages the import goes through
                    if parent in modules and not name.startswith(parent + "."):
                        graph[name].add(parent)
                    parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_its_way_back_to_itself():
    assert _cycles(_graph(_modules())) == []


def test_the_check_finds_a_cycle_hidden_in_a_function_or_a_package():
    graph = _graph(_modules())
    graph["paratrain.config"].add("paratrain.strategies.base")  # as `from ... import` inside a function would
    assert any("paratrain.config" in c and "paratrain.strategies.base" in c for c in _cycles(graph))
    graph = _graph(_modules())
    graph["paratrain.strategies"].add("paratrain.strategies.base")  # a package re-exporting the base class
    assert any("paratrain.strategies" in c for c in _cycles(graph))


def test_strategies_and_comm_import_nothing_above_them():
    """``launch -> train -> strategies -> comm``: a strategy never imports the loop or the
    launcher, and a codec or the checkpoint store no strategy."""
    graph = _graph(_modules())
    for name, targets in graph.items():
        if name.startswith("paratrain.strategies"):
            assert not {t for t in targets if t.startswith(("paratrain.train", "paratrain.launch"))}, name
        if name.startswith("paratrain.checkpoints"):
            assert not {t for t in targets if t.startswith(("paratrain.strategies", "paratrain.train"))}, name
        if name.startswith("paratrain.comm"):
            assert not {t for t in targets if t.startswith(("paratrain.strategies", "paratrain.train"))}, name
