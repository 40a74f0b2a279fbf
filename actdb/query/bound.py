"""Queries bound before: DuckDB's binder asked once for a query run again.

`Database.sql` binds each query as it is made, so that a misspelt column is an error there and
a result knows its columns before it runs; DuckDB then binds it again when its rows are
computed (its relation API submits the SQL text). A query run again, such as a selective query
in a loop over other ids, would bind a second time for nothing: what the binder said still
holds while nothing its names read has changed (DuckDB's catalog version, which the relation
API checks the same way before it trusts a schema it bound) and its parameters bind as before.
So the binder's answer is kept by the query's text, the catalog version and its parameters'
SQL types (and values, for all but lists: a scalar can steer the binder, as a struct key or a
format does, while a list of ids is data); a later run with the same key submits the text
directly. Refusals are not kept: a query that failed to bind is bound afresh each time.

The submission goes through `duckdb._seam`, the engine seam of the DuckDB build this package
runs on; a DuckDB without it binds every query as its relation API does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any

import duckdb

try:
    from duckdb import _seam
except ImportError:  # another build of DuckDB: every query binds through its relations
    _seam = None  # type: ignore[assignment]

_NEEDED = ("submit", "catalog_version", "literal_type")
ENABLED = _seam is not None and all(hasattr(_seam, n) for n in _NEEDED)

Params = dict[str, Any] | list[Any] | None
# The most values a list parameter holds (nested lists counted through) for its query's bind
# to be kept: DuckDB converts each value to learn the list's type, about as long as the bind
# a query run again saves for a list of a thousand; a longer one binds every time.
LIST_VALUES = 1024


def _longer(value: list[Any] | tuple[Any, ...], limit: int) -> bool:
    """Whether `value` holds more than `limit` values, nested lists counted through (the
    count stops once past `limit`; a list whose first value is no list holds no lists, or
    DuckDB refuses it)."""
    left = limit
    stack = [value]
    while stack:
        items = stack.pop()
        left -= len(items)
        if left < 0:
            return True
        if items and isinstance(items[0], list | tuple):  # a list's values share a type
            stack.extend(items)
    return False


def _relation(con: duckdb.DuckDBPyConnection, text: str, params: Params) -> Any:
    """DuckDB's relation for a query, built in a frame whose locals hold no data frame (see
    sandbox.lock on Python replacement scans)."""
    return con.sql(text, params=params) if params is not None else con.sql(text)


class BoundQuery:
    """A query whose binding is known, with the part of a DuckDB relation that `Result` uses:
    its columns and types, its rows as Arrow or as tuples, a reader of its batches, and a
    relation of its own for anything else (`limit`), bound when first asked for. Each read
    submits the query anew, as a relation's does."""

    def __init__(self, con: duckdb.DuckDBPyConnection, text: str, params: Params,
                 columns: list[str], types: list[Any], version: int) -> None:
        self._con, self._text, self._params = con, text, params
        self._columns, self._types, self._version = columns, types, version
        self._relation: duckdb.DuckDBPyRelation | None = None

    def relation(self) -> duckdb.DuckDBPyRelation:
        if self._relation is None:
            self._relation = _relation(self._con, self._text, self._params)
        return self._relation

    def _current(self) -> bool:
        """Whether the schema kept still holds (else the relation binds it again)."""
        return self._relation is None and _seam.catalog_version(self._con) == self._version

    @property
    def columns(self) -> list[str]:
        return list(self._columns) if self._current() else self.relation().columns

    @property
    def types(self) -> list[Any]:
        return list(self._types) if self._current() else self.relation().types

    def _submit(self, form: str, batch_size: int = 131072) -> Any:
        return _seam.submit(self._con, self._text, self._params, form, batch_size)

    def to_arrow_table(self) -> Any:
        return self._submit("arrow").arrow_table()

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._submit("rows").fetchall()  # type: ignore[no-any-return]

    def to_arrow_reader(self, rows_per_batch: int) -> Iterator[Any]:
        return self._submit("stream", int(rows_per_batch)).arrow_reader()  # type: ignore[no-any-return]

    def limit(self, n: int, offset: int = 0) -> duckdb.DuckDBPyRelation:
        return self.relation().limit(n, offset)


class BoundQueries:
    """What DuckDB's binder said of the last `size` queries a connection bound (module note)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, size: int = 256) -> None:
        self._con = con
        self.size = size
        self._done: OrderedDict[Hashable, tuple[list[str], list[Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, text: str, params: Params) -> Hashable | None:
        """The query's key, or None where a parameter has no SQL type (DuckDB's relation
        then says why) or a value that cannot be a key."""
        if not ENABLED:
            return None
        if params is None:
            signature: tuple[Any, ...] = ()
        else:
            items = params.items() if isinstance(params, dict) else enumerate(params)
            parts: list[tuple[Any, ...]] = []
            for name, value in items:
                if isinstance(value, list | tuple) and _longer(value, LIST_VALUES):
                    return None  # typing it would cost about what the bind saves
                try:
                    sql_type = _seam.literal_type(value)
                except duckdb.Error:
                    return None
                if isinstance(value, list | tuple):
                    parts.append((name, sql_type))
                    continue
                try:
                    hash(value)
                except TypeError:  # a dict (a STRUCT): its values may steer the binder
                    return None
                parts.append((name, sql_type, type(value), value))
            signature = (type(params), tuple(parts))
        return (text, _seam.catalog_version(self._con), signature)

    def run(self, text: str, params: Params) -> BoundQuery | duckdb.DuckDBPyRelation | None:
        """The query to fetch from: a BoundQuery where it bound before with this key, else
        DuckDB's relation, bound here (its errors raised here), whose schema is then kept.
        None for a statement that returns no rows."""
        key = self._key(text, params)
        if key is not None:
            with self._lock:
                hit = self._done.get(key)
                if hit is not None:
                    self._done.move_to_end(key)
            if hit is not None:
                return BoundQuery(self._con, text, params, hit[0], hit[1], key[1])  # type: ignore[index]
        rel = _relation(self._con, text, params)
        # A relation that captured Python objects by name (replacement scans, which only a
        # later connection to a locked catalog leaves on: sandbox.lock) reads them through
        # names of its own: never submitted as bare text.
        if rel is not None and key is not None and not getattr(rel, "_captured", ()):
            schema = (list(rel.columns), list(rel.types))
            with self._lock:
                self._done[key] = schema
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
        return rel
