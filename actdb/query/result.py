"""A query's result: DuckDB's own method names, with our errors instead of DuckDB's wraps."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import duckdb
import numpy as np

from ..errors import ActdbError, MissingDependencyError, QueryError
from ..lazy import lazy_module
from .bound import BoundQuery
from .execute import ErrorBox
from .sandbox import too_deep
from .timeout import TimeLimit

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    pc = lazy_module("pyarrow.compute")
    torch = lazy_module("torch")



class Gather(Protocol):
    """What a result asks of its database to turn a column of handles into vectors."""

    def holds(self, col: pa.ChunkedArray) -> bool:
        """Whether every value of `col` is a handle of the database's connection."""

    def __call__(self, col: pa.ChunkedArray, what: str) -> Any:
        """The vectors of a column of handles (no NULLs) as float32 [n, d] on the device,
        views applied; `what` names the rows in errors (VectorSource.gather)."""

T = TypeVar("T")


class Result:
    """A query's rows, lazy until first fetched or shown; then computed once and kept.

    `relation` is DuckDB's relation of the query, or a BoundQuery where the query was bound
    before (bound.py): either gives the columns and types before any row is computed.

    DuckDB's names: `.df()`, `.pl()`, `.arrow()` / `.to_arrow_table()`, `.fetchall()`,
    `.fetchone()`, `.fetchnumpy()`, `.torch()`, `.show()`, `.limit(n)`. In a notebook a Result
    shows its first rows and its row count.
    """

    PREVIEW_ROWS = 10
    note: str | None = None  # how a cluster ran the query (distributed.py), else None

    def __init__(self, relation: duckdb.DuckDBPyRelation | BoundQuery, box: ErrorBox, query: str,
                 gather: Gather | None = None, *, limit: TimeLimit | None = None,
                 seconds: float | None = None) -> None:
        self._rel = relation
        self._box = box
        self.query = query
        self.gather = gather  # the database's vectors of handles, for `.torch()`
        self._limit, self._seconds = limit, seconds  # the time limit its computing runs under
        self._table: pa.Table | None = None  # the rows, once computed
        self._cursor = 0  # fetchone's position in them

    @property
    def columns(self) -> list[str]:
        return list(self._rel.columns)

    @property
    def types(self) -> list[Any]:
        """DuckDB's type of each column."""
        return list(self._rel.types)

    def _timed(self) -> AbstractContextManager[None]:
        """The query's time limit (timeout.py) around a step that computes its rows."""
        if self._limit is None:
            return nullcontext()
        return self._limit.running(self._seconds)

    def _run(self, fetch: Callable[[], T]) -> T:
        self._box.error = None
        with self._timed():
            try:
                return fetch()
            except duckdb.Error as e:
                raise translate(e, self._box) from None
            except RuntimeError as e:
                raise interrupted(e) from None

    def _rows(self) -> pa.Table:
        """The whole result as Arrow, computed on first use and kept (tensor functions are
        the expensive part of a query: never run them twice for one Result)."""
        if self._table is None:
            self._table = self._run(self._rel.to_arrow_table)
        return self._table

    def df(self) -> Any:
        """A pandas DataFrame."""
        return converted(self._rows(), lambda t: t.to_pandas(), "df()")

    def to_arrow_table(self) -> pa.Table:
        """A pyarrow Table."""
        return self._rows()

    arrow = to_arrow_table

    def pl(self) -> Any:
        """A polars DataFrame (needs the `polars` package)."""
        try:
            import polars
        except ImportError:
            raise MissingDependencyError(
                "Result.pl() needs polars, which is not installed: pip install polars "
                "(or use .df() for pandas, .arrow() for Arrow)") from None
        return polars.from_arrow(self._rows())

    def fetchall(self) -> list[tuple[Any, ...]]:
        """Every row as a tuple."""
        table = self._rows()
        columns = converted(table, _python_columns, "fetchall()")
        return list(zip(*columns, strict=True)) if columns else []

    def text(self, *, max_colwidth: int = 80) -> str:
        """Every row as aligned plain text, tokens' whitespace made visible (the CLI's table
        output). Rows not computed yet whose columns all hold numbers, text, or lists and
        structs of them are fetched once as DuckDB's Python values, without Arrow (importing
        pyarrow would be a large part of a `SELECT 1`'s start); any other type is shown
        from Arrow, as Python's values of times, intervals or maps differ from it (a
        TIMESTAMP_NS's nanoseconds, an infinite date)."""
        from .display import text_table

        names = self.columns
        if self._table is None and all(_plain(t) for t in self._rel.types):
            rows = self._run(self._rel.fetchall)
            columns = [list(c) for c in zip(*rows, strict=True)] if rows else []
        else:
            columns = converted(self._rows(), _python_columns, "the table output")
        return text_table(names, columns, max_colwidth=max_colwidth)

    def fetchone(self) -> tuple[Any, ...] | None:
        """The next row as a tuple, or None after the last (each call moves on one row)."""
        table = self._rows()
        if self._cursor >= table.num_rows:
            return None
        columns = converted(table.slice(self._cursor, 1), _python_columns, "fetchone()")
        self._cursor += 1
        return tuple(c[0] for c in columns)

    def fetchnumpy(self) -> dict[str, np.ndarray]:
        """Each column as a NumPy array."""
        return {name: col.to_numpy(zero_copy_only=False)
                for name, col in zip(self._rows().column_names, self._rows().columns,
                                     strict=True)}

    def torch(self) -> dict[str, Any]:
        """Every column as a torch tensor (DuckDB's `.torch()`): numbers and booleans [N]; a
        `vec` column (or a view of it) the vectors [N, d] in float32, as `db.vectors` gives
        them, on the database's device; a list column of numbers (`to_list`, `delta`,
        `mean_vector`) [N, L] when every row holds L of them. Any other column (text,
        structs) is a QueryError naming it, as in DuckDB, where it used to be left out."""
        table = self._rows()
        named = set(self.handle_columns())  # `vec` and its views in the outermost SELECT
        out = {}
        for name, col in zip(table.column_names, table.columns, strict=True):
            # handles by their values too (a subquery's alias, a CTE, a CASE): a HUGEINT
            # column whose every value opens under the connection's key (handles.py)
            if pa.types.is_decimal(col.type) and (
                    name in named or (self.gather is not None and self.gather.holds(col))):
                if self.gather is None:
                    raise QueryError(f"column {name!r} holds vec handles, and this result "
                                     "has no store to read their vectors from")
                out[name] = self.gather(handle_values(col, name), f"column {name!r}")
            else:
                values = converted(pa.table({name: col}), lambda t: column_values(
                    t.column(0), t.column_names[0], "torch()"), "torch()")
                out[name] = torch.from_numpy(values)
        return out

    def handle_columns(self) -> list[str]:
        """The columns that hold vec handles (handle_columns.py)."""
        from .handle_columns import handle_columns

        return handle_columns(self.query, self.columns, self.types)

    def limit(self, n: int, offset: int = 0) -> Result:
        """The first `n` rows (after `offset`), as a new lazy Result."""
        try:  # a BoundQuery binds its relation here (bound.py)
            rel = self._rel.limit(n, offset)
        except duckdb.Error as e:
            raise translate(e, self._box) from None
        return Result(rel, self._box, self.query, self.gather, limit=self._limit,
                      seconds=self._seconds)

    def show(self) -> None:
        """Print the first rows and the row count."""
        print(repr(self))

    def __len__(self) -> int:
        return self._rows().num_rows

    def _repr_html_(self) -> str:
        import html

        from .display import html_preview

        try:  # a notebook shows what went wrong in place of the rows, never a traceback
            table = self._rows()
            return converted(table.slice(0, self.PREVIEW_ROWS), lambda t: html_preview(
                t, table.num_rows, self.columns), "the notebook preview")
        except ActdbError as e:
            return f"<pre>actdb.Result columns={html.escape(str(self.columns))}: " \
                   f"{html.escape(str(e))}</pre>"

    def record_batches(self, rows_per_batch: int = 65536) -> Iterator[pa.RecordBatch]:
        """Stream the result in Arrow record batches, so memory stays bounded (a time limit
        covers the whole stream, until its last batch is read)."""
        self._box.error = None
        with self._timed():
            try:
                reader = self._rel.to_arrow_reader(rows_per_batch)
                yield from reader
            except duckdb.Error as e:
                raise translate(e, self._box) from None
            except RuntimeError as e:
                raise interrupted(e) from None

    def __repr__(self) -> str:
        from .display import text_preview

        try:
            table = self._rows()
            return converted(table.slice(0, self.PREVIEW_ROWS), lambda t: text_preview(
                t, table.num_rows, self.columns), "the preview")
        except Exception as e:  # noqa: BLE001 - a repr must not raise; say what went wrong
            return f"<actdb.Result columns={self.columns}: {e}>"


