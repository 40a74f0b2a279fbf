"""Values a result holds that Python, pandas, CSV or Parquet cannot: one sentence naming the
column and what to do, never a traceback, and the connection answers the next query."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli

REFERENCE = "SELECT count(*), round(sum(norm), 4) FROM acts"

# (query, the column no Python date/time, pandas frame, CSV or Parquet holds, where it fails)
BEYOND = [
    ("SELECT 1 AS ok, 'infinity'::DATE AS d", "d",
     {"fetchall", "fetchone", "df", "torch", "table", "json"}),
    ("SELECT DATE '5877642-06-25' AS far, 2 AS ok", "far",
     {"fetchall", "fetchone", "df", "torch", "table", "json"}),
    ("SELECT TIMESTAMP '294247-01-09 04:00:54' AS t", "t",
     {"fetchall", "fetchone", "torch", "table", "json"}),
    ("SELECT '-infinity'::TIMESTAMP AS \"minus inf\"", "minus inf",
     {"fetchall", "fetchone", "torch", "table", "json"}),
    ("SELECT INTERVAL 1 DAY AS i, 3 AS ok", "i", {"torch", "csv", "parquet"}),
    ("SELECT '24:00:00'::TIME AS x", "x", {"df", "torch"}),
    ("SELECT union_value(k := 1)::UNION(k INT, s VARCHAR) AS u", "u", {"df", "torch", "parquet"}),
]


@pytest.fixture(scope="module")
def store(family_store: Callable[[str], Path]) -> Path:
    return family_store("gpt2")


@pytest.fixture(scope="module")
def db(store: Path) -> Iterator[actdb.Database]:
    with actdb.connect(store, device="cpu") as database:
        yield database


def _python(db: actdb.Database, how: str, query: str) -> Any:
    result = db.sql(query)
    return {"fetchall": result.fetchall, "fetchone": result.fetchone, "df": result.df,
            "torch": result.torch}[how]()


@pytest.mark.parametrize(("query", "column", "where"), BEYOND)
def test_python_values_beyond_reach_are_one_sentence(query: str, column: str, where: set[str],
                                                     db: actdb.Database) -> None:
    before = db.sql(REFERENCE).fetchall()
    for how in ("fetchall", "fetchone", "df", "torch"):
        if how not in where:
            continue
        with pytest.raises(actdb.QueryError) as info:
            _python(db, how, query)
        text = str(info.value)
        assert "\n" not in text and f"column {column!r}" in text, text
        # a tensor holds numbers alone (a refusal of its own); the rest can be had as text
        assert how == "torch" or "AS VARCHAR)" in text, text
        assert db.sql(REFERENCE).fetchall() == before
    # a repr and a notebook's preview say it in place of the rows
    assert (f"column {column!r}" in repr(db.sql(query))) == ("table" in where)
    html = db.sql(query)._repr_html_()
    assert html.startswith("<") and ("cannot hold" in html) == ("df" in where)
    # the way the error names: the value as text is what to do, and it works
    quoted = column if column.isidentifier() else f'"{column}"'
    assert db.sql(f"SELECT CAST({quoted} AS VARCHAR) FROM ({query})").fetchall()[0][0]


@pytest.mark.parametrize(("query", "column", "where"), BEYOND)
@pytest.mark.parametrize("fmt", ["table", "csv", "json", "parquet"])
def test_cli_outputs_beyond_reach_are_one_sentence(fmt: str, query: str, column: str,
                                                   where: set[str], store: Path,
                                                   tmp_path: Path) -> None:
    out = ["-o", str(tmp_path / "out.parquet")] if fmt == "parquet" else []
    res = CliRunner().invoke(cli, ["query", str(store), query, "--format", fmt, *out])
    if fmt not in where:  # this format holds these values
        assert res.exit_code == 0, res.output
        return
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: ") and res.output.count("\n") == 1, res.output
    assert f"column {column!r}" in res.output


def test_a_refused_export_leaves_the_connection_usable(db: actdb.Database, tmp_path: Path
                                                       ) -> None:
    """An export stopped after its first batch (a column Parquet cannot hold) closed nothing,
    and the connection refused every later query while the stream stayed open."""
    before = db.sql(REFERENCE).fetchall()
    with pytest.raises(actdb.QueryError, match="Parquet cannot hold column 'i'"):
        db.export("SELECT vec, INTERVAL 1 DAY AS i FROM acts LIMIT 3", tmp_path / "x.parquet")
    assert db.sql(REFERENCE).fetchall() == before
    with pytest.raises(actdb.QueryError, match="safetensors holds only numbers"):
        db.export("SELECT vec, 'x' AS s FROM acts", tmp_path / "x.safetensors")
    assert db.sql(REFERENCE).fetchall() == before
    got = db.export("SELECT vec, 3 AS n FROM acts LIMIT 3", tmp_path / "y.parquet")
    assert got.rows == 3


def test_test_all_types_is_refused(db: actdb.Database, store: Path) -> None:
    """DuckDB's fixture of every type's extremes, which no researcher needs, was allowed and
    failed as a pyarrow OverflowError traceback."""
    with pytest.raises(actdb.QueryError, match=r"test_all_types\(\) is refused"):
        db.sql("SELECT * FROM test_all_types()")
    res = CliRunner().invoke(cli, ["query", str(store), "SELECT * FROM test_all_types()"])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and "Traceback" not in (
        res.output)


DEEP = [
    # 1,000 CTEs, each built on the last: DuckDB's binder stops at its max_expression_depth
    "WITH " + ", ".join(f"c{i} AS (SELECT {'1 AS x' if i == 0 else f'x FROM c{i - 1}'})"
                        for i in range(1000)) + " SELECT * FROM c999",
    # nested in the text: the parsers stop first
    "SELECT " + "".join(f"(WITH c{i} AS (SELECT " for i in range(1000)) + "1"
    + "".join(f") SELECT * FROM c{i})" for i in reversed(range(1000))),
    "SELECT " + "(" * 1000 + "1" + ")" * 1000,
]


@pytest.mark.parametrize("query", DEEP, ids=["chained", "nested", "parentheses"])
def test_too_deep_says_what_to_do_without_set(query: str, db: actdb.Database) -> None:
    with pytest.raises(actdb.QueryError) as info:
        db.sql(query).fetchall()
    text = str(info.value)
    assert "\n" not in text and "SET" not in text and "max_expression_depth" not in text, text
    assert "nests deeper than" in text and "db.register" in text, text
    assert db.sql(REFERENCE).fetchall()[0][0] > 0
