"""`actdb.connect(path)`: a store opened for SQL with the tensor functions."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

from ..devices import resolve_device
from ..errors import ActdbError, QueryError
from ..lazy import lazy_module
from ..store.info import StoreInfo, describe
from ..store.store import Store
from ..store.verify import verify as verify_store
from . import plan, sandbox
from .bound import BoundQueries
from .execute import ErrorBox, prepare
from .functions import describe as describe_functions
from .result import Result, column_values, handle_values, interrupted, translate
from .tables import TableLike, check_name, load_table
from .threads import DUCKDB_THREADS, torch_threads
from .timeout import TimeLimit, check_seconds
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

if TYPE_CHECKING:
    from .dataset import VectorDataset
    from .export import Exported

_OPEN: weakref.WeakSet[Database] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # DuckDB connections that still hold Python UDFs at interpreter exit make the bindings
    # print leak reports; closing them first keeps the exit quiet.
    for db in list(_OPEN):
        db.close()


class Database:
    """A store opened for queries. Queries never change it, whatever `read_only` says:
    `read_only=False` only takes the catalog's write lock (DuckDB allows one writer).

    Queries run sandboxed (sandbox.py): one SELECT, no files, no extensions, configuration
    locked once the views, macros and UDFs are in place; `register` adds the user's own tables.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, read_only: bool = True, device: str = "auto",
        cache_bytes: int = 256 << 20, threads: int = DUCKDB_THREADS,
        storage_options: Mapping[str, Any] | None = None, cluster: Any = None,
        timeout: float | None = None, handle_key: bytes | None = None,
    ) -> None:
        """`handle_key`: the key of this connection's vec handles (handles.py); None draws a
        new one. A cluster's workers are opened with the coordinator's."""
        self.timeout = check_seconds(timeout)
        # `auto` and `cpu` are resolved when a tensor is first needed (so a query without
        # tensor functions never imports torch); anything else is checked now.
        spec = device if device in ("auto", "cpu") else resolve_device(device)
        self.store = Store(path, read_only=read_only, storage_options=storage_options)
        self.con = self.store.catalog.con
        # DuckDB's share of the thread policy (threads.py).
        if not sandbox.is_locked(self.con):  # else set by the first Database of this process
            self.con.execute(f"SET threads = {int(threads)}")
            _quiet_progress_bar(self.con)
        self.source = VectorSource(self.store, spec, cache_bytes=cache_bytes, key=handle_key)
        self._gather = HandleVectors(self.source)
        self._box = ErrorBox()
        self._limit = TimeLimit(self.con, self._box.stop)
        self._functions = prepare(self.con, self.source, self._box)
        _OPEN.add(self)
        self._known_names: set[str] | None = None  # read when a query first needs it
        self._taken = {
            r[0].lower() for r in self.con.execute(
                "SELECT table_name FROM duckdb_tables() UNION SELECT view_name FROM duckdb_views()"
            ).fetchall()
        }
        self._tables: dict[str, object] = {}
        sandbox.lock(self.con)
        # Statements are parsed and their trees serialized on a connection of their own (a
        # cursor: DuckDB parses there and never binds or runs the query's text; the store's
        # database is locked down before it exists): cheaper than a database of its own, which
        # every CLI query would open.
        self._parser = self.con.cursor()
        sandbox.lock(self._parser)
        self._checked = plan.CheckedQueries()
        self._bound = BoundQueries(self.con)  # the binder's answers, for queries run again
        self._cluster: Any = None
        if cluster is not None:
            from .distributed import Cluster

            try:
                self._cluster = Cluster(cluster, path=_worker_path(path), device=device,
                                        worker=run_partial, storage_options=storage_options)
            except BaseException:
                self.close()
                raise

    @property
    def parser(self) -> duckdb.DuckDBPyConnection:
        """The cursor statements are parsed on (plan.check): it never binds or runs them."""
        return self._parser

    def reopened(self, *, device: str) -> Database:
        """A new connection to the same store, with its own handles, caches and DuckDB (a
        DataLoader worker's: a connection is not fork-safe)."""
        return Database(self.store.location, device=device,
                        storage_options=self.store.storage_options, timeout=self.timeout)

    def _known(self) -> set[str]:
        """Every function name DuckDB knows here (its own, the macros and the UDFs), read on
        first use: a query calling only what sqlglot knows never needs the list."""
        if self._known_names is None:
            self._known_names = {
                r[0].lower() for r in self.con.execute(
                    "SELECT DISTINCT function_name FROM duckdb_functions()"
                ).fetchall()
            }
        return self._known_names

    @property
    def device(self) -> torch.device:
        """The torch device tensor functions compute on."""
        return self.source.device

    # -- queries ---------------------------------------------------------------------------

    def sql(self, query: str, *, params: dict[str, Any] | list[Any] | None = None,
            timeout: float | None = None) -> Result:
        """Run a read-only query (lazily: its rows are computed when first fetched or shown).

        Args:
            query: one SELECT (or EXPLAIN of one), DuckDB's dialect, with the tensor functions.
            params: values for `$name` (a dict) or `?` / `$1` (a list) in the query.
            timeout: seconds the query may compute (None: the connection's `timeout`); past
                them it stops with a QueryTimeoutError and the connection stays usable.

        Returns:
            A Result: `.df()`, `.fetchall()`, `.to_arrow_table()`, `.torch()`...
        """
        if not isinstance(query, str):
            raise QueryError(f"a query is a string of SQL, not {type(query).__name__}")
        seconds = check_seconds(timeout) if timeout is not None else self.timeout
        params = _bindable(params)
        runnable, calls, tables = self._checked.check(query, self._parser, self._known)
        try:
            # the tensor functions it calls and the view `acts`, on first use
            self._functions.register(calls, tables)
        except duckdb.Error as e:
            raise translate(e, self._box) from None
        if self._cluster is not None:
            from . import distributed

            result = distributed.run(self, self._cluster, query, runnable, params,
                                     lambda text: self._run(text, params, query, seconds),
                                     seconds)
            result.gather = self._gather
            return result
        return self._run(runnable, params, query, seconds)

    def _run(self, runnable: str, params: dict[str, Any] | list[Any] | None, query: str,
             seconds: float | None) -> Result:
        """A checked query, here in this process."""
        self._box.error = None
        try:
            rel = self._bound.run(runnable, params)
        except duckdb.Error as e:
            err = translate(e, self._box)
            if isinstance(params, dict) and "Values were not provided" in str(err):
                given = ", ".join(params) or "none"  # a misspelt name is then plain to see
                err = QueryError(f"{err}; the parameters given: {given}")
            raise err from None
        except RuntimeError as e:
            raise interrupted(e) from None
        if rel is None:
            raise QueryError("the statement returns no rows")
        return Result(rel, self._box, query, self._gather, limit=self._limit, seconds=seconds)

    def vectors(self, query: str, *, params: dict[str, Any] | list[Any] | None = None
                ) -> torch.Tensor:
        """The `vec` column of a query as a tensor [N, d] (views applied), on the device."""
        table = self.sql(query, params=params).to_arrow_table()
        column = "vec" if "vec" in table.column_names else table.column_names[0]
        if table.num_columns != 1 and "vec" not in table.column_names:
            raise QueryError("vectors() needs a query with a 'vec' column or a single column")
        col = table.column(column)
        if pa.types.is_decimal(col.type):  # handles (HUGEINT)
            return self._gather(handle_values(col, column), "vectors() rows")
        # a vector the query computed (`delta(vec)`, `mean_vector(...)`): its lists
        x = column_values(col, column, "vectors()")
        if x.ndim != 2:
            raise QueryError(f"vectors() needs vec handles or lists of numbers; column "
                             f"{column!r} holds {col.type} values")
        return torch.from_numpy(x.astype(np.float32)).to(self.device)

    def register(self, name: str, table: TableLike) -> None:
        """Add a named, read-only table that queries can join, e.g. labels for prompts.

        Args:
            name: a plain identifier that is not a table of the store (`acts`, `prompts`...);
                registering a name again replaces the earlier table.
            table: a pandas DataFrame, an Arrow table, or the path of a .csv, .parquet or
                .jsonl/.json file (read here, in Python: queries themselves cannot read files).
        """
        check_name(name, self._taken)
        data = load_table(table)
        self.con.register(name, data)
        self._tables[name.lower()] = data

    def export(self, query: str, path: str | os.PathLike[str], *,
               params: dict[str, Any] | list[Any] | None = None) -> Exported:
        """Write the vectors a query selects (views applied) with its other columns.

        Args:
            query: a SELECT with one vec column (`vec` or a view of it).
            path: `.parquet`, `.npy` or `.safetensors` (see `actdb export --help`).
            params: values for `$name` / `?` in the query.

        Returns:
            What was written (path, rows, d, columns).
        """
        from .export import export

        return export(self, query, path, params=params)

    def dataset(self, query: str, *, batch_size: int = 4096, shuffle_buffer: int = 0,
                seed: int | None = None, columns: Sequence[str] | None = None,
                params: dict[str, Any] | list[Any] | None = None,
                drop_last: bool = False) -> VectorDataset:
        """A torch IterableDataset of the query's vectors, streamed with bounded memory.

        Args:
            query: a SELECT with one vec column (`vec` or a view of it).
            batch_size: rows per batch; use `DataLoader(ds, batch_size=None)`.
            shuffle_buffer: rows held for shuffling (0: the query's order).
            seed: the shuffle's seed (each pass over the dataset draws anew from it).
            columns: the query's other columns to yield beside `vec` (default: all it
                selects; `()` for the vectors alone). Numbers come as tensors, anything
                else (text, lists) as Python lists, which cost time in a training loop:
                select what the loop uses.
            params: values for `$name` / `?` in the query.
            drop_last: leave out a last batch smaller than `batch_size`.

        Returns:
            The dataset; each item is `{"vec": Tensor[B, d], column: Tensor[B] or list}`.
        """
        from .dataset import VectorDataset

        return VectorDataset(self, query, batch_size=batch_size, shuffle_buffer=shuffle_buffer,
                             seed=seed, columns=columns, params=params, drop_last=drop_last)

    def __repr__(self) -> str:
        try:
            models = [r[0] for r in self.con.execute(
                "SELECT model FROM models ORDER BY model_id").fetchall()]
        except duckdb.Error:
            models = []
        return f"<actdb.Database {self.store.location!r}: models {models}, device {self.device}>"

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
        self.source.clear()

    @property
    def stats(self) -> dict[str, int]:
        """Chunks and bytes read from the tensors since the database was opened, and the rows
        of one-vector functions answered from bulk windows or computed as asked (bulk.py)."""
        return {"chunks_read": self.source.cache.chunks_read,
                "bytes_read": self.source.cache.bytes_read,
                "rows_bulk": sum(b.rows_bulk for b in self._functions.bulk),
                "rows_exact": sum(b.rows_exact for b in self._functions.bulk)}

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        self._parser.close()
        self.source.cache.close()
        self.store.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HandleVectors:
    """A result's way to the vectors of its handle columns (result.Gather): each handle
    opened under the connection's key (handles.py), then read."""

    def __init__(self, source: VectorSource) -> None:
        self._source = source

    def holds(self, col: pa.ChunkedArray) -> bool:
        return self._source.codec.opens(col)

    def __call__(self, col: pa.ChunkedArray, what: str) -> torch.Tensor:
        fields = self._source.codec.open(col)
        with torch_threads(1):
            return self._source.gather(fields, self._source.device, what)


