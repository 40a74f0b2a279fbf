"""A query run again with other values (bound.py: its bind in `sql()` skipped) answers as a
connection that never saw it does, and as plain DuckDB over the catalog counts its rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest

import actdb
from actdb.query import bound
from actdb.query.bound import BoundQuery

pytestmark = pytest.mark.skipif(not bound.ENABLED, reason="this DuckDB has no engine seam")

QUERY = ("SELECT prompt_id, position, layer, norm, vec, position_from_end FROM acts "
         "WHERE prompt_id IN (SELECT unnest($ids)) ORDER BY prompt_id, position, site")


def test_a_query_run_again_answers_as_a_fresh_connection(
        family_store: Callable[[str], Path]) -> None:
    store = family_store("gpt2")
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    n_prompts = con.execute("SELECT count(*) FROM prompts").fetchall()[0][0]
    expected_rows = con.execute(
        "SELECT count(*) FROM tokens WHERE prompt_id = ANY($1)", [[1, n_prompts - 1]]
    ).fetchall()[0][0] * con.execute("SELECT count(*) FROM sites").fetchall()[0][0]
    con.close()
    with actdb.connect(store, device="cpu") as db, actdb.connect(store, device="cpu") as fresh:
        db.sql(QUERY, params={"ids": [0]}).fetchall()
        again = db.sql(QUERY, params={"ids": [1, n_prompts - 1]})
        assert isinstance(again._rel, BoundQuery)  # the bind was skipped
        ref = fresh.sql(QUERY, params={"ids": [1, n_prompts - 1]})
        assert not isinstance(ref._rel, BoundQuery)
        assert again.columns == ref.columns and again.types == ref.types
        assert again.handle_columns() == ["vec"]
        got, want = again.torch(), ref.torch()
        assert len(got["vec"]) == expected_rows > 0
        for name in want:
            assert np.array_equal(got[name].numpy(), want[name].numpy()), name
        text = db.sql(QUERY.replace("vec, ", ""), params={"ids": [2]}).text()
        assert text == fresh.sql(QUERY.replace("vec, ", ""), params={"ids": [2]}).text()
        assert (db.sql(QUERY, params={"ids": [1, 2]}).limit(3, 1).df()["norm"].tolist()
                == fresh.sql(QUERY, params={"ids": [1, 2]}).df()["norm"].tolist()[1:4])
        batches = list(db.sql(QUERY, params={"ids": [1, 2]}).record_batches(5))
        assert sum(b.num_rows for b in batches) == len(db.sql(QUERY, params={"ids": [1, 2]}))
