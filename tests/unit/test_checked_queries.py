"""plan.CheckedQueries: a connection's checks kept by query text give what `plan.check`
gives, keep no refusal, and hold at most `size` queries."""

from __future__ import annotations

import duckdb
import pytest

from actdb.errors import QueryError
from actdb.query import plan, sandbox


@pytest.fixture()
def con() -> duckdb.DuckDBPyConnection:
    c = duckdb.connect()
    sandbox.lock(c)
    return c


def known() -> set[str]:
    return {"avg", "cosine_to_anchor", "unnest", "count"}


QUERIES = ["SELECT 1", "SELECT avg(cosine_to_anchor(vec, 'w1')) FROM acts WHERE prompt_id IN "
           "(SELECT unnest($ids))", "EXPLAIN SELECT count(*) FROM tokens"]


def test_kept_answers_are_checks_answers(con: duckdb.DuckDBPyConnection) -> None:
    kept = plan.CheckedQueries(size=2)
    for _ in range(2):  # the second time from what was kept
        for q in QUERIES:
            assert kept.check(q, con, known) == plan.check(q, con, known)
    assert len(kept._done) == 2 and list(kept._done) == QUERIES[1:]
    got = kept.check(QUERIES[1], con, known)
    got[1].add("changed")  # an answer handed out is the caller's own
    assert kept.check(QUERIES[1], con, known) == plan.check(QUERIES[1], con, known)


def test_refusals_are_checked_every_time(con: duckdb.DuckDBPyConnection) -> None:
    kept = plan.CheckedQueries()
    for _ in range(2):
        with pytest.raises(QueryError, match="unknown function 'cosine_to_ancor'"):
            kept.check("SELECT cosine_to_ancor(vec, 1) FROM acts", con, known)
        with pytest.raises(QueryError):
            kept.check("DROP TABLE tokens", con, known)
    assert not kept._done
