"""The views `neurons` and `circuits`: the stored layer weights as rows whose vector columns are
vec handles (weight_rows.py), made the first time a query names them.

    neurons(model, layer, expert, neuron, w_in, w_gate, w_out)
    circuits(model, layer, head, circuit, rank, sigma, u, v, rotary)

Each view is a cross product of a small table of streams (one row per layer and expert, or
per layer and circuit) with the row numbers, so declaring it reads no weight: the handles are
made from row numbers, and a vector is read only when a tensor function receives its handle;
`sigma` is read per layer when the column is asked for. A store that holds no layer weights
gets views that refuse, in one sentence, to be read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
from duckdb.func import FunctionNullHandling, PythonUDFType

from ..errors import ActdbError, QueryError
from ..lazy import lazy_module
from . import handles as H
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    pc = lazy_module("pyarrow.compute")

VIEWS = ("neurons", "circuits")

SqlType = Callable[[duckdb.DuckDBPyConnection, str], Any]


def _issue_udf(src: VectorSource, box: Any) -> Callable[[pa.Array], pa.Array]:
    """The views' handles of fields words: each names a row of a weight stream (checked)."""
    def udf(fields: pa.Array) -> pa.Array:
        try:
            valid = ~fields.is_null().to_numpy(zero_copy_only=False)
            f = pc.fill_null(fields, 0).to_numpy(zero_copy_only=False).astype(np.int64)
            stream = (f >> H.STREAM_SHIFT) & H.STREAM_MASK
            rows = f & H.ROW_MASK
            for s in np.unique(stream[valid]):
                st = src.codec.stream(int(s))
                if (st.kind == "acts" or (f[valid & (stream == s)] >> H.STREAM_SHIFT
                                          != (H.TAG >> H.STREAM_SHIFT) | int(s)).any()
                        or rows[valid & (stream == s)].max() >= st.n_rows):
                    raise QueryError("a weight view's row names no stored weight row")
            return src.codec.seal(f, valid if not valid.all() else None)
        except ActdbError as e:
            box.error = e
            raise

    return udf


def _sigma_udf(src: VectorSource, box: Any) -> Callable[[pa.Array], pa.Array]:
    """`circuits.sigma` of the fields word of each row's `u`."""
    def udf(fields: pa.Array) -> pa.Array:
        try:
            f = fields.to_numpy(zero_copy_only=False).astype(np.int64)
            out = np.empty(len(f))
            stream = (f >> H.STREAM_SHIFT) & H.STREAM_MASK
            specs = src.weight_plan().specs
            for s in np.unique(stream):
                at = np.nonzero(stream == s)[0]
                out[at] = src.weight_rows.sigma(specs[int(s)], f[at] & H.ROW_MASK)
            return pa.array(out, type=pa.float64())
        except ActdbError as e:
            box.error = e
            raise

    return udf


def _refuse_udf(message: str, box: Any) -> Callable[[pa.Array], pa.Array]:
    def udf(x: pa.Array) -> pa.Array:
        box.error = QueryError(message)
        raise box.error

    return udf


