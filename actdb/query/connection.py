"""What the modules a Database uses need of it, as a Protocol: export, dataset and the cluster
coordinator take the open connection without importing database.py, which imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import duckdb
    import torch

    from ..store.store import Store
    from .result import Result
    from .vectors import VectorSource


class Connection(Protocol):
    """An open store (database.Database)."""

    con: duckdb.DuckDBPyConnection  # the catalog's connection, where queries run
    store: Store
    source: VectorSource

    @property
    def parser(self) -> duckdb.DuckDBPyConnection:
        """The cursor statements are parsed on (plan.check)."""

    @property
    def device(self) -> torch.device: ...

    def sql(self, query: str, *, params: dict[str, Any] | list[Any] | None = None) -> Result:
        ...

    def reopened(self, *, device: str) -> Connection:
        """A new connection to the same store (its own handles, caches and DuckDB)."""

    def close(self) -> None: ...
