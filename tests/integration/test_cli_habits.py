"""CLI habits: --version, python -m actdb, SQL from a file or stdin, vec handles refused in file
output, export, visible tokens in tables, plain progress lines, -q, and Ctrl-C during an ingest
(a real SIGINT to a real subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import actdb
from actdb.cli import cli

ACTDB = [sys.executable, "-m", "actdb"]


def run(*args: object, input: str | None = None) -> Any:
    """`actdb ARGS` in-process (stdout and stderr apart, returncode as a subprocess's)."""
    r = CliRunner().invoke(cli, [str(a) for a in args], input=input)
    r.returncode = r.exit_code  # type: ignore[attr-defined]
    return r


def run_process(*args: object, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m actdb ARGS` in a real subprocess."""
    return subprocess.run([*ACTDB, *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def store(family_store: Callable[[str], Path]) -> Path:
    return family_store("llama")


def test_version_and_python_dash_m() -> None:
    out = run_process("--version")
    assert out.returncode == 0 and actdb.__version__ in out.stdout


# `actdb ARGS` through the console script's entry point, with the process's exit watched: the
# exit handlers must run and the output be whole before the process ends without tearing the
# interpreter down (cli_exit.exit_now).
_WATCHED = """
import atexit, os, sys
atexit.register(lambda: sys.stderr.write("exit handlers ran\\n"))
real_exit = os._exit
def watched(status):
    sys.stderr.write(f"fast exit {status}\\n")
    sys.stderr.flush()
    real_exit(status)
os._exit = watched
sys.argv = ["actdb", *sys.argv[1:]]
from actdb.cli import main
main()
"""


def test_the_command_ends_fast_with_its_output_whole_and_its_status(store: Path) -> None:
    def watched(*args: object) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered
        return subprocess.run([sys.executable, "-c", _WATCHED, *map(str, args)],
                              capture_output=True, text=True, timeout=300, env=env)

    # 20,000 rows written one line at a time: the last of them are still in stdout's buffer
    # when the command returns
    big = watched("query", store, "SELECT range AS i FROM range(20000)", "--format", "json")
    assert big.returncode == 0, big.stderr
    assert [json.loads(x)["i"] for x in big.stdout.splitlines()] == list(range(20000))
    assert big.stderr.endswith("exit handlers ran\nfast exit 0\n"), big.stderr
    table = watched("query", store, "SELECT range AS i FROM range(3)")
    assert table.stdout.split() == ["i", "0", "1", "2"], table.stdout
    vectors = watched("query", store, "SELECT count(vec_norm(vec)) AS n FROM acts")
    assert vectors.returncode == 0 and int(vectors.stdout.split()[1]) > 0, vectors.stderr
    assert vectors.stderr.endswith("fast exit 0\n"), vectors.stderr
    bad = watched("query", store, "SELECT nosuch_function(1)")
    assert bad.returncode == 1 and "unknown function 'nosuch_function'" in bad.stderr
    assert bad.stderr.endswith("exit handlers ran\nfast exit 1\n"), bad.stderr
    usage = watched("query")
    assert usage.returncode == 2 and "Missing argument" in usage.stderr
    assert usage.stderr.endswith("fast exit 2\n"), usage.stderr


def test_sql_from_file_and_stdin(store: Path, tmp_path: Path) -> None:
    sql = "SELECT position, token FROM tokens WHERE prompt_id = 0 ORDER BY position"
    (tmp_path / "q.sql").write_text(sql)
    runner = CliRunner()
    direct = runner.invoke(cli, ["query", str(store), sql, "--format", "csv"])
    from_file = runner.invoke(cli, ["query", str(store), "-f", str(tmp_path / "q.sql"),
                                    "--format", "csv"])
    from_stdin = runner.invoke(cli, ["query", str(store), "-", "--format", "csv"], input=sql)
    from_dash_f = runner.invoke(cli, ["query", str(store), "-f", "-", "--format", "csv"],
                                input=sql)
    assert direct.exit_code == 0 and direct.output.count("\n") > 2
    assert from_file.output == from_stdin.output == from_dash_f.output == direct.output
    both = runner.invoke(cli, ["query", str(store), sql, "-f", str(tmp_path / "q.sql")])
    assert both.exit_code == 2 and "not both" in both.output
    neither = runner.invoke(cli, ["query", str(store)])
    assert neither.exit_code == 2 and "no SQL" in neither.output


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_vec_handles_are_refused_in_file_output(store: Path, tmp_path: Path, fmt: str) -> None:
    out = run("query", store, "SELECT layer, normalized(vec) AS z FROM acts LIMIT 3",
              "--format", fmt, "-o", tmp_path / f"o.{fmt}")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "column 'z' holds vec handles" in out.stderr and "to_list(z)" in out.stderr
    assert "actdb export" in out.stderr
    star = run("query", store, "SELECT * FROM acts LIMIT 3", "--format", fmt,
               "-o", tmp_path / f"s.{fmt}")
    assert star.returncode == 1 and "column 'vec' holds vec handles" in star.stderr
    numbers = run("query", store, "SELECT layer, to_list(vec) AS v FROM acts LIMIT 3",
                  "--format", "json")
    rows = [json.loads(line) for line in numbers.stdout.splitlines()]
    assert numbers.returncode == 0 and len(rows) == 3 and len(rows[0]["v"]) == 64


def test_export_command_writes_what_db_vectors_reads(store: Path, tmp_path: Path) -> None:
    sql = "SELECT prompt_id, position, vec FROM acts WHERE site = 'blocks.1.ln2' ORDER BY 1, 2"
    out = run("export", store, sql, "-o", tmp_path / "v.parquet")
    assert out.returncode == 0, out.stderr
    with actdb.connect(store, device="cpu") as db:
        ref = db.vectors(sql).numpy()
    assert f"wrote {len(ref)} vectors of d=64 with 2 other columns" in out.stdout
    table = pq.read_table(tmp_path / "v.parquet")
    np.testing.assert_array_equal(np.stack(table.column("vec").to_numpy(zero_copy_only=False)),
                                  ref)
    out = run("export", store, sql, "-o", tmp_path / "v.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), ref)
    # .npy holds the matrix alone: said, not claimed written (it said "with 2 other columns")
    assert f"wrote {len(ref)} vectors of d=64 to" in out.stdout
    assert "(prompt_id, position) were not written" in out.stderr
    out = run("export", store, sql, "-o", tmp_path / "v.safetensors")
    assert out.returncode == 0 and "with 2 other columns" in out.stdout
    umask = os.umask(0)
    os.umask(umask)
    for name in ("v.parquet", "v.npy", "v.safetensors"):  # one mode for every format
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    bad = run("export", store, "SELECT layer FROM acts", "-o", tmp_path / "n.parquet")
    assert bad.returncode == 1 and "export needs a query selecting vec" in bad.stderr


def test_table_output_aligns_every_kind_of_value(store: Path) -> None:
    """The table format, written from Arrow: columns right-aligned to their widest cell,
    NULL for missing values, floats to 6 significant digits, lists and structs spelled out."""
    out = CliRunner().invoke(cli, ["query", str(store), """
        SELECT * FROM (VALUES
            (1, 0.1234567891::DOUBLE, [1.5, 2.0], {'token_id': 7, 'token': ' a'}, NULL),
            (22, 'NaN'::DOUBLE, [], NULL, 'x')) t(n, f, l, s, v)"""])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        " n        f          l                        s    v",
        " 1 0.123457 [1.5, 2.0] {token_id: 7, token: ␣a} NULL",
        "22      NaN         []                     NULL    x",
    ]
    empty = CliRunner().invoke(cli, ["query", str(store), "SELECT 1 AS a WHERE false"])
    assert empty.output == "(no rows) ['a']\n"


def test_table_output_of_times_intervals_and_maps_is_as_arrow_gives_them(store: Path) -> None:
    """Numbers and text are shown from DuckDB's Python values, anything else from Arrow as
    before: Python's values would drop a TIMESTAMP_NS's nanoseconds, and show an interval and a
    map otherwise than the csv and json output do (review finding)."""
    out = CliRunner().invoke(cli, ["query", str(store), """
        SELECT '2020-01-01 00:00:00.123456789'::TIMESTAMP_NS AS t, INTERVAL 1 DAY AS i,
               MAP {'a': 1} AS m, 7 AS n"""])
    assert out.exit_code == 0, out.output
    assert out.output.split("\n")[1].split() == ["2020-01-01", "00:00:00.123456789",
                                                 "[0,", "1,", "0]", "[[a,", "1]]", "7"]


def test_table_output_shows_whitespace_tokens(store: Path) -> None:
    out = CliRunner().invoke(cli, ["query", str(store), "SELECT ' Paris' AS token, "
                                   "'a\nb' AS t2, 'The capital of France' AS prose"])
    assert "␣Paris" in out.output and "a↵b" in out.output
    assert "The capital of France" in out.output  # prose keeps its spaces


def test_progress_lines_when_stderr_is_not_a_terminal_and_quiet(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is Paris.\nOne two three.\n")
    out = run_process("ingest", tmp_path / "a.actdb", "--model", model_dir("llama"),
                      "--prompts", prompts)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("ingest ")]
    assert lines and "tokens (100%)" in lines[-1] and "\r" not in out.stderr
    quiet = run("ingest", tmp_path / "b.actdb", "--model", model_dir("llama"), "--prompts",
                prompts, "-q")
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


@pytest.mark.slow
def test_ctrl_c_during_ingest_says_what_is_saved_and_exits_130(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prompts = tmp_path / "many.txt"
    # Far more prompts than an ingest finishes before its first commit is seen (about 100 of
    # them; 8,200 tokens/s on a quiet host ingests 4,000 in 10 s), so the interrupt lands
    # mid-ingest.
    n = 8000
    prompts.write_text("\n".join(f"{words[i % 12]} {words[(i * 7) % 12]} number {i} of many"
                                 for i in range(n)) + "\n")
    store = tmp_path / "s.actdb"
    proc = subprocess.Popen(
        [*ACTDB, "ingest", str(store), "--model", str(model_dir("llama")), "--prompts",
         str(prompts), "--batch-size", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        # A test run started in the background (`cmd &` without job control) ignores SIGINT,
        # and a child inherits that, as a user's Ctrl-C in a terminal never is: Python then
        # installs no KeyboardInterrupt handler. The child starts with the default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Interrupt once the first commit (every 2048 tokens, about 100 of these prompts) is
    # there for a reader to see, as readers see an ingest's commits while it writes. A look
    # a second: each costs the ingest's two cores a reader's start.
    deadline = time.monotonic() + 240
    while not (store / "catalog.duckdb").exists() or _saved(store) == 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no commit seen mid-ingest: {proc.communicate()[1][-2000:]}")
        time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    saved = _saved(store)
    assert saved < n
    assert f"interrupted: {saved} of {n} prompts are saved in {store}" in err
    assert "run the same command again to resume" in err
    with actdb.connect(store) as db:
        assert db.verify() == []


def test_ctrl_c_during_a_query_exits_130_and_is_a_keyboard_interrupt_in_python(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A query interrupted in DuckDB's own work, or inside a tensor function's UDF (which
    DuckDB wraps as an error), is KeyboardInterrupt in Python, never a QueryError that an
    `except QueryError` would swallow; the CLI says so and exits 130, as an ingest does."""
    endless = "SELECT count(*) FROM range(20000000000) t(i) WHERE i % 7 = 3"
    # Python's own Ctrl-C handler: a test run started in the background ignores SIGINT, and
    # interrupt_main then does nothing (a user's terminal always has the handler)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_in_python(store, endless, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, before)
    proc = subprocess.Popen(
        [*ACTDB, "query", str(store), endless], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3.0)  # the CLI started and the query runs (it never ends by itself)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and "Error" not in err


def _interrupted_in_python(store: Path, endless: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import _thread
    import dataclasses
    import threading

    from actdb.query import functions

    with actdb.connect(store) as db:
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            db.sql(endless).fetchall()
        timer.join()

        def interrupt(*args: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setitem(functions.REGISTRY, "vec_norm", dataclasses.replace(
            functions.REGISTRY["vec_norm"], kernel=interrupt))
        with pytest.raises(KeyboardInterrupt):
            db.sql("SELECT vec_norm(vec) FROM acts").fetchall()
        # an error that TRY() swallowed earlier in the query is not what the interrupt is
        with pytest.raises(KeyboardInterrupt):
            db.sql("SELECT TRY(cosine_to(vec, [1.0, 2.0])), vec_norm(vec) FROM acts").fetchall()
        assert db.sql("SELECT 42").fetchall() == [(42,)]  # the connection still works


def _saved(store: Path) -> int:
    with actdb.connect(store) as db:
        row = db.sql("SELECT count(DISTINCT prompt_id) FROM tokens").fetchone()
    return int(row[0]) if row else 0
