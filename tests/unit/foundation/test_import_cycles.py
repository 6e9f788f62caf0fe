"""No import cycles between the project's modules (issue 16).

A cycle makes the import order matter (a half-initialised module hands out missing names) and
means two modules cannot be understood or changed apart. This test builds the import graph
statically from the AST of every module of the project's packages — without importing anything,
so it needs no optional dependency and starts nothing — and fails naming each strongly
connected component of more than one module.

What counts as an edge, A -> B ("A needs B"):
- every `import B` / `from B import x` / `from . import x` in A, at module level AND inside
  functions. Counting module-level imports only would miss exactly the cycles issue 16 names: a
  factory in a base module that lazily imports its subclasses, which import the base
  (`trainer.backend` <-> `trainer.megatron.backend` was one). A lazy import avoids the import-
  time failure but still ties the two modules together, so it counts;
- `from P import name` where `P.name` is itself a module counts as an edge to `P.name`;
- NOT imports under `if TYPE_CHECKING:` (they never run);
- NOT the implicit import of a parent package (`a.b.c` loading `a/__init__.py`): a package's
  `__init__` may hold a factory that lazily imports its submodules ("factories in package
  `__init__`s"), which is the layout this test steers towards.
Only edges between the project's own modules are kept.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# The folders that install as tandem.<folder> (setup.cfg's package_dir).
UNDER_TANDEM = ("launcher", "services", "trainer", "rollout", "reward")
# Every Python package of the project (slurm/ holds shell scripts and an sbatch file only);
# benchmarks/ runs from the checkout under its own name.
PACKAGES = ("tandem", *UNDER_TANDEM, "benchmarks")


def module_name(path: Path, root: Path) -> str:
    """The name the module imports as: `trainer/loop.py` is `tandem.trainer.loop`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in UNDER_TANDEM:
        parts.insert(0, "tandem")
    return ".".join(parts)


def project_modules(root: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    """{dotted name: file} of every module inside a package (a directory with __init__.py)."""
    found = {}
    for pkg in packages:
        if not (root / pkg / "__init__.py").exists():
            continue
        for path in sorted((root / pkg).rglob("*.py")):
            dirs = path.relative_to(root).parents[:-1]   # the package dirs, innermost first
            if all((root / d / "__init__.py").exists() for d in dirs):
                found[module_name(path, root)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_stmt(other)
                continue
            visit_stmt(child)

    def visit_stmt(node):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        visit(node)

    visit(tree)
    return out


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        targets.add(base)
        targets.update(f"{base}.{alias.name}" for alias in node.names)
    edges = set()
    for t in targets:
        # `import a.b.c` where only `a.b` is ours (c a name): keep the longest project module.
        while t and t not in modules:
            t = t.rpartition(".")[0]
        if t and t != name:
            edges.add(t)
    return edges


def import_graph(root: Path = REPO, packages=PACKAGES) -> dict[str, set[str]]:
    modules = project_modules(root, packages)
    return {name: import_edges(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        result.append(sorted(component))
    return sorted(result)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle through the component's first module (for the failure message)."""
    members = set(component)
    start = component[0]
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def describe(graph: dict[str, set[str]], components: list[list[str]]) -> str:
    return "\n".join(f"  {' -> '.join(cycle_path(graph, c))}   (component: {', '.join(c)})"
                      for c in components)


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, f"found only {len(graph)} modules under {REPO}: is PACKAGES right?"
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (A -> B: A imports B, module level or in a function):\n" + \
        describe(graph, cycles)


def test_the_checker_finds_a_lazy_import_cycle_and_ignores_type_checking(tmp_path):
    """The shape issue 16 found in trainer/: a factory in the base module lazily importing a
    subclass module that imports the base. Moving the factory to the package __init__ breaks it."""
    pkg = tmp_path / "pkg"
    (pkg / "impl").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "impl" / "__init__.py").write_text("")
    (pkg / "base.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from pkg.helper import Helper\n"
                                 "class Base: ...\ndef build():\n    from .impl.backend import Impl\n"
                                 "    return Impl()\n")
    (pkg / "impl" / "backend.py").write_text("from ..base import Base\nclass Impl(Base): ...\n")
    (pkg / "helper.py").write_text("import pkg.base\nclass Helper: ...\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.base"] == {"pkg.impl.backend"} and graph["pkg.helper"] == {"pkg.base"}
    assert strongly_connected(graph) == [["pkg.base", "pkg.impl.backend"]]
    assert cycle_path(graph, ["pkg.base", "pkg.impl.backend"]) == ["pkg.base", "pkg.impl.backend", "pkg.base"]

    (pkg / "base.py").write_text("class Base: ...\n")
    (pkg / "__init__.py").write_text("def build():\n    from pkg.impl.backend import Impl\n    return Impl()\n")
    assert strongly_connected(import_graph(tmp_path, ("pkg",))) == []