def converted(table: pa.Table, convert: Callable[[pa.Table], T], what: str) -> T:
    """`convert(table)`, or one sentence naming the first column it cannot convert: Arrow
    holds values that Python, pandas, CSV or Parquet cannot (a DATE or TIMESTAMP past
    Python's year 9999 or at DuckDB's infinity, an INTERVAL in CSV or Parquet)."""
    try:
        return convert(table)
    except ActdbError:
        raise  # a sentence of ours (a QueryError is a ValueError too)
    except (OverflowError, ValueError, NotImplementedError, pa.ArrowException) as e:
        error = e
    for i, name in enumerate(table.column_names):
        try:
            convert(table.select([i]))
        except ActdbError:
            raise
        except (OverflowError, ValueError, NotImplementedError, pa.ArrowException) as e:
            raise _unconvertible(what, name, e) from None
    raise _unconvertible(what, None, error) from None


def _unconvertible(what: str, name: str | None, e: BaseException) -> QueryError:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if name is None:
        return QueryError(f"{what} cannot hold this result ({why})")
    quoted = name if name.isidentifier() else '"' + name.replace('"', '""') + '"'
    return QueryError(f"{what} cannot hold column {name!r} ({why}); select it as text, "
                      f"CAST({quoted} AS VARCHAR), or leave out the rows it cannot hold")


