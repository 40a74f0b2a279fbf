"""published.compact: the catalog a finished ingest publishes to object storage, copied into
a fresh file, holds exactly the tables, columns and rows of the working copy, in fewer
bytes than a file checkpointed at every commit."""

from __future__ import annotations

from pathlib import Path

import duckdb

from actdb.store.catalog_schema import SCHEMA
from actdb.store.published import compact


def _rows(path: Path) -> dict[str, object]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() "
                                            "ORDER BY ALL").fetchall()]
        out: dict[str, object] = {t: con.execute(f'SELECT * FROM "{t}" ORDER BY ALL').fetchall()
                                  for t in tables}
        out["columns"] = con.execute(
            "SELECT table_name, column_name, data_type, column_default FROM "
            "information_schema.columns ORDER BY ALL").fetchall()
        return out
    finally:
        con.close()


def test_compacted_catalog_is_the_same_catalog_smaller(tmp_path: Path) -> None:
    src = tmp_path / "catalog.duckdb"
    con = duckdb.connect(str(src))
    con.execute(SCHEMA)
    con.execute("ALTER TABLE prompts ADD COLUMN topic VARCHAR DEFAULT 'none'")
    for batch in range(4):  # a checkpoint per commit, as a working copy on S3 has
        con.execute("INSERT INTO tokens SELECT 'm', $b, i, i, 'w' || i, $b * 1000 + i, NULL, "
                    "NULL, NULL, NULL, NULL FROM range(1000) t(i)", {"b": batch})
        con.execute("INSERT INTO prompts (prompt_id, text, n_tokens) VALUES ($b, 'p', 1000)",
                    {"b": batch})
        con.execute("UPDATE models SET n_rows = $b", {"b": batch})
        con.execute("CHECKPOINT")
    con.execute("INSERT INTO models (model, model_id, config) VALUES ('m', 0, '{\"a\": 1}')")
    con.close()
    dest = tmp_path / "catalog.duckdb.compacted"
    assert compact(src, dest)
    assert _rows(dest) == _rows(src)
    assert dest.stat().st_size < src.stat().st_size


def test_a_working_folder_with_a_quote_in_its_path_compacts(tmp_path: Path) -> None:
    """The working copy lives under the temporary folder (TMPDIR), whose path may hold a
    quote: the copy reads it all the same."""
    folder = tmp_path / "it's here"
    folder.mkdir()
    src = folder / "catalog.duckdb"
    con = duckdb.connect(str(src))
    con.execute(SCHEMA)
    con.execute("INSERT INTO models (model, model_id, config) VALUES ('m', 0, '{}')")
    con.close()
    dest = folder / "catalog.duckdb.compacted"
    assert compact(src, dest)
    assert _rows(dest) == _rows(src)
