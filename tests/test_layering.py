"""Imports point one way: gateway → routing → nothing of kvgate; the product never imports its test double.
Read from the source (every import statement, at any depth), not from what happens to be loaded."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "routing", "loadtests")


def _imports(package: str) -> dict[str, set[str]]:
    """module → the top-level kvgate packages it imports."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in (ROOT / package).rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found[module] |= {name.split(".")[0] for name in names if name.split(".")[0] in PACKAGES}
    return found


def test_routing_imports_nothing_of_the_gateway() -> None:
    offenders = {m: deps for m, deps in _imports("routing").items() if "gateway" in deps or "loadtests" in deps}
    assert not offenders


def test_the_gateway_never_imports_the_emulator() -> None:
    offenders = {m: deps for m, deps in _imports("gateway").items() if "loadtests" in deps}
    assert not offenders


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = {package: set().union(*_imports(package).values()) - {package} for package in PACKAGES}
    for package in PACKAGES:
        seen, frontier = set(), list(graph[package])
        while frontier:
            current = frontier.pop()
            assert current != package, f"{package} reaches itself through {sorted(seen)}"
            if current not in seen:
                seen.add(current)
                frontier.extend(graph.get(current, ()))


def test_the_checker_sees_imports_inside_functions() -> None:
    # gateway.cli imports its commands inside main() (the one place allowed): a checker reading only module-level
    # imports would miss them.
    assert "gateway" in _imports("gateway")["gateway.cli"]


# ── inside a package: no module-level cycle, and no kvgate import hidden in a function ───────────────────────
def _module_names(package: str) -> dict[str, Path]:
    names = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvgate modules an import statement loads (a `from package import module` names the module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:  # relative: resolved against the importing module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    found = {f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in known}
    if len(found) < len(node.names) and source in known:
        found.add(source)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(package: str) -> dict[str, set[str]]:
    """module → the kvgate modules it imports when it is loaded (not inside a function, not only for type checkers)."""
    names = _module_names(package)
    known = set(_module_names("gateway")) | set(_module_names("routing")) | set(_module_names("loadtests"))
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        edges: set[str] = set()
        pending: list[ast.AST] = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and _is_type_checking(node):
                pending.extend(node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, module, path.name == "__init__.py", known)
            pending.extend(ast.iter_child_nodes(node))
        graph[module] = edges - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle_inside_a_package() -> None:
    for package in ("gateway", "routing"):
        graph = _module_level_imports(package)
        inside = {m: {t for t in deps if t.split(".")[0] == package} for m, deps in graph.items()}
        assert not import_cycles(inside), f"{package}: modules that import each other, directly or around a circle"


def test_no_import_cycle_between_subpackages() -> None:
    """Folders are layers: http → serving → pd, admission, tenancy, integrity, telemetry → config and errors (and
    routing's engines, policies, prefix_index, state under its workers and pools), never back up."""
    for package in ("gateway", "routing"):
        graph: dict[str, set[str]] = defaultdict(set)
        for module, deps in _module_level_imports(package).items():
            unit = ".".join(module.split(".")[:2])
            graph[unit] |= {".".join(d.split(".")[:2]) for d in deps if d.split(".")[0] == package} - {unit}
        assert not import_cycles(graph), f"{package}: subpackages that import each other"


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = {"gateway.a": {"gateway.b"}, "gateway.b": {"gateway.c"}, "gateway.c": {"gateway.a"}, "gateway.d": set()}
    assert import_cycles(graph) == [["gateway.a", "gateway.b", "gateway.c"]]


def test_no_kvgate_import_inside_a_function() -> None:
    """A function-level import hides a dependency (often a cycle) from whoever reads the module's head; only the
    command line defers its commands' imports, so `kvgate --help` stays fast."""
    offenders = []
    for package in ("gateway", "routing"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "gateway" / "cli.py":
                continue
            for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        names = ["." if node.level else (node.module or "")]
                    else:
                        continue
                    if any(name == "." or name.split(".")[0] in PACKAGES for name in names):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders
