"""The query sandbox under attack: every escape through Python, the CLI and a real subprocess.

After each attempt: no file outside the store was read (a sentinel file's secret never shows
up) or written (a target path does not appear), the store's bytes are unchanged, and the same
session still answers a reference query exactly as before.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.escapes import ESCAPES, SECRET

import actdb
from actdb.cli import cli

REFERENCE = ("SELECT site, count(*) AS n, round(sum(vec_norm(vec)), 6) AS s FROM acts "
             "GROUP BY site ORDER BY site")



@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory,
          family_store: Callable[[str], Path]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sec")
    store = root / "s.actdb"
    shutil.copytree(family_store("gpt2"), store)
    secret_dir = root / "outside"
    secret_dir.mkdir()
    (secret_dir / "secret.csv").write_text(f"{SECRET}\n{SECRET},1\n")
    db = actdb.connect(store, device="cpu")
    yield {"store": store, "root": root, "secret_dir": secret_dir, "db": db,
           "reference": db.sql(REFERENCE).fetchall()}
    db.close()


def _fill(template: str, s: dict[str, Any], target: Path) -> str:
    return template.format(secret=s["secret_dir"] / "secret.csv", target=target,
                           catalog=s["store"] / "catalog.duckdb", dir=s["secret_dir"])


def _digest(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def digest(setup: dict[str, Any]) -> dict[str, str]:
    return _digest(setup["store"])


def _after(s: dict[str, Any], digest: dict[str, str], target: Path, text: str) -> None:
    assert SECRET not in text
    assert not target.exists()
    assert sorted(p.name for p in s["secret_dir"].iterdir()) == ["secret.csv"]
    assert _digest(s["store"]) == digest
    assert s["db"].sql(REFERENCE).fetchall() == s["reference"]


@pytest.mark.parametrize("template", ESCAPES)
def test_python_escape_is_refused(template: str, setup: dict[str, Any],
                                  digest: dict[str, str]) -> None:
    target = setup["root"] / "target.out"
    query = _fill(template, setup, target)
    with pytest.raises(actdb.ActdbError) as info:
        setup["db"].sql(query).fetchall()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    _after(setup, digest, target, message)


@pytest.mark.parametrize("template", ESCAPES)
def test_cli_escape_is_refused(template: str, setup: dict[str, Any],
                               digest: dict[str, str]) -> None:
    target = setup["root"] / "target-cli.out"
    query = _fill(template, setup, target)
    res = CliRunner().invoke(cli, ["query", str(setup["store"]), query, "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and res.output.startswith("Error: "), res.output
    _after(setup, digest, target, res.output)


@pytest.mark.parametrize("read_only", [True, False])
def test_misread_explain_prefix_runs_only_the_checked_select(
        read_only: bool, setup: dict[str, Any], digest: dict[str, str]) -> None:
    """DuckDB nests /* */ comments: a prefix read differently from DuckDB must not let the
    text after the checked SELECT run (the EXPLAIN is rebuilt around what was checked)."""
    setup["db"].close()
    db = actdb.connect(setup["store"], read_only=read_only, device="cpu")
    try:
        before = db.sql(REFERENCE).fetchall()
        for query in ("EXPLAIN ANALYZE /* /* */ SELECT 1 --*/ DELETE FROM tokens",
                      "EXPLAIN ANALYZE /* /* */ SELECT 1 --*/ "
                      "CREATE OR REPLACE TEMP MACRO vec_norm(v) AS 42"):
            try:
                db.sql(query).fetchall()
            except actdb.ActdbError as e:
                assert "\n" not in str(e)
            assert db.sql(REFERENCE).fetchall() == before
    finally:
        db.close()
        setup["db"] = actdb.connect(setup["store"], device="cpu")
    _after(setup, digest, setup["root"] / "target-misread.out", "")


@pytest.mark.slow
@pytest.mark.parametrize("template", [
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{catalog}'",
    "SELECT * FROM read_text('{secret}')",
    "SELECT * FROM glob('{dir}/*')",
])
def test_subprocess_escape_is_refused(template: str, setup: dict[str, Any],
                                      digest: dict[str, str]) -> None:
    target = setup["root"] / "target-sub.out"
    query = _fill(template, setup, target)
    proc = subprocess.run([sys.executable, "-m", "actdb.cli", "query", str(setup["store"]),
                           query, "--device", "cpu"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("Error: "), proc.stderr
    _after(setup, digest, target, proc.stdout + proc.stderr)


def test_the_working_directorys_tmp_folder_is_not_readable(
        setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB lets a locked-down connection use its temporary directory, by default `.tmp`
    under the working directory for an in-memory database (the catalog's copy, a cluster's
    combining step): a user's file kept there was read by `histogram_values('.tmp/x.csv',
    a)` and by the engine's own readers (review finding). Queries spill into a folder of the
    process's own instead, and a relation's name is never a path."""
    cwd = tmp_path / "work"
    (cwd / ".tmp").mkdir(parents=True)
    (cwd / ".tmp" / "x.csv").write_text(f"a,b\n{SECRET},2\n")
    (cwd / "y.csv").write_text(f"a,b\n{SECRET},2\n")
    monkeypatch.chdir(cwd)
    digest = _digest(setup["store"])
    with actdb.connect(setup["store"], device="cpu") as db:
        spill = db.con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
        assert Path(spill).is_dir() and (Path(spill).stat().st_mode & 0o777) == 0o700
        import duckdb

        for query in ("SELECT * FROM read_csv('.tmp/x.csv')", "SELECT * FROM '.tmp/x.csv'"):
            with pytest.raises(duckdb.Error, match="disabled by configuration"):
                db.con.execute(query).fetchall()  # the engine's own lock, under the checks
        for query in ("SELECT * FROM histogram_values('.tmp/x.csv', a)",
                      "SELECT * FROM histogram_values(y.csv, a)",
                      'SELECT * FROM histogram_values("y.csv", a)',
                      "SELECT * FROM histogram_values($t, a)"):
            with pytest.raises(actdb.QueryError, match="looks like a file path|takes the name "
                               "of a table") as info:  # the checks, before the engine's lock
                db.sql(query, params={"t": ".tmp/x.csv"} if "$t" in query else None
                       ).fetchall()
            assert SECRET not in str(info.value)
        assert db.sql("SELECT count(*) FROM histogram_values(acts, layer)").fetchall()[0][0] > 0
    proc = subprocess.run([sys.executable, "-m", "actdb.cli", "query", str(setup["store"]),
                           "SELECT * FROM histogram_values('.tmp/x.csv', a)"],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1 and SECRET not in proc.stdout + proc.stderr, proc.stderr
    assert _digest(setup["store"]) == digest


def test_a_stores_tokenizer_code_never_runs(setup: dict[str, Any], tmp_path: Path) -> None:
    """A store from elsewhere whose saved tokenizer names Python of its own (`auto_map`):
    a query that needs the tokenizer (a string no vocabulary entry holds) had transformers
    ask on stdin whether to run it (review finding). The code never runs; tokens resolve by
    the vocabulary table alone, as in a store saved without a tokenizer."""
    import json

    store = tmp_path / "s.actdb"
    shutil.copytree(setup["store"], store)
    folder = store / "tokenizers" / "0"
    marker = tmp_path / "ran"
    (folder / "evil_tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTok(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "evil_tok.EvilTok"]},
                  tokenizer_class="EvilTok")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "actdb.cli", "query", str(store),
         "SELECT cosine_to_anchor(vec, 'zzqx qqzz') FROM acts LIMIT 1"],
        input="y\n" * 8, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert not marker.exists()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'zzqx qqzz' is not one token of model" in proc.stderr, proc.stderr