_OPENED: dict[tuple[str, str], Database] = {}


def run_partial(sql: str, *, path: str, device: str, params: Any, need: dict[str, int],
                storage_options: dict[str, Any] | None = None,
                handle_key: bytes | None = None, seconds: float | None = None) -> pa.Table:
    """On a worker: one partition's query, through the sandbox like any other, its handles
    made and opened under the coordinator's `handle_key` (handles.py), within `seconds`
    (None: no limit).

    The worker keeps its database open between tasks while its snapshot holds every row the
    coordinator counted (`need`: committed rows per model) and its key is the coordinator's;
    partitions stop at those counts, and committed rows never change, so a newer snapshot
    gives the same rows."""
    opened = (path, device)
    db = _OPENED.get(opened)
    if db is not None:
        have = {m.model: m.n_rows for m in db.source.models.values()}
        if (any(have.get(m, -1) < n for m, n in need.items())
                or (handle_key is not None and db.source.codec.key != handle_key)):
            db.close()
            db = None
    if db is None:
        _one_thread_per_task()
        db = Database(path, device=device, storage_options=storage_options,
                      handle_key=handle_key)
        _OPENED[opened] = db
    return db.sql(sql, params=params, timeout=seconds).to_arrow_table()


def _one_thread_per_task() -> None:
    """torch gets the worker's own thread count: worker processes share the machine."""
    import torch

    try:
        from distributed import get_worker

        threads = int(get_worker().state.nthreads)
    except (ImportError, ValueError, AttributeError):
        threads = os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))



