"""Queries on a Dask cluster: partition the rows of `acts` by chunk ranges, run the query per
partition on the workers, combine the partial results here.

Each worker opens the store read-only itself (an actdb Database of its own, kept between
tasks) and runs its partition's query through `Database.sql`, so the sandbox checks every
statement a worker runs. The per-partition and combining queries come from split.py; a query
it cannot split runs here, in one process, with a note saying why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from ..cluster import DaskClient
from ..errors import QueryError
from . import sandbox
from .execute import ErrorBox
from .result import Result, translate
from .split import PARTS, Split, Unsplittable, split
from .timeout import exceeded

if TYPE_CHECKING:
    from .connection import Connection

# A worker's task: one partition's query (sql, path=, device=, params=, need=,
# storage_options=, handle_key=, seconds=) -> its rows (database.run_partial).
Worker = Callable[..., pa.Table]

# Partitions per worker thread: a few, so that one slow partition does not hold up the rest.
PARTITIONS_PER_THREAD = 2


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Token rows [lo, hi) of one model: whole direction chunks, but for the last one."""

    model: str
    lo: int
    hi: int
    # an encoder-decoder's: a prompt's position is in both towers, its rows in either
    towers: bool = False

    def table(self) -> exp.Select:
        """This partition's rows of acts, as a subquery: the rows of its model's tokens in
        [lo, hi) (a handle's row is `tokens.row`, so none is made to choose them)."""
        model = exp.Literal.string(self.model).sql(dialect="duckdb")
        rows = f'"row" >= {int(self.lo)} AND "row" < {int(self.hi)}'
        if self.towers:  # a row is its tower's sites' only
            select = sqlglot.parse_one(
                f"SELECT * FROM acts WHERE model = {model} AND (prompt_id, position, site) IN "
                "(SELECT t.prompt_id, t.position, s.site FROM tokens t JOIN sites s ON "
                f"s.model = t.model AND s.tower = t.tower WHERE t.model = {model} AND "
                f"t.{rows})", read="duckdb")
        else:
            select = sqlglot.parse_one(
                f"SELECT * FROM acts WHERE model = {model} AND (prompt_id, position) IN "
                f"(SELECT prompt_id, position FROM tokens WHERE model = {model} AND {rows})",
                read="duckdb")
        assert isinstance(select, exp.Select)
        return select


def partitions(models: list[tuple[str, int, int]], target: int, *,
               towers: frozenset[str] = frozenset()) -> list[Partition]:
    """Cut every model's rows into about `target` ranges in all, each whole chunks.

    Args:
        models: (name, committed rows, rows per direction chunk), in model_id order.
        target: how many partitions to aim for.
        towers: the models whose rows each belong to one tower (encoder-decoders).
    """
    total = sum(n for _, n, _ in models)
    out: list[Partition] = []
    for name, n_rows, chunk in models:
        size = max(chunk, math.ceil(max(total, 1) / max(target, 1) / chunk) * chunk)
        out += [Partition(model=name, lo=lo, hi=min(lo + size, n_rows),
                          towers=name in towers) for lo in range(0, n_rows, size)]
    return out


