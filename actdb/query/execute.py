"""Set up a DuckDB connection for queries: views over the catalog, tensor macros and UDFs."""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
from duckdb.func import FunctionNullHandling, PythonUDFType

from ..errors import ActdbError, QueryError
from ..lazy import lazy_module
from . import handles as H
from .aggregates import Directions, DirectionTable
from .attention_view import make_attention_view
from .bulk import BulkEvaluator
from .functions import (
    ANCHORS,
    DIRECTION,
    REGISTRY,
    TOKEN,
    TOKEN_ANCHORS,
    VEC,
    VECS,
    TensorFunction,
    direction_udf,
)
from .kernels import Arg
from .lists import ListResults
from .sandbox import TABLE_FUNCTIONS
from .threads import torch_threads
from .timeout import watching
from .vectors import VectorSource
from .weight_views import VIEWS as WEIGHT_VIEWS
from .weight_views import make_weight_views

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    pc = lazy_module("pyarrow.compute")  # imported when a tensor function first runs

_SCALARS = ("DOUBLE", "BIGINT")  # kernels fill a float64 array, NaN for NULL


_SESSIONS = itertools.count()
# Rows a window of bulk evaluation may reach ahead (bulk.py): scalar results are 8 bytes a
# row; a list result (top_logits, nearest_anchors) is a vocabulary-wide product a row, so its
# windows stay smaller. The cache holds this many rows of results for each function (a list
# result's row holds k Python dicts, so far fewer of them).
BULK_ROWS = 1 << 16
BULK_LIST_ROWS = 1 << 12
BULK_CACHE_ROWS = 1 << 19
BULK_LIST_CACHE_ROWS = 1 << 13


class ErrorBox:
    """What a connection's UDFs share with its queries: the ActdbError a UDF raised, kept so
    the caller gets it back instead of DuckDB's wrap, and the flag a query's time limit sets
    to stop them (timeout.py)."""

    def __init__(self) -> None:
        self.error: ActdbError | None = None
        self.stop = threading.Event()


def _arrow_type(sql: str) -> pa.DataType:
    plain = {"DOUBLE": pa.float64(), "BIGINT": pa.int64(), "FLOAT[]": pa.list_(pa.float32()),
             "DOUBLE[]": pa.list_(pa.float64())}
    if sql in plain:
        return plain[sql]
    fields = sql.removeprefix("STRUCT(").removesuffix(")[]").split(", ")
    kinds = {"BIGINT": pa.int64(), "VARCHAR": pa.string(), "DOUBLE": pa.float64()}
    return pa.list_(pa.struct([(f.split()[0], kinds[f.split()[1]]) for f in fields]))


def _args(columns: list[pa.Array], kinds: list[str], directions: DirectionTable,
          n: int | None = None) -> list[Any]:
    """The kernel's arguments from the UDF's argument columns other than the vectors (a
    packed token column is two or three of them: its text, its SQL type and the anchor set
    packed with it; a direction column holds ids in `directions`); `n`: each column holds
    one row, for n rows."""
    out: list[Any] = []
    for a, kind in zip(columns, kinds, strict=True):
        if kind == DIRECTION:
            ids = a.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            if n is not None:  # read-only: bulk.py keeps a broadcast for later calls
                ids = np.repeat(ids, n)
                ids.setflags(write=False)
            out.append(Directions(ids, directions))
        elif kind in (TOKEN, TOKEN_ANCHORS):  # one column, two or three arguments
            packed = kind == TOKEN_ANCHORS
            out += Arg.tokens(a, packed) if n is None else Arg.repeat_tokens(a, n, packed)
        else:
            out.append(Arg.of(a) if n is None else Arg.repeat(a, n))
    return out


def _with_arity(f: Callable[..., pa.Array], n: int) -> Callable[..., pa.Array]:
    """DuckDB reads a UDF's parameter count from its signature (inspect.signature), so a
    function of *arrays states its n parameters in `__signature__`."""
    f.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"a{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(n)])
    return f


def _drop_nulls(arrays: tuple[pa.Array, ...]) -> tuple[tuple[pa.Array, ...], np.ndarray | None]:
    """The rows with no NULL argument, and their positions (None: every row)."""
    if not any(a.null_count for a in arrays):
        return arrays, None
    null = np.zeros(len(arrays[0]), dtype=bool)
    for a in arrays:
        if a.null_count:
            null |= a.is_null().to_numpy(zero_copy_only=False)
    keep = np.nonzero(~null)[0]
    return tuple(a.take(pa.array(keep)) for a in arrays), keep


