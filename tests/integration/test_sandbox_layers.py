"""Which layer of the sandbox refuses each escape, each layer alone (actdb/query/sandbox.py).

test_security.py runs every escape end to end and accepts any refusal, so a layer that stopped
refusing went unseen while another caught the attack. Here each layer's own function meets the
attack, and must refuse it in its own words:
- "1": the statement check, `sandbox.check_statement` (one SELECT, or EXPLAIN of one);
- "2d" / "2g": the walks of DuckDB's and of sqlglot's tree of the checked SELECT;
- "3": the locked connection itself: the checked text run on the store's connection with
  layers 1 and 2 skipped, refused by DuckDB (no files, no extension loads, settings locked).
An escape with no layer here is refused outside the sandbox (the handle checks, the planner's
known-function check); test_security.py still runs it end to end.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
import sqlglot
from support.escapes import ESCAPES, SECRET

import actdb
from actdb.query import sandbox

EXPLAIN_ONE = r"^EXPLAIN \(and EXPLAIN ANALYZE, which executes\) is allowed only for one plain " \
              r"SELECT; this one explains an? \w+ statement$"
READ_ONLY = r"^queries are read-only: an? \w+ statement would change the store or the session"
ONE_AT_A_TIME = r"^give one statement at a time; the query holds 2$"
PARSER = r"syntax error at or near"
DEPTH = r"expression depth limit"
FILES = r"^\w+\(\) is refused: queries cannot read files"
PATH = r"looks like a file path: queries cannot read files"
TABLE_FUNCTION = r"^table function \w+\(\) is refused in queries; allowed table functions are"
SESSION = r"^\w+\(\) changes the session, so it is refused in queries$"
INTERNAL = r"^_actdb_\w+\(\) is internal to actdb"
# DuckDB's own refusals under the lock
NO_FILES = r"Cannot access (file|directory) .* disabled by configuration|disabled by configuration"
NO_EXTENSION = r"is not in the catalog, but it exists in the \w+ extension"
LOCKED = r"the configuration has been locked"

FILE_READ = (("2d", FILES), ("2g", FILES), ("3", NO_FILES))
PATH_READ = (("2d", PATH), ("2g", PATH), ("3", NO_FILES))

PINNED: dict[str, tuple[tuple[str, str], ...]] = {
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{target}'": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{catalog}'": (("1", EXPLAIN_ONE),),
    "explain   analyse /* hi */ COPY (SELECT 1) TO '{target}'": (("1", EXPLAIN_ONE),),
    "EXPLAIN (FORMAT json) COPY (SELECT 1) TO '{target}'": (("1", EXPLAIN_ONE),),
    "EXPLAIN COPY (SELECT 1) TO '{target}'": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE CREATE OR REPLACE TEMP VIEW acts AS SELECT 1 AS x": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE CREATE OR REPLACE TEMP MACRO vec_norm(v) AS 42": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE DELETE FROM prompts": (("1", EXPLAIN_ONE),),
    "EXPLAIN (ANALYZE ') SELECT 1 --') DELETE FROM tokens": (
        ("1", r"^EXPLAIN options may be plain words only"),),
    "EXPLAIN ANALYZE INSERT INTO prompts (prompt_id, text) VALUES (99, 'fake')": (
        ("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE UPDATE models SET n_rows = 0": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE ATTACH '{target}' AS x": (("1", PARSER),),
    "EXPLAIN ANALYZE SET enable_external_access = true": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE PRAGMA enable_profiling": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE CALL checkpoint()": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE INSTALL httpfs": (("1", EXPLAIN_ONE),),
    "EXPLAIN ANALYZE EXPORT DATABASE '{target}'": (("1", PARSER),),
    "EXPLAIN ANALYZE SELECT * FROM read_text('{secret}')": FILE_READ,
    "EXPLAIN SELECT * FROM read_blob('{secret}')": FILE_READ,
    "COPY (SELECT 1) TO '{target}'": (("1", READ_ONLY), ("3", NO_FILES)),
    "COPY prompts TO '{target}'": (("1", READ_ONLY), ("3", NO_FILES)),
    "COPY prompts FROM '{secret}'": (("1", READ_ONLY),),
    "DELETE FROM prompts": (("1", READ_ONLY),),
    "INSERT INTO prompts (prompt_id, text) VALUES (99, 'fake')": (("1", READ_ONLY),),
    "UPDATE models SET n_rows = 0": (("1", READ_ONLY),),
    "CREATE OR REPLACE TEMP VIEW acts AS SELECT 1 AS x": (("1", READ_ONLY),),
    "CREATE OR REPLACE TEMP MACRO vec_norm(v) AS 42": (("1", READ_ONLY),),
    "CREATE TABLE t AS SELECT * FROM read_text('{secret}')": (("1", READ_ONLY),),
    "DROP VIEW acts": (("1", READ_ONLY),),
    "ALTER TABLE prompts ADD COLUMN x INTEGER": (("1", READ_ONLY),),
    "ATTACH '{target}' AS x": (("1", READ_ONLY), ("3", NO_FILES)),
    "DETACH catalog": (("1", READ_ONLY),),
    "USE memory": (("1", READ_ONLY),),
    "INSTALL httpfs": (("1", READ_ONLY),),
    "FORCE INSTALL httpfs": (("1", READ_ONLY),),
    "LOAD httpfs": (("1", READ_ONLY),),
    "SET enable_external_access = true": (("1", READ_ONLY), ("3", LOCKED)),
    "RESET lock_configuration": (("1", READ_ONLY), ("3", LOCKED)),
    "SET lock_configuration = false": (("1", READ_ONLY), ("3", LOCKED)),
    "SET VARIABLE x = 1": (("1", READ_ONLY),),
    "PRAGMA enable_profiling": (("1", READ_ONLY),),
    "PRAGMA table_info('prompts')": (("1", READ_ONLY),),
    "CALL checkpoint()": (("1", READ_ONLY),),
    "CALL enable_logging()": (("1", READ_ONLY), ("3", LOCKED)),
    "CHECKPOINT": (("1", READ_ONLY),),
    "VACUUM": (("1", READ_ONLY),),
    "ANALYZE": (("1", READ_ONLY),),
    "BEGIN TRANSACTION": (("1", READ_ONLY),),
    "EXPORT DATABASE '{target}'": (("1", READ_ONLY), ("3", NO_FILES)),
    "IMPORT DATABASE '{dir}'": (("1", READ_ONLY),),
    "PIVOT tokens ON position USING count(*)": (("1", r"^the query expands to several "),),
    "SELECT 1; COPY (SELECT 1) TO '{target}'": (("1", ONE_AT_A_TIME),),
    "SELECT 1 /* ; */ ; DROP VIEW acts": (("1", ONE_AT_A_TIME),),
    "SELECT 1 -- ;\n; DELETE FROM prompts": (("1", ONE_AT_A_TIME),),
    "SELECT ';'; DELETE FROM prompts": (("1", ONE_AT_A_TIME),),
    "SELECT * FROM read_text('{secret}')": FILE_READ,
    "SELECT * FROM read_blob('{secret}')": FILE_READ,
    "SELECT * FROM read_csv('{secret}')": FILE_READ,
    "SELECT * FROM read_csv_auto('{secret}', header = false)": FILE_READ,
    "SELECT * FROM read_json_objects('{secret}')": FILE_READ,
    "SELECT * FROM read_parquet('{secret}')": FILE_READ,
    "SELECT * FROM parquet_scan('{secret}')": FILE_READ,
    "SELECT * FROM parquet_metadata('{secret}')": FILE_READ,
    "SELECT * FROM sniff_csv('{secret}')": FILE_READ,
    "SELECT * FROM glob('{dir}/*')": FILE_READ,
    "SELECT * FROM read_duckdb('{catalog}')": FILE_READ,
    "SELECT * FROM read_text('{catalog}')": FILE_READ,
    "SELECT * FROM '{secret}'": PATH_READ,
    'SELECT * FROM "{secret}"': PATH_READ,
    "FROM '{secret}'": PATH_READ,
    "SELECT (SELECT content FROM read_text('{secret}'))": FILE_READ,
    "WITH x AS (SELECT * FROM read_text('{secret}')) SELECT * FROM x": FILE_READ,
    "SELECT * FROM acts WHERE prompt_id IN (SELECT 1 FROM read_csv('{secret}'))": FILE_READ,
    "SELECT * FROM acts, LATERAL (SELECT * FROM read_text('{secret}'))": FILE_READ,
    "SUMMARIZE SELECT * FROM read_text('{secret}')": FILE_READ,
    "DESCRIBE SELECT * FROM read_text('{secret}')": FILE_READ,
    "PIVOT (SELECT * FROM read_csv('{secret}')) ON column0 IN ('x') USING count(*)": FILE_READ,
    "SELECT * FROM query('SELECT * FROM read_text(''{secret}'')')": (
        ("2d", TABLE_FUNCTION), ("3", NO_FILES)),
    "SELECT * FROM query_table('prompts')": (("2d", TABLE_FUNCTION),),
    "SELECT * FROM histogram_values('{secret}', column0)": (("2d", PATH), ("3", NO_FILES)),
    'SELECT * FROM histogram_values("{secret}", column0)': (("2d", PATH), ("3", NO_FILES)),
    "SELECT * FROM histogram('{secret}', column0)": (("2d", PATH), ("3", NO_FILES)),
    "SELECT * FROM histogram_values(('{secret}'), column0)": (("2d", PATH), ("3", NO_FILES)),
    "SELECT * FROM histogram_values(concat('{secret}', ''), column0)": (
        ("2d", r"^histogram_values\(\) takes the name of a table or view"), ("3", NO_FILES)),
    "SELECT * FROM json_execute_serialized_sql('{{}}')": (("2d", TABLE_FUNCTION),),
    "SELECT * FROM arrow_scan(1, 2, 3)": (("2d", TABLE_FUNCTION),),
    "SELECT * FROM checkpoint()": (("2d", TABLE_FUNCTION),),
    "SELECT * FROM enable_logging()": (("2d", TABLE_FUNCTION), ("3", LOCKED)),
    "SELECT * FROM 'https://example.com/x.parquet'": PATH_READ,
    "SELECT * FROM read_parquet('s3://bucket/x.parquet')": FILE_READ,
    "SELECT * FROM sqlite_scan('{secret}', 't')": (("2d", TABLE_FUNCTION), ("3", NO_EXTENSION)),
    "SELECT * FROM iceberg_scan('{secret}')": (("2d", TABLE_FUNCTION), ("3", NO_EXTENSION)),
    "SELECT st_point(1, 2)": (("3", NO_EXTENSION),),
    "SELECT setseed(0.5)": (("2d", SESSION), ("2g", SESSION)),
    "SELECT write_log('x')": (("2d", SESSION), ("2g", SESSION)),
    "SELECT getenv('HOME')": (),  # the DuckDB shell's function: not here at all
    "SELECT _actdb_vec_norm_s0(vec) FROM acts": (("2d", INTERNAL), ("2g", INTERNAL)),
    "SELECT _actdb_stored_norm_s0(vec) FROM acts": (("2d", INTERNAL), ("2g", INTERNAL)),
    "SELECT current_setting('enable_external_access'), * FROM read_text('{secret}')": FILE_READ,
    "SELECT " + "(" * 1000 + "1" + ")" * 1000: (("1", DEPTH),),
    "SELECT " + "abs(" * 1000 + "1" + ")" * 1000: (("1", DEPTH),),
    "SELECT 1 FROM " + "(SELECT 1 " * 500 + ")" * 500: (("1", PARSER),),
    # sqlglot's reading runs out of Python's stack (plan.check falls back on DuckDB's tree)
    "SELECT " + "read_text(" * 100 + "'{secret}'" + ")" * 100: (("2d", FILES),),
    "SELECT " + "(" * 300 + "(SELECT content FROM read_text('{secret}'))" + ")" * 300: (
        ("2d", FILES), ("3", NO_FILES)),
}
# Values that are not handles of this store, and arithmetic on handles: the handle checks'
# (tests/unit/test_handles.py), not the sandbox's.
HANDLES = [t for t in ESCAPES if t not in PINNED]
CASES = [(t, layer, words) for t, layers in PINNED.items() for layer, words in layers]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory,
          family_store: Callable[[str], Path]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("layers")
    store = root / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    (root / "outside").mkdir()
    (root / "outside" / "secret.csv").write_text(f"{SECRET}\n{SECRET},1\n")
    parser = duckdb.connect(":memory:")  # layers 1 and 2 only parse: no store behind them
    sandbox.lock(parser)
    db = actdb.connect(store, device="cpu")
    db.sql("SELECT count(*), sum(vec_norm(vec)) FROM acts").fetchall()  # the view and a UDF
    yield {"root": root, "store": store, "parser": parser, "db": db,
           "digest": _digest(store)}
    db.close()
    parser.close()


def _digest(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


def _fill(template: str, s: dict[str, Any]) -> str:
    return template.format(secret=s["root"] / "outside" / "secret.csv",
                           target=s["root"] / "target.out",
                           catalog=s["store"] / "catalog.duckdb", dir=s["root"] / "outside")


def test_every_escape_is_pinned_or_a_handle_check() -> None:
    assert set(PINNED) <= set(ESCAPES)
    calls = ("vec_norm(", "cosine(", "to_list(", "cosine_to_anchor(", "logit(")
    assert HANDLES and all(any(c in t for c in calls) for t in HANDLES), HANDLES


@pytest.mark.parametrize(("template", "layer", "words"), CASES,
                         ids=[f"{layer}-{i}" for i, (_, layer, _) in enumerate(CASES)])
def test_a_layer_alone_refuses(template: str, layer: str, words: str,
                               setup: dict[str, Any]) -> None:
    query, parser = _fill(template, setup), setup["parser"]
    if layer == "1":
        with pytest.raises((actdb.QueryError, duckdb.ParserException), match=words):
            sandbox.check_statement(query, parser)
        return
    if layer == "3":
        # straight to the store's locked connection, layers 1 and 2 skipped: the text layer 1
        # would run, or a statement it refuses as written
        try:
            text = sandbox.check_statement(query, parser)[1]
        except (actdb.QueryError, duckdb.ParserException):
            text = query
        with pytest.raises(duckdb.Error, match=words) as info:
            setup["db"].con.sql(text).fetchall()
        assert SECRET not in str(info.value)
        assert not (setup["root"] / "target.out").exists()
        assert _digest(setup["store"]) == setup["digest"]
        return
    select = sandbox.check_statement(query, parser)[0]  # what the first layer passes on
    if layer == "2d":
        with pytest.raises(actdb.QueryError, match=words):
            sandbox.check_duckdb_tree(select, parser)
    else:
        tree = sqlglot.parse_one(select, read="duckdb")
        with pytest.raises(actdb.QueryError, match=words):
            sandbox.check_sqlglot_tree(tree)


def test_layer_three_leaves_the_connection_as_it_was(setup: dict[str, Any]) -> None:
    """After every attack on the bare connection, its settings are those of the lockdown."""
    con = setup["db"].con
    for name, want in sandbox.LOCKDOWN:
        if name in ("python_enable_replacements",):
            continue
        assert bool(con.execute("SELECT current_setting(?)", [name]).fetchall()[0][0]) == want
    assert setup["db"].sql("SELECT count(*) FROM acts").fetchall()[0][0] > 0
