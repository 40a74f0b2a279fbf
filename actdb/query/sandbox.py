"""The query sandbox: which statements run, what they may call, and the engine settings behind it.

Three layers, each enough on its own for the escapes we know of, so that a gap in one is caught
by the next:
1. DuckDB's own parser says the statement is one SELECT (or an EXPLAIN whose inner statement
   is one SELECT; EXPLAIN ANALYZE executes, which is harmless for a SELECT).
2. The statement's trees, both DuckDB's (`json_serialize_sql`) and sqlglot's (for every
   statement that calls a function or holds a parenthesis: plan.py), are walked: table
   functions must be on an allow-list (no file readers, no `query()`, no raw Arrow pointers),
   scalar functions that change session state and actdb's internal UDFs are refused, and a
   table named like a path (`FROM 'file.csv'`) is refused.
3. The connection runs with external access off, extension auto-install and auto-load off,
   Python replacement scans off, and the configuration locked, so DuckDB itself refuses files,
   downloads and `SET`s whatever got past 1 and 2.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import duckdb

from ..errors import QueryError

if TYPE_CHECKING:
    from sqlglot import exp

# Applied in this order after the query layer's views, macros and UDFs are set up; the last
# one makes every setting (these and the rest) read-only. DuckDB shares one database instance
# between the connections of a process to one file, and these settings are the instance's, so
# a second connection to a store may find them already applied and locked.
LOCKDOWN = (
    ("enable_external_access", False),
    ("autoinstall_known_extensions", False),
    ("autoload_known_extensions", False),
    ("python_enable_replacements", False),  # this one is the connection's own
    ("lock_configuration", True),
)
_PER_CONNECTION = {"python_enable_replacements"}

# Table functions that compute or describe, and read nothing outside the database.
TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "repeat", "repeat_row", "json_each", "json_tree",
    "histogram", "histogram_values", "summary", "icu_calendar_names", "pg_timezone_names",
    "duckdb_columns", "duckdb_constraints", "duckdb_databases",
    "duckdb_dependencies", "duckdb_functions", "duckdb_indexes", "duckdb_keywords",
    "duckdb_schemas", "duckdb_sequences", "duckdb_tables", "duckdb_types", "duckdb_views",
    "pragma_table_info", "pragma_show", "pragma_version", "pragma_platform",
    "pragma_database_size", "pragma_collations",
})

# Scalar functions with effects beyond their result (session state, logs, profiling).
SCALAR_REFUSED = frozenset({
    "setseed", "write_log", "enable_profile", "disable_profile", "nextval", "currval",
})

FILE_HINT = ("queries cannot read files; name the file as a table instead: "
             "actdb query --table NAME=FILE, or db.register(NAME, path)")

_PATH_CHARS = frozenset("./\\:*?~")


def too_deep(levels: int) -> QueryError:
    """The one sentence for a query nested past the parsers' or DuckDB's depth limit: DuckDB's
    own advice, `SET max_expression_depth`, is a SET, which the sandbox refuses."""
    return QueryError(f"the query nests deeper than {levels} levels (subqueries, CTEs built on "
                      "one another, or nested expressions), a limit queries cannot raise; "
                      "flatten it, or run a part first and join its result as a table "
                      "(db.register, --table)")


def is_locked(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the connection's configuration is locked (by us, on another connection)."""
    rows = con.execute("SELECT current_setting('lock_configuration')").fetchall()
    return bool(rows and rows[0][0])


def lock(con: duckdb.DuckDBPyConnection) -> None:
    """Turn external access and extension loading off and lock the configuration; where it is
    locked already, check that every one of these settings is in force."""
    if is_locked(con):
        # A later connection cannot turn Python replacement scans off. They look only at the
        # locals of the frame that calls DuckDB, bound.py's _relation, which holds the
        # connection, the query text and its parameters: no data frame to find.
        if con.execute("SELECT current_setting('temp_directory')").fetchall() != [
                (spill_directory(),)]:
            raise QueryError("the store's catalog is open elsewhere in this process with its "
                             "settings locked and another temporary directory; close that "
                             "connection first")
        for name, want in LOCKDOWN:
            if name in _PER_CONNECTION:
                continue
            rows = con.execute("SELECT current_setting(?)", [name]).fetchall()
            if not rows or bool(rows[0][0]) != want:
                raise QueryError(f"the store's catalog is open elsewhere in this process with "
                                 f"{name} = {not want} and its settings locked; close that "
                                 "connection first")
        return
    # DuckDB lets a locked-down connection read and write its temporary directory: for an
    # in-memory database that is `.tmp` under the working directory, where any file a user
    # keeps would be readable by a query. It spills into a folder of this process's own.
    spill = spill_directory().replace("'", "''")
    con.execute(f"SET temp_directory = '{spill}'")
    for name, want in LOCKDOWN:
        con.execute(f"SET {name} = {str(want).lower()}")