def test_sandbox_settings_are_locked(setup: dict[str, Any]) -> None:
    """The engine itself refuses files, extensions and setting changes, under the checks."""
    con = setup["db"].con
    settings = dict(con.execute(
        "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
        "'autoinstall_known_extensions', 'autoload_known_extensions', 'lock_configuration')"
    ).fetchall())
    assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                        "autoinstall_known_extensions": "false",
                        "autoload_known_extensions": "false"}
    import duckdb

    with pytest.raises(duckdb.Error):
        con.execute(f"SELECT * FROM read_text('{setup['secret_dir'] / 'secret.csv'}')")
    with pytest.raises(duckdb.Error):
        con.execute("SET enable_external_access = true")


def test_explain_analyze_of_a_select_runs(setup: dict[str, Any]) -> None:
    plan = setup["db"].sql("EXPLAIN ANALYZE SELECT count(*) FROM acts").fetchall()
    assert "Total Time" in str(plan)  # it ran
    assert setup["db"].sql("EXPLAIN SELECT vec_norm(vec) FROM acts").fetchall()


def test_read_only_false_cannot_change_the_catalog(setup: dict[str, Any], tmp_path: Path
                                                   ) -> None:
    store = tmp_path / "rw.actdb"
    shutil.copytree(setup["store"], store)
    tables = ("meta", "models", "prompts", "prompt_runs", "tokens", "sites", "vocab")

    def rows() -> dict[str, list[tuple[Any, ...]]]:
        with actdb.connect(store) as ro:
            return {t: sorted(map(repr, ro.con.execute(f"SELECT * FROM {t}").fetchall()))
                    for t in tables}

    before = rows()
    target = tmp_path / "rw-target.out"
    with actdb.connect(store, read_only=False, device="cpu") as db:
        reference = db.sql(REFERENCE).fetchall()
        for template in ESCAPES:
            query = _fill(template, setup, target)
            with pytest.raises(actdb.ActdbError):
                db.sql(query).fetchall()
            assert db.sql(REFERENCE).fetchall() == reference
    assert not target.exists()
    assert rows() == before