class Cluster:
    """A Dask client and how to reach the store from its workers.

    Args:
        spec: `local:N` (a LocalCluster of N single-thread worker processes on 127.0.0.1,
            started here and closed with the database), a scheduler address
            (`tcp://host:8786`), or a `distributed.Client` / cluster object.
        path: the store, as the workers will open it (the same file system or URL).
        device: the device the workers compute on.
        storage_options: object-storage settings the workers open the store with.
        worker: what a worker runs for one partition (database.run_partial).
    """

    def __init__(self, spec: Any, *, path: str, device: str, worker: Worker,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.worker = worker
        self.path = path
        self.device = device
        self.storage_options = dict(storage_options) if storage_options else None
        self._dask = DaskClient(spec, QueryError)
        self.client = self._dask.client

    def threads(self) -> int:
        return max(1, sum(self.client.nthreads().values()))

    def workers(self) -> str:
        """The cluster's size in words: its worker processes and their threads."""
        n = len(self.client.nthreads())
        return f"{n} worker{'s' if n != 1 else ''} ({self.threads()} threads)"

    def close(self) -> None:
        self._dask.close()

    def map(self, sqls: list[str], params: Any, need: dict[str, int], key: bytes,
            seconds: float | None = None) -> list[pa.Table]:
        """Each partial query's rows, in order, from the workers, which make and open handles
        under `key` (the coordinator's: the handles they return open here); within `seconds`
        (None: no limit), each worker's query under that limit too."""
        futures = self.client.map(self.worker, sqls, path=self.path, device=self.device,
                                  storage_options=self.storage_options, params=params,
                                  need=need, handle_key=key, seconds=seconds, pure=False)
        if seconds is not None:
            from distributed import wait

            try:
                wait(futures, timeout=seconds)
            except TimeoutError:
                self.client.cancel(futures)  # queued ones; running ones stop at their limit
                raise exceeded(seconds) from None
        return list(self.client.gather(futures))


# -- the coordinator -----------------------------------------------------------------------


def run(db: Connection, cluster: Cluster, query: str, runnable: str, params: Any,
        local: Callable[[str], Result], seconds: float | None = None) -> Result:
    """A checked query on the cluster, or here in one process with a note saying why.

    Args:
        db: the coordinator's database (partitions, binding, the single-process fallback).
        cluster: where partitions run.
        query: the user's query, as given.
        runnable: what plan.check returned for it (an EXPLAIN rebuilt around its SELECT).
        params: the query's parameters.
        local: runs the query in this process (Database's own path).
        seconds: the query's time limit (None: none); a split query is computed here, within
            it, and a query run in one process gets it from `local`.
    """
    select, text = sandbox.check_statement(runnable, db.parser)
    explain = text != select
    parts: list[Partition] = []
    try:
        try:
            tree = sqlglot.parse_one(select, read="duckdb")
        except (ParseError, sqlglot.errors.TokenError, RecursionError):
            raise Unsplittable("sqlglot cannot read the query, so it is not split") from None
        plan = split(tree, _aggregates(db))
        parts = partitions([(m.model, m.n_rows, m.chunk_tokens)
                            for _, m in sorted(db.source.models.items())],
                           cluster.threads() * PARTITIONS_PER_THREAD,
                           towers=frozenset(m.model for m in db.source.models.values()
                                            if m.row_towers))
        if not parts:
            raise Unsplittable("the store holds no rows to partition")
    except Unsplittable as why:
        note = f"runs in one process, not split: {why}"
        result = _explain_local(db, text, note, params) if explain else local(runnable)
        result.note = note
        return result
    box = ErrorBox()
    try:  # binding only: the names and types of the single-process result
        bound = db.con.sql(select, params=params) if params is not None else db.con.sql(select)
        columns, types = list(bound.columns), [str(t) for t in bound.types]
    except duckdb.Error as e:
        raise translate(e, box) from None
    if explain:
        return _explain_split(plan, parts, cluster, query, types)
    need = {m.model: m.n_rows for m in db.source.models.values()}
    tables = cluster.map([plan.partial(p.table()) for p in parts], params, need,
                         db.source.codec.key, seconds)
    table = _combine(plan, tables, columns, types)
    result = _result(table, query)
    result.note = (f"split into {len(parts)} partitions of acts rows on "
                   f"{cluster.workers()} ({plan.kind})")
    return result


def _aggregates(db: Connection) -> set[str]:
    rows = db.con.execute("SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
                          "WHERE function_type = 'aggregate'").fetchall()
    return {r[0] for r in rows}


def _combine(plan: Split, tables: list[pa.Table], columns: list[str], types: list[str]
             ) -> pa.Table:
    parts = pa.concat_tables(tables)
    own = parts.num_columns - len(plan.hidden)
    parts = parts.rename_columns([f"_c{i}" for i in range(own)] + list(plan.hidden))
    sql = plan.combine(len(columns), types)
    if sql is None:  # plain rows in partition order: the first LIMIT + OFFSET of them
        stop = parts.num_rows if plan.limit is None else plan.offset + plan.limit
        out = parts.slice(plan.offset, max(0, stop - plan.offset)).select(
            [f"_c{i}" for i in range(own)])
    else:
        con = duckdb.connect(":memory:", config={"threads": 1})
        try:
            con.register(PARTS, parts)
            sandbox.lock(con)
            out = con.sql(sql).to_arrow_table()
        finally:
            con.close()
    return out.rename_columns(columns)


def _result(table: pa.Table, query: str) -> Result:
    """A Result over rows already computed, held by an in-memory DuckDB of its own."""
    con = duckdb.connect(":memory:", config={"threads": 1})
    result = Result(con.from_arrow(table), ErrorBox(), query)
    result._table = table
    setattr(result, "_keep", con)  # noqa: B010 - the relation's connection lives with it
    return result


def _explain_split(plan: Split, parts: list[Partition], cluster: Cluster, query: str,
                   types: list[str]) -> Result:
    first = parts[0]
    steps = [
        ("split", f"{plan.kind}: {len(parts)} partitions of acts rows (whole chunks) on "
                  f"{cluster.workers()}"),
        ("partitions", "; ".join(f"{p.model} rows {p.lo}..{p.hi - 1}" for p in parts)),
        ("per partition", plan.partial(first.table())),
        ("combine", plan.combine(len(types), types)
         or "the partitions' rows one after another"
         + (f", rows {plan.offset}..{plan.offset + plan.limit - 1}" if plan.limit else "")),
    ]
    return _result(pa.table({"explain_key": [k for k, _ in steps],
                             "explain_value": [v for _, v in steps]}), query)


def _explain_local(db: Connection, text: str, note: str, params: Any) -> Result:
    rows = [("split", note)]
    try:
        plan = db.con.sql(text, params=params) if params is not None else db.con.sql(text)
        rows += [(str(k), str(v)) for k, v in plan.fetchall()]
    except duckdb.Error as e:
        raise translate(e, ErrorBox()) from None
    return _result(pa.table({"explain_key": [k for k, _ in rows],
                             "explain_value": [v for _, v in rows]}), text)


__all__ = ["Cluster", "Partition", "partitions", "run"]