def _make_udf(fn: TensorFunction, src: VectorSource, box: ErrorBox,
              bulk: list[BulkEvaluator], directions: DirectionTable) -> Callable[..., pa.Array]:
    kinds = fn.udf_kinds()  # one a UDF column (a token and its anchor set are one)
    scalar = fn.returns in _SCALARS
    out_type = _arrow_type(fn.returns)
    assert fn.kernel is not None
    kernel = fn.kernel
    evaluator: BulkEvaluator | None = None
    if kinds.count(VEC) == 1 and VECS not in kinds:
        # A function of one vector and constant-able arguments: bulk-evaluated (bulk.py).
        others = [k for k in kinds if k != VEC]
        evaluator = BulkEvaluator(
            src, kernel, scalar=scalar, vec_at=kinds.index(VEC),
            convert=lambda columns: _args(columns, others, directions),
            broadcast=lambda columns, n: _args(columns, others, directions, n),
            list_type=None if scalar else out_type,
            max_rows=BULK_ROWS if scalar else BULK_LIST_ROWS,
            cache_rows=BULK_CACHE_ROWS if scalar else BULK_LIST_CACHE_ROWS,
            ahead=not fn.vocabulary_wide,
        )
        bulk.append(evaluator)

    def exact(arrays: tuple[Any, ...]) -> Any:
        vecs: list[np.ndarray | pa.Array] = []
        columns, column_kinds = [], []
        for a, kind in zip(arrays, kinds, strict=True):
            if kind == VEC:
                vecs.append(a)  # opened: fields words
            elif kind == VECS:
                vecs.append(a)  # lists of handles: aggregates.HandleLists reads them
            else:
                columns.append(a)
                column_kinds.append(kind)
        rest = _args(columns, column_kinds, directions)
        n = len(arrays[0])
        out: Any = np.full(n, np.nan) if scalar else ListResults(n)
        kernel(src, *vecs, out, *rest)
        return out

    def udf(*arrays: pa.Array) -> pa.Array:
        n = len(arrays[0])
        arrays, keep = _drop_nulls(arrays)
        try:
            # every handle opened (checked) before anything reads it (handles.py)
            args = tuple(src.codec.open(a) if kind == VEC else a
                         for a, kind in zip(arrays, kinds, strict=True))
            # threads.py: small ops never fan out; timeout.py: a query past its limit stops
            with torch_threads(1), watching(box.stop):
                sub = evaluator.evaluate(args) if evaluator is not None else exact(args)
        except ActdbError as e:
            box.error = e
            raise
        if scalar:
            if keep is not None:
                full = np.full(n, np.nan)
                full[keep] = sub
                sub = full
            null = np.isnan(sub)
            if fn.returns == "BIGINT":
                return pa.array(np.where(null, 0, sub).astype(np.int64), mask=null)
            return pa.array(sub, type=pa.float64(), mask=null)
        if keep is not None:
            lists = ListResults(n)
            lists.put(keep, sub.arrow(out_type))
            sub = lists
        return sub.arrow(out_type)

    return _with_arity(udf, len(kinds))


def _stored_field_udf(src: VectorSource, name: str, box: ErrorBox
                      ) -> Callable[[pa.Array], pa.Array]:
    """The view's `norm` or `mean` column, of its rows' fields words (no handle is made or
    opened for them: VectorSource.check_stored); an ActdbError (a damaged chunk) reaches
    the caller as itself, as from the tensor functions."""
    def udf(h: pa.Array) -> pa.Array:
        null = h.is_null().to_numpy(zero_copy_only=False)
        keep = np.nonzero(~null)[0]
        out = np.full(len(h), np.nan)
        if len(keep):
            try:
                values = pc.drop_null(h).to_numpy(zero_copy_only=False).astype(np.int64)
                src.check_stored(values)
                with torch_threads(1), watching(box.stop):
                    for g in src.groups(values):
                        field = g.norm if name == "norm" else g.mean
                        out[keep[g.index]] = field.double().cpu().numpy()
            except ActdbError as e:
                box.error = e
                raise
        return pa.array(out, type=pa.float64(), mask=null)

    return udf


