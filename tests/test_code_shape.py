"""The shape of the code: no import cycles among the project's modules, no oversized files.

Pure and fast: the sources are parsed with `ast`, nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
IMPORTING = ("common", "proxy", "neuron_connector", "transfer", "scheduler", "worker", "proxy_server.py")
SIZED = IMPORTING + ("examples", "tests", "scripts")
MAX_LINES = 400
_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* is Python 3.11+


def sources(roots: tuple[str, ...]) -> Iterator[Path]:
    for name in roots:
        path = ROOT / name
        yield from [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported: not function bodies, not `if TYPE_CHECKING:` blocks.

    A function's imports run when it is called, after every module has loaded: they cannot
    form an import-time cycle, and lazy imports are how one is broken on purpose.
    """
    for node in body:
        yield node
        if isinstance(node, ast.If):
            test = node.test
            type_checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
            yield from import_time_statements(node.orelse if type_checking else node.body + node.orelse)
        elif isinstance(node, _TRY):
            yield from import_time_statements(
                node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)
        elif isinstance(node, ast.With):
            yield from import_time_statements(node.body)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports at import time; a package means its __init__.

    `from pkg import name` is pkg.name when that is a module, else pkg.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in import_time_statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is the importer's package, each level above goes one up
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules))
    return found - {"", name}


def _known(dotted: str, modules: set[str]) -> str:
    """The longest prefix of `dotted` that is a project module, or "" (not ours)."""
    parts = dotted.split(".")
    return next((m for m in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if m in modules), "")


def import_graph() -> dict[str, set[str]]:
    paths = list(sources(IMPORTING))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) for p in paths}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [g for g in groups if len(g) > 1]


def a_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the group's first module, found breadth first: start -> ... -> start."""
    start = group[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & set(group)):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    raise AssertionError(f"{group} is strongly connected, so a cycle exists")


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [" -> ".join(a_cycle(group, graph)) for group in strongly_connected(graph)]
    assert not cycles, ("import cycles among the project's modules (module-level imports; those under "
                        "`if TYPE_CHECKING:` and inside functions do not count):\n  " + "\n  ".join(cycles))


def test_no_file_over_the_line_limit() -> None:
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in sources(SIZED)}
    over = [f"{path}: {lines} lines" for path, lines in sorted(sizes.items()) if lines > MAX_LINES]
    assert not over, f"files over {MAX_LINES} lines:\n  " + "\n  ".join(over)
