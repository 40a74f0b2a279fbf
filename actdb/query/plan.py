"""Check a query before DuckDB runs it: one read-only statement, known functions, sane arguments.

DuckDB decides the statement type (it is the engine that will run it); sqlglot's tree is
walked for function calls, so a misspelt function gets the closest names, a tensor function
gets its signature when called wrongly, and literal arguments are checked up front.

sqlglot is imported only for a statement that may call a function, since its checks are all
about calls: importing it and its DuckDB dialect is a large part of a CLI query's start (the
dialect parses dozens of SQL templates as it loads), which
`SELECT * FROM prompts WHERE prompt_id = 3` has no use for. A statement is read by sqlglot too
when DuckDB's own tree of it calls a function, or when its text holds a parenthesis at all: no
call can be written without one, and DuckDB's tree leaves out text it never runs (a named
WINDOW that nothing uses), which sqlglot's reading has always refused when it calls something
refused.
"""

from __future__ import annotations

import difflib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import duckdb

from ..errors import QueryError, QuerySyntaxError
from . import sandbox
from .functions import ANCHORS, INT, REGISTRY, TOKEN, VEC
from .model_weights import ANCHOR_NAMES

if TYPE_CHECKING:
    from sqlglot import exp


def check(query: str, con: duckdb.DuckDBPyConnection, known: Callable[[], set[str]]
          ) -> tuple[str, set[str], set[str]]:
    """The text to run (the query, or an EXPLAIN rebuilt around its checked SELECT), the
    names of the functions it calls and those of the relations it names (lower case,
    sandbox.check_duckdb_tree); a QueryError unless `query` is one sandboxed
    SELECT (sandbox.py) calling known functions with sane literal arguments. `con` only
    parses: it never sees the store; `known()` gives the names of the functions the query
    may call."""
    if not query.strip():
        raise QueryError("the query is empty")
    try:
        select, runnable = sandbox.check_statement(query, con)
        calls, tables = sandbox.check_duckdb_tree(select, con)
    except duckdb.ParserException as e:
        if "expression depth" in str(e):
            raise _too_deep() from None
        raise _syntax_error(query, e) from None
    except duckdb.Error as e:
        raise QueryError(_first_line(e)) from None
    except RecursionError:
        raise _too_deep() from None
    if not calls and "(" not in select:
        return runnable, calls, tables  # nothing for sqlglot's reading to check (the module's note)
    import sqlglot
    from sqlglot import exp

    try:
        tree = sqlglot.parse_one(select, read="duckdb")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError, RecursionError):
        # DuckDB parses what sqlglot does not, and nests deeper than Python's stack lets
        # sqlglot go: DuckDB's own tree was checked above, and its binder checks the rest.
        return runnable, calls, tables
    if isinstance(tree, exp.Command):
        return runnable, calls, tables  # sqlglot's fallback for syntax it lacks: DuckDB's tree
    sandbox.check_sqlglot_tree(tree)
    for node in tree.find_all(exp.Anonymous):
        _check_call(node, known)
    return runnable, calls, tables


class CheckedQueries:
    """`check`'s answers for the last `size` queries a connection checked, by their text:
    the answer is a function of the text alone (the parser cursor never sees the store, and
    the names of known functions are read once a connection), so a query run again (a
    selective query in a loop, with other parameters) skips the two parses. Refusals are not
    kept: a refused query is checked afresh each time."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._done: OrderedDict[str, tuple[str, frozenset[str], frozenset[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, query: str, con: duckdb.DuckDBPyConnection, known: Callable[[], set[str]]
              ) -> tuple[str, set[str], set[str]]:
        with self._lock:
            hit = self._done.get(query)
            if hit is not None:
                self._done.move_to_end(query)
        if hit is None:
            runnable, calls, tables = check(query, con, known)
            hit = (runnable, frozenset(calls), frozenset(tables))
            with self._lock:
                self._done[query] = hit
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
        return hit[0], set(hit[1]), set(hit[2])


def _too_deep() -> QueryError:
    return sandbox.too_deep(sys.getrecursionlimit())


def _first_line(e: duckdb.Error) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first.split(" Error: ", 1)[-1]


def _check_call(node: exp.Anonymous, known_names: Callable[[], set[str]]) -> None:
    name = str(node.name).lower()
    fn = REGISTRY.get(name)
    if fn is None:
        known = known_names()
        if name in known:
            return
        builtin = {n for n in known if not n.startswith("_")} - set(REGISTRY)
        names = list(REGISTRY) + sorted(builtin)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise QueryError(f"unknown function {name!r}{hint}")
    from sqlglot import exp

    args = node.expressions
    lo, hi = fn.arity
    if not lo <= len(args) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise QueryError(
            f"{name}() takes {want} arguments, got {len(args)}; signature: {fn.signature}"
        )
    for param, arg in zip(fn.params, args, strict=False):
        if not isinstance(arg, exp.Literal):
            continue
        value = arg.this
        if param.kind == VEC:
            raise QueryError(f"{name}(): {param.name} must be a vec handle (a vec column or a "
                             f"view of one), got {arg.sql()}; signature: {fn.signature}")
        if param.kind == ANCHORS and (not arg.is_string or value not in ANCHOR_NAMES):
            raise QueryError(f"unknown anchor set {value!r} in {name}(); anchor sets are "
                             f"{list(ANCHOR_NAMES)}")
        if param.kind == INT and (arg.is_string or not value.lstrip("-").isdigit()):
            raise QueryError(f"{name}(): {param.name} must be an integer, got {arg.sql()}; "
                             f"signature: {fn.signature}")
        if param.kind == INT and param.name == "k" and int(value) < 1:
            raise QueryError(f"{name}(): k must be at least 1, got {value}")
        if param.kind == INT and param.name == "dim" and int(value) < 0:
            raise QueryError(f"{name}(): dim must be 0 or more, got {value}")
        if param.kind == TOKEN and not arg.is_string and not value.isdigit():
            raise QueryError(f"{name}(): token must be a string or a token id, got {arg.sql()}")


def _syntax_error(query: str, e: duckdb.ParserException) -> QuerySyntaxError:
    """Line and column where DuckDB puts its caret; sqlglot's position if DuckDB gives none."""
    text = str(e)
    what = text.split("\n")[0].removeprefix("Parser Error: ").removeprefix("syntax error ")
    try:
        pos = _duckdb_position(text) or _sqlglot_position(query) or (1, 1)
    except RecursionError:
        pos = (1, 1)
    line, col = pos
    return QuerySyntaxError(
        f"syntax error at line {line}, column {col}: {what}", query=query, line=line, column=col
    )


def _duckdb_position(message: str) -> tuple[int, int] | None:
    """DuckDB prints `LINE n: <text>` and a caret line under it."""
    lines = message.splitlines()
    for i, ln in enumerate(lines[:-1]):
        if ln.startswith("LINE ") and ":" in ln and "^" in lines[i + 1]:
            head = ln.split(":", 1)[0]
            prefix = len(head) + 2  # "LINE n: "
            if not head[5:].isdigit():
                return None
            return int(head[5:]), lines[i + 1].index("^") - prefix + 1
    return None


def _sqlglot_position(query: str) -> tuple[int, int] | None:
    import sqlglot

    try:
        sqlglot.parse(query, read="duckdb")
    except sqlglot.errors.ParseError as pe:
        if pe.errors:
            err = pe.errors[0]
            return int(err.get("line") or 1), int(err.get("col") or 1)
    except sqlglot.errors.TokenError:
        return None
    return None