def make_weight_views(con: duckdb.DuckDBPyConnection, src: VectorSource, box: Any,
                      session: str, sqltype: SqlType) -> None:
    """Create the temp views `neurons` and `circuits` on `con` (and their tables and UDFs)."""
    plan = src.weight_plan()
    arrow, special = PythonUDFType.ARROW, FunctionNullHandling.SPECIAL
    if not plan.neurons and not plan.circuits:
        names = ", ".join(repr(m) for m in plan.without) or "none"
        message = (f"the store holds no layer weights, so neither neurons nor circuits has "
                   f"rows: its models ({names}) were stored without them (ingested with "
                   "--weights none, or by an actdb before 0.3); ingest again into a new store "
                   "to read weights")
        con.create_function(f"_actdb_no_weights_{session}", _refuse_udf(message, box),
                            [sqltype(con, "BIGINT")], sqltype(con, "BOOLEAN"),
                            type=arrow, null_handling=special, side_effects=True)
        refuse = f"_actdb_no_weights_{session}(range)"
        con.execute(f"""CREATE OR REPLACE TEMP VIEW neurons AS SELECT NULL::VARCHAR AS model,
            NULL::INTEGER AS layer, NULL::INTEGER AS expert, NULL::BIGINT AS neuron,
            NULL::{H.SQL_TYPE} AS w_in, NULL::{H.SQL_TYPE} AS w_gate,
            NULL::{H.SQL_TYPE} AS w_out FROM range(1) WHERE {refuse}""")
        con.execute(f"""CREATE OR REPLACE TEMP VIEW circuits AS SELECT NULL::VARCHAR AS model,
            NULL::INTEGER AS layer, NULL::INTEGER AS head, NULL::VARCHAR AS circuit,
            NULL::BIGINT AS rank, NULL::DOUBLE AS sigma, NULL::{H.SQL_TYPE} AS u,
            NULL::{H.SQL_TYPE} AS v, NULL::BOOLEAN AS rotary FROM range(1) WHERE {refuse}""")
        return
    con.create_function(f"_actdb_weight_handle_{session}", _issue_udf(src, box),
                        [sqltype(con, "BIGINT")], sqltype(con, H.SQL_TYPE),
                        type=arrow, null_handling=special, side_effects=False)
    con.create_function(f"_actdb_sigma_{session}", _sigma_udf(src, box),
                        [sqltype(con, "BIGINT")], sqltype(con, "DOUBLE"),
                        type=arrow, null_handling=special, side_effects=False)
    con.execute("CREATE OR REPLACE TEMP TABLE _actdb_neuron_streams (model VARCHAR, layer "
                "INTEGER, expert INTEGER, n BIGINT, s_in BIGINT, s_gate BIGINT, s_out BIGINT)")
    con.execute("CREATE OR REPLACE TEMP TABLE _actdb_circuit_streams (model VARCHAR, layer "
                "INTEGER, circuit VARCHAR, heads BIGINT, d_head BIGINT, s_u BIGINT, "
                "s_v BIGINT, rotary BOOLEAN)")
    for table, rows in (("_actdb_neuron_streams", plan.neurons),
                        ("_actdb_circuit_streams", plan.circuits)):
        if rows:  # bound as lists: registering an Arrow table would import pandas
            cols = list(zip(*rows, strict=True))
            con.execute(f"INSERT INTO {table} SELECT "
                        + ", ".join(f"unnest(${i + 1})" for i in range(len(cols))),
                        [list(c) for c in cols])
    handle = f"_actdb_weight_handle_{session}"

    def word(row: str, stream: str) -> str:  # a fields word (handles.py); NULL without stream
        return f"({row} | ({stream} << {H.STREAM_SHIFT}) | {H.TAG})"

    con.execute(f"""
        CREATE OR REPLACE TEMP VIEW neurons AS
        SELECT model, layer, expert, neuron, {handle}({word('neuron', 's_in')}) AS w_in,
               {handle}({word('neuron', 's_gate')}) AS w_gate,
               {handle}({word('neuron', 's_out')}) AS w_out
        FROM (SELECT *, unnest(range(n)) AS neuron FROM _actdb_neuron_streams)
    """)
    con.execute(f"""
        CREATE OR REPLACE TEMP VIEW circuits AS
        SELECT model, layer, (i // d_head)::INTEGER AS head, circuit, i % d_head + 1 AS rank,
               _actdb_sigma_{session}({word('i', 's_u')}) AS sigma,
               {handle}({word('i', 's_u')}) AS u, {handle}({word('i', 's_v')}) AS v, rotary
        FROM (SELECT *, unnest(range(heads * d_head)) AS i FROM _actdb_circuit_streams)
    """)
