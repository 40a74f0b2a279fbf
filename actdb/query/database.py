"""`actdb.connect(path)`: a store opened for SQL with the tensor functions."""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

import duckdb
import numpy as np
import torch

from ..devices import resolve_device
from ..errors import ActdbError, QueryError
from ..store.info import StoreInfo, describe
from ..store.store import Store
from ..store.verify import verify as verify_store
from . import plan
from .execute import ErrorBox, prepare
from .functions import describe as describe_functions
from .result import Result, translate
from .vectors import VectorSource

_OPEN: weakref.WeakSet[Database] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # DuckDB connections that still hold Python UDFs at interpreter exit make the bindings
    # print leak reports; closing them first keeps the exit quiet.
    for db in list(_OPEN):
        db.close()


class Database:
    """A store opened for queries. Queries never change it, whatever `read_only` says:
    `read_only=False` only takes the catalog's write lock (DuckDB allows one writer)."""

    def __init__(
        self, path: str | os.PathLike[str], *, read_only: bool = True, device: str = "auto",
        cache_bytes: int = 256 << 20, threads: int = 1,
    ) -> None:
        self.device = resolve_device(device)
        self.store = Store(path, read_only=read_only)
        self.con = self.store.catalog.con
        # One DuckDB thread by default: the UDFs hold the GIL anyway, and idle DuckDB workers
        # compete with torch for the cores (see BENCHMARKS.md).
        self.con.execute(f"SET threads = {int(threads)}")
        # DuckDB draws a progress bar on stdout for long queries: not into our results.
        self.con.execute("SET enable_progress_bar = false")
        self.source = VectorSource(self.store, self.device, cache_bytes=cache_bytes)
        self._box = ErrorBox()
        prepare(self.con, self.source, self._box)
        _OPEN.add(self)
        self._known = {
            r[0].lower() for r in self.con.execute(
                "SELECT DISTINCT function_name FROM duckdb_functions()"
            ).fetchall()
        }

    # -- queries ---------------------------------------------------------------------------

    def sql(self, query: str, *, params: dict[str, Any] | list[Any] | None = None) -> Result:
        """Run a read-only query; `$name` / `?` parameters bind from `params`."""
        plan.check(query, self.con, self._known)
        self._box.error = None
        try:
            rel = self.con.sql(query, params=params) if params is not None else self.con.sql(query)
        except duckdb.Error as e:
            raise translate(e, self._box) from None
        if rel is None:
            raise QueryError("the statement returns no rows")
        return Result(rel, self._box, query)

    def vectors(self, query: str, *, params: dict[str, Any] | list[Any] | None = None
                ) -> torch.Tensor:
        """The `vec` column of a query as a tensor [N, d] (views applied), on the device."""
        table = self.sql(query, params=params).to_arrow_table()
        column = "vec" if "vec" in table.column_names else table.column_names[0]
        if table.num_columns != 1 and "vec" not in table.column_names:
            raise QueryError("vectors() needs a query with a 'vec' column or a single column")
        col = table.column(column)
        if col.null_count:
            raise QueryError(f"column {column!r} holds NULL handles")
        handles = col.to_numpy().astype(np.int64)
        out: torch.Tensor | None = None
        for g in self.source.groups(handles):
            if out is None:
                out = torch.empty((len(handles), g.x.shape[-1]), device=self.device)
            if g.x.shape[-1] != out.shape[-1]:
                raise QueryError(
                    f"vectors() rows have different widths ({out.shape[-1]} and "
                    f"{g.x.shape[-1]}); select one site width at a time"
                )
            out[torch.from_numpy(g.index).to(self.device)] = g.x
        return out if out is not None else torch.empty((0, 0))

    # -- the store -------------------------------------------------------------------------

    def info(self) -> StoreInfo:
        return describe(self.store)

    def verify(self, *, full: bool = False) -> list[str]:
        """Check that the catalog and the tensors agree.

        Args:
            full: also read every chunk of committed rows and every weight and check their
                checksums (format 2 stores; format 1 stores have none to check).

        Returns:
            The problems found, one sentence each; empty when the store is consistent.
        """
        return verify_store(self.store, full=full)

    @staticmethod
    def functions() -> list[dict[str, Any]]:
        return describe_functions()

    def drop_caches(self) -> None:
        """Forget the chunks read so far, so the next query reads from the store again
        (for timing cold reads; the operating system's page cache is not touched)."""
        self.source.cache.clear()

    @property
    def stats(self) -> dict[str, int]:
        """Chunks and bytes read from the tensors since the database was opened."""
        return {"chunks_read": self.source.cache.chunks_read,
                "bytes_read": self.source.cache.bytes_read}

    def close(self) -> None:
        self.source.cache.close()
        self.store.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    path: str | os.PathLike[str], *, read_only: bool = True, device: str = "auto",
    cache_bytes: int = 256 << 20,
) -> Database:
    """Open a store for queries (read-only unless `read_only=False`)."""
    return Database(path, read_only=read_only, device=device, cache_bytes=cache_bytes)


__all__ = ["ActdbError", "Database", "connect"]