def test_another_sessions_udfs_are_refused(setup: dict[str, Any]) -> None:
    with actdb.connect(setup["store"], device="cpu") as other:
        # the view and the functions a query names are made when it first names them
        assert other.sql(REFERENCE).fetchall() == setup["reference"]
        names = [r[0] for r in other.con.execute(
            "SELECT DISTINCT function_name FROM duckdb_functions() "
            "WHERE function_name LIKE '_actdb_%'").fetchall()]
        assert names
        for name in names:
            with pytest.raises(actdb.QueryError, match="internal to actdb"):
                setup["db"].sql(f"SELECT {name}(vec) FROM acts").fetchall()
        assert other.sql(REFERENCE).fetchall() == setup["reference"]


# -- the user's own tables -------------------------------------------------------------------


def _labels(tmp_path: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt_id": [0, 1, 2], "label": ["a", "b", "c"]})
    paths = {"csv": tmp_path / "labels.csv", "parquet": tmp_path / "labels.parquet",
             "jsonl": tmp_path / "labels.jsonl"}
    paths["csv"].write_text("prompt_id,label\n0,a\n1,b\n2,c\n")
    pq.write_table(table, paths["parquet"])
    paths["jsonl"].write_text("".join(
        f'{{"prompt_id": {i}, "label": "{x}"}}\n' for i, x in enumerate("abc")))
    return paths


JOIN = ("SELECT p.prompt_id, l.label FROM prompts p JOIN labels l USING (prompt_id) "
        "ORDER BY p.prompt_id")


@pytest.mark.parametrize("kind", ["csv", "parquet", "jsonl", "frame", "arrow"])
def test_register_joins_a_named_table(kind: str, setup: dict[str, Any], tmp_path: Path) -> None:
    import pandas as pd
    import pyarrow as pa

    paths = _labels(tmp_path)
    frame = pd.DataFrame({"prompt_id": [0, 1, 2], "label": ["a", "b", "c"]})
    sources: dict[str, Any] = {"frame": frame, "arrow": pa.Table.from_pandas(frame), **paths}
    source = sources[kind]
    with actdb.connect(setup["store"], device="cpu") as db:
        db.register("labels", source)
        assert db.sql(JOIN).fetchall() == [(0, "a"), (1, "b"), (2, "c")]
        with pytest.raises(actdb.QueryError, match="read-only"):
            db.sql("INSERT INTO labels VALUES (9, 'z')").fetchall()
        assert db.sql("SELECT count(*) FROM labels").fetchall() == [(3,)]


@pytest.mark.parametrize("name", ["acts", "PROMPTS", "tokens", "sites", "vocab", "models",
                                  "meta", "_actdb_x", "1abc", "a b", "x;DROP", "", "é"])
def test_register_refuses_names(name: str, setup: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(actdb.QueryError, match="table name"):
        setup["db"].register(name, _labels(tmp_path)["csv"])
    assert setup["db"].sql(REFERENCE).fetchall() == setup["reference"]


@pytest.mark.parametrize(("file", "match"), [
    ("missing.csv", "does not exist"), ("labels.txt", "unknown extension"),
    ("bad.parquet", "cannot read"),
])
def test_register_refuses_files(file: str, match: str, setup: dict[str, Any],
                                tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("x")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(actdb.QueryError, match=match):
        setup["db"].register("labels", tmp_path / file)


def test_cli_table_option(setup: dict[str, Any], tmp_path: Path) -> None:
    paths = _labels(tmp_path)
    res = CliRunner().invoke(cli, ["query", str(setup["store"]), JOIN, "--format", "csv",
                                   "--table", f"labels={paths['csv']}", "--table",
                                   f"more={paths['parquet']}"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == ['"prompt_id","label"', '0,"a"', '1,"b"', '2,"c"']
    bad = CliRunner().invoke(cli, ["query", str(setup["store"]), "SELECT 1", "--table", "nope"])
    assert bad.exit_code == 2 and "NAME=FILE" in bad.output


@pytest.mark.parametrize("second", ["labels", "LABELS"])
def test_cli_table_name_given_twice_is_refused(second: str, setup: dict[str, Any],
                                               tmp_path: Path) -> None:
    """Two files under one name: the last one hid the first in silence."""
    paths = _labels(tmp_path)
    res = CliRunner().invoke(cli, ["query", str(setup["store"]), JOIN, "--table",
                                   f"labels={paths['csv']}", "--table",
                                   f"{second}={paths['jsonl']}"])
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert "given twice" in line and "labels.csv" in line and "labels.jsonl" in line, line


def test_register_again_replaces_the_table(setup: dict[str, Any], tmp_path: Path) -> None:
    """In Python a name registered again is replaced (a notebook cell re-run with new data,
    as DuckDB's own register does), whatever case it is written in."""
    import pandas as pd

    with actdb.connect(setup["store"], device="cpu") as db:
        db.register("labels", _labels(tmp_path)["csv"])
        assert db.sql(JOIN).fetchall() == [(0, "a"), (1, "b"), (2, "c")]
        db.register("Labels", pd.DataFrame({"prompt_id": [1], "label": ["new"]}))
        assert db.sql(JOIN).fetchall() == [(1, "new")]


# -- output paths and notebooks --------------------------------------------------------------


def test_output_into_a_missing_folder_or_onto_a_folder(setup: dict[str, Any],
                                                       tmp_path: Path) -> None:
    for out, match in ((tmp_path / "no" / "x.csv", "does not exist"), (tmp_path, "folder")):
        res = CliRunner().invoke(cli, ["query", str(setup["store"]), "SELECT 1", "-o", str(out),
                                       "--format", "csv"])
        assert res.exit_code == 1 and match in res.output and "Traceback" not in res.output
        assert res.output.count("\n") == 1, res.output
    assert not (tmp_path / "no").exists()


FAKE_IPYTHON = '''
class _Kernel:
    config = {"IPKernelApp": {}}

def get_ipython():
    return _Kernel()
'''


def test_connect_in_a_jupyter_kernel_without_ipywidgets(setup: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """DuckDB sees a kernel (IPython with an IPKernelApp config, interactive) and no
    ipywidgets: it then refuses every change to enable_progress_bar. That is the real failure,
    made to happen here without Jupyter installed."""
    pkg = tmp_path / "fake" / "IPython"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_IPYTHON)
    (pkg / "display.py").write_text("def display(*a, **k):\n    pass\n")
    script = (
        "import sys; sys.ps1 = '>>> '\n"
        "import IPython, duckdb\n"
        "try:\n"
        "    duckdb.connect().execute('SET enable_progress_bar = false')\n"
        "    print('duckdb accepted the setting')\n"
        "except duckdb.Error as e:\n"
        "    print('duckdb refused:', 'ipywidgets' in str(e))\n"
        "import actdb\n"
        f"db = actdb.connect({str(setup['store'])!r}, device='cpu')\n"
        "print(db.sql('SELECT count(*) FROM acts').fetchall()[0][0])\n"
        "db.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(pkg.parent)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "duckdb refused: True"  # the condition really is the kernel's
    assert int(lines[1]) == setup["db"].sql("SELECT count(*) FROM acts").fetchall()[0][0]
