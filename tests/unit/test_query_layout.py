"""The query package's layout: no import circle among its modules, and no module past about 500
lines. Imports are read from the source with `ast`, wherever they stand, so an import made
inside a function or for type checking alone counts as the dependency it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

QUERY = Path(__file__).resolve().parents[2] / "actdb" / "query"
MAX_LINES = 520


def imports(path: Path) -> set[str]:
    """The modules of actdb.query that `path` imports anywhere in its text: at the top, inside
    functions, and for type checking alone (a type a module needs is a dependency too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1:  # from .x import y / from . import x
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out |= {a.name for a in node.names}
        elif node.module and node.module.startswith("actdb.query."):
            out.add(node.module.split(".")[2])
    return out & {p.stem for p in QUERY.glob("*.py")}


def graph() -> dict[str, set[str]]:
    return {p.stem: imports(p) - {p.stem} for p in sorted(QUERY.glob("*.py"))}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as the path around it (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_query() -> None:
    assert circles(graph()) == []


@pytest.mark.parametrize("path", sorted(QUERY.glob("*.py")), ids=lambda p: p.name)
def test_modules_stay_readable(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES
