"""Which columns of a query's result hold `vec` handles: read from the outermost SELECT's
syntax tree and the columns' types, for the outputs that refuse handles (csv, json, a file)
and those that read their vectors (`torch()`, `export`, `dataset`)."""

from __future__ import annotations

from typing import Any

import sqlglot
from sqlglot import exp

from .handles import VIEWS

_VIEW_FUNCTIONS = frozenset(VIEWS[1:])
# `vec` of acts, and the vector columns of the weight views (weight_views.py)
_HANDLE_NAMES = frozenset({"vec", "w_in", "w_gate", "w_out", "u", "v"})
# DuckDB's type ids of a column of handles: a DECIMAL(38, 0) (handles.py), or the HUGEINT a
# cast keeping the value gives
_HANDLE_TYPES = frozenset({"hugeint", "decimal"})


def handle_columns(query: str, names: list[str], types: list[Any]) -> list[str]:
    """The columns (`names`, of DuckDB `types`) of `query`'s result that hold vec handles:
    `vec` itself (also through `*`), the weight views' `w_in`, `w_gate`, `w_out`, `u`, `v`,
    and views of them (`normalized(vec)`, ...)."""
    by_name = dict(zip(names, types, strict=True))
    found = {n for n in names if n.lower() in _HANDLE_NAMES}
    try:
        tree = sqlglot.parse_one(query, read="duckdb")
    except sqlglot.errors.ParseError:
        return [n for n in names if n in found and by_name[n].id in _HANDLE_TYPES]
    select = tree if isinstance(tree, exp.Select) else tree.find(exp.Select)
    if select is not None:
        # by each item's output name, not its place: a `*` before it expands to many columns
        for projection in select.expressions:
            name = projection.alias_or_name
            if name not in names:
                continue
            inner = projection.unalias()
            if isinstance(inner, exp.Column) and inner.name.lower() in _HANDLE_NAMES:
                found.add(name)
            elif isinstance(inner, exp.Func) and _function_name(inner) in _VIEW_FUNCTIONS:
                found.add(name)
    # a list named vec (`delta(vec) AS vec`) is a vector the query made, not handles
    return [n for n in names if n in found and by_name[n].id in _HANDLE_TYPES]


def _function_name(node: exp.Func) -> str:
    return (node.name if isinstance(node, exp.Anonymous) else node.sql_name()).lower()
