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
    # gateway.server imports gateway.app inside serve(): a checker reading only module-level imports would miss it.
    assert "gateway" in _imports("gateway")["gateway.server"]
