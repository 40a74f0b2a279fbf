"""bound.py: a query run again skips the bind in `sql()`, and answers as DuckDB's own relation
of the same text does (the reference: a relation made on the spot, on the same connection)."""

from __future__ import annotations

import duckdb
import pytest

from actdb.query import bound
from actdb.query.bound import BoundQueries, BoundQuery

pytestmark = pytest.mark.skipif(not bound.ENABLED, reason="this DuckDB has no engine seam")

QUERY = "SELECT x, x * 2 AS y, 'p' || x AS s FROM range(10) t(x) WHERE x IN (SELECT unnest($ids))"


@pytest.fixture()
def con() -> duckdb.DuckDBPyConnection:
    return duckdb.connect()


def _same(got: BoundQuery | duckdb.DuckDBPyRelation, con: duckdb.DuckDBPyConnection,
          text: str, params: object) -> None:
    ref = con.sql(text, params=params)
    assert got.columns == ref.columns
    assert [str(t) for t in got.types] == [str(t) for t in ref.types]
    assert got.fetchall() == ref.fetchall()
    assert got.to_arrow_table().equals(ref.to_arrow_table())


def test_a_query_run_again_skips_the_bind_and_answers_the_same(
        con: duckdb.DuckDBPyConnection) -> None:
    queries = BoundQueries(con)
    first = queries.run(QUERY, {"ids": [1, 2]})
    assert isinstance(first, duckdb.DuckDBPyRelation)  # bound here: its errors raised here
    again = queries.run(QUERY, {"ids": [3, 5, 7]})
    assert isinstance(again, BoundQuery)
    _same(again, con, QUERY, {"ids": [3, 5, 7]})
    assert again.fetchall() == [(3, 6, "p3"), (5, 10, "p5"), (7, 14, "p7")]
    batches = list(queries.run(QUERY, {"ids": [4, 9]}).to_arrow_reader(1))  # type: ignore[union-attr]
    assert [b.num_rows for b in batches if b.num_rows] and sum(b.num_rows for b in batches) == 2
    limited = queries.run(QUERY, {"ids": [4, 8, 9]}).limit(1, 1)  # type: ignore[union-attr]
    assert limited.fetchall() == con.sql(QUERY, params={"ids": [4, 8, 9]}).limit(1, 1).fetchall()


def test_other_parameter_types_bind_anew(con: duckdb.DuckDBPyConnection) -> None:
    queries = BoundQueries(con)
    text = "SELECT $v AS v, $w AS w"
    for params in ({"v": 1, "w": [1, 2]}, {"v": True, "w": [1, 2]}, {"v": 1.0, "w": [1, 2]},
                   {"v": 1.0, "w": ["x"]}, {"v": 1.0, "w": [2**40]}, {"v": 1.0, "w": [1.5]},
                   [1, 2]):
        if isinstance(params, list):
            text = "SELECT ? AS v, ? AS w"
        got = queries.run(text, params)
        assert isinstance(got, duckdb.DuckDBPyRelation)  # never bound with these types
        _same(got, con, text, params)
    # a list binds by its type alone; a scalar by its value too (it can steer the binder)
    assert isinstance(queries.run(text, [1, [3]]), duckdb.DuckDBPyRelation)
    assert isinstance(queries.run(text, [1, [3, 4, 5]]), BoundQuery)
    assert isinstance(queries.run(text, [7, [3]]), duckdb.DuckDBPyRelation)


def test_a_changed_catalog_binds_again(con: duckdb.DuckDBPyConnection) -> None:
    queries = BoundQueries(con)
    con.execute("CREATE TABLE t AS SELECT 1 AS a")
    queries.run("SELECT * FROM t", None)
    held = queries.run("SELECT * FROM t", None)
    assert isinstance(held, BoundQuery) and held.columns == ["a"]
    con.execute("CREATE OR REPLACE TABLE t AS SELECT 'x' AS b, 2.5 AS c")
    assert held.columns == ["b", "c"]  # a result made before the change says what runs now
    assert [str(t) for t in held.types] == ["VARCHAR", "DECIMAL(2,1)"]
    fresh = queries.run("SELECT * FROM t", None)
    assert isinstance(fresh, duckdb.DuckDBPyRelation)
    _same(fresh, con, "SELECT * FROM t", None)


def test_refusals_are_not_kept(con: duckdb.DuckDBPyConnection) -> None:
    queries = BoundQueries(con)
    for _ in range(2):
        with pytest.raises(duckdb.BinderException):
            queries.run("SELECT nope FROM range(3)", None)
    con.execute("CREATE TABLE later AS SELECT 4 AS nope")
    assert queries.run("SELECT nope FROM later", None).fetchall() == [(4,)]  # type: ignore[union-attr]


def test_a_long_list_binds_every_time(con: duckdb.DuckDBPyConnection) -> None:
    """Typing a long list costs what its bind saves: such a query is never kept."""
    queries = BoundQueries(con)
    long_ids = list(range(bound.LIST_VALUES + 1))
    nested = [[0.5] * (bound.LIST_VALUES // 2 + 1)] * 2
    for text, params in ((QUERY, {"ids": long_ids}), ("SELECT len($ids) AS n", {"ids": nested})):
        for _ in range(2):
            got = queries.run(text, params)
            assert isinstance(got, duckdb.DuckDBPyRelation)
    _same(queries.run(QUERY, {"ids": long_ids}), con, QUERY, {"ids": long_ids})
    queries.run(QUERY, {"ids": long_ids[: bound.LIST_VALUES]})
    assert isinstance(queries.run(QUERY, {"ids": long_ids[1: bound.LIST_VALUES + 1]}), BoundQuery)

