"""A query's result: DuckDB's own method names, with our errors instead of DuckDB's wraps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from ..errors import QueryError
from .execute import ErrorBox

T = TypeVar("T")


class Result:
    """Lazy until fetched; each fetch method runs the query once."""

    def __init__(self, relation: duckdb.DuckDBPyRelation, box: ErrorBox, query: str) -> None:
        self._rel = relation
        self._box = box
        self.query = query

    @property
    def columns(self) -> list[str]:
        return list(self._rel.columns)

    def _run(self, fetch: Callable[[], T]) -> T:
        self._box.error = None
        try:
            return fetch()
        except duckdb.Error as e:
            raise translate(e, self._box) from None

    def df(self) -> Any:
        """A pandas DataFrame."""
        return self._run(self._rel.df)

    def to_arrow_table(self) -> pa.Table:
        return self._run(self._rel.to_arrow_table)

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._run(self._rel.fetchall)

    def torch(self) -> dict[str, Any]:
        """Numeric columns as a dict of torch tensors (DuckDB's `.torch()`)."""
        return self._run(self._rel.torch)

    def record_batches(self, rows_per_batch: int = 65536) -> Iterator[pa.RecordBatch]:
        """Stream the result in Arrow record batches, so memory stays bounded."""
        self._box.error = None
        try:
            reader = self._rel.to_arrow_reader(rows_per_batch)
            yield from reader
        except duckdb.Error as e:
            raise translate(e, self._box) from None

    def __repr__(self) -> str:
        return f"<actdb.Result columns={self.columns}>"


def translate(e: duckdb.Error, box: ErrorBox) -> Exception:
    """The ActdbError a UDF raised, or DuckDB's message as one sentence."""
    if box.error is not None:
        err, box.error = box.error, None
        return err
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
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
    return QueryError(first)