def _view_udf(src: VectorSource, view: str, box: ErrorBox) -> Callable[[pa.Array], pa.Array]:
    """A view of handles (`normalized(vec)`): each one opened, and sealed again with the view's
    code; a handle that already is a view is an error."""
    code = H.VIEWS.index(view)

    def udf(h: pa.Array) -> pa.Array:
        valid = ~h.is_null().to_numpy(zero_copy_only=False) if h.null_count else None
        fields = np.zeros(len(h), dtype=np.int64)
        try:
            opened = src.codec.open(pc.drop_null(h) if valid is not None else h)
            if ((opened >> H.VIEW_SHIFT) & H.VIEW_MASK).any():
                raise QueryError(f"{view}() takes a raw vec, not a view of one")
            weights = src.codec.weight_rows(opened)
            if weights is not None and weights.any():
                raise QueryError(f"{view}() takes a vec of acts (a norm's input), not a weight "
                                 "row of neurons or circuits (a direction with no norm)")
        except ActdbError as e:
            box.error = e
            raise
        if valid is None:
            fields = opened
        else:
            fields[valid] = opened
        return src.codec.seal(fields | np.int64(code << H.VIEW_SHIFT), valid)

    return udf


def _issue_udf(src: VectorSource, box: ErrorBox) -> Callable[[pa.Array], pa.Array]:
    """The view `acts`' `vec`: the handles of its rows' fields words (VectorSource.issue)."""
    def udf(fields: pa.Array) -> pa.Array:
        try:
            if fields.null_count:
                raise QueryError("a vec handle was asked for a NULL row")
            return src.issue(fields.to_numpy(zero_copy_only=False).astype(np.int64, copy=False))
        except ActdbError as e:
            box.error = e
            raise

    return udf


_TYPES: dict[str, duckdb.sqltypes.DuckDBPyType] = {}


def _sqltype(con: duckdb.DuckDBPyConnection, name: str) -> duckdb.sqltypes.DuckDBPyType:
    """DuckDB's type object for `name`, parsed once a process, by `con`: the module-level
    `duckdb.sqltype` opens DuckDB's default connection first, a cost every query would pay."""
    t = _TYPES.get(name)
    if t is None:
        t = _TYPES[name] = con.sqltype(name)
    return t


# The relations and table functions a query may name without seeing the view `acts`: the
# catalog's own tables, and the table functions that read no relation. A query naming any
# other relation (acts, a CTE, a registered table, information_schema, a SHOW or DESCRIBE) or
# calling any other table function (duckdb_views(), pragma_table_info('acts'),
# histogram_values('acts', layer): they list the catalog or take a relation by name) has the
# view made first.
_PLAIN_TABLES = frozenset({"models", "prompts", "tokens", "sites", "vocab", "meta", "prompt_runs"})
_GENERATORS = frozenset({"range", "generate_series", "unnest", "repeat", "repeat_row",
                         "json_each", "json_tree"})


def _any_set(con: duckdb.DuckDBPyConnection, columns: tuple[tuple[str, str], ...]) -> bool:
    """Whether any row of these (table, column) pairs holds a value that is not NULL."""
    union = " UNION ALL ".join(f"SELECT 1 FROM {t} WHERE {c} IS NOT NULL" for t, c in columns)
    return bool(con.execute(f"SELECT EXISTS ({union})").fetchall()[0][0])


def _sees_acts(calls: set[str], tables: set[str]) -> bool:
    return bool(tables - _PLAIN_TABLES) or bool(calls & TABLE_FUNCTIONS - _GENERATORS)


