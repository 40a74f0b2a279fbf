"""The package's layout: imports flow one way (cli -> ingest or query -> store), with no
circle, read from the source with `ast` (every import counts, at module level or in a
function)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "actdb"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name imported from a package counts as
    the submodule when there is one, else as the package)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if a.name != "_native"]
                found = [s for s in subs if s in modules]
                if len(found) < len(subs):
                    found.append(target)
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            edges[name] |= {t for t in found if t in modules and t != name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    assert _circles(_imports()) == []


def test_imports_flow_one_way() -> None:
    """store imports neither ingest nor query (nor the pictures); ingest and query never
    import each other."""
    layer = {"store": "actdb.store", "ingest": "actdb.ingestion", "query": "actdb.query",
             "plot": "actdb.plot"}
    forbidden = {"store": ("ingest", "query", "plot"), "ingest": ("query", "plot"),
                 "query": ("ingest", "plot")}
    wrong = []
    for name, targets in _imports().items():
        for mine, theirs in forbidden.items():
            if name == layer[mine] or name.startswith(layer[mine] + "."):
                wrong += [f"{name} -> {t}" for t in sorted(targets) for other in theirs
                          if t == layer[other] or t.startswith(layer[other] + ".")]
    assert not wrong, wrong