def _bindable(params: dict[str, Any] | list[Any] | None) -> dict[str, Any] | list[Any] | None:
    """`params` as DuckDB binds them: torch tensors and NumPy arrays as lists (a direction
    from a probe or from `db.vectors`), NumPy scalars as Python numbers (a token id from
    `argmax`), all of which DuckDB refused with a type error; anything but a dict (for
    `$name`) or a list (for `?`, `$1`) is refused, a string above all, which DuckDB bound
    one character to each `?`."""
    def plain(v: Any) -> Any:
        module = type(v).__module__
        if module.startswith("torch") and hasattr(v, "tolist"):
            return v.detach().cpu().tolist()
        if module == "numpy" and hasattr(v, "tolist"):  # arrays and scalars alike
            return v.tolist()
        if isinstance(v, list | tuple):  # list(np.ones(d)), [np.int64(3)]
            return [plain(x) for x in v]
        return v

    if params is None:
        return None
    if isinstance(params, dict):
        return {k: plain(v) for k, v in params.items()}
    if isinstance(params, list | tuple):
        return [plain(v) for v in params]
    raise QueryError(f"params must be a dict ({{'name': value}} for $name) or a list (for ? "
                     f"and $1, $2, ...), not {type(params).__name__} {params!r:.40}")


def _worker_path(path: str | os.PathLike[str]) -> str:
    """The store as workers open it: a URL as given, a local path made absolute."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def _quiet_progress_bar(con: duckdb.DuckDBPyConnection) -> None:
    """Progress bar off, so it is never drawn into our results. Inside a Jupyter kernel without
    ipywidgets DuckDB has already turned it off and refuses any change to the setting (even to
    off): read it first, and carry on if the change is refused, since off is what we want."""
    rows = con.execute("SELECT current_setting('enable_progress_bar')").fetchall()
    if not rows or rows[0][0]:
        try:
            con.execute("SET enable_progress_bar = false")
        except duckdb.Error:
            pass  # refused only where DuckDB itself keeps the bar off


def connect(
    path: str | os.PathLike[str], *, read_only: bool = True, device: str = "auto",
    cache_bytes: int = 256 << 20, storage_options: Mapping[str, Any] | None = None,
    cluster: Any = None, timeout: float | None = None,
) -> Database:
    """Open a store for queries (read-only unless `read_only=False`).

    Args:
        path: a local store directory, or `s3://bucket/prefix/name.actdb` on object storage
            (credentials and endpoint from the AWS environment variables).
        read_only: False takes the catalog's write lock of a local store (DuckDB allows one
            writer); it changes nothing on object storage, where queries never write.
        device: `auto`, `cpu`, `cuda` or `cuda:i`: where tensor functions compute.
        cache_bytes: memory for chunks kept between queries.
        storage_options: object-storage settings that override the environment, e.g.
            `{"endpoint": "http://127.0.0.1:9000", "access_key_id": ..., "region": ...}`.
        cluster: run queries on Dask: `"local:N"` (N worker processes started here), a
            scheduler address (`"tcp://host:8786"`) or a `distributed.Client`. Queries that
            split (see `EXPLAIN`) run per chunk range on the workers, which open the store
            themselves (with the same `storage_options`); the rest run here, and their
            result's `note` says why.
        timeout: seconds each query may compute (None, the default: no limit); past them
            the query stops with a QueryTimeoutError (one sentence) and the connection stays
            usable. `sql(..., timeout=)` sets it for one query.

    Returns:
        A Database; `.sql(query)` runs queries on it.
    """
    return Database(path, read_only=read_only, device=device, cache_bytes=cache_bytes,
                    storage_options=storage_options, cluster=cluster, timeout=timeout)


__all__ = ["ActdbError", "Database", "connect"]
