"""The package's shape: no runtime import cycle, no file over 500 lines, no ``Any`` in the public
entry points' signatures (issue 14)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import autoplace

PACKAGE = Path(autoplace.__file__).resolve().parent
ROOT = PACKAGE.parent
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports at run time, at any depth (inside functions
    too: an import there runs when the function does), ``if TYPE_CHECKING:`` blocks excepted.
    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module; a module's
    own parent packages do not count (they are already being imported)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        else:
            visit(node)

    visit(ast.parse(path.read_text()))
    out = set()
    for mod in found:
        while mod and mod not in modules:
            mod = mod.rsplit(".", 1)[0] if "." in mod else ""
        if mod and mod != name and not name.startswith(mod + "."):
            out.add(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def test_no_runtime_import_cycle() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, f"runtime import cycles (TYPE_CHECKING imports excepted): {cycles}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above would pass vacuously if the walk found no imports."""
    graph = _import_graph()
    assert "autoplace.placement" in graph["autoplace.api"]
    graph["autoplace.cluster"] = graph["autoplace.cluster"] | {"autoplace.api"}
    assert any("autoplace.cluster" in c and "autoplace.api" in c for c in _cycles(graph))


def test_every_file_is_under_500_lines() -> None:
    """The package, its tests, benchmarks and examples."""
    files = [p for folder in (PACKAGE, ROOT / "tests", ROOT / "benchmarks", ROOT / "examples") if folder.exists()
             for p in folder.rglob("*.py")]
    assert len(files) > 100
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"files of {MAX_LINES} lines or more (split them by idea): {long}"


@pytest.mark.parametrize("name", ["wrap", "plan", "simulate", "trace"])
def test_public_entry_points_have_no_any_in_their_signatures(name: str) -> None:
    fn = inspect.unwrap(getattr(autoplace, name))
    hints = {k: str(v) for k, v in fn.__annotations__.items()}  # strings: the package uses PEP 563
    missing = set(inspect.signature(fn).parameters) - set(hints)
    assert not missing and "return" in hints, f"autoplace.{name} has unannotated parameters: {missing}"
    bad = {k: v for k, v in hints.items() if re.search(r"\bAny\b", v)}
    assert not bad, f"autoplace.{name} has Any in its signature: {bad}"