_SPILL: list[str] = []


def spill_directory() -> str:
    """A folder only this process uses (mode 0700, removed at exit), for DuckDB's spills."""
    if not _SPILL:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="actdb-spill-")
        atexit.register(shutil.rmtree, folder, True)
        _SPILL.append(folder)
    return _SPILL[0]


def check_statement(query: str, con: duckdb.DuckDBPyConnection) -> tuple[str, str]:
    """(the SELECT a query runs, the text to run); a QueryError for anything else. DuckDB
    parse errors propagate as duckdb.ParserException.

    For an EXPLAIN the text to run is rebuilt from a fixed prefix and the checked SELECT, so
    a comment or quote that makes our reading of the prefix differ from DuckDB's can never
    smuggle another statement past the check: DuckDB runs exactly what was checked."""
    statements = con.extract_statements(query)
    if len(statements) != 1:
        raise QueryError(f"give one statement at a time; the query holds {len(statements)}")
    kind = _kind(statements[0])
    if kind == "EXPLAIN":
        prefix, inner = _explained(query)
        inner_statements = con.extract_statements(inner) if inner.strip() else []
        inner_kind = _kind(inner_statements[0]) if len(inner_statements) == 1 else "MULTI"
        if inner_kind != "SELECT":
            raise QueryError(
                "EXPLAIN (and EXPLAIN ANALYZE, which executes) is allowed only for one plain "
                f"SELECT; this one explains {_article(inner_kind)} {inner_kind} statement"
            )
        return inner, f"{prefix} {inner}"
    if kind == "MULTI":
        raise QueryError("the query expands to several statements (a PIVOT without an IN list "
                         "does); give one plain SELECT, e.g. PIVOT ... ON col IN (...)")
    if kind != "SELECT":
        raise QueryError(f"queries are read-only: {_article(kind)} {kind} statement would "
                         "change the store or the session, so it is refused")
    return query, query


def check_duckdb_tree(select: str, con: duckdb.DuckDBPyConnection
                      ) -> tuple[set[str], set[str]]:
    """Walk DuckDB's own parse tree of a SELECT for refused functions and file tables; the
    names of the functions it calls and of the relations it names, in lower case (operators
    such as `+` and `LIKE` are functions there; table functions and window calls,
    `f(x) OVER (...)`, are counted too; a relation is named as written, with its schema if
    it has one, a CTE's name counts as one, and a SHOW or DESCRIBE as `show ...`)."""
    rows = con.execute("SELECT json_serialize_sql(?::VARCHAR)", [select]).fetchall()
    tree = json.loads(rows[0][0]) if rows else {"error": True}
    if tree.get("error"):
        raise QueryError("the query could not be checked by the sandbox "
                         f"({tree.get('error_message', 'no parse tree')}); give one plain SELECT")
    calls: set[str] = set()
    tables: set[str] = set()
    for node in _dicts(tree):
        if node.get("type") == "TABLE_FUNCTION":
            name = str(node.get("function", {}).get("function_name", ""))
            calls.add(name.lower())
            _check_table_function(name)
            if name.lower() in _RELATION_ARGUMENT:
                _check_relation_argument(name.lower(), node["function"].get("arguments", []))
        elif node.get("class") in ("FUNCTION", "WINDOW") and "function_name" in node:
            name = str(node.get("function_name", ""))
            calls.add(name.lower())
            _check_scalar(name)
        elif node.get("type") == "BASE_TABLE":
            _check_table_name(str(node.get("table_name", "")))
            parts = (node.get("catalog_name"), node.get("schema_name"), node.get("table_name"))
            tables.add(".".join(str(p) for p in parts if p).lower())
        elif node.get("type") == "SHOW_REF":  # (SHOW TABLES), (DESCRIBE t): the catalog listed
            tables.add(f"show {node.get('table_name', '')}".lower())
    return calls, tables


def check_sqlglot_tree(tree: exp.Expr) -> None:
    """Walk sqlglot's tree of the query: nothing but a query, no refused function or table."""
    from sqlglot import exp

    for node in tree.walk():
        if isinstance(node, exp.Command | exp.Copy | exp.Create | exp.Insert | exp.Update
                      | exp.Delete | exp.Drop | exp.Pragma | exp.Set | exp.Use | exp.Merge
                      | exp.Attach | exp.Detach | exp.Install):
            raise QueryError(f"queries are read-only: {node.key.upper()} is refused inside a "
                             "query")
        if isinstance(node, exp.Func):
            _check_scalar(node.name if isinstance(node, exp.Anonymous) else node.sql_name())
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            _check_table_name(node.name)


