"""The shape of the code: imports point down the packages' order, no import cycles among the project's
modules, no oversized files, no `sys.path` edits, the handoff's keys spelled in one module.

Pure and fast: the sources are parsed with `ast`, nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The packages of ours, lowest first: each imports only the layers before it. Beside them, `proxy` (and
# its entry point), `stack` and `planner` import only `common`; only `worker` of the layers uses `scheduler`; what
# measures, breaks, teaches and checks the system imports everything. docs/architecture.md shows the same
# order (tests/test_docs.py holds its table to it).
LAYERS = ("common", "transfer", "scheduler", "neuron_connector", "worker")
ON_COMMON = ("proxy", "proxy_server", "stack", "planner")
ON_EVERYTHING = ("benchmarks", "faults", "examples", "tests")
SCHEDULER_USERS = ("worker", "benchmarks", "tests")
OURS = LAYERS + ON_COMMON + ON_EVERYTHING
IMPORTING = tuple(f"{name}.py" if name == "proxy_server" else name for name in OURS)   # where each one's code is
SIZED = IMPORTING + ("scripts",)
MAX_LINES = 400
_TRY = (ast.Try, ast.TryStar)


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
    # Native extensions built from a .c file of their own name are modules that import none of ours.
    native = {module_name(c.with_suffix(".py")) for p in paths for c in p.parent.glob("_*.c")}
    modules = {module_name(p) for p in paths} | native
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


def may_import(package: str) -> tuple[str, ...]:
    """The packages of ours `package` may import, itself aside."""
    if package in LAYERS:
        allowed = LAYERS[:LAYERS.index(package)]
    elif package in ON_COMMON:
        allowed = ("common", "proxy") if package == "proxy_server" else ("common",)
    else:
        allowed = OURS
    return tuple(p for p in allowed if p != package and (p != "scheduler" or package in SCHEDULER_USERS))


def every_import(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every import in `path`, in functions and `if TYPE_CHECKING:` blocks too:
    an import made late is still a dependency."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0] if not node.level else (package or [""])[0]
            yield node.lineno, top


@pytest.mark.parametrize("package", OURS)
def test_imports_point_down_the_layers(package: str) -> None:
    allowed = may_import(package)
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {top}"
             for path in sources((IMPORTING[OURS.index(package)],))
             for line, top in every_import(path) if top in OURS and top != package and top not in allowed]
    owner = " (scheduler is the worker's alone)" if any(w.endswith(" scheduler") for w in wrong) else ""
    assert not wrong, (f"{package} may import only {', '.join(allowed) or 'nothing of ours'}{owner}:\n  "
                       + "\n  ".join(wrong))


def test_every_package_has_its_place_in_the_order() -> None:
    """A package the order does not place escapes the rule above; a place with no package is a stale rule."""
    on_disk = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"examples"}
    on_disk |= {p.stem for p in ROOT.glob("*.py") if p.name != "setup.py"}
    assert not on_disk - set(OURS), f"packages with no place in the order: {sorted(on_disk - set(OURS))}"
    assert not set(OURS) - on_disk, f"places in the order with no package: {sorted(set(OURS) - on_disk)}"


def test_no_sys_path_edits() -> None:
    """Code imports installed packages (or runs from the repo root as `python -m`); it never edits sys.path."""
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for path in sources(SIZED + ("setup.py",))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits, "sys.path used in:\n  " + "\n  ".join(edits)


# The keys of `kv_transfer_params` (ours and vLLM's NixlConnector's) and the field itself. "role" and
# "request_id" are keys too, but words every part of the system uses for other things: those are caught
# where they are read from or written into a value named as the handoff (HANDOFF_NAMES).
HANDOFF_KEYS = frozenset({"kv_transfer_params", "remote_host", "remote_port", "remote_engine_id", "remote_url",
                          "remote_block_ids", "do_remote_prefill", "do_remote_decode", "pulled_on_stop"})
HANDOFF_MODULE = ROOT / "common" / "handoff.py"
SHARED_KEYS = frozenset({"role", "request_id"})
HANDOFF_NAMES = ("kv", "handoff", "transfer")


def test_handoff_keys_are_spelled_only_in_the_handoff_module() -> None:
    """Outside tests (which check the wire format by its bytes), code builds and reads `kv_transfer_params`
    through common.handoff's types: no other module has the keys as string literals."""
    spelled = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
               for path in sources(tuple(name for name in SIZED if name != "tests") + ("setup.py",))
               if path != HANDOFF_MODULE
               for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in HANDOFF_KEYS]
    assert not spelled, "kv_transfer_params keys spelled outside common/handoff.py:\n  " + "\n  ".join(spelled)


def _named_as_handoff(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return any(part in name.lower() for part in HANDOFF_NAMES)


def _shared_key_of_handoff(node: ast.AST) -> bool:
    """`params["role"]`, `params.get("request_id")` or `params["role"] = ...` on a value named as the handoff."""
    if isinstance(node, ast.Subscript):
        target, key = node.value, node.slice
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in ("get", "pop", "setdefault") and node.args):
        target, key = node.func.value, node.args[0]
    else:
        return False
    return (isinstance(key, ast.Constant) and key.value in SHARED_KEYS) and _named_as_handoff(target)


def test_handoff_role_and_request_id_are_read_only_in_the_handoff_module() -> None:
    """"role" and "request_id" of `kv_transfer_params` are read and written through common.handoff too."""
    spelled = [f"{path.relative_to(ROOT)}:{node.lineno}"
               for path in sources(tuple(name for name in SIZED if name != "tests") + ("setup.py",))
               if path != HANDOFF_MODULE
               for node in ast.walk(ast.parse(path.read_text(), str(path))) if _shared_key_of_handoff(node)]
    assert not spelled, "kv_transfer_params' role or request_id read outside common/handoff.py:\n  " + "\n  ".join(
        spelled)
