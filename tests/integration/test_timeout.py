"""A query's time limit: endless queries stop near it with one sentence, tensor functions in
flight included, and the same connection then answers a normal query as before."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli
from actdb.query import lens

LIMIT = 0.5
# The stop comes at the limit, plus DuckDB's step between chunks and a busy machine's delay.
SLACK = 3.0
REFERENCE = "SELECT count(*), round(sum(vec_norm(vec)), 5), round(sum(entropy(vec)), 3) FROM acts"

ENDLESS = [
    "SELECT count(*) FROM range(1000000000000)",
    "SELECT count(*) FROM range(100000) a, range(100000) b, range(100000) c",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
    "SELECT count(*) FROM acts a, acts b, acts c, acts d",
    "SELECT sum(vec_norm(a.vec)) FROM acts a, acts b, acts c",
    "SELECT sum(entropy(a.vec)) FROM acts a, acts b, acts c",
]


@pytest.fixture(scope="module")
def store(family_store: Callable[[str], Path]) -> Path:
    return family_store("gpt2")


@pytest.fixture(scope="module")
def expected(store: Path) -> tuple[tuple[int, float, float], int]:
    """The reference query's answer on a connection without a limit, and the row count of
    acts from the catalog alone (plain DuckDB: tokens times sites)."""
    with actdb.connect(store, device="cpu") as db:
        answer = db.sql(REFERENCE).fetchall()[0]
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT count(*) FROM tokens t JOIN sites s USING (model)"
                           ).fetchall()[0][0]
    finally:
        con.close()
    return answer, rows


def _stopped(run: Callable[[], object]) -> tuple[actdb.QueryTimeoutError, float]:
    start = time.monotonic()
    with pytest.raises(actdb.QueryTimeoutError) as info:
        run()
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("query", ENDLESS)
def test_an_endless_query_stops_near_its_limit(query: str, store: Path,
                                               expected: tuple[tuple[int, float, float], int]
                                               ) -> None:
    answer, rows = expected
    with actdb.connect(store, device="cpu", timeout=LIMIT) as db:
        db.sql(REFERENCE, timeout=120).fetchall()  # torch and the UDFs loaded first
        err, took = _stopped(lambda: db.sql(query).fetchall())
        assert isinstance(err, TimeoutError) and isinstance(err, actdb.ActdbError)
        assert "time limit of 0.5 s" in str(err) and "\n" not in str(err)
        assert LIMIT <= took < LIMIT + SLACK, took
        # the same connection answers right, under its limit, and again after another stop
        assert db.sql(REFERENCE, timeout=120).fetchall()[0] == answer
        assert db.sql("SELECT count(*) FROM acts").fetchall()[0][0] == rows
        _stopped(lambda: db.sql(query).fetchall())
        assert db.sql(REFERENCE, timeout=120).fetchall()[0] == answer


def test_a_tensor_function_in_flight_stops(store: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """One UDF call made slow inside (a vocabulary-wide block a row, each taking 20 ms: about
    12 s for the store's rows in one call), where DuckDB's interrupt cannot reach: the check
    between blocks stops it near the limit."""
    to_logits, lse = lens._to_logits, lens.vocab_scan.lse

    def slow(model: object, scores: object) -> object:
        time.sleep(0.02)
        return to_logits(model, scores)

    def slow_lse(*args: Any, **kwargs: Any) -> Any:  # the bfloat16 kernel's path, where usable
        time.sleep(0.02)
        return lse(*args, **kwargs)

    with actdb.connect(store, device="cpu") as db:
        db.sql(REFERENCE).fetchall()
        monkeypatch.setattr(lens, "_BLOCK", 1)
        monkeypatch.setattr(lens, "_to_logits", slow)
        monkeypatch.setattr(lens.vocab_scan, "lse", slow_lse)
        err, took = _stopped(lambda: db.sql("SELECT entropy(vec) FROM acts",
                                            timeout=LIMIT).fetchall())
        assert "time limit" in str(err)
        assert took < LIMIT + SLACK, took
        monkeypatch.undo()
        assert db.sql("SELECT count(*) FROM acts").fetchall()[0][0] > 0


def test_streamed_batches_stop(store: Path) -> None:
    with actdb.connect(store, device="cpu") as db:
        result = db.sql("SELECT a.range AS x FROM range(1000000000000) a", timeout=LIMIT)
        err, took = _stopped(lambda: [b.num_rows for b in result.record_batches(10000)])
        assert took < LIMIT + SLACK
        assert db.sql("SELECT 42").fetchall() == [(42,)]


def test_no_limit_by_default_and_bad_limits(store: Path) -> None:
    with actdb.connect(store, device="cpu") as db:
        assert db.timeout is None
        # a query longer than a short limit would be finishes without one
        assert db.sql("SELECT count(*) FROM range(30000000)").fetchall() == [(30000000,)]
        for bad in (0, -1, float("nan"), float("inf"), "5", True):
            with pytest.raises(actdb.QueryError, match="timeout is a number of seconds"):
                db.sql("SELECT 1", timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(actdb.QueryError, match="timeout is a number of seconds"):
        actdb.connect(store, timeout=-2)


def test_cli_timeout(store: Path) -> None:
    runner = CliRunner()
    start = time.monotonic()
    res = runner.invoke(cli, ["query", str(store), ENDLESS[0], "--timeout", "0.5",
                              "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: the query ran past its time limit of 0.5 s")
    assert res.output.count("\n") == 1 and "Traceback" not in res.output
    assert time.monotonic() - start < 30
    res = runner.invoke(cli, ["query", str(store), "SELECT 1", "--timeout", "0"])
    assert res.exit_code == 2
    res = runner.invoke(cli, ["query", str(store), "SELECT count(*) FROM acts",
                              "--timeout", "60", "--format", "csv"])
    assert res.exit_code == 0, res.output
    assert "--timeout SECONDS" in runner.invoke(cli, ["query", "--help"]).output