def _check_table_function(name: str) -> None:
    low = name.lower()
    if low in TABLE_FUNCTIONS:
        return
    if _reads_files(low):
        raise QueryError(f"{low}() is refused: {FILE_HINT}")
    raise QueryError(f"table function {low}() is refused in queries; allowed table functions "
                     f"are {', '.join(sorted(TABLE_FUNCTIONS))}")


# Table functions whose first argument names a relation, looked up by DuckDB's
# `query_table`, which reads a file of that name where no relation has it.
_RELATION_ARGUMENT = frozenset({"histogram", "histogram_values"})


def _check_relation_argument(name: str, arguments: list[Any]) -> None:
    """The relation is written as a name or a string holding one, never a path, a parameter
    or an expression (whose value the check cannot see)."""
    first = arguments[0].get("expression", {}) if arguments else {}
    literal = first.get("literal", {}) if first.get("class") == "CONSTANT" else {}
    names = first.get("column_names", []) if first.get("class") == "COLUMN_REF" else []
    if len(names) == 1:  # `acts`, `"acts"`; `"x.csv"` and `x.csv` (two names) are paths
        _check_table_name(str(names[0]))
        return
    if literal.get("kind") == "STRING":
        _check_table_name(str(literal.get("text", "")))
        return
    raise QueryError(f"{name}() takes the name of a table or view as its first argument "
                     "(e.g. acts), not a qualified name, a parameter or an expression")


def _reads_files(name: str) -> bool:
    """DuckDB's file readers, by name (the allow-list refuses any others it does not know)."""
    return name.startswith(("read_", "parquet_", "sniff_")) or name == "glob"


def _check_scalar(name: str) -> None:
    low = name.lower()
    if _reads_files(low):
        raise QueryError(f"{low}() is refused: {FILE_HINT}")
    if low.startswith("_actdb_"):
        raise QueryError(f"{low}() is internal to actdb; call the tensor functions by their "
                         "names (actdb functions lists them)")
    if low in SCALAR_REFUSED:
        raise QueryError(f"{low}() changes the session, so it is refused in queries")


def _check_table_name(name: str) -> None:
    if _PATH_CHARS & set(name):
        raise QueryError(f"table {name!r} looks like a file path: {FILE_HINT}")


def _dicts(tree: Any) -> Iterator[dict[str, Any]]:
    """Every dict in a JSON tree, iteratively: a deep query must not exhaust the stack."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _kind(statement: Any) -> str:
    return str(statement.type).rsplit(".", 1)[-1]


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"


# An EXPLAIN option list we pass on: words and commas only, nothing that can hide text.
_OPTIONS = re.compile(r"\(\s*[A-Za-z_]+(\s+[A-Za-z_]+)?(\s*,\s*[A-Za-z_]+(\s+[A-Za-z_]+)?)*\s*\)")


def _explained(query: str) -> tuple[str, str]:
    """(a clean EXPLAIN prefix, the statement it wraps): after EXPLAIN, an optional ANALYZE
    and an optional option list of plain words, comments skipped. The prefix is rebuilt from
    what was recognised, so any misreading only changes what is explained, never adds to it."""
    i = _skip_blank(query, 0)
    words: list[str] = []
    while len(words) < 2:
        word = re.match(r"[A-Za-z]+", query[i:])
        text = word.group(0).upper() if word else ""
        if (not words and text != "EXPLAIN") or (words and text not in ("ANALYZE", "ANALYSE")):
            break
        words.append(text)
        i = _skip_blank(query, i + len(text))
    if query[i:i + 1] == "(":
        options = _OPTIONS.match(query, i)
        if options is None:
            raise QueryError("EXPLAIN options may be plain words only, e.g. "
                             "EXPLAIN (ANALYZE, FORMAT json) SELECT ...")
        words.append(options.group(0))
        i = _skip_blank(query, options.end())
    return " ".join(words or ["EXPLAIN"]), query[i:]


def _skip_blank(query: str, i: int) -> int:
    """The index of the first character at or after i that is not blank or in a comment."""
    while i < len(query):
        if query[i].isspace():
            i += 1
        elif query.startswith("--", i):
            end = query.find("\n", i)
            i = len(query) if end < 0 else end + 1
        elif query.startswith("/*", i):
            end = query.find("*/", i + 2)
            i = len(query) if end < 0 else end + 2
        else:
            break
    return i


__all__ = ["FILE_HINT", "LOCKDOWN", "TABLE_FUNCTIONS", "check_duckdb_tree",
           "check_sqlglot_tree", "check_statement", "lock", "too_deep"]