def handle_values(col: pa.ChunkedArray, name: str) -> pa.ChunkedArray:
    """A column of vec handles, refusing NULLs (each handle is checked where it is opened)."""
    if col.null_count:
        raise QueryError(f"column {name!r} holds NULL handles; filter them out first")
    return col


def _python_columns(table: pa.Table) -> list[list[Any]]:
    return [c.to_pylist() for c in table.columns]


def _numbers(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def column_values(col: pa.ChunkedArray, name: str, what: str) -> np.ndarray:
    """A column as a NumPy array a tensor can take: numbers and booleans [N] (NaN for NULL in
    a float column; DECIMAL and HUGEINT as float64, as DuckDB's own `.torch()` gives them), or
    a list column of numbers [N, L] when every row holds L of them."""
    t = col.type
    if pa.types.is_decimal(t):
        col, t = col.cast(pa.float64()), pa.float64()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = t.value_type
        if not _numbers(inner):
            raise QueryError(f"{what}: column {name!r} holds lists of {inner}, which a tensor "
                             "cannot hold")
        if col.null_count:
            raise QueryError(f"{what}: column {name!r} holds NULL lists; filter them out first")
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        if len(lengths) and not np.all(lengths == lengths[0]):
            raise QueryError(f"{what}: column {name!r} holds lists of {int(lengths.min())} to "
                             f"{int(lengths.max())} values; a tensor needs the same length on "
                             "every row")
        flat = pc.list_flatten(col)
        if flat.null_count:
            raise QueryError(f"{what}: column {name!r} holds lists with NULL elements")
        if pa.types.is_decimal(inner):
            flat = flat.cast(pa.float64())
        values = np.array(flat.to_numpy(zero_copy_only=False))  # a copy torch may write to
        return values.reshape(len(lengths), int(lengths[0]) if len(lengths) else 0)
    values = np.array(col.to_numpy(zero_copy_only=False))
    if values.dtype.kind not in "biuf":
        if pa.types.is_boolean(t):  # NULLs make NumPy's booleans objects
            raise QueryError(f"{what}: column {name!r} holds NULL booleans, which a bool "
                             "tensor cannot hold; filter or coalesce them")
        raise QueryError(f"{what}: column {name!r} holds {t} values, which a tensor cannot "
                         "hold; select it apart, or use .df() or .arrow()")
    return values


# DuckDB types whose Python values print as their Arrow values do (display._cell)
_PLAIN_TYPES = frozenset({
    "boolean", "tinyint", "smallint", "integer", "bigint", "hugeint", "utinyint", "usmallint",
    "uinteger", "ubigint", "uhugeint", "float", "double", "decimal", "varchar", "null"})


def _plain(t: Any) -> bool:
    """Whether DuckDB type `t` holds numbers or text, or lists, arrays or structs of them."""
    if t.id in ("list", "array"):
        return _plain(t.children[0][1])
    if t.id == "struct":
        return all(_plain(c) for _, c in t.children)
    return t.id in _PLAIN_TYPES


def interrupted(e: RuntimeError) -> BaseException:
    """DuckDB's Python client ends a query that Ctrl-C interrupts with RuntimeError('Query
    interrupted'): a KeyboardInterrupt, as Python would raise; any other RuntimeError as it is."""
    return KeyboardInterrupt() if str(e) == "Query interrupted" else e


def translate(e: duckdb.Error, box: ErrorBox) -> BaseException:
    """The ActdbError a UDF raised, or DuckDB's message as one sentence; Ctrl-C (DuckDB's
    interrupt, or a KeyboardInterrupt inside a UDF, which DuckDB wraps) as KeyboardInterrupt,
    so that `except QueryError` never swallows it."""
    text = str(e).strip()
    if isinstance(e, duckdb.InterruptException) or (
            "executing the UDF: KeyboardInterrupt" in text):
        box.error = None  # an error a TRY() swallowed earlier in the query is not this one
        return KeyboardInterrupt()
    if box.error is not None:
        err, box.error = box.error, None
        return err
    first = text.splitlines()[0] if text else type(e).__name__
    depth = re.search(r"Max expression depth limit of (\d+) exceeded", first)
    if depth:
        return too_deep(int(depth.group(1)))
    if "Mixing named and positional parameters" in first:
        return QueryError("the query mixes named ($name) and positional (? or $1) parameters, "
                          "or names them while params is a list: give params as a dict for "
                          "$name, a list for ? and $1")
    nested = re.search(r"Unimplemented type for cast \((.+)\[\] -> ([^\[\]]+)\)$", first)
    if nested:  # DuckDB's words for a list where a number belongs
        return QueryError(f"a list was given where a number belongs ({nested.group(1)}[] -> "
                          f"{nested.group(2)}); a direction for cosine_to or project is one "
                          "vector: a 1-D list, array or tensor (x[0], not x[0:1])")
    for prefix in ("Binder Error: ", "Catalog Error: ", "Conversion Error: ",
                   "Invalid Input Error: ", "Parser Error: ", "Out of Range Error: "):
        first = first.removeprefix(prefix)
    wrong_types = ("does not support the supplied arguments", "No function matches the given")
    if any(w in text for w in wrong_types):
        from .functions import REGISTRY

        for fn in REGISTRY.values():
            if f"_actdb_{fn.name}_s" in text or f"Macro {fn.name}(" in text:
                return QueryError(f"{fn.name}() got arguments of the wrong type; signature: "
                                  f"{fn.signature}")
    if "Python exception occurred while executing the UDF" in first:
        first = first.split(": ", 1)[-1]
    # DuckDB's own hint for a misspelt name, on a line of its own: kept
    hints = [ln.strip() for ln in text.splitlines()[1:]
             if ln.strip().startswith(("Did you mean", "Candidate bindings:"))]
    if hints:
        first = f"{first.rstrip('!')}; {'; '.join(h[0].lower() + h[1:] for h in hints)}"
    return QueryError(first)