class Functions:
    """The tensor functions and the view `acts` of one connection, each made the first time a
    query calls or names it: registering all the functions is a noticeable part of a CLI
    query's start, for queries that call one or two, or none; the view's `norm`, `mean` and
    `vec` columns are Arrow UDFs, and registering one imports pyarrow.

    Registering runs statements on the connection, so it is done before the query that needs
    it is bound (Database.sql), never while a query runs; a query that lists DuckDB's
    functions (`duckdb_functions()`) gets them all first, and one that lists the catalog gets
    the view, as they did when all was made at open. A connection with a result still
    streaming refuses any statement, so there the first call of a function fails at `sql()`
    with DuckDB's one sentence, where it used to fail when the query was fetched."""

    def __init__(self, con: duckdb.DuckDBPyConnection, src: VectorSource, box: ErrorBox,
                 session: str) -> None:
        self._con, self._src, self._box, self._session = con, src, box, session
        self._lock = threading.Lock()
        self._udfs: set[str] = set()  # UDFs created (a macro may yet fail after its UDF)
        self._done: set[str] = set()  # UDF and macro both in place
        self._acts = False  # the view `acts` is in place
        self._attention = False  # the view `attention` is in place (attention_view.py)
        self._weight_views = False  # the views `neurons` and `circuits` are in place
        # The bulk evaluators of the functions of one vector registered so far (their
        # counters are the session's stats).
        self.bulk: list[BulkEvaluator] = []
        self.directions = DirectionTable()  # the FLOAT[] directions its queries pass

    def register(self, names: Iterable[str], tables: Iterable[str] = ()) -> None:
        """Register the tensor functions among `names` (lower case) not registered yet, and
        the view `acts` where the query may see it (`tables`: the relations it names)."""
        names, tables = set(names), set(tables)
        wanted = set(REGISTRY) if "duckdb_functions" in names else names
        with self._lock:
            if not self._acts and _sees_acts(names, tables):
                self._make_acts()
            if not self._attention and "attention" in tables:
                make_attention_view(self._con, self._src, self._box, self._session,
                                    lambda t: _sqltype(self._con, t))
                self._attention = True
            if not self._weight_views and (tables & set(WEIGHT_VIEWS)
                                           or names & TABLE_FUNCTIONS - _GENERATORS):
                make_weight_views(self._con, self._src, self._box, self._session, _sqltype)
                self._weight_views = True
            for name in sorted(wanted - self._done):
                fn = REGISTRY.get(name)
                if fn is None:
                    continue
                # what the UDFs read, while the connection is free
                self._src.tokens.read_vocabularies()
                if DIRECTION in (p.kind for p in fn.params) and "_direction" not in self._udfs:
                    self._con.create_function(  # constants are folded: one call a query
                        direction_udf(self._session), self.directions.ids,
                        [_sqltype(self._con, "FLOAT[]")], _sqltype(self._con, "BIGINT"),
                        type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL,
                        side_effects=False,
                    )
                    self._udfs.add("_direction")
                if fn.view is not None and name not in self._udfs:
                    self._con.create_function(
                        fn.udf_name(self._session), _view_udf(self._src, fn.view, self._box),
                        [_sqltype(self._con, H.SQL_TYPE)], _sqltype(self._con, H.SQL_TYPE),
                        type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL,
                        side_effects=False,
                    )
                    self._udfs.add(name)
                if fn.kernel is not None and name not in self._udfs:
                    self._con.create_function(
                        fn.udf_name(self._session),
                        _make_udf(fn, self._src, self._box, self.bulk, self.directions),
                        [_sqltype(self._con, t) for t in fn.udf_params()],
                        _sqltype(self._con, fn.returns), type=PythonUDFType.ARROW,
                        null_handling=FunctionNullHandling.SPECIAL, side_effects=False,
                    )
                    self._udfs.add(name)
                self._con.execute(fn.macro_sql(self._session))  # CREATE OR REPLACE
                self._done.add(name)

    def _make_acts(self) -> None:
        """The temp view `acts` and its helpers: the stored norm and mean UDFs, and the
        store's (model, site, head) streams with the numbers handles carry (handles.py)."""
        con, src, session = self._con, self._src, self._session
        for name in ("norm", "mean"):
            if f"_stored_{name}" not in self._udfs:
                con.create_function(
                    f"_actdb_stored_{name}_{session}", _stored_field_udf(src, name, self._box),
                    [_sqltype(con, "BIGINT")], _sqltype(con, "DOUBLE"),
                    type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL,
                    side_effects=False,
                )
                self._udfs.add(f"_stored_{name}")
        if "_handle" not in self._udfs:
            con.create_function(
                f"_actdb_handle_{session}", _issue_udf(src, self._box),
                [_sqltype(con, "BIGINT")], _sqltype(con, H.SQL_TYPE),
                type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL,
                side_effects=False,
            )
            self._udfs.add("_handle")
        have = {r[0] for r in con.execute("SELECT * FROM tokens LIMIT 0").description or []}
        site_cols = {r[0] for r in con.execute("SELECT * FROM sites LIMIT 0").description
                     or []}
        runs = {r[0] for r in con.execute("SELECT * FROM prompt_runs LIMIT 0").description or []}
        # Where a model's sites see different grids of positions (grids.py), a site's rows
        # are its grid's tokens; elsewhere both are NULL and every site has every token.
        grids = "grid" in have and "grid" in site_cols
        # An encoder-decoder's rows each belong to one tower (its input's to the encoder, the
        # tokens its decoder read to the decoder): a row meets that tower's sites only, and
        # its run (n_tokens) is its tower's. NULL: a row every site sees.
        towers = "tower" in have and "tower" in runs and "tower" in site_cols
        # Where no row holds a grid or a tower (a text model's store, the common case), their
        # conditions hold for every pair the joins make: left out, so DuckDB never plans them
        # in a query of acts. The rows never change under a connection (a reader's snapshot,
        # or a writer's lock), so what holds now holds for every query the view serves.
        grids = grids and _any_set(con, (("tokens", "grid"), ("sites", "grid")))
        towers = towers and _any_set(con, (("tokens", "tower"), ("prompt_runs", "tower"),
                                           ("sites", "tower")))
        # The store's streams, each with its site's columns: one table that the view joins
        # to the tokens (one join fewer for DuckDB to plan in every query of acts). A site's
        # row never changes once its model is stored, and the streams are the connection's
        # own list, so the copy is what joining `sites` would give. Filled from lists bound
        # as parameters: registering an Arrow table makes DuckDB import pandas, a second of
        # CPU.
        names = {m.model_id: m.model for m in src.models.values()}
        streams = src.codec.streams
        site_extra = "".join(f", s.{c}" for c, on in (("grid", grids), ("tower", towers)) if on)
        con.execute("CREATE OR REPLACE TEMP TABLE _actdb_streams AS SELECT s.model, s.site, "
                    f"s.layer, s.role{site_extra}, NULL::INTEGER AS head, NULL::BIGINT AS stream "
                    "FROM sites s LIMIT 0")
        if streams:
            con.execute(
                f"INSERT INTO _actdb_streams SELECT s.model, s.site, s.layer, s.role{site_extra}, "
                "h.head, h.stream FROM sites s JOIN (SELECT unnest($1) AS model, unnest($2) AS "
                "site, unnest($3) AS head, unnest($4) AS stream) h ON h.model = s.model AND "
                "h.site = s.site",
                [[names[s.model_id] for s in streams],
                 [src.site(s.model_id, s.site_id).site for s in streams],
                 [s.head if s.head >= 0 else None for s in streams],
                 list(range(len(streams)))],
            )
        # the fields word of a raw handle (handles.py), which the view's UDFs take
        fields = f'(t."row" | (s.stream << {H.STREAM_SHIFT}) | {H.TAG})'
        # A store from before images has no patch coordinates: NULL, as for a text position.
        patch = ", ".join(f"t.{c}" if c in have else f"NULL::INTEGER AS {c}"
                          for c in ("patch_row", "patch_col", "frame"))
        on_grid = " AND s.grid IS NOT DISTINCT FROM t.grid" if grids else ""
        run_tower = " AND r.tower IS NOT DISTINCT FROM t.tower" if towers else ""
        on_grid += " AND (t.tower IS NULL OR t.tower = s.tower)" if towers else ""
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW acts AS
            SELECT model, prompt_id, position, token_id, token, site, layer, role, head,
                   _actdb_stored_norm_{session}(_fields) AS norm,
                   _actdb_stored_mean_{session}(_fields) AS mean,
                   _actdb_handle_{session}(_fields) AS vec, n_tokens,
                   n_tokens - 1 - position AS position_from_end, patch_row, patch_col, frame
            FROM (
                SELECT t.model, t.prompt_id, t.position, t.token_id, t.token,
                       s.site, s.layer, s.role, s.head, {fields} AS _fields, r.n_tokens, {patch}
                FROM tokens t
                JOIN prompt_runs r ON r.model = t.model AND r.prompt_id = t.prompt_id{run_tower}
                JOIN _actdb_streams s ON s.model = t.model{on_grid}
            )
        """)
        self._acts = True


def prepare(con: duckdb.DuckDBPyConnection, src: VectorSource, box: ErrorBox) -> Functions:
    """The tensor functions and the view `acts` for `con`, made as queries first need them
    (Functions.register)."""
    return Functions(con, src, box, f"s{next(_SESSIONS)}")


__all__ = ["ANCHORS", "ErrorBox", "Functions", "prepare"]
